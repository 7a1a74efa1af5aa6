"""kernels/replay.py on the CPU: how a recording becomes a launch group (which pointer is a
hole, a scratch buffer or a fixed buffer, and when no group may be built), the C++ group's
own argument checks, and that CPU calls always take the Python path. Replays themselves
launch GPU binaries: tests/gpu/test_replay_gpu.py."""
from types import SimpleNamespace

import pytest
import torch

from fp8train.kernels import native, replay

triton = pytest.importorskip("triton")
from fp8train.kernels import launcher  # noqa: E402


def fake_binary(signature: dict):
    """What kernel_params reads of a triton 3.6 CompiledKernel (see tests/test_native.py)."""
    meta = SimpleNamespace(num_ctas=1, num_warps=4, shared=0, launch_pdl=False, launch_cooperative_grid=False,
                           global_scratch_size=0, profile_scratch_size=0)
    return SimpleNamespace(src=SimpleNamespace(signature=signature), metadata=meta, function=0)


SIG = {"x_ptr": "*bf16", "out_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "part_ptr": "*fp32", "m": "i32",
       "BLOCK": "constexpr"}
SIG2 = {"part_ptr": "*fp32", "db_ptr": "*bf16", "n": "i32"}


def recording(*launches, scratch=()):
    rec = launcher.Recording()
    rec.launches.extend(launches)
    for t, zeroed in scratch:
        rec.scratch[t.data_ptr()] = (t, zeroed)
    return rec


@pytest.fixture
def call():
    """A call's tensors, a quantizer-like fixed buffer and a scratch buffer."""
    x = torch.randn(37, 64, dtype=torch.bfloat16)
    out = torch.empty(37, 64, dtype=torch.float8_e4m3fn)
    db = torch.empty(64, dtype=torch.bfloat16)
    history = torch.zeros(16)
    part = torch.empty(5, 64)
    return SimpleNamespace(x=x, out=out, db=db, history=history, part=part)


def test_plan_maps_holes_scratch_and_fixed_buffers(call):
    # the first launch reads x (through a byte view, as the transpose kernel does), writes out,
    # reads the scale at history[0] (a view: an address inside a fixed buffer) and writes the
    # scratch; the second reduces the scratch into db
    rec = recording((fake_binary(SIG), 12, (call.x.view(torch.uint8), call.out, call.history[0], call.part, 37)),
                    (fake_binary(SIG2), 3, (call.part.unsqueeze(0), call.db, 64)),
                    scratch=[(call.part, True)])
    spec = replay.plan(rec, (call.x, None, call.out, call.db), fixed=(call.history,))
    assert spec is not None and spec.holes == 4 and spec.device is None  # CPU tensors: no device index
    (b1, grid1, values1, holes1), (b2, grid2, values2, holes2) = spec.launches
    # slots: x 0, out 2, db 3; the scratch after the call's 4 tensors: 4; two scratch pointers
    # of the recorded kernel ABI (null) at the end of each launch
    assert holes1 == [0, 2, -1, 4, -1, -1, -1] and holes2 == [4, 3, -1, -1, -1]
    assert values1[2] == call.history.data_ptr() and values1[4] == launcher.pack_param("i32", 37)
    assert values1[0] == values1[1] == values1[3] == 0  # holes carry no address
    assert grid1 == 12 and grid2 == 3
    assert spec.scratch_shapes == [[5, 64]] and spec.scratch_zeroed == [True]
    assert spec.keep == [call.history]
    assert spec.aligned == [call.x.data_ptr() % 16 == 0, False, call.out.data_ptr() % 16 == 0,
                            call.db.data_ptr() % 16 == 0]


def test_plan_refuses_what_it_cannot_replay(call):
    one = (fake_binary(SIG), 1, (call.x, call.out, call.history[0], call.part, 37))
    holes, fixed = (call.x, call.out), (call.history,)
    assert replay.plan(recording(one, scratch=[(call.part, False)]), holes, fixed) is not None
    # a pointer that is neither the call's, nor scratch, nor inside a fixed buffer: never baked in
    assert replay.plan(recording(one), holes, fixed) is None
    assert replay.plan(recording(one, scratch=[(call.part, False)]), holes, ()) is None
    # a launch that went through Triton's own path, or nothing recorded
    rec = recording(one, scratch=[(call.part, False)])
    rec.complete = False
    assert replay.plan(rec, holes, fixed) is None
    assert replay.plan(recording(), holes, fixed) is None
    # two call tensors at one address
    assert replay.plan(recording(one, scratch=[(call.part, False)]), (call.x, call.out, call.x[0]), fixed) is None
    # a binary the C++ launcher cannot launch (clusters)
    clustered = fake_binary(SIG)
    clustered.metadata.num_ctas = 2
    assert replay.plan(recording((clustered, 1, one[2]), scratch=[(call.part, False)]), holes, fixed) is None


def test_scratch_is_noted_only_while_recording():
    outside = launcher.scratch((2, 3), torch.device("cpu"))
    with launcher.recording() as rec:
        zeroed = launcher.scratch((4,), torch.device("cpu"), zeroed=True)
        plain = launcher.scratch((5,), torch.device("cpu"))
    assert set(rec.scratch) == {zeroed.data_ptr(), plain.data_ptr()} and outside.data_ptr() not in rec.scratch
    assert rec.scratch[zeroed.data_ptr()][1] is True and rec.scratch[plain.data_ptr()][1] is False
    assert torch.equal(zeroed, torch.zeros(4)) and zeroed.dtype == torch.float32
    assert launcher._recording is None


def test_cpu_calls_take_python_and_cache_nothing():
    cache, ran = {}, []
    x = torch.randn(4, 8)
    replay.run(cache, ("k",), (x,), (), lambda: ran.append(1))
    replay.run(cache, ("k",), (x,), None, lambda: ran.append(2))
    assert ran == [1, 2] and cache == {}


@pytest.mark.slow  # builds the C++ extension (tests/tiers.py)
def test_cpp_group_checks_its_arguments():
    ext = native.extension()
    if ext is None:
        pytest.skip(f"extension not built: {native.failure()}")
    launch = ext.Launch(0, 1, 128, 0, [0, 0, 5], [0, 3, -1])
    with pytest.raises(RuntimeError, match="hole 3 of a table of 2"):
        ext.Group(0, 2, [launch], [], [], [True, True], [])
    with pytest.raises(RuntimeError, match="one alignment flag per tensor"):
        ext.Group(0, 2, [launch], [[4]], [], [True, True], [])
    # slots 0, 1: the call's tensors; 2: the scratch buffer
    group = ext.Group(0, 2, [ext.Launch(0, 1, 128, 0, [0, 0, 5], [0, 2, -1])], [[4]], [False], [True, True], [])
    with pytest.raises(RuntimeError, match="launch group of 2 tensors got 1"):
        ext.run_group(group, [torch.zeros(4)])
    with pytest.raises(RuntimeError, match="is not on cuda:0"):
        ext.run_group(group, [torch.zeros(4), None])
    # a per-tensor cast plan's launches index the four cast holes only (the fifth: block scales')
    with pytest.raises(RuntimeError, match="cast plan launch with hole 4"):
        ext.CastPlan(0, 1, False, [2, 16], [], [ext.Launch(0, 1, 128, 0, [0], [4])], None, None, 0, [])
