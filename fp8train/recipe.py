"""FP8 recipes: frozen, validated descriptions of how a model is quantized.

A recipe says which FP8 format each tensor role uses, how its scale is chosen and how each
GEMM accumulates. It holds no state: scaling state lives in quantizers (quantizer.py).
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Literal, Union

import torch

from .roles import GemmRole, TensorRole


class Format(enum.Enum):
    """FP8 formats per role.

    E4M3    e4m3 for inputs, weights and gradients.
    HYBRID  e4m3 forward (inputs, weights), e5m2 for gradients, whose range matters more
            than their precision.
    """

    E4M3 = "e4m3"
    HYBRID = "hybrid"

    def dtype(self, role: TensorRole) -> torch.dtype:
        if self is Format.HYBRID and role is TensorRole.GRAD_OUTPUT:
            return torch.float8_e5m2
        return torch.float8_e4m3fn


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """Accumulation precision per GEMM role, always explicit.

    cuBLAS "fast accumulation" keeps the FP8 tensor-core partial sums in reduced precision:
    fine for the forward pass, measurably worse for the long reductions of dgrad/wgrad.
    """

    fprop_fast_accum: bool = True
    dgrad_fast_accum: bool = False
    wgrad_fast_accum: bool = False

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, bool):
                raise ValueError(f"GemmConfig.{field.name} must be a bool, got {value!r}")

    def fast_accum(self, role: GemmRole) -> bool:
        return getattr(self, _FAST_ACCUM_FIELD[role])


_FAST_ACCUM_FIELD = {role: f"{role.value}_fast_accum" for role in GemmRole}


def _check_format(owner: str, fmt) -> None:
    if not isinstance(fmt, Format):
        raise ValueError(f"{owner}.fp8_format must be a fp8train.Format (E4M3 or HYBRID), got {fmt!r}")


def _check_bool(owner: str, field: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{owner}.{field} must be a bool (True or False), got {value!r}")


def _check_gemm(owner: str, gemm) -> None:
    if not isinstance(gemm, GemmConfig):
        raise ValueError(f"{owner}.gemm must be a fp8train.GemmConfig, got {gemm!r}")


AMAX_COMPUTE_ALGOS = ("max", "most_recent")


@dataclasses.dataclass(frozen=True)
class DelayedScaling:
    """Scale from the amax history of earlier steps: the cast is a single pass.

    Each cast records its tensor's amax; once per step (at the next `fp8train.autocast`
    entry) every quantizer's history is rolled and its scale recomputed in one launch:
    scale = fp8_max / amax / 2**margin, amax being the history's max ("max") or its newest
    entry ("most_recent"). A quantizer's very first cast has no history yet and uses the
    tensor's own amax (current scaling) once.

    auto_precision: run each layer's GEMMs in FP8 only where a measured table says FP8 is
    faster for its shapes on this GPU, else in high precision (fp8train/precision.py).

    power_of_two_scales: round every scale computed from an amax down to a power of two
    (scaling.compute_scale), as DeepSeek-V3 and torchao's rowwise recipe do: multiplying by
    the scale or by scale_inv then only moves exponents, so no rounding error enters through
    the scale. The price: up to one binade of the FP8 range's top stays unused (the amax maps
    into (fp8_max / 2, fp8_max] instead of onto fp8_max).
    """

    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: Literal["max", "most_recent"] = "max"
    margin: int = 0
    gemm: GemmConfig = GemmConfig()
    auto_precision: bool = False
    power_of_two_scales: bool = False

    def __post_init__(self):
        _check_format("DelayedScaling", self.fp8_format)
        _check_gemm("DelayedScaling", self.gemm)
        _check_bool("DelayedScaling", "auto_precision", self.auto_precision)
        _check_bool("DelayedScaling", "power_of_two_scales", self.power_of_two_scales)
        n = self.amax_history_len
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 65536:
            raise ValueError(f"DelayedScaling.amax_history_len must be an int in [1, 65536], got {n!r}")
        if self.amax_compute_algo not in AMAX_COMPUTE_ALGOS:
            raise ValueError(
                f"DelayedScaling.amax_compute_algo must be one of {AMAX_COMPUTE_ALGOS}, "
                f"got {self.amax_compute_algo!r}"
            )
        m = self.margin
        if isinstance(m, bool) or not isinstance(m, int) or not 0 <= m <= 64:
            raise ValueError(f"DelayedScaling.margin must be an int in [0, 64], got {m!r}")


@dataclasses.dataclass(frozen=True)
class CurrentScaling:
    """Scale from the amax of the tensor being cast (an amax pass, then the cast: one launch).

    auto_precision, power_of_two_scales: as for DelayedScaling.
    """

    fp8_format: Format = Format.HYBRID
    gemm: GemmConfig = GemmConfig()
    auto_precision: bool = False
    power_of_two_scales: bool = False

    def __post_init__(self):
        _check_format("CurrentScaling", self.fp8_format)
        _check_gemm("CurrentScaling", self.gemm)
        _check_bool("CurrentScaling", "auto_precision", self.auto_precision)
        _check_bool("CurrentScaling", "power_of_two_scales", self.power_of_two_scales)


# Every GEMM of block scaling promotes to FP32 per 128-wide slice of the reduction dim: the
# scales are applied there, so there is no "fast accumulation" to choose.
_PROMOTED = GemmConfig(fprop_fast_accum=False, dgrad_fast_accum=False, wgrad_fast_accum=False)


@dataclasses.dataclass(frozen=True)
class BlockScaling:
    """One scale per block of each tensor, from the block's own amax (DeepSeek-V3's
    fine-grained scaling): 1 x 128 blocks for inputs and gradients, 128 x 128 tiles for
    weights, 128 always along the GEMM's reduction dim; each GEMM sums every 128-wide slice
    of that dim in float32, multiplies it by its two blocks' scales and accumulates the
    slices in float32 ("FP32 promotion"; `gemm` is fixed to no fast accumulation).
    docs/design.md, "Block scaling", has the blocks of each GEMM. Like current scaling it has
    no state: no amax history, nothing in the state_dict but the FP8 format.

    fp8_format: E4M3 by default (every role in e4m3, as DeepSeek-V3 trains), unlike the
    other recipes' HYBRID: the GPU's blockwise GEMM (torch.nn.functional.scaled_mm's
    BlockWise1x128 / BlockWise128x128, cuBLASLt on Hopper) takes e4m3 operands only. HYBRID
    (e5m2 gradients) runs on the CPU's emulated GEMMs; on CUDA its layers refuse to run.

    power_of_two_scales: as for DelayedScaling, per block (kernels/block_reference.py).

    stack_siblings: in compiled calls, sibling fp8train.Linears tied on one input (attention's
    q/k/v, an MLP's gate/up: docs/design.md, "Shared inputs"), each out_features a multiple of
    128, run as one GEMM each way, their weights stacked (modules/stacked.py; eager calls
    stack only with modules.stacked.EAGER on): the same tiles and blocks,
    so the same FP8 bytes; the first sibling's call computes the others' outputs, which are
    then column slices of one (..., sum of out_features) tensor (strided views, the last dim
    contiguous, as a fused QKV projection's split: `.view` may split the last dim, not merge
    it with others). True, the default: HF Llama compiled steps 0.92x (h1024) and 0.96x
    (h2048) of the siblings apart (docs/benchmarks.md, N2). False: each sibling runs its own
    GEMMs and returns a contiguous tensor.

    fp8_wgrad: True (the default), the wgrad GEMM in FP8 too, both operands in 1 x 128 blocks
    along the tokens: each layer's input and output gradient cast a second time, transposed
    (the two-way casts). False, the wgrad runs in the activations' dtype (as
    TransformerEngine's override_linear_precision does), from X and dY themselves: one cast
    each (1 x 128 along the features), X kept in the activations' dtype for the backward
    instead of its transposed FP8 copy. Where the block wgrad saves little over BF16's (at
    HF Llama h1024 it took 1.03x BF16's time, docs/benchmarks.md) the transposed casts cost
    more than it saves. So far on the Python node only (the C++ node's block path has an FP8
    wgrad only); the gated MLP's and RMSNorm's fused casts keep their computed values for it.

    Taken by fp8train.Linear (and so by fp8train.convert's layers), LayerNormLinear and
    LayerNormMLP without tensor parallelism, eagerly and under torch.compile; tensor
    parallelism, CUDA graphs, FSDP2's fp8_all_gather and ONNX export refuse it with an error
    that says so.
    """

    fp8_format: Format = Format.E4M3
    power_of_two_scales: bool = False
    stack_siblings: bool = True
    fp8_wgrad: bool = True

    def __post_init__(self):
        _check_format("BlockScaling", self.fp8_format)
        _check_bool("BlockScaling", "power_of_two_scales", self.power_of_two_scales)
        _check_bool("BlockScaling", "stack_siblings", self.stack_siblings)
        _check_bool("BlockScaling", "fp8_wgrad", self.fp8_wgrad)

    @property
    def gemm(self) -> GemmConfig:
        """FP32 promotion in every GEMM: no fast accumulation (not a field: not a choice)."""
        return _PROMOTED

    # Auto precision measures FP8 against high precision per layer; not for block scaling yet.
    auto_precision = False


Recipe = Union[DelayedScaling, CurrentScaling, BlockScaling]


def default_recipe() -> Recipe:
    """The recipe of `fp8train.autocast()` and `make_graphed_callables` when none is given.
    CurrentScaling: on HF Llama (docs/benchmarks.md, N1) it was level with torchao's tensorwise
    scaling in validation loss where DelayedScaling trailed it by ~0.5% over 15 runs; delayed
    scaling's single-pass casts are the faster step, taken by asking for it."""
    return CurrentScaling()


def check_recipe(recipe) -> Recipe:
    if not isinstance(recipe, (DelayedScaling, CurrentScaling, BlockScaling)):
        raise ValueError(
            "recipe must be fp8train.DelayedScaling, fp8train.CurrentScaling or fp8train.BlockScaling, "
            f"got {recipe!r}"
        )
    return recipe
