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
from tests.helpers import assert_bitwise, assert_same_steps, autocast_steps

pytest.importorskip("triton")

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("native_extension")]
CUDA = torch.device("cuda")
NODE = "fp8train::LayerNormMLPBackward"


def run_steps(module, xs, dys, recipe, enabled, grad_x=True):
    """autocast_steps with the C++ extension on or off."""
    native.ENABLED = enabled
    try:
        return autocast_steps(module, xs, dys, recipe, grad_x)
    finally:
        native.ENABLED = True


def compare(mod, ref, xs, dys, recipe, grad_x=True):
    """mod through the node (where it takes it) against ref through the Python Function: the
    node names per step of mod."""
    got = run_steps(mod, xs, dys, recipe, True, grad_x)
    want = run_steps(ref, xs, dys, recipe, False, grad_x)
    for name_ref, *_ in want[0]:
        assert name_ref in ("_LayerNormMLPFnBackward", "none"), name_ref
    assert_same_steps(got, want)
    return [g[0] for g in got[0]]


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


@pytest.mark.parametrize("params_dtype", [torch.bfloat16, torch.float32], ids=["bf16-params", "fp32-params"])
def test_node_recasts_the_weights_itself(params_dtype, monkeypatch):
    """Once the node runs, it launches the weights' steady-state re-casts itself (no Python
    requantize), skips them for is_first_microbatch=False, and follows in-place weight
    updates between steps: the Python Function's bytes, step after step."""
    from fp8train.quantizer import DelayedScalingQuantizer
    torch.manual_seed(5)
    ref = fp8train.LayerNormMLP(128, 256, activation="gelu_tanh", params_dtype=params_dtype, device=CUDA)
    mod = copy.deepcopy(ref)
    flags = [None, None, None, None, True, False, False, None]
    xs = [torch.randn(64, 128, device=CUDA, dtype=torch.bfloat16) for _ in flags]
    dys = [torch.randn(64, 128, device=CUDA, dtype=torch.bfloat16) for _ in flags]
    updates = [{n: 0.01 * torch.randn_like(p) for n, p in ref.named_parameters()} for _ in flags]
    recipe = fp8train.DelayedScaling()
    python_casts = [0]
    requantize = DelayedScalingQuantizer.requantize

    def counted(self, *args, **kwargs):
        python_casts[0] += 1
        return requantize(self, *args, **kwargs)
    monkeypatch.setattr(DelayedScalingQuantizer, "requantize", counted)

    def steps(module, enabled):
        native.ENABLED = enabled
        out, casts = [], []
        try:
            for i, flag in enumerate(flags):
                x = xs[i].clone().requires_grad_(True)
                before = python_casts[0]
                with fp8train.autocast(recipe=recipe):
                    y = module(x, is_first_microbatch=flag)
                casts.append(python_casts[0] - before)
                y.backward(dys[i])
                out.append((node_name(y), y.detach(), x.grad, {n: p.grad.clone() for n, p in module.named_parameters()}))
                module.zero_grad(set_to_none=True)
                if i + 1 < len(flags) and flags[i + 1] is not False:  # an update between microbatch groups
                    with torch.no_grad():
                        for n, p in module.named_parameters():
                            p.add_(updates[i][n])
            return (out, {n: t.clone() for n, t in module.state_dict().items()}), casts
        finally:
            native.ENABLED = True
    got, got_casts = steps(mod, True)
    want, want_casts = steps(ref, False)
    assert [g[0] for g in got[0]][2:] == [NODE] * (len(flags) - 2)
    # the node's own launches, float32 weights too (their transposed cast is one prepared
    # launch since the cast kernel copies a float32 tile's bytes itself: kernels/cast.py)
    assert got_casts[3:] == [0] * (len(flags) - 3), got_casts
    assert want_casts[5:7] == [0, 0] and want_casts[4] == 2, want_casts  # False: no cast; True: both weights
    assert_same_steps(got, want)


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
        replays.append(("graphed", y.detach().clone(), x.grad.clone(),
                        {n: p.grad.clone() for n, p in mod.named_parameters()}))
        mod.zero_grad(set_to_none=True)
    state = {n: t.clone() for n, t in mod.state_dict().items()}
    want, want_state = run_steps(ref, xs, dys, recipe, False)
    assert_same_steps((replays, state), (want[3:], want_state))
