"""The norm kernels (kernels/norm.py) under the Triton interpreter on CPU, against their twins.

Run with `TRITON_INTERPRET=1 python -m pytest tests/interpret` (skipped otherwise).

The interpreter's own conversions are not the hardware's (fp32 -> fp8 rounds on the first
cut-off bit, fp32 -> bf16 truncates, bf16 -> fp32 flushes subnormals; see
test_kernels_interpret.py), so most tests swap in exact ones (fixture `exact_conversions`).
Then, given the same row statistics (`stats_ready`), the kernel evaluates y with the twin's
operations in the twin's order, and everything is compared bit for bit: fp8 bytes, the
transposed copy and its padding, y_out, amax, scale, scale_inv, count. Statistics the
kernel computes itself are summed in another order: mean, rstd and dx / dweight / dbias
are compared within float32 tolerances, and the fp8 bytes that follow from them within one
fp8 ulp. `test_interpreter_conversion_within_one_ulp` keeps the interpreter's conversion.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET", "0").lower() not in ("1", "true", "yes", "on"):
    pytest.skip("Triton interpreter tests: run with TRITON_INTERPRET=1", allow_module_level=True)
pytest.importorskip("triton")


from fp8train import scaling  # noqa: E402
from fp8train.kernels import norm  # noqa: E402
from fp8train.kernels import norm_reference as ref  # noqa: E402
from helpers import FP8_FORMATS  # noqa: E402

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = FP8_FORMATS
X_DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16"),
            pytest.param(torch.float32, id="fp32")]
KINDS = [pytest.param(True, id="layernorm"), pytest.param(False, id="rmsnorm")]
# Launch shapes: the interpreter's own (steps of 4 x 16, 8 x 16 tiles: several row blocks
# per program, several chunks per row, tails) and the GPU's (whole rows in one step).
CONFIGS = [pytest.param(norm.launch_configs(torch.device("cpu")), id="cpu-config"),
           pytest.param(norm.launch_configs(torch.device("cuda")), id="gpu-config")]
# (1, 16): one row; (15, 48): 3 chunks of 16 under the cpu config; (37, 100): a 4-column tail.
SHAPES = [pytest.param((1, 16), id="1x16"), pytest.param((15, 48), id="15x48"), pytest.param((37, 100), id="37x100")]
EPS = 1e-5
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                                        "ignore:invalid value encountered:RuntimeWarning",
                                        "ignore:divide by zero encountered:RuntimeWarning")


# --------------------------------------------------------------------------- helpers


# exact_conversions: tests/interpret/conftest.py


@pytest.fixture(params=CONFIGS)
def config(request, exact_conversions):
    """Every test with this fixture runs under both launch shapes, with exact conversions."""
    with norm.override_configs(request.param):
        yield request.param


def make_x(shape, dtype) -> torch.Tensor:
    """Rows with their own offset and scale (2^-6 .. 2^6)."""
    m, k = shape
    scale = torch.exp2(torch.randint(-6, 7, (m, 1)).float())
    return ((torch.randn(m, k) + torch.randn(m, 1) * 3) * scale).to(dtype)


def make_params(k, layer, dtype=torch.float32):
    weight = (torch.randn(k) * 0.5 + 1).to(dtype)
    return weight, (torch.randn(k).to(dtype) if layer else None)


def stats_buffers(m, layer):
    return (torch.full((m,), math.nan) if layer else None), torch.full((m,), math.nan)


def clone(t):
    return None if t is None else t.clone()


def poisoned(shape, dtype) -> torch.Tensor:
    """An fp8 tensor full of 0x5A bytes, so elements a kernel forgot to write stand out."""
    return torch.full(shape, 0x5A, dtype=torch.uint8).view(dtype)


def assert_bits_equal(got, want, what) -> None:
    int_view = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[got.element_size()]
    assert got.dtype == want.dtype and got.shape == want.shape, what
    assert torch.equal(got.view(int_view), want.view(int_view)), f"{what}: {got} != {want}"


def assert_fp8_equal(got, want, what="fp8 output") -> None:
    """Bytewise, except that any NaN encoding matches any other (the GPU tests pin those)."""
    g, w = got.view(torch.uint8), want.view(torch.uint8)
    nan_w = want.float().isnan()
    assert torch.equal(got.float().isnan(), nan_w), f"{what}: NaN positions differ"
    bad = (g != w) & ~nan_w
    assert not bad.any(), f"{what}: {int(bad.sum())} bytes differ, e.g. got {g[bad][:8].tolist()} want {w[bad][:8].tolist()}"


def assert_fp8_within_one_ulp(got, want, what="fp8 output", min_equal=0.9) -> None:
    """Neighbouring fp8 values at most (+0 and -0 as one), NaN where the other has NaN."""
    nan_w = want.float().isnan()
    assert torch.equal(got.float().isnan(), nan_w), f"{what}: NaN positions differ"
    order = lambda b: torch.where(b >= 0x80, -(b & 0x7F), b & 0x7F)
    dist = (order(got.view(torch.uint8).int()) - order(want.view(torch.uint8).int())).abs()[~nan_w]
    assert (dist <= 1).all(), f"{what}: {int((dist > 1).sum())} bytes more than one ulp apart"
    assert (dist == 0).float().mean() >= min_equal, f"{what}: only {(dist == 0).float().mean():.3f} equal"


def assert_rows_close(got, want, rel, what) -> None:
    """|got - want| <= rel * max |want| of the row (the float32 summation-order tolerance)."""
    got, want = got.double().reshape(want.shape[0], -1), want.double().reshape(want.shape[0], -1)
    bound = rel * want.abs().amax(dim=1, keepdim=True)
    err = (got - want).abs()
    assert (err <= bound).all(), f"{what}: error {err.max().item():.3g} above the bound"


# One ulp of each dtype relative to the value, at most (float32: the summation tolerance).
ROUNDING = {torch.float32: 1e-5, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


class Fwd:
    """One norm_fwd_fp8 call's outputs, poisoned before the call."""

    def __init__(self, x, fp8, layer, mp=None, scale=3.7, from_amax=None, stats=None, with_y=True, pow2=False):
        m, k = x.shape
        self.mean, self.rstd = stats if stats is not None else stats_buffers(m, layer)
        self.out = poisoned((m, k), fp8)
        self.out_t = None if mp is None else poisoned((k, mp), fp8)
        self.scale, self.scale_inv = torch.tensor(scale), torch.tensor(-7.0)
        self.amax = torch.tensor(scaling.UNRECORDED)
        self.from_amax = from_amax
        self.count = None if from_amax is None else torch.tensor(5, dtype=torch.int32)
        self.y = torch.full((m, k), math.nan, dtype=x.dtype) if with_y else None
        self.pow2 = pow2

    def run(self, impl, x, weight, bias, stats_ready=False) -> "Fwd":
        impl.norm_fwd_fp8(x, weight, bias, EPS, self.mean, self.rstd, self.out, self.out_t, self.scale,
                          self.scale_inv, self.amax, self.from_amax, self.count, self.y, stats_ready, self.pow2)
        return self

    def assert_bits_equal(self, other: "Fwd") -> None:
        assert_fp8_equal(self.out, other.out, "out")
        if self.out_t is not None:
            assert_fp8_equal(self.out_t, other.out_t, "out_t")
        for name in ("mean", "rstd", "y", "scale", "scale_inv", "amax", "count"):
            a, b = getattr(self, name), getattr(other, name)
            if a is not None:
                assert_bits_equal(a, b, name)


def check_transposed_copy(f: Fwd, m: int) -> None:
    assert_bits_equal(f.out_t[:, :m], f.out.t().contiguous(), "out_t[:, :M] vs out.T")
    assert not f.out_t[:, m:].view(torch.uint8).any(), "padding columns must be zero bytes"


# --------------------------------------------------------------------------- forward


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("layer", KINDS)
def test_norm_stats(shape, layer, config):
    m, k = shape
    x = make_x(shape, (torch.bfloat16, torch.float16, torch.float32)[m % 3])
    weight, bias = make_params(k, layer, torch.bfloat16)
    got, want = stats_buffers(m, layer), stats_buffers(m, layer)
    a_got, a_want = torch.tensor(scaling.UNRECORDED), torch.tensor(scaling.UNRECORDED)
    norm.norm_stats(x, weight, bias, EPS, *got, amax_out=a_got)
    ref.norm_stats(x, weight, bias, EPS, *want, amax_out=a_want)
    if layer:
        assert_rows_close(got[0], want[0], 1e-5, "mean")  # relative to |mean| itself: offsets are large
    assert_rows_close(got[1], want[1], 1e-5, "rstd")
    assert_rows_close(a_got.view(1), a_want.view(1), 1e-5, "amax")
    _, rstd_only = stats_buffers(m, layer)
    norm.norm_stats(x, weight, bias, EPS, got[0], rstd_only)  # without the amax: no second loop
    assert_bits_equal(rstd_only, got[1], "rstd without amax")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("layer", KINDS)
@pytest.mark.parametrize("x_dtype", X_DTYPES)
def test_fwd_without_cast(shape, layer, x_dtype, config):
    """norm_fwd (no cast): statistics within float32 tolerance of the twin's, and y the bits
    of norm_stats' statistics followed by a stats_ready norm_fwd_fp8's y."""
    m, k = shape
    x = make_x(shape, x_dtype)
    weight, bias = make_params(k, layer, x_dtype)
    got, want = stats_buffers(m, layer), stats_buffers(m, layer)
    y, y_want = torch.full((m, k), math.nan).to(x_dtype), torch.full((m, k), math.nan).to(x_dtype)
    norm.norm_fwd(x, weight, bias, EPS, *got, y)
    ref.norm_fwd(x, weight, bias, EPS, *want, y_want)
    if layer:
        assert_rows_close(got[0], want[0], 1e-5, "mean")
    assert_rows_close(got[1], want[1], 1e-5, "rstd")
    stats = stats_buffers(m, layer)
    norm.norm_stats(x, weight, bias, EPS, *stats)
    y_two = torch.full((m, k), math.nan).to(x_dtype)
    norm.norm_fwd_fp8(x, weight, bias, EPS, *stats, torch.empty(m, k, dtype=E4M3), None, torch.tensor(1.0),
                      torch.tensor(0.0), y_out=y_two, stats_ready=True)
    assert_bits_equal(got[1], stats[1], "rstd vs norm_stats")
    assert_bits_equal(y, y_two, "y vs norm_stats then norm_fwd_fp8")


@pytest.mark.sweep
@pytest.mark.parametrize("shape", SHAPES[:2])
@pytest.mark.parametrize("x_dtype", X_DTYPES)
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("layer", KINDS)
def test_fwd_from_given_stats_bit_exact(shape, x_dtype, fp8, layer, config):
    """stats_ready: the kernel's y is the twin's, so every output matches bit for bit."""
    m, k = shape
    x = make_x(shape, x_dtype)
    weight, bias = make_params(k, layer, (torch.float32, torch.bfloat16)[m % 2])
    mean, rstd = ref.row_stats(x, EPS, layer)
    stats = lambda: ((mean.clone() if layer else None), rstd.clone())
    mp = m + 5
    got = Fwd(x, fp8, layer, mp=mp, stats=stats()).run(norm, x, weight, bias, stats_ready=True)
    want = Fwd(x, fp8, layer, mp=mp, stats=stats()).run(ref, x, weight, bias, stats_ready=True)
    got.assert_bits_equal(want)
    check_transposed_copy(got, m)
    # Row-major only (the other branch of the kernel), without y_out.
    got = Fwd(x, fp8, layer, stats=stats(), with_y=False).run(norm, x, weight, bias, stats_ready=True)
    assert_fp8_equal(got.out, want.out, "out without out_t")
    assert_bits_equal(got.amax, want.amax, "amax without out_t")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("layer", KINDS)
@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "tiles"])
def test_fwd_computes_stats(shape, layer, transposed, config):
    """One launch (delayed scaling): the stats within float32 tolerance, the rest follows."""
    m, k = shape
    x_dtype = (torch.bfloat16, torch.float16, torch.float32)[(m + transposed) % 3]
    fp8 = (E4M3, E5M2)[(m + layer) % 2]
    x = make_x(shape, x_dtype)
    weight, bias = make_params(k, layer)
    mp = (m + 15) // 16 * 16 if transposed else None
    got = Fwd(x, fp8, layer, mp=mp).run(norm, x, weight, bias)
    want = Fwd(x, fp8, layer, mp=mp).run(ref, x, weight, bias)
    if layer:
        assert_rows_close(got.mean, want.mean, 1e-5, "mean")
    assert_rows_close(got.rstd, want.rstd, 1e-5, "rstd")
    assert_rows_close(got.y.float(), want.y.float(), ROUNDING[x_dtype] + 1e-5, "y_out")
    assert_fp8_within_one_ulp(got.out, want.out, "out")
    assert_rows_close(got.amax.view(1), want.amax.view(1), 1e-5, "amax")
    assert_bits_equal(got.scale_inv, want.scale_inv, "scale_inv")
    if transposed:
        check_transposed_copy(got, m)


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("layer", KINDS)
@pytest.mark.parametrize("pow2", [False, True], ids=["exact", "pow2"])
def test_current_scaling_two_steps(fp8, layer, pow2, config):
    """norm_stats(amax) then norm_fwd_fp8(from_amax, stats_ready): bit for bit given that amax
    (pow2: the scale rounded down to a power of two, the kernel's POW2)."""
    m, k = 15, 48
    x = make_x((m, k), torch.bfloat16)
    weight, bias = make_params(k, layer)
    stats, a = stats_buffers(m, layer), torch.tensor(scaling.UNRECORDED)
    norm.norm_stats(x, weight, bias, EPS, *stats, amax_out=a)
    copy = lambda: ((stats[0].clone() if layer else None), stats[1].clone())
    got = Fwd(x, fp8, layer, mp=16, scale=0.625, from_amax=a.clone(), stats=copy(), pow2=pow2)
    want = Fwd(x, fp8, layer, mp=16, scale=0.625, from_amax=a.clone(), stats=copy(), pow2=pow2)
    got.run(norm, x, weight, bias, stats_ready=True)
    want.run(ref, x, weight, bias, stats_ready=True)
    got.assert_bits_equal(want)
    assert got.scale.item() != 0.625 and got.count.item() == 5
    assert (math.frexp(got.scale.item())[0] == 0.5) == pow2
    assert got.amax.item() == a.item()  # the amax of the same y, from either pass


@pytest.mark.parametrize("special", [math.nan, math.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("layer", KINDS)
def test_nonfinite_rows(special, layer, config):
    m, k = 6, 40
    x = make_x((m, k), torch.float32)
    x[3, 33] = special
    weight, bias = make_params(k, layer)
    stats, a = stats_buffers(m, layer), torch.tensor(scaling.UNRECORDED)
    norm.norm_stats(x, weight, bias, EPS, *stats, amax_out=a)
    assert a.item() == math.inf
    got = Fwd(x, E4M3, layer, mp=8, from_amax=a.clone()).run(norm, x, weight, bias)
    want = Fwd(x, E4M3, layer, mp=8, from_amax=a.clone()).run(ref, x, weight, bias)
    assert got.count.item() == 6 and got.scale.item() == torch.tensor(3.7).item()  # inf amax: kept, counted
    assert got.amax.item() == math.inf
    assert_fp8_within_one_ulp(got.out, want.out)
    assert torch.equal(got.y.isnan(), want.y.isnan())
    check_transposed_copy(got, m)


def test_row_strided_input(config):
    big = make_x((40, 70), torch.float16)
    x = big[3:34, 5:53]  # row stride 70, K = 48
    weight, bias = make_params(48, True)
    mean, rstd = ref.row_stats(x, EPS, True)
    got = Fwd(x, E5M2, True, mp=32, stats=(mean.clone(), rstd.clone())).run(norm, x, weight, bias, True)
    want = Fwd(x, E5M2, True, mp=32, stats=(mean.clone(), rstd.clone())).run(ref, x, weight, bias, True)
    got.assert_bits_equal(want)
    stats = stats_buffers(31, True)
    norm.norm_stats(x, weight, bias, EPS, *stats)
    assert_rows_close(stats[1], rstd, 1e-5, "rstd of strided rows")


# --------------------------------------------------------------------------- backward


def run_bwd(impl, dy, x, weight, mean, rstd, layer, g_dtype=torch.float32):
    m, k = x.shape
    dx = torch.full((m, k), math.nan, dtype=x.dtype)
    dw = torch.full((k,), math.nan, dtype=g_dtype)
    db = torch.full((k,), math.nan, dtype=g_dtype) if layer else None
    impl.norm_bwd(dy, x, weight, mean, rstd, dx, dw, db)
    return dx, dw, db


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("layer", KINDS)
@pytest.mark.parametrize("x_dtype", [X_DTYPES[0], X_DTYPES[2]])
def test_bwd(shape, layer, x_dtype, config):
    m, k = shape
    x = make_x(shape, x_dtype)
    dy = torch.randn(shape).to(x_dtype)
    weight, _ = make_params(k, layer, torch.bfloat16)
    mean, rstd = ref.row_stats(x, EPS, layer)
    got = run_bwd(norm, dy, x, weight, mean, rstd, layer)
    want = run_bwd(ref, dy, x, weight, mean, rstd, layer)
    assert_rows_close(got[0].float(), want[0].float(), ROUNDING[x_dtype] + 1e-5, "dx")
    assert_rows_close(got[1].view(1, -1), want[1].view(1, -1), 1e-5, "dweight")
    if layer:
        assert_rows_close(got[2].view(1, -1), want[2].view(1, -1), 1e-5, "dbias")
    if m != 15:
        return
    again = run_bwd(norm, dy, x, weight, mean, rstd, layer)  # the same grid: the same sums
    for a, b, name in zip(got, again, ("dx", "dweight", "dbias")):
        if a is not None:
            assert_bits_equal(a, b, f"{name} is deterministic")


def test_bwd_strided_inputs_and_low_precision_grads(config):
    big_x, big_dy = make_x((30, 64), torch.bfloat16), torch.randn(30, 64).to(torch.bfloat16)
    x, dy = big_x[2:29, 3:51], big_dy[::1, 10:58][1:28]  # row strides 64, K = 48
    weight, _ = make_params(48, True)
    mean, rstd = ref.row_stats(x, EPS, True)
    got = run_bwd(norm, dy, x, weight, mean, rstd, True, g_dtype=torch.bfloat16)
    want = run_bwd(ref, dy.contiguous(), x.contiguous(), weight, mean, rstd, True, g_dtype=torch.float32)
    assert_rows_close(got[0].float(), want[0].float(), ROUNDING[torch.bfloat16] + 1e-5, "dx")
    assert_rows_close(got[1].float().view(1, -1), want[1].view(1, -1), ROUNDING[torch.bfloat16], "dweight (bf16)")
    assert_rows_close(got[2].float().view(1, -1), want[2].view(1, -1), ROUNDING[torch.bfloat16], "dbias (bf16)")


# --------------------------------------------------------------------------- edges


def test_empty_batch(config):
    x = torch.empty((0, 24), dtype=torch.bfloat16)
    weight, bias = make_params(24, True)
    got = Fwd(x, E4M3, True, mp=16, from_amax=torch.tensor(2.0)).run(norm, x, weight, bias)
    want = Fwd(x, E4M3, True, mp=16, from_amax=torch.tensor(2.0)).run(ref, x, weight, bias)
    got.assert_bits_equal(want)
    assert not got.out_t.view(torch.uint8).any()
    dw, db = torch.full((24,), math.nan), torch.full((24,), math.nan)
    norm.norm_bwd(x, x, weight, torch.empty(0), torch.empty(0), torch.empty_like(x), dw, db)
    assert not dw.any() and not db.any()


def test_one_column(config):
    x = make_x((9, 1), torch.float32)
    for layer in (True, False):
        weight, bias = make_params(1, layer)
        mean, rstd = ref.row_stats(x, EPS, layer)
        runs = []
        for impl in (norm, ref):
            stats = (clone(mean), rstd.clone())
            runs.append(Fwd(x, E4M3, layer, mp=9, stats=stats).run(impl, x, weight, bias, stats_ready=True))
        runs[0].assert_bits_equal(runs[1])
        got = run_bwd(norm, x, x, weight, mean, rstd, layer)
        want = run_bwd(ref, x, x, weight, mean, rstd, layer)
        assert_rows_close(got[0], want[0], 1e-5, "dx")


def test_rejects_bad_arguments():
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    rstd = torch.empty(8)
    with pytest.raises(ValueError, match="norm_stats: bias is given"):
        norm.norm_stats(x, torch.ones(16), torch.zeros(16), EPS, None, rstd)
    with pytest.raises(ValueError, match="norm_fwd_fp8: out_t must be"):
        norm.norm_fwd_fp8(x, torch.ones(16), None, EPS, None, rstd, torch.empty(8, 16, dtype=E4M3),
                          torch.empty(16, 4, dtype=E4M3), torch.tensor(1.0), torch.tensor(1.0))
    with pytest.raises(ValueError, match="norm_bwd: dx_out must be bfloat16"):
        norm.norm_bwd(x, x, torch.ones(16), None, rstd, torch.empty(8, 16), torch.empty(16))


@pytest.mark.parametrize("fp8", FP8)
def test_interpreter_conversion_within_one_ulp(fp8):
    """With the interpreter's own conversions: one fp8 ulp off at most, where that conversion is sane."""
    x = make_x((33, 70), torch.float32)
    weight, bias = make_params(70, True)
    mean, rstd = ref.row_stats(x, EPS, True)
    got = Fwd(x, fp8, True, mp=48, stats=(mean.clone(), rstd.clone())).run(norm, x, weight, bias, True)
    want = Fwd(x, fp8, True, mp=48, stats=(mean.clone(), rstd.clone())).run(ref, x, weight, bias, True)
    y8 = ref.normalize(x, weight, bias, mean, rstd) * 3.7
    normal = y8.abs() >= torch.finfo(fp8).tiny  # it garbles fp8 subnormal results
    mantissa_bits = 3 if fp8 == E4M3 else 2
    g, w = got.out.view(torch.uint8).int(), want.out.view(torch.uint8).int()
    order = lambda b: torch.where(b >= 0x80, -(b & 0x7F), b & 0x7F)
    one_ulp = (order(g) - order(w)).abs() <= 1
    lost_carry = ((w & ((1 << mantissa_bits) - 1)) == 0) & (g == w - (1 << mantissa_bits))
    assert (one_ulp | lost_carry | ~normal).all()
    assert (g == w)[normal].float().mean() > 0.8
    check_transposed_copy(got, 33)
