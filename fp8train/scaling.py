"""Pure scale math: amax -> scale, amax histories. No state, no kernels.

Note: conventions used throughout fp8train.
  * `scale` maps high precision into the FP8 range:   q = fp8(x * scale)
  * `scale_inv = 1 / scale` maps FP8 back:             x ~= float(q) * scale_inv
    Quantizers own `scale`; every Float8Tensor carries its own `scale_inv` (the GEMM's input).
  * An amax history is a float32 vector of length H. Entry 0 collects the amax of the step
    in progress (each cast max-accumulates into it); entries 1..H-1 are earlier steps,
    newest first. A negative entry (UNRECORDED) means "no amax recorded there".
"""
from __future__ import annotations

import torch

UNRECORDED = -1.0
# Scales (and so scale_inv) are clamped to normal float32 powers of two at both ends, so
# neither a scale nor its inverse is ever 0, subnormal or inf.
SCALE_MIN = 2.0**-126
SCALE_MAX = 2.0**126

_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 dtype (e4m3fn: 448, e5m2: 57344)."""
    try:
        return _FP8_MAX[dtype]
    except KeyError:
        raise ValueError(f"{dtype} is not an FP8 dtype; use torch.float8_e4m3fn or torch.float8_e5m2") from None


def fp8_dtype_of_max(value: float) -> torch.dtype:
    for dtype, m in _FP8_MAX.items():
        if m == value:
            return dtype
    raise ValueError(f"{value} is not the max of a supported FP8 dtype")


def compute_scale(amax: torch.Tensor, prev_scale: torch.Tensor, fp8_max: float, margin: int = 0,
                  power_of_two: bool = False) -> torch.Tensor:
    """scale = fp8_max / amax / 2**margin, with every edge case defined (float32, no sync).

    amax > 0, finite    the formula, then clamped to [2**-126, 2**126].
    amax subnormal      fp8_max / amax overflows float32; the clamp gives 2**126, so the
                        cast stays finite (such a tensor keeps only a few mantissa bits).
                        So do normal amaxes below fp8_max / 2**128 (~2**-119.2 for e4m3,
                        ~2**-112.2 for e5m2), whatever the margin: the quotient overflows
                        before the margin divides it.
    amax == 0           `prev_scale`: an all-zero tensor fits any scale, keep the last one.
    amax inf or NaN     `prev_scale`: a non-finite amax never reaches a scale. Callers count
                        these events (quantizer `nonfinite_count`).
    power_of_two        the clamped scale rounded down to a power of two (`round_down_pow2`):
                        2**floor(log2(fp8_max / amax / 2**margin)), clamped. x * scale and
                        q * scale_inv then only move exponents; scale_inv is exact too.
                        Rounding down keeps amax * scale <= fp8_max. Could the float32
                        quotient round up onto a power of two? Not here: fp8_max is 7 * 2**k,
                        and the float32 neighbours of 7 * 2**j lie 2**-23.8 apart
                        (relatively), more than the 2**-25 below a power of two from which a
                        quotient rounds onto it (tests/test_scaling.py tries every amax of a
                        binade). Were it to happen, the saturating cast would clamp the amax
                        element to fp8_max: an error under 2**-24, relative.
                        An unusable amax still returns `prev_scale` unrounded.
    """
    scale = _div(fp8_max, amax) / 2.0**margin
    scale = scale.clamp(SCALE_MIN, SCALE_MAX)
    if power_of_two:
        scale = round_down_pow2(scale)
    usable = (amax > 0) & torch.isfinite(amax)
    return torch.where(usable, scale, prev_scale)


def round_down_pow2(scale: torch.Tensor) -> torch.Tensor:
    """The power of two at or below each positive normal float32 `scale`: its mantissa bits
    cleared (exact; inf and NaN give inf). Clamped scales are always normal."""
    return (scale.view(torch.int32) & 0x7F800000).view(torch.float32)


def scale_inverse(scale: torch.Tensor) -> torch.Tensor:
    """1 / scale, IEEE float32 (see _div)."""
    return _div(1.0, scale)


def _div(a: float, b: torch.Tensor) -> torch.Tensor:
    """a / b (float32 b) rounded as IEEE float32 division rounds, also where torch.compile
    generates the code: Triton's float32 `/` is approximate (within 2 ulps), float64's is
    exact, and a float64 quotient of float32 operands rounded to float32 is the float32
    quotient (53 >= 2 * 24 + 2 bits: double rounding cannot occur for a division)."""
    return torch.div(a, b.double()).float()


def amax_from_history(history: torch.Tensor, algo: str) -> torch.Tensor:
    """The amax a delayed scale is computed from: max of recorded entries, or entry 0."""
    if algo == "most_recent":
        return history[0]
    if algo == "max":
        return history.max().clamp_min(0.0)
    raise ValueError(f"unknown amax_compute_algo {algo!r}")


def rolled_history(history: torch.Tensor) -> torch.Tensor:
    """[UNRECORDED, h0, h1, ..., h_{H-2}]: the pending amax becomes the newest past one."""
    return torch.cat([history.new_full((1,), UNRECORDED), history[:-1]])


def delayed_update(history: torch.Tensor, scale: torch.Tensor, nonfinite_count: torch.Tensor,
                   fp8_max: float, algo: str, margin: int, power_of_two: bool = False):
    """One quantizer's per-step update; returns (history, scale, nonfinite_count), new tensors.

    Pending amax (history[0]):
      unrecorded (< 0)   the quantizer did not cast this step: nothing changes.
      finite             scale from the history (`compute_scale`, with `power_of_two`), then
                         the history rolls.
      inf or NaN         the step is discarded: history[0] is reset to UNRECORDED, the scale
                         is kept and `nonfinite_count` grows by one.
    """
    pending = history[0]
    recorded = (pending >= 0) | torch.isnan(pending)
    finite = torch.isfinite(pending)
    valid = recorded & finite
    amax = amax_from_history(history, algo)
    new_scale = torch.where(valid, compute_scale(amax, scale, fp8_max, margin, power_of_two), scale)
    discarded = torch.cat([history.new_full((1,), UNRECORDED), history[1:]])
    new_history = torch.where(valid, rolled_history(history), torch.where(recorded, discarded, history))
    new_count = nonfinite_count + (recorded & ~finite).to(nonfinite_count.dtype)
    return new_history, new_scale, new_count
