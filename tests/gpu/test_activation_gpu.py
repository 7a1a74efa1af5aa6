"""The fused activation kernels (kernels/activation.py) against their twins on the GPU.

Both sides run on CUDA tensors: `fp8train.kernels.activation.*` (Triton) and
`fp8train.kernels.activation_reference.*` (torch). The float32 expressions are the same op
for op, every multiply-add an explicit fma on both sides; only exp2 and the two reciprocals
differ (the GPU's ex2.approx against torch.exp2, its div.full.f32 against an IEEE quotient,
each within about 2 ulps), and the twin's Note shows how each
formula keeps that a difference of a few float32 ulps in the result (no erf, no 1 + erf
cancellation, no 1 - sigmoid near 1, a common cut at |x| = 12 for gelu's tails). A byte then
lands on the neighbouring fp8 value only when its value lies within those few ulps of a
rounding boundary: for a few 1e-6 of the elements (about 2^-22 relative against an fp8 step
of at least 2^-4), more only next to a zero of act', where bf16 inputs put few elements.
The 1e-3 allowance leaves a wide margin over that, and a byte 2 steps off, or a NaN moved,
means a formula that amplifies a rounding difference. Hence:
  fp8 bytes     NaN at the same places; elsewhere at most 1 fp8 ulp apart, and on fewer
                than 1e-3 of the elements (one element allowed in tensors under 1000)
  amax          within rel 1e-5 (non-finite: equal)
  dbias         within 1e-5 * sum_rows |dh| per column, plus the rounding of dbias_out's dtype
  exact         scale, scale_inv and nonfinite_count when the scale comes from a given
                from_amax or is given; the kernel's out_t[:, :M] against its own out.T (for
                now a torch copy on CUDA: activation._FUSED_TRANSPOSE_ON_CUDA); out_t's zero
                padding; every element written (outputs poisoned with two byte patterns).
"""
from __future__ import annotations

import math
from typing import Optional

import pytest
import torch

pytest.importorskip("triton")

from fp8train import scaling  # noqa: E402
from fp8train.kernels import activation, reference  # noqa: E402
from fp8train.kernels import activation_reference as act_ref  # noqa: E402
from helpers import assert_bitwise, FP8_FORMATS, fp8_order, INPUT_DTYPES, poisoned  # noqa: E402

pytestmark = pytest.mark.gpu

DEV = "cuda"
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = FP8_FORMATS
INPUTS = INPUT_DTYPES
ACTS = list(act_ref.ACTIVATIONS)
POISONS = (0x5A, 0xA5)
# ("delayed", scale) reads `scale`; ("current", amax) computes the scale from the given amax.
DELAYED = ("delayed", 3.7)
CURRENT = ("current", 41.5)
MODES = [pytest.param(DELAYED, id="delayed"), pytest.param(CURRENT, id="current")]


# --------------------------------------------------------------------------- helpers


def h_width(act: str, f: int) -> int:
    return 2 * f if act == "swiglu" else f


def make_input(shape, dtype, spread: float = 4.0, specials: bool = True) -> torch.Tensor:
    """Normal values of standard deviation `spread`, with NaN, +-inf, -0, huge and subnormal values sprinkled in."""
    x = (torch.randn(shape, device=DEV) * spread).to(dtype)
    flat = x.view(-1)
    if specials and flat.numel() >= 16:
        tiny = torch.finfo(dtype).tiny
        values = torch.tensor([math.nan, -math.nan, math.inf, -math.inf, -0.0, tiny / 8, -tiny / 2, 300.0, -6e4],
                              device=DEV).to(dtype)
        idx = torch.randint(0, flat.numel(), (values.numel() * 2,), device=DEV)
        flat[idx] = values.repeat(2)
    return x


def assert_fp8_near(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """NaN at the same places; elsewhere at most 1 ulp apart, on fewer than 1e-3 of the elements."""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    nan_g, nan_w = got.float().isnan(), want.float().isnan()
    if not torch.equal(nan_g, nan_w):
        pytest.fail(f"{what}: NaN positions differ at {(nan_g != nan_w).nonzero()[:5].tolist()}")
    dist = (fp8_order(got) - fp8_order(want)).abs()
    dist[nan_w] = 0
    far = dist > 1
    if far.any():
        at = far.nonzero()[:5].tolist()
        pytest.fail(f"{what}: {int(far.sum())} values more than 1 ulp off, first at {at}: got "
                    f"{[got[tuple(i)].item() for i in at]}, want {[want[tuple(i)].item() for i in at]}")
    n_off = int((dist != 0).sum())
    assert n_off <= max(1, (dist.numel() - 1) // 1000), f"{what}: {n_off} of {dist.numel()} values 1 ulp off"


def assert_rel(got: torch.Tensor, want: torch.Tensor, what: str, rel: float = 1e-5) -> None:
    g, w = got.double(), want.double()
    if not w.isfinite().all():
        assert torch.equal(g.isnan(), w.isnan()) and torch.equal(g[w.isinf()], w[w.isinf()]), f"{what}: {g} vs {w}"
    fin = w.isfinite()
    assert ((g[fin] - w[fin]).abs() <= rel * w[fin].abs()).all(), f"{what}: {g} vs {w}"


class Scalars:
    """The scalar tensors one call reads and writes; clone() gives the twin its own."""

    def __init__(self, scale, scale_inv, amax, from_amax, count):
        self.scale, self.scale_inv, self.amax, self.from_amax, self.count = scale, scale_inv, amax, from_amax, count

    @classmethod
    def make(cls, mode, amax_start: Optional[float] = scaling.UNRECORDED) -> "Scalars":
        f32 = lambda v: torch.tensor(v, dtype=torch.float32, device=DEV)
        amax = None if amax_start is None else f32(amax_start)
        kind, value = mode
        if kind == "delayed":
            return cls(f32(value), f32(-3.0), amax, None, None)
        return cls(f32(0.8125), f32(-3.0), amax, f32(value), torch.tensor(4, dtype=torch.int32, device=DEV))

    def clone(self) -> "Scalars":
        c = lambda t: None if t is None else t.clone()
        return Scalars(c(self.scale), c(self.scale_inv), c(self.amax), c(self.from_amax), c(self.count))

    def args(self):
        return self.scale, self.scale_inv, self.amax, self.from_amax, self.count

    def assert_matches(self, want: "Scalars") -> None:
        for name in ("scale", "scale_inv", "from_amax", "count"):
            g, w = getattr(self, name), getattr(want, name)
            if g is not None:
                assert_bitwise(g, w, name)
        if self.amax is not None:
            assert_rel(self.amax, want.amax, "amax")


def check_outputs(out, out_t, want, want_t, m: int, what: str) -> None:
    assert_fp8_near(out, want, f"{what} out")
    if out_t is not None:
        assert_fp8_near(out_t, want_t, f"{what} out_t")
        assert_bitwise(out_t[:, :m], out.t(), f"{what} out_t[:, :M] vs out.T")
        assert not out_t[:, m:].view(torch.uint8).any(), f"{what}: out_t padding must be zero bytes"


def check_dbias(got: torch.Tensor, want: torch.Tensor, dh: torch.Tensor) -> None:
    """Per column: |got - want| <= 1e-5 sum |dh| + rounding of the dtype; the same NaN / inf."""
    g, w = got.double(), want.double()
    same_special = (g.isnan() & w.isnan()) | (g == w)
    tol = 1e-5 * torch.where(dh.isfinite(), dh, 0.0).abs().sum(dim=0).double() + torch.finfo(got.dtype).eps * w.abs()
    bad = ~same_special & ~((g - w).abs() <= tol)
    if bad.any():
        at = bad.nonzero()[:5].flatten().tolist()
        pytest.fail(f"dbias: {int(bad.sum())} of {g.numel()} columns off, at {at}: got {g[at].tolist()}, "
                    f"want {w[at].tolist()}")


def check_fwd(h, act, fp8, mode, mp: Optional[int], amax_start=scaling.UNRECORDED) -> None:
    m, f = h.shape[0], act_ref.out_features(h, act)
    start = Scalars.make(mode, amax_start)
    want_s = start.clone()
    want = poisoned((m, f), fp8, 0)
    want_t = None if mp is None else poisoned((f, mp), fp8, 0)
    act_ref.act_fwd_fp8(h, act, want, want_t, *want_s.args())
    for byte in POISONS:
        got_s = start.clone()
        out = poisoned((m, f), fp8, byte)
        out_t = None if mp is None else poisoned((f, mp), fp8, byte)
        activation.act_fwd_fp8(h, act, out, out_t, *got_s.args())
        check_outputs(out, out_t, want, want_t, m, f"act_fwd_fp8 (poison {byte:#x})")
        got_s.assert_matches(want_s)


def check_bwd(da, h, act, fp8, mode, mp: Optional[int], dbias_dtype=torch.float32,
              amax_start=scaling.UNRECORDED) -> None:
    m, fh = h.shape
    start = Scalars.make(mode, amax_start)
    want_s = start.clone()
    want = poisoned((m, fh), fp8, 0)
    want_t = None if mp is None else poisoned((fh, mp), fp8, 0)
    want_db = None if dbias_dtype is None else torch.zeros(fh, dtype=dbias_dtype, device=DEV)
    act_ref.act_bwd_fp8(da, h, act, want, want_t, *want_s.args(), dbias_out=want_db)
    for byte in POISONS:
        got_s = start.clone()
        out = poisoned((m, fh), fp8, byte)
        out_t = None if mp is None else poisoned((fh, mp), fp8, byte)
        db = None if dbias_dtype is None else torch.full((fh,), float(byte), dtype=dbias_dtype, device=DEV)
        activation.act_bwd_fp8(da, h, act, out, out_t, *got_s.args(), dbias_out=db)
        check_outputs(out, out_t, want, want_t, m, f"act_bwd_fp8 (poison {byte:#x})")
        got_s.assert_matches(want_s)
        if db is not None:
            check_dbias(db, want_db, act_ref.act_grad(da, h, act))


# --------------------------------------------------------------------------- shapes


SHAPES = [(1, 16), (3, 17), (37, 1000), (200, 4096), (1000, 1003), (4097, 1000)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("mode", MODES)
def test_fwd_shapes(shape, act, fp8, mode):
    m, f = shape
    h = make_input((m, h_width(act, f)), torch.bfloat16)
    check_fwd(h, act, fp8, mode, mp=(m + 15) // 16 * 16)
    check_fwd(h, act, fp8, mode, mp=m + 100)
    check_fwd(h, act, fp8, mode, mp=None)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("mode", MODES)
def test_bwd_shapes(shape, act, fp8, mode):
    m, f = shape
    h = make_input((m, h_width(act, f)), torch.bfloat16, specials=False)
    da = make_input((m, f), torch.bfloat16)
    check_bwd(da, h, act, fp8, mode, mp=(m + 15) // 16 * 16)
    check_bwd(da, h, act, fp8, mode, mp=m + 100, dbias_dtype=None)
    check_bwd(da, h, act, fp8, mode, mp=None, dbias_dtype=torch.bfloat16)


@pytest.mark.parametrize("x_dtype", INPUTS)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("fp8", FP8)
def test_input_dtypes(x_dtype, act, fp8):
    """bf16 / fp16 / fp32 inputs (fp32 takes the row-major kernel plus a torch byte transpose)."""
    m, f = 513, 1024
    h = make_input((m, h_width(act, f)), x_dtype)
    da = make_input((m, f), x_dtype)
    check_fwd(h, act, fp8, DELAYED, mp=528)
    check_fwd(h, act, fp8, CURRENT, mp=None)
    check_bwd(da, h, act, fp8, DELAYED, mp=528, dbias_dtype=x_dtype)
    check_bwd(da, h.to(torch.bfloat16), act, fp8, CURRENT, mp=528)  # mixed input dtypes


@pytest.mark.parametrize("act", ACTS)
def test_row_strided_inputs(act):
    """h and da as row slices of wider tensors: unaligned starts, row strides != widths."""
    f = 999
    big_h = make_input((1030, h_width(act, f) + 70), torch.bfloat16)
    big_da = make_input((1030, f + 33), torch.float16)
    h = big_h[3:1030, 5:5 + h_width(act, f)]
    da = big_da[3:1030, 1:1 + f]
    check_fwd(h, act, E4M3, CURRENT, mp=1040)
    check_bwd(da, h, act, E5M2, DELAYED, mp=1040)
    check_fwd(big_h[::2, :h_width(act, 512)], act, E4M3, DELAYED, mp=528)  # row stride 2 * width


@pytest.mark.parametrize("act", ACTS)
def test_bandwidth_size(act):
    """8192 tokens x ffn 16384 in bf16 (swiglu: h of 8192 x 32768): the size the kernels are for."""
    m, f = 8192, 16384
    h = make_input((m, h_width(act, f)), torch.bfloat16, spread=2.0, specials=False)
    da = make_input((m, f), torch.bfloat16, spread=1e-3, specials=False)
    check_fwd(h, act, E4M3, CURRENT, mp=m)
    check_bwd(da, h, act, E5M2, DELAYED, mp=m)


def bf16_grid(limit: float) -> torch.Tensor:
    """Every bfloat16 value in [-limit, limit] (both zeros, the subnormals), then +inf, -inf, NaN."""
    top = int(torch.tensor(limit, dtype=torch.bfloat16).view(torch.int16))
    bits = torch.arange(top + 1, dtype=torch.int32, device=DEV)
    both = torch.cat([bits, bits - 32768]).to(torch.int16)  # the second half with the sign bit set
    specials = torch.tensor([math.inf, -math.inf, math.nan], device=DEV).to(torch.bfloat16)
    return torch.cat([both.view(torch.bfloat16), specials])


@pytest.mark.parametrize("scale", [1.0, 2.0**40, 2.0**100], ids=["s1", "s2^40", "s2^100"])
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("fp8", FP8)
def test_tails_and_special_products(fp8, act, scale):
    """Every bf16 input in [-16, 16] and +-inf, NaN, each against da = 1, +-inf, NaN, huge, tiny
    and -2.5, at scales that bring the far tails (gelu down to 1e-32 at x = -12) into the fp8
    range: the erfc form, the cut at |x| = 12 and the NaN / inf rules of the twin's Note
    hold on the GPU too."""
    grid = bf16_grid(16.0)  # (N,)
    da_values = torch.tensor([1.0, math.inf, -math.inf, math.nan, 3e4, 1e-30, -2.5], device=DEV)
    m = da_values.numel()
    h = grid.expand(m, -1).contiguous()  # (M, N): row i meets da_values[i]
    if act == "swiglu":
        h = torch.cat([h, torch.full_like(h, 1.5)], dim=1)  # gate = the grid, up = 1.5
    da = da_values.to(torch.bfloat16)[:, None].expand(m, grid.numel()).contiguous()
    check_fwd(h, act, fp8, ("delayed", scale), mp=16)
    check_bwd(da, h, act, fp8, ("delayed", scale), mp=16)


# --------------------------------------------------------------------------- amax and scales


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("start", ["unrecorded", "zero", "huge", "inf"])
def test_amax_passes_accumulate(act, start):
    m, f = 777, 1111
    h = make_input((m, h_width(act, f)), torch.bfloat16, specials=False)
    da = make_input((m, f), torch.bfloat16, specials=False)
    value = {"unrecorded": scaling.UNRECORDED, "zero": 0.0, "huge": 1e30, "inf": math.inf}[start]
    for kernel, twin in ((lambda a: activation.act_amax(h, act, a), lambda a: act_ref.act_amax(h, act, a)),
                         (lambda a: activation.act_bwd_amax(da, h, act, a),
                          lambda a: act_ref.act_bwd_amax(da, h, act, a))):
        got, want = torch.tensor(value, device=DEV), torch.tensor(value, device=DEV)
        kernel(got)
        twin(want)
        assert_rel(got, want, "amax")
    check_fwd(h, act, E4M3, DELAYED, mp=784, amax_start=value)
    check_bwd(da, h, act, E5M2, DELAYED, mp=None, amax_start=value)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("special", [math.nan, -math.nan, math.inf, -math.inf], ids=["nan", "-nan", "inf", "-inf"])
def test_amax_counts_nan_as_inf(act, special):
    m, f = 300, 400
    h = make_input((m, h_width(act, f)), torch.float16, specials=False)
    h[123, 321] = 1.0  # act'(h) != 0 where da is bad
    da = make_input((m, f), torch.float16, specials=False)
    h_bad, da_bad = h.clone(), da.clone()
    h_bad[200, 17] = math.nan
    da_bad[123, 321] = special
    got = torch.tensor(scaling.UNRECORDED, device=DEV)
    activation.act_amax(h_bad, act, got)
    assert got.item() == math.inf
    got = torch.tensor(scaling.UNRECORDED, device=DEV)
    activation.act_bwd_amax(da_bad, h, act, got)
    assert got.item() == math.inf


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("fp8", FP8)
def test_current_scaling_two_steps(act, fp8):
    """act_amax then act_fwd_fp8(from_amax) (and the backward pair), as a quantizer runs them."""
    m, f = 1000, 1536
    h = make_input((m, h_width(act, f)), torch.bfloat16, specials=False)
    da = make_input((m, f), torch.bfloat16, specials=False)
    fh = h.shape[1]
    for first, second, values, n in (
            (lambda a: activation.act_amax(h, act, a), lambda *s, **k: activation.act_fwd_fp8(h, act, *s, **k),
             act_ref.act_forward(h, act), f),
            (lambda a: activation.act_bwd_amax(da, h, act, a),
             lambda *s, **k: activation.act_bwd_fp8(da, h, act, *s, **k), act_ref.act_grad(da, h, act), fh)):
        amax = torch.zeros((), device=DEV)
        first(amax)
        assert_rel(amax, reference.abs_max(values), "first pass amax")
        scale, inv = torch.tensor(0.625, device=DEV), torch.zeros((), device=DEV)
        count = torch.tensor(2, dtype=torch.int32, device=DEV)
        out, out_t = poisoned((m, n), fp8, 0x5A), poisoned((n, 1008), fp8, 0x5A)
        second(out, out_t, scale, inv, from_amax=amax, nonfinite_count=count)
        want_scale = scaling.compute_scale(amax, torch.tensor(0.625, device=DEV), scaling.fp8_max(fp8))
        assert_bitwise(scale, want_scale, "scale from the kernel's amax")
        assert_bitwise(inv, torch.reciprocal(want_scale), "scale_inv")
        assert count.item() == 2
        want = reference.saturating_cast(values, want_scale, fp8)
        want_t = torch.zeros((n, 1008), dtype=torch.uint8, device=DEV)
        want_t[:, :m] = want.view(torch.uint8).t()
        check_outputs(out, out_t, want, want_t.view(fp8), m, "two steps")


@pytest.mark.parametrize("from_amax", [0.0, -1.0, 1e-40, 3e38, math.inf, math.nan, 2.5],
                         ids=["zero", "unrecorded", "subnormal", "huge", "inf", "nan", "normal"])
@pytest.mark.parametrize("fp8", FP8)
def test_current_scaling_edge_amaxes(from_amax, fp8):
    """amax 0 / negative / inf / NaN keep the old scale (inf, NaN count); subnormal clamps to 2**126."""
    h = make_input((96, 320), torch.bfloat16)
    da = make_input((96, 160), torch.bfloat16)
    check_fwd(h, "swiglu", fp8, ("current", from_amax), mp=96)
    check_bwd(da, h, "swiglu", fp8, ("current", from_amax), mp=112)
    check_fwd(h, "gelu", fp8, ("current", from_amax), mp=None)


@pytest.mark.parametrize("act", ACTS)
def test_empty_inputs(act):
    f = 48
    h = torch.empty((0, h_width(act, f)), dtype=torch.bfloat16, device=DEV)
    da = torch.empty((0, f), dtype=torch.bfloat16, device=DEV)
    check_fwd(h, act, E4M3, CURRENT, mp=16)
    check_bwd(da, h, act, E5M2, DELAYED, mp=16, dbias_dtype=torch.bfloat16)
    got, want = torch.tensor(-1.0, device=DEV), torch.tensor(-1.0, device=DEV)
    activation.act_amax(h, act, got)
    act_ref.act_amax(h, act, want)
    assert_bitwise(got, want, "amax")


# --------------------------------------------------------------------------- CUDA graphs


def test_cuda_graph_capture_matches_eager():
    """A forward + backward activation step (delayed scaling, dbias) captured once and replayed on
    new inputs equals running it eagerly: no host sync, no allocation outside the graph's pool."""
    m, f, act = 1000, 512, "swiglu"

    def make_state():
        return dict(h=make_input((m, 2 * f), torch.bfloat16, specials=False),
                    da=make_input((m, f), torch.bfloat16, specials=False),
                    out=poisoned((m, f), E4M3, 0x5A), out_t=poisoned((f, 1008), E4M3, 0x5A),
                    dout=poisoned((m, 2 * f), E5M2, 0x5A), dout_t=poisoned((2 * f, 1008), E5M2, 0x5A),
                    scale=torch.tensor(3.7, device=DEV), dscale=torch.tensor(0.5, device=DEV),
                    inv=torch.zeros((), device=DEV), dinv=torch.zeros((), device=DEV),
                    amax=torch.full((), -1.0, device=DEV), damax=torch.full((), -1.0, device=DEV),
                    dbias=torch.zeros(2 * f, device=DEV))

    def step(s):
        activation.act_fwd_fp8(s["h"], act, s["out"], s["out_t"], s["scale"], s["inv"], s["amax"])
        activation.act_bwd_fp8(s["da"], s["h"], act, s["dout"], s["dout_t"], s["dscale"], s["dinv"], s["damax"],
                               dbias_out=s["dbias"])

    graphed = make_state()
    eager = {k: v.clone() for k, v in graphed.items()}
    warm = {k: v.clone() for k, v in graphed.items()}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(warm)  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(graphed)
    for replay in range(3):
        for key in ("h", "da"):
            new = make_input(graphed[key].shape, torch.bfloat16, specials=False) * (replay + 1)
            graphed[key].copy_(new)
            eager[key].copy_(new)
        graph.replay()
        step(eager)
        torch.cuda.synchronize()
        for key in graphed:
            assert_bitwise(graphed[key], eager[key], f"replay {replay}: {key}")
