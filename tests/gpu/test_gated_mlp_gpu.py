"""fp8train.GatedMLP on the GPU (modules/gated_mlp.py): the SwiGLU Triton kernels
(kernels/swiglu.py) against their twin (kernels/swiglu_reference.py, run on the CPU), their
launch groups replayed from C++, and a converted HF Llama (tiny shape, FP32 parameters under
torch.autocast(bfloat16)) that trains with fused MLPs as with HF's.

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

Not covered: g in (-88.7, -87.3), where s is a float32 subnormal: the GPU's division may
flush it to zero where the twin keeps it (silu(g) ~ 1e-36 there).
"""
import sys
from pathlib import Path

import pytest
import torch

import fp8train
from fp8train import kernels
from fp8train.kernels import swiglu_reference as ref
from fp8train.modules import gated_mlp
from tests.helpers import llama_steps_side_by_side

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
SHAPES = [pytest.param((8192, 2816), id="8192x2816"), pytest.param((333, 5632), id="333x5632"),
          pytest.param((7, 13, 129), id="7x13x129")]
DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16"),
          pytest.param(torch.float32, id="fp32")]
RECIPES = [pytest.param(fp8train.CurrentScaling(), id="current"), pytest.param(fp8train.DelayedScaling(), id="delayed")]
INF, NAN = float("inf"), float("nan")


def _llama():
    pytest.importorskip("transformers")
    benchmarks = str(Path(__file__).resolve().parents[2] / "benchmarks")
    if benchmarks not in sys.path:
        sys.path.insert(0, benchmarks)
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


def _twin(g, u, da):
    """The twin's (out, dg, du) of CPU copies, in the outputs' dtypes."""
    g, u, da = g.cpu(), u.cpu(), da.cpu()
    out, dg, du = torch.empty_like(g), torch.empty_like(g), torch.empty_like(u)
    ref.swiglu_fwd(g, u, out)
    ref.swiglu_bwd(da, g, u, dg, du)
    return out, dg, du


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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_kernels_match_the_twin(shape, dtype):
    g, u, da = _inputs(shape, dtype, seed=sum(shape))
    out = torch.full_like(g, NAN)  # every element must be written
    dg, du = torch.full_like(g, NAN), torch.full_like(u, NAN)
    kernels.swiglu_fwd(g, u, out)
    kernels.swiglu_bwd(da, g, u, dg, du)
    w_out, w_dg, w_du = _twin(g, u, da)
    out, dg, du = out.cpu(), dg.cpu(), du.cpu()
    if dtype != torch.float32:
        for name, a, b in (("out", out, w_out), ("dg", dg, w_dg), ("du", du, w_du)):
            _assert_rounded_match(a, b, f"{name} {shape} {dtype}")
        return
    rel = 2.0**-20
    _assert_float32_within(out, w_out, rel * w_out.double().abs(), f"out {shape}")
    _assert_float32_within(du, w_du, rel * w_du.double().abs(), f"du {shape}")
    g64 = g.cpu().double()
    scale = (da.cpu().double() * u.cpu().double() * torch.sigmoid(g64)).abs()
    _assert_float32_within(dg, w_dg, rel * (1 + g64.abs()) * scale + rel * w_dg.double().abs(), f"dg {shape}")


def test_mixed_input_dtypes():
    """u of another dtype than g (the contract allows it): out and dg in g's dtype, du in u's."""
    g, _, da = _inputs((333, 1029), torch.bfloat16, seed=5)
    u = torch.randn(333, 1029, device=CUDA) * 2
    out, dg, du = torch.empty_like(g), torch.empty_like(g), torch.empty_like(u)
    kernels.swiglu_fwd(g, u, out)
    kernels.swiglu_bwd(da, g, u, dg, du)
    w_out, w_dg, w_du = _twin(g, u, da)
    _assert_rounded_match(out.cpu(), w_out, "out")
    _assert_rounded_match(dg.cpu(), w_dg, "dg")
    _assert_float32_within(du.cpu(), w_du, 2.0**-20 * w_du.double().abs(), "du")


def _count_python_launches(monkeypatch) -> list:
    """The names of the kernels.swiglu_* wrappers called from now on (a replayed call calls none)."""
    calls = []
    for name in ("swiglu_fwd", "swiglu_bwd"):
        original = getattr(kernels, name)

        def counted(*args, _original=original, _name=name):
            calls.append(_name)
            return _original(*args)
        monkeypatch.setattr(kernels, name, counted)
    return calls


def test_the_second_call_replays_the_launch_group(native_extension, monkeypatch):
    """The first call of a shape launches from Python and builds the launch groups; the next
    calls run from them (C++) with their own tensors: the same results as Python launches
    on those tensors, bit for bit."""
    gated_mlp._FWD_GROUPS.clear()
    gated_mlp._BWD_GROUPS.clear()
    calls = _count_python_launches(monkeypatch)
    g, u, da = _inputs((1024, 2816), torch.bfloat16, seed=3)
    first = gated_mlp.swiglu_forward(g, u), *gated_mlp.swiglu_backward(da, g, u)
    assert calls == ["swiglu_fwd", "swiglu_bwd"]
    assert any(gated_mlp._FWD_GROUPS.values()) and any(gated_mlp._BWD_GROUPS.values())
    again = gated_mlp.swiglu_forward(g, u), *gated_mlp.swiglu_backward(da, g, u)
    assert calls == ["swiglu_fwd", "swiglu_bwd"], "the second call took Python"
    for name, a, b in zip(("out", "dg", "du"), again, first):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), name
    # other tensors of the same shape: the group launches on them, not on the first call's
    g2, u2, da2 = _inputs((1024, 2816), torch.bfloat16, seed=4)
    replayed = gated_mlp.swiglu_forward(g2, u2), *gated_mlp.swiglu_backward(da2, g2, u2)
    assert len(calls) == 2
    want = torch.empty_like(g2), torch.empty_like(g2), torch.empty_like(u2)
    kernels.swiglu_fwd(g2, u2, want[0])
    kernels.swiglu_bwd(da2, g2, u2, want[1], want[2])
    for name, a, b in zip(("out", "dg", "du"), replayed, want):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), name


def test_a_misaligned_view_gets_its_own_group(native_extension):
    """Inputs that start 2 bytes into a buffer (not 16-byte aligned): their own recording,
    with the results of a Python launch."""
    gated_mlp._FWD_GROUPS.clear()
    n = 513 * 1031
    g_buf, u_buf = (torch.randn(n + 1, device=CUDA).to(torch.bfloat16) for _ in range(2))
    g, u = g_buf[1:].view(513, 1031), u_buf[1:].view(513, 1031)
    assert g.data_ptr() % 16 != 0
    results = [gated_mlp.swiglu_forward(g, u) for _ in range(2)]  # Python and recording, then the group
    want = torch.empty_like(g)
    kernels.swiglu_fwd(g, u, want)
    for a in results:
        assert torch.equal(a.view(torch.int16), want.view(torch.int16))
    aligned = g.contiguous().clone(), u.contiguous().clone()
    assert aligned[0].data_ptr() % 16 == 0
    for _ in range(2):
        assert torch.equal(gated_mlp.swiglu_forward(*aligned).view(torch.int16), want.view(torch.int16))
    assert sum(1 for v in gated_mlp._FWD_GROUPS.values() if v) == 2


def test_gated_mlp_steady_state_is_its_first_call(native_extension):
    """nn.Linear projections under torch.autocast(bfloat16), inside fp8train.autocast: the
    first call (Python launches) and the next (replayed) give the same output and gradients,
    bit for bit, on the fused path; and within bf16 roundings of float64 (normwise 4 x 2^-8,
    as tests/test_gated_mlp.py on the CPU)."""
    torch.manual_seed(0)
    mlp = gated_mlp.GatedMLP(*(torch.nn.Linear(a, b, bias=False, device=CUDA)
                               for a, b in ((512, 1408), (512, 1408), (1408, 512))))
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
    y64 = torch.nn.functional.silu(x64 @ w[0].t()) * (x64 @ w[1].t()) @ w[2].t()
    y64.backward(dy.double())
    for name, got, want in zip(("y", "dx", "dgate", "dup", "ddown"), runs[0], [y64, x64.grad] + [t.grad for t in w]):
        err = ((got.double() - want).norm() / want.norm()).item()
        assert err < 4 * 2.0**-8, (name, err)


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
