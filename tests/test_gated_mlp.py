"""fp8train.GatedMLP on the CPU (the gated kernels' twins): what convert replaces and what it
leaves, the formula outside fp8train.autocast (a converted HF Llama's logits bit for bit),
the twins' float32 math against float64 with its special values and argument checks, the
fused path inside fp8train.autocast against float64, the formula where the kernels refuse,
activation checkpointing and torch.compile (modules/gated_mlp.py, kernels/gated_reference.py).
The kernels under the Triton interpreter: tests/interpret/test_gated_interpret.py; on the
GPU: tests/gpu/test_gated_mlp_gpu.py."""
import copy
import importlib
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import fp8train
from fp8train import kernels
from fp8train.kernels import gated_reference as ref
from fp8train.modules import gated_mlp
from fp8train.modules.gated_mlp import GatedMLP, gated_mlp_formula
from helpers import assert_bitwise, sqnr_db

EPS32 = 2.0**-24  # the unit roundoff of float32 (half an ulp at 1)
HIGH_PRECISION = dict(filter_fn=lambda *a: False)  # convert keeps every nn.Linear as it is


class LlamaStyleMLP(nn.Module):
    """transformers' LlamaMLP (hidden_act "silu"), as it writes it."""

    def __init__(self, hidden=64, inner=160, bias=False):
        super().__init__()
        self.hidden_size, self.intermediate_size = hidden, inner
        self.gate_proj = nn.Linear(hidden, inner, bias=bias)
        self.up_proj = nn.Linear(hidden, inner, bias=bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return down_proj


class Block(nn.Module):
    """A residual block around an MLP (convert replaces children, never the model itself)."""

    def __init__(self, mlp=None):
        super().__init__()
        self.mlp = mlp if mlp is not None else LlamaStyleMLP()

    def forward(self, x):
        return x + self.mlp(x)


def _quantizer_free(keys):
    return {k for k in keys if "quantizer" not in k}


# --------------------------------------------------------------------------- what convert replaces


def test_convert_replaces_the_llama_form_with_the_same_modules():
    model = Block()
    mlp = model.mlp
    children = {name: getattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn")}
    keys = set(model.state_dict())
    fp8train.convert(model, fp8train.DelayedScaling(), **HIGH_PRECISION)
    assert type(model.mlp) is GatedMLP and model.mlp.name == "mlp"
    for name, child in children.items():
        assert getattr(model.mlp, name) is child, name
    assert set(model.state_dict()) == keys
    assert model.mlp.hidden_size == 64 and model.mlp.intermediate_size == 160
    assert not hasattr(model.mlp, "config")  # carried only when present

    converted = Block()
    weights = [converted.mlp.gate_proj.weight, converted.mlp.up_proj.weight, converted.mlp.down_proj.weight]
    keys = set(converted.state_dict())
    fp8train.convert(converted, fp8train.DelayedScaling())  # the projections become fp8train.Linear first
    assert type(converted.mlp) is GatedMLP
    projections = (converted.mlp.gate_proj, converted.mlp.up_proj, converted.mlp.down_proj)
    assert all(type(p) is fp8train.Linear for p in projections)
    assert all(p.weight is w for p, w in zip(projections, weights))
    assert _quantizer_free(converted.state_dict()) == keys

    kept = Block()
    fp8train.convert(kept, fuse_mlps=False)
    assert type(kept.mlp) is LlamaStyleMLP


def test_convert_is_idempotent_and_keeps_the_training_flag():
    model = Block().eval()
    fp8train.convert(model)
    mlp = model.mlp
    assert not mlp.training
    fp8train.convert(model)
    assert model.mlp is mlp
    assert GatedMLP.from_module(mlp) is None


def test_convert_checks_a_module_built_on_meta():
    with torch.device("meta"):
        model = Block(LlamaStyleMLP(bias=True))
    fp8train.convert(model)
    assert type(model.mlp) is GatedMLP and model.mlp.gate_proj.weight.is_meta


class GeluTanhMLP(LlamaStyleMLP):
    """Gemma's: gelu_pytorch_tanh in place of silu (GeGLU: replaced, activation gelu_tanh)."""

    def __init__(self, hidden=64, inner=160, bias=False):
        super().__init__(hidden, inner, bias)
        self.act_fn = nn.GELU(approximate="tanh")


class GeluErfMLP(LlamaStyleMLP):
    """gelu's erf form: no activation of GatedMLP's."""

    def __init__(self):
        super().__init__()
        self.act_fn = nn.GELU()


class NewGelu(nn.Module):
    """transformers' NewGELUActivation ("gelu_new"): the tanh form in Python ops."""

    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class GeluTanhPythonMLP(LlamaStyleMLP):
    """gelu_new: the same function as F.gelu's tanh form, other bits: not replaced."""

    def __init__(self):
        super().__init__()
        self.act_fn = NewGelu()


class SwappedMLP(LlamaStyleMLP):
    """silu(up) * gate: the same children, another function."""

    def forward(self, x):
        return self.down_proj(self.act_fn(self.up_proj(x)) * self.gate_proj(x))


class SumMLP(LlamaStyleMLP):
    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) + self.up_proj(x))


class ScaledMLP(LlamaStyleMLP):
    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x)) * 2.0


class ActAfterMLP(LlamaStyleMLP):
    """down(silu(gate(x))) * ...: dims that do not chain here (the probe fails to run)."""

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x))) * self.up_proj(x)


class ExtraParamMLP(LlamaStyleMLP):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))


class ExtraBufferMLP(LlamaStyleMLP):
    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.ones(()))


class RenamedMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w3, self.w2 = nn.Linear(64, 160, bias=False), nn.Linear(64, 160, bias=False), nn.Linear(160, 64)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.w2(self.act_fn(self.w1(x)) * self.w3(x))


class FeedForward(LlamaStyleMLP):
    """The right formula and children, but not named like an MLP."""


class ExtraChildMLP(LlamaStyleMLP):
    def __init__(self):
        super().__init__()
        self.dropout = nn.Dropout(0.0)


def _hooked(where):
    mlp = LlamaStyleMLP()
    if where == "forward":
        mlp.register_forward_hook(lambda *a: None)
    elif where == "pre":
        mlp.register_forward_pre_hook(lambda *a: None)
    elif where == "projection":
        mlp.up_proj.register_forward_hook(lambda *a: None)
    else:
        mlp.act_fn.register_forward_hook(lambda *a: None)
    return mlp


LEFT_ALONE = {
    "gelu-erf": GeluErfMLP, "gelu-tanh-python": GeluTanhPythonMLP, "swapped": SwappedMLP, "sum": SumMLP, "scaled": ScaledMLP,
    "act-after-down": ActAfterMLP, "extra-parameter": ExtraParamMLP, "extra-buffer": ExtraBufferMLP,
    "renamed-children": RenamedMLP, "not-named-mlp": FeedForward, "extra-child": ExtraChildMLP,
    "forward-hook": lambda: _hooked("forward"), "pre-hook": lambda: _hooked("pre"),
    "projection-hook": lambda: _hooked("projection"), "act-hook": lambda: _hooked("act"),
}


@pytest.mark.parametrize("make", LEFT_ALONE.values(), ids=LEFT_ALONE.keys())
def test_convert_leaves_other_modules_alone(make):
    model = Block(make())
    before = model.mlp
    fp8train.convert(model, **HIGH_PRECISION)
    assert model.mlp is before
    assert GatedMLP.from_module(before) is None


def test_the_probe_leaves_the_module_as_it_was():
    mlp = ScaledMLP()
    children = dict(mlp.named_children())
    state = {k: v.clone() for k, v in mlp.state_dict().items()}
    assert GatedMLP.from_module(mlp) is None
    assert dict(mlp.named_children()) == children
    for k, v in mlp.state_dict().items():
        assert torch.equal(v, state[k]), k


def test_constructor_takes_the_activation_its_act_fn_computes():
    lin = lambda i, o: nn.Linear(i, o, bias=False)  # noqa: E731
    assert GatedMLP(lin(16, 32), lin(16, 32), lin(32, 16)).activation == "silu"
    assert isinstance(GatedMLP(lin(16, 32), lin(16, 32), lin(32, 16)).act_fn, nn.SiLU)
    geglu = GatedMLP(lin(16, 32), lin(16, 32), lin(32, 16), nn.GELU(approximate="tanh"))
    assert geglu.activation == "gelu_tanh"
    assert GatedMLP(lin(16, 32), lin(16, 32), lin(32, 16), activation="gelu_tanh").act_fn.approximate == "tanh"
    with pytest.raises(ValueError, match="computes gelu_tanh, not activation='silu'"):
        GatedMLP(lin(16, 32), lin(16, 32), lin(32, 16), nn.GELU(approximate="tanh"), activation="silu")
    with pytest.raises(ValueError, match="computes none of"):
        GatedMLP(lin(16, 32), lin(16, 32), lin(32, 16), nn.GELU())  # the erf form
    with pytest.raises(ValueError, match="activation must be one of"):
        GatedMLP(lin(16, 32), lin(16, 32), lin(32, 16), activation="relu")


class UnusedActMLP(LlamaStyleMLP):
    """Computes silu(gate) * up with F.silu, holding an act_fn it does not call."""

    def __init__(self):
        super().__init__()
        self.act_fn = nn.Identity()

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def test_an_act_fn_the_forward_does_not_use_is_left_alone():
    mlp = UnusedActMLP()
    assert GatedMLP.from_module(mlp) is None  # not an error: convert leaves it


def test_constructor_checks():
    lin = lambda i, o: nn.Linear(i, o, bias=False)  # noqa: E731
    with pytest.raises(TypeError, match="up_proj"):
        GatedMLP(lin(16, 32), nn.Conv1d(16, 32, 1), lin(32, 16))
    with pytest.raises(ValueError, match="do not chain"):
        GatedMLP(lin(16, 32), lin(16, 48), lin(32, 16))
    with pytest.raises(ValueError, match="do not chain"):
        GatedMLP(lin(16, 32), lin(16, 32), lin(48, 16))


# transformers' own classes: LlamaMLP and its copies are replaced (with and without biases),
# and Gemma's with its gelu_pytorch_tanh; one with hidden_act "gelu" (the erf form) or "gelu_new"
# (the tanh form in Python ops, other bits than F.gelu's) stays
HF_MLPS = [("llama", "LlamaMLP", {}, "silu"), ("llama", "LlamaMLP", {"mlp_bias": True}, "silu"),
           ("mistral", "MistralMLP", {}, "silu"), ("qwen2", "Qwen2MLP", {}, "silu"), ("qwen3", "Qwen3MLP", {}, "silu"),
           ("gemma", "GemmaMLP", {}, "gelu_tanh"), ("gemma2", "Gemma2MLP", {}, "gelu_tanh"),
           ("llama", "LlamaMLP", {"hidden_act": "gelu"}, None), ("llama", "LlamaMLP", {"hidden_act": "gelu_new"}, None)]


@pytest.mark.parametrize("family, cls, overrides, activation", HF_MLPS,
                         ids=["llama", "llama-bias", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gelu-erf", "gelu-new"])
def test_transformers_mlps_are_replaced_by_their_formula(family, cls, overrides, activation):
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(family, hidden_size=48, intermediate_size=80, num_attention_heads=4,
                                               num_key_value_heads=2, head_dim=12, **overrides)
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    hf = getattr(module, cls)(config)
    mlp = GatedMLP.from_module(hf)
    if activation is None:
        assert mlp is None
        return
    assert mlp.activation == activation and mlp.act_fn is hf.act_fn
    assert mlp.gate_proj is hf.gate_proj and mlp.config is config
    assert (mlp.hidden_size, mlp.intermediate_size) == (48, 80)
    x = torch.randn(2, 7, 48, dtype=torch.bfloat16) * 3
    with torch.no_grad():
        assert torch.equal(mlp(x.float()), hf(x.float()))


def _llama():
    pytest.importorskip("transformers")
    import hf_llama
    return hf_llama


def test_a_converted_llama_computes_what_it_did_outside_autocast():
    """Every decoder layer's MLP replaced (the projections converted first); outside
    fp8train.autocast the logits and the parameters' gradients are the unconverted model's
    bit for bit, in float32 and under torch.autocast(bfloat16)."""
    hf_llama = _llama()
    model = hf_llama.build_llama(hf_llama.SHAPES["tiny"], torch.device("cpu"))
    original = copy.deepcopy(model)
    keys = set(model.state_dict())
    fp8train.convert(model, fp8train.CurrentScaling(), filter_fn=hf_llama.not_lm_head)
    assert [type(layer.mlp) for layer in model.model.layers] == [GatedMLP] * 2
    assert all(type(layer.mlp.down_proj) is fp8train.Linear for layer in model.model.layers)
    assert [layer.mlp.name for layer in model.model.layers] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert _quantizer_free(model.state_dict()) == keys
    assert fp8train.inspect.mlp_paths(model) == {f"model.layers.{i}.mlp": "no eager FP8 call yet" for i in (0, 1)}
    x = torch.randint(0, 256, (2, 33))
    for bf16 in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            got, want = model(input_ids=x, labels=x), original(input_ids=x, labels=x)
        assert torch.equal(got.logits, want.logits), bf16
        got.loss.backward()
        want.loss.backward()
        for (name, a), b in zip(model.named_parameters(), original.parameters()):
            assert torch.equal(a.grad, b.grad), (bf16, name)
        model.zero_grad(set_to_none=True)
        original.zero_grad(set_to_none=True)
    assert set(fp8train.inspect.mlp_paths(model).values()) == {"no eager FP8 call yet"}


@pytest.mark.parametrize("recipe", [pytest.param(fp8train.CurrentScaling(), id="current"),
                                    pytest.param(fp8train.DelayedScaling(), id="delayed")])
def test_a_converted_llama_trains_with_fused_mlps_as_with_hfs(recipe):
    """Inside fp8train.autocast under torch.autocast(bfloat16): both layers' MLPs on the
    kernels' twins, losses within 1e-3 of the model with HF's MLPs at each of 3 AdamW steps
    (HF's bf16 ops round silu(gate) before the product, the kernel once: last-bit
    differences, which an FP8 cast can turn into a flipped byte)."""
    hf_llama = _llama()
    models = []
    for fuse in (True, False):
        model = hf_llama.build_llama(hf_llama.SHAPES["tiny"], torch.device("cpu"))
        fp8train.convert(model, recipe, filter_fn=hf_llama.not_lm_head, fuse_mlps=fuse)
        models.append(model)
    g = torch.Generator().manual_seed(0)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in models]
    for step in range(3):
        x = torch.randint(0, 256, (2, 64), generator=g)
        with torch.autocast("cpu", dtype=torch.bfloat16), fp8train.autocast(recipe=recipe):
            losses = [m(input_ids=x, labels=x).loss for m in models]  # one region: delayed updates roll all alike
        for loss, opt in zip(losses, opts):
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-3, atol=0, msg=f"step {step}")
    assert fp8train.inspect.mlp_paths(models[0]) == {f"model.layers.{i}.mlp": gated_mlp.FUSED for i in range(2)}
    assert fp8train.inspect.mlp_paths(models[1]) == {}


# --------------------------------------------------------------------------- the twins' math


def _reference(g, u, da):
    """silu(g) * u and its gradients by float64 autograd (the exact values, to float64 rounding)."""
    g64, u64 = g.double().requires_grad_(), u.double().requires_grad_()
    a = F.silu(g64) * u64
    a.backward(da.double())
    return a.detach(), g64.grad, u64.grad


def _assert_within(got, want, tol, what):
    """|got - want| <= tol elementwise (finite want); got's non-finite values where want's are."""
    got = got.double()
    assert got.shape == want.shape, what
    assert torch.equal(got.isnan(), want.isnan()), what
    assert torch.equal(got[want.isinf()], want[want.isinf()]), what
    fin = want.isfinite()
    err = (got - want).abs()[fin]
    bound = tol.expand_as(want)[fin]
    assert (err <= bound).all(), f"{what}: worst {(err / bound).max().item():.2f} x the bound"


SHAPES = [pytest.param((3, 5, 7), id="3x5x7"), pytest.param((1, 1), id="1x1"), pytest.param((0, 9), id="0x9"),
          pytest.param((4, 1537), id="4x1537")]


@pytest.mark.parametrize("shape", SHAPES)
def test_twin_math_against_float64(shape):
    """Float32 inputs, so the float64 reference sees the twin's exact inputs. The bounds
    follow the twin's operations (kernels/gated_reference.py), with e = 2^-24 float32's unit
    roundoff: exp(-g) is exp2(g * NEG_LOG2E), whose product (and the float32 constant) errs
    by up to 2e relative, which moves exp2's result by |g| 2e relative (d exp2(t) / exp2(t)
    = ln 2 dt with t = -g log2 e); exp2 itself adds an ulp (2e), and 1 + exp(-g), the
    reciprocal, g * s and the product with u (or da) e each. So silu(g) * u and da * silu(g)
    are within (2 |g| + 6) e relative of the exact values. dg = da u s (1 + g (1 - s))
    cancels near silu's minimum (g = -1.28), so its bound is absolute: the error of
    1 + g (1 - s) is |g| times that of 1 - s (for g < 0, s <= 1/2: within (|g| + 3) e) plus
    its own rounding, so dg is within 8 (1 + |g|)^2 e of |da u s| (seen: up to 3.8)."""
    g = torch.randn(shape) * 5
    u = torch.randn(shape) * 2
    da = torch.randn(shape)
    a, (dg, du) = ref.gated_forward(g, u, "silu"), ref.gated_grads(da, g, u, "silu")
    assert a.dtype == dg.dtype == du.dtype == torch.float32 and a.shape == dg.shape == du.shape == g.shape
    a64, dg64, du64 = _reference(g, u, da)
    g_abs = g.double().abs()
    rel = (2 * g_abs + 6) * EPS32
    _assert_within(a, a64, rel * a64.abs(), "silu(g) * u")
    _assert_within(du, du64, rel * du64.abs(), "du")
    scale = (da.double() * u.double() * torch.sigmoid(g.double())).abs()
    _assert_within(dg, dg64, 8 * (1 + g_abs) ** 2 * EPS32 * scale, "dg")


def test_twin_tails_keep_relative_precision():
    """Large |g|: silu(g) -> g for g -> +inf, and g e^g -> 0 for g -> -inf without flushing
    to zero early (exp(-g) = e^60 is far inside float32's range; silu(-60) ~ -5e-25); the
    relative bounds of test_twin_math_against_float64 hold there too."""
    g = torch.tensor([-87.0, -60.0, -30.0, -12.5, 12.5, 30.0, 60.0, 88.0])
    u = torch.full_like(g, 1.5)
    da = torch.full_like(g, -0.75)
    a64, dg64, du64 = _reference(g, u, da)
    rel = (2 * g.double().abs() + 6) * EPS32
    _assert_within(ref.gated_forward(g, u, "silu"), a64, rel * a64.abs(), "a")
    dg, du = ref.gated_grads(da, g, u, "silu")
    _assert_within(du, du64, rel * du64.abs(), "du")
    scale = (da.double() * u.double() * torch.sigmoid(g.double())).abs()
    _assert_within(dg, dg64, 8 * (1 + g.double().abs()) ** 2 * EPS32 * scale, "dg")
    assert (ref.gated_forward(g, u, "silu")[:4] < 0).all()  # not flushed to -0.0


INF, NAN = math.inf, math.nan
# (g, u, da) -> (a, dg, du), the IEEE values of silu(g) * u = g sigmoid(g) u and its gradients
# dg = da u s (1 + g (1 - s)), du = da g s; s(+inf) = 1, s(-inf) = 0, s(0) = 1/2
SPECIALS = [
    ((INF, 2.0, 1.0), (INF, NAN, INF)),  # +inf * 1 * 2; dg: inf * (1 - 1) = inf * 0
    ((INF, -2.0, 1.0), (-INF, NAN, INF)),
    ((-INF, 2.0, 1.0), (NAN, NAN, NAN)),  # -inf * 0
    ((NAN, 2.0, 1.0), (NAN, NAN, NAN)),
    ((1.0, NAN, 1.0), (NAN, NAN, None)),  # du = da * silu(1), finite: computed below
    ((1.0, 2.0, NAN), (None, NAN, NAN)),
    ((0.0, 3.0, 2.0), (0.0, 3.0, 0.0)),  # dg = da * u * 1/2
    ((-0.0, 3.0, 2.0), (-0.0, 3.0, -0.0)),
    ((0.0, -3.0, 2.0), (-0.0, -3.0, 0.0)),
    ((1.0, INF, 1.0), (INF, INF, None)),
    ((-1.0, INF, 1.0), (-INF, INF, None)),  # silu(-1) < 0; silu'(-1) = s (1 - (1 - s)) = s^2 > 0
    ((2.0, 0.0, INF), (None, NAN, INF)),  # dg = inf * 0
]


@pytest.mark.parametrize("case, want", SPECIALS, ids=[str(c) for c, _ in SPECIALS])
def test_twin_special_values(case, want):
    g, u, da = (torch.tensor([v], dtype=torch.float32) for v in case)
    a = ref.gated_forward(g, u, "silu")
    dg, du = ref.gated_grads(da, g, u, "silu")
    a64, dg64, du64 = _reference(g, u, da)
    for name, got, expected, exact in (("a", a, want[0], a64), ("dg", dg, want[1], dg64), ("du", du, want[2], du64)):
        if expected is None:  # a finite value: within the relative bound of the float64 one
            assert exact.isfinite().all()
            torch.testing.assert_close(got.double(), exact, rtol=8 * EPS32, atol=0, msg=name)
            continue
        value = got.item()
        if math.isnan(expected):
            assert math.isnan(value), (name, value)
        else:
            assert value == expected and math.copysign(1, value) == math.copysign(1, expected), (name, value)


def test_twin_dg_at_minus_one_is_positive_for_positive_u():
    # silu'(-1) = s (1 + (-1)(1 - s)) = s^2 > 0 with s = sigmoid(-1): the sign used in SPECIALS
    s = 1 / (1 + math.exp(1))
    dg = ref.gated_grads(torch.ones(1), torch.tensor([-1.0]), torch.ones(1), "silu")[0].item()
    assert math.isclose(dg, s * s, rel_tol=16 * EPS32)


@pytest.mark.parametrize("shape", SHAPES)
def test_gelu_tanh_twin_against_float64(shape):
    """GeGLU: act(g) = g sigmoid(2 k (g + c g^3)), the tanh form of gelu that F.gelu(approximate=
    "tanh") computes, by float64 autograd. The twin is activation_reference's gelu_tanh, held
    to 1e-5 relative of float64 there (tests/test_activation_kernels.py), times u or da (one
    rounding more): a and du within 1e-5 relative, atol 1e-6 of the largest |u| or |da|
    (outputs near gelu's zero at g = 0); dg = act'(g) da u within 1e-5 relative, atol 1e-5 of
    the largest |da u| (act' crosses zero near g = -0.75)."""
    g, u, da = torch.randn(shape) * 4, torch.randn(shape) * 2, torch.randn(shape)
    a, (dg, du) = ref.gated_forward(g, u, "gelu_tanh"), ref.gated_grads(da, g, u, "gelu_tanh")
    assert a.dtype == dg.dtype == du.dtype == torch.float32 and a.shape == dg.shape == du.shape == g.shape
    g64, u64 = g.double().requires_grad_(), u.double().requires_grad_()
    a64 = F.gelu(g64, approximate="tanh") * u64
    a64.backward(da.double())
    top = lambda t: t.abs().max().item() if t.numel() else 0.0  # noqa: E731
    torch.testing.assert_close(a.double(), a64.detach(), rtol=1e-5, atol=1e-6 * top(u), msg="a")
    torch.testing.assert_close(du.double(), u64.grad, rtol=1e-5, atol=1e-6 * top(da), msg="du")
    torch.testing.assert_close(dg.double(), g64.grad, rtol=1e-5, atol=1e-5 * top(da * u), msg="dg")


# (g) -> (a, dg, du) for u = 2, da = 1: the IEEE values of g sigmoid(z) * u, z = 2 k (g + c g^3),
# and its gradients; sigmoid(+inf) = 1, sigmoid(-inf) = 0; act'(+-inf) = s + g s (1 - s) z' = NaN
GELU_TANH_SPECIALS = [(INF, (INF, NAN, INF)), (-INF, (NAN, NAN, NAN)), (NAN, (NAN, NAN, NAN)),
                      (0.0, (0.0, 1.0, 0.0)), (-0.0, (-0.0, 1.0, -0.0))]


@pytest.mark.parametrize("g_value, want", GELU_TANH_SPECIALS, ids=[str(v) for v, _ in GELU_TANH_SPECIALS])
def test_gelu_tanh_twin_special_values(g_value, want):
    """act'(0) = 1/2, so dg = 1/2 * da * u = 1 at g = +-0; a and du keep g's zero sign."""
    g, u, da = torch.tensor([g_value]), torch.tensor([2.0]), torch.tensor([1.0])
    got = [ref.gated_forward(g, u, "gelu_tanh").item(), *(t.item() for t in ref.gated_grads(da, g, u, "gelu_tanh"))]
    for name, value, expected in zip(("a", "dg", "du"), got, want):
        if math.isnan(expected):
            assert math.isnan(value), (name, value)
        else:
            assert value == expected and math.copysign(1, value) == math.copysign(1, expected), (name, value)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_gelu_tanh_in_place_twins_round_once(dtype):
    """gated_fwd / gated_bwd with act gelu_tanh write the float32 results rounded once to their
    output dtypes, bit for bit."""
    shape = (3, 5, 41)
    g, u, da = ((torch.randn(shape) * s).to(dtype) for s in (4, 2, 1))
    out, dg_out, du_out = (torch.full(shape, NAN, dtype=dtype) for _ in range(3))
    kernels.gated_fwd(g, u, "gelu_tanh", out)
    kernels.gated_bwd(da, g, u, "gelu_tanh", dg_out, du_out)
    assert_bitwise(out, ref.gated_forward(g, u, "gelu_tanh").to(dtype), "out")
    dg, du = ref.gated_grads(da, g, u, "gelu_tanh")
    assert_bitwise(dg_out, dg.to(dtype), "dg_out")
    assert_bitwise(du_out, du.to(dtype), "du_out")


OUT_DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16"),
              pytest.param(torch.float32, id="fp32")]


@pytest.mark.parametrize("dtype", OUT_DTYPES)
@pytest.mark.parametrize("u_dtype", [pytest.param(None, id="u-same"), pytest.param(torch.float32, id="u-fp32")])
def test_in_place_twins_round_once_to_the_output_dtype(dtype, u_dtype):
    """gated_fwd / gated_bwd write the float32 results rounded once (to nearest even) to
    their output dtypes, bit for bit; and those are within half an ulp of the output dtype
    (2^-8 relative in bf16, 2^-11 in fp16: the unit roundoff) plus the float32 bound of the
    exact value."""
    shape = (5, 3, 37)
    g = (torch.randn(shape) * 4).to(dtype)
    u = (torch.randn(shape) * 2).to(u_dtype or dtype)
    da = torch.randn(shape).to(dtype)
    out = torch.full(shape, NAN, dtype=dtype)
    dg_out = torch.full(shape, NAN, dtype=dtype)
    du_out = torch.full(shape, NAN, dtype=u.dtype)
    kernels.gated_fwd(g, u, "silu", out)
    kernels.gated_bwd(da, g, u, "silu", dg_out, du_out)
    assert_bitwise(out, ref.gated_forward(g, u, "silu").to(dtype), "out")
    dg, du = ref.gated_grads(da, g, u, "silu")
    assert_bitwise(dg_out, dg.to(dtype), "dg_out")
    assert_bitwise(du_out, du.to(u.dtype), "du_out")
    a64, _, du64 = _reference(g, u, da)
    half_ulp = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 0.0}
    tiny = 2.0**-25 if dtype == torch.float16 else 0.0  # fp16 subnormals' half ulp (2^-24 / 2)
    rel = (2 * g.double().abs() + 6) * EPS32
    _assert_within(out, a64, (half_ulp[dtype] + rel) * a64.abs() * (1 + rel) + tiny, "out vs float64")
    _assert_within(du_out, du64, (half_ulp[du_out.dtype] + rel) * du64.abs() * (1 + rel) + tiny, "du vs float64")


def test_zero_size_calls_write_nothing_and_pass():
    g = torch.empty(0, 16)
    out = torch.empty(0, 16)
    kernels.gated_fwd(g, g, "silu", out)
    kernels.gated_bwd(g, g, g, "silu", torch.empty(0, 16), torch.empty(0, 16))


# --------------------------------------------------------------------------- argument checks


def _bad_fwd_calls():
    ok = torch.randn(4, 8)
    yield "shape", (ok, torch.randn(4, 9), "silu", torch.empty(4, 8)), "one shape"
    yield "out-shape", (ok, ok, "silu", torch.empty(8, 4)), "one shape"
    yield "out-dtype", (ok, ok, "silu", torch.empty(4, 8, dtype=torch.bfloat16)), "out must have g's dtype"
    yield "non-contiguous", (torch.randn(8, 4).t(), ok, "silu", torch.empty(4, 8)), "contiguous"
    yield "out-non-contiguous", (ok, ok, "silu", torch.empty(8, 4).t()), "contiguous"
    yield "int", (torch.ones(4, 8, dtype=torch.int32), ok, "silu", torch.empty(4, 8, dtype=torch.int32)), "bfloat16"
    yield "float64", (ok.double(), ok, "silu", torch.empty(4, 8, dtype=torch.float64)), "bfloat16"
    yield "not-a-tensor", (ok, 1.0, "silu", torch.empty(4, 8)), "must be a tensor"
    yield "act", (ok, ok, "gelu", torch.empty(4, 8)), r"act must be one of \('silu', 'gelu_tanh'\), got 'gelu'"


def _bad_bwd_calls():
    ok = torch.randn(4, 8)
    out = lambda dtype=torch.float32: torch.empty(4, 8, dtype=dtype)  # noqa: E731
    yield "shape", (torch.randn(4, 9), ok, ok, "silu", out(), out()), "one shape"
    yield "dg-dtype", (ok, ok, ok, "gelu_tanh", out(torch.bfloat16), out()), "dg_out must have g's dtype"
    yield "du-dtype", (ok, ok, ok.bfloat16(), "silu", out(), out()), "du_out must have u's dtype"
    yield "non-contiguous", (torch.randn(8, 4).t(), ok, ok, "silu", out(), out()), "da must be contiguous"
    yield "int", (ok, ok, torch.ones(4, 8, dtype=torch.int64), "silu", out(), out(torch.int64)), "bfloat16"
    yield "act", (ok, ok, ok, None, out(), out()), "act must be one of"


BAD_FWD = list(_bad_fwd_calls())
BAD_BWD = list(_bad_bwd_calls())


@pytest.mark.parametrize("fn", [kernels.gated_fwd, ref.gated_fwd], ids=["kernels", "twin"])
@pytest.mark.parametrize("args, match", [c[1:] for c in BAD_FWD], ids=[c[0] for c in BAD_FWD])
def test_fwd_argument_checks(fn, args, match):
    with pytest.raises(ValueError, match=f"^gated_fwd: .*{match}"):
        fn(*args)


@pytest.mark.parametrize("fn", [kernels.gated_bwd, ref.gated_bwd], ids=["kernels", "twin"])
@pytest.mark.parametrize("args, match", [c[1:] for c in BAD_BWD], ids=[c[0] for c in BAD_BWD])
def test_bwd_argument_checks(fn, args, match):
    with pytest.raises(ValueError, match=f"^gated_bwd: .*{match}"):
        fn(*args)


@pytest.mark.parametrize("fn, args", [(kernels.gated_fwd, (1.0, torch.randn(4, 8), "silu", torch.empty(4, 8))),
                                      (kernels.gated_bwd, (torch.randn(4, 8), [0.0], torch.randn(4, 8), "silu",
                                                           torch.empty(4, 8), torch.empty(4, 8)))],
                         ids=["fwd", "bwd"])
def test_dispatch_names_a_g_that_is_no_tensor(fn, args):
    """The family is chosen by g's device, before the twin's own checks could name it."""
    with pytest.raises(TypeError, match=r"gated family\): expected a tensor .*got (float|list)"):
        fn(*args)


# --------------------------------------------------------------------------- the module inside fp8train.autocast


ACT_MLPS = {"silu": LlamaStyleMLP, "gelu_tanh": GeluTanhMLP}
ACTS = [pytest.param(act, id=act) for act in ACT_MLPS]


def _mlp(hidden=64, inner=160, bias=False, high_precision=True, recipe=None, activation="silu"):
    """A converted Block's GatedMLP (projections kept as nn.Linear where high_precision) with
    weights of unit-scale outputs, and the float64 copy of its projections."""
    block = Block(ACT_MLPS[activation](hidden, inner, bias))
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape) / math.sqrt(p.shape[-1]))
    fp8train.convert(block, recipe, **(HIGH_PRECISION if high_precision else {}))
    assert type(block.mlp) is GatedMLP and block.mlp.activation == activation
    return block.mlp


def _float64_twin(mlp):
    twin = ACT_MLPS[mlp.activation](mlp.gate_proj.in_features, mlp.gate_proj.out_features, mlp.gate_proj.bias is not None)
    with torch.no_grad():
        for name in ("gate_proj", "up_proj", "down_proj"):
            for p, q in zip(getattr(twin, name).parameters(), getattr(mlp, name).parameters()):
                p.copy_(q)
    return twin.double()


def _run(mlp, x, dy, bf16=False, recipe=None, reentrant=None):
    """y, dx and the three weights' gradients of mlp(x) with output gradient dy, inside
    fp8train.autocast (and torch.autocast(bfloat16) where bf16); the backward after the region,
    as models train; under torch.utils.checkpoint unless reentrant is None."""
    x = x.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16), \
            fp8train.autocast(recipe=recipe or fp8train.CurrentScaling()):
        y = mlp(x) if reentrant is None else checkpoint(mlp, x, use_reentrant=reentrant)
    y.backward(dy.to(y.dtype))
    grads = [x.grad] + [getattr(mlp, n).weight.grad for n in ("gate_proj", "up_proj", "down_proj")]
    mlp.zero_grad(set_to_none=True)
    return y.detach(), grads


def _run64(twin, x, dy):
    x = x.detach().double().requires_grad_()
    y = twin(x)
    y.backward(dy.double())
    grads = [x.grad] + [getattr(twin, n).weight.grad for n in ("gate_proj", "up_proj", "down_proj")]
    return y.detach(), grads


GRAD_NAMES = ("dx", "dgate_proj.weight", "dup_proj.weight", "ddown_proj.weight")


@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_fused_path_float32_matches_float64(bias, activation):
    """float32 activations, nn.Linear projections: the fused kernels' twins between float32
    GEMMs. Float32's sums over 64 / 160 terms and the twins' few-ulp results keep every
    output and gradient within 1e-5 relative of float64 (absolute: 1e-5 of the largest
    element, for elements that cancel)."""
    mlp = _mlp(bias=bias, activation=activation)
    twin = _float64_twin(mlp)
    x, dy = torch.randn(3, 17, 64) * 2, torch.randn(3, 17, 64)
    y, grads = _run(mlp, x, dy)
    assert fp8train.inspect.mlp_paths(Block(mlp)) == {"mlp": gated_mlp.FUSED}
    assert y.dtype == torch.float32
    y64, grads64 = _run64(twin, x, dy)
    for name, got, want in zip(("y",) + GRAD_NAMES, [y] + grads, [y64] + grads64):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item(), msg=name)


@pytest.mark.parametrize("activation", ACTS)
def test_fused_path_bf16_matches_float64_to_bf16_roundings(activation):
    """Under torch.autocast(bfloat16) the projections read x and their weights rounded to bf16
    (2^-8 relative each, bf16's unit roundoff) and write bf16, and the kernel rounds
    silu(g) * u once: y and the gradients are a handful of bf16 roundings from float64, whose
    errors add up over the GEMMs' sums like random ones (1.2 to 1.5 x 2^-8 normwise, seen over
    20 seeds): normwise within 4 x 2^-8; elementwise, where the reference is not small (the
    larger half: no cancellation), within 2^-3 (seen: up to 0.06)."""
    mlp = _mlp(hidden=96, inner=224, activation=activation)
    twin = _float64_twin(mlp)
    x, dy = torch.randn(2, 21, 96) * 2, torch.randn(2, 21, 96)
    y, grads = _run(mlp, x, dy, bf16=True)
    assert fp8train.inspect.mlp_paths(Block(mlp)) == {"mlp": gated_mlp.FUSED}
    assert y.dtype == torch.bfloat16 and grads[0].dtype == torch.float32
    y64, grads64 = _run64(twin, x, dy)
    for name, got, want in zip(("y",) + GRAD_NAMES, [y] + grads, [y64] + grads64):
        err = ((got.double() - want).norm() / want.norm()).item()
        assert err < 4 * 2.0**-8, (name, err)
        big = want.abs() >= want.abs().median()
        rel = ((got.double() - want).abs() / want.abs())[big]
        assert rel.max() < 2.0**-3, (name, rel.max().item())


@pytest.mark.parametrize("activation", ACTS)
def test_fused_path_bf16_is_one_rounding_of_the_kernel_inputs(activation):
    """What the fused step itself adds under torch.autocast(bfloat16): the product handed to
    down_proj is gated_fwd of the bf16 g and u (one rounding), not act(g) * u in bf16."""
    mlp = _mlp(activation=activation)
    seen = {}
    mlp.down_proj.register_forward_pre_hook(lambda m, args: seen.__setitem__("a", args[0]))
    x = torch.randn(4, 9, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16), fp8train.autocast(recipe=fp8train.CurrentScaling()):
        mlp(x)
        g, u = mlp.gate_proj(x), mlp.up_proj(x)
    assert g.dtype == torch.bfloat16
    assert_bitwise(seen["a"], ref.gated_forward(g, u, activation).to(torch.bfloat16), "act(g) * u")


@pytest.mark.parametrize("recipe, activation", [
    pytest.param(fp8train.CurrentScaling(), "silu", id="current"),
    pytest.param(fp8train.DelayedScaling(), "silu", id="delayed"),
    pytest.param(fp8train.CurrentScaling(), "gelu_tanh", id="current-gelu_tanh")])
def test_fused_path_with_fp8_projections_trains(recipe, activation):
    """fp8train.Linear projections (the recipes' HYBRID format: e4m3 forward, unit roundoff
    2^-4, about 29 dB per cast; e5m2 gradients, 2^-3, about 23 dB): outputs and gradients
    finite, of their shapes, and above 15 dB SQNR against float64 (seen over 20 seeds: y
    23-25 dB, the gradients 20-22 dB, two or three casts in series; a wrong term or sign in
    a gradient gives 0 dB or less)."""
    mlp = _mlp(high_precision=False, recipe=recipe, activation=activation)
    assert type(mlp.gate_proj) is fp8train.Linear
    twin = _float64_twin(mlp)
    x, dy = torch.randn(2, 16, 64) * 2, torch.randn(2, 16, 64)
    for _ in range(2):  # delayed: calibration, then scales from the history
        y, grads = _run(mlp, x, dy, bf16=True, recipe=recipe)
    assert fp8train.inspect.mlp_paths(Block(mlp)) == {"mlp": gated_mlp.FUSED}
    y64, grads64 = _run64(twin, x, dy)
    for name, got, want in zip(("y",) + GRAD_NAMES, [y] + grads, [y64] + grads64):
        assert got.shape == want.shape and got.isfinite().all(), name
        assert sqnr_db(got, want) > 15, (name, sqnr_db(got, want))


def test_gated_function_takes_non_contiguous_inputs():
    """_GatedFn makes its inputs contiguous: forward and backward are the twins' bits for
    contiguous copies (the twin itself is not layout-blind on the CPU: torch's exp2 takes a
    vectorized path for contiguous runs and a scalar one otherwise, which can differ in the
    last float32 bit)."""
    g = torch.randn(13, 6).t().requires_grad_()
    u = (torch.randn(13, 6) * 2).t().requires_grad_()
    a = gated_mlp._GatedFn.apply(g, u, "silu")
    assert a.is_contiguous() and a.shape == (6, 13)
    g_c, u_c = g.detach().contiguous(), u.detach().contiguous()
    assert_bitwise(a.detach(), ref.gated_forward(g_c, u_c, "silu"), "a")
    da = torch.randn(13, 6).t()
    a.backward(da)
    dg, du = ref.gated_grads(da.contiguous(), g_c, u_c, "silu")
    assert_bitwise(g.grad, dg, "dg")
    assert_bitwise(u.grad, du, "du")
    only_g = gated_mlp._GatedFn.apply(g.detach().requires_grad_(), u.detach(), "silu")
    only_g.sum().backward()  # no gradient asked for u: none computed into it


# --------------------------------------------------------------------------- where the kernels refuse


def test_kernel_refusal_reasons():
    g = torch.randn(3, 8)
    assert gated_mlp._kernel_refusal(g, torch.randn(3, 8)) is None
    assert gated_mlp._kernel_refusal(g.bfloat16(), torch.randn(3, 8).bfloat16()) is None
    why = gated_mlp._kernel_refusal(g.bfloat16(), torch.randn(3, 8))
    assert why.startswith("formula:") and "bfloat16" in why and "float32" in why
    why = gated_mlp._kernel_refusal(g, torch.randn(3, 9))
    assert why.startswith("formula:") and "(3, 9)" in why
    assert gated_mlp._kernel_refusal(g.double(), g.double()) == "formula: a torch.float64 activation"
    assert gated_mlp._kernel_refusal(g.to(torch.int32), g.to(torch.int32)).startswith("formula:")
    sub = torch.nn.Parameter(g)  # a tensor subclass
    assert "subclass" in gated_mlp._kernel_refusal(sub, g)


def test_float64_runs_the_formula_and_says_why():
    """FP8 Linears refuse float64; kept as nn.Linear (float64 weights) the MLP runs the
    formula inside fp8train.autocast, bit for bit, gradients included."""
    fp8_mlp = _mlp(high_precision=False).double()
    with pytest.raises(TypeError, match="float64"), fp8train.autocast(recipe=fp8train.CurrentScaling()):
        fp8_mlp(torch.randn(2, 64, dtype=torch.float64))
    mlp = _mlp().double()
    x, dy = torch.randn(3, 5, 64, dtype=torch.float64), torch.randn(3, 5, 64, dtype=torch.float64)
    y, grads = _run(mlp, x, dy)
    assert fp8train.inspect.mlp_paths(Block(mlp)) == {"mlp": "formula: a torch.float64 activation"}
    x2 = x.clone().requires_grad_()
    want = gated_mlp_formula(x2, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    want.backward(dy)
    assert_bitwise(y, want.detach(), "y")
    want_grads = [x2.grad] + [getattr(mlp, n).weight.grad for n in ("gate_proj", "up_proj", "down_proj")]
    for name, a, b in zip(GRAD_NAMES, grads, want_grads):
        assert_bitwise(a, b, name)


def test_outside_autocast_it_is_the_formula_bit_for_bit():
    mlp = _mlp()
    hf = _float64_twin(mlp).float()
    for bf16 in (False, True):
        x = torch.randn(2, 11, 64)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            assert_bitwise(mlp(x), hf(x), f"bf16={bf16}")
    assert fp8train.inspect.mlp_paths(Block(mlp)) == {"mlp": "no eager FP8 call yet"}


# --------------------------------------------------------------------------- checkpointing and compile


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("high_precision", [True, False], ids=["nn-linear", "fp8-linear"])
def test_checkpointing_gives_the_same_gradients(reentrant, high_precision):
    """The recomputation runs in the backward pass, after fp8train.autocast exited: it runs
    the fused kernel again (the recipe of the forward), so outputs and gradients are those of
    the plain call bit for bit, with nn.Linear and with FP8 (current scaling) projections."""
    mlp = _mlp(high_precision=high_precision, recipe=None if high_precision else fp8train.CurrentScaling())
    x, dy = torch.randn(2, 19, 64), torch.randn(2, 19, 64)
    for bf16 in (False, True):
        y, grads = _run(mlp, x, dy, bf16=bf16)
        y_ckpt, grads_ckpt = _run(mlp, x, dy, bf16=bf16, reentrant=reentrant)
        assert fp8train.inspect.mlp_paths(Block(mlp)) == {"mlp": gated_mlp.FUSED}
        assert_bitwise(y_ckpt, y, f"y bf16={bf16}")
        for name, a, b in zip(GRAD_NAMES, grads_ckpt, grads):
            assert_bitwise(a, b, f"{name} bf16={bf16}")


@pytest.mark.parametrize("activation", ACTS)
def test_compiled_fullgraph_runs_the_float32_formula(fresh_dynamo, activation):
    """Traced inside fp8train.autocast (backend "eager": the traced ops as they are), the
    MLP computes act(g) * u in float32, rounded once to g's dtype: float32 activations give
    the formula's bits, bf16 ones (g, u) its float32 form rounded once; gradients likewise,
    by autograd through those ops. No graph break (fullgraph=True)."""
    mlp = _mlp(activation=activation)
    act = {"silu": F.silu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}[activation]
    compiled = torch.compile(Block(mlp), fullgraph=True, backend="eager")
    recipe = fp8train.CurrentScaling()
    for bf16 in (False, True):
        x = torch.randn(2, 13, 64)
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16), fp8train.autocast(recipe=recipe):
            y = compiled(x1)
            if bf16:
                g, u = mlp.gate_proj(x2), mlp.up_proj(x2)
                assert g.dtype == torch.bfloat16
                want = x2 + mlp.down_proj((act(g.float()) * u.float()).to(torch.bfloat16))
            else:
                want = x2 + mlp.down_proj(act(mlp.gate_proj(x2)) * mlp.up_proj(x2))
        assert_bitwise(y, want, f"y bf16={bf16}")
        dy = torch.randn_like(y)
        y.backward(dy)
        want.backward(dy)
        assert_bitwise(x1.grad, x2.grad, f"dx bf16={bf16}")
    assert fp8train.inspect.mlp_paths(Block(mlp)) == {"mlp": "no eager FP8 call yet"}  # traced calls set none
