"""Activation checkpointing (torch.utils.checkpoint, reentrant or not; Hugging Face's
gradient checkpointing) around fp8train layers. The recomputation runs inside the backward
pass, after fp8train.autocast has exited (and on the GPU in the autograd engine's thread): it
must run by the recipe the forward ran by and cast with the same scales, so that training
with checkpointing is bit for bit training without it (the forward's FP8 values are the
recomputation's). Before FP8Module.call_recipe it ran in high precision: non-reentrant
checkpointing refused the saved tensors (their dtypes differ), reentrant checkpointing ran the
backward in high precision without a word. The GPU side (the C++ nodes' saved tensors through
saved-tensor hooks, the memory freed) is tests/gpu/test_activation_checkpointing_gpu.py."""
import copy

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import fp8train
from fp8train import LayerNormLinear, LayerNormMLP, Linear
from helpers import llama_steps_side_by_side

RECIPES = [pytest.param(fp8train.CurrentScaling(), id="current"),
           pytest.param(fp8train.DelayedScaling(), id="delayed"),
           pytest.param(fp8train.BlockScaling(), id="block")]
REENTRANT = [pytest.param(False, id="non-reentrant"), pytest.param(True, id="reentrant")]


def _layers(recipe):
    torch.manual_seed(0)
    layers = [Linear(128, 64, bias=True), LayerNormLinear(128, 64, normalization="RMSNorm"),
              LayerNormMLP(128, 256, activation="swiglu", normalization="RMSNorm")]
    for layer in layers:  # quantizers now, as fp8train.convert(model, recipe) makes them
        for gemm in layer.GEMMS:
            layer.quantizers(recipe, torch.device("cpu"), gemm)
    return layers


def _train_side_by_side(plain, checkpointed, recipe, xs, *, reentrant: bool = False, fp8: bool = True):
    """Three SGD steps of both layers on xs, `checkpointed` under torch.utils.checkpoint; each
    step's forwards in one fp8train.autocast region (or outside one when not fp8: a delayed
    update rolls every live quantizer, so both see the same updates), the backwards after
    the region exits, as models train. Returns each layer's outputs and input gradients."""
    layers = (plain, checkpointed)
    opts = [torch.optim.SGD(layer.parameters(), lr=0.1) for layer in layers]
    out = ([], [])
    for x in xs:
        xs2 = [x.clone().requires_grad_() for _ in layers]
        with fp8train.autocast(enabled=fp8, recipe=recipe):
            ys = [plain(xs2[0]), checkpoint(checkpointed, xs2[1], use_reentrant=reentrant)]
        for y, x2, opt, record in zip(ys, xs2, opts, out):
            (y.float() * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            record += [y.detach(), x2.grad]
    return out


def _xs():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(2, 48, 128, generator=g).to(torch.bfloat16) for _ in range(3)]


def _assert_same(plain, checkpointed, want, got):
    name = type(plain).__name__
    for w, g in zip(want, got):
        assert torch.equal(g, w), name
    for (key, w), g in zip(plain.state_dict().items(), checkpointed.state_dict().values()):
        assert torch.equal(g, w), f"{name}.{key}"  # parameters and scaling state


@pytest.mark.parametrize("reentrant", REENTRANT)
@pytest.mark.parametrize("recipe", RECIPES)
def test_checkpointed_layers_train_bit_for_bit_as_without(recipe, reentrant):
    for plain, checkpointed in zip(_layers(recipe), _layers(recipe)):
        want, got = _train_side_by_side(plain, checkpointed, recipe, _xs(), reentrant=reentrant)
        _assert_same(plain, checkpointed, want, got)


def _count_weight_casts(layer) -> list:
    """Wrap every weight quantizer's cast entry points (Python casts, and the C++ node's
    re-cast plan) with a counter; returns it (one entry per call)."""
    calls = []
    for gemm in layer.GEMMS:
        q = layer._modules[layer._names[gemm][1]]
        for name in ("quantize", "requantize", "cast", "native_recast"):
            def counted(*args, _f=getattr(q, name), _name=name, **kwargs):
                calls.append(_name)
                return _f(*args, **kwargs)
            setattr(q, name, counted)
    return calls


@pytest.mark.parametrize("reentrant", REENTRANT)
@pytest.mark.parametrize("recipe", RECIPES)
def test_the_recomputation_reuses_the_forwards_weight_cast(recipe, reentrant):
    """The weights do not change between a forward and its backward: the recomputation takes
    the forward's FP8 weights as kept (WeightWorkspace.source) instead of casting each weight
    again (host launches and a read of every master weight). A weight written in place in
    between is cast again."""
    for plain, layer in zip(_layers(recipe), _layers(recipe)):
        want, got = _train_side_by_side(plain, layer, recipe, _xs()[:2], reentrant=reentrant)
        _assert_same(plain, layer, want, got)
        calls = _count_weight_casts(layer)
        x = _xs()[2].requires_grad_()
        with fp8train.autocast(recipe=recipe):
            y = checkpoint(layer, x, use_reentrant=reentrant)
        forward_casts = len(calls)
        assert forward_casts == len(layer.GEMMS), calls  # one per weight
        y.float().sum().backward()
        assert len(calls) == forward_casts, calls  # the recomputation cast nothing
        with fp8train.autocast(recipe=recipe):
            y = checkpoint(layer, x, use_reentrant=reentrant)
        with torch.no_grad():
            next(p for p in layer.parameters() if p.dim() == 2).mul_(0.5)  # after the forward, before the backward
        recast_before = len(calls)
        y.float().sum().backward()
        assert len(calls) > recast_before, type(layer).__name__


def test_a_forward_outside_autocast_recomputes_in_high_precision():
    recipe = fp8train.CurrentScaling()
    plain, checkpointed = _layers(recipe)[0], _layers(recipe)[0]
    _train_side_by_side(plain, checkpointed, recipe, _xs()[:1])  # both ran FP8 once
    xs = [x.float() for x in _xs()]  # the torch composition: x in the parameters' dtype
    want, got = _train_side_by_side(plain, checkpointed, recipe, xs, fp8=False)
    _assert_same(plain, checkpointed, want, got)


def test_a_forward_inside_backward_runs_by_the_last_forwards_recipe():
    """The rule itself: outside a backward pass the active recipe (noted), inside one the
    noted recipe whatever is active there."""
    recipe, other = fp8train.CurrentScaling(), fp8train.DelayedScaling()
    layer = _layers(recipe)[0]
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            with fp8train.autocast(recipe=other):
                seen.append(layer.call_recipe())
            return g

    with fp8train.autocast(recipe=recipe):
        assert layer.call_recipe() is recipe
    x = torch.ones(2, requires_grad=True)
    Probe.apply(x).sum().backward()
    assert seen == [recipe]
    assert layer.call_recipe() is None  # outside autocast, outside backward: high precision, noted
    Probe.apply(x).sum().backward()
    assert seen == [recipe, None]


# ---------------------------------------------------------------- a model users bring
transformers = pytest.importorskip("transformers")
import hf_llama  # noqa: E402


def _assert_same_model(model, twin):
    for (name, w), g in zip(model.state_dict().items(), twin.state_dict().values()):
        assert torch.equal(g, w), name


@pytest.mark.parametrize("reentrant", REENTRANT)
@pytest.mark.parametrize("recipe", RECIPES)
def test_hf_llama_with_gradient_checkpointing_trains_as_without(recipe, reentrant):
    model = hf_llama.build_llama(hf_llama.SHAPES["tiny"], torch.device("cpu"))
    fp8train.convert(model, recipe, filter_fn=hf_llama.not_lm_head)
    twin = copy.deepcopy(model)
    hf_llama.checkpointing(twin, reentrant)
    calls = []  # which FP8 recipe each call of one checkpointed Linear ran by
    twin.model.layers[1].self_attn.q_proj.register_forward_hook(lambda m, *_: calls.append(m.call_recipe()))
    want, got = llama_steps_side_by_side((model, twin), recipe, 3, torch.device("cpu"))
    assert calls == [recipe] * 6  # three steps, each a forward and its recomputation, all in FP8
    assert torch.equal(got, want), (got, want)
    _assert_same_model(model, twin)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_compiled_hf_llama_with_gradient_checkpointing_trains_as_without(recipe):
    """Compiled (aot_eager: the traced ops as they are) as one graph each (fullgraph), the
    checkpointed layers' recomputation the backward graph's: the losses and weights are those
    of the same compiled model without checkpointing, bit for bit; BlockScaling stacked, with
    the gated MLP's and the norms' casts in their kernels, in both. Two settings make the
    checkpointed model one graph (docs/user-guide.md): use_cache=False (HF's warning that it
    turns the cache off is a logging call, a graph break), and Dynamo's
    skip_fwd_side_effects_in_bwd_under_checkpoint (HF's attention mutates a context variable
    of the `kernels` package inside the checkpointed forward, which Dynamo refuses to trace
    under a checkpoint otherwise; BF16 alike). Without them the checkpointed layers ran
    eagerly, outside the graph, where BlockScaling's siblings do not stack."""
    model = hf_llama.build_llama(hf_llama.SHAPES["tiny"], torch.device("cpu"))
    fp8train.convert(model, recipe, filter_fn=hf_llama.not_lm_head)
    model.config.use_cache = False
    twin = copy.deepcopy(model)
    hf_llama.checkpointing(twin, False)
    cpu = torch.device("cpu")
    llama_steps_side_by_side((model, twin), recipe, 1, cpu)  # one eager step first (shared input casts tie there)
    compiled = [torch.compile(m, backend="aot_eager", fullgraph=True) for m in (model, twin)]
    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True):  # read while tracing
        want, got = llama_steps_side_by_side(compiled, recipe, 3, cpu)
    assert torch.equal(got, want), (got, want)
    _assert_same_model(model, twin)
