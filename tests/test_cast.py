"""The CPU cast path (reference twins, through fp8train.quantize) against ml_dtypes, bit for bit."""
import math

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fp8train
from fp8train import scaling
from fp8train.kernels import reference
from helpers import all_bf16_values, fp8_bytes

FORMATS = {torch.float8_e4m3fn: ml_dtypes.float8_e4m3fn, torch.float8_e5m2: ml_dtypes.float8_e5m2}


def ml_dtypes_cast(x: torch.Tensor, scale: float, dtype: torch.dtype) -> np.ndarray:
    """Independent reference: numpy float32 multiply, clip, ml_dtypes round-to-nearest-even."""
    m = scaling.fp8_max(dtype)
    with np.errstate(all="ignore"):
        y = np.clip(x.float().numpy() * np.float32(scale), -m, m)
    return y.astype(FORMATS[dtype]).view(np.uint8)


def assert_same_fp8(ours: np.ndarray, ref: np.ndarray, dtype) -> None:
    """Byte equality, except that a NaN may use another NaN encoding (ml_dtypes writes e5m2
    NaN as 0x7E, torch as 0x7F); it must still be NaN with the same sign."""
    nan_ours = np.isnan(ours.view(FORMATS[dtype]).astype(np.float32))
    nan_ref = np.isnan(ref.view(FORMATS[dtype]).astype(np.float32))
    assert np.array_equal(nan_ours, nan_ref)
    assert np.array_equal(ours[~nan_ours], ref[~nan_ref])
    assert np.array_equal(ours[nan_ours] >> 7, ref[nan_ref] >> 7)


@pytest.mark.parametrize("dtype", FORMATS, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("scale", [1.0, 2.0**-10, 3.7, 2.0**20, 1e-30, 2.0**126])
def test_every_bf16_pattern_matches_ml_dtypes(dtype, scale):
    x = all_bf16_values()
    q = fp8train.quantize(x, dtype, scale=scale)
    assert q.fp8_dtype == dtype and q.dtype == torch.bfloat16 and q.shape == x.shape
    assert_same_fp8(fp8_bytes(q.fp8_data).numpy(), ml_dtypes_cast(x, scale, dtype), dtype)
    assert q.scale_inv.item() == np.float32(1) / np.float32(scale)


@pytest.mark.parametrize("dtype", FORMATS, ids=["e4m3", "e5m2"])
def test_current_scaling_uses_the_tensor_amax(dtype):
    x = torch.randn(37, 129) * 1e-3
    x[3, 5] = -7.25e-2  # the amax
    q = fp8train.quantize(x, dtype)
    scale = scaling.fp8_max(dtype) / np.float32(7.25e-2)
    assert q.scale_inv.item() == np.float32(1) / np.float32(scale)
    assert_same_fp8(fp8_bytes(q.fp8_data).numpy(), ml_dtypes_cast(x, np.float32(scale), dtype), dtype)
    assert q.fp8_data.view(torch.uint8).flatten()[3 * 129 + 5] in (0xFE, 0xFB)  # -fp8_max exactly


@settings(max_examples=200, deadline=None)
@given(values=st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), min_size=1, max_size=64),
       scale=st.floats(min_value=2.0**-60, max_value=2.0**60, width=32),
       e5m2=st.booleans())
def test_float32_inputs_match_ml_dtypes(values, scale, e5m2):
    dtype = torch.float8_e5m2 if e5m2 else torch.float8_e4m3fn
    x = torch.tensor(values, dtype=torch.float32)
    q = fp8train.quantize(x, dtype, scale=scale)
    assert_same_fp8(fp8_bytes(q.fp8_data).numpy(), ml_dtypes_cast(x, scale, dtype), dtype)


def test_fp16_inputs_match_ml_dtypes():
    x = torch.arange(0, 2**16, dtype=torch.int32).to(torch.int16).view(torch.float16)
    for dtype in FORMATS:
        q = fp8train.quantize(x, dtype, scale=0.125)
        assert_same_fp8(fp8_bytes(q.fp8_data).numpy(), ml_dtypes_cast(x, 0.125, dtype), dtype)


def test_special_values():
    x = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e30, -1e30, 1e-30])
    q = fp8train.quantize(x, torch.float8_e4m3fn, scale=1.0).fp8_data.float()
    assert q[:2].tolist() == [0.0, 0.0] and q[2:4].tolist() == [448.0, -448.0]  # saturating
    assert torch.isnan(q[4]) and q[5:7].tolist() == [448.0, -448.0] and q[7].item() == 0.0


@pytest.mark.parametrize("x, expected_scale", [
    (torch.zeros(5, 16), 1.0),  # all zero: scale kept at its initial 1
    (torch.full((4,), float("nan")), 1.0),
    (torch.tensor([1.0, float("inf")]), 1.0),
    (torch.tensor([1e-40, -1e-41]), 2.0**126),
], ids=["zeros", "nan", "inf", "subnormal"])
def test_current_scaling_edge_cases(x, expected_scale):
    q = fp8train.quantize(x)
    assert q.scale_inv.item() == 1.0 / expected_scale
    assert torch.isfinite(q.scale_inv)


def test_reference_abs_max_counts_nan_as_inf():
    assert reference.abs_max(torch.tensor([1.0, float("nan"), -3.0])).item() == float("inf")
    assert reference.abs_max(torch.tensor([1.0, -3.0], dtype=torch.bfloat16)).item() == 3.0
    assert reference.abs_max(torch.empty(0)).item() == 0.0


def test_reference_cast_transpose_pads_with_zeros():
    x = torch.randn(5, 32)
    out = torch.empty(5, 32, dtype=torch.float8_e4m3fn)
    out_t = torch.full((32, 16), 0x55, dtype=torch.uint8).view(torch.float8_e4m3fn)
    s, si, amax = torch.tensor(2.0), torch.empty(()), torch.tensor(-1.0)
    reference.cast_transpose_amax(x, out, out_t, s, si, amax_out=amax)
    assert torch.equal(fp8_bytes(out_t[:, :5]), fp8_bytes(out).t())
    assert (fp8_bytes(out_t[:, 5:]) == 0).all()
    assert amax.item() == x.abs().max().item() and si.item() == 0.5


@pytest.mark.parametrize("bad, match", [
    (dict(x=torch.arange(4)), "expected a bfloat16"),
    (dict(x=torch.randn(4, dtype=torch.float64)), "expected a bfloat16"),
    (dict(x=torch.randn(4), dtype=torch.bfloat16), "not an FP8 dtype"),
    (dict(x=torch.randn(4), scale=0.0), "positive finite"),
    (dict(x=torch.randn(4), scale=float("inf")), "positive finite"),
    (dict(x=torch.randn(4), scale=torch.ones(2)), "one-element float32"),
], ids=["int", "float64", "dtype", "scale0", "scaleinf", "scaleshape"])
def test_quantize_rejects_bad_input(bad, match):
    with pytest.raises((TypeError, ValueError), match=match):
        fp8train.quantize(**bad)


def pow2_scale(amax: float, fp8_max: float) -> float:
    """2**floor(log2(fp8_max / amax)) clamped to [2**-126, 2**126], by math.frexp in float64
    (an independent computation of scaling.compute_scale(..., power_of_two=True))."""
    mantissa, exponent = math.frexp(fp8_max / amax)  # fp8_max / amax = mantissa * 2**exponent, mantissa in [0.5, 1)
    return 2.0 ** min(max(exponent - 1, -126), 126)


@pytest.mark.parametrize("dtype", FORMATS, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("transpose", [False, True], ids=["rows", "transpose"])
@pytest.mark.parametrize("amax", [None, 3.0, 448.0, 1e-3, 1e-40, 0.0, math.inf, math.nan],
                         ids=["own", "3", "448", "1e-3", "subnormal", "zero", "inf", "nan"])
def test_power_of_two_current_scaling_twins(dtype, transpose, amax):
    # kernels.cast_amax / cast_transpose_amax on the CPU (the twins) with a scale computed from
    # from_amax and rounded down to a power of two: the scale, the exact scale_inv, the count
    # of non-finite amaxes and the bytes of ml_dtypes at that scale.
    x = (torch.randn(37, 48) * 10).to(torch.bfloat16)
    from_amax = reference.abs_max(x) if amax is None else torch.tensor(amax)
    scale, scale_inv, count = torch.tensor(0.5), torch.empty(()), torch.tensor(2, dtype=torch.int32)
    out = torch.empty(37, 48, dtype=dtype)
    if transpose:
        out_t = torch.full((48, 48), 0x55, dtype=torch.uint8).view(dtype)
        fp8train.kernels.cast_transpose_amax(x, out, out_t, scale, scale_inv, from_amax=from_amax,
                                             nonfinite_count=count, power_of_two=True)
        assert torch.equal(fp8_bytes(out_t[:, :37]), fp8_bytes(out).t()) and not fp8_bytes(out_t[:, 37:]).any()
    else:
        fp8train.kernels.cast_amax(x, out, scale, scale_inv, from_amax=from_amax, nonfinite_count=count,
                                   power_of_two=True)
    a = float(from_amax)
    want = pow2_scale(a, scaling.fp8_max(dtype)) if a > 0 and math.isfinite(a) else 0.5  # else: kept
    assert scale.item() == want and scale_inv.item() == 1.0 / want  # a power of two: its inverse is exact
    assert count.item() == 2 + (not math.isfinite(a))
    assert_same_fp8(fp8_bytes(out).numpy(), ml_dtypes_cast(x, want, dtype), dtype)


@pytest.mark.parametrize("work", [2, 77, 5000])
def test_persistent_grid_of_a_symbolic_size_adds_no_guard(work):
    """fp8train::cast_kernels' body runs in torch.compile's trace with symbolic sizes: a guard
    on the token count there makes every sequence length on the other side of it compile
    again (a compiled HF Llama did for 64 tokens or fewer, on the GPU)."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from fp8train.kernels import cast as cast_kernels

    env = ShapeEnv()
    size = env.create_symintnode(env.create_symbol(work, source=ConstantSource("tokens")), hint=work)
    programs = cast_kernels._grid(size, 3, torch.device("cpu"))  # the interpreter's 3 SMs: a cap of 9
    assert env.guards == []
    assert programs.node.hint == min(work, 9)
    assert cast_kernels._grid(work, 3, torch.device("cpu")) == min(work, 9)
    assert cast_kernels._grid(0, 3, torch.device("cpu")) == 1
    cfg = cast_kernels.launch_configs(torch.device("cpu"))[1]
    cast_kernels._check_tile_offsets(cfg, 64, 64, size)  # rows of 64 elements, a symbolic padded row count
    for guard in env.guards:  # the int32 bound alone: true for every size from 2 to a million rows
        symbol, = guard.expr.free_symbols
        assert all(bool(guard.expr.subs(symbol, rows)) for rows in (2, 17, 64, 65, 10**6)), guard.expr
    with pytest.raises(ValueError, match="too long"):
        cast_kernels._check_tile_offsets(cfg, 2**31, 64, 64)
