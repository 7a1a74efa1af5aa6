"""A gated MLP's product cast inside its stacked gate/up node (modules/stacked.py GATED,
linear.gated_stacked_forward): under BlockScaling(stack_siblings=True) the gate/up GEMM's
node casts act(g) * u for the down projection from the GEMM's output in one kernel, and its
backward casts dg | du from the down projection's dX, g and u in one kernel; the product and
the two gradients are never stored. The kernels compute what the unfused path's kernels
store and cast (gated_reference, rounded to the activations' dtype, then the two-way cast),
so on the CPU (the twins) a model trains bit for bit as with GATED off, eagerly (with
stacked.EAGER) and compiled. The GPU side: tests/gpu/test_gated_stacked_gpu.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fp8train
from fp8train import gemm
from fp8train.modules import gated_mlp, stacked
from fp8train.quantizer import Quantizer
from tests.test_shared_inputs import _cast_ops, _train
from tests.test_stacked_siblings import _aot_recording_backend, _calls

STACKED = fp8train.BlockScaling(stack_siblings=True)


@pytest.fixture(autouse=True)
def eager_stacking(monkeypatch):
    monkeypatch.setattr(stacked, "EAGER", True)


class Model(nn.Module):
    """A residual block around a converted Llama MLP: float32 norm, GatedMLP of fp8train.Linears."""

    def __init__(self, d: int = 128, f: int = 256, bias: bool = False, act: str = "silu"):
        super().__init__()
        lin = lambda i, o: fp8train.Linear(i, o, bias=bias)  # noqa: E731
        self.mlp = fp8train.GatedMLP(lin(d, f), lin(d, f), lin(f, d), activation=act)

    def forward(self, x):
        return x + self.mlp(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


def _model(seed=0, **kw) -> Model:
    torch.manual_seed(seed)
    return Model(**kw)


def _batches(n=4, d=128, rows=40):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(2, rows, d, generator=g) for _ in range(n)]


@pytest.fixture
def gated_casts(monkeypatch) -> list:
    """The gated casts run from now on: 2 (g, u) for the product, 3 (dA, g, u) for its gradients."""
    calls = []
    from fp8train import kernels
    for name in ("gated_block_cast", "gated_grad_block_cast"):
        fn = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _fn=fn, _name=name, **k: (calls.append(_name), _fn(*a, **k))[1])
    return calls


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("autocast_bf16", [False, True], ids=["fp32", "autocast-bf16"])
def test_gated_node_trains_as_the_unfused_mlp(autocast_bf16, act, monkeypatch, gated_casts):
    """Four SGD steps, GATED on and off: the same losses and weights, bit for bit, with the
    gated casts once each way a step: the first step too (the node ties gate and up itself
    before it decides)."""
    batches = _batches(rows=37)  # 74 tokens: a tail block of rows
    monkeypatch.setattr(stacked, "GATED", False)
    off = _model(act=act)
    want = _train(off, STACKED, batches, autocast_bf16)
    assert gated_casts == []
    monkeypatch.setattr(stacked, "GATED", True)
    on = _model(act=act)
    got = _train(on, STACKED, batches, autocast_bf16)
    assert torch.equal(got, want), (got, want)
    for (name, p), q in zip(on.named_parameters(), off.parameters()):
        assert torch.equal(p, q), name
    assert gated_casts == ["gated_block_cast", "gated_grad_block_cast"] * 4
    assert on.mlp._path[0] == gated_mlp.GATED_NODE
    assert all(q._offered is None for q in on.modules() if isinstance(q, Quantizer))


def test_gated_node_gemm_count(monkeypatch):
    """The unfused stacked MLP's block GEMMs: gate/up and down forward, down's dgrad and wgrad,
    gate/up's wgrad (the input takes no gradient: no dgrad)."""
    calls = []
    mm = gemm.block_scaled_mm
    monkeypatch.setattr(gemm, "block_scaled_mm", lambda *a, **k: (calls.append(1), mm(*a, **k))[1])
    model, batches = _model(), _batches(2)
    _train(model, STACKED, batches[:1])
    calls.clear()
    _train(model, STACKED, batches[1:])
    assert len(calls) == 5


@pytest.mark.parametrize("what", ["bias", "hook", "plain-down", "gated-off", "eager-off", "apart", "outside"])
def test_the_mlp_runs_unfused_where_the_node_cannot_take_it(what, monkeypatch, gated_casts):
    model = _model(bias=what == "bias")
    recipe = fp8train.BlockScaling(stack_siblings=what != "apart")
    if what == "hook":
        model.mlp.down_proj.register_forward_hook(lambda m, i, o: None)
    if what == "plain-down":
        model.mlp.down_proj = nn.Linear(256, 128, bias=False)
    if what == "gated-off":
        monkeypatch.setattr(stacked, "GATED", False)
    if what == "eager-off":
        monkeypatch.setattr(stacked, "EAGER", False)
    batches = _batches(3)
    if what == "outside":
        for x in batches:
            model(x).pow(2).mean().backward()
    else:
        _train(model, recipe, batches)
    assert gated_casts == []
    assert model.mlp._path[0] != gated_mlp.GATED_NODE


def _compiled_after_one_step(model, batches, autocast_bf16: bool = False):
    """One eager step (it ties the siblings and makes the quantizers), then the rest compiled
    (fullgraph, AOTAutograd recording Dynamo's graphs): (the compiled steps' losses, graphs)."""
    _train(model, STACKED, batches[:1], autocast_bf16)
    graphs, forwards = [], []
    compiled = torch.compile(model, fullgraph=True, backend=_aot_recording_backend(graphs, forwards))
    return _train(compiled, STACKED, batches[1:], autocast_bf16), graphs


def test_compiled_gated_node_is_the_eager_one():
    """Compiled (fullgraph) after one eager step: one graph, the eager GATED model's losses
    bit for bit, the gated cast operator twice a step (forward and backward), no block cast of
    the product or of dg | du, and no offer kept past the trace."""
    batches = _batches(3)
    want = _train(_model(), STACKED, batches)
    model = _model()
    got, graphs = _compiled_after_one_step(model, batches)
    assert len(graphs) == 1, f"{len(graphs)} graphs: recompiled"
    assert torch.equal(got, want[1:]), (got, want)
    assert _calls(graphs[0], "gated_block_cast") == 2
    assert _calls(graphs[0], "block_cast_parts") == 0
    assert all(q._offered is None for q in model.modules() if isinstance(q, Quantizer))


def test_inductor_compiled_gated_node_is_the_eager_one():
    """The same through Inductor (the default backend): the stand-in product is never
    computed, and the losses are the eager ones."""
    batches = _batches(3)
    want = _train(_model(), STACKED, batches)
    model = _model()
    _train(model, STACKED, batches[:1])
    got = _train(torch.compile(model, fullgraph=True), STACKED, batches[1:])
    assert torch.equal(got, want[1:]), (got, want)


class _NormedBlock(nn.Module):
    """A converted Llama layer's shape: fp8train.RMSNorm before stacked q/k (a tie of two) and
    before the gated MLP."""

    def __init__(self, d: int = 128, f: int = 256):
        super().__init__()
        lin = lambda i, o: fp8train.Linear(i, o, bias=False)  # noqa: E731
        self.norm1, self.norm2 = fp8train.RMSNorm(d), fp8train.RMSNorm(d)
        with torch.no_grad():
            self.norm1.weight.uniform_(-2, 2)
            self.norm2.weight.uniform_(-2, 2)
        self.q, self.k, self.o = lin(d, d), lin(d, d), lin(d, d)
        self.mlp = fp8train.GatedMLP(lin(d, f), lin(d, f), lin(f, d))

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.o(self.q(h) * torch.sigmoid(self.k(h)))
        return x + self.mlp(self.norm2(x))


@pytest.mark.parametrize("autocast_bf16", [False, True], ids=["fp32", "autocast-bf16"])
def test_compiled_norms_cast_for_their_stacked_readers(autocast_bf16, monkeypatch):
    """Compiled, each RMSNorm casts its output for the stacked tie reading it (stacked.NORMS),
    from its input and rstd: the same bytes as the tie's own cast of the output, so the losses
    are those of NORMS off, bit for bit; the graph holds the norm's cast twice and casts no
    norm output itself; no offer is left past the trace."""
    monkeypatch.setattr(stacked, "EAGER", False)
    batches = _batches(4)
    runs = {}
    for norms in (False, True):
        monkeypatch.setattr(stacked, "NORMS", norms)
        torch.manual_seed(0)
        model = _NormedBlock()
        runs[norms] = _compiled_after_one_step(model, batches, autocast_bf16)
        graphs = runs[norms][1]
        assert len(graphs) == 1
        assert all(q._offered is None for q in model.modules() if isinstance(q, Quantizer))
    assert torch.equal(runs[True][0], runs[False][0]), runs
    assert _calls(runs[True][1][0], "norm_block_cast") == 2
    assert _calls(runs[False][1][0], "norm_block_cast") == 0
    assert _cast_ops(runs[False][1][0]) - _cast_ops(runs[True][1][0]) == 2


def test_inductor_compiled_norms_and_gated_node_train_as_eager():
    """Through Inductor: the compiled model's losses follow the eager ones (the eager norm is
    fp8train's kernel twin, the compiled one the formula: float32 rounding apart)."""
    batches = _batches(4)
    torch.manual_seed(0)
    eager = _NormedBlock()
    want = _train(eager, STACKED, batches)
    torch.manual_seed(0)
    model = _NormedBlock()
    _train(model, STACKED, batches[:1])
    got = _train(torch.compile(model, fullgraph=True), STACKED, batches[1:])
    assert ((got - want[1:]).abs() / want[1:].abs()).max() < 1e-4, (got, want)
