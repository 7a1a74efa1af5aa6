"""Stacked siblings (modules/stacked.py): under BlockScaling(stack_siblings=True) a tie's
Linears (q/k/v, gate/up) run as one GEMM each way, the first member's call computing the
others' outputs. Against the same model with stack_siblings=False: the same FP8 bytes, so
losses and weights agree to float32 summation order (one dgrad sums the members' dX inside
the GEMM), with 11 block GEMMs a step where there were 18 (the block's input needs no
gradient: q/k/v run no dgrad). The GPU side (the C++ node, the
Triton casts) is tests/gpu/test_stacked_siblings_gpu.py."""
from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fp8train
from fp8train import gemm
from fp8train.modules import stacked
from fp8train.quantizer import Quantizer
from tests.test_shared_inputs import _cast_ops, _train

STACKED = fp8train.BlockScaling(stack_siblings=True)
APART = fp8train.BlockScaling(stack_siblings=False)


@pytest.fixture(autouse=True)
def eager_stacking(monkeypatch):
    # eager calls stack only with the switch on (modules/stacked.py, EAGER); these tests run the
    # logic eagerly on the CPU, and test_compiled_stacked_siblings the traced calls, which stack anyway
    monkeypatch.setattr(stacked, "EAGER", True)


class Block(nn.Module):
    """An HF-Llama-like block whose sibling widths are multiples of 128 (GQA: k and v narrower
    than q), in float32 with a float32 norm, as tests/test_shared_inputs.py's Block."""

    def __init__(self, d: int = 128, kv: int = 128, f: int = 256, bias: bool = False):
        super().__init__()
        lin = lambda i, o: fp8train.Linear(i, o, bias=bias)  # noqa: E731
        self.q, self.k, self.v, self.o = lin(d, 2 * kv), lin(d, kv), lin(d, kv), lin(2 * kv, d)
        self.gate, self.up, self.down = lin(d, f), lin(d, f), lin(f, d)

    @staticmethod
    def norm(x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    def forward(self, x):
        h = self.norm(x)
        q = self.q(h)
        x = x + self.o(q * torch.sigmoid(self.k(h)).repeat(1, 1, 2) + self.v(h).repeat(1, 1, 2))
        h = self.norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class _Marked(torch.Tensor):
    """A tensor subclass standing in for a weight the stack must not concatenate."""


def _block(seed=0, **kw) -> Block:
    torch.manual_seed(seed)
    return Block(**kw)


def _batches(n=4, d=128):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(2, 40, d, generator=g) for _ in range(n)]


@pytest.fixture
def gemm_calls(monkeypatch) -> list:
    """The block-scaled GEMMs run from now on (gemm.block_scaled_mm calls)."""
    calls = []
    mm = gemm.block_scaled_mm

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return mm(*args, **kwargs)

    monkeypatch.setattr(gemm, "block_scaled_mm", counted)
    return calls


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("autocast_bf16", [False, True], ids=["fp32", "autocast-bf16"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_stacked_training_matches_the_layers_apart(autocast_bf16, bias, gemm_calls):
    """Four SGD steps stacked and apart: the first step ties (no stack yet: 18 GEMMs), each
    later one runs 11 block GEMMs (q/k/v and gate/up one each way) against 18. The losses
    and weights agree to float32 summation order: relative 1e-5 after the four steps in
    float32; under bf16 autocast 2e-3, where a bf16 rounding of a GEMM output (2^-9
    relative) flips with the order and an FP8 rounding after it may flip too (a wrong
    slice, a dropped bias or member gradient is off by order 1)."""
    tol = 2e-3 if autocast_bf16 else 1e-5
    stacked, apart = _block(bias=bias), _block(bias=bias)
    batches = _batches()
    want = _train(apart, APART, batches, autocast_bf16)
    apart_calls = len(gemm_calls)
    got = _train(stacked, STACKED, batches, autocast_bf16)
    assert apart_calls == 4 * 18 and len(gemm_calls) - apart_calls == 18 + 3 * 11
    assert _rel(got, want) < tol, (got, want)
    for (name, p), q in zip(stacked.named_parameters(), apart.parameters()):
        assert _rel(p.detach(), q.detach()) < tol, name


def test_members_are_the_tie_in_call_order_and_take_their_slices():
    model = _block()
    _train(model, STACKED, _batches(2))
    qkv, gate_up = model.q.input_quantizer, model.gate.input_quantizer
    assert qkv.members == [model.q, model.k, model.v] and gate_up.members == [model.gate, model.up]
    assert model.o.input_quantizer.members == () and model.o.input_quantizer.sharing == 1
    assert model.q._stack_workspace.block is not None and model.k._stack_workspace.block is None
    outs = {}
    for name in ("q", "k", "v"):
        getattr(model, name).register_forward_hook(lambda m, args, y, name=name: outs.__setitem__(name, y))
    with fp8train.autocast(recipe=STACKED):
        model(_batches(1)[0])
    # k and v are column slices of q's GEMM output: one storage, q's slice first
    assert outs["q"].untyped_storage().data_ptr() == outs["k"].untyped_storage().data_ptr() \
        == outs["v"].untyped_storage().data_ptr()
    assert outs["k"].stride() == (40 * 512, 512, 1) and outs["k"].shape == (2, 40, 128)
    assert qkv._stack_memo is None and gate_up._stack_memo is None  # every member took its slice


def test_a_member_on_another_input_or_alone_runs_its_own_gemm(gemm_calls):
    """k called on another tensor than q's (or first): no slice to take, its own GEMM, the
    result the unstacked layer's, bit for bit; q's outputs for k and v stay until taken or
    replaced."""
    model = _block()
    _train(model, STACKED, _batches(2))
    twin = copy.deepcopy(model)
    x, other = _batches(2)[1][:, :, :], torch.randn(2, 40, 128)
    with fp8train.autocast(recipe=STACKED):
        model.q(x)
        calls = len(gemm_calls)
        y = model.k(other)
        assert len(gemm_calls) == calls + 1
        assert model.q.input_quantizer._stack_memo is not None  # k's and v's slices of q(x), not taken
        y_alone = model.k(x.clone())  # an equal tensor is not the same input: computed, not taken
    with fp8train.autocast(recipe=APART):
        assert torch.equal(y, twin.k(other))
        assert torch.equal(y_alone, twin.k(x.clone()))


def test_copies_and_pickles_keep_their_own_ties():
    """deepcopy and torch.save / load point the members at the copy's own layers; the copy
    trains as the original does, bit for bit."""
    model = _block()
    _train(model, STACKED, _batches(1))
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    for copy_ in (copy.deepcopy(model), torch.load(buf, weights_only=False)):
        assert copy_.q.input_quantizer.members == [copy_.q, copy_.k, copy_.v]
        assert all(m is not o for m, o in zip(copy_.q.input_quantizer.members, model.q.input_quantizer.members))
        assert torch.equal(_train(copy_, STACKED, _batches(3)[1:]), _train(copy.deepcopy(model), STACKED,
                                                                             _batches(3)[1:]))


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpointed_block_stacks_where_its_forward_did(reentrant):
    """Activation checkpointing: the ties form during the first forward, whose recomputation
    must not stack (it would save other tensors: non-reentrant checkpointing refuses); later
    steps stack in both. The losses and weights are those of the block without checkpointing,
    bit for bit."""
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(nn.Module):
        def __init__(self, block):
            super().__init__()
            self.block = block

        def forward(self, x):
            return checkpoint(self.block, x, use_reentrant=reentrant)

    plain, ckpt = _block(), Checkpointed(_block())
    batches = [b.requires_grad_(reentrant) for b in _batches(3)]  # reentrant: an input that needs grad
    want = _train(plain, STACKED, batches)
    got = _train(ckpt, STACKED, batches)
    assert ckpt.block.q._stacked_last and ckpt.block.gate._stacked_last
    assert torch.equal(got, want), (got, want)
    for (name, p), q in zip(ckpt.block.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), name


def test_eager_calls_stack_only_with_the_switch(monkeypatch, gemm_calls):
    monkeypatch.setattr(stacked, "EAGER", False)
    _train(_block(), STACKED, _batches(2))
    assert len(gemm_calls) == 2 * 18


def test_a_recipe_change_rebuilds_the_ties():
    """Switching recipe gives each layer new quantizers: they leave the old tie (its members
    emptied as its count falls) and tie again on the new recipe's first step."""
    model = _block()
    _train(model, STACKED, _batches(2))
    old = model.q.input_quantizer
    with pytest.warns(UserWarning, match="recipe changed"):
        _train(model, fp8train.CurrentScaling(), _batches(1))
    assert old.sharing == 1 and old.members == ()
    new = model.q.input_quantizer
    assert new is not old and new.members == [model.q, model.k, model.v] and new.sharing == 3


def test_off_narrow_or_mixed_members_run_apart(gemm_calls):
    """stack_siblings=False, widths that are not multiples of 128, and members that differ
    (a weight that is a tensor subclass, one without requires_grad) each run their own
    GEMMs: 18 a step."""
    for model, recipe in ((_block(), APART), (_block(kv=64, f=192), STACKED)):
        _train(model, recipe, _batches(2))
        assert len(gemm_calls) == 2 * 18
        gemm_calls.clear()
    model = _block()
    model.v.weight = nn.Parameter(_Marked(model.v.weight.detach()))  # a tensor subclass (DTensor, Float8Tensor)
    _train(model, STACKED, _batches(2))
    assert len(gemm_calls) == 18 + (6 + 3 + 3 + 3)  # q/k/v apart, without dgrad; gate/up stacked
    gemm_calls.clear()
    model = _block()
    model.k.weight.requires_grad_(False)
    _train(model, STACKED, _batches(2))
    # k has no wgrad: 17 GEMMs on the first step; then q/k/v apart (5), gate/up stacked (3), o, down
    assert len(gemm_calls) == 17 + (5 + 3 + 3 + 3)


def _calls(gm: torch.fx.GraphModule, name: str) -> int:
    """Calls of operators whose name holds `name` in a graph and its subgraphs."""
    return sum(node.op == "call_function" and name in str(node.target)
               for sub in gm.modules() if isinstance(sub, torch.fx.GraphModule) for node in sub.graph.nodes)


def _aot_recording_backend(graphs: list, forwards: list):
    """_recording_backend's Dynamo graphs, and AOTAutograd's partitioned forward graphs."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    def forward(gm, _):
        forwards.append(gm)
        return make_boxed_func(gm)

    aot = aot_autograd(fw_compiler=forward, bw_compiler=lambda gm, _: make_boxed_func(gm),
                       partition_fn=min_cut_rematerialization_partition)

    def backend(gm, example_inputs):
        graphs.append(gm)
        return aot(gm, example_inputs)

    return backend


def test_compiled_stacked_siblings():
    """Compiled (fullgraph) after one eager step: one graph, no recompile, the eager stacked
    model's losses bit for bit, and no output kept past the trace. Per step 4 input and 4
    gradient casts (2 of them the stacked members' gradients, cast as parts), 2 weight casts
    and 2 stacked weight casts against 4 + 7 + 7 apart, and 11 block GEMMs (18). The forward
    graph concatenates the weights twice, inside the stacked casts' CPU bodies (on CUDA a
    Triton launch reads the parts in place): the concatenation that feeds the autograd node
    (for dW's split) is dropped, not computed."""
    batches = _batches(3)
    eager = _block()
    want = _train(eager, STACKED, batches)
    counts = {}
    for recipe in (STACKED, APART):
        model = _block()
        _train(model, recipe, batches[:1])
        graphs, forwards = [], []
        compiled = torch.compile(model, fullgraph=True, backend=_aot_recording_backend(graphs, forwards))
        got = _train(compiled, recipe, batches[1:])
        assert len(graphs) == 1, f"{len(graphs)} graphs: recompiled"
        assert all(q._traced_stack is None and q._traced_memo is None for q in model.modules()
                   if isinstance(q, Quantizer))
        counts[recipe.stack_siblings] = (_cast_ops(graphs[0]), _calls(graphs[0], "weight_tiles_stacked"),
                                         _calls(graphs[0], "block_cast_parts"), _calls(graphs[0], "block_scaled_mm"),
                                         _calls(forwards[0], "aten.cat"))
        if recipe is STACKED:
            assert torch.equal(got, want[1:]), (got, want)
    assert counts == {True: (10, 2, 2, 11, 2), False: (18, 0, 0, 18, 0)}, counts


@pytest.mark.parametrize("power_of_two", [False, True], ids=["scale", "pow2"])
def test_cast_parts_is_the_cast_of_the_concatenation(power_of_two):
    """BlockScalingQuantizer.cast_parts (a stacked tie's output gradients, given apart): the
    bytes, scales, transposed copy and bias sums of cast(torch.cat(parts, -1)), bit for bit;
    3-D parts (batch, tokens, width), the last one's width not a multiple of 128; beyond
    three parts, the concatenation's cast."""
    from fp8train.quantizer_factory import make_quantizer
    from fp8train.recipe import TensorRole
    q = make_quantizer(fp8train.BlockScaling(power_of_two_scales=power_of_two), TensorRole.GRAD_OUTPUT)
    g = torch.Generator().manual_seed(5)
    for widths in ((256, 128, 100), (128, 128, 128, 64)):
        parts = [torch.randn(3, 50, n, generator=g).to(torch.bfloat16) * 10 ** i for i, n in enumerate(widths)]
        got = q.cast_parts(parts, dbias=True)
        want = q.cast(torch.cat(parts, dim=-1).reshape(150, -1), transpose=True, dbias=True)
        assert got.data.shape == (150, sum(widths))
        assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
        assert torch.equal(got.data_t.view(torch.uint8), want.data_t.view(torch.uint8))
        assert torch.equal(got.scale_inv, want.scale_inv) and torch.equal(got.scale_inv_t, want.scale_inv_t)
        assert torch.equal(got.dbias, want.dbias)
        # without the transposed copy (BlockScaling(fp8_wgrad=False)): the 1 x 128 half alone
        one = q.cast_parts(parts, transpose=False, dbias=True)
        assert one.data_t is None and one.scale_inv_t is None
        assert torch.equal(one.data.view(torch.uint8), want.data.view(torch.uint8))
        assert torch.equal(one.scale_inv, want.scale_inv) and torch.equal(one.dbias, want.dbias)
