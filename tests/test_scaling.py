"""Scale math edge cases (fp8train/scaling.py), each stated in compute_scale's docstring."""
import math

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
