"""Launch groups (kernels/replay.py) through real module code, on the CPU: the fused modules'
norm and activation steps run their Triton kernels under the interpreter, are recorded, and
later calls replay them with their own tensors put where `replay.Slots` says (call tensors,
per-call scratch, fixed quantizer buffers). Output, gradients and scaling state must be the
bytes of a twin module that runs every launch through Python.

What stands in for the GPU: `kernels._family` hands the modules the Triton kernel modules
for CPU tensors, a DirectKernel launch under a recording is noted with its kernel (there is
no compiled binary to note), and a group re-launches each recorded kernel through the
interpreter with the new call's tensors viewed exactly as the recorded arguments were (the
C++ group passes the same addresses). So this checks which pointer goes where, the scratch
and its zeroing, and the modules' lists of call tensors; the C++ launcher itself and the
binaries' parameter layout are GPU tests (tests/gpu/test_replay_gpu.py)."""
import copy
import importlib
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 (make test runs it)", allow_module_level=True)
pytest.importorskip("triton")

import fp8train  # noqa: E402
from fp8train import kernels  # noqa: E402
from fp8train.kernels import launcher, native, replay  # noqa: E402
from tests.helpers import assert_same_steps, autocast_steps  # noqa: E402


class _Arg:
    """A recorded tensor argument: its slot (or the fixed tensor) and how it was viewed."""

    def __init__(self, slot, t):
        self.slot, self.fixed = slot, (t if slot < 0 else None)
        self.dtype, self.shape, self.stride = t.dtype, tuple(t.shape), tuple(t.stride())

    def resolve(self, table):
        if self.slot < 0:
            return self.fixed
        return table[self.slot].view(self.dtype).as_strided(self.shape, self.stride)


class InterpretedGroup:
    """The CPU stand-in for the C++ group: the same placement, launched through the interpreter."""

    calls = 0

    def __init__(self, rec, holes, fixed):
        self.slots = replay.Slots(rec, holes, fixed)
        assert self.slots.ok
        self.launches = []
        for kernel, grid, args in rec.launches:
            placed = []
            for a in args:
                if isinstance(a, torch.Tensor):
                    slot = self.slots.place(a)
                    assert slot is not None, f"a pointer argument of {kernel._fn.fn.__name__} has no place"
                    placed.append(_Arg(slot, a))
                else:
                    placed.append(a)
            self.launches.append((kernel, grid, placed))

    def __call__(self, *tensors):
        InterpretedGroup.calls += 1
        # NaN where not zeroed: a scratch read before it is written shows in the bytes
        scratch = [torch.zeros(shape) if zeroed else torch.full(shape, float("nan"))
                   for shape, zeroed in zip(self.slots.scratch_shapes, self.slots.scratch_zeroed)]
        table = list(tensors) + scratch
        for kernel, grid, placed in self.launches:
            args = [a.resolve(table) if isinstance(a, _Arg) else a for a in placed]
            kernel._fn[(grid,)](*args, **kernel._options)


@pytest.fixture
def interpreted_groups(monkeypatch, exact_conversions):
    def family(x, name):
        return importlib.import_module(f"fp8train.kernels.{name}")

    def record(self, grid, *args):
        if launcher._recording is not None:
            launcher._recording.launches.append((self, grid, args))
        self._fn[(grid,)](*args, **self._options)

    def build(rec, holes, fixed):
        if not rec.launches:
            return None
        return InterpretedGroup(rec, holes, fixed)

    monkeypatch.setattr(kernels, "_family", family)
    monkeypatch.setattr(launcher.DirectKernel, "__call__", record)
    monkeypatch.setattr(replay, "_python_only", lambda first: not native.ENABLED or launcher._recording is not None)
    monkeypatch.setattr(replay, "build", build)
    InterpretedGroup.calls = 0


def compare(mod, ref, xs, dys, recipe):
    """mod's steps with launch groups (interpreted) against ref's through Python, bit for bit."""
    native.ENABLED = True
    got = autocast_steps(mod, xs, dys, recipe)
    native.ENABLED = False
    try:
        want = autocast_steps(ref, xs, dys, recipe)
    finally:
        native.ENABLED = True
    assert_same_steps(got, want)


@pytest.mark.parametrize("activation,normalization,bias", [("gelu_tanh", "LayerNorm", True),
                                                           ("swiglu", "RMSNorm", False), ("relu", "LayerNorm", True)])
def test_layernorm_mlp_replays_give_the_python_bytes(interpreted_groups, activation, normalization, bias):
    torch.manual_seed(0)
    ref = fp8train.LayerNormMLP(32, 48, bias=bias, normalization=normalization, activation=activation)
    mod = copy.deepcopy(ref)
    # 26 rows: partial tiles, a padded transposed copy; growing inputs move the scales
    xs = [torch.randn(2, 13, 32) * (1 + i) for i in range(4)]
    dys = [torch.randn(2, 13, 32) for _ in range(4)]
    compare(mod, ref, xs, dys, fp8train.DelayedScaling())
    # norm and activation forward replay from step 2 (step 0 calibrates, step 1 records);
    # the activation and norm backward from step 1 or 2
    assert InterpretedGroup.calls >= 7, InterpretedGroup.calls


@pytest.mark.parametrize("k", [48, 112], ids=["whole-rows", "chunked-rows"])
def test_layernorm_linear_replays_give_the_python_bytes(interpreted_groups, k):
    """k = 112: the interpreter's norm backward takes rows in chunks and sums them into a
    zeroed scratch (kernels/norm.py), which the group must zero again on every call."""
    torch.manual_seed(1)
    ref = fp8train.LayerNormLinear(k, 32)
    mod = copy.deepcopy(ref)
    xs = [torch.randn(21, k) for _ in range(4)]
    dys = [torch.randn(21, 32) for _ in range(4)]
    compare(mod, ref, xs, dys, fp8train.DelayedScaling())
    assert InterpretedGroup.calls >= 4, InterpretedGroup.calls
