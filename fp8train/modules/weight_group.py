"""The weight casts of a compiled forward in one operator (delayed scaling; off by default,
GROUP_WEIGHT_CASTS below, docs/design.md "Grouped weight casts").

`fp8train.convert(model)` registers the converted Linears here and hooks `model`'s forward:
the pre-hook arms the group; in a torch.compile trace of the forward, the first traced
weight cast finds it armed and casts every eligible weight at once (ops.cast_weights: one
launch on CUDA, where one cast per Linear cost ~30 us of host each from Inductor's code),
leaving each cast in its layer's weight workspace (`WeightWorkspace.pending`), which the
layer's forward takes instead of casting; the post-hook disarms and drops what was not
taken. The cast happens inside the forward's trace: torch.compile(model) compiles each
hook as a frame of its own (torch 2.13 on the CPU), so a cast made in the pre-hook would
enter the forward's graph as three inputs per layer; the hooks only flip flags. Eager
forwards never read the slots (their casts run in the C++ node).

Eligible: a plain 2-D weight (not FSDP2's DTensor nor an FP8-gathered one) of a Linear
without tensor parallelism, cast by its calibrated DelayedScalingQuantizer for the active
recipe, without auto precision or CUDA-graph weight caching. Each member's cast is the
one it would make itself (same kernel math, same amax record); weights of another dtype
or device form their own group.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch
from torch import nn

from .. import ops
from ..autocast import active_recipe
from ..quantizer import Cast, DelayedScalingQuantizer
from ..recipe import DelayedScaling
from ..roles import TensorRole

# Off until a measurement shows the grouped step faster: on the H200 (2026-12-02, a slow host,
# 3 rounds) HF Llama h1024 compiled ran 27 fewer launches a step but level in wall time
# (docs/benchmarks.md). An A/B switch (hf_llama.py's "grouped" variant), not a user setting.
GROUP_WEIGHT_CASTS = False


class WeightCastGroup:
    """The converted Linears of one model, and the hooks on its forward."""

    def __init__(self):
        self.layers: List[nn.Module] = []
        # [0]: True from the model's pre-hook until the first traced weight cast of the
        # forward casts the group (or the post-hook ends the forward).
        self.armed: list = [False]
        self.filled: list = [False]  # [0]: casts left in the slots since the last post-hook

    @classmethod
    def of(cls, model: nn.Module) -> "WeightCastGroup":
        """The group hooked on `model`, made and hooked on first use."""
        group = model.__dict__.get("_fp8train_weight_casts")
        if group is None:
            group = cls()
            model.__dict__["_fp8train_weight_casts"] = group
            model.register_forward_pre_hook(group.before_forward)
            model.register_forward_hook(group.after_forward)
        return group

    def add(self, layer: nn.Module) -> None:
        if not any(existing is layer for existing in self.layers):
            self.layers.append(layer)
            layer._workspace.group = self

    def before_forward(self, module, args) -> None:
        if GROUP_WEIGHT_CASTS:
            self.armed[0] = True

    def after_forward(self, module, args, output) -> None:
        if self.armed[0]:
            self.armed[0] = False
        if self.filled[0]:  # (every forward of a converted model runs this: two reads when idle)
            self.filled[0] = False
            for layer in self.layers:
                slot = layer._workspace.pending
                if slot[0] is not None:
                    slot[0] = None

    def cast_all(self) -> None:
        """In a trace, the forward's first traced weight cast while armed: cast every
        eligible weight in one operator per (dtype, device, FP8 format) and leave each cast in
        its layer's workspace (`pending`)."""
        self.armed[0] = False
        recipe = active_recipe()
        if type(recipe) is not DelayedScaling or recipe.auto_precision:
            return
        transpose = torch.is_grad_enabled()  # the dgrad GEMM's W^T (a member that needs none ignores it)
        groups: Dict[Tuple, list] = {}
        for layer in self.layers:
            q = _quantizer_if_eligible(layer, recipe)
            if q is not None:
                w = layer.weight
                groups.setdefault((w.dtype, w.device, q.dtype), []).append((layer, w, q))
        for (_, _, fp8_dtype), members in groups.items():
            if len(members) < 2:
                continue  # its own cast is as cheap
            casts = ops.cast_weights([w for _, w, _ in members], [q.scaling_state() for _, _, q in members],
                                     fp8_dtype, transpose)
            for (layer, _, _), cast in zip(members, casts):
                layer._workspace.pending[0] = Cast(*cast)
            self.filled[0] = True


def _quantizer_if_eligible(layer, recipe):
    """layer's weight quantizer where the group may cast its weight (module docstring), else None."""
    w = layer.weight
    if layer.tp is not None or layer.weight_cast_skip is not None or not layer._fp8_dims \
            or type(w) not in (nn.Parameter, torch.Tensor) or w.dim() != 2 or not w.is_contiguous():
        return None
    q = getattr(layer, "weight_quantizer", None)
    if type(q) is not DelayedScalingQuantizer or not q.calibrated or not q.matches(recipe, TensorRole.WEIGHT):
        return None
    return q
