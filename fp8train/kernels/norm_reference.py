"""Pure-torch twins of the fused LayerNorm / RMSNorm kernels in `norm.py`: the specification.

Each function has the exact signature and in-place contract of its Triton counterpart; on
CPU these are what runs, on the GPU the tests compare the kernels against them (within
float32 tolerances: the kernels sum in another order). Scale conventions: fp8train/scaling.py.

Note: one normalization, two flavours, chosen by `mean_out` / `mean`:
  LayerNorm (mean given)   mean = sum(x) / K,  var = sum((x - mean)^2) / K  (biased)
                           y = (x - mean) * rstd * weight + bias,  rstd = 1 / sqrt(var + eps)
                           (* weight + bias: one fused multiply-add, see `normalize`)
  RMSNorm   (mean None)    y = x * rstd * weight,  rstd = 1 / sqrt(sum(x^2) / K + eps); no bias
All arithmetic is float32 whatever the input dtypes; y is float32 until it is stored.

Note: the FP8 output is the saturating cast of the float32 y (not of y rounded to x.dtype),
and the amax is that of the float32 y, NaN counted as +inf (reference.abs_max).

The argument checks live here too, so that the twin (the CPU path) and the Triton wrapper
refuse exactly the same inputs with the same messages.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .. import scaling
from . import reference
from .checks import check_scalar, check_scales
from .activation_reference import fma

_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


# --------------------------------------------------------------------------- the math


def row_stats(x: torch.Tensor, eps: float, layer: bool):
    """(mean or None, rstd) of each row of x (M, K), float32 (M,) each."""
    xf = x.float()
    if layer:
        mean = xf.mean(dim=1)
        var = (xf - mean[:, None]).square().mean(dim=1)
        return mean, torch.rsqrt(var + eps)
    return None, torch.rsqrt(xf.square().mean(dim=1) + eps)


def normalize(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
              mean: Optional[torch.Tensor], rstd: torch.Tensor) -> torch.Tensor:
    """y (M, K) float32 = (x - mean) * rstd * weight + bias, evaluated in exactly this order,
    with `* weight + bias` one fused multiply-add (one rounding, as the kernel's tl.math.fma).

    Two roundings there would leave the kernel, whose compiler fuses that multiply-add
    anyway, up to an ulp of xhat * weight away from the twin, which is many ulps of a y
    that bias nearly cancels (a byte 3 fp8 steps off in the GPU tests of 2026-11-29).
    """
    xf = x.float()
    xhat = (xf - mean[:, None]) * rstd[:, None] if mean is not None else xf * rstd[:, None]
    if bias is None:
        return xhat * weight.float()
    return fma(xhat, weight.float(), bias.float())


# --------------------------------------------------------------------------- the twins


def norm_stats(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float,
               mean_out: Optional[torch.Tensor], rstd_out: torch.Tensor,
               amax_out: Optional[torch.Tensor] = None) -> None:
    """Row statistics of x, and optionally the amax of y (current scaling's first pass).

    x         (M, K) bf16/fp16/fp32, unit column stride, any row stride
    weight    (K,) gamma; bias (K,) beta or None (LayerNorm only); any of bf16/fp16/fp32
    mean_out  (M,) float32, written; None selects RMSNorm
    rstd_out  (M,) float32, written
    amax_out  () float32 or None; max-accumulates abs_max(y) (y itself is not written)
    """
    check_stats_args("norm_stats", x, weight, bias, eps, mean_out, rstd_out, amax_out)
    mean, rstd = row_stats(x, eps, layer=mean_out is not None)
    if mean_out is not None:
        mean_out.copy_(mean)
    rstd_out.copy_(rstd)
    if amax_out is not None:
        reference.amax(normalize(x, weight, bias, mean, rstd), amax_out)


def norm_fwd_fp8(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float,
                 mean_out: Optional[torch.Tensor], rstd_out: torch.Tensor, out: torch.Tensor,
                 out_t: Optional[torch.Tensor], scale: torch.Tensor, scale_inv_out: torch.Tensor,
                 amax_out: Optional[torch.Tensor] = None, from_amax: Optional[torch.Tensor] = None,
                 nonfinite_count: Optional[torch.Tensor] = None, y_out: Optional[torch.Tensor] = None,
                 stats_ready: bool = False, power_of_two: bool = False) -> None:
    """LayerNorm / RMSNorm forward straight into FP8 (+ transposed copy), with the amax.

    x, weight, bias, eps, mean_out, rstd_out as in `norm_stats`; with `stats_ready` the row
    statistics are read from mean_out / rstd_out (written by `norm_stats`), otherwise they
    are computed and written there (the backward pass needs them).
    out              (M, K) fp8 row-major: saturating_cast(y, scale)
    out_t            (K, Mp) fp8 row-major or None, Mp >= M: out_t[:, :M] = out.T, out_t[:, M:] = 0
    scale, scale_inv_out, amax_out, from_amax, nonfinite_count, power_of_two
                     exactly as in reference.cast_amax, with y as the tensor cast
    y_out            (M, K) in x.dtype or None: y rounded to x.dtype, written only when given

    Delayed scaling: one call. Current scaling: norm_stats(..., amax_out=a), then
    norm_fwd_fp8(..., from_amax=a, stats_ready=True).
    """
    check_fwd_args("norm_fwd_fp8", x, weight, bias, eps, mean_out, rstd_out, out, out_t, scale, scale_inv_out,
                   amax_out, from_amax, nonfinite_count, y_out)
    if stats_ready:
        mean, rstd = mean_out, rstd_out
    else:
        mean, rstd = row_stats(x, eps, layer=mean_out is not None)
        if mean_out is not None:
            mean_out.copy_(mean)
        rstd_out.copy_(rstd)
    y = normalize(x, weight, bias, mean, rstd)  # (M, K) float32
    s = reference.resolve_scale(scale, from_amax, nonfinite_count, scaling.fp8_max(out.dtype), power_of_two)
    q = reference.saturating_cast(y, s, out.dtype)
    out.copy_(q)
    if out_t is not None:
        m = x.shape[0]
        out_t[:, :m].copy_(q.t())
        out_t[:, m:].view(torch.uint8).zero_()
    scale_inv_out.copy_(scaling.scale_inverse(s))
    if amax_out is not None:
        reference.amax(y, amax_out)
    if y_out is not None:
        y_out.copy_(y)


def norm_fwd(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float,
             mean_out: Optional[torch.Tensor], rstd_out: torch.Tensor, y_out: torch.Tensor) -> None:
    """LayerNorm / RMSNorm forward in high precision alone: norm_fwd_fp8's statistics and y
    without the cast (a norm whose output no FP8 layer reads through it yet).

    x, weight, bias, eps, mean_out, rstd_out as in `norm_stats` (statistics written);
    y_out (M, K) in x.dtype: y rounded to x.dtype.
    """
    check_stats_args("norm_fwd", x, weight, bias, eps, mean_out, rstd_out, None)
    check_y_out("norm_fwd", x, y_out)
    mean, rstd = row_stats(x, eps, layer=mean_out is not None)
    if mean_out is not None:
        mean_out.copy_(mean)
    rstd_out.copy_(rstd)
    y_out.copy_(normalize(x, weight, bias, mean, rstd))


def norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mean: Optional[torch.Tensor],
             rstd: torch.Tensor, dx_out: torch.Tensor, dweight_out: torch.Tensor,
             dbias_out: Optional[torch.Tensor] = None) -> None:
    """Gradients of LayerNorm (mean given) / RMSNorm (mean None) from the saved row statistics.

    dy           (M, K) bf16/fp16/fp32, unit column stride;  x as in the forward
    mean, rstd   (M,) float32 from the forward (mean None: RMSNorm)
    dx_out       (M, K) in x.dtype, contiguous
    dweight_out  (K,) any of bf16/fp16/fp32; dbias_out (K,) likewise or None (LayerNorm only)

        xhat = (x - mean) * rstd  (RMSNorm: x * rstd),  g = dy * weight
        dx   = (g - mean_K(g) - xhat * mean_K(g * xhat)) * rstd   (RMSNorm: no mean_K(g) term)
        dweight = sum_M(dy * xhat),  dbias = sum_M(dy)             all in float32
    """
    check_bwd_args("norm_bwd", dy, x, weight, mean, rstd, dx_out, dweight_out, dbias_out)
    xf, dyf = x.float(), dy.float()
    xhat = (xf - mean[:, None]) * rstd[:, None] if mean is not None else xf * rstd[:, None]
    g = dyf * weight.float()
    c2 = (g * xhat).mean(dim=1)
    if mean is not None:
        dx = (g - g.mean(dim=1)[:, None] - xhat * c2[:, None]) * rstd[:, None]
    else:
        dx = (g - xhat * c2[:, None]) * rstd[:, None]
    dx_out.copy_(dx)
    dweight_out.copy_((dyf * xhat).sum(dim=0))
    if dbias_out is not None:
        dbias_out.copy_(dyf.sum(dim=0))


# --------------------------------------------------------------------------- argument checks


def check_stats_args(fn, x, weight, bias, eps, mean_out, rstd_out, amax_out) -> None:
    """The checks of norm_stats (and the shared part of norm_fwd_fp8), raising ValueError."""
    _check_rows(fn, "x", x)
    m, k = x.shape
    dev = x.device
    _check_vector(fn, "weight", weight, k, _INPUT_DTYPES, dev)
    if bias is not None:
        _check_vector(fn, "bias", bias, k, _INPUT_DTYPES, dev)
    if bias is not None and mean_out is None:
        raise ValueError(f"{fn}: bias is given but mean_out is None (RMSNorm has no bias); pass mean_out "
                         "for LayerNorm, or bias=None")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0.0 <= eps < float("inf"):
        raise ValueError(f"{fn}: eps must be a finite Python number >= 0; got {eps!r}")
    if mean_out is not None:
        _check_vector(fn, "mean_out", mean_out, m, (torch.float32,), dev)
    _check_vector(fn, "rstd_out", rstd_out, m, (torch.float32,), dev)
    if amax_out is not None:
        check_scalar(fn, "amax_out", amax_out, torch.float32, dev)


def check_fwd_args(fn, x, weight, bias, eps, mean_out, rstd_out, out, out_t, scale, scale_inv_out,
                   amax_out, from_amax, nonfinite_count, y_out) -> None:
    """The checks of norm_fwd_fp8, raising ValueError."""
    check_stats_args(fn, x, weight, bias, eps, mean_out, rstd_out, amax_out)
    m, k = x.shape
    dev = x.device
    _check_matrix(fn, "out", out, (m, k), _FP8_DTYPES, dev)
    if out_t is not None:
        if out_t.dim() != 2 or out_t.shape[0] != k or out_t.shape[1] < m:
            raise ValueError(f"{fn}: out_t must be (K, Mp) = ({k}, >= {m}) for x of shape {tuple(x.shape)}; "
                             f"got {tuple(out_t.shape)}")
        _check_matrix(fn, "out_t", out_t, tuple(out_t.shape), (out.dtype,), dev)
    if y_out is not None:
        _check_matrix(fn, "y_out", y_out, (m, k), (x.dtype,), dev)
    check_scales(fn, dev, scale, scale_inv_out, amax_out, from_amax, nonfinite_count)


def check_y_out(fn, x, y_out) -> None:
    _check_matrix(fn, "y_out", y_out, tuple(x.shape), (x.dtype,), x.device)


def check_bwd_args(fn, dy, x, weight, mean, rstd, dx_out, dweight_out, dbias_out) -> None:
    """The checks of norm_bwd, raising ValueError."""
    _check_rows(fn, "x", x)
    m, k = x.shape
    dev = x.device
    _check_rows(fn, "dy", dy)
    if dy.shape != x.shape or dy.device != dev:
        raise ValueError(f"{fn}: dy must have x's shape {tuple(x.shape)} and device {dev}; "
                         f"got {tuple(dy.shape)} on {dy.device}")
    _check_vector(fn, "weight", weight, k, _INPUT_DTYPES, dev)
    if mean is not None:
        _check_vector(fn, "mean", mean, m, (torch.float32,), dev)
    _check_vector(fn, "rstd", rstd, m, (torch.float32,), dev)
    _check_matrix(fn, "dx_out", dx_out, (m, k), (x.dtype,), dev)
    _check_vector(fn, "dweight_out", dweight_out, k, _INPUT_DTYPES, dev)
    if dbias_out is not None:
        if mean is None:
            raise ValueError(f"{fn}: dbias_out is given but mean is None (RMSNorm has no bias); "
                             "pass dbias_out=None")
        _check_vector(fn, "dbias_out", dbias_out, k, _INPUT_DTYPES, dev)


def _require_tensor(fn: str, name: str, t, what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{fn}: {name} must be {what}; got {type(t).__name__}")


def _names(dtypes: Sequence[torch.dtype]) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


def _check_rows(fn: str, name: str, t: torch.Tensor) -> None:
    """(M, K) high precision with unit column stride (any row stride), K >= 1."""
    _require_tensor(fn, name, t, "a 2-D (M, K) tensor")
    if t.dim() != 2:
        raise ValueError(f"{fn}: {name} must be 2-D (M, K); got shape {tuple(t.shape)} (flatten leading dims)")
    if t.dtype not in _INPUT_DTYPES:
        raise ValueError(f"{fn}: {name} must be {_names(_INPUT_DTYPES)}; got {t.dtype}")
    if t.shape[1] == 0:
        raise ValueError(f"{fn}: {name} must have K >= 1 columns; got shape {tuple(t.shape)}")
    if t.stride(1) != 1 and t.shape[1] > 1:
        raise ValueError(f"{fn}: {name} of shape {tuple(t.shape)} and strides {tuple(t.stride())} needs unit "
                         f"stride in its last dim; pass {name}.contiguous()")


def _check_vector(fn: str, name: str, t: torch.Tensor, n: int, dtypes, device: torch.device) -> None:
    _require_tensor(fn, name, t, f"a ({n},) tensor")
    if t.dtype not in dtypes:
        raise ValueError(f"{fn}: {name} must be {_names(dtypes)}; got {t.dtype}")
    if t.shape != (n,) or t.device != device or (n > 1 and t.stride(0) != 1):
        raise ValueError(f"{fn}: {name} must be a contiguous ({n},) tensor on {device}; "
                         f"got {tuple(t.shape)} with strides {tuple(t.stride())} on {t.device}")


def _check_matrix(fn: str, name: str, t: torch.Tensor, shape, dtypes, device: torch.device) -> None:
    _require_tensor(fn, name, t, f"a {tuple(shape)} tensor")
    if t.dtype not in dtypes:
        raise ValueError(f"{fn}: {name} must be {_names(dtypes)}; got {t.dtype}")
    if t.shape != shape or t.device != device or not t.is_contiguous():
        raise ValueError(f"{fn}: {name} must be a contiguous tensor of shape {tuple(shape)} on {device}; "
                         f"got {tuple(t.shape)} (contiguous={t.is_contiguous()}) on {t.device}")
