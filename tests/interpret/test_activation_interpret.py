"""The fused activation kernels (kernels/activation.py) under the Triton interpreter, against their twins.

Run with `TRITON_INTERPRET=1 python -m pytest tests/interpret` (skipped otherwise).

The interpreter's fp32 -> fp8 and bf16 -> fp32 conversions are not the hardware's (see
test_kernels_interpret.py), so most tests swap in exact ones (fixture `exact_conversions`).
Even then the kernel's exp2 is numpy's and the twin's is torch's, which may differ in the
last float32 bit (every other operation, the fmas included, rounds the same on both
sides); so fp8 outputs are compared by value within one fp8 ulp (the ordered byte
distance), with NaN at the same places, and amax / dbias within float tolerances.
Exact: the kernel's own out_t[:, :M] against its out.T, the zero padding, and scale /
scale_inv / nonfinite_count when the scale comes from a given from_amax.
"""
from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

if os.environ.get("TRITON_INTERPRET", "0").lower() not in ("1", "true", "yes", "on"):
    pytest.skip("Triton interpreter tests: run with TRITON_INTERPRET=1", allow_module_level=True)
pytest.importorskip("triton")

from triton.runtime import interpreter as _interpreter  # noqa: E402

from fp8train import scaling  # noqa: E402
from fp8train.kernels import activation, reference  # noqa: E402
from fp8train.kernels import activation_reference as act_ref  # noqa: E402

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = [pytest.param(E4M3, id="e4m3"), pytest.param(E5M2, id="e5m2")]
INPUTS = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16"),
          pytest.param(torch.float32, id="fp32")]
ACTS = list(act_ref.ACTIVATIONS)
# Launch shapes: the interpreter's own (small tiles: several loop steps per program, edge and
# padding tiles) and the GPU's (whole test tensors in one or two tiles).
CPU_CONFIG = activation.launch_config(torch.device("cpu"), gated=False)
CONFIGS = [pytest.param(None, id="cpu-config"), pytest.param("cuda", id="gpu-config")]
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                                        "ignore:invalid value encountered:RuntimeWarning",
                                        "ignore:divide by zero encountered:RuntimeWarning")


# --------------------------------------------------------------------------- helpers


# exact_conversions: tests/interpret/conftest.py


@pytest.fixture(params=CONFIGS)
def config(request, exact_conversions):
    """Every comparison runs under both launch shapes (the GPU's: gated or not, per act), exactly converted."""
    if request.param is None:
        yield lambda act: CPU_CONFIG
    else:
        yield lambda act: activation.launch_config(torch.device("cuda"), gated=act == "swiglu")


def make_h(m: int, f: int, act: str, dtype, spread: float = 4.0, specials: bool = True) -> torch.Tensor:
    """fc1 output (M, F) or (M, 2F) for swiglu; with NaN, +-inf, -0.0 and large values sprinkled in."""
    h = torch.randn(m, 2 * f if act == "swiglu" else f) * spread
    if specials and h.numel() >= 16:
        values = torch.tensor([math.nan, math.inf, -math.inf, -0.0, 300.0, -300.0])
        h.view(-1)[torch.randperm(h.numel())[:values.numel()]] = values
    return h.to(dtype)


def poisoned(shape, dtype) -> torch.Tensor:
    return torch.full(shape, 0x5A, dtype=torch.uint8).view(dtype)


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    int_view = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[got.element_size()]
    assert got.dtype == want.dtype and got.shape == want.shape, what
    assert torch.equal(got.view(int_view), want.view(int_view)), f"{what}: {got} != {want}"


def _order(t: torch.Tensor) -> torch.Tensor:
    """fp8 bytes on a line where neighbouring values differ by 1 (+0 and -0 both at 0)."""
    b = t.view(torch.uint8).int()
    return torch.where(b >= 0x80, -(b & 0x7F), b & 0x7F)


def assert_fp8_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """NaN at the same places; elsewhere at most one fp8 ulp apart, on at most 1% of elements."""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    nan_g, nan_w = got.float().isnan(), want.float().isnan()
    assert torch.equal(nan_g, nan_w), f"{what}: NaN positions differ"
    dist = (_order(got) - _order(want)).abs()[~nan_w]
    assert dist.numel() == 0 or dist.max() <= 1, f"{what}: {int((dist > 1).sum())} values more than 1 ulp off"
    assert int((dist != 0).sum()) <= 1 + dist.numel() // 100, f"{what}: {int((dist != 0).sum())} values 1 ulp off"


def assert_float_close(got: torch.Tensor, want: torch.Tensor, what: str, rel: float = 1e-6) -> None:
    """Same non-finite values; finite ones within rel (a few float32 ulps)."""
    g, w = got.double(), want.double()
    assert torch.equal(g.isnan(), w.isnan()) and torch.equal(g[w.isinf()], w[w.isinf()]), f"{what}: {g} vs {w}"
    fin = w.isfinite()
    assert ((g[fin] - w[fin]).abs() <= rel * w[fin].abs()).all(), f"{what}: {g} vs {w}"


def scalar_args(mode: str):
    """(scale, scale_inv_out, amax_out, from_amax, nonfinite_count): delayed, or current from a given amax."""
    f32 = lambda v: torch.tensor(v, dtype=torch.float32)
    if mode == "delayed":
        return [f32(3.7), f32(-7.0), f32(scaling.UNRECORDED), None, None]
    return [f32(0.625), f32(-7.0), f32(scaling.UNRECORDED), f32(41.5), torch.tensor(5, dtype=torch.int32)]


def assert_scalars(got, want) -> None:
    for name, g, w in zip(("scale", "scale_inv", "amax", "from_amax", "count"), got, want):
        if g is None:
            continue
        if name == "amax":
            assert_float_close(g, w, "amax")
        else:
            assert_bits_equal(g, w, name)


def run_fwd(h, act, fp8, mode, mp):
    m, f = h.shape[0], act_ref.out_features(h, act)
    got_s = scalar_args(mode)
    want_s = [None if t is None else t.clone() for t in got_s]
    out = poisoned((m, f), fp8)
    out_t = None if mp is None else poisoned((f, mp), fp8)
    want, want_t = poisoned((m, f), fp8), None if mp is None else poisoned((f, mp), fp8)
    activation.act_fwd_fp8(h, act, out, out_t, *got_s)
    act_ref.act_fwd_fp8(h, act, want, want_t, *want_s)
    check_outputs(out, out_t, want, want_t, m)
    assert_scalars(got_s, want_s)


def run_bwd(da, h, act, fp8, mode, mp, dbias_dtype=torch.float32):
    m, fh = h.shape
    got_s = scalar_args(mode)
    want_s = [None if t is None else t.clone() for t in got_s]
    out, want = poisoned((m, fh), fp8), poisoned((m, fh), fp8)
    out_t = None if mp is None else poisoned((fh, mp), fp8)
    want_t = None if mp is None else poisoned((fh, mp), fp8)
    dbias = None if dbias_dtype is None else torch.full((fh,), math.nan, dtype=dbias_dtype)
    want_dbias = None if dbias_dtype is None else dbias.clone()
    activation.act_bwd_fp8(da, h, act, out, out_t, *got_s, dbias_out=dbias)
    act_ref.act_bwd_fp8(da, h, act, want, want_t, *want_s, dbias_out=want_dbias)
    check_outputs(out, out_t, want, want_t, m)
    assert_scalars(got_s, want_s)
    if dbias is not None:
        dh = act_ref.act_grad(da, h, act)
        abs_sum = torch.where(dh.isfinite(), dh, 0.0).abs().sum(dim=0).double()
        tol = 1e-6 * abs_sum + torch.finfo(dbias_dtype).eps * want_dbias.double().abs()
        g, w = dbias.double(), want_dbias.double()
        same_special = (g.isnan() & w.isnan()) | (g == w)
        assert (same_special | ((g - w).abs() <= tol)).all(), f"dbias: {g} vs {w}"


def check_outputs(out, out_t, want, want_t, m) -> None:
    assert_fp8_close(out, want, "out")
    if out_t is not None:
        assert_fp8_close(out_t, want_t, "out_t")
        assert_bits_equal(out_t[:, :m], out.t(), "out_t[:, :M] vs out.T")  # the kernel's two copies agree
        assert not out_t[:, m:].view(torch.uint8).any(), "padding columns must be zero bytes"


# --------------------------------------------------------------------------- forward


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("x_dtype", INPUTS)
@pytest.mark.parametrize("fp8", FP8)
def test_fwd_dtypes(act, x_dtype, fp8, exact_conversions):
    with activation.override_config(CPU_CONFIG):
        run_fwd(make_h(21, 70, act, x_dtype), act, fp8, "delayed", mp=32)


@pytest.mark.sweep
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("shape", [(1, 16), (15, 48), (37, 130)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("mode", ["delayed", "current"])
def test_fwd_shapes(act, shape, mode, config):
    m, f = shape
    h = make_h(m, f, act, torch.bfloat16)
    with activation.override_config(config(act)):
        run_fwd(h, act, E4M3, mode, mp=(m + 15) // 16 * 16 + 16)
        if mode == "delayed":
            run_fwd(h, act, E5M2, mode, mp=None)


# --------------------------------------------------------------------------- backward


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("x_dtype", INPUTS)
@pytest.mark.parametrize("fp8", FP8)
def test_bwd_dtypes(act, x_dtype, fp8, exact_conversions):
    h = make_h(21, 70, act, x_dtype, specials=False)
    da = make_h(21, 70, "relu", x_dtype)  # (M, F) gradient with specials
    with activation.override_config(CPU_CONFIG):
        run_bwd(da, h, act, fp8, "delayed", mp=40, dbias_dtype=x_dtype)


@pytest.mark.sweep
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("shape", [(1, 16), (15, 48), (37, 130)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("mode", ["delayed", "current"])
def test_bwd_shapes(act, shape, mode, config):
    m, f = shape
    h = make_h(m, f, act, torch.bfloat16)
    da = (torch.randn(m, f) * 2).to(torch.bfloat16)
    with activation.override_config(config(act)):
        run_bwd(da, h, act, E5M2, mode, mp=(m + 15) // 16 * 16 + 16)
        run_bwd(da, h, act, E4M3, mode, mp=None, dbias_dtype=torch.bfloat16 if mode == "delayed" else None)


@pytest.fixture
def twin_exp2(monkeypatch):
    """The interpreter's exp2 computed by torch.exp2, the twin's: what is left between kernel
    and twin is then their float32 formulas alone."""
    exp2 = lambda data: torch.exp2(torch.from_numpy(np.ascontiguousarray(data))).numpy()
    monkeypatch.setattr(_interpreter.InterpreterBuilder, "create_exp2", lambda self, arg: self.unary_op(arg, exp2))


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("fp8", FP8)
def test_same_float32_formulas_as_the_twin(act, fp8, exact_conversions, twin_exp2):
    """With the twin's exp2 the kernel's bytes and amax equal the twin's bit for bit (NaN: at
    the same places; its sign and payload mean nothing), specials and far tails included
    (scale 2^60 shows gelu down to x = -11): the kernel evaluates the twin's expressions op
    for op, its fmas rounding as the twin's `fma`."""
    h = make_h(37, 130, act, torch.float32, spread=6.0)
    da = make_h(37, 130, "relu", torch.float32, spread=6.0)
    with activation.override_config(CPU_CONFIG):
        for scale in (3.7, 2.0**60):
            for kernel, twin, args in ((activation.act_fwd_fp8, act_ref.act_fwd_fp8, (h, act)),
                                       (activation.act_bwd_fp8, act_ref.act_bwd_fp8, (da, h, act))):
                n = h.shape[1] if kernel is activation.act_bwd_fp8 else act_ref.out_features(h, act)
                outs = []
                for fn in (kernel, twin):
                    out, s = poisoned((37, n), fp8), [torch.tensor(scale), torch.tensor(0.0), torch.tensor(-1.0)]
                    fn(*args, out, None, *s)
                    outs.append((out, s[2]))
                (out, amax), (want, want_amax) = outs
                nan = want.float().isnan()
                assert torch.equal(out.float().isnan(), nan), f"{kernel.__name__}: NaN positions differ"
                got_bytes, want_bytes = out.view(torch.uint8)[~nan], want.view(torch.uint8)[~nan]
                assert torch.equal(got_bytes, want_bytes), f"{kernel.__name__} out at scale {scale}: " \
                    f"{int((got_bytes != want_bytes).sum())} bytes differ"
                assert_bits_equal(amax, want_amax, f"{kernel.__name__} amax")


@pytest.mark.parametrize("act", ACTS)
def test_wide_rows(act, exact_conversions):
    """F = 1000 (not a multiple of any tile width) under the GPU's launch shape, forward and backward."""
    h = make_h(37, 1000, act, torch.bfloat16)
    da = (torch.randn(37, 1000) * 2).to(torch.bfloat16)
    with activation.override_config(activation.launch_config(torch.device("cuda"), gated=act == "swiglu")):
        run_fwd(h, act, E4M3, "current", mp=48)
        run_bwd(da, h, act, E5M2, "delayed", mp=48)


@pytest.mark.parametrize("act", ACTS)
def test_row_strided_inputs(act, config):
    """h and da as row slices of wider tensors (row strides != widths, unaligned starts)."""
    big_h = make_h(40, 60, act, torch.float16)
    big_da = (torch.randn(40, 70) * 3).to(torch.float16)
    f = 25
    h = big_h[3:34, 1:1 + (2 * f if act == "swiglu" else f)]
    da = big_da[3:34, 5:5 + f]
    assert not h.is_contiguous() and not da.is_contiguous()
    with activation.override_config(config(act)):
        run_fwd(h, act, E4M3, "current", mp=48)
        run_bwd(da, h, act, E5M2, "delayed", mp=32)


# --------------------------------------------------------------------------- amax and current scaling


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("start", [scaling.UNRECORDED, 0.5, 1e30], ids=lambda v: f"start{v:g}")
def test_amax_passes(act, start, config):
    h = make_h(21, 50, act, torch.bfloat16, specials=False)
    da = (torch.randn(21, 50) * 3).to(torch.bfloat16)
    with activation.override_config(config(act)):
        for kernel, twin in ((lambda a: activation.act_amax(h, act, a), lambda a: act_ref.act_amax(h, act, a)),
                             (lambda a: activation.act_bwd_amax(da, h, act, a),
                              lambda a: act_ref.act_bwd_amax(da, h, act, a))):
            got, want = torch.tensor(start), torch.tensor(start)
            kernel(got)
            twin(want)
            assert_float_close(got, want, "amax")


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("special", [math.nan, -math.nan, math.inf, -math.inf], ids=["nan", "-nan", "inf", "-inf"])
def test_amax_counts_nan_as_inf(act, special, exact_conversions):
    h = make_h(21, 50, act, torch.float32, specials=False)
    h[9, 40] = 1.0  # act'(h) != 0 where da is bad
    da = torch.randn(21, 50)
    h_bad, da_bad = h.clone(), da.clone()
    h_bad[4, 7] = math.nan
    da_bad[9, 40] = special
    with activation.override_config(CPU_CONFIG):
        got = torch.tensor(scaling.UNRECORDED)
        activation.act_amax(h_bad, act, got)
        assert got.item() == math.inf
        got = torch.tensor(scaling.UNRECORDED)
        activation.act_bwd_amax(da_bad, h, act, got)
        assert got.item() == math.inf
        run_bwd(da_bad, h, act, E4M3, "delayed", mp=32)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("pow2", [False, True], ids=["exact", "pow2"])
def test_current_scaling_two_steps(act, pow2, config):
    """act_amax, then act_fwd_fp8 with from_amax (and the same for the backward), kernel vs twin
    (pow2: the scales rounded down to powers of two, the kernels' POW2)."""
    m, f = 37, 70
    h = make_h(m, f, act, torch.bfloat16, specials=False)
    da = (torch.randn(m, f) * 3).to(torch.bfloat16)
    fh = h.shape[1]
    with activation.override_config(config(act)):
        results = []
        for impl in (activation, act_ref):
            amax_a, amax_dh = torch.zeros(()), torch.zeros(())
            impl.act_amax(h, act, amax_a)
            impl.act_bwd_amax(da, h, act, amax_dh)
            s_a, inv_a, s_dh, inv_dh = torch.tensor(0.625), torch.tensor(0.0), torch.tensor(0.625), torch.tensor(0.0)
            count = torch.tensor(2, dtype=torch.int32)
            out, out_t = poisoned((m, f), E4M3), poisoned((f, 48), E4M3)
            dout, dout_t = poisoned((m, fh), E5M2), poisoned((fh, 48), E5M2)
            impl.act_fwd_fp8(h, act, out, out_t, s_a, inv_a, from_amax=amax_a, nonfinite_count=count,
                             power_of_two=pow2)
            impl.act_bwd_fp8(da, h, act, dout, dout_t, s_dh, inv_dh, from_amax=amax_dh, nonfinite_count=count,
                             power_of_two=pow2)
            results.append(dict(amax_a=amax_a, amax_dh=amax_dh, s_a=s_a, inv_a=inv_a, s_dh=s_dh, inv_dh=inv_dh,
                                out=out, out_t=out_t, dout=dout, dout_t=dout_t, count=count))
    got, want = results
    for key in ("amax_a", "amax_dh", "s_a", "inv_a", "s_dh", "inv_dh"):
        assert_float_close(got[key], want[key], key)  # the kernel's amax may differ in the last bit
    assert got["count"].item() == want["count"].item() == 2
    assert all((math.frexp(got[key].item())[0] == 0.5) == pow2 for key in ("s_a", "s_dh"))
    check_outputs(got["out"], got["out_t"], want["out"], want["out_t"], m)
    check_outputs(got["dout"], got["dout_t"], want["dout"], want["dout_t"], m)
    assert_fp8_close(got["out"], reference.saturating_cast(act_ref.act_forward(h, act), got["s_a"], E4M3),
                     "out vs the twin's values at the kernel's scale")


@pytest.mark.parametrize("from_amax, pow2", [(0.0, False), (1e-40, False), (math.inf, False), (math.nan, False),
                                             (0.0, True), (1e-40, True), (math.nan, True), (2.5, True)],
                         ids=["zero", "subnormal", "inf", "nan", "zero-pow2", "subnormal-pow2", "nan-pow2",
                              "normal-pow2"])
def test_current_scaling_edge_amaxes(from_amax, pow2, exact_conversions):
    h = make_h(15, 48, "gelu", torch.bfloat16)
    da = torch.randn(15, 48, dtype=torch.bfloat16)
    with activation.override_config(CPU_CONFIG):
        outs = []
        for fwd, bwd in ((activation.act_fwd_fp8, activation.act_bwd_fp8), (act_ref.act_fwd_fp8, act_ref.act_bwd_fp8)):
            s, inv, count = torch.tensor(0.625), torch.tensor(0.0), torch.tensor(3, dtype=torch.int32)
            out, dout = poisoned((15, 48), E4M3), poisoned((15, 48), E5M2)
            fwd(h, "gelu", out, None, s, inv, from_amax=torch.tensor(from_amax), nonfinite_count=count,
                power_of_two=pow2)
            bwd(da, h, "gelu", dout, None, s, inv, from_amax=torch.tensor(from_amax), nonfinite_count=count,
                power_of_two=pow2)
            outs.append((out, dout, s, inv, count))
    (out, dout, s, inv, count), (w_out, w_dout, w_s, w_inv, w_count) = outs
    assert_fp8_close(out, w_out, "out")
    assert_fp8_close(dout, w_dout, "dout")
    assert_bits_equal(s, w_s, "scale")
    assert_bits_equal(inv, w_inv, "scale_inv")
    assert_bits_equal(count, w_count, "count")


# --------------------------------------------------------------------------- edges and arguments


@pytest.mark.parametrize("act", ACTS)
def test_empty_inputs(act, exact_conversions):
    f = 24
    fh = 2 * f if act == "swiglu" else f
    h, da = torch.empty(0, fh, dtype=torch.bfloat16), torch.empty(0, f, dtype=torch.bfloat16)
    run_fwd(h, act, E4M3, "current", mp=16)
    run_bwd(da, h, act, E5M2, "delayed", mp=16, dbias_dtype=torch.bfloat16)
    got, want = torch.tensor(-1.0), torch.tensor(-1.0)
    activation.act_amax(h, act, got)
    act_ref.act_amax(h, act, want)
    assert_bits_equal(got, want, "amax")


def test_rejects_bad_arguments():
    """The wrappers run the twin's checks: same errors, raised before any launch."""
    h = torch.randn(8, 16, dtype=torch.bfloat16)
    scale, inv = torch.tensor(1.0), torch.tensor(1.0)
    out = torch.empty(8, 16, dtype=E4M3)
    with pytest.raises(ValueError, match="act_fwd_fp8: act must be one of 'gelu', 'gelu_tanh', 'relu', 'swiglu'"):
        activation.act_fwd_fp8(h, "silu", out, None, scale, inv)
    with pytest.raises(ValueError, match="even number of columns"):
        activation.act_amax(torch.randn(8, 15), "swiglu", torch.tensor(0.0))
    with pytest.raises(ValueError, match="act_bwd_fp8: da must be"):
        activation.act_bwd_fp8(h[:, :8], h, "gelu", out, None, scale, inv)
    with pytest.raises(ValueError, match="act_bwd_amax: h must be bfloat16"):
        activation.act_bwd_amax(h, h.double(), "relu", torch.tensor(0.0))
    with pytest.raises(ValueError, match="dbias_out must be"):
        activation.act_bwd_fp8(h, h, "gelu", out, None, scale, inv, dbias_out=torch.empty(15))


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("fp8", FP8)
def test_interpreter_conversion_within_one_ulp(act, fp8):
    """With the interpreter's own fp8 conversion: one fp8 ulp (or its known lost carry) off at most,
    in the normal range (it garbles subnormal results)."""
    h = make_h(33, 40, act, torch.float16, specials=False)
    scale = torch.tensor(3.7)
    out, out_t = poisoned((33, 40), fp8), poisoned((40, 48), fp8)
    with activation.override_config(CPU_CONFIG):
        activation.act_fwd_fp8(h, act, out, out_t, scale, torch.tensor(0.0))
    a = act_ref.act_forward(h, act)
    want = reference.saturating_cast(a, scale, fp8)
    mantissa_bits = 3 if fp8 == E4M3 else 2
    g, w = out.view(torch.uint8).int(), want.view(torch.uint8).int()
    one_ulp = (_order(out) - _order(want)).abs() <= 1
    lost_carry = ((w & ((1 << mantissa_bits) - 1)) == 0) & (g == w - (1 << mantissa_bits))
    normal_range = (a * scale).abs() >= torch.finfo(fp8).tiny
    assert (one_ulp | lost_carry | ~normal_range).all()
    assert (g == w)[normal_range].float().mean() > 0.9
    assert_bits_equal(out_t[:, :33], out.t(), "out_t[:, :M] vs out.T")
    assert not out_t[:, 33:].view(torch.uint8).any()
