"""Shared inputs (issue 24 item 4): sibling Linears that read the same tensor (attention's
q/k/v, an MLP's gate/up) tie their input quantizers on their first FP8 call, and the tensor is
cast once per step (Quantizer.cast_shared). Trained side by side with the detection off, the
losses, gradients and state are bit for bit the same. The GPU side (the C++ node taking the
group's one cast) is tests/gpu/test_shared_inputs_gpu.py."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fp8train
from fp8train.block_quantizer import BlockScalingQuantizer
from fp8train.modules import base
from fp8train.quantizer import CurrentScalingQuantizer, DelayedScalingQuantizer, Quantizer, update_delayed_scales
from fp8train.roles import TensorRole


@pytest.fixture(autouse=True)
def sharing_on(monkeypatch):
    # on by default; set here so that these tests hold whatever the default
    monkeypatch.setattr(base, "SHARE_INPUT_CASTS", True)


RECIPES = [pytest.param(fp8train.DelayedScaling(), id="delayed"), pytest.param(fp8train.CurrentScaling(), id="current"),
           pytest.param(fp8train.BlockScaling(), id="block")]
GROUPS = [["q", "k", "v"], ["gate", "up"]]


class Block(nn.Module):
    """An HF-Llama-like block: RMSNorm in float32 (as HF computes it), q/k/v on its output,
    o, another norm, gate/up on its output, down."""

    def __init__(self, d: int = 32, f: int = 64, dtype=torch.float32):
        super().__init__()
        lin = lambda i, o: fp8train.Linear(i, o, bias=False, params_dtype=dtype)  # noqa: E731
        self.q, self.k, self.v, self.o = lin(d, d), lin(d, d), lin(d, d), lin(d, d)
        self.gate, self.up, self.down = lin(d, f), lin(d, f), lin(f, d)

    @staticmethod
    def norm(x):  # computed in float32, returned in x's dtype: float32 under torch.autocast, as HF's RMSNorm
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

    def forward(self, x):  # (B, T, d)
        h = self.norm(x)
        x = x + self.o(self.q(h) * torch.sigmoid(self.k(h)) + self.v(h))
        h = self.norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


@pytest.fixture
def no_sharing(monkeypatch):
    monkeypatch.setattr(base, "SHARE_INPUT_CASTS", False)


def _block(dtype=torch.float32, seed=0) -> Block:
    torch.manual_seed(seed)
    return Block(dtype=dtype)


def _batches(n=4, dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(2, 24, 32, generator=g).to(dtype) for _ in range(n)]


def _train(model, recipe, batches, autocast_bf16: bool = False):
    """Loss per step (SGD without state, so a loaded model continues like the original; also
    tests/test_stacked_siblings.py's)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast_bf16), fp8train.autocast(recipe=recipe):
            loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return torch.stack(losses)


def _state(model: nn.Module) -> dict:
    """A snapshot: every later autocast entry rolls every live delayed history, any model's."""
    return copy.deepcopy(model.state_dict())


def _assert_same_state(sa: dict, sb: dict):
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


def count_input_casts(monkeypatch) -> list:
    """The INPUT quantizers' Quantizer.cast calls from now on, one entry (the quantizer) each
    (also tests/gpu/test_shared_inputs_gpu.py's)."""
    calls = []

    def counting(cast):
        def counted(self, x, **kw):
            if self.role is TensorRole.INPUT:
                calls.append(self)
            return cast(self, x, **kw)
        return counted

    for cls in (Quantizer, BlockScalingQuantizer):  # the block quantizer's cast is its own
        monkeypatch.setattr(cls, "cast", counting(cls.cast))
    return calls


# ------------------------------------------------------------------------------ ties

@pytest.mark.parametrize("recipe", RECIPES)
def test_siblings_tie_and_others_do_not(recipe):
    model = _block()
    _train(model, recipe, _batches(1), autocast_bf16=False)
    assert fp8train.inspect.shared_input_casts(model) == GROUPS
    assert model.q.input_quantizer is model.k.input_quantizer is model.v.input_quantizer
    assert model.o.input_quantizer is not model.q.input_quantizer
    assert model.q.input_quantizer.sharing == 3 and model.gate.input_quantizer.sharing == 2
    assert model.o.input_quantizer.sharing == 1
    paths = fp8train.inspect.execution_paths(model)
    assert paths["q"] == paths["k"] and "Python node" in paths["q"]  # CPU: no C++ node anyway


def test_quantizers_made_by_convert_tie_on_the_first_forward():
    """convert(model, recipe) makes the quantizers without an input; the first forward ties."""
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    fp8train.convert(model, fp8train.DelayedScaling())
    assert model[0].input_quantizer is not None
    with fp8train.autocast(recipe=fp8train.DelayedScaling()):
        x = torch.randn(4, 32)
        model[0](x), model[1](x)
    assert fp8train.inspect.shared_input_casts(model) == [["0", "1"]]


def test_auto_precision_measurements_do_not_split_siblings(tmp_path, monkeypatch):
    """A missing table entry is measured with twin layers between the siblings' first calls."""
    from fp8train import precision
    from tests.helpers import own_precision_table

    def measure(make_twin, shape, dtype, device, recipe):
        with fp8train.autocast(recipe=dataclasses.replace(recipe, auto_precision=False)):
            make_twin()(torch.randn(shape, dtype=dtype))  # what the timing does: twin calls
        return 1.0, 2.0  # FP8 faster

    monkeypatch.setattr(precision, "measure", measure)
    layers = nn.ModuleList(fp8train.Linear(32, n) for n in (32, 16, 16))  # q, and GQA's narrower k, v
    x = torch.randn(4, 32)
    with own_precision_table(torch.device("cpu"), tmp_path / "table.json"), \
            fp8train.autocast(recipe=fp8train.DelayedScaling(auto_precision=True)):
        for layer in layers:
            layer(x)  # q and k measure their shapes first
    assert fp8train.inspect.shared_input_casts(layers) == [["0", "1", "2"]]


def _three_calls(between=None, recipes=(fp8train.DelayedScaling(),) * 3, xs=None, one_region=True):
    # one_region: the three calls in one outermost autocast region (one step), each under its
    # recipe in a nested region; else each call in a region of its own (three steps)
    layers = [fp8train.Linear(32, 32) for _ in range(3)]
    x = torch.randn(4, 32)
    with fp8train.autocast(recipe=recipes[0], enabled=one_region):
        for i, layer in enumerate(layers):
            if between is not None and i:
                between(x)
            with fp8train.autocast(recipe=recipes[i]):
                layer(x if xs is None else xs[i])
    return fp8train.inspect.shared_input_casts(nn.ModuleList(layers))


def test_non_siblings_do_not_tie():
    assert _three_calls() == [["0", "1", "2"]]
    assert _three_calls(xs=[torch.randn(4, 32) for _ in range(3)]) == []                      # different inputs
    assert _three_calls(between=lambda x: x.mul_(1.0)) == []                                # modified in place
    assert _three_calls(recipes=(fp8train.DelayedScaling(), fp8train.DelayedScaling(margin=1),
                                 fp8train.CurrentScaling())) == []                           # different recipes
    assert _three_calls(one_region=False) == []  # one tensor fed to layers in separate steps (two models in turn)


def test_switched_off(no_sharing):
    model = _block()
    _train(model, fp8train.DelayedScaling(), _batches(1), autocast_bf16=False)
    assert fp8train.inspect.shared_input_casts(model) == []


# -------------------------------------------------------------------- training, bitwise

@pytest.mark.parametrize("dtype, autocast_bf16", [(torch.float32, True), (torch.bfloat16, False)],
                         ids=["fp32-under-autocast-bf16", "bf16"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_training_is_bitwise_that_of_untied_layers(recipe, dtype, autocast_bf16, monkeypatch):
    tied, untied = _block(dtype), _block(dtype)
    batches = _batches(4, dtype)
    calls = count_input_casts(monkeypatch)
    want = None
    with monkeypatch.context() as m:
        m.setattr(base, "SHARE_INPUT_CASTS", False)
        want = _train(untied, recipe, batches, autocast_bf16)
    want_state = _state(untied)
    assert len(calls) == 7 * 4 and fp8train.inspect.shared_input_casts(untied) == []
    calls.clear()
    got = _train(tied, recipe, batches, autocast_bf16)
    assert fp8train.inspect.shared_input_casts(tied) == GROUPS
    # the first step casts before each tie forms (q, k; gate, up): 6 casts; then one per group: 4
    assert len(calls) == 6 + 4 * 3, len(calls)
    assert torch.equal(got, want), (got, want)
    _assert_same_state(_state(tied), want_state)


# ---------------------------------------------------------------------------- the memo

@pytest.mark.parametrize("kind", ["delayed", "current"])
def test_memo_serves_the_siblings_and_nothing_stale(kind, monkeypatch):
    q = (DelayedScalingQuantizer(TensorRole.INPUT, torch.float8_e4m3fn, 4) if kind == "delayed" else
         CurrentScalingQuantizer(TensorRole.INPUT, torch.float8_e4m3fn))
    q.sharing = 3
    calls = count_input_casts(monkeypatch)
    x = torch.randn(2, 24, 32)
    first = q.cast_shared(x)
    assert first.data.shape == (48, 32) and first.data_t is None
    assert q.cast_shared(x) is first and q.cast_shared(x) is first and len(calls) == 1  # the three siblings
    q.cast_shared(x)
    assert len(calls) == 2  # dropped after the last sibling: a fourth call casts
    x.mul_(2.0)
    assert q.cast_shared(x) is not first and len(calls) == 3  # modified in place
    t = q.cast_shared(x, transpose=True)
    assert t.data_t is not None and len(calls) == 4  # a memo without the transposed copy cannot serve
    assert q.cast_shared(x) is t and len(calls) == 4  # one with it serves a call without
    q.cast_shared(x.clone())
    assert len(calls) == 5  # another tensor
    if kind == "delayed":
        q.cast_shared(x)
        update_delayed_scales()  # a new step: the scale may change without x changing
        q.cast_shared(x)
        assert len(calls) == 7
    assert q.__getstate__()["_memo"] is None  # copies and pickles keep no cast


# ------------------------------------------------------------------------- checkpoints

@pytest.mark.parametrize("recipe", RECIPES)
def test_checkpoint_round_trip_of_a_tied_model(recipe):
    model = _block()
    batches = _batches(4)
    _train(model, recipe, batches[:2], autocast_bf16=False)
    state = copy.deepcopy(model.state_dict())
    assert "q.input_quantizer.fp8_max" in state and "k.input_quantizer.fp8_max" in state  # the tie saved per layer
    want = _train(model, recipe, batches[2:], autocast_bf16=False)
    want_state = _state(model)
    resumed = _block(seed=5)
    resumed.load_state_dict(state)  # quantizers made per layer (untied), tied again on the first call
    got = _train(resumed, recipe, batches[2:], autocast_bf16=False)
    assert fp8train.inspect.shared_input_casts(resumed) == GROUPS
    assert torch.equal(got, want), (got, want)
    _assert_same_state(_state(resumed), want_state)


@pytest.mark.parametrize("recipe", RECIPES)
def test_tied_state_dict_saves_through_safetensors(recipe, tmp_path):
    """safetensors (what HF save_pretrained writes) refuses one storage under several names:
    a tie's later names hold copies, its first name the buffers themselves (a load in place,
    as torch.distributed.checkpoint's, writes through to every sibling)."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    model = _block()
    batches = _batches(4)
    _train(model, recipe, batches[:2], autocast_bf16=False)
    state = model.state_dict()
    q = model.q.input_quantizer
    assert q is model.k.input_quantizer
    for name, buf in q.named_buffers():
        if name in q._non_persistent_buffers_set:
            continue
        first, later = state[f"q.input_quantizer.{name}"], state[f"v.input_quantizer.{name}"]
        assert first.data_ptr() == buf.data_ptr(), name
        assert later.data_ptr() != buf.data_ptr() and torch.equal(later, buf), name
    assert model.state_dict().keys() == state.keys()  # a second call marks its own state_dict
    assert model.state_dict()["v.input_quantizer.fp8_max"].data_ptr() != q.fp8_max.data_ptr()
    path = tmp_path / "block.safetensors"
    safetensors_torch.save_file(state, path)
    want = _train(model, recipe, batches[2:], autocast_bf16=False)
    want_state = _state(model)
    resumed = _block(seed=5)
    resumed.load_state_dict(safetensors_torch.load_file(path))
    got = _train(resumed, recipe, batches[2:], autocast_bf16=False)
    assert torch.equal(got, want), (got, want)
    _assert_same_state(_state(resumed), want_state)


@pytest.mark.parametrize("recipe", RECIPES)
def test_untied_checkpoint_loads_into_a_tied_model(recipe, monkeypatch):
    untied = _block()
    batches = _batches(4)
    with monkeypatch.context() as m:
        m.setattr(base, "SHARE_INPUT_CASTS", False)
        _train(untied, recipe, batches[:2], autocast_bf16=False)
        state = copy.deepcopy(untied.state_dict())
        want = _train(untied, recipe, batches[2:], autocast_bf16=False)
        want_state = _state(untied)
    tied = _block(seed=5)
    _train(tied, recipe, batches[:1], autocast_bf16=False)
    tied.load_state_dict(state)
    assert fp8train.inspect.shared_input_casts(tied) == GROUPS  # the ties stay
    got = _train(tied, recipe, batches[2:], autocast_bf16=False)
    assert torch.equal(got, want), (got, want)
    _assert_same_state(_state(tied), want_state)


# --------------------------------------------------------------------------- compile

_CAST_OPS = ("fp8train.cast_kernels", "fp8train.block_cast", "fp8train.block_cast_parts")


def _cast_ops(gm: torch.fx.GraphModule) -> int:
    """Calls of the cast operators in a graph as Dynamo traced it (before AOTAutograd's CSE,
    which merges identical pure casts on the CPU, where Inductor runs their torch-op bodies,
    but not the Triton kernels a GPU graph launches)."""
    return sum(node.op == "call_function" and str(node.target).split(".default")[0] in _CAST_OPS
               for sub in gm.modules() if isinstance(sub, torch.fx.GraphModule)  # autograd.Functions' bodies too
               for node in sub.graph.nodes)


def _recording_backend(graphs: list):
    from functorch.compile import min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    aot = aot_autograd(fw_compiler=lambda gm, _: gm, bw_compiler=lambda gm, _: gm,
                       partition_fn=min_cut_rematerialization_partition)

    def backend(gm, example_inputs):
        graphs.append(gm)
        return aot(gm, example_inputs)

    return backend


class Siblings(nn.Module):
    """Three Linears on one input (attention's q, k, v)."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (fp8train.Linear(32, 32, bias=False) for _ in range(3))

    def forward(self, x):
        return self.q(x) * self.k(x) + self.v(x)


def _compiled_casts(model, recipe, batches) -> int:
    """Trains `model` on the batches, the first eagerly (the quantizers, the ties) and the rest
    compiled (fullgraph), checks the losses against an eager twin's, and returns the number of
    cast operator calls in the compiled graph."""
    eager = copy.deepcopy(model)
    want = _train(eager, recipe, batches, autocast_bf16=False)
    _train(model, recipe, batches[:1], autocast_bf16=False)
    graphs = []
    compiled = torch.compile(model, fullgraph=True, backend=_recording_backend(graphs))
    got = _train(compiled, recipe, batches[1:], autocast_bf16=False)
    assert torch.equal(got, want[1:]), (got, want)
    assert len(graphs) == 1, f"{len(graphs)} graphs: recompiled"
    assert all(q._traced_memo is None for q in model.modules() if isinstance(q, Quantizer))
    return _cast_ops(graphs[0])


@pytest.mark.parametrize("recipe", RECIPES)
def test_compiled_siblings_cast_their_input_once(recipe):
    """Three tied siblings compiled: one cast op for x (Quantizer._traced_cast_shared), one per
    weight and one per gradient (the backward bodies), no graph break, no recompile, the memo
    empty after the step, bit for bit the eager losses."""
    assert _compiled_casts(Siblings(), recipe, _batches(3)) == 1 + 3 + 3


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_compiled_block_casts_against_untied(recipe, monkeypatch):
    """The HF-like block compiled, tied and untied: 7 weight casts, 7 gradient casts, and 4
    input casts tied (q/k/v, o, gate/up, down) against 7 untied."""
    counts = {}
    for share in (True, False):
        monkeypatch.setattr(base, "SHARE_INPUT_CASTS", share)
        counts[share] = _compiled_casts(_block(), recipe, _batches(2))
    assert counts == {True: 7 + 7 + 4, False: 7 + 7 + 7}, counts
