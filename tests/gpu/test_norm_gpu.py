"""The norm kernels (kernels/norm.py) against their twins (kernels/norm_reference.py) on the GPU.

Both sides run on CUDA tensors. The kernels sum rows in another order than torch (chunks
merged with Chan's formula, block reductions), so the statistics, and with them y, differ
in their last float32 bits and an fp8 byte, rarely, lands on the neighbouring value. (y's
`* weight + bias` is one fma on both sides: rounded twice on one side only, a y that bias
nearly cancels moved by several fp8 steps.) The backward's compiler-fused multiply-adds
are inside the dx tolerance below. Hence:
  mean, rstd, amax   within rel 1e-5 (mean: of the row's max |x|, see row_max_abs); non-finite
                     at the same rows
  y_out, dx          within 1e-5 of the row's scale plus one rounding of their dtype
  dweight, dbias     within 1e-5 * sum_rows |term| per column, plus one rounding of their dtype
  fp8 bytes          NaN at the same places; elsewhere at most 1 fp8 ulp apart, and on fewer
                     than 1e-3 of the elements (one element allowed in tensors under 1000)
  exact              scale, scale_inv and nonfinite_count (the scale comes from a given scale
                     or from_amax); the kernel's out_t[:, :M] against its own out.T (for now
                     a torch copy on CUDA: norm._FUSED_TRANSPOSE_ON_CUDA); out_t's zero padding;
                     two runs into outputs poisoned with different bytes (every element
                     written, launches deterministic, norm_bwd's sums included).
"""
from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from fp8train import scaling  # noqa: E402
from fp8train.kernels import norm  # noqa: E402
from fp8train.kernels import norm_reference as ref  # noqa: E402
from helpers import assert_bitwise, FP8_FORMATS, fp8_order, INPUT_DTYPES, poisoned  # noqa: E402

pytestmark = pytest.mark.gpu

DEV = "cuda"
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = FP8_FORMATS
INPUTS = INPUT_DTYPES
KINDS = [pytest.param(True, id="layernorm"), pytest.param(False, id="rmsnorm")]
# Odd M, K not a power of two (no 16-divisible specialization), one-chunk and several-chunk
# rows (K = 8192: two row steps forward, steps of 4 rows backward), the bandwidth-relevant size.
SHAPES = [pytest.param(s, id=f"{s[0]}x{s[1]}") for s in
          ((1, 16), (3 * 5, 48), (37, 1000), (1000, 1003), (333, 8192), (8192, 4096))]
POISONS = (0x5A, 0xA5)
# One ulp of each dtype relative to the value (at most): two roundings of nearby float32
# values can land on neighbours.
ROUNDING = {torch.float32: 0.0, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}
EPS = 1e-5
# ("delayed", scale) reads `scale`; ("current", amax) computes the scale from the given amax.
MODES = [pytest.param(("delayed", 3.7), id="delayed"), pytest.param(("current", 41.5), id="current")]


# --------------------------------------------------------------------------- helpers


def make_x(shape, dtype, specials: bool = False) -> torch.Tensor:
    """Rows with their own offset and scale (2^-6 .. 2^6); with `specials`, row 3 holds a NaN
    and row 7 an inf (where they exist), which LayerNorm spreads over the row."""
    m, k = shape
    scale = torch.exp2(torch.randint(-6, 7, (m, 1), device=DEV).float())
    x = ((torch.randn(m, k, device=DEV) + torch.randn(m, 1, device=DEV) * 3) * scale).to(dtype)
    if specials:
        for row, value in ((3, math.nan), (7, -math.inf)):
            if row < m:
                x[row, (row * 37) % k] = value
    return x


def make_params(k, layer, dtype=torch.float32):
    weight = (torch.randn(k, device=DEV) * 0.5 + 1).to(dtype)
    return weight, (torch.randn(k, device=DEV).to(dtype) if layer else None)


def assert_fp8_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    nan_g, nan_w = got.float().isnan(), want.float().isnan()
    if not torch.equal(nan_g, nan_w):
        pytest.fail(f"{what}: NaN at {int((nan_g != nan_w).sum())} other places")
    dist = (fp8_order(got) - fp8_order(want)).abs()[~nan_w]
    if dist.numel() == 0:
        return
    assert int(dist.max()) <= 1, f"{what}: {int((dist > 1).sum())} bytes more than one fp8 ulp apart"
    n_diff = int((dist != 0).sum())
    assert n_diff <= max(1, 1e-3 * got.numel()), f"{what}: {n_diff} of {got.numel()} bytes differ"


def assert_rows_close(got, want, rel, what, scale=None) -> None:
    """|got - want| <= rel * scale row by row (scale: the row's max |want| unless given); the
    same rows non-finite on both sides, compared only where want is finite."""
    got, want = got.double().reshape(want.shape[0], -1), want.double().reshape(want.shape[0], -1)
    finite = want.isfinite()
    assert torch.equal(got.isfinite().all(dim=1), finite.all(dim=1)), f"{what}: non-finite rows differ"
    if scale is None:
        scale = torch.where(finite, want.abs(), 0.0).amax(dim=1, keepdim=True)
    err = torch.where(finite, (got - want).abs(), 0.0)
    ok = err <= rel * scale.double().reshape(want.shape[0], -1)
    assert ok.all(), f"{what}: {int((~ok).sum())} of {ok.numel()} out of tolerance, max error {err.max().item():.3g}"


def clone(t):
    return None if t is None else t.clone()


class Fwd:
    """The buffers one norm_fwd_fp8 call writes, poisoned with `byte` (NaN-ish for floats)."""

    def __init__(self, x, fp8, layer, byte, mp=None, mode=("delayed", 3.7), stats=None, with_y=True):
        m, k = x.shape
        f32 = lambda v: torch.tensor(v, dtype=torch.float32, device=DEV)
        self.mean, self.rstd = stats if stats is not None else (
            poisoned((m,), torch.float32, byte) if layer else None, poisoned((m,), torch.float32, byte))
        self.out = poisoned((m, k), fp8, byte)
        self.out_t = None if mp is None else poisoned((k, mp), fp8, byte)
        self.y = poisoned((m, k), x.dtype, byte) if with_y else None
        self.amax = f32(scaling.UNRECORDED)
        self.scale_inv = f32(-3.0)
        kind, value = mode
        if kind == "delayed":
            self.scale, self.from_amax, self.count = f32(value), None, None
        else:
            self.scale, self.from_amax = f32(0.8125), f32(value)
            self.count = torch.tensor(4, dtype=torch.int32, device=DEV)

    def run(self, impl, x, weight, bias, stats_ready=False) -> "Fwd":
        impl.norm_fwd_fp8(x, weight, bias, EPS, self.mean, self.rstd, self.out, self.out_t, self.scale,
                          self.scale_inv, self.amax, self.from_amax, self.count, self.y, stats_ready)
        return self

    def tensors(self):
        return {name: getattr(self, name) for name in
                ("mean", "rstd", "out", "out_t", "y", "amax", "scale", "scale_inv", "count")
                if getattr(self, name) is not None}


def run_kernel_twice(x, weight, bias, fp8, layer, stats_ready=False, stats=None, **kw) -> Fwd:
    """The kernel into outputs poisoned two ways; both runs must agree bit for bit."""
    runs = []
    for byte in POISONS:
        s = None if stats is None else tuple(clone(t) for t in stats)
        runs.append(Fwd(x, fp8, layer, byte, stats=s, **kw).run(norm, x, weight, bias, stats_ready))
    for name, t in runs[0].tensors().items():
        assert_bitwise(t, runs[1].tensors()[name], f"{name}: two runs (poison {POISONS[0]:#x} / {POISONS[1]:#x})")
    return runs[0]


def check_transposed_copy(f: Fwd, m: int) -> None:
    assert_bitwise(f.out_t[:, :m], f.out.t().contiguous(), "out_t[:, :M] vs out.T")
    assert not f.out_t[:, m:].view(torch.uint8).any(), "out_t padding must be zero bytes"


def row_max_abs(x: torch.Tensor) -> torch.Tensor:
    """(M,) max |x| over each row's finite entries: the scale of the mean's rounding error.

    Both sides sum K float32 values, each along its own tree of additions of some depth d
    (the kernel: a thread's serial run of <= 16 elements, <= 8 shuffle / cross-warp levels,
    then one Chan merge per chunk of the row: 2 chunks at K = 8192 in the row configs, 64 in
    the 32 x 128 tiles; torch's reduction is of the same kind), and a mean summed that way is within d * 2^-24 * mean|x|
    <= d * 6e-8 * max|x| of the exact one: with d well under 100, under 6e-6 * max|x|,
    inside the 1e-5 used. Relative to |mean| nothing is bounded: a row whose values nearly
    cancel has |mean| << max|x| (the 8192x4096 float32 run of 2026-11-29 missed 1e-5 * |mean|
    by an error of 6.1e-5 on one such row).
    """
    return torch.where(x.isfinite(), x.float().abs(), 0.0).amax(dim=1)


def compare_fwd(got: Fwd, want: Fwd, x: torch.Tensor, stats_compared: bool, layer: bool) -> None:
    if stats_compared:
        if layer:
            assert_rows_close(got.mean, want.mean, 1e-5, "mean", scale=row_max_abs(x))
        assert_rows_close(got.rstd, want.rstd, 1e-5, "rstd")
    assert_fp8_close(got.out, want.out, "out")
    if got.y is not None:
        assert_rows_close(got.y, want.y, 1e-5 + ROUNDING[x.dtype], "y_out")
    a_got, a_want = got.amax.item(), want.amax.item()
    assert a_got == a_want or abs(a_got - a_want) <= 1e-5 * abs(a_want), f"amax {a_got} != {a_want}"
    for name in ("scale", "scale_inv", "count"):
        if getattr(got, name) is not None:
            assert_bitwise(getattr(got, name), getattr(want, name), name)


# --------------------------------------------------------------------------- forward


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("layer", KINDS)
@pytest.mark.parametrize("x_dtype", INPUTS)
def test_norm_stats(shape, layer, x_dtype):
    m, k = shape
    x = make_x(shape, x_dtype, specials=True)
    weight, bias = make_params(k, layer, torch.bfloat16)
    results = []
    for impl in (norm, ref):
        mean = torch.full((m,), math.nan, device=DEV) if layer else None
        rstd, amax = torch.full((m,), math.nan, device=DEV), torch.tensor(scaling.UNRECORDED, device=DEV)
        impl.norm_stats(x, weight, bias, EPS, mean, rstd, amax_out=amax)
        results.append((mean, rstd, amax))
    (mean, rstd, amax), (want_mean, want_rstd, want_amax) = results
    if layer:
        assert_rows_close(mean, want_mean, 1e-5, "mean", scale=row_max_abs(x))
    assert_rows_close(rstd, want_rstd, 1e-5, "rstd")
    if m > 3:  # row 3 holds a NaN
        assert amax.item() == want_amax.item() == math.inf
    else:
        assert abs(amax.item() - want_amax.item()) <= 1e-5 * want_amax.item()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("layer", KINDS)
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("mode", MODES)
def test_fwd_from_given_stats(shape, layer, fp8, mode):
    """stats_ready (the current-scaling second pass) with the twin's statistics."""
    m, k = shape
    x = make_x(shape, torch.bfloat16, specials=True)
    weight, bias = make_params(k, layer)
    stats = ref.row_stats(x, EPS, layer)  # (mean or None, rstd)
    mp = (m + 15) // 16 * 16
    got = run_kernel_twice(x, weight, bias, fp8, layer, stats_ready=True, stats=stats, mp=mp, mode=mode)
    want = Fwd(x, fp8, layer, 0, stats=tuple(clone(t) for t in stats), mp=mp, mode=mode)
    want.run(ref, x, weight, bias, stats_ready=True)
    compare_fwd(got, want, x, stats_compared=False, layer=layer)
    assert_bitwise(got.rstd, stats[1], "rstd is an input with stats_ready")
    check_transposed_copy(got, m)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("layer", KINDS)
@pytest.mark.parametrize("x_dtype", INPUTS)
@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "tiles"])
def test_fwd_computes_stats(shape, layer, x_dtype, transposed):
    """One launch (delayed scaling): stats, fp8 (+ transposed copy), y_out and amax."""
    m, k = shape
    fp8 = (E4M3, E5M2)[(m + layer) % 2]
    x = make_x(shape, x_dtype, specials=True)
    weight, bias = make_params(k, layer, (torch.float32, torch.bfloat16)[m % 2])
    mp = m + 13 if transposed else None
    got = run_kernel_twice(x, weight, bias, fp8, layer, mp=mp)
    want = Fwd(x, fp8, layer, 0, mp=mp).run(ref, x, weight, bias)
    compare_fwd(got, want, x, stats_compared=True, layer=layer)
    if transposed:
        check_transposed_copy(got, m)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("layer", KINDS)
@pytest.mark.parametrize("x_dtype", INPUTS)
def test_fwd_without_cast(shape, layer, x_dtype):
    """norm_fwd (fp8train.RMSNorm with no FP8 reader): statistics and y alone, against the
    twin, into outputs poisoned two ways (every element written, the same bits both times);
    y and rstd are the bits norm_stats and a norm_fwd_fp8 on those statistics write."""
    m, k = shape
    x = make_x(shape, x_dtype, specials=True)
    weight, bias = make_params(k, layer, x_dtype)
    runs = []
    for impl, byte in ((norm, POISONS[0]), (norm, POISONS[1]), (ref, POISONS[0])):
        mean = poisoned((m,), torch.float32, byte) if layer else None
        rstd, y = poisoned((m,), torch.float32, byte), poisoned((m, k), x_dtype, byte)
        impl.norm_fwd(x, weight, bias, EPS, mean, rstd, y)
        runs.append((mean, rstd, y))
    (mean, rstd, y), again, (want_mean, want_rstd, want_y) = runs
    for name, a, b in zip(("mean", "rstd", "y"), (mean, rstd, y), again):
        if a is not None:
            assert_bitwise(a, b, f"{name}: two runs")
    if layer:
        assert_rows_close(mean, want_mean, 1e-5, "mean", scale=row_max_abs(x))
    assert_rows_close(rstd, want_rstd, 1e-5, "rstd")
    assert_rows_close(y, want_y, 1e-5 + ROUNDING[x_dtype], "y")
    stats = Fwd(x, E4M3, layer, 0)
    norm.norm_stats(x, weight, bias, EPS, stats.mean, stats.rstd)
    stats.run(norm, x, weight, bias, stats_ready=True)
    assert_bitwise(rstd, stats.rstd, "rstd vs norm_stats")
    assert_bitwise(y, stats.y, "y vs norm_fwd_fp8 from norm_stats' statistics")


@pytest.mark.parametrize("shape", SHAPES[1:])
@pytest.mark.parametrize("layer", KINDS)
@pytest.mark.parametrize("fp8", FP8)
def test_current_scaling_two_steps(shape, layer, fp8):
    """norm_stats(amax) then norm_fwd_fp8(from_amax, stats_ready); the twin given the kernel's
    statistics and amax produces the same scale bit for bit and the same bytes within 1 ulp."""
    m, k = shape
    x = make_x(shape, torch.bfloat16)
    weight, bias = make_params(k, layer)
    mean = torch.empty(m, device=DEV) if layer else None
    rstd, a = torch.empty(m, device=DEV), torch.tensor(scaling.UNRECORDED, device=DEV)
    norm.norm_stats(x, weight, bias, EPS, mean, rstd, amax_out=a)
    mode = ("current", a.item())
    got = run_kernel_twice(x, weight, bias, fp8, layer, stats_ready=True, stats=(mean, rstd), mp=m + 1, mode=mode)
    want = Fwd(x, fp8, layer, 0, stats=(clone(mean), clone(rstd)), mp=m + 1, mode=mode)
    want.run(ref, x, weight, bias, stats_ready=True)
    compare_fwd(got, want, x, stats_compared=False, layer=layer)
    assert abs(got.amax.item() - a.item()) <= 1e-5 * a.item(), "both passes see the same y"
    check_transposed_copy(got, m)


@pytest.mark.parametrize("layer", KINDS)
def test_nonfinite_amax_keeps_scale_and_counts(layer):
    x = make_x((64, 256), torch.bfloat16, specials=True)
    weight, bias = make_params(256, layer)
    mean = torch.empty(64, device=DEV) if layer else None
    rstd, a = torch.empty(64, device=DEV), torch.tensor(scaling.UNRECORDED, device=DEV)
    norm.norm_stats(x, weight, bias, EPS, mean, rstd, amax_out=a)
    assert a.item() == math.inf
    got = run_kernel_twice(x, weight, bias, E4M3, layer, stats_ready=True, stats=(mean, rstd), mp=64,
                           mode=("current", math.inf))
    assert got.scale.item() == 0.8125 and got.count.item() == 5
    assert got.amax.item() == math.inf


@pytest.mark.parametrize("x_dtype", INPUTS)
def test_row_strided_input(x_dtype):
    big = make_x((1100, 1300), x_dtype)
    x = big[3:1030, 5:1029]  # row stride 1300, K = 1024, unaligned start
    weight, bias = make_params(1024, True)
    got = run_kernel_twice(x, weight, bias, E4M3, True, mp=1040)
    want = Fwd(x, E4M3, True, 0, mp=1040).run(ref, x, weight, bias)
    compare_fwd(got, want, x, stats_compared=True, layer=True)
    check_transposed_copy(got, 1027)


def test_repeated_launches_take_the_cached_binary(monkeypatch):
    """DirectKernel launches the cached binary from the second call on: new data, same results,
    and no compile after the first step (counted as calls of the kernel's `warmup`, through
    which DirectKernel gets every binary, relative to the first step: earlier tests may have
    compiled this specialization already)."""
    warmup = norm._norm_fwd_kernel.warmup
    compiles = []
    monkeypatch.setattr(norm._norm_fwd_kernel, "warmup", lambda *a, **k: compiles.append(1) or warmup(*a, **k))
    weight, bias = make_params(4096, True)
    for step in range(3):
        x = make_x((256, 4096), torch.bfloat16)
        got = Fwd(x, E4M3, True, POISONS[step % 2], mp=256).run(norm, x, weight, bias)
        want = Fwd(x, E4M3, True, 0, mp=256).run(ref, x, weight, bias)
        compare_fwd(got, want, x, stats_compared=True, layer=True)
        check_transposed_copy(got, 256)
        if step == 0:
            first = len(compiles)
    assert len(compiles) == first, f"steps 2 and 3 compiled {len(compiles) - first} binaries"


def test_empty_batch():
    x = torch.empty((0, 64), dtype=torch.bfloat16, device=DEV)
    weight, bias = make_params(64, True)
    got = Fwd(x, E4M3, True, POISONS[0], mp=16, mode=("current", 2.0)).run(norm, x, weight, bias)
    want = Fwd(x, E4M3, True, POISONS[0], mp=16, mode=("current", 2.0)).run(ref, x, weight, bias)
    for name, t in got.tensors().items():
        assert_bitwise(t, want.tensors()[name], name)
    assert not got.out_t.view(torch.uint8).any()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_runs_on_the_tensors_device():
    dev = torch.device("cuda", 1)
    x = make_x((40, 256), torch.bfloat16).to(dev)
    weight, bias = (t.to(dev) for t in make_params(256, True))
    mean, rstd = torch.empty(40, device=dev), torch.empty(40, device=dev)
    norm.norm_stats(x, weight, bias, EPS, mean, rstd)
    want_mean, want_rstd = ref.row_stats(x, EPS, True)
    assert_rows_close(mean, want_mean, 1e-5, "mean on cuda:1")
    assert_rows_close(rstd, want_rstd, 1e-5, "rstd on cuda:1")
    dx, dw, db = torch.empty_like(x), torch.empty(256, device=dev), torch.empty(256, device=dev)
    norm.norm_bwd(x, x, weight, mean, rstd, dx, dw, db)
    assert dx.isfinite().all() and dw.isfinite().all()


# --------------------------------------------------------------------------- backward


def run_bwd(impl, dy, x, weight, mean, rstd, layer, g_dtype, byte):
    k = x.shape[1]
    dx = poisoned(tuple(x.shape), x.dtype, byte)
    dw = poisoned((k,), g_dtype, byte)
    db = poisoned((k,), g_dtype, byte) if layer else None
    impl.norm_bwd(dy, x, weight, mean, rstd, dx, dw, db)
    return dx, dw, db


def check_bwd(dy, x, weight, layer, g_dtype=torch.float32) -> None:
    mean, rstd = ref.row_stats(x, EPS, layer)
    got = run_bwd(norm, dy, x, weight, mean, rstd, layer, g_dtype, POISONS[0])
    again = run_bwd(norm, dy, x, weight, mean, rstd, layer, g_dtype, POISONS[1])
    for a, b, name in zip(got, again, ("dx", "dweight", "dbias")):
        if a is not None:
            assert_bitwise(a, b, f"{name}: two runs (deterministic, fully written)")
    want = run_bwd(ref, dy, x, weight, mean, rstd, layer, torch.float32, 0)
    # dx cancels terms of size rstd * (|g| + |mean(g)| + |xhat * mean(g * xhat)|).
    xf, g = x.double(), dy.double() * weight.double()
    xhat = ((xf - mean.double()[:, None]) if layer else xf) * rstd.double()[:, None]
    terms = g.abs() + (xhat * (g * xhat).mean(dim=1, keepdim=True)).abs()
    if layer:
        terms = terms + g.mean(dim=1, keepdim=True).abs()
    dx_scale = rstd.double()[:, None] * terms.amax(dim=1, keepdim=True)
    err = (got[0].double() - want[0].double()).abs()
    bound = 1e-5 * dx_scale + ROUNDING[x.dtype] * want[0].double().abs()
    assert (err <= bound).all(), f"dx: {int((err > bound).sum())} out of tolerance"
    sums = [(dy.double() * xhat).abs().sum(dim=0), dy.double().abs().sum(dim=0)]
    for g_, w_, mag, name in zip(got[1:], want[1:], sums, ("dweight", "dbias")):
        if g_ is None:
            continue
        err = (g_.double() - w_.double()).abs()
        bound = 1e-5 * mag + ROUNDING[g_dtype] * w_.double().abs()
        assert (err <= bound).all(), f"{name}: {int((err > bound).sum())} of {err.numel()} out of tolerance"


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("layer", KINDS)
@pytest.mark.parametrize("x_dtype", INPUTS)
def test_bwd(shape, layer, x_dtype):
    k = shape[1]
    x = make_x(shape, x_dtype)
    dy = torch.randn(shape, device=DEV).to(x_dtype)
    weight, _ = make_params(k, layer, torch.bfloat16)
    check_bwd(dy, x, weight, layer)


@pytest.mark.parametrize("g_dtype", [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")])
def test_bwd_strided_inputs_and_low_precision_grads(g_dtype):
    big_x = make_x((700, 1200), torch.bfloat16)
    big_dy = torch.randn(700, 1200, device=DEV).to(torch.bfloat16)
    x, dy = big_x[5:690, 7:1031], big_dy[3:688, 100:1124]  # row stride 1200, K = 1024
    weight, _ = make_params(1024, True, g_dtype)
    check_bwd(dy, x, weight, True, g_dtype)


def test_bwd_empty_batch():
    x = torch.empty((0, 64), dtype=torch.bfloat16, device=DEV)
    weight, _ = make_params(64, True)
    dw, db = poisoned((64,), torch.float32, 0x5A), poisoned((64,), torch.float32, 0x5A)
    norm.norm_bwd(x, x, weight, torch.empty(0, device=DEV), torch.empty(0, device=DEV), torch.empty_like(x), dw, db)
    assert not dw.any() and not db.any()
