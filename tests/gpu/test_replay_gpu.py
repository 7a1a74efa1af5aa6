"""Launch groups (kernels/replay.py) against the Python launches they replay: the fused
modules' norm and activation steps, forward and backward, give the same bytes either way.

The Python path is the reference: `native.ENABLED = False` runs it on a twin module with the
same parameters and inputs. A step's first call of each shape records its launches, later
calls replay them, so each test also checks that replays happened."""
from __future__ import annotations

import copy

import pytest
import torch

import fp8train
from fp8train.kernels import native, replay
from fp8train.modules import layernorm_mlp_native as mlp_native
from fp8train.modules import norm as norm_module
from fp8train.quantizer import Quantizer
from tests.helpers import assert_same_steps, autocast_steps

pytest.importorskip("triton")

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("native_extension")]
CUDA = torch.device("cuda")


@pytest.fixture
def replays(monkeypatch):
    """Counts launch-group replays."""
    count = [0]
    original = replay.Group.__call__

    def counted(self, *tensors):
        count[0] += 1
        return original(self, *tensors)
    monkeypatch.setattr(replay.Group, "__call__", counted)
    return count


def run_steps(module, xs, dys, recipe, enabled):
    """autocast_steps with the launch groups on or off; the LayerNormMLP node off: these tests
    look at the groups the Python Function replays (tests/gpu/test_mlp_node_gpu.py: the node,
    which runs them from C++)."""
    native.ENABLED, mlp_native.ENABLED = enabled, False
    try:
        return autocast_steps(module, xs, dys, recipe)
    finally:
        native.ENABLED = mlp_native.ENABLED = True


def compare(mod, ref, xs, dys, recipe, between=None):
    """mod's steps with launch groups against ref's through Python; `between(module, i)`, if
    given, runs before step i of each."""
    def steps(module, enabled):
        if between is None:
            return run_steps(module, xs, dys, recipe, enabled)
        out = []
        for i in range(len(xs)):
            between(module, i)
            out += run_steps(module, xs[i:i + 1], dys[i:i + 1], recipe, enabled)[0]
        return out, {n: t.clone() for n, t in module.state_dict().items()}
    assert_same_steps(steps(mod, True), steps(ref, False))


@pytest.mark.parametrize("activation", ["gelu_tanh", "swiglu", "relu"])
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("params_dtype", [torch.bfloat16, torch.float32], ids=["bf16-params", "fp32-params"])
def test_layernorm_mlp_replays_match_python(activation, normalization, bias, params_dtype, replays):
    torch.manual_seed(0)
    ref = fp8train.LayerNormMLP(128, 256, bias=bias, normalization=normalization, activation=activation,
                                params_dtype=params_dtype, device=CUDA)
    mod = copy.deepcopy(ref)
    xs = [torch.randn(3, 37, 128, device=CUDA, dtype=torch.bfloat16) * (1 + i) for i in range(4)]  # odd rows, 3-D
    dys = [torch.randn(3, 37, 128, device=CUDA, dtype=torch.bfloat16) for _ in range(4)]
    compare(mod, ref, xs, dys, fp8train.DelayedScaling())
    # step 0 calibrates, step 1 records; steps 2 and 3 replay the norm and activation,
    # forward and backward (the norm backward, which reads no quantizer, from step 1)
    assert replays[0] >= 8, f"{replays[0]} replays"


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_layernorm_linear_replays_match_python(normalization, replays):
    torch.manual_seed(1)
    ref = fp8train.LayerNormLinear(256, 96, normalization=normalization, params_dtype=torch.bfloat16, device=CUDA)
    mod = copy.deepcopy(ref)
    xs = [torch.randn(50, 256, device=CUDA, dtype=torch.bfloat16) for _ in range(4)]
    dys = [torch.randn(50, 96, device=CUDA, dtype=torch.bfloat16) for _ in range(4)]
    compare(mod, ref, xs, dys, fp8train.DelayedScaling())
    assert replays[0] >= 4, f"{replays[0]} replays"


def test_current_scaling_never_records(replays):
    """Current scaling zeroes its amax between two launches: the modules keep the Python path."""
    norm_module._BWD_GROUPS.clear()  # so that this test's first norm backward records
    mod = fp8train.LayerNormMLP(128, 256, activation="gelu_tanh", params_dtype=torch.bfloat16, device=CUDA)
    xs = [torch.randn(64, 128, device=CUDA, dtype=torch.bfloat16) for _ in range(3)]
    dys = [torch.randn(64, 128, device=CUDA, dtype=torch.bfloat16) for _ in range(3)]
    run_steps(mod, xs, dys, fp8train.CurrentScaling(), True)
    # no quantizer holds a group; only the norm backward (it reads no quantizer) recorded on
    # the first step and replayed on the next two
    quantizers = [m for m in mod.modules() if isinstance(m, Quantizer)]
    assert quantizers and not any(isinstance(v, replay.Group) for q in quantizers for v in q._prepared.values())
    assert replays[0] == 2


def test_moved_quantizer_buffers_drop_the_groups(replays):
    """A group points at its quantizer's scale and amax history: after `.to()` moves them the
    quantizer's preparations (groups included) are dropped and re-recorded, so replays still
    read the live buffers (the bytes match the Python path after the move)."""
    torch.manual_seed(2)
    ref = fp8train.LayerNormMLP(128, 256, activation="gelu_tanh", params_dtype=torch.bfloat16, device=CUDA)
    mod = copy.deepcopy(ref)
    xs = [torch.randn(40, 128, device=CUDA, dtype=torch.bfloat16) for _ in range(6)]
    dys = [torch.randn(40, 128, device=CUDA, dtype=torch.bfloat16) for _ in range(6)]

    def move_at_step_3(module, i):
        if i == 3:  # new buffers for every quantizer (a round trip through the CPU reallocates them)
            module.to("cpu").to(CUDA)
    compare(mod, ref, xs, dys, fp8train.DelayedScaling(), between=move_at_step_3)
    assert replays[0] > 0
