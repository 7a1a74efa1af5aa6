"""The pure-torch twins of the fused MLP activation kernels (kernels/activation_reference.py).

Values against torch's own forms in float64 (forward: F.gelu, F.gelu(approximate="tanh"),
F.relu, F.silu(gate) * up; backward: torch.autograd through those forms), the FP8 outputs
bit for bit against reference.saturating_cast / cast_transpose_amax of the twin's float32
values (and ml_dtypes), the scale / amax contract of reference.cast_transpose_amax, dbias,
and the argument checks. Tolerances against float64 (the twins compute in float32):
  forward   |a - a64| <= 1e-6 + 1e-5 |a64|   (F.gelu's float64 erf form itself cancels for
                                             x < -5, and the twin's exponent rounding
                                             reaches 1.1e-5 of gelu near x = -12)
  backward  |dh - dh64| <= 1e-5 max|da| + 1e-5 |dh64|   (gelu_tanh's 1 - s near s = 1)
  dbias     |db - db64| <= 1e-6 sum_rows |dh64| + fp32 / bf16 / fp16 rounding of the result
"""
import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fp8train import scaling
from fp8train.kernels import activation_reference as act_ref
from fp8train.kernels import reference
from helpers import FP8_FORMATS, INPUT_DTYPES

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = FP8_FORMATS
INPUTS = INPUT_DTYPES
ACTS = list(act_ref.ACTIVATIONS)
# (M, F): F is the activation's width; swiglu's h is (M, 2F).
SHAPES = [(1, 16), (15, 48), (37, 1000), (64, 70)]
SHAPE_IDS = [f"{m}x{f}" for m, f in SHAPES]
ML_DTYPES = {E4M3: ml_dtypes.float8_e4m3fn, E5M2: ml_dtypes.float8_e5m2}


# --------------------------------------------------------------------------- helpers


def h_width(act: str, f: int) -> int:
    return 2 * f if act == "swiglu" else f


def make_h(m: int, f: int, act: str, dtype=torch.float32, spread: float = 3.0) -> torch.Tensor:
    """fc1 output (M, F) or (M, 2F): normal values of standard deviation `spread`."""
    return (torch.randn(m, h_width(act, f)) * spread).to(dtype)


def with_specials(t: torch.Tensor) -> torch.Tensor:
    """t with NaN, +-inf, -0, huge and tiny values at random places (t of at least 16 elements)."""
    t = t.clone()
    flat = t.view(-1)
    values = torch.tensor([math.nan, -math.nan, math.inf, -math.inf, -0.0, 1e4, -3e4, 1e-30, -60.0, 60.0])
    idx = torch.randperm(flat.numel())[:values.numel()]
    flat[idx] = values[:idx.numel()].to(t.dtype)
    return t


def torch_form(x: torch.Tensor, act: str) -> torch.Tensor:
    """The activation as torch writes it (the twin's specification), in x's dtype."""
    if act == "gelu":
        return F.gelu(x)
    if act == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if act == "relu":
        return F.relu(x)
    f = x.shape[1] // 2
    return F.silu(x[:, :f]) * x[:, f:]


def autograd_dh(da: torch.Tensor, h: torch.Tensor, act: str) -> torch.Tensor:
    """d(act(h)) / dh contracted with da, by torch.autograd in float64."""
    x = h.double().requires_grad_()
    torch_form(x, act).backward(da.double())
    return x.grad


def poisoned(shape, dtype) -> torch.Tensor:
    return torch.full(shape, 0x5A, dtype=torch.uint8).view(dtype)


def assert_bytes_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, what
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[got.element_size()]
    assert torch.equal(got.view(bits), want.view(bits)), f"{what}: {got} != {want}"


def scalars(mode: str, from_amax_value: float = 2.5):
    """(scale, scale_inv_out, amax_out, from_amax, nonfinite_count) for 'delayed' or 'current'."""
    f32 = lambda v: torch.tensor(v, dtype=torch.float32)
    if mode == "delayed":
        return f32(3.7), f32(-7.0), f32(scaling.UNRECORDED), None, None
    return f32(0.625), f32(-7.0), f32(scaling.UNRECORDED), f32(from_amax_value), torch.tensor(5, dtype=torch.int32)


def clone_all(ts):
    return tuple(None if t is None else t.clone() for t in ts)


# --------------------------------------------------------------------------- float32 math vs torch


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", INPUTS)
def test_forward_matches_torch_float64(shape, act, dtype):
    h = make_h(*shape, act, dtype)
    a = act_ref.act_forward(h, act)
    want = torch_form(h.double(), act)
    assert a.dtype == torch.float32 and a.shape == shape
    torch.testing.assert_close(a.double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", INPUTS)
def test_backward_matches_autograd_float64(shape, act, dtype):
    m, f = shape
    h = make_h(m, f, act, dtype)
    da = torch.randn(m, f).to(dtype)
    dh = act_ref.act_grad(da, h, act)
    want = autograd_dh(da, h, act)
    assert dh.dtype == torch.float32 and dh.shape == h.shape
    torch.testing.assert_close(dh.double(), want, rtol=1e-5, atol=1e-5 * da.abs().max().item())


def math_form(x: float, act: str, up: float = 1.5) -> float:
    """act(x) in float64 from Python's math module: an independent reference (erfc form of
    Phi, no cancellation) for finite x. swiglu: silu(x) * up."""
    if act == "gelu":
        return x * 0.5 * math.erfc(-x / math.sqrt(2))
    if act == "gelu_tanh":
        return 0.5 * x * (1 + math.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    if act == "relu":
        return x if not x < 0 else 0.0  # -0.0 stays -0.0
    return x / (1 + math.exp(-x)) * up if x > -700 else -0.0  # exp(700+) overflows float64


# act(+inf) and act(-inf), the IEEE evaluation of each formula: x * Phi(x), x * sigmoid(...)
# and silu(x) * 1.5 are inf * 1 at +inf and -inf * 0 = NaN at -inf; relu is max(x, 0).
# (torch's vectorized float32 F.gelu on the CPU is no specification here: on some machines it
# returns NaN for +inf inside a row and inf for the same value alone.)
INFINITIES = {"gelu": (math.inf, math.nan), "gelu_tanh": (math.inf, math.nan), "relu": (math.inf, 0.0),
              "swiglu": (math.inf, math.nan)}


@pytest.mark.parametrize("act", ACTS)
def test_special_values_are_the_ieee_math(act):
    """NaN, +-inf, -0.0, huge and tiny inputs: NaN stays NaN, infinities as INFINITIES says,
    and every finite input gives its float64 math value rounded to float32, within 1e-6
    relative, with the sign of a zero result (the sign of x for gelu, gelu_tanh, swiglu)."""
    values = [math.nan, -math.inf, math.inf, -0.0, 0.0, -1e4, 1e4, -20.0, 20.0, 1e-30, -1e-30, 2.0]
    h = torch.tensor([values])
    if act == "swiglu":
        h = torch.cat([h, torch.full_like(h, 1.5)], dim=1)
    got = act_ref.act_forward(h, act)[0].tolist()
    for x, a in zip(values, got):
        if math.isnan(x):
            want = math.nan
        elif math.isinf(x):
            want = INFINITIES[act][0 if x > 0 else 1]
        else:
            want = float(np.float32(math_form(x, act)))
        if math.isnan(want) or math.isinf(want) or want == 0:
            assert a == want or (math.isnan(a) and math.isnan(want)), f"{act}({x}) = {a}, want {want}"
            assert math.copysign(1, a) == math.copysign(1, want) or math.isnan(want), f"{act}({x}): sign of {a}"
        else:
            assert abs(a - want) <= 1e-6 * abs(want), f"{act}({x}) = {a}, want {want}"
    if act == "relu":  # relu' = (x > 0), except that torch's threshold_backward passes da through at NaN x.
        da = torch.full_like(h, 3.0)
        want_dh = torch.where(h.isnan() | (h > 0), 3.0, 0.0)
        assert_bytes_equal(act_ref.act_grad(da, h, act), want_dh, "relu'")
        x = h.clone().requires_grad_()
        F.relu(x).backward(da)
        assert_bytes_equal(act_ref.act_grad(da, h, act), x.grad, "relu' vs autograd")


def test_fma_rounds_once():
    """fma(a, b, c) is a * b + c rounded once, like the GPU's fma.rn.f32: also where rounding
    the float64 sum to float32 would round twice (a tie after the first rounding)."""
    one = 1 + 2.0**-12  # one * one = 1 + 2^-11 + 2^-24: a float32 tie, broken by c = +-2^-60
    got = act_ref.fma(torch.tensor([one, -one]), torch.tensor([one, one]), torch.tensor([2.0**-60, -2.0**-60]))
    want = 1 + 2.0**-11 + 2.0**-23
    assert got.tolist() == [want, -want]
    assert (torch.tensor([one]).double() ** 2 + 2.0**-60).float().item() != want  # two roundings miss it
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(4000, generator=g), torch.randn(4000, generator=g)
    c = torch.randn(4000, generator=g) * torch.exp2(torch.randint(-30, 10, (4000,), generator=g).float())
    exact = [Fraction(x) * Fraction(y) + Fraction(z) for x, y, z in zip(a.tolist(), b.tolist(), c.tolist())]
    # float32 neighbours of float64(exact) bracket the exact value; the nearer one (ties to even) is the fma
    got = act_ref.fma(a, b, c)
    lo = torch.tensor([float(e) for e in exact], dtype=torch.float64).float()
    for e, g_, l_ in zip(exact, got.tolist(), lo.tolist()):
        cands = [l_, float(np.nextafter(np.float32(l_), np.float32(math.inf))),
                 float(np.nextafter(np.float32(l_), np.float32(-math.inf)))]
        best = min(cands, key=lambda v: (abs(Fraction(v) - e), int(np.float32(v).view(np.int32)) & 1))
        assert g_ == best
    specials = act_ref.fma(torch.tensor([math.inf, 0.0, -0.0, 2.0]), torch.tensor([0.0, 5.0, 5.0, math.inf]),
                           torch.tensor([1.0, -0.0, -0.0, -math.inf]))
    assert specials[0].isnan() and specials[3].isnan()
    assert_bytes_equal(specials[1:3], torch.tensor([0.0, -0.0]), "signed zeros")


def test_gelu_keeps_relative_precision_in_its_tail():
    """gelu and gelu' for x in [-12, -3] within 2e-5 (relative) of float64 erfc forms: no
    1 + erf cancellation (the erf form is off by 10% at x = -5, 100% past -5.55). 2e-5: the
    exponent, up to 72 in size, is rounded to float32 (6e-8 relative) a few times."""
    x = torch.linspace(-12.0, -3.0, 20001)
    x64 = x.double()
    cdf64 = 0.5 * torch.special.erfc(-x64 / math.sqrt(2))
    pdf64 = torch.exp(-x64 * x64 / 2) / math.sqrt(2 * math.pi)
    a = act_ref.act_forward(x[None], "gelu")[0].double()
    dh = act_ref.act_grad(torch.ones(1, x.numel()), x[None], "gelu")[0].double()
    for got, want, what in ((a, x64 * cdf64, "gelu"), (dh, cdf64 + x64 * pdf64, "gelu'")):
        rel = ((got - want).abs() / want.abs()).max().item()
        assert rel <= 2e-5, f"{what}: relative error {rel:.3g}"


@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "swiglu"])
def test_infinite_gradients_follow_the_cut(act):
    """da = +-inf gives +-inf where act'(x) != 0 and NaN where it is exactly 0: gelu' is 0 past
    x = -12 (the twin's cut) and tiny but nonzero just inside it; same for the others' tails."""
    x = torch.tensor([[-1e4, -12.5, -12.0, -11.0, -5.0, 0.5, 30.0]])
    f = x.shape[1]
    h = torch.cat([x, torch.full_like(x, 1.5)], dim=1) if act == "swiglu" else x
    dh = act_ref.act_grad(torch.full((1, f), math.inf), h, act)[:, :f]
    d1 = act_ref.act_grad(torch.ones(1, f), h, act)[:, :f]
    assert torch.equal(dh.isnan(), d1 == 0)
    assert torch.equal(dh[d1 != 0], (d1[d1 != 0].sign() * math.inf))
    if act == "gelu":
        assert (d1[0, :2] == 0).all() and (d1[0, 2:5] != 0).all()
        assert_bytes_equal(act_ref.act_forward(x, act)[0, :2], torch.tensor([-0.0, -0.0]), "gelu past the cut")


# --------------------------------------------------------------------------- FP8 outputs


@pytest.mark.sweep
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("x_dtype", INPUTS)
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("mode", ["delayed", "current"])
def test_fwd_fp8_is_cast_transpose_of_the_activation(shape, act, x_dtype, fp8, mode):
    """act_fwd_fp8 == cast_transpose_amax(act_forward(h)): bytes, padding and every scalar."""
    m, f = shape
    h = with_specials(make_h(m, f, act, x_dtype, spread=30.0))
    mp = (m + 15) // 16 * 16 + 16  # a padding tile of zeros at least
    args = scalars(mode)
    want_args = clone_all(args)
    out, out_t = poisoned((m, f), fp8), poisoned((f, mp), fp8)
    want, want_t = poisoned((m, f), fp8), poisoned((f, mp), fp8)
    act_ref.act_fwd_fp8(h, act, out, out_t, *args)
    reference.cast_transpose_amax(act_ref.act_forward(h, act), want, want_t, *want_args)
    assert_bytes_equal(out, want, "out")
    assert_bytes_equal(out_t, want_t, "out_t")
    assert not out_t[:, m:].view(torch.uint8).any(), "out_t padding must be zero bytes"
    for name, got_s, want_s in zip(("scale", "scale_inv", "amax", "from_amax", "count"), args, want_args):
        if got_s is not None:
            assert_bytes_equal(got_s, want_s, name)
    # The bytes are the saturating cast of the float32 activation (and ml_dtypes agrees).
    a = act_ref.act_forward(h, act)
    assert_bytes_equal(out, reference.saturating_cast(a, args[0], fp8), "saturating_cast")
    y = np.clip(a.numpy() * args[0].numpy(), -scaling.fp8_max(fp8), scaling.fp8_max(fp8))
    ours = out.view(torch.uint8).numpy()
    theirs = y.astype(ML_DTYPES[fp8]).view(np.uint8)
    nan = np.isnan(y)
    assert np.array_equal(ours[~nan], theirs[~nan]) and np.isnan(out.float().numpy()[nan]).all()


@pytest.mark.sweep
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("x_dtype", INPUTS)
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("mode", ["delayed", "current"])
def test_bwd_fp8_is_cast_transpose_of_dh(shape, act, x_dtype, fp8, mode):
    """act_bwd_fp8 == cast_transpose_amax(act_grad(da, h)), and dbias the column sums of dh."""
    m, f = shape
    h = make_h(m, f, act, x_dtype)
    da = with_specials(torch.randn(m, f) * 4).to(x_dtype) if m * f >= 16 else torch.randn(m, f).to(x_dtype)
    fh = h.shape[1]
    mp = m + 21
    args = scalars(mode)
    want_args = clone_all(args)
    out, out_t = poisoned((m, fh), fp8), poisoned((fh, mp), fp8)
    want, want_t = poisoned((m, fh), fp8), poisoned((fh, mp), fp8)
    dbias = torch.full((fh,), 77.0)
    act_ref.act_bwd_fp8(da, h, act, out, out_t, *args, dbias_out=dbias)
    dh = act_ref.act_grad(da, h, act)
    reference.cast_transpose_amax(dh, want, want_t, *want_args)
    assert_bytes_equal(out, want, "out")
    assert_bytes_equal(out_t, want_t, "out_t")
    assert not out_t[:, m:].view(torch.uint8).any(), "out_t padding must be zero bytes"
    for name, got_s, want_s in zip(("scale", "scale_inv", "amax", "from_amax", "count"), args, want_args):
        if got_s is not None:
            assert_bytes_equal(got_s, want_s, name)
    assert_bytes_equal(dbias, dh.sum(dim=0), "dbias")


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("fp8", FP8)
def test_without_transpose_is_cast_amax(act, fp8):
    h = make_h(15, 48, act, torch.bfloat16)
    da = torch.randn(15, 48, dtype=torch.bfloat16)
    for fn, values, n in ((lambda o, *s: act_ref.act_fwd_fp8(h, act, o, None, *s), act_ref.act_forward(h, act), 48),
                          (lambda o, *s: act_ref.act_bwd_fp8(da, h, act, o, None, *s), act_ref.act_grad(da, h, act),
                           h.shape[1])):
        args = scalars("delayed")
        want_args = clone_all(args)
        out, want = poisoned((15, n), fp8), poisoned((15, n), fp8)
        fn(out, *args)
        reference.cast_amax(values, want, *want_args)
        assert_bytes_equal(out, want, "out")
        assert_bytes_equal(args[2], want_args[2], "amax")
        assert_bytes_equal(args[1], want_args[1], "scale_inv")


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dbias_dtype", INPUTS)
def test_dbias_matches_autograd(act, dbias_dtype):
    m, f = 37, 1000
    h = make_h(m, f, act, torch.bfloat16)
    da = torch.randn(m, f, dtype=torch.bfloat16)
    fh = h.shape[1]
    dbias = torch.full((fh,), math.nan, dtype=dbias_dtype)
    args = scalars("delayed")
    act_ref.act_bwd_fp8(da, h, act, torch.empty(m, fh, dtype=E5M2), None, *args, dbias_out=dbias)
    want64 = autograd_dh(da, h, act)
    tol = 1e-6 * want64.abs().sum(dim=0) + torch.finfo(dbias_dtype).eps * want64.sum(dim=0).abs()
    assert ((dbias.double() - want64.sum(dim=0)).abs() <= tol).all()
    assert_bytes_equal(dbias, act_ref.act_grad(da, h, act).sum(dim=0).to(dbias_dtype), "dbias in its dtype")


@pytest.mark.parametrize("act", ACTS)
def test_row_strided_inputs(act):
    """h and da as row slices of wider tensors give the results of their contiguous copies."""
    big_h = make_h(40, 60, act, torch.float16)
    big_da = torch.randn(40, 70, dtype=torch.float16)
    fh = big_h.shape[1] - (10 if act == "swiglu" else 6)  # even for swiglu
    h, da = big_h[3:34, :fh], big_da[3:34, 2:2 + act_ref.out_features(big_h[:, :fh], act)]
    assert not h.is_contiguous() and not da.is_contiguous()
    f = da.shape[1]
    results = []
    for hh, dd in ((h, da), (h.contiguous(), da.contiguous())):
        out, out_t = poisoned((31, f), E4M3), poisoned((f, 32), E4M3)
        dout, dout_t = poisoned((31, fh), E5M2), poisoned((fh, 48), E5M2)
        dbias, amax = torch.empty(fh), torch.tensor(-1.0)
        act_ref.act_fwd_fp8(hh, act, out, out_t, torch.tensor(2.0), torch.tensor(0.0), amax)
        act_ref.act_bwd_fp8(dd, hh, act, dout, dout_t, torch.tensor(0.5), torch.tensor(0.0), dbias_out=dbias)
        results.append((out, out_t, dout, dout_t, dbias, amax))
    for name, a, b in zip(("out", "out_t", "dout", "dout_t", "dbias", "amax"), *results):
        assert_bytes_equal(a, b, name)


# --------------------------------------------------------------------------- amax and current scaling


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("start", [scaling.UNRECORDED, 0.0, 0.5, 1e30], ids=lambda v: f"start{v:g}")
def test_amax_accumulates(act, start):
    h = make_h(15, 48, act, torch.bfloat16)
    da = torch.randn(15, 48, dtype=torch.bfloat16)
    for got_fn, values in ((lambda a: act_ref.act_amax(h, act, a), act_ref.act_forward(h, act)),
                           (lambda a: act_ref.act_bwd_amax(da, h, act, a), act_ref.act_grad(da, h, act))):
        got = torch.tensor(start)
        got_fn(got)
        assert_bytes_equal(got, torch.maximum(torch.tensor(start), values.abs().max()), "amax")
        assert got.item() > 0


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("special", [math.nan, -math.nan, math.inf, -math.inf], ids=["nan", "-nan", "inf", "-inf"])
def test_amax_counts_nan_as_inf(act, special):
    """A NaN activation / gradient makes the amax +inf (never NaN, never hidden)."""
    h = make_h(15, 48, act)
    h[9, 40] = 1.0  # act'(h) != 0 where da is bad (relu would mask it otherwise)
    da = torch.randn(15, 48)
    h_bad = h.clone()
    h_bad[4, 7] = math.nan
    da_bad = da.clone()
    da_bad[9, 40] = special
    got = torch.tensor(scaling.UNRECORDED)
    act_ref.act_amax(h_bad, act, got)
    assert got.item() == math.inf
    got = torch.tensor(scaling.UNRECORDED)
    act_ref.act_bwd_amax(da_bad, h, act, got)
    assert got.item() == math.inf
    got = torch.tensor(scaling.UNRECORDED)
    act_ref.act_bwd_fp8(da_bad, h, act, torch.empty(h.shape, dtype=E5M2), None, torch.tensor(1.0),
                        torch.tensor(0.0), amax_out=got)
    assert got.item() == math.inf


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("fp8", FP8)
def test_current_scaling_two_steps(act, fp8):
    """act_amax, then act_fwd_fp8 with from_amax: the scale is compute_scale of the activation's amax."""
    m, f = 37, 1000
    h = make_h(m, f, act, torch.bfloat16)
    da = torch.randn(m, f, dtype=torch.bfloat16)
    for first_pass, second_pass, values, n in (
            (lambda a: act_ref.act_amax(h, act, a),
             lambda *s, **k: act_ref.act_fwd_fp8(h, act, *s, **k), act_ref.act_forward(h, act), f),
            (lambda a: act_ref.act_bwd_amax(da, h, act, a),
             lambda *s, **k: act_ref.act_bwd_fp8(da, h, act, *s, **k), act_ref.act_grad(da, h, act), h.shape[1])):
        amax = torch.zeros(())
        first_pass(amax)
        assert_bytes_equal(amax, reference.abs_max(values), "first pass amax")
        scale, inv, count = torch.tensor(0.625), torch.tensor(0.0), torch.tensor(3, dtype=torch.int32)
        out, out_t = poisoned((m, n), fp8), poisoned((n, 48), fp8)
        second_pass(out, out_t, scale, inv, from_amax=amax, nonfinite_count=count)
        want_scale = scaling.compute_scale(amax, torch.tensor(0.625), scaling.fp8_max(fp8))
        assert_bytes_equal(scale, want_scale, "scale")
        assert_bytes_equal(inv, torch.reciprocal(want_scale), "scale_inv")
        assert count.item() == 3
        assert_bytes_equal(out, reference.saturating_cast(values, want_scale, fp8), "out")
        assert values.abs().max() * want_scale <= scaling.fp8_max(fp8) * (1 + 1e-6)  # the amax maps to fp8_max


@pytest.mark.parametrize("from_amax, want_scale, counted", [(0.0, 0.625, 0), (math.inf, 0.625, 1), (math.nan, 0.625, 1),
                                                           (1e-40, scaling.SCALE_MAX, 0)],
                         ids=["zero", "inf", "nan", "subnormal"])
def test_current_scaling_edge_amaxes(from_amax, want_scale, counted):
    """amax 0 / inf / NaN keep the old scale (inf and NaN count once); subnormal clamps to 2**126."""
    h = make_h(15, 48, "gelu")
    scale, inv, count = torch.tensor(0.625), torch.tensor(0.0), torch.tensor(3, dtype=torch.int32)
    out = torch.empty(15, 48, dtype=E4M3)
    act_ref.act_fwd_fp8(h, "gelu", out, None, scale, inv, from_amax=torch.tensor(from_amax), nonfinite_count=count)
    assert scale.item() == want_scale
    assert count.item() == 3 + counted
    assert_bytes_equal(out, reference.saturating_cast(act_ref.act_forward(h, "gelu"), scale, E4M3), "out")


# --------------------------------------------------------------------------- empty inputs and bad arguments


@pytest.mark.parametrize("act", ACTS)
def test_empty_inputs_touch_only_scalars(act):
    fh = 48 if act == "swiglu" else 24
    f = 24
    h, da = torch.empty(0, fh, dtype=torch.bfloat16), torch.empty(0, f, dtype=torch.bfloat16)
    amax = torch.tensor(-1.0)
    act_ref.act_amax(h, act, amax)
    assert amax.item() == 0.0  # as reference.amax of an empty tensor
    out_t = poisoned((f, 16), E4M3)
    scale, inv, amax = torch.tensor(2.0), torch.tensor(0.0), torch.tensor(-1.0)
    act_ref.act_fwd_fp8(h, act, torch.empty(0, f, dtype=E4M3), out_t, scale, inv, amax)
    assert not out_t.view(torch.uint8).any() and inv.item() == 0.5 and amax.item() == 0.0
    dbias, dout_t = torch.full((fh,), 5.0, dtype=torch.bfloat16), poisoned((fh, 16), E5M2)
    act_ref.act_bwd_fp8(da, h, act, torch.empty(0, fh, dtype=E5M2), dout_t, scale, inv, dbias_out=dbias)
    assert not dout_t.view(torch.uint8).any() and not dbias.any()


def test_rejects_bad_arguments():
    h = torch.randn(8, 16, dtype=torch.bfloat16)
    da = torch.randn(8, 16, dtype=torch.bfloat16)
    scale, inv = torch.tensor(1.0), torch.tensor(1.0)
    out = torch.empty(8, 16, dtype=E4M3)
    fwd = act_ref.act_fwd_fp8
    bwd = act_ref.act_bwd_fp8
    with pytest.raises(ValueError, match="act_fwd_fp8: act must be one of 'gelu', 'gelu_tanh', 'relu', 'swiglu'"):
        fwd(h, "silu", out, None, scale, inv)
    with pytest.raises(ValueError, match="act_amax: act must be one of"):
        act_ref.act_amax(h, "GELU", torch.tensor(0.0))
    with pytest.raises(ValueError, match="even number of columns"):
        fwd(torch.randn(8, 15), "swiglu", torch.empty(8, 7, dtype=E4M3), None, scale, inv)
    with pytest.raises(ValueError, match="act_fwd_fp8: h must be bfloat16, float16 or float32"):
        fwd(h.double(), "gelu", out, None, scale, inv)
    with pytest.raises(ValueError, match="h must be 2-D"):
        fwd(h.view(2, 4, 16), "gelu", out, None, scale, inv)
    with pytest.raises(ValueError, match="unit stride along its columns"):
        fwd(torch.randn(16, 8, dtype=torch.bfloat16).t(), "gelu", out, None, scale, inv)
    with pytest.raises(ValueError, match="out must be float8"):
        fwd(h, "gelu", torch.empty(8, 16), None, scale, inv)
    with pytest.raises(ValueError, match=r"out must be a contiguous tensor of shape \(8, 8\)"):
        fwd(torch.randn(8, 16), "swiglu", out, None, scale, inv)
    with pytest.raises(ValueError, match="contiguous"):
        fwd(h, "gelu", torch.empty(16, 8, dtype=E4M3).t(), None, scale, inv)
    with pytest.raises(ValueError, match="out_t must be"):
        fwd(h, "gelu", out, torch.empty(16, 7, dtype=E4M3), scale, inv)
    with pytest.raises(ValueError, match="share an FP8 dtype"):
        fwd(h, "gelu", out, torch.empty(16, 8, dtype=E5M2), scale, inv)
    with pytest.raises(ValueError, match="scale must be"):
        fwd(h, "gelu", out, None, scale.double(), inv)
    with pytest.raises(ValueError, match="different buffers"):
        a = torch.tensor(1.0)
        fwd(h, "gelu", out, None, scale, inv, amax_out=a, from_amax=a)
    with pytest.raises(ValueError, match="nonfinite_count"):
        fwd(h, "gelu", out, None, scale, inv, from_amax=torch.tensor(1.0), nonfinite_count=torch.tensor(0))
    with pytest.raises(ValueError, match="act_bwd_fp8: da must be"):
        bwd(da, torch.randn(8, 16), "swiglu", out, None, scale, inv)
    with pytest.raises(ValueError, match="act_bwd_fp8: da must be bfloat16"):
        bwd(da.double(), h, "gelu", out, None, scale, inv)
    with pytest.raises(ValueError, match=r"act_bwd_fp8: out must be a contiguous tensor of shape \(8, 32\)"):
        bwd(da, torch.randn(8, 32), "swiglu", out, None, scale, inv)
    with pytest.raises(ValueError, match=r"dbias_out must be .* of shape \(16,\)"):
        bwd(da, h, "gelu", out, None, scale, inv, dbias_out=torch.empty(8))
    with pytest.raises(ValueError, match="dbias_out must be"):
        bwd(da, h, "gelu", out, None, scale, inv, dbias_out=torch.empty(16, dtype=torch.float64))
    with pytest.raises(ValueError, match="act_bwd_amax: da must be"):
        act_ref.act_bwd_amax(da[:4], h, "relu", torch.tensor(0.0))
    with pytest.raises(ValueError, match="act_bwd_amax: amax_out must be"):
        act_ref.act_bwd_amax(da, h, "relu", torch.tensor(0.0, dtype=torch.float64))
