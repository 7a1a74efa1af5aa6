"""The quantizer a recipe or a checkpoint calls for (quantizer.py's kinds and block_quantizer.py's)."""
from __future__ import annotations

from . import scaling
from .block_quantizer import BlockScalingQuantizer
from .quantizer import CurrentScalingQuantizer, DelayedScalingQuantizer, Quantizer
from .recipe import BlockScaling, DelayedScaling, Recipe
from .roles import TensorRole


def make_quantizer(recipe: Recipe, role: TensorRole, device=None) -> Quantizer:
    dtype = recipe.fp8_format.dtype(role)
    pow2 = recipe.power_of_two_scales
    if isinstance(recipe, DelayedScaling):
        return DelayedScalingQuantizer(role, dtype, recipe.amax_history_len, recipe.amax_compute_algo,
                                       recipe.margin, device=device, power_of_two=pow2)
    if isinstance(recipe, BlockScaling):
        return BlockScalingQuantizer(role, dtype, device=device, power_of_two=pow2)
    return CurrentScalingQuantizer(role, dtype, device=device, power_of_two=pow2)


def quantizer_from_state(role: TensorRole, state: dict, device=None) -> Quantizer:
    """An empty quantizer shaped like a saved one (its buffers are then loaded into it):
    delayed scaling saves an amax history, current scaling an amax, block scaling neither."""
    dtype = scaling.fp8_dtype_of_max(float(state["fp8_max"]))
    if "amax_history" in state:
        return DelayedScalingQuantizer(role, dtype, state["amax_history"].shape[0], device=device)
    if "amax" in state:
        return CurrentScalingQuantizer(role, dtype, device=device)
    return BlockScalingQuantizer(role, dtype, device=device)
