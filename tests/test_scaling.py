"""Scale math edge cases (fp8train/scaling.py), each stated in compute_scale's docstring."""
import math
from fractions import Fraction

import pytest
import torch

from fp8train import scaling
from fp8train.scaling import SCALE_MAX, SCALE_MIN, UNRECORDED

f32 = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
PREV = f32(0.75)


@pytest.mark.parametrize("dtype, m", [(torch.float8_e4m3fn, 448.0), (torch.float8_e5m2, 57344.0)])
def test_fp8_max(dtype, m):
    assert scaling.fp8_max(dtype) == m
    assert scaling.fp8_dtype_of_max(m) == dtype


def test_fp8_max_rejects_other_dtypes():
    with pytest.raises(ValueError, match="not an FP8 dtype"):
        scaling.fp8_max(torch.bfloat16)


@pytest.mark.parametrize("amax, margin", [(1.0, 0), (3.5, 0), (1e-3, 2), (1e30, 0), (448.0, 5)])
def test_formula(amax, margin):
    s = scaling.compute_scale(f32(amax), PREV, 448.0, margin)
    expected = torch.tensor(448.0, dtype=torch.float32) / f32(amax) / 2.0**margin
    assert s.dtype == torch.float32 and torch.equal(s, expected)


def test_amax_zero_keeps_previous_scale():
    assert torch.equal(scaling.compute_scale(f32(0.0), PREV, 448.0), PREV)


@pytest.mark.parametrize("amax", [1e-40, 1.4e-45, 2.0**-127])
def test_subnormal_amax_clamps_to_largest_scale(amax):
    s = scaling.compute_scale(f32(amax), PREV, 448.0)
    assert s.item() == SCALE_MAX and math.isfinite(1 / s.item())


def test_huge_amax_and_margin_clamp_to_smallest_scale():
    s = scaling.compute_scale(f32(3e38), PREV, 448.0, margin=64)
    assert s.item() == SCALE_MIN


@pytest.mark.parametrize("amax", [math.inf, -math.inf, math.nan])
def test_nonfinite_amax_never_reaches_the_scale(amax):
    assert torch.equal(scaling.compute_scale(f32(amax), PREV, 57344.0), PREV)


def test_history_amax():
    h = f32([2.0, 5.0, UNRECORDED, 1.0])
    assert scaling.amax_from_history(h, "max").item() == 5.0
    assert scaling.amax_from_history(h, "most_recent").item() == 2.0
    assert torch.equal(scaling.rolled_history(h), f32([UNRECORDED, 2.0, 5.0, UNRECORDED]))


def _update(history, algo="max", margin=0, scale=0.5, count=0):
    return scaling.delayed_update(f32(history), f32(scale), torch.tensor(count, dtype=torch.int32), 448.0, algo, margin)


def test_update_rolls_and_rescales():
    h, s, c = _update([4.0, 8.0, 2.0])
    assert h.tolist() == [UNRECORDED, 4.0, 8.0] and s.item() == 448.0 / 8.0 and c.item() == 0
    h, s, c = _update([4.0, 8.0, 2.0], algo="most_recent", margin=1)
    assert s.item() == 448.0 / 4.0 / 2.0


def test_update_skips_unrecorded_step():
    h, s, c = _update([UNRECORDED, 8.0, 2.0])
    assert h.tolist() == [UNRECORDED, 8.0, 2.0] and s.item() == 0.5 and c.item() == 0


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_update_discards_nonfinite_step_and_counts_it(bad):
    h, s, c = _update([bad, 8.0, 2.0], count=3)
    assert h.tolist() == [UNRECORDED, 8.0, 2.0] and s.item() == 0.5 and c.item() == 4


def test_update_with_zero_amax_keeps_scale_but_rolls():
    h, s, c = _update([0.0, UNRECORDED], algo="most_recent")
    assert h.tolist() == [UNRECORDED, 0.0] and s.item() == 0.5


def test_history_length_one():
    h, s, c = _update([7.0])
    assert h.tolist() == [UNRECORDED] and s.item() == 64.0


# ------------------------------------------------------------------ power-of-two scales


FLOAT32_OVERFLOW = Fraction(2**128 - 2**103)  # the midpoint above FLT_MAX: from here float32 rounds to inf


def pow2_scale_reference(amax: float, fp8_max: float, margin: int) -> float:
    """The intended power-of-two scale, exactly (fractions, no float rounding anywhere):
    2**floor(log2(fp8_max / amax / 2**margin)), clamped to [2**-126, 2**126]; amax > 0, finite.
    Where fp8_max / amax overflows float32 the scale is 2**126 whatever the margin
    (compute_scale's docstring)."""
    if Fraction(fp8_max) / Fraction(amax) >= FLOAT32_OVERFLOW:
        return 2.0**126
    r = Fraction(fp8_max) / Fraction(amax) / 2**margin
    k = r.numerator.bit_length() - r.denominator.bit_length()  # floor(log2 r) or one above it
    if Fraction(2) ** k > r:
        k -= 1
    return 2.0 ** min(max(k, -126), 126)


def edge_amaxes() -> torch.Tensor:
    """Zero, subnormals, the normal range's ends, exact powers of two and their neighbours,
    fp8 maxes times powers of two and their neighbours, inf, NaN, and random bit patterns."""
    vals = [0.0, -0.0, 1.4e-45, 1e-40, 2.0**-127, 2.0**-126, 1e-30, 0.1, 1.0, 3.0, 3.5, 7.0, 448.0, 57344.0,
            3e38, 3.4028234663852886e38, math.inf, -math.inf, math.nan]
    vals += [2.0**k for k in range(-126, 128, 7)] + [1.75 * 2.0**k for k in range(-120, 120, 9)]
    base = torch.tensor(vals, dtype=torch.float32)
    up = torch.nextafter(base, torch.tensor(math.inf))
    down = torch.nextafter(base, torch.tensor(0.0))
    rand = torch.randint(1, 0x7F800000, (4096,), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    return torch.cat([base, up, down, rand.view(torch.float32)])


@pytest.mark.parametrize("fp8_max", [448.0, 57344.0], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("margin", [0, 1, 5, 64])
def test_power_of_two_scales_match_exact_reference(fp8_max, margin):
    amax = edge_amaxes()
    prev = torch.full_like(amax, 0.75)
    got = scaling.compute_scale(amax, prev, fp8_max, margin, power_of_two=True)
    for a, s in zip(amax.tolist(), got.tolist()):
        want = pow2_scale_reference(a, fp8_max, margin) if a > 0 and math.isfinite(a) else 0.75
        assert s == want, f"amax {a!r}: scale {s!r}, want {want!r}"
    inv = scaling.scale_inverse(got)
    usable = (amax > 0) & amax.isfinite()
    assert torch.equal(inv[usable].double(), 1.0 / got[usable].double())  # scale_inv exact: a power of two too


# 2^23 amaxes per case (4-8 s each on a 2-core machine): make test runs the default format
# without margin, the slow tier the rest
@pytest.mark.parametrize("margin, fp8_max", [
    pytest.param(0, 448.0, id="0-e4m3"), pytest.param(0, 57344.0, id="0-e5m2", marks=pytest.mark.slow),
    pytest.param(3, 448.0, id="3-e4m3", marks=pytest.mark.slow),
    pytest.param(3, 57344.0, id="3-e5m2", marks=pytest.mark.slow)])
def test_power_of_two_scale_is_the_largest_that_fits_for_every_amax_of_a_binade(margin, fp8_max):
    # Every float32 amax in [1, 2) (the quotient's rounding repeats per binade away from the
    # clamps): amax * scale <= fp8_max / 2**margin < amax * 2 * scale, in exact float64
    # products. So the float32 quotient never rounded up onto a power of two (scaling.py).
    amax = (torch.arange(0, 2**23, dtype=torch.int32) + 0x3F800000).view(torch.float32)
    scale = scaling.compute_scale(amax, torch.ones(()), fp8_max, margin, power_of_two=True).double()
    assert torch.equal(scale, scaling.round_down_pow2(scale.float()).double())
    limit = fp8_max / 2.0**margin
    fits = amax.double() * scale
    assert (fits <= limit).all() and (2 * fits > limit).all()


def test_power_of_two_keeps_the_previous_scale_as_it_is():
    prev = f32(0.75)  # not a power of two (a quantizer switched to the rule mid-run): kept, not rounded
    for amax in (0.0, math.inf, math.nan):
        assert torch.equal(scaling.compute_scale(f32(amax), prev, 448.0, power_of_two=True), prev)


def test_round_down_pow2():
    s = f32([1.0, 1.5, 1.9999999, 2.0**-126, 3.0 * 2.0**-126, 2.0**126, 448.0, 0.3])
    assert scaling.round_down_pow2(s).tolist() == [1.0, 1.0, 1.0, 2.0**-126, 2.0**-125, 2.0**126, 256.0, 0.25]


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 2])
def test_delayed_update_with_power_of_two(algo, margin):
    history = [3.0, 100.0, UNRECORDED, 0.4]
    amax = 100.0 if algo == "max" else 3.0
    h, s, c = scaling.delayed_update(f32(history), f32(0.5), torch.tensor(0, dtype=torch.int32), 448.0, algo,
                                     margin, power_of_two=True)
    assert s.item() == pow2_scale_reference(amax, 448.0, margin) and h.tolist() == [UNRECORDED, 3.0, 100.0, UNRECORDED]
    # a discarded (inf) step and an unrecorded one keep the scale
    for pending in (math.inf, UNRECORDED):
        _, s2, _ = scaling.delayed_update(f32([pending] + history[1:]), f32(0.5), torch.tensor(0, dtype=torch.int32),
                                          448.0, algo, margin, power_of_two=True)
        assert s2.item() == 0.5
