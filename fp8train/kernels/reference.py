"""Pure-torch twins of every Triton kernel: the specification the kernels must match.

Each function has the exact signature and in-place contract of its Triton counterpart in
kernels/__init__.py. On CPU these are what runs; on the GPU the tests compare the Triton
kernels against them bit for bit. Scale conventions: see fp8train/scaling.py.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .. import scaling


def abs_max(x: torch.Tensor) -> torch.Tensor:
    """max |x| as float32, with NaN counted as +inf (so a NaN can never hide in an amax)."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    a = x.detach().float().abs()
    return torch.where(torch.isnan(a), torch.inf, a).max()


def amax(x: torch.Tensor, amax_out: torch.Tensor) -> None:
    """amax_out (0-dim float32) <- max(amax_out, abs_max(x))."""
    amax_out.copy_(torch.maximum(amax_out, abs_max(x)))


def resolve_scale(scale, from_amax, nonfinite_count, fp8_max, power_of_two: bool = False) -> torch.Tensor:
    """The scale a cast uses: `scale`, or with from_amax (current scaling) first rewritten as
    compute_scale(from_amax, scale, power_of_two=power_of_two) and a non-finite from_amax
    counted; returns it. power_of_two matters only with from_amax (a given scale is used as is)."""
    if from_amax is None:
        return scale
    # Current scaling: the scale comes from this tensor's own amax; `scale` holds the last one.
    scale.copy_(scaling.compute_scale(from_amax, scale, fp8_max, power_of_two=power_of_two))
    if nonfinite_count is not None:
        nonfinite_count.add_((~torch.isfinite(from_amax)).to(nonfinite_count.dtype))
    return scale


def saturating_cast(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The cast every kernel reproduces: round-to-nearest-even, saturating, NaN stays NaN."""
    m = scaling.fp8_max(dtype)
    return x.float().mul(scale).clamp(-m, m).to(dtype)


def skipped(skip: torch.Tensor) -> bool:
    """Whether a skippable cast's () int32 flag says "do nothing" (nonzero). The kernels
    read the flag on the device; the twins read it here (a sync on CUDA tensors)."""
    return bool(skip.item())


def cast_amax(x: torch.Tensor, out: torch.Tensor, scale: torch.Tensor, scale_inv_out: torch.Tensor,
              amax_out: Optional[torch.Tensor] = None, from_amax: Optional[torch.Tensor] = None,
              nonfinite_count: Optional[torch.Tensor] = None, dbias_out: Optional[torch.Tensor] = None,
              power_of_two: bool = False) -> None:
    """Cast x into `out` (same shape, fp8) and write `scale_inv_out = 1 / scale`.

    scale            () float32; read, or with `from_amax` first set to
                     compute_scale(from_amax, scale) (current scaling)
    power_of_two     with from_amax: that scale rounded down to a power of two (scaling.py)
    amax_out         () float32 or None; max-accumulates abs_max(x) (delayed scaling history[0])
    nonfinite_count  () int32 or None; +1 when `from_amax` is inf/NaN
    dbias_out        (N,) float32 or None; the column sums of x's rows (N = x.shape[-1]) in
                     float32: the bias gradient when x is a grad-output. The GPU sums in
                     another order (tiles, then their partial sums): equal within float32
                     rounding, not bit for bit.
    """
    s = resolve_scale(scale, from_amax, nonfinite_count, scaling.fp8_max(out.dtype), power_of_two)
    out.copy_(saturating_cast(x, s, out.dtype))
    scale_inv_out.copy_(scaling.scale_inverse(s))
    if amax_out is not None:
        amax(x, amax_out)
    if dbias_out is not None:
        cols = x.shape[-1] if x.dim() else 1
        dbias_out.copy_(x.detach().reshape(-1, cols).float().sum(0))


def cast_transpose_amax(x: torch.Tensor, out: torch.Tensor, out_t: torch.Tensor, scale: torch.Tensor,
                        scale_inv_out: torch.Tensor, amax_out: Optional[torch.Tensor] = None,
                        from_amax: Optional[torch.Tensor] = None,
                        nonfinite_count: Optional[torch.Tensor] = None,
                        dbias_out: Optional[torch.Tensor] = None, power_of_two: bool = False) -> None:
    """`cast_amax` of a 2-D x (M, N) that also writes the transposed copy.

    out    (M, N) fp8 row-major
    out_t  (N, Mp) fp8 row-major with Mp >= M: out_t[:, :M] = out.T, out_t[:, M:] = 0
           (the zero columns pad the wgrad GEMM's reduction dim to a multiple of 16)
    """
    s = resolve_scale(scale, from_amax, nonfinite_count, scaling.fp8_max(out.dtype), power_of_two)
    q = saturating_cast(x, s, out.dtype)
    out.copy_(q)
    m = x.shape[0]
    out_t[:, :m].copy_(q.t())
    out_t[:, m:].view(torch.uint8).zero_()
    scale_inv_out.copy_(scaling.scale_inverse(s))
    if amax_out is not None:
        amax(x, amax_out)
    if dbias_out is not None:
        dbias_out.copy_(x.detach().float().sum(0))


def scale_update(histories: Sequence[torch.Tensor], scales: Sequence[torch.Tensor],
                 counts: Sequence[torch.Tensor], fp8_maxes: Sequence[float], algo: str, margin: int,
                 power_of_two: bool = False) -> None:
    """The per-step delayed-scaling update of many quantizers, in place (scaling.delayed_update)."""
    for history, scale, count, m in zip(histories, scales, counts, fp8_maxes):
        h, s, c = scaling.delayed_update(history, scale, count, m, algo, margin, power_of_two)
        history.copy_(h)
        scale.copy_(s)
        count.copy_(c)
