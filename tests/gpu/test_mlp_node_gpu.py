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


def run(module, x, dy, recipe, enabled):
    native.ENABLED = enabled
    try:
        with fp8train.autocast(recipe=recipe):
            y = module(x)
        if dy is not None:
            y.backward(dy)
    finally:
        native.ENABLED = True
    return y


def compare(a, b, ya, yb, xa, xb, what):
    assert_bitwise(ya, yb, f"{what}: y")
    if xa.requires_grad:
        assert_bitwise(xa.grad, xb.grad, f"{what}: x.grad")
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert (pa.grad is None) == (pb.grad is None), f"{what}: {name}.grad presence"
        if pa.grad is not None:
            assert_bitwise(pa.grad, pb.grad, f"{what}: {name}.grad")
    for (name, ba), (_, bb) in zip(a.named_buffers(), b.named_buffers()):
        assert_bitwise(ba, bb, f"{what}: {name}")


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
    recipe = fp8train.DelayedScaling()
    names = []
    for i in range(5):
        x = torch.randn(3, 37, 128, device=CUDA, dtype=torch.bfloat16) * (1 + i)  # 3-D, odd rows
        dy = torch.randn(3, 37, 128, device=CUDA, dtype=torch.bfloat16)
        xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        ya, yb = run(mod, xa, dy, recipe, True), run(ref, xb, dy, recipe, False)
        names.append(node_name(ya))
        assert node_name(yb) == "_LayerNormMLPFnBackward"
        compare(mod, ref, ya, yb, xa, xb, f"step {i}")
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
    recipe = fp8train.DelayedScaling()
    names = []
    for i in range(4):
        x = torch.randn(64, 128, device=CUDA, dtype=torch.bfloat16)
        dy = torch.randn(64, 128, device=CUDA, dtype=torch.bfloat16)
        xa, xb = x.clone(), x.clone()
        if frozen != "input":
            xa.requires_grad_(True)
            xb.requires_grad_(True)
        ya, yb = run(mod, xa, dy, recipe, True), run(ref, xb, dy, recipe, False)
        names.append(node_name(ya))
        compare(mod, ref, ya, yb, xa, xb, f"{frozen} step {i}")
    assert names[-1] == NODE, names


def test_no_grad_forward_and_backward_twice():
    torch.manual_seed(2)
    mod = fp8train.LayerNormMLP(128, 256, activation="gelu_tanh", params_dtype=torch.bfloat16, device=CUDA)
    ref = copy.deepcopy(mod)
    recipe = fp8train.DelayedScaling()
    x = torch.randn(64, 128, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    for _ in range(3):
        dy = torch.ones(64, 128, device=CUDA, dtype=torch.bfloat16)
        run(mod, x, dy, recipe, True)
        run(ref, x, dy, recipe, False)
    with torch.no_grad():
        for _ in range(3):  # records, then the node's forward alone
            ya, yb = run(mod, x, None, recipe, True), run(ref, x, None, recipe, False)
    assert ya.grad_fn is None
    assert_bitwise(ya, yb, "no_grad y")
    with fp8train.autocast(recipe=recipe):
        y = mod(x)
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
    for i in range(3):  # eager steps on both, so that the node's plan exists before capture
        xa, xb = xs[i].clone().requires_grad_(True), xs[i].clone().requires_grad_(True)
        compare(mod, ref, run(mod, xa, dys[i], recipe, True), run(ref, xb, dys[i], recipe, False), xa, xb,
                f"eager {i}")
    sample = xs[0].clone().requires_grad_(True)
    fp8train.make_graphed_callables(mod, (sample,), recipe=recipe)
    for i in range(3, 8):
        xa, xb = xs[i].clone().requires_grad_(True), xs[i].clone().requires_grad_(True)
        ya = mod(xa)
        ya.backward(dys[i])
        yb = run(ref, xb, dys[i], recipe, False)
        compare(mod, ref, ya, yb, xa, xb, f"replay {i}")
