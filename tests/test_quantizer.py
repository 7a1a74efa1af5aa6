"""Quantizers own scaling state; one registry update per step rolls every delayed history."""
import gc
import weakref

import numpy as np

import pytest
import torch

import fp8train
from fp8train import CurrentScalingQuantizer, DelayedScalingQuantizer, TensorRole
from fp8train.quantizer import _REGISTRY
from fp8train.scaling import UNRECORDED
from helpers import fp8_bytes

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def div(a, b) -> float:
    """IEEE float32 division (Python's `448.0 / tensor` is reciprocal-then-multiply in torch)."""
    return float(np.float32(a) / np.float32(b))


def delayed(h=4, dtype=E4M3, **kw):
    return DelayedScalingQuantizer(TensorRole.INPUT, dtype, h, **kw)


def test_first_cast_calibrates_then_history_drives_the_scale():
    q = delayed()
    x = torch.randn(8, 32)
    out = q.quantize(x)
    amax = x.abs().max()
    assert q.calibrated and q.scale.item() == div(448.0, amax)
    assert q.amax_history.tolist() == [amax.item(), UNRECORDED, UNRECORDED, UNRECORDED]
    assert torch.equal(fp8_bytes(out.fp8_data), fp8_bytes(fp8train.quantize(x, E4M3, scale=q.scale).fp8_data))
    # Two casts in one step: the pending amax is their max; the scale waits for the update.
    y = torch.randn(8, 32) * 4
    q.quantize(y)
    assert q.amax_history[0].item() == max(amax.item(), y.abs().max().item())
    assert q.scale.item() == div(448.0, amax)
    fp8train.update_delayed_scales()
    assert q.amax_history[0].item() == UNRECORDED
    assert q.scale.item() == div(448.0, torch.maximum(amax, y.abs().max()))


def test_update_leaves_unused_quantizers_alone():
    used, unused = delayed(), delayed()
    used.quantize(torch.randn(4, 16))
    unused.quantize(torch.randn(4, 16))
    fp8train.update_delayed_scales()
    before = unused.amax_history.clone(), unused.scale.clone()
    used.quantize(torch.randn(4, 16))
    fp8train.update_delayed_scales()
    assert torch.equal(unused.amax_history, before[0]) and torch.equal(unused.scale, before[1])
    assert used.amax_history[2].item() >= 0


def test_nonfinite_step_is_discarded_and_counted():
    q = delayed()
    q.quantize(torch.randn(4, 16))
    fp8train.update_delayed_scales()
    scale, history = q.scale.clone(), q.amax_history.clone()
    bad = torch.randn(4, 16)
    bad[1, 2] = float("nan")
    out = q.quantize(bad)
    assert q.amax_history[0].item() == float("inf")  # NaN is recorded as inf
    assert torch.isnan(out.fp8_data.float()[1, 2])
    fp8train.update_delayed_scales()
    assert torch.equal(q.scale, scale) and torch.equal(q.amax_history, history)
    assert q.nonfinite_count.item() == 1


def test_current_scaling_quantizer():
    q = CurrentScalingQuantizer(TensorRole.GRAD_OUTPUT, E5M2)
    x = torch.randn(16, 16)
    out = q.quantize(x)
    assert q.amax.item() == x.abs().max().item() and q.scale.item() == div(57344.0, x.abs().max())
    assert out.fp8_dtype == E5M2 and out.role is TensorRole.GRAD_OUTPUT
    q.quantize(torch.full((4, 4), float("inf")))
    assert q.nonfinite_count.item() == 1 and q.scale.item() == div(57344.0, x.abs().max())


def test_current_scaling_takes_each_cast_own_amax_not_the_running_max():
    """Each cast's amax replaces the last one (the amax is taken afresh, not max-accumulated),
    down as well as up; a skipped cast (a cached weight's flag) leaves data and state alone."""
    q = CurrentScalingQuantizer(TensorRole.WEIGHT, E4M3)
    for peak in (100.0, 1.0, 3.0):
        x = torch.randn(24, 32).clamp(-0.5, 0.5)
        x[3, 5] = -peak
        out = q.quantize(x, transpose=True)
        assert q.amax.item() == peak and q.scale.item() == div(448.0, peak)
        assert fp8_bytes(out.fp8_data).tolist() == fp8_bytes((x * q.scale).to(E4M3)).tolist()
    skip = torch.ones((), dtype=torch.int32)
    before = fp8_bytes(out.fp8_data).clone()
    q.requantize(torch.full((24, 32), 7.0), out, transpose=True, skip=skip)
    assert q.amax.item() == 3.0 and q.scale.item() == div(448.0, 3.0) and torch.equal(fp8_bytes(out.fp8_data), before)
    skip.zero_()
    q.requantize(torch.full((24, 32), 7.0), out, transpose=True, skip=skip)
    assert q.amax.item() == 7.0 and q.scale.item() == div(448.0, 7.0)


@pytest.mark.parametrize("make", [delayed, lambda: CurrentScalingQuantizer(TensorRole.INPUT, E4M3)],
                         ids=["delayed", "current"])
def test_steady_state_prepares_one_launch_per_case_and_its_lookups_find_it(make):
    """Casts of one case (shape, dtype, transposed copy or not) prepare their launch once and
    reuse it; the C++ plans' lookup (_steady_launches) finds that same launch, so a key that
    drifted between the two would show here (the steady state would silently re-plan)."""
    q = make()
    x = torch.randn(64, 32, dtype=torch.bfloat16)
    for _ in range(3):
        q.quantize(x, transpose=True)
    (launch,) = q._prepared.values()
    assert q._steady_launches(x.shape, x.dtype, True, False) == (launch,)
    assert q._steady_launches(x.shape, x.dtype, False, False) is None
    q.quantize(x)
    q.quantize(x)
    assert len(q._prepared) == 2 and q._prepared[next(iter(q._prepared))] is launch


@pytest.mark.parametrize("make", [delayed, lambda: CurrentScalingQuantizer(TensorRole.INPUT, E4M3)],
                         ids=["delayed", "current"])
@pytest.mark.parametrize("shape", [(5, 32), (3, 7, 48), (16, 16)], ids=str)
def test_transpose_and_workspace(make, shape):
    q = make()
    x = torch.randn(shape, dtype=torch.bfloat16)
    out = q.quantize(x, transpose=True)
    rows = x.numel() // shape[-1]
    assert out.transpose_is_cached()
    t = out.transpose_data(padded=True)
    assert t.shape == (shape[-1], -(-rows // 16) * 16)
    assert torch.equal(fp8_bytes(t[:, :rows]), fp8_bytes(out.fp8_data.reshape(rows, -1)).t())
    assert (fp8_bytes(t[:, rows:]) == 0).all()
    # In place: same storages, new values, transposed copy rewritten too.
    ptrs = out.fp8_data.data_ptr(), out.scale_inv.data_ptr(), t.data_ptr()
    y = torch.randn(shape, dtype=torch.bfloat16)
    again = q.quantize(y, transpose=True, out=out)
    assert again is out and (out.fp8_data.data_ptr(), out.scale_inv.data_ptr(), out.transpose_data(padded=True).data_ptr()) == ptrs
    assert torch.equal(fp8_bytes(out.transpose_data()), fp8_bytes(out.fp8_data.reshape(rows, -1)).t())
    with pytest.raises(ValueError, match="does not fit"):
        q.quantize(torch.randn(2, 16), out=out)


def test_registry_drops_freed_quantizers_and_rebuilds_after_moves():
    q = delayed()
    assert any(live is q for live in _REGISTRY.live())
    fp8train.update_delayed_scales()
    batches = _REGISTRY._batches
    ref = weakref.ref(q)
    del q
    gc.collect()
    assert ref() is None and len(_REGISTRY.live()) == len(_REGISTRY._refs)
    # The built batch keeps the dead quantizer's buffers, so it stays valid (a captured CUDA
    # graph may still launch it); it is only stale, and rebuilt at the next eager update.
    assert _REGISTRY._batches is batches and _REGISTRY._stale
    fp8train.update_delayed_scales()
    assert _REGISTRY._batches is not batches and not _REGISTRY._stale
    q = delayed()
    assert _REGISTRY._batches is None  # a new quantizer needs a rebuild before it updates
    fp8train.update_delayed_scales()
    assert _REGISTRY._batches is not None
    q.to(torch.float32)  # _apply may replace buffers
    assert _REGISTRY._batches is None


def test_state_dict_round_trip_restores_calibration():
    q = delayed(h=8)
    q.quantize(torch.randn(4, 16))
    fp8train.update_delayed_scales()
    fresh = delayed(h=8)
    fresh.load_state_dict(q.state_dict())
    assert fresh.calibrated and torch.equal(fresh.scale, q.scale) and torch.equal(fresh.amax_history, q.amax_history)
    assert not delayed(h=8).calibrated


def test_copies_are_registered_and_updated():
    import copy
    q = delayed()
    q.quantize(torch.randn(4, 16))
    twin = copy.deepcopy(q)
    assert any(live is twin for live in _REGISTRY.live())
    fp8train.update_delayed_scales()
    assert torch.equal(twin.amax_history, q.amax_history) and torch.equal(twin.scale, q.scale)
    assert twin.amax_history[0].item() == UNRECORDED


def test_no_rebuild_during_cuda_graph_capture(monkeypatch):
    q = delayed()
    fp8train.update_delayed_scales()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    _REGISTRY._stale = True  # e.g. a layer was freed: the built batch still runs, unchanged
    batches = _REGISTRY._batches
    fp8train.update_delayed_scales()
    assert _REGISTRY._batches is batches
    delayed()  # a layer created since the last eager step cannot join a capture
    with pytest.raises(RuntimeError, match="run one eager step"):
        fp8train.update_delayed_scales()
    del q
