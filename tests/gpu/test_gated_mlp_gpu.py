"""fp8train.GatedMLP on the GPU (modules/gated_mlp.py): the gated Triton kernels, act(g) * u
and its backward with act silu or gelu_tanh (kernels/gated.py), against their twin
(kernels/gated_reference.py, run on the CPU), their launch groups replayed from C++, a
converted HF Llama (tiny shape, FP32 parameters under torch.autocast(bfloat16)) that trains
with fused MLPs as with HF's, and a GeGLU MLP of fp8train.Linear projections that trains on
the fused path.

Tolerances, kernel against twin. The kernels evaluate the twin's float32 expressions op for
op, but with the GPU's exp2 (ex2.approx.f32, within 2 ulps of the exact value; torch's, the
twin's, within 1) and division (div.full.f32, within 2 ulps; the twin's is IEEE). So
exp(-g) may differ by 3 ulps, s = 1 / (1 + exp(-g)) by at most 3 + 2.5 ulps (the first
scaled by e / (1 + e) <= 1), and g * s * u, da * g * s by one rounding more each side: 7.5
ulps, within 2^-20 relative (8 ulps at the bottom of a binade). dg's 1 + g (1 - s) cancels
near g = -1.28, so its bound has an absolute part, |g| times the error of 1 - s: 2^-20
(1 + |g|) |da u s| on top of 2^-20 |dg|. bf16 / fp16 outputs are those float32 values rounded
once, so they equal the twin's but where the float32 value lies within 8 of its ulps of a
rounding boundary: at most the fraction 8 * 2^-23 / eps(dtype) of elements (2^-13 for bf16,
2^-10 for fp16; seen far fewer), each exactly one ulp off.

gelu_tanh: the same with z = 2 k (g + c g^3) in g's place (products and an fma, alike on
both sides: no exp2 or division in it): s = sigmoid(z), out = g s u and du = da g s within
2^-20 relative. dg = da u (s + g s (1 - s) z'), z' = 2 k (1 + 3 c g^2), cancels near
g = -0.75 (gelu_tanh's minimum): within 2^-20 (|da u s| (1 + |g| z' (1 - s)) + |dg|). Its
s is a float32 subnormal for g in (-10.061, -10.001), which float32 inputs of spread 4 do
reach: there the GPU's division may flush s to zero, an absolute error below FLT_MIN
(2^-126) in s and in a result that is itself subnormal, which adds FLT_MIN (1 + |g u|) to
out's bound, FLT_MIN (1 + |g da|) to du's and FLT_MIN (1 + |da u| (1 + |g| z')) to dg's
(bf16 inputs hold no g there: -10 is just above, its s normal; fp16 outputs that small are 0).

Not covered: silu's g in (-88.7, -87.3), where its s is a float32 subnormal (silu(g) ~ 1e-36
there), out of reach of the inputs' spread.
"""

import pytest
import torch

import fp8train
from fp8train import kernels
from fp8train.kernels import gated_reference as ref
from fp8train.kernels.activation_reference import TANH_2K, TANH_C
from fp8train.modules import gated_mlp
from tests.helpers import llama_steps_side_by_side, sqnr_db

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
SHAPES = [pytest.param((8192, 2816), id="8192x2816"), pytest.param((333, 5632), id="333x5632"),
          pytest.param((7, 13, 129), id="7x13x129")]
DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16"),
          pytest.param(torch.float32, id="fp32")]
RECIPES = [pytest.param(fp8train.CurrentScaling(), id="current"), pytest.param(fp8train.DelayedScaling(), id="delayed")]
ACTS = [pytest.param(act, id=act) for act in ref.GATED_ACTIVATIONS]
INF, NAN = float("inf"), float("nan")
FLT_MIN = 2.0**-126  # float32's smallest normal: a subnormal the GPU may flush is below it


def _llama():
    pytest.importorskip("transformers")
    import hf_llama
    return hf_llama


def _inputs(shape, dtype, seed):
    """g, u, da on the GPU; at the front of the flat tensors, g's special values (+-inf, NaN,
    +-0, +-100, 1e30: inf in fp16), then u's and da's (with random others)."""
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    make = lambda spread: (torch.randn(shape, generator=gen, device=CUDA) * spread).to(dtype)  # noqa: E731
    g, u, da = make(4.0), make(2.0), make(1.0)
    specials = [INF, -INF, NAN, 0.0, -0.0, 100.0, -100.0, 1e30]
    g.view(-1)[:len(specials)] = torch.tensor(specials, device=CUDA).to(dtype)
    u.view(-1)[8:11] = torch.tensor([INF, -INF, NAN], device=CUDA).to(dtype)
    da.view(-1)[11:14] = torch.tensor([INF, -INF, NAN], device=CUDA).to(dtype)
    return g, u, da


def _twin(g, u, da, act):
    """The twin's (out, dg, du) of CPU copies, in the outputs' dtypes."""
    g, u, da = g.cpu(), u.cpu(), da.cpu()
    out, dg, du = torch.empty_like(g), torch.empty_like(g), torch.empty_like(u)
    ref.gated_fwd(g, u, act, out)
    ref.gated_bwd(da, g, u, act, dg, du)
    return out, dg, du


def _float32_bounds(g, u, da, act, w_out, w_dg, w_du):
    """The bounds on the float32 out, dg and du's distance from the twin's (module docstring)."""
    rel = 2.0**-20
    x, up, d = g.cpu().double(), u.cpu().double(), da.cpu().double()
    out, dg, du = (t.double().abs() for t in (w_out, w_dg, w_du))
    if act == "silu":
        scale = (d * up * torch.sigmoid(x)).abs()
        return rel * out, rel * (1 + x.abs()) * scale + rel * dg, rel * du
    s = torch.sigmoid(TANH_2K * x * (1 + TANH_C * x * x))
    dz = TANH_2K * (1 + 3 * TANH_C * x * x)
    return (rel * out + FLT_MIN * (1 + (x * up).abs()),
            rel * ((d * up * s).abs() * (1 + x.abs() * dz * (1 - s)) + dg)
            + FLT_MIN * (1 + (d * up).abs() * (1 + x.abs() * dz)),
            rel * du + FLT_MIN * (1 + (x * d).abs()))


def _same_non_finite(got, want, what):
    assert got.dtype == want.dtype and got.shape == want.shape, what
    assert torch.equal(got.isnan(), want.isnan()), f"{what}: NaN positions differ"
    inf = want.isinf()
    assert torch.equal(got.isinf(), inf) and torch.equal(got[inf], want[inf]), f"{what}: infs differ"


def _assert_float32_within(got, want, bound, what):
    _same_non_finite(got, want, what)
    fin = want.isfinite()
    err = (got.double() - want.double()).abs()[fin]
    b = bound[fin]
    assert (err <= b).all(), f"{what}: {int((err > b).sum())} beyond; worst {(err / b).max().item():.2f} x the bound"


def _assert_rounded_match(got, want, what):
    """Equal but in at most 8 * 2^-23 / eps(dtype) of the elements, each one ulp off (module docstring)."""
    _same_non_finite(got, want, what)
    keep = ~want.isnan()
    bits = lambda t: t.view(torch.int16)[keep].int()  # noqa: E731
    order = lambda b: torch.where(b < 0, -(b & 0x7FFF), b)  # noqa: E731 (+0 and -0 both at 0)
    dist = (order(bits(got)) - order(bits(want))).abs()
    assert dist.numel() == 0 or dist.max() <= 1, f"{what}: {int((dist > 1).sum())} elements more than one ulp off"
    allowed = 1 + int(dist.numel() * 8 * 2.0**-23 / torch.finfo(got.dtype).eps)
    assert int((dist != 0).sum()) <= allowed, f"{what}: {int((dist != 0).sum())} of {dist.numel()} one ulp off"


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_kernels_match_the_twin(shape, dtype, act):
    """out, dg and du against the twin's, specials included: bf16 / fp16 equal but in the rare
    element one ulp off, float32 within the bounds of the module docstring."""
    g, u, da = _inputs(shape, dtype, seed=sum(shape))
    out = torch.full_like(g, NAN)  # every element must be written
    dg, du = torch.full_like(g, NAN), torch.full_like(u, NAN)
    kernels.gated_fwd(g, u, act, out)
    kernels.gated_bwd(da, g, u, act, dg, du)
    w_out, w_dg, w_du = _twin(g, u, da, act)
    out, dg, du = out.cpu(), dg.cpu(), du.cpu()
    if dtype != torch.float32:
        for name, a, b in (("out", out, w_out), ("dg", dg, w_dg), ("du", du, w_du)):
            _assert_rounded_match(a, b, f"{name} {shape} {dtype}")
        return
    b_out, b_dg, b_du = _float32_bounds(g, u, da, act, w_out, w_dg, w_du)
    _assert_float32_within(out, w_out, b_out, f"out {shape}")
    _assert_float32_within(du, w_du, b_du, f"du {shape}")
    _assert_float32_within(dg, w_dg, b_dg, f"dg {shape}")


@pytest.mark.parametrize("act", ACTS)
def test_mixed_input_dtypes(act):
    """u of another dtype than g (the contract allows it): out and dg in g's dtype, du in u's."""
    g, _, da = _inputs((333, 1029), torch.bfloat16, seed=5)
    u = torch.randn(333, 1029, device=CUDA) * 2
    out, dg, du = torch.empty_like(g), torch.empty_like(g), torch.empty_like(u)
    kernels.gated_fwd(g, u, act, out)
    kernels.gated_bwd(da, g, u, act, dg, du)
    w_out, w_dg, w_du = _twin(g, u, da, act)
    _assert_rounded_match(out.cpu(), w_out, "out")
    _assert_rounded_match(dg.cpu(), w_dg, "dg")
    _assert_float32_within(du.cpu(), w_du, _float32_bounds(g, u, da, act, w_out, w_dg, w_du)[2], "du")


def _count_python_launches(monkeypatch) -> list:
    """The names of the kernels.gated_* wrappers called from now on (a replayed call calls none)."""
    calls = []
    for name in ("gated_fwd", "gated_bwd"):
        original = getattr(kernels, name)

        def counted(*args, _original=original, _name=name):
            calls.append(_name)
            return _original(*args)
        monkeypatch.setattr(kernels, name, counted)
    return calls


@pytest.mark.parametrize("act", ACTS)
def test_the_second_call_replays_the_launch_group(native_extension, monkeypatch, act):
    """The first call of a shape launches from Python and builds the launch groups; the next
    calls run from them (C++) with their own tensors: the same results as Python launches
    on those tensors, bit for bit."""
    gated_mlp._FWD_GROUPS.clear()
    gated_mlp._BWD_GROUPS.clear()
    calls = _count_python_launches(monkeypatch)
    g, u, da = _inputs((1024, 2816), torch.bfloat16, seed=3)
    first = gated_mlp.gated_forward(g, u, act), *gated_mlp.gated_backward(da, g, u, act)
    assert calls == ["gated_fwd", "gated_bwd"]
    assert any(gated_mlp._FWD_GROUPS.values()) and any(gated_mlp._BWD_GROUPS.values())
    again = gated_mlp.gated_forward(g, u, act), *gated_mlp.gated_backward(da, g, u, act)
    assert calls == ["gated_fwd", "gated_bwd"], "the second call took Python"
    for name, a, b in zip(("out", "dg", "du"), again, first):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), name
    # other tensors of the same shape: the group launches on them, not on the first call's
    g2, u2, da2 = _inputs((1024, 2816), torch.bfloat16, seed=4)
    replayed = gated_mlp.gated_forward(g2, u2, act), *gated_mlp.gated_backward(da2, g2, u2, act)
    assert len(calls) == 2
    want = torch.empty_like(g2), torch.empty_like(g2), torch.empty_like(u2)
    kernels.gated_fwd(g2, u2, act, want[0])
    kernels.gated_bwd(da2, g2, u2, act, want[1], want[2])
    for name, a, b in zip(("out", "dg", "du"), replayed, want):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), name


def test_each_activation_has_its_own_group(native_extension):
    """The launch groups are keyed by the activation: after a silu call of a shape, a gelu_tanh
    call of the same tensors records its own group, and each replays its own kernel."""
    gated_mlp._FWD_GROUPS.clear()
    g, u, _ = _inputs((333, 1029), torch.bfloat16, seed=6)
    results = {act: [gated_mlp.gated_forward(g, u, act) for _ in range(2)] for act in ref.GATED_ACTIVATIONS}
    assert sum(1 for v in gated_mlp._FWD_GROUPS.values() if v) == 2
    for act, outs in results.items():
        want = torch.empty_like(g)
        kernels.gated_fwd(g, u, act, want)
        for a in outs + [gated_mlp.gated_forward(g, u, act)]:
            assert torch.equal(a.view(torch.int16), want.view(torch.int16)), act
    assert not torch.equal(results["silu"][0], results["gelu_tanh"][0])


@pytest.mark.parametrize("act", ACTS)
def test_a_misaligned_view_gets_its_own_group(native_extension, act):
    """Inputs that start 2 bytes into a buffer (not 16-byte aligned): their own recording,
    with the results of a Python launch."""
    gated_mlp._FWD_GROUPS.clear()
    n = 513 * 1031
    g_buf, u_buf = (torch.randn(n + 1, device=CUDA).to(torch.bfloat16) for _ in range(2))
    g, u = g_buf[1:].view(513, 1031), u_buf[1:].view(513, 1031)
    assert g.data_ptr() % 16 != 0
    results = [gated_mlp.gated_forward(g, u, act) for _ in range(2)]  # Python and recording, then the group
    want = torch.empty_like(g)
    kernels.gated_fwd(g, u, act, want)
    for a in results:
        assert torch.equal(a.view(torch.int16), want.view(torch.int16))
    aligned = g.contiguous().clone(), u.contiguous().clone()
    assert aligned[0].data_ptr() % 16 == 0
    for _ in range(2):
        assert torch.equal(gated_mlp.gated_forward(*aligned, act).view(torch.int16), want.view(torch.int16))
    assert sum(1 for v in gated_mlp._FWD_GROUPS.values() if v) == 2


@pytest.mark.parametrize("act", ACTS)
def test_gated_mlp_steady_state_is_its_first_call(native_extension, act):
    """nn.Linear projections under torch.autocast(bfloat16), inside fp8train.autocast: the
    first call (Python launches) and the next (replayed) give the same output and gradients,
    bit for bit, on the fused path; and within bf16 roundings of float64 (normwise 4 x 2^-8,
    as tests/test_gated_mlp.py on the CPU)."""
    torch.manual_seed(0)
    mlp = gated_mlp.GatedMLP(*(torch.nn.Linear(a, b, bias=False, device=CUDA)
                               for a, b in ((512, 1408), (512, 1408), (1408, 512))), activation=act)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    x = torch.randn(4, 77, 512, device=CUDA) * 2
    dy = torch.randn(4, 77, 512, device=CUDA)
    runs = []
    for _ in range(2):
        x1 = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16), fp8train.autocast(recipe=fp8train.CurrentScaling()):
            y = mlp(x1)
        y.backward(dy.to(y.dtype))
        runs.append([y.detach(), x1.grad] + [p.grad.clone() for p in mlp.parameters()])
        mlp.zero_grad(set_to_none=True)
    assert fp8train.inspect.mlp_paths(torch.nn.Sequential(mlp)) == {"0": gated_mlp.FUSED}
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    x64 = x.double().requires_grad_()
    w = [p.detach().double().requires_grad_() for p in mlp.parameters()]
    y64 = gated_mlp.ACTIVATIONS[act](x64 @ w[0].t()) * (x64 @ w[1].t()) @ w[2].t()
    y64.backward(dy.double())
    for name, got, want in zip(("y", "dx", "dgate", "dup", "ddown"), runs[0], [y64, x64.grad] + [t.grad for t in w]):
        err = ((got.double() - want).norm() / want.norm()).item()
        assert err < 4 * 2.0**-8, (name, err)


def test_geglu_of_fp8_linears_trains_on_the_fused_path():
    """GeGLU (Gemma's MLP): a GatedMLP(activation="gelu_tanh") of three fp8train.Linear, float32
    activations, trains inside fp8train.autocast(CurrentScaling) on the fused path, its loss
    lower at each of 5 AdamW steps. After them, y and the gradients (x's, the weights') against
    gated_mlp_formula on the same projections: run inside the same autocast (the same FP8
    GEMMs; act(g) * u differs by float32 ulps, which an FP8 cast now and then turns into a
    flipped byte: seen up to 5e-4 on the CPU) within 1e-2 relative Frobenius error (a silu in
    gelu_tanh's place is 16% off); run outside it, in float32 throughout, above 15 dB SQNR:
    FP8's error, e4m3 forward and e5m2 backward casts (seen 17 dB for y, 20 dB for the
    gradients on the CPU; a wrong scale gives 0 dB or less)."""
    torch.manual_seed(0)
    mlp = gated_mlp.GatedMLP(*(fp8train.Linear(a, b, bias=False, device=CUDA)
                               for a, b in ((512, 1408), (512, 1408), (1408, 512))), activation="gelu_tanh")
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    opt = torch.optim.AdamW(mlp.parameters(), lr=1e-3)
    x = torch.randn(4, 77, 512, device=CUDA) * 2
    target, dy = torch.randn(4, 77, 512, device=CUDA), torch.randn(4, 77, 512, device=CUDA)
    losses = []
    for _ in range(5):
        with fp8train.autocast(recipe=fp8train.CurrentScaling()):
            loss = torch.nn.functional.mse_loss(mlp(x), target)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert fp8train.inspect.mlp_paths(torch.nn.Sequential(mlp)) == {"0": gated_mlp.FUSED}
    assert all(b < a for a, b in zip(losses, losses[1:])), losses

    def run(fn, fp8):
        x1 = x.clone().requires_grad_()
        with fp8train.autocast(enabled=fp8, recipe=fp8train.CurrentScaling()):
            y = fn(x1)
        y.backward(dy)
        results = [y.detach(), x1.grad] + [p.grad for p in mlp.parameters()]
        mlp.zero_grad(set_to_none=True)
        return results

    def formula(t):
        return gated_mlp.gated_mlp_formula(t, mlp.gate_proj, mlp.up_proj, mlp.down_proj, "gelu_tanh")

    fused, inside, outside = run(mlp, True), run(formula, True), run(formula, False)
    for name, got, same_gemms, high in zip(("y", "dx", "dgate", "dup", "ddown"), fused, inside, outside):
        assert got.isfinite().all(), name
        err = ((got.double() - same_gemms.double()).norm() / same_gemms.double().norm()).item()
        assert err < 1e-2, (name, err)
        assert sqnr_db(got, high) > 15, (name, sqnr_db(got, high))


@pytest.mark.parametrize("recipe", RECIPES)
def test_converted_llama_trains_with_fused_mlps_as_with_hfs(recipe):
    """Every Linear on the C++ node and both layers' MLPs on the kernels; losses within 1e-3
    of the model with HF's MLPs at each of 6 steps (HF's bf16 ops round silu(gate) before the
    product, the kernel once: last-bit differences, which the FP8 casts can turn into a flipped
    byte)."""
    hf_llama = _llama()
    models = []
    for fuse in (True, False):
        model = hf_llama.build_llama(hf_llama.SHAPES["tiny"], CUDA)
        fp8train.convert(model, recipe, filter_fn=hf_llama.not_lm_head, fuse_mlps=fuse)
        models.append(model)
    assert [type(layer.mlp) for layer in models[0].model.layers] == [gated_mlp.GatedMLP] * 2
    fused, hfs = llama_steps_side_by_side(models, recipe, 6, CUDA)
    assert fused.isfinite().all() and hfs.isfinite().all(), (fused, hfs)
    torch.testing.assert_close(fused, hfs, rtol=1e-3, atol=0)
    for model in models:
        assert set(fp8train.inspect.execution_paths(model).values()) == {"C++ node"}
    assert fp8train.inspect.mlp_paths(models[0]) == {f"model.layers.{i}.mlp": gated_mlp.FUSED for i in range(2)}
    assert fp8train.inspect.mlp_paths(models[1]) == {}


def test_fused_mlps_keep_one_activation_less(native_extension):
    """Autograd keeps g and u per fused MLP, HF's ops g, u and silu(g): after the forward,
    the fused model holds at least layers x (batch x seq x intermediate) bf16 elements less
    (the same model otherwise: the same projections' FP8 saves), and its step's peak is not
    above the other's. Measured on the third step of each (quantizers, optimizer state,
    workspaces and launch groups all made)."""
    hf_llama = _llama()
    shape = hf_llama.SHAPES["tiny"]
    models = []
    for fuse in (True, False):
        model = hf_llama.build_llama(shape, CUDA)
        fp8train.convert(model, fp8train.CurrentScaling(), filter_fn=hf_llama.not_lm_head, fuse_mlps=fuse)
        models.append(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in models]
    batch, seq = 16, 64
    x = torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(2)).to(CUDA)
    held, peaks = [], []
    for step in range(3):
        for model, opt in zip(models, opts):
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            with torch.autocast("cuda", dtype=torch.bfloat16), fp8train.autocast(recipe=fp8train.CurrentScaling()):
                loss = model(input_ids=x, labels=x, use_cache=False).loss
            after_forward = torch.cuda.memory_allocated()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del loss
            torch.cuda.synchronize()
            if step == 2:
                held.append(after_forward - before)
                peaks.append(torch.cuda.max_memory_allocated() - before)
    assert set(fp8train.inspect.mlp_paths(models[0]).values()) == {gated_mlp.FUSED}
    silu_bytes = shape.layers * batch * seq * shape.ffn * 2
    assert held[1] - held[0] >= silu_bytes, (held, silu_bytes)
    assert peaks[0] <= peaks[1], peaks
