"""The C++ LayerNormMLP node's Python side on the CPU (modules/layernorm_mlp_native.py): which
calls may take it, the per-signature entries and when they start over, the plan's argument
checks in C++; CPU layers never take it. The node itself runs on the GPU:
tests/gpu/test_mlp_node_gpu.py."""
import copy
import pickle

import pytest
import torch

import fp8train
from fp8train.kernels import native
from fp8train.modules import layernorm_mlp_native as mlp_native
from fp8train.quantizer_factory import make_quantizer
from fp8train.roles import TensorRole


def quantizers():
    recipe = fp8train.DelayedScaling()
    return tuple(make_quantizer(recipe, role) for role in (TensorRole.INPUT, TensorRole.INPUT,
                                                             TensorRole.GRAD_OUTPUT, TensorRole.GRAD_OUTPUT))


def test_entries_start_over_when_a_quantizer_or_its_preparations_change():
    plans, qs = mlp_native.NodePlans(), quantizers()
    e = plans.entry("k", qs)
    e.set_fwd(("norm", "act"))
    assert plans.entry("k", qs) is e and e.fwd == ("norm", "act")
    qs[1]._forget_prepared()  # what .to() and loads do
    fresh = plans.entry("k", qs)
    assert fresh is not e and fresh.fwd is None
    other = quantizers()
    assert plans.entry("k", other) is not fresh
    e2 = plans.entry("k2", other)
    e2.set_bwd(("act_bwd", None))
    e2.plan = "made"
    e2.set_bwd(("act_bwd", None))  # the same groups: the plan stays
    assert e2.plan == "made"
    e2.set_bwd(("act_bwd2", None))
    assert e2.plan is None


def test_copies_and_pickles_start_empty():
    plans = mlp_native.NodePlans()
    plans.entry("k", quantizers()).set_fwd((object(), object()))
    assert copy.deepcopy(plans)._entries == {} and pickle.loads(pickle.dumps(plans))._entries == {}
    layer = fp8train.LayerNormMLP(32, 64)
    assert copy.deepcopy(layer)._node_plans._entries == {}


def test_needs_and_signature():
    x = torch.randn(2, 5, 32, requires_grad=True)
    w = torch.nn.Parameter(torch.ones(32))
    frozen = torch.ones(32)
    assert mlp_native.needs_of(x, w, None, w, frozen, w, None) == (True, True, False, True, False, True, False)
    with torch.no_grad():
        assert mlp_native.needs_of(x, w, None, w, frozen, w, None) == (False,) * 7
    layer = fp8train.LayerNormMLP(32, 64)
    cfg = fp8train.GemmConfig()
    needs = (True,) * 7
    a = mlp_native.signature(layer, x, torch.bfloat16, needs, cfg)
    assert a == mlp_native.signature(layer, x.detach().clone(), torch.bfloat16, needs, cfg)
    assert a != mlp_native.signature(layer, x[:1], torch.bfloat16, needs, cfg)
    assert a != mlp_native.signature(layer, x, torch.float16, needs, cfg)
    layer.to(torch.bfloat16)  # parameter dtypes are part of it: the groups were compiled for them
    assert a != mlp_native.signature(layer, x, torch.bfloat16, needs, cfg)


def test_cpu_calls_are_not_eligible_and_layers_keep_the_python_function():
    assert not mlp_native.eligible(torch.randn(4, 32), quantizers())
    layer = fp8train.LayerNormMLP(32, 64, activation="gelu_tanh")
    x = torch.randn(8, 32, requires_grad=True)
    for _ in range(3):
        with fp8train.autocast():
            y = layer(x)
        assert y.grad_fn.name() == "_LayerNormMLPFnBackward"
        y.sum().backward()
    assert layer._node_plans._entries == {}


@pytest.mark.slow  # builds the C++ extension (tests/tiers.py)
def test_cpp_plan_checks_its_arguments():
    pytest.importorskip("triton")
    ext = native.extension()
    if ext is None:
        pytest.skip(f"extension not built: {native.failure()}")
    launch = ext.Launch(0, 1, 128, 0, [0], [0])
    norm_fwd = ext.Group(0, 9, [launch], [], [], [True] * 9, [])
    act_fwd = ext.Group(0, 4, [launch], [], [], [True] * 4, [])
    args = (0, [64, 32, 64, 64, 64], True, False, [False] * 7, [1, 4, 4, 5, 0], [True, False, False])
    ext.MlpPlan(*args, norm_fwd, act_fwd, None, None, None)
    with pytest.raises(RuntimeError, match="wrong kind"):
        ext.MlpPlan(*args, act_fwd, norm_fwd, None, None, None)
    with pytest.raises(RuntimeError, match="needs the forward groups"):
        ext.MlpPlan(*args, None, act_fwd, None, None, None)
    with pytest.raises(RuntimeError, match="MlpPlan\\(device"):
        ext.MlpPlan(0, [64, 32], True, False, [False] * 7, [1, 4, 4, 5, 0], [True, False, False], norm_fwd,
                    act_fwd, None, None, None)
