"""The normalization in front of LayerNormLinear / LayerNormMLP: its parameters, its high-
precision form (outside autocast) and its fused FP8 forward and backward (inside)."""
from __future__ import annotations

import math
from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels, ops
from ..kernels import replay
from ..quantizer import Cast, Quantizer

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


def check_norm_args(owner: str, normalization: str, eps) -> None:
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"{owner}: normalization must be one of {NORMALIZATIONS}, got {normalization!r}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"{owner}: eps must be a finite number >= 0, got {eps!r}")


def make_norm_params(module: nn.Module, size: int, normalization: str, factory: dict) -> None:
    """Register layer_norm_weight (gamma, ones) and, for LayerNorm, layer_norm_bias (beta,
    zeros) on `module` (names as in TransformerEngine, so checkpoints map one to one)."""
    module.layer_norm_weight = nn.Parameter(torch.ones(size, **factory))
    if normalization == "LayerNorm":
        module.layer_norm_bias = nn.Parameter(torch.zeros(size, **factory))
    else:
        module.register_parameter("layer_norm_bias", None)


def norm_high_precision(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], normalization: str,
                        eps: float) -> torch.Tensor:
    """What torch.nn.LayerNorm / torch.nn.RMSNorm compute (the layer outside autocast)."""
    if normalization == "LayerNorm":
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def norm_high_precision_in(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], normalization: str,
                           eps: float) -> torch.Tensor:
    """The norm of a layer's high-precision path inside fp8train.autocast, where input and
    parameters may differ in dtype (float32 master weights, bf16 activations; torch's CUDA
    kernels refuse the mix): computed in the wider of the two, as torch.autocast runs norms in
    float32, and returned in x's dtype, as the norm modules return it. One dtype: exactly
    norm_high_precision."""
    wide = torch.promote_types(x.dtype, weight.dtype)
    if wide == x.dtype and wide == weight.dtype:
        return norm_high_precision(x, weight, bias, normalization, eps)
    ln = norm_high_precision(x.to(wide), weight.to(wide), None if bias is None else bias.to(wide), normalization, eps)
    return ln.to(x.dtype)


def norm_fp8(x2: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], layer: bool, eps: float,
             q: Quantizer, transpose: bool, want_y: bool, amax_hook: Optional[Callable[[torch.Tensor], None]] = None,
             found: Optional[list] = None
             ) -> Tuple[Cast, Optional[torch.Tensor], torch.Tensor, Optional[torch.Tensor]]:
    """Normalize x2 (M, K) straight into FP8 with quantizer q (current scaling: a statistics
    pass that also takes the amax, then the cast; delayed: one launch).

    Returns (cast, mean (M,) float32 or None for RMSNorm, rstd (M,) float32, y) where y is
    the high-precision normalized output in x2's dtype, written only when want_y.
    amax_hook: Quantizer.produce's hook on the statistics pass's amax (sequence parallelism:
    the group's all-reduce, so every rank's rows are cast with one scale).
    found: a list that gets the launch group that ran or was built (kernels/replay.py), or None.
    """
    if torch.compiler.is_compiling():  # traced code: the same kernels as a custom op (fp8train/ops.py)
        if amax_hook is not None:
            raise RuntimeError("norm_fp8: a group-consistent (tensor-parallel) norm cannot run inside a "
                               "torch.compile trace; run tensor-parallel fused modules eagerly")
        parts, mean, rstd, y = ops.norm_fwd_fp8(x2, weight, bias, layer, eps, q.dtype, q.scaling_state(), transpose,
                                                want_y)
        return Cast(*parts), mean, rstd, y
    m, k = x2.shape
    mean = torch.empty(m, dtype=torch.float32, device=x2.device) if layer else None
    rstd = torch.empty(m, dtype=torch.float32, device=x2.device)
    out = q.allocate((m, k), x2.device, transpose=transpose)
    y = torch.empty_like(x2) if want_y else None

    def first_pass(amax_out):
        kernels.norm_stats(x2, weight, bias, eps, mean, rstd, amax_out)

    def cast(scale, amax_out, from_amax, count, power_of_two):
        kernels.norm_fwd_fp8(x2, weight, bias, eps, mean, rstd, out.data, out.data_t, scale, out.scale_inv,
                             amax_out, from_amax, count, y, stats_ready=from_amax is not None,
                             power_of_two=power_of_two)

    # Steady state (delayed scaling, no group all-reduce): the launches replayed from C++
    key = ("norm_fwd", x2.shape, x2.stride(), x2.dtype, weight.dtype, None if bias is None else bias.dtype, layer,
           eps, transpose, want_y, x2.device.index)
    group = replay.run(q._prepared, key, (x2, weight, bias, mean, rstd, out.data, out.data_t, out.scale_inv, y),
                       None if amax_hook is not None else q.replay_fixed(),
                       lambda: q.produce(first_pass, cast, amax_hook))
    if found is not None:
        found.append(group)
    return out, mean, rstd, y


def norm_forward(x2: torch.Tensor, weight: torch.Tensor, eps: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """(rstd (M,) float32, y (M, K) in x2's dtype) of an RMSNorm without a cast
    (kernels.norm_fwd), replayed from C++ in the steady state like norm_backward."""
    m = x2.shape[0]
    rstd = torch.empty(m, dtype=torch.float32, device=x2.device)
    y = torch.empty_like(x2)
    key = ("norm_fwd_y", x2.shape, x2.stride(), x2.dtype, weight.dtype, eps, x2.device.index)
    replay.run(_FWD_GROUPS, key, (x2, weight, rstd, y), (),
               lambda: kernels.norm_fwd(x2, weight, None, eps, None, rstd, y))
    return rstd, y


def norm_backward(d_norm: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  mean: Optional[torch.Tensor], rstd: torch.Tensor, need_dx: bool,
                  param_grad_dtype: Optional[torch.dtype] = None, found: Optional[list] = None
                  ) -> Tuple[Optional[torch.Tensor], torch.Tensor, Optional[torch.Tensor]]:
    """(dx (M, K) in x2's dtype or None, dweight, dbias or None) of the normalization.
    dweight / dbias come in the parameters' dtype, or in param_grad_dtype when given (float32
    partial sums that sequence parallelism still reduces over the group)."""
    if torch.compiler.is_compiling():  # traced code: the same kernel as a custom op (fp8train/ops.py)
        if param_grad_dtype is not None:
            raise RuntimeError("norm_backward: param_grad_dtype (tensor-parallel) is not supported inside a "
                               "torch.compile trace")
        dx, dweight, dbias = ops.norm_bwd(d_norm, x2, weight, bias, mean, rstd)
        return (dx if need_dx else None), dweight, dbias
    dx = torch.empty_like(x2)
    dweight = torch.empty_like(weight, dtype=param_grad_dtype)
    dbias = torch.empty_like(bias, dtype=param_grad_dtype) if bias is not None else None
    key = ("norm_bwd", x2.shape, x2.stride(), d_norm.stride(), x2.dtype, d_norm.dtype, weight.dtype, mean is None,
           dweight.dtype, None if dbias is None else dbias.dtype, x2.device.index)
    group = replay.run(_BWD_GROUPS, key, (d_norm, x2, weight, mean, rstd, dx, dweight, dbias), (),
                       lambda: kernels.norm_bwd(d_norm, x2, weight, mean, rstd, dx, dweight, dbias))
    if found is not None:
        found.append(group)
    return (dx if need_dx else None), dweight, dbias


# The norm backward's and the uncast forward's launch groups (kernels/replay.py); they point
# at no fixed buffer, so they outlive any layer. A few entries per model (one per shape and
# dtype combination).
_BWD_GROUPS: dict = {}
_FWD_GROUPS: dict = {}


__all__ = ["NORMALIZATIONS", "check_norm_args", "make_norm_params", "norm_high_precision", "norm_high_precision_in",
           "norm_fp8", "norm_forward", "norm_backward"]
