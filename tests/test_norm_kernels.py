"""The LayerNorm / RMSNorm twins (kernels/norm_reference.py), the specification of kernels/norm.py.

Checked against torch's own layer_norm / rms_norm, float64 formulas and float64 autograd:
  mean, rstd, y     within 2e-6 of the row's scale (float32 arithmetic, K <= 1000)
  dx                within 1e-5 of max |dx| for float32 inputs, 1 ulp + that for bf16/fp16 outputs
  dweight, dbias    within 1e-5 of sum |terms| of each column (the float32 sum over M rows)
and bit for bit where the contract is a cast: out / out_t = reference.saturating_cast(y),
y_out = y rounded to x.dtype, the scale / scale_inv / amax / count bookkeeping of
reference.cast_transpose_amax.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from fp8train import scaling
from fp8train.kernels import norm_reference as ref
from fp8train.kernels import reference

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = [pytest.param(E4M3, id="e4m3"), pytest.param(E5M2, id="e5m2")]
X_DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16"),
            pytest.param(torch.float32, id="fp32")]
SHAPES = [pytest.param((1, 16), id="1x16"), pytest.param((37, 1000), id="37x1000"),
          pytest.param((3 * 5, 48), id="15x48"), pytest.param((4, 1), id="4x1")]
KINDS = [pytest.param(True, id="layernorm"), pytest.param(False, id="rmsnorm")]
EPS = 1e-5


# --------------------------------------------------------------------------- helpers


def make_x(shape, dtype) -> torch.Tensor:
    """Rows with their own offset and scale (2^-6 .. 2^6), so that the mean matters."""
    m, k = shape
    scale = torch.exp2(torch.randint(-6, 7, (m, 1)).float())
    offset = torch.randn(m, 1) * 3
    return ((torch.randn(m, k) + offset) * scale).to(dtype)


def make_params(k, layer, dtype=torch.float32):
    weight = (torch.randn(k) * 0.5 + 1).to(dtype)
    bias = torch.randn(k).to(dtype) if layer else None
    return weight, bias


def stats_buffers(m, layer):
    """Poisoned (M,) float32 outputs: NaN where the function forgot to write."""
    return (torch.full((m,), math.nan) if layer else None), torch.full((m,), math.nan)


def poisoned(shape, dtype) -> torch.Tensor:
    return torch.full(shape, 0x5A, dtype=torch.uint8).view(dtype)


def assert_bits_equal(got, want, what) -> None:
    int_view = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[got.element_size()]
    assert got.dtype == want.dtype and got.shape == want.shape, what
    assert torch.equal(got.view(int_view), want.view(int_view)), f"{what}: {got} != {want}"


def float64_forward(x, weight, bias, layer):
    """(mean, rstd, y) in float64 from the formulas."""
    x64 = x.double()
    mean = x64.mean(dim=1) if layer else torch.zeros(x.shape[0], dtype=torch.float64)
    var = (x64 - mean[:, None]).square().mean(dim=1)
    rstd = 1 / torch.sqrt(var + EPS)
    y = (x64 - mean[:, None]) * rstd[:, None] * weight.double()
    return mean, rstd, (y + bias.double() if bias is not None else y)


def assert_rows_close(got, want, row_scale, rel, what) -> None:
    """|got - want| <= rel * row_scale, row by row (row_scale: (M,) or (M, 1))."""
    err = (got.double() - want.double()).abs()
    bound = rel * row_scale.double().reshape(err.shape[0], *([1] * (err.dim() - 1)))
    assert (err <= bound).all(), f"{what}: max error {(err - bound).max().item():.3g} above the bound"


def run_fwd(x, weight, bias, fp8, mp=None, scale=3.7, amax_start=scaling.UNRECORDED, with_y=True, **kw):
    """norm_fwd_fp8 into fresh (poisoned) outputs; returns them all in a dict."""
    m, k = x.shape
    layer = kw.pop("layer", bias is not None)
    mean, rstd = kw.pop("stats", None) or stats_buffers(m, layer)
    o = dict(mean=mean, rstd=rstd, out=poisoned((m, k), fp8),
             out_t=None if mp is None else poisoned((k, mp), fp8),
             scale=torch.tensor(scale), scale_inv=torch.tensor(-7.0), amax=torch.tensor(amax_start),
             y=torch.full((m, k), math.nan, dtype=x.dtype) if with_y else None)
    ref.norm_fwd_fp8(x, weight, bias, EPS, o["mean"], o["rstd"], o["out"], o["out_t"], o["scale"], o["scale_inv"],
                     amax_out=o["amax"], y_out=o["y"], **kw)
    return o


# --------------------------------------------------------------------------- forward values


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("x_dtype", X_DTYPES)
@pytest.mark.parametrize("w_dtype", [pytest.param(torch.float32, id="w-fp32"), pytest.param(torch.bfloat16, id="w-bf16")])
def test_layer_norm_matches_torch(shape, x_dtype, w_dtype):
    x = make_x(shape, x_dtype)
    weight, bias = make_params(shape[1], True, w_dtype)
    mean, rstd = stats_buffers(shape[0], True)
    ref.norm_stats(x, weight, bias, EPS, mean, rstd)
    _, want_mean, want_rstd = torch.native_layer_norm(x.float(), (shape[1],), None, None, EPS)
    mean64, rstd64, y64 = float64_forward(x, weight, bias, True)
    row_scale = x.double().abs().amax(dim=1)
    assert_rows_close(mean, mean64, row_scale, 2e-6, "mean vs float64")
    assert_rows_close(rstd, rstd64, rstd64, 2e-6, "rstd vs float64")
    assert_rows_close(mean, want_mean.view(-1), row_scale, 2e-6, "mean vs native_layer_norm")
    assert_rows_close(rstd, want_rstd.view(-1), rstd64, 2e-6, "rstd vs native_layer_norm")
    y = ref.normalize(x, weight, bias, mean, rstd)
    torch_y = F.layer_norm(x.float(), (shape[1],), weight.float(), bias.float(), EPS)
    y_scale = y64.abs().amax(dim=1).clamp_min(1e-30)
    assert_rows_close(y, y64, y_scale, 2e-6, "y vs float64")
    assert_rows_close(y, torch_y, y_scale, 2e-6, "y vs F.layer_norm")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("x_dtype", X_DTYPES)
def test_rms_norm_matches_torch(shape, x_dtype):
    x = make_x(shape, x_dtype)
    weight, _ = make_params(shape[1], False, torch.float16)
    _, rstd = stats_buffers(shape[0], False)
    ref.norm_stats(x, weight, None, EPS, None, rstd)
    _, rstd64, y64 = float64_forward(x, weight, None, False)
    assert_rows_close(rstd, rstd64, rstd64, 2e-6, "rstd vs float64")
    y = ref.normalize(x, weight, None, None, rstd)
    torch_y = F.rms_norm(x.float(), (shape[1],), weight.float(), EPS)
    y_scale = y64.abs().amax(dim=1).clamp_min(1e-30)
    assert_rows_close(y, y64, y_scale, 2e-6, "y vs float64")
    assert_rows_close(y, torch_y, y_scale, 2e-6, "y vs F.rms_norm")


def test_stats_of_large_offsets_use_two_passes():
    """mean 300, std 0.05: float32 E[x^2] - mean^2 loses the variance, two passes keep it."""
    x = 300 + torch.randn(8, 512) * 0.05
    weight, bias = make_params(512, True)
    mean, rstd = stats_buffers(8, True)
    ref.norm_stats(x, weight, bias, EPS, mean, rstd)
    _, rstd64, _ = float64_forward(x, weight, bias, True)
    assert_rows_close(rstd, rstd64, rstd64, 1e-5, "rstd")
    one_pass = torch.rsqrt((x.square().mean(dim=1) - x.mean(dim=1).square()).clamp_min(0) + EPS)
    assert ((one_pass.double() - rstd64).abs() > 0.01 * rstd64).any(), "this input should defeat one pass"


# --------------------------------------------------------------------------- fp8 outputs


@pytest.mark.sweep
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("x_dtype", X_DTYPES)
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("layer", KINDS)
@pytest.mark.parametrize("pad", [0, 11], ids=["mp=m", "mp=m+11"])
def test_fp8_outputs_are_the_cast_of_y(shape, x_dtype, fp8, layer, pad):
    x = make_x(shape, x_dtype)
    weight, bias = make_params(shape[1], layer, torch.bfloat16)
    m = shape[0]
    o = run_fwd(x, weight, bias, fp8, mp=m + pad, layer=layer)
    want_mean, want_rstd = ref.row_stats(x, EPS, layer)
    if layer:
        assert_bits_equal(o["mean"], want_mean, "mean_out")
    assert_bits_equal(o["rstd"], want_rstd, "rstd_out")
    y = ref.normalize(x, weight, bias, want_mean, want_rstd)
    assert_bits_equal(o["out"], reference.saturating_cast(y, torch.tensor(3.7), fp8), "out")
    assert_bits_equal(o["out_t"][:, :m], o["out"].t().contiguous(), "out_t[:, :M]")
    assert not o["out_t"][:, m:].view(torch.uint8).any(), "out_t padding must be zero bytes"
    assert_bits_equal(o["y"], y.to(x_dtype), "y_out")
    assert_bits_equal(o["scale_inv"], torch.reciprocal(torch.tensor(3.7)), "scale_inv")
    assert_bits_equal(o["amax"], reference.abs_max(y), "amax")


@pytest.mark.parametrize("fp8", FP8)
def test_without_optional_outputs(fp8):
    x = make_x((9, 40), torch.bfloat16)
    weight, bias = make_params(40, True)
    full = run_fwd(x, weight, bias, fp8, mp=16)
    mean, rstd = stats_buffers(9, True)
    out, scale, inv = poisoned((9, 40), fp8), torch.tensor(3.7), torch.tensor(0.0)
    ref.norm_fwd_fp8(x, weight, bias, EPS, mean, rstd, out, None, scale, inv)
    assert_bits_equal(out, full["out"], "out")
    assert_bits_equal(mean, full["mean"], "mean")
    assert scale.item() == pytest.approx(3.7)


def test_row_strided_input_equals_contiguous():
    big = make_x((20, 70), torch.float16)
    x = big[2:19, 5:53]  # row stride 70, K = 48
    assert not x.is_contiguous()
    weight, bias = make_params(48, True)
    a = run_fwd(x, weight, bias, E4M3, mp=32)
    b = run_fwd(x.contiguous(), weight, bias, E4M3, mp=32)
    for key in ("mean", "rstd", "out", "out_t", "y", "amax"):
        assert_bits_equal(a[key], b[key], key)


@pytest.mark.parametrize("layer", KINDS)
def test_stats_ready_reads_the_given_stats(layer):
    """With stats_ready the stats are inputs: scaled rstd -> scaled xhat, buffers untouched."""
    x = make_x((6, 32), torch.float32)
    weight, bias = make_params(32, layer)
    mean, rstd = ref.row_stats(x, EPS, layer)
    rstd = rstd * 2
    given = ((mean.clone() if layer else None), rstd.clone())
    o = run_fwd(x, weight, bias, E5M2, stats=given, stats_ready=True, layer=layer)
    assert_bits_equal(o["rstd"], rstd, "rstd must stay as given")
    assert_bits_equal(o["y"], ref.normalize(x, weight, bias, mean, rstd), "y from the given stats")


# --------------------------------------------------------------------------- amax and scaling


@pytest.mark.parametrize("start", [scaling.UNRECORDED, 0.0, 1e30], ids=["unrecorded", "zero", "huge"])
@pytest.mark.parametrize("layer", KINDS)
def test_amax_accumulates(start, layer):
    x = make_x((7, 48), torch.bfloat16)
    weight, bias = make_params(48, layer)
    mean, rstd = stats_buffers(7, layer)
    amax = torch.tensor(start)
    ref.norm_stats(x, weight, bias, EPS, mean, rstd, amax_out=amax)
    y_amax = reference.abs_max(ref.normalize(x, weight, bias, mean, rstd))
    assert amax.item() == max(torch.tensor(start).item(), y_amax.item())
    o = run_fwd(x, weight, bias, E4M3, amax_start=start, layer=layer)
    assert o["amax"].item() == amax.item()


@pytest.mark.parametrize("special", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("layer", KINDS)
def test_nonfinite_input_rows(special, layer):
    """A NaN / inf anywhere makes the amax inf; LayerNorm turns its row NaN, RMSNorm its element."""
    x = make_x((5, 24), torch.float32)
    x[2, 7] = special
    weight, bias = make_params(24, layer)
    mean, rstd = stats_buffers(5, layer)
    amax = torch.tensor(scaling.UNRECORDED)
    ref.norm_stats(x, weight, bias, EPS, mean, rstd, amax_out=amax)
    assert amax.item() == math.inf
    o = run_fwd(x, weight, bias, E4M3, layer=layer)
    assert o["amax"].item() == math.inf
    nan_rows = o["y"].isnan().any(dim=1)
    assert nan_rows.tolist() == [False, False, True, False, False]
    if layer:
        assert o["y"][2].isnan().all() and o["out"][2].float().isnan().all()
    other = torch.tensor([0, 1, 3, 4])
    assert o["out"][other].float().isfinite().all()


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("layer", KINDS)
@pytest.mark.parametrize("x_dtype", X_DTYPES)
def test_current_scaling_two_steps(fp8, layer, x_dtype):
    """norm_stats(amax) + norm_fwd_fp8(from_amax, stats_ready) == the cast at compute_scale(amax(y))."""
    m, k = 13, 80
    x = make_x((m, k), x_dtype)
    weight, bias = make_params(k, layer)
    mean, rstd = stats_buffers(m, layer)
    a = torch.tensor(scaling.UNRECORDED)
    ref.norm_stats(x, weight, bias, EPS, mean, rstd, amax_out=a)
    scale, inv, count = torch.tensor(0.625), torch.tensor(-1.0), torch.tensor(3, dtype=torch.int32)
    out, out_t = poisoned((m, k), fp8), poisoned((k, 16), fp8)
    ref.norm_fwd_fp8(x, weight, bias, EPS, mean, rstd, out, out_t, scale, inv, from_amax=a, nonfinite_count=count,
                     stats_ready=True)
    y = ref.normalize(x, weight, bias, *ref.row_stats(x, EPS, layer))
    want_scale = scaling.compute_scale(reference.abs_max(y), torch.tensor(0.625), scaling.fp8_max(fp8))
    assert_bits_equal(scale, want_scale, "scale")
    assert_bits_equal(inv, torch.reciprocal(want_scale), "scale_inv")
    assert count.item() == 3
    assert_bits_equal(out, reference.saturating_cast(y, want_scale, fp8), "out")
    # The same bytes as the delayed-scaling cast (one call) at that scale.
    o = run_fwd(x, weight, bias, fp8, mp=16, scale=want_scale.item(), layer=layer)
    assert_bits_equal(out, o["out"], "delayed == current")
    assert_bits_equal(out_t, o["out_t"], "delayed == current (out_t)")


@pytest.mark.parametrize("from_amax", [0.0, math.inf, math.nan], ids=["zero", "inf", "nan"])
def test_current_scaling_unusable_amax_keeps_the_scale(from_amax):
    x = make_x((4, 16), torch.bfloat16)
    weight, bias = make_params(16, True)
    o = run_fwd(x, weight, bias, E4M3, scale=0.625, from_amax=torch.tensor(from_amax),
                nonfinite_count=torch.tensor(0, dtype=torch.int32))
    assert o["scale"].item() == 0.625


# --------------------------------------------------------------------------- backward


def autograd_backward(x, weight, bias, dy, layer):
    """(dx, dweight, dbias) by float64 autograd through torch's own norms."""
    x64 = x.double().requires_grad_()
    w64 = weight.double().requires_grad_()
    b64 = bias.double().requires_grad_() if bias is not None else None
    if layer:
        y = F.layer_norm(x64, (x.shape[1],), w64, b64, EPS)
    else:
        y = F.rms_norm(x64, (x.shape[1],), w64, EPS)
    y.backward(dy.double())
    return x64.grad, w64.grad, (b64.grad if b64 is not None else None)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("x_dtype", X_DTYPES)
@pytest.mark.parametrize("layer", KINDS)
def test_backward_matches_float64_autograd(shape, x_dtype, layer):
    m, k = shape
    x = make_x(shape, x_dtype)
    dy = torch.randn(shape).to(x_dtype)
    weight, bias = make_params(k, layer)
    mean, rstd = stats_buffers(m, layer)
    ref.norm_stats(x, weight, bias, EPS, mean, rstd)
    dx = torch.full(shape, math.nan, dtype=x_dtype)
    dw = torch.full((k,), math.nan)
    db = torch.full((k,), math.nan) if layer else None
    ref.norm_bwd(dy, x, weight, mean, rstd, dx, dw, db)
    want_dx, want_dw, want_db = autograd_backward(x, weight, bias, dy, layer)

    # dx cancels terms of size rstd * (|g| + |mean(g)| + |xhat * mean(g * xhat)|): float32
    # keeps 1e-5 of those (an RMSNorm row of one large element cancels almost everything).
    _, rstd64, _ = float64_forward(x, weight, bias, layer)
    mean64 = x.double().mean(dim=1) if layer else torch.zeros(m, dtype=torch.float64)
    xhat = (x.double() - mean64[:, None]) * rstd64[:, None]
    g = dy.double() * weight.double()
    terms = g.abs() + (xhat * (g * xhat).mean(dim=1, keepdim=True)).abs()
    if layer:
        terms = terms + g.mean(dim=1, keepdim=True).abs()
    dx_scale = rstd64[:, None] * terms.amax(dim=1, keepdim=True)
    ulp = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[x_dtype]
    err = (dx.double() - want_dx).abs()
    assert (err <= 1e-5 * dx_scale + ulp * want_dx.abs()).all(), f"dx: max error {err.max().item():.3g}"
    w_mag = (dy.double() * xhat).abs().sum(dim=0)
    b_mag = dy.double().abs().sum(dim=0)
    # + float64 noise: with K = 1 autograd's xhat is ~1e-14 where ours is exactly 0
    assert ((dw.double() - want_dw).abs() <= 1e-5 * w_mag + 1e-10 * b_mag).all(), "dweight"
    if layer:
        assert ((db.double() - want_db).abs() <= 1e-5 * b_mag + 1e-30).all(), "dbias"


@pytest.mark.parametrize("g_dtype", [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")])
def test_backward_low_precision_parameter_grads(g_dtype):
    """dweight / dbias are accumulated in float32 and rounded once into their own dtype."""
    x = make_x((11, 48), torch.bfloat16)
    dy = torch.randn(11, 48).to(torch.bfloat16)
    weight, _ = make_params(48, True, g_dtype)
    mean, rstd = ref.row_stats(x, EPS, True)
    dx32, dw32, db32 = torch.empty_like(x), torch.empty(48), torch.empty(48)
    ref.norm_bwd(dy, x, weight, mean, rstd, dx32, dw32, db32)
    dx, dw, db = torch.empty_like(x), torch.empty(48, dtype=g_dtype), torch.empty(48, dtype=g_dtype)
    ref.norm_bwd(dy, x, weight, mean, rstd, dx, dw, db)
    assert_bits_equal(dx, dx32, "dx")
    assert_bits_equal(dw, dw32.to(g_dtype), "dweight")
    assert_bits_equal(db, db32.to(g_dtype), "dbias")


# --------------------------------------------------------------------------- empty and bad inputs


def test_empty_batch():
    x = torch.empty((0, 24), dtype=torch.bfloat16)
    weight, bias = make_params(24, True)
    o = run_fwd(x, weight, bias, E4M3, mp=16, amax_start=scaling.UNRECORDED)
    assert not o["out_t"].view(torch.uint8).any(), "out_t is all padding"
    assert o["amax"].item() == 0.0  # as reference.amax of an empty tensor
    dw, db = torch.full((24,), math.nan), torch.full((24,), math.nan)
    ref.norm_bwd(x, x, weight, torch.empty(0), torch.empty(0), torch.empty_like(x), dw, db)
    assert not dw.any() and not db.any()


def fwd_args(**changes):
    """Valid norm_fwd_fp8 arguments (LayerNorm, x (8, 16) bf16) with some replaced."""
    args = dict(x=torch.randn(8, 16, dtype=torch.bfloat16), weight=torch.ones(16), bias=torch.zeros(16), eps=EPS,
                mean_out=torch.empty(8), rstd_out=torch.empty(8), out=torch.empty(8, 16, dtype=E4M3),
                out_t=torch.empty(16, 16, dtype=E4M3), scale=torch.tensor(1.0), scale_inv_out=torch.tensor(1.0))
    args.update(changes)
    return args


def bwd_args(**changes):
    args = dict(dy=torch.randn(8, 16), x=torch.randn(8, 16), weight=torch.ones(16), mean=torch.zeros(8),
                rstd=torch.ones(8), dx_out=torch.empty(8, 16), dweight_out=torch.empty(16),
                dbias_out=torch.empty(16))
    args.update(changes)
    return args


BAD_FWD = [
    (dict(x=torch.randn(2, 4, 16, dtype=torch.bfloat16)), "x must be 2-D"),
    (dict(x=torch.randn(8, 16, dtype=torch.float64)), "x must be bfloat16"),
    (dict(x=torch.randn(16, 8, dtype=torch.bfloat16).t()), "unit stride"),
    (dict(x=torch.randn(8, 0, dtype=torch.bfloat16)), "K >= 1"),
    (dict(weight=torch.ones(15)), "weight must be a contiguous \\(16,\\)"),
    (dict(weight=None), "weight must be a \\(16,\\) tensor"),
    (dict(weight=torch.ones(16, dtype=torch.int32)), "weight must be"),
    (dict(weight=torch.ones(32)[::2]), "weight must be a contiguous"),
    (dict(weight=torch.ones(16, device="meta")), "on cpu"),
    (dict(mean_out=None), "bias is given but mean_out is None"),
    (dict(eps=-1.0), "eps must be"),
    (dict(eps=torch.tensor(1e-5)), "eps must be"),
    (dict(mean_out=torch.empty(8, dtype=torch.float16)), "mean_out must be float32"),
    (dict(rstd_out=torch.empty(7)), "rstd_out must be a contiguous \\(8,\\)"),
    (dict(out=torch.empty(8, 16)), "out must be float8"),
    (dict(out=None), "out must be a \\(8, 16\\) tensor; got NoneType"),
    (dict(rstd_out=None), "rstd_out must be a \\(8,\\) tensor"),
    (dict(scale=1.0), "scale must be a one-element"),
    (dict(out=torch.empty(16, 8, dtype=E4M3).t()), "out must be a contiguous"),
    (dict(out_t=torch.empty(16, 7, dtype=E4M3)), "out_t must be \\(K, Mp\\)"),
    (dict(out_t=torch.empty(16, 16, dtype=E5M2)), "out_t must be float8_e4m3fn"),
    (dict(y_out=torch.empty(8, 16)), "y_out must be bfloat16"),
    (dict(scale=torch.tensor(1.0, dtype=torch.float64)), "scale must be"),
    (dict(amax_out=torch.tensor([1.0, 2.0])), "amax_out must be"),
    (dict(nonfinite_count=torch.tensor(0)), "nonfinite_count must be"),
]


@pytest.mark.parametrize("changes,match", BAD_FWD, ids=[m for _, m in BAD_FWD])
def test_fwd_rejects_bad_arguments(changes, match):
    with pytest.raises(ValueError, match=f"norm_fwd_fp8: .*{match}"):
        ref.norm_fwd_fp8(**fwd_args(**changes))


def test_from_amax_must_not_be_amax_out():
    a = torch.tensor(1.0)
    with pytest.raises(ValueError, match="different buffers"):
        ref.norm_fwd_fp8(**fwd_args(amax_out=a, from_amax=a))


def test_stats_rejects_bad_arguments():
    x = torch.randn(8, 16)
    with pytest.raises(ValueError, match="norm_stats: bias is given"):
        ref.norm_stats(x, torch.ones(16), torch.zeros(16), EPS, None, torch.empty(8))
    with pytest.raises(ValueError, match="norm_stats: rstd_out must be float32"):
        ref.norm_stats(x, torch.ones(16), None, EPS, None, torch.empty(8, dtype=torch.bfloat16))


BAD_BWD = [
    (dict(dy=torch.randn(8, 17)), "dy must have x's shape"),
    (dict(dy=torch.randn(16, 8).t()), "dy of shape .* unit stride"),
    (dict(x=torch.randn(8, 16, dtype=torch.float64)), "x must be"),
    (dict(mean=torch.zeros(8, dtype=torch.float64)), "mean must be float32"),
    (dict(rstd=torch.ones(9)), "rstd must be a contiguous"),
    (dict(dx_out=torch.empty(8, 16, dtype=torch.bfloat16)), "dx_out must be float32"),
    (dict(dweight_out=torch.empty(8)), "dweight_out must be a contiguous"),
    (dict(mean=None), "dbias_out is given but mean is None"),
    (dict(weight=torch.ones(16, device="meta")), "on cpu"),
]


@pytest.mark.parametrize("changes,match", BAD_BWD, ids=[m for _, m in BAD_BWD])
def test_bwd_rejects_bad_arguments(changes, match):
    with pytest.raises(ValueError, match=f"norm_bwd: .*{match}"):
        ref.norm_bwd(**bwd_args(**changes))


def test_backward_launch_shape_by_row_length():
    """NormConfigs.bwd_for: narrow rows (up to narrow_bwd's whole-row length) take narrow_bwd,
    then bwd up to its whole-row length, longer rows wide_bwd; without narrow_bwd, bwd."""
    pytest.importorskip("triton")
    from fp8train.kernels import norm

    def row(max_n, warps):
        return norm.RowConfig(block=4096, max_block_n=max_n, long_block_m=4, num_warps=warps, programs_per_sm=2)
    narrow, bwd, wide = row(1024, 4), row(4096, 8), row(8192, 16)
    configs = norm.NormConfigs(rows=bwd, tiles=norm.TileConfig(32, 128, 8, 2), bwd=bwd, wide_bwd=wide,
                               narrow_bwd=narrow)
    assert [configs.bwd_for(k) for k in (1, 1000, 1024, 1025, 4096, 4097, 20000)] == \
        [narrow, narrow, narrow, bwd, bwd, wide, wide]
    plain = norm.NormConfigs(rows=bwd, tiles=norm.TileConfig(32, 128, 8, 2), bwd=bwd, wide_bwd=wide)
    assert [plain.bwd_for(k) for k in (1000, 4096, 4097)] == [bwd, bwd, wide]
    assert norm.launch_configs(torch.device("cuda")).bwd_for(1024).num_warps == 4  # the measured narrow shape
