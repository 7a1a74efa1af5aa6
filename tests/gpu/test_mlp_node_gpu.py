"""The C++ LayerNormMLP node (csrc/linear_node.cpp `mlp_forward`, modules/layernorm_mlp_native.py)
against the Python Function it replaces: the same bytes for the output, every gradient and
the scaling state, step after step.

The Python path is the reference: `native.ENABLED = False` runs it on a twin module with the
same parameters and inputs. The node takes over once the Python path has run both passes of
a call signature with launch groups (kernels/replay.py): the third step here."""
from __future__ import annotations

import copy

import pytest
import torch

import fp8train
from fp8train.kernels import native
from tests.helpers import assert_bitwise

pytest.importorskip("triton")

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
NODE = "fp8train::LayerNormMLPBackward"


@pytest.fixture(scope="module", autouse=True)
def built():
    if native.extension() is None:
        pytest.fail(f"the C++ extension did not build: {native.failure()}")


def run_steps(module, xs, dys, recipe, enabled, grad_x=True):
    """Per step (node name, y, x.grad, parameter grads), and the state after the last step.
    All of one module's steps run before its twin's: every autocast entry rolls every live
    delayed quantizer, so interleaved steps would roll each module's histories at the other's."""
    native.ENABLED = enabled
    try:
        out = []
        for x, dy in zip(xs, dys):
            x = x.detach().clone().requires_grad_(grad_x)
            with fp8train.autocast(recipe=recipe):
                y = module(x)
            name = node_name(y)
            if y.requires_grad:
                y.backward(dy)
            out.append((name, y.detach(), x.grad,
                        {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}))
            module.zero_grad(set_to_none=True)
        return out, {n: t.clone() for n, t in module.state_dict().items()}
    finally:
        native.ENABLED = True


def compare(mod, ref, xs, dys, recipe, grad_x=True):
    """mod through the node (where it takes it) against ref through the Python Function: the
    node names per step of mod."""
    got, got_state = run_steps(mod, xs, dys, recipe, True, grad_x)
    want, want_state = run_steps(ref, xs, dys, recipe, False, grad_x)
    for i, ((_, y, dx, grads), (name_ref, y_ref, dx_ref, grads_ref)) in enumerate(zip(got, want)):
        assert name_ref in ("_LayerNormMLPFnBackward", "none"), name_ref
        assert_bitwise(y, y_ref, f"step {i}: y")
        assert (dx is None) == (dx_ref is None), f"step {i}: x.grad presence"
        if dx is not None:
            assert_bitwise(dx, dx_ref, f"step {i}: x.grad")
        assert grads.keys() == grads_ref.keys(), f"step {i}: which parameters got gradients"
        for name in grads_ref:
            assert_bitwise(grads[name], grads_ref[name], f"step {i}: {name}.grad")
    for name, t in want_state.items():
        assert_bitwise(got_state[name], t, name)
    return [g[0] for g in got]


def node_name(y):
    return y.grad_fn.name() if y.grad_fn is not None else "none"


@pytest.mark.parametrize("activation", ["gelu_tanh", "swiglu"])
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("params_dtype", [torch.bfloat16, torch.float32], ids=["bf16-params", "fp32-params"])
def test_node_matches_the_python_function(activation, normalization, bias, params_dtype):
    torch.manual_seed(0)
    ref = fp8train.LayerNormMLP(128, 256, bias=bias, normalization=normalization, activation=activation,
                                params_dtype=params_dtype, device=CUDA)
    mod = copy.deepcopy(ref)
    xs = [torch.randn(3, 37, 128, device=CUDA, dtype=torch.bfloat16) * (1 + i) for i in range(5)]  # 3-D, odd rows
    dys = [torch.randn(3, 37, 128, device=CUDA, dtype=torch.bfloat16) for _ in range(5)]
    names = compare(mod, ref, xs, dys, fp8train.DelayedScaling())
    assert names[2:] == [NODE] * 3, names


@pytest.mark.parametrize("frozen", ["input", "norm", "norm-bias-only", "fc1", "all-params"])
def test_node_with_frozen_parts(frozen):
    torch.manual_seed(1)
    ref = fp8train.LayerNormMLP(128, 256, activation="gelu_tanh", params_dtype=torch.bfloat16, device=CUDA)
    if frozen == "norm":
        ref.layer_norm_weight.requires_grad_(False)
        ref.layer_norm_bias.requires_grad_(False)
    elif frozen == "norm-bias-only":  # the norm backward still runs, for the bias alone
        ref.layer_norm_weight.requires_grad_(False)
    elif frozen == "fc1":
        ref.fc1_weight.requires_grad_(False)
        ref.fc1_bias.requires_grad_(False)
    elif frozen == "all-params":
        for p in ref.parameters():
            p.requires_grad_(False)
    mod = copy.deepcopy(ref)
    xs = [torch.randn(64, 128, device=CUDA, dtype=torch.bfloat16) for _ in range(4)]
    dys = [torch.randn(64, 128, device=CUDA, dtype=torch.bfloat16) for _ in range(4)]
    names = compare(mod, ref, xs, dys, fp8train.DelayedScaling(), grad_x=frozen != "input")
    assert names[-1] == NODE, names


def test_no_grad_forward_and_backward_twice():
    torch.manual_seed(2)
    mod = fp8train.LayerNormMLP(128, 256, activation="gelu_tanh", params_dtype=torch.bfloat16, device=CUDA)
    ref = copy.deepcopy(mod)
    recipe = fp8train.DelayedScaling()
    x = torch.randn(64, 128, device=CUDA, dtype=torch.bfloat16)
    dy = torch.ones(64, 128, device=CUDA, dtype=torch.bfloat16)

    def steps(module, enabled):
        run_steps(module, [x] * 3, [dy] * 3, recipe, enabled)
        native.ENABLED = enabled
        try:
            with torch.no_grad():
                ys = []
                for _ in range(3):  # records, then the node's forward alone
                    with fp8train.autocast(recipe=recipe):
                        ys.append(module(x))
            return ys
        finally:
            native.ENABLED = True
    got, want = steps(mod, True), steps(ref, False)
    assert got[-1].grad_fn is None
    for i, (a, b) in enumerate(zip(got, want)):
        assert_bitwise(a, b, f"no_grad call {i}")
    with fp8train.autocast(recipe=recipe):
        y = mod(x.clone().requires_grad_(True))
    assert node_name(y) == NODE
    y.sum().backward()
    with pytest.raises(RuntimeError, match="second time"):
        y.sum().backward()


def test_graphed_node_matches_eager():
    """make_graphed_callables over a module whose calls take the node: replays train like
    eager Python steps."""
    torch.manual_seed(3)
    mod = fp8train.LayerNormMLP(128, 256, activation="gelu_tanh", params_dtype=torch.bfloat16, device=CUDA)
    ref = copy.deepcopy(mod)
    recipe = fp8train.DelayedScaling()
    xs = [torch.randn(64, 128, device=CUDA, dtype=torch.bfloat16) for _ in range(8)]
    dys = [torch.randn(64, 128, device=CUDA, dtype=torch.bfloat16) for _ in range(8)]
    got, _ = run_steps(mod, xs[:3], dys[:3], recipe, True)  # eager steps: the node's plan exists before capture
    assert got[-1][0] == NODE
    fp8train.make_graphed_callables(mod, (xs[0].clone().requires_grad_(True),), recipe=recipe)
    replays = []
    for i in range(3, 8):
        x = xs[i].clone().requires_grad_(True)
        y = mod(x)
        y.backward(dys[i])
        # clones: a replay's output and input gradient are the graph's static buffers, which
        # the next replay overwrites
        replays.append((y.detach().clone(), x.grad.clone(), {n: p.grad.clone() for n, p in mod.named_parameters()}))
        mod.zero_grad(set_to_none=True)
    state = {n: t.clone() for n, t in mod.state_dict().items()}
    want, want_state = run_steps(ref, xs, dys, recipe, False)
    for i, ((y, dx, grads), (_, y_ref, dx_ref, grads_ref)) in enumerate(zip(replays, want[3:])):
        assert_bitwise(y, y_ref, f"replay {i}: y")
        assert_bitwise(dx, dx_ref, f"replay {i}: x.grad")
        for name in grads_ref:
            assert_bitwise(grads[name], grads_ref[name], f"replay {i}: {name}.grad")
    for name, t in want_state.items():
        assert_bitwise(state[name], t, name)
