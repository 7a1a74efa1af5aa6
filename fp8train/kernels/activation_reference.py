"""Pure-torch twins of the fused MLP activation kernels (kernels/activation.py): the specification.

A transformer MLP runs fc1 -> act -> fc2. These functions take fc1's high-precision output
h and emit the FP8 operands the next GEMMs read, without a high-precision copy of the
activation in between:

  forward   a = act(h)                          -> a as fp8 (+ a^T for fc2's wgrad)
  backward  dh = da * act'(h)  (da from fc2's dgrad) -> dh as fp8 (+ dh^T for fc1's wgrad),
            and optionally dbias = dh.sum(0) (fc1's bias gradient)

Activations (`act`):
  "gelu"       x * Phi(x), Phi the normal cdf            = F.gelu(x)
  "gelu_tanh"  0.5 x (1 + tanh(k (x + c x^3)))         = F.gelu(x, approximate="tanh")
  "relu"       max(x, 0), -0.0 and NaN kept            = F.relu(x)
  "swiglu"     h (M, 2F) = [gate | up]: silu(gate) * up = F.silu(h[:, :F]) * h[:, F:]
Gradients are those of torch.autograd through the torch forms above:
  gelu       Phi(x) + x phi(x),  phi the normal density
  gelu_tanh  s + x s (1 - s) z'(x),  s = sigmoid(z), z = 2 k (x + c x^3)
  relu       da where x > 0, 0 where x <= 0; NaN x passes da through (torch's threshold_backward)
  swiglu     dgate = da * up * s (1 + gate (1 - s)), s = sigmoid(gate);  dup = da * silu(gate)

Note: how the float32 math is written, and why. The Triton kernels evaluate these
expressions op for op, so kernel and twin differ only where the GPU's exp2 (ex2.approx)
differs from torch.exp2 in the last bits; every formula is chosen so that such a
difference stays a difference of a few float32 ulps in the result:
  * Every multiply-add is an explicit fused multiply-add, `fma` here (exactly rounded, in
    float64 with round-to-odd) and tl.math.fma in the kernel. The GPU compiler contracts
    a plain `a * b + c` into an fma on its own, and near a cancellation the two roundings
    differ by far more than an ulp of the result.
  * exp(v) is written exp2(v * LOG2E): the product is rounded the same way on both sides,
    so only exp2 itself differs (torch.exp's argument is exact, tl.exp's is not).
  * Phi(x) = erfc(-x / sqrt 2) / 2, with erfc(z) for z >= 0 from the Numerical Recipes
    Chebyshev fit t exp(-z^2 + P(t)), t = 1 / (1 + z / 2) (relative error < 1.1e-7), and
    Phi = 1 - erfc(z) / 2 for x >= 0. The form 0.5 (1 + erf(x / sqrt 2)) cancels for x < 0
    (at x = -5 one float32 ulp of erf is 10% of Phi), so any two erf implementations
    disagree there by whole fp8 steps; erf itself is not used. In float32, gelu(x) is within
    1e-6 (relative) of the exact value for x > -3 and within 1.1e-5 down to x = -12, where
    the rounding of the exponent (about -72) dominates; torch's float32 F.gelu returns -0.0
    from x = -5.55 on.
  * sigmoid(z) = 1 / (1 + exp(-z)) (IEEE division here; the kernels' div.full.f32 is within
    2 ulps of it, like their exp2), and 1 - sigmoid(z) = exp(-z) sigmoid(z)
    for z >= 0 (1 - s would cancel as s -> 1), 1 - s for z < 0.
  * gelu_tanh is evaluated as x * sigmoid(2 k (x + c x^3)), the same function: it needs no
    tanh (Triton has none) and keeps full relative precision for negative x, where
    1 + tanh(...) cancels.
  * |x| > GELU_CUT (12): phi(x) = 0 and Phi(x) = 0 (x < 0) or 1. Past 12 both are below
    3e-32, and a little further they leave the normal float32 range, where the GPU's exp2
    flushes to zero and torch's does not; cutting at 12 makes them zero on both sides, so
    that da = +-inf gives the same NaN / inf on both sides.

Special inputs: the IEEE evaluation of the formulas, which torch's scalar float32 results
(F.gelu, F.silu, autograd) agree with, with one exception below. (Torch's vectorized CPU
F.gelu is no specification: on some machines it returns NaN for +inf inside a row.)
  x = NaN           act NaN, dh NaN (relu: dh = da, torch's threshold_backward)
  x = +inf          gelu, gelu_tanh, silu: +inf; gelu', gelu_tanh', silu': NaN (inf * 0)
  x = -inf          gelu, gelu_tanh, silu: NaN (-inf * 0); their derivatives NaN
  x = -0.0          act -0.0 (relu, gelu, gelu_tanh)
  da = +-inf        dh = da * act'(x): +-inf where act'(x) != 0, NaN where it is 0
  |x| > 1.8e19      (gelu_tanh) x^2 overflows in z and z': act is still x s (x, or -0.0
                    for negative x), but act' is NaN (inf * 0) where the exact derivative
                    is 1 or 0; torch's float32 F.gelu(approximate="tanh") backward gives NaN
                    there too
  x < -12 (gelu)    act -0.0 and act' = 0, so dh = da * 0 (NaN for da = +-inf). The
                    exception: torch's float32 gelu' is a tiny nonzero number down to
                    x = -14.3 (then dh = +-inf for da = +-inf).
Subnormal inputs and products are kept (IEEE on both sides). Outside the float32 range the
saturating cast clamps: +-inf and huge values become +-fp8_max, NaN stays NaN.

Note: scale conventions (q = fp8(v * scale), scale_inv = 1 / scale, amax of the unscaled
float32 values, NaN counted as +inf) are those of fp8train/scaling.py and
reference.cast_transpose_amax; the scale / scale_inv / amax_out / from_amax /
nonfinite_count arguments behave exactly as there.

The argument checks live here too (`check_fwd_args`, `check_bwd_args`) so that the twin and
the Triton wrapper reject exactly the same inputs with the same messages.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import reference
from .checks import check_fp8_outputs, check_scalar, check_scales

ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "swiglu")

# float32 constants, shared with the kernels (Python floats; both sides round them to float32).
SQRT1_2 = 0.7071067811865476        # 1 / sqrt(2)
INV_SQRT_2PI = 0.3989422804014327   # 1 / sqrt(2 pi)
TANH_2K = 1.5957691216057308        # 2 sqrt(2 / pi): z = 2 k x (1 + c x^2)
TANH_C = 0.044715                   # c
TANH_3C = 0.134145                  # 3 c, in z'(x) = 2 k (1 + 3 c x^2)
LOG2E = 1.4426950408889634          # exp(v) = exp2(v * LOG2E)
NEG_LOG2E = -LOG2E                  # exp(-z) = exp2(z * NEG_LOG2E)
NEG_HALF_LOG2E = -0.5 * LOG2E       # exp(-x^2 / 2) = exp2(x^2 * NEG_HALF_LOG2E)
GELU_CUT = 12.0                     # |x| past this: phi(x) = 0, Phi(x) = 0 or 1 (see Note)
# erfc(z) ~ t exp(-z^2 + P(t)), t = 1 / (1 + z / 2), P(t) = sum_i ERFC_FIT[i] t^i (Numerical
# Recipes' erfcc, a Chebyshev fit with relative error < 1.1e-7 for z >= 0).
ERFC_FIT = (-1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806, 0.27886807, -1.13520398, 1.48851587,
            -0.82215223, 0.17087277)

_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# --------------------------------------------------------------------------- float32 math


def fma(a, b, c) -> torch.Tensor:
    """a * b + c rounded once to float32, as the GPU's fma.rn.f32 (tl.math.fma) computes it.

    a, b, c: float32 tensors or Python floats (rounded to float32 first, as the kernels'
    constants are), broadcast together. In float64 the product is exact (24 x 24 bits);
    the sum is made exact by TwoSum and rounded to odd, and rounding that to float32 is
    then a single correct rounding (53 >= 24 + 2 bits). NaN, inf and signed zeros follow
    IEEE fma.
    """
    device = next(t.device for t in (a, b, c) if isinstance(t, torch.Tensor))
    a, b, c = (torch.as_tensor(t, dtype=torch.float32, device=device).double() for t in (a, b, c))
    p = a * b
    s = p + c
    s_p = s - p
    err = (p - (s - s_p)) + (c - s_p)  # s + err == p + c exactly (TwoSum), s finite
    inexact_even = (err != 0) & ((s.view(torch.int64) & 1) == 0) & s.isfinite()
    s = torch.where(inexact_even, torch.nextafter(s, torch.copysign(torch.full_like(s, torch.inf), err)), s)
    return s.float()


def _sigmoid(z: torch.Tensor):
    """(sigmoid(z), exp(-z)) float32: IEEE 1 / (1 + exp(-z)); exp(-z) = inf gives exactly 0."""
    e = torch.exp2(z * NEG_LOG2E)
    return torch.reciprocal(1.0 + e), e


def _sigmoid_complement(z: torch.Tensor, s: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """1 - sigmoid(z) without cancellation: exp(-z) sigmoid(z) for z >= 0, 1 - s below."""
    return torch.where(z >= 0.0, e * s, 1.0 - s)


def _normal_cdf(x: torch.Tensor) -> torch.Tensor:
    """Phi(x) = erfc(-x / sqrt 2) / 2 (see Note): 0 below -GELU_CUT, 1 above GELU_CUT, NaN at NaN.

    erfc(a), a = |x| / sqrt 2, is Numerical Recipes' t exp(-a^2 + P(t)), t = 1 / (1 + a / 2),
    with a^2 taken as x^2 / 2 (one rounding, where squaring the rounded a would double its
    error); then Phi = erfc(a) / 2 for x < 0 and 1 - erfc(a) / 2 for x >= 0.
    """
    t = torch.reciprocal(1.0 + 0.5 * ((x * SQRT1_2).abs()))
    q = fma(ERFC_FIT[-1], t, ERFC_FIT[-2])
    for coefficient in reversed(ERFC_FIT[:-2]):
        q = fma(q, t, coefficient)
    half = 0.5 * (t * torch.exp2(fma(x * x, -0.5, q) * LOG2E))  # erfc(a) / 2
    cdf = torch.where(x < 0.0, half, 1.0 - half)
    return torch.where(x > GELU_CUT, 1.0, torch.where(x < -GELU_CUT, 0.0, cdf))


def _normal_pdf(x: torch.Tensor) -> torch.Tensor:
    """phi(x) = exp(-x^2 / 2) / sqrt(2 pi), 0 where |x| > GELU_CUT."""
    pdf = torch.exp2((x * x) * NEG_HALF_LOG2E) * INV_SQRT_2PI
    return torch.where(x.abs() > GELU_CUT, 0.0, pdf)


def act_forward(h: torch.Tensor, act: str) -> torch.Tensor:
    """a = act(h) as float32: (M, F) for h (M, F), or (M, F) for swiglu's h (M, 2F)."""
    x = h.float()
    if act == "gelu":
        return x * _normal_cdf(x)
    if act == "gelu_tanh":
        z = (x * TANH_2K) * fma(x * x, TANH_C, 1.0)
        return x * _sigmoid(z)[0]
    if act == "relu":
        return torch.where(x < 0.0, 0.0, x)
    if act == "swiglu":
        f = x.shape[1] // 2
        gate, up = x[:, :f], x[:, f:]
        return (gate * _sigmoid(gate)[0]) * up
    raise ValueError(_unknown_act("act_forward", act))


def act_grad(da: torch.Tensor, h: torch.Tensor, act: str) -> torch.Tensor:
    """dh = da * act'(h) as float32, shape of h: (M, F), or (M, 2F) = [dgate | dup] for swiglu."""
    g = da.float()
    x = h.float()
    if act == "gelu":
        return g * fma(x, _normal_pdf(x), _normal_cdf(x))
    if act == "gelu_tanh":
        x2 = x * x
        z = (x * TANH_2K) * fma(x2, TANH_C, 1.0)
        s, e = _sigmoid(z)
        dz = TANH_2K * fma(x2, TANH_3C, 1.0)
        return g * fma((x * s) * _sigmoid_complement(z, s, e), dz, s)
    if act == "relu":
        return torch.where(x <= 0.0, 0.0, g)
    if act == "swiglu":
        f = x.shape[1] // 2
        gate, up = x[:, :f], x[:, f:]
        s, e = _sigmoid(gate)
        dgate = (g * up) * (s * fma(gate, _sigmoid_complement(gate, s, e), 1.0))
        dup = g * (gate * s)
        return torch.cat([dgate, dup], dim=1)
    raise ValueError(_unknown_act("act_grad", act))


# --------------------------------------------------------------------------- the twins


def act_amax(h: torch.Tensor, act: str, amax_out: torch.Tensor) -> None:
    """amax_out (() float32) <- max(amax_out, abs_max(act(h))), NaN counted as +inf.

    The first pass of current scaling; writes nothing else. M == 0: amax_out <- max(amax_out, 0).
    """
    check_amax_args("act_amax", h, act, amax_out)
    reference.amax(act_forward(h, act), amax_out)


def act_fwd_fp8(h: torch.Tensor, act: str, out: torch.Tensor, out_t: Optional[torch.Tensor],
                scale: torch.Tensor, scale_inv_out: torch.Tensor, amax_out: Optional[torch.Tensor] = None,
                from_amax: Optional[torch.Tensor] = None, nonfinite_count: Optional[torch.Tensor] = None,
                power_of_two: bool = False) -> None:
    """The activation of fc1's output, cast to FP8 (with its transposed copy) in one pass.

    h       (M, F), or (M, 2F) for swiglu; bf16/fp16/fp32, unit column stride, any row stride
    out     (M, F) fp8, contiguous: saturating_cast(act(h), scale)
    out_t   (F, Mp) fp8, contiguous, Mp >= M, or None: out_t[:, :M] = out.T, out_t[:, M:] = 0
    scale, scale_inv_out, amax_out, from_amax, nonfinite_count, power_of_two: as
            reference.cast_transpose_amax, with amax_out max-accumulating abs_max(act(h))
            (float32, unscaled).
    Delayed scaling: one call with amax_out. Current scaling: act_amax(h, act, a), then this
    with from_amax=a.
    """
    check_fwd_args("act_fwd_fp8", h, act, out, out_t, scale, scale_inv_out, amax_out, from_amax, nonfinite_count)
    a = act_forward(h, act)  # (M, F) float32
    _cast_outputs(a, out, out_t, scale, scale_inv_out, amax_out, from_amax, nonfinite_count, power_of_two)


def act_bwd_amax(da: torch.Tensor, h: torch.Tensor, act: str, amax_out: torch.Tensor) -> None:
    """amax_out <- max(amax_out, abs_max(dh)), dh = da * act'(h): current scaling's first pass."""
    check_bwd_amax_args("act_bwd_amax", da, h, act, amax_out)
    reference.amax(act_grad(da, h, act), amax_out)


def act_bwd_fp8(da: torch.Tensor, h: torch.Tensor, act: str, out: torch.Tensor, out_t: Optional[torch.Tensor],
                scale: torch.Tensor, scale_inv_out: torch.Tensor, amax_out: Optional[torch.Tensor] = None,
                from_amax: Optional[torch.Tensor] = None, nonfinite_count: Optional[torch.Tensor] = None,
                dbias_out: Optional[torch.Tensor] = None, power_of_two: bool = False) -> None:
    """dh = da * act'(h) cast to FP8 (with its transposed copy), and optionally fc1's dbias.

    da         (M, F) bf16/fp16/fp32 gradient w.r.t. a, unit column stride
    h          (M, Fh) the saved fc1 output, Fh = F (Fh = 2F for swiglu)
    out        (M, Fh) fp8, contiguous: saturating_cast(dh, scale)
    out_t      (Fh, Mp) fp8, contiguous, Mp >= M, or None: out_t[:, :M] = out.T, out_t[:, M:] = 0
    dbias_out  (Fh,) bf16/fp16/fp32, or None: float32 column sums of dh, written in its dtype
               (all zeros when M == 0)
    scale, scale_inv_out, amax_out, from_amax, nonfinite_count, power_of_two: as
               reference.cast_transpose_amax, with amax_out max-accumulating abs_max(dh)
               (float32, unscaled).
    """
    check_bwd_args("act_bwd_fp8", da, h, act, out, out_t, scale, scale_inv_out, amax_out, from_amax,
                   nonfinite_count, dbias_out)
    dh = act_grad(da, h, act)  # (M, Fh) float32
    _cast_outputs(dh, out, out_t, scale, scale_inv_out, amax_out, from_amax, nonfinite_count, power_of_two)
    if dbias_out is not None:
        dbias_out.copy_(dh.sum(dim=0))


def _cast_outputs(v, out, out_t, scale, scale_inv_out, amax_out, from_amax, nonfinite_count, power_of_two) -> None:
    """reference.cast_transpose_amax of the float32 values v, with out_t optional."""
    if out_t is None:
        reference.cast_amax(v, out, scale, scale_inv_out, amax_out, from_amax, nonfinite_count,
                            power_of_two=power_of_two)
    else:
        reference.cast_transpose_amax(v, out, out_t, scale, scale_inv_out, amax_out, from_amax, nonfinite_count,
                                      power_of_two=power_of_two)


# --------------------------------------------------------------------------- argument checks


def out_features(h: torch.Tensor, act: str) -> int:
    """Columns of act(h): h.shape[1], or half of it for swiglu."""
    return h.shape[1] // 2 if act == "swiglu" else h.shape[1]


def check_amax_args(fn: str, h, act, amax_out) -> None:
    _check_act(fn, act)
    _check_h(fn, h, act)
    check_scalar(fn, "amax_out", amax_out, torch.float32, h.device)


def check_bwd_amax_args(fn: str, da, h, act, amax_out) -> None:
    check_amax_args(fn, h, act, amax_out)
    _check_da(fn, da, h, act)


def check_fwd_args(fn: str, h, act, out, out_t, scale, scale_inv_out, amax_out, from_amax, nonfinite_count) -> None:
    _check_act(fn, act)
    _check_h(fn, h, act)
    check_fp8_outputs(fn, h.shape[0], out_features(h, act), h.device, out, out_t)
    check_scales(fn, h.device, scale, scale_inv_out, amax_out, from_amax, nonfinite_count)


def check_bwd_args(fn: str, da, h, act, out, out_t, scale, scale_inv_out, amax_out, from_amax, nonfinite_count,
                   dbias_out) -> None:
    _check_act(fn, act)
    _check_h(fn, h, act)
    _check_da(fn, da, h, act)
    check_fp8_outputs(fn, h.shape[0], h.shape[1], h.device, out, out_t)
    check_scales(fn, h.device, scale, scale_inv_out, amax_out, from_amax, nonfinite_count)
    if dbias_out is not None:
        if (dbias_out.dtype not in _INPUT_DTYPES or dbias_out.shape != (h.shape[1],)
                or dbias_out.device != h.device or not dbias_out.is_contiguous()):
            raise ValueError(f"{fn}: dbias_out must be a contiguous bfloat16, float16 or float32 tensor of shape "
                             f"({h.shape[1]},) on {h.device}; got {dbias_out.dtype} {tuple(dbias_out.shape)} "
                             f"(contiguous={dbias_out.is_contiguous()}) on {dbias_out.device}")


def _unknown_act(fn: str, act) -> str:
    return f"{fn}: act must be one of {', '.join(map(repr, ACTIVATIONS))}; got {act!r}"


def _check_act(fn: str, act) -> None:
    if act not in ACTIVATIONS:
        raise ValueError(_unknown_act(fn, act))


def _check_rows(fn: str, name: str, t: torch.Tensor) -> None:
    """t must be 2-D, bf16/fp16/fp32, with unit stride along its columns (any row stride)."""
    if t.dim() != 2:
        raise ValueError(f"{fn}: {name} must be 2-D (rows, columns); got shape {tuple(t.shape)}")
    if t.dtype not in _INPUT_DTYPES:
        raise ValueError(f"{fn}: {name} must be bfloat16, float16 or float32; got {t.dtype}")
    if t.stride(1) != 1 and t.shape[1] > 1:
        raise ValueError(f"{fn}: {name} of shape {tuple(t.shape)} has strides {tuple(t.stride())}; it needs unit "
                         f"stride along its columns (any row stride): pass {name}.contiguous()")


def _check_h(fn: str, h: torch.Tensor, act: str) -> None:
    _check_rows(fn, "h", h)
    if act == "swiglu" and h.shape[1] % 2:
        raise ValueError(f"{fn}: swiglu needs h = [gate | up] of shape (M, 2F), an even number of columns; "
                         f"got {tuple(h.shape)}")


def _check_da(fn: str, da: torch.Tensor, h: torch.Tensor, act: str) -> None:
    _check_rows(fn, "da", da)
    want = (h.shape[0], out_features(h, act))
    if da.shape != want or da.device != h.device:
        raise ValueError(f"{fn}: da must be {want} on {h.device} for h of shape {tuple(h.shape)} and act={act!r}; "
                         f"got {tuple(da.shape)} on {da.device}")


