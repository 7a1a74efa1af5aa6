"""Activation checkpointing on the GPU (the CPU side, the recipe a recomputation runs by, is
tests/test_activation_checkpointing.py).

* The C++ nodes (fp8train::LinearBackward, LayerNormMLPBackward, HighBackward) keep their
  activations as autograd's SavedVariables: saved-tensor hooks see them, so checkpointing frees
  them until its recomputation (before, the FP8 transposed copies stayed alive through a
  checkpointed region).
* A converted HF Llama with HF's gradient checkpointing trains bit for bit as without it, on
  the C++ node (the recomputation runs in the autograd engine's device thread), and holds no
  more memory between forward and backward than the BF16 model with checkpointing.
"""
import copy

import pytest
import torch

import fp8train
from tests.helpers import llama_steps_side_by_side

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("native_extension")]
CUDA = torch.device("cuda")
RECIPES = [pytest.param(fp8train.CurrentScaling(), id="current"),
           pytest.param(fp8train.DelayedScaling(), id="delayed"),
           pytest.param(fp8train.BlockScaling(), id="block")]


def _packed_by_node(layer, x, recipe, node: str, steps: int = 3):
    """`steps` fwd+bwd of layer (the node takes over once the Python path prepared its
    launches); the last under saved-tensor hooks that record what they pack. Returns the
    packed tensors and the input's gradient of the last step."""
    packed = []

    def pack(t):
        packed.append(t)
        return t

    for step in range(steps):
        xi = x.clone().requires_grad_()
        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        if step == steps - 1:
            hooks.__enter__()
        try:
            with fp8train.autocast(recipe=recipe):
                y = layer(xi)
        finally:
            if step == steps - 1:
                hooks.__exit__(None, None, None)
        y.float().square().sum().backward()
    assert y.grad_fn.name() == node, y.grad_fn.name()
    return packed, xi.grad


@pytest.mark.parametrize("recipe", RECIPES)
def test_linear_node_saves_its_fp8_input_through_saved_tensor_hooks(recipe):
    torch.manual_seed(0)
    layer = fp8train.Linear(256, 384, params_dtype=torch.bfloat16, device=CUDA)
    x = torch.randn(3, 100, 256, device=CUDA, dtype=torch.bfloat16)
    packed, _ = _packed_by_node(layer, x, recipe, "fp8train::LinearBackward")
    fp8 = [t for t in packed if t.dtype == torch.float8_e4m3fn]
    assert len(fp8) == 1 and fp8[0].shape[0] == 256, [(t.dtype, tuple(t.shape)) for t in packed]  # X^T (K, Mp)
    assert len(packed) == 2  # and its scales


def test_layernorm_mlp_node_saves_its_activations_through_saved_tensor_hooks():
    torch.manual_seed(0)
    layer = fp8train.LayerNormMLP(256, 512, activation="gelu_tanh", params_dtype=torch.bfloat16, device=CUDA)
    x = torch.randn(300, 256, device=CUDA, dtype=torch.bfloat16)
    packed, _ = _packed_by_node(layer, x, fp8train.DelayedScaling(), "fp8train::LayerNormMLPBackward")
    shapes = {(t.dtype, tuple(t.shape)) for t in packed}
    assert (torch.bfloat16, (300, 512)) in shapes, shapes  # fc1's output
    assert sum(t.dtype == torch.float8_e4m3fn for t in packed) == 2, shapes  # x^T and a^T
    assert len(packed) >= 8, shapes  # with x, the norm's weight, bias, statistics and scales


def test_high_node_saves_its_activations_through_saved_tensor_hooks():
    torch.manual_seed(0)
    layer = fp8train.LayerNormMLP(72, 200, activation="gelu_tanh", params_dtype=torch.bfloat16, device=CUDA)
    x = torch.randn(300, 72, device=CUDA, dtype=torch.bfloat16)
    with pytest.warns(UserWarning, match="multiples of 16"):  # dims FP8 cannot take: the high-precision node
        packed, _ = _packed_by_node(layer, x, fp8train.CurrentScaling(), "fp8train::HighBackward", steps=1)
    shapes = {(t.dtype, tuple(t.shape)) for t in packed}
    assert (torch.bfloat16, (300, 200)) in shapes, shapes  # fc1's output
    assert len(packed) >= 9, shapes


# ---------------------------------------------------------------- a model users bring
pytest.importorskip("transformers")
import hf_llama  # noqa: E402


def _held_between_forward_and_backward(model, recipe, steps, shape) -> int:
    """Bytes a forward leaves allocated for its backward, measured after torch.autocast exits
    (its cache of cast weights goes then), at the last of `steps` steps."""
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    for _ in range(steps):
        x = torch.randint(0, 256, shape, generator=g).to(CUDA)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16), fp8train.autocast(recipe=recipe):
            loss = model(input_ids=x, labels=x, use_cache=False).loss
        held = torch.cuda.memory_allocated() - before
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return held


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_hf_llama_with_gradient_checkpointing_trains_as_without(recipe, reentrant):
    model = hf_llama.build_llama(hf_llama.SHAPES["tiny"], CUDA)
    fp8train.convert(model, recipe, filter_fn=hf_llama.not_lm_head)
    twin = copy.deepcopy(model)
    hf_llama.checkpointing(twin, reentrant)
    assert twin.is_gradient_checkpointing and not model.is_gradient_checkpointing
    want, got = llama_steps_side_by_side((model, twin), recipe, 4, CUDA)
    assert torch.equal(got, want), (got, want)
    for (name, w), g in zip(model.state_dict().items(), twin.state_dict().values()):
        assert torch.equal(g, w), name
    paths = fp8train.inspect.execution_paths(twin)
    assert set(paths.values()) == {"C++ node"}, paths


@pytest.mark.parametrize("recipe", RECIPES[:1] + RECIPES[2:])
def test_checkpointed_hf_llama_holds_no_fp8_copies_between_forward_and_backward(recipe):
    """Between forward and backward a checkpointed model keeps its layers' inputs; the FP8
    model's Linears add no FP8 copies to that: it holds less than one byte per element of one
    hidden-wide tensor per layer more than the checkpointed BF16 model (the C++ nodes'
    transposed FP8 inputs, were they kept, are 5.75 such bytes per layer: q/k/v's, o's,
    gate/up's and down's; 2026-12-03, H200: 1.6 MB more with CurrentScaling, 2.1 with
    BlockScaling, on 30 MB, where 5.75 bytes would be 24 MB)."""
    shape = hf_llama.Shape(hidden=512, ffn=1408, layers=4, heads=8, kv_heads=2, batch=4, seq=512)
    bf16 = hf_llama.build_llama(shape, CUDA)
    fp8 = copy.deepcopy(bf16)
    fp8train.convert(fp8, recipe, filter_fn=hf_llama.not_lm_head)
    for m in (bf16, fp8):
        hf_llama.checkpointing(m, False)
    held = [_held_between_forward_and_backward(m, recipe, 3, (shape.batch, shape.seq)) for m in (bf16, fp8)]
    tokens = shape.batch * shape.seq
    assert held[1] <= held[0] + shape.layers * tokens * shape.hidden, (held, tokens * shape.hidden)
    assert set(fp8train.inspect.execution_paths(fp8).values()) == {"C++ node"}


@pytest.mark.parametrize("recipe", RECIPES)
def test_linear_node_trains_with_its_activations_offloaded(recipe):
    """torch.autograd.graph.save_on_cpu(pin_memory=True) copies what the node saves to pinned
    host memory (contiguous: a strided view comes back with other strides) and back for the
    backward: the same gradients as without it, on the C++ node."""
    torch.manual_seed(0)
    layer = fp8train.Linear(256, 384, params_dtype=torch.bfloat16, device=CUDA)
    twin = copy.deepcopy(layer)
    x = torch.randn(3, 100, 256, device=CUDA, dtype=torch.bfloat16)
    for step in range(3):
        xs = [x.clone().requires_grad_() for _ in range(2)]
        with fp8train.autocast(recipe=recipe):  # one region: delayed updates roll both alike
            y = layer(xs[0])
            with torch.autograd.graph.save_on_cpu(pin_memory=True):
                y_off = twin(xs[1])
        assert y_off.grad_fn.name() == y.grad_fn.name()
        for out in (y, y_off):
            out.float().square().sum().backward()
        assert torch.equal(xs[1].grad, xs[0].grad) and torch.equal(twin.weight.grad, layer.weight.grad)
        layer.weight.grad = twin.weight.grad = None
    assert y_off.grad_fn.name() == "fp8train::LinearBackward"
