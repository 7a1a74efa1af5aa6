"""fp8train.RMSNorm on the CPU (the norm kernels' twins): what convert replaces and what it
leaves, the formula outside fp8train.autocast, the kernels inside (against float64), and the
cast it makes for sibling Linears (modules/rms_norm.py). The GPU side is
tests/gpu/test_rms_norm_gpu.py."""
import copy

import pytest
import torch
from torch import nn

import fp8train
from fp8train import quantizer as quantizer_module
from fp8train import scaling
from fp8train.modules import rms_norm
from fp8train.modules.rms_norm import RMSNorm, rms_norm_formula

RECIPES = [pytest.param(fp8train.CurrentScaling(), id="current"), pytest.param(fp8train.DelayedScaling(), id="delayed")]


class LlamaStyleRMSNorm(nn.Module):
    """HF's LlamaRMSNorm as transformers writes it."""

    def __init__(self, size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class GemmaStyleRMSNorm(LlamaStyleRMSNorm):
    """Gemma's: y * (1 + weight), computed in float32: another formula."""

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (h * (1.0 + self.weight.float())).type_as(x)


class Block(nn.Module):
    """A norm read by two sibling Linears (gate/up), then a third (down) on their product."""

    def __init__(self, size=64, norm=LlamaStyleRMSNorm):
        super().__init__()
        self.norm = norm(size)
        self.gate, self.up = nn.Linear(size, 2 * size, bias=False), nn.Linear(size, 2 * size, bias=False)
        self.down = nn.Linear(2 * size, size, bias=False)
        with torch.no_grad():
            self.norm.weight.copy_(torch.randn(size) * 0.3 + 1)

    def forward(self, x):
        h = self.norm(x)
        return x + self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))


def test_convert_replaces_the_llama_form_and_keeps_the_parameter():
    torch.manual_seed(0)
    model = Block()
    weight, keys = model.norm.weight, model.state_dict().keys()
    fp8train.convert(model)
    assert type(model.norm) is RMSNorm and model.norm.weight is weight and model.norm.name == "norm"
    assert model.norm.eps == model.norm.variance_epsilon == 1e-6
    assert model.state_dict().keys() - {k for k in model.state_dict() if "quantizer" in k} == keys
    kept = Block()
    fp8train.convert(kept, fuse_norms=False)
    assert type(kept.norm) is LlamaStyleRMSNorm


def test_convert_leaves_other_formulas_and_modules_alone():
    gemma = Block(norm=GemmaStyleRMSNorm)
    fp8train.convert(gemma)
    assert type(gemma.norm) is GemmaStyleRMSNorm  # named like one, computes another function

    class TwoParamsRMSNorm(LlamaStyleRMSNorm):
        def __init__(self, size):
            super().__init__(size)
            self.bias = nn.Parameter(torch.zeros(size))

    class NoEpsRMSNorm(LlamaStyleRMSNorm):
        def __init__(self, size):
            super().__init__(size)
            del self.variance_epsilon

    hooked = LlamaStyleRMSNorm(64)
    hooked.register_forward_hook(lambda *a: None)
    for module in (TwoParamsRMSNorm(64), NoEpsRMSNorm(64), hooked, nn.LayerNorm(64), nn.RMSNorm(64)):
        assert RMSNorm.from_module(module) is None, type(module).__name__


# transformers' own classes (the user guide names Llama, Mistral and Qwen2 as replaced, Gemma as kept)
HF_NORMS = [("llama", "LlamaRMSNorm", True), ("mistral", "MistralRMSNorm", True), ("qwen2", "Qwen2RMSNorm", True),
            ("qwen3", "Qwen3RMSNorm", True), ("gemma", "GemmaRMSNorm", False)]


@pytest.mark.parametrize("family, cls, replaced", HF_NORMS, ids=[n[1] for n in HF_NORMS])
def test_transformers_norms_are_replaced_by_their_formula(family, cls, replaced):
    pytest.importorskip("transformers")
    import importlib
    hf = getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), cls)(48, eps=1e-5)
    with torch.no_grad():
        hf.weight.normal_()
    norm = RMSNorm.from_module(hf)
    if not replaced:
        assert norm is None
        return
    assert norm.weight is hf.weight and norm.eps == 1e-5
    x = torch.randn(2, 7, 48, dtype=torch.bfloat16) * 3
    assert torch.equal(norm(x), hf(x))


def test_convert_checks_a_module_built_on_meta():
    with torch.device("meta"):
        model = Block()
    fp8train.convert(model)
    assert type(model.norm) is RMSNorm and model.norm.weight.is_meta


@pytest.mark.parametrize("x_dtype, w_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                              (torch.bfloat16, torch.float32)], ids=str)
def test_outside_autocast_it_computes_the_replaced_module_bit_for_bit(x_dtype, w_dtype):
    hf = LlamaStyleRMSNorm(96).to(w_dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(96))
    norm = RMSNorm.from_module(copy.deepcopy(hf))
    x = (torch.randn(3, 5, 96) * 4).to(x_dtype).requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    want, got = hf(x), norm(x2)
    assert got.dtype == want.dtype and torch.equal(got, want)
    g = torch.randn_like(want)
    want.backward(g)
    got.backward(g)
    assert torch.equal(x2.grad, x.grad) and torch.equal(norm.weight.grad, hf.weight.grad)


def _reference(x, weight, eps):
    """The norm in float64, with its gradients."""
    x64 = x.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    y = w64 * (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps))
    return x64, w64, y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_inside_autocast_the_kernels_match_float64(dtype):
    """No reader: the norm kernel (its twin here) alone; y, dx, dweight against float64,
    within one rounding of the dtype (y) and 1e-5 relative (float32 gradients)."""
    torch.manual_seed(1)
    norm = RMSNorm(80, eps=1e-5, params_dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(80) * 0.5 + 1)
    x = (torch.randn(4, 7, 80) * 3).to(dtype).requires_grad_()
    with fp8train.autocast(recipe=fp8train.CurrentScaling()):
        y = norm(x)
    assert fp8train.inspect.norm_paths(nn.Sequential(norm))["0"] == rms_norm._NO_READER
    x64, w64, y64 = _reference(x, norm.weight, 1e-5)
    g = torch.randn_like(y64)
    y.backward(g.to(dtype))
    y64.backward(g)
    ulp = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-8}[dtype]
    torch.testing.assert_close(y.double(), y64, rtol=2 * ulp, atol=0)
    grad_tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=grad_tol, atol=grad_tol * x64.grad.abs().max().item())
    torch.testing.assert_close(norm.weight.grad.double(), w64.grad, rtol=grad_tol,
                               atol=grad_tol * w64.grad.abs().max().item())


def _count_casts(monkeypatch) -> list:
    """Every tensor a quantizer casts from now on (by identity: addresses get reused)."""
    calls = []
    original = quantizer_module.Quantizer.cast

    def cast(self, x, *args, **kwargs):
        calls.append(x)
        return original(self, x, *args, **kwargs)
    monkeypatch.setattr(quantizer_module.Quantizer, "cast", cast)
    return calls


def _step(model, x, recipe):
    return _steps([model], x, recipe)[0]


def _steps(models, x, recipe):
    """One step of each model in one FP8 region: one delayed-scaling update for all (it rolls
    every live quantizer)."""
    with torch.autocast("cpu", dtype=torch.bfloat16), fp8train.autocast(recipe=recipe):
        outs = [m(x) for m in models]
    for out in outs:
        out.float().square().mean().backward()
    return [out.detach() for out in outs]


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_norm_casts_for_its_sibling_readers(recipe, monkeypatch):
    """The first FP8 step notes gate/up (tied) as the norm's readers; from the next, under
    delayed scaling the norm kernel casts its output for them and the Linears cast nothing of
    it; under current scaling they cast it once for both, as with HF's norm. Outputs,
    gradients and the readers' scaling state follow a model with HF's norm (float32: the
    twins' sums are torch's, so within 1e-6)."""
    fused = isinstance(recipe, fp8train.DelayedScaling)
    torch.manual_seed(2)
    model = Block()
    twin = copy.deepcopy(model)
    fp8train.convert(model, recipe)
    fp8train.convert(twin, recipe, fuse_norms=False)
    calls = _count_casts(monkeypatch)
    outputs = {}
    for name, m in (("model", model), ("twin", twin)):
        # the output itself, kept alive: a freed one's address is soon another tensor's
        m.norm.register_forward_hook(lambda mod, args, out, name=name: outputs.__setitem__(name, out))
    for i in range(3):  # the first step notes the readers
        calls.clear()
        x = torch.randn(2, 16, 64)
        with torch.autocast("cpu", dtype=torch.bfloat16), fp8train.autocast(recipe=recipe):
            got, want = model(x), twin(x)
        forward_calls = list(calls)
        for out in (got, want):
            out.float().square().mean().backward()
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        for (name, a), b in zip(model.named_parameters(), twin.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7, msg=name)
        model.zero_grad()
        twin.zero_grad()
        # step 0: gate and up each cast the norm's output (they tie on it); then the twin casts it
        # once for both (shared), and the model's norm casts it itself (delayed scaling)
        of = lambda y: sum(1 for c in forward_calls if c is y or c._base is y)  # noqa: E731 (rows: a view of y)
        assert of(outputs["twin"]) == (2 if i == 0 else 1), i
        assert of(outputs["model"]) == (2 if i == 0 else 0 if fused else 1), (i, fp8train.inspect.norm_paths(model))
    assert fp8train.inspect.norm_paths(model)["norm"] == (rms_norm.FUSED if fused else rms_norm._READERS_CAST)
    q = model.gate.input_quantizer
    assert q is model.up.input_quantizer and q.sharing == 2 and model.norm._reader[0] is q
    for a, b in zip(q.state_dict().values(), twin.gate.input_quantizer.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)


def test_a_copy_casts_for_its_own_readers():
    """copy.deepcopy of a model whose norm has readers: the copy's norm casts for the copy's
    tied quantizer, and stepping the copy leaves the original's scaling state alone."""
    torch.manual_seed(4)
    recipe = fp8train.DelayedScaling()
    model = fp8train.convert(Block(), recipe)
    x = torch.randn(2, 16, 64)
    for _ in range(2):
        _step(model, x, recipe)
    twin = copy.deepcopy(model)
    assert twin.norm._reader[0] is twin.gate.input_quantizer is not model.gate.input_quantizer
    before = {k: v.clone() for k, v in model.gate.input_quantizer.state_dict().items()}
    _step(twin, x * 3, recipe)
    assert fp8train.inspect.norm_paths(twin)["norm"] == rms_norm.FUSED
    history = model.gate.input_quantizer.amax_history
    # the original's history only rolled (the update on entering the region), nothing recorded
    assert torch.equal(history[1:], before["amax_history"][:-1]) and history[0].item() == scaling.UNRECORDED


def test_a_recipe_change_finds_the_readers_again():
    torch.manual_seed(3)
    model = fp8train.convert(Block())
    x = torch.randn(2, 16, 64)
    for recipe in (fp8train.CurrentScaling(), fp8train.CurrentScaling(), fp8train.DelayedScaling()):
        with pytest.warns(UserWarning) if recipe == fp8train.DelayedScaling() else _nothing():
            _step(model, x, recipe)
    assert fp8train.inspect.norm_paths(model)["norm"].startswith("kernel: its readers' quantizer")
    _step(model, x, fp8train.DelayedScaling())
    assert fp8train.inspect.norm_paths(model)["norm"] == rms_norm.FUSED
    assert model.norm._reader[0] is model.gate.input_quantizer


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_a_mixed_dtype_call_runs_the_formula_and_says_why():
    norm = RMSNorm(32)  # float32 weight
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    with fp8train.autocast(recipe=fp8train.CurrentScaling()):
        y = norm(x)
    assert y.dtype == torch.float32 and torch.equal(y, rms_norm_formula(x, norm.weight, norm.eps))
    assert "bfloat16 input with a torch.float32 weight" in norm._path[0]


def test_constructor_checks():
    for bad in (0, -3, 2.0, True):
        with pytest.raises(ValueError, match="hidden_size"):
            RMSNorm(bad)
    for bad in (-1e-6, float("nan"), "1e-6"):
        with pytest.raises(ValueError, match="eps"):
            RMSNorm(8, eps=bad)
