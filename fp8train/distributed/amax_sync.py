"""Delayed scaling across a process group: reduce the pending amaxes of many quantizers in
one collective, before the per-step scale update.

Delayed scales are computed from amax histories by `update_delayed_scales()` (run on entry
to `fp8train.autocast`). If every rank's histories hold the same values, every rank
computes the same scales: so it is enough to make the *pending* entry (`amax_history[0]`,
the amax of the step just finished) the group's maximum before that update. Call

    reduce_delayed_amaxes(quantizers, AmaxReduction.tensor_parallel(tp_group))
    with fp8train.autocast(recipe=DelayedScaling(...)):    # the update runs here
        ...

once per step, on every rank of the groups, with the same quantizers in the same order
(`delayed_quantizers(model)` lists a model's in module order; lazily built quantizers exist
after the first FP8 forward). Calibration of fresh quantizers goes through
`cast_consistent`, so the first scales agree too.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, List, Tuple

import torch
from torch import nn

from ..quantizer import DelayedScalingQuantizer
from .fp8_comm import reduce_amax
from .groups import GroupsLike


def delayed_quantizers(module: nn.Module) -> List[DelayedScalingQuantizer]:
    """Every DelayedScalingQuantizer inside `module`, in module order (the same order on
    every rank that holds the same model structure)."""
    return [m for m in module.modules() if isinstance(m, DelayedScalingQuantizer)]


def reduce_delayed_amaxes(quantizers: Iterable[DelayedScalingQuantizer], groups: GroupsLike = None) -> None:
    """amax_history[0] of each quantizer <- its max over the ranks of `groups`; one all-reduce
    per group for all quantizers together (flatten into one buffer, reduce, scatter back).

    Pending entries keep their meaning through the MAX: UNRECORDED (-1) on every rank stays
    unrecorded; a quantizer that cast on some ranks only gets their amax everywhere (so every
    rank updates it alike); inf (or NaN, turned into inf) on any rank discards the step on
    every rank (scaling.delayed_update).
    """
    qs = list(quantizers)
    if not qs:
        return
    for q in qs:
        if not isinstance(q, DelayedScalingQuantizer):
            raise TypeError(f"reduce_delayed_amaxes: expected DelayedScalingQuantizers, got {type(q).__name__}")
    devices = {q.amax_history.device for q in qs}
    if len(devices) != 1:
        raise ValueError(f"reduce_delayed_amaxes: the quantizers live on several devices ({sorted(map(str, devices))}); "
                         "reduce each device's quantizers separately")
    _pending_buffer([q.amax_history for q in qs]).reduce(groups)


class _PendingBuffer:
    """The pending entries (amax_history[0]) of one list of histories in one flat (n,) float32
    buffer: one fused copy in, the collectives, one fused copy back. Built once per list and
    reused every step (no per-quantizer indexing, stacking or allocation on the step's host
    path; capturable in a CUDA graph)."""

    def __init__(self, histories: List[torch.Tensor]):
        self.pending = [h[0] for h in histories]  # () views; they keep their histories alive
        self.flat = torch.empty(len(histories), dtype=torch.float32, device=histories[0].device)
        self.slots = list(self.flat.unbind(0))

    def reduce(self, groups: GroupsLike) -> None:
        torch._foreach_copy_(self.slots, self.pending)
        reduce_amax(self.flat, groups)
        torch._foreach_copy_(self.pending, self.slots)


_BUFFERS: "OrderedDict[Tuple[int, ...], _PendingBuffer]" = OrderedDict()
_MAX_BUFFERS = 8  # lists seen recently (a model's, the registry's live set, ...)


def _pending_buffer(histories: List[torch.Tensor]) -> _PendingBuffer:
    """The cached buffer of exactly these history tensors, in this order. Keyed by the
    tensors' ids, which cannot be reused while the cache's views keep the tensors alive; a
    reloaded or new quantizer has a new history tensor and so gets a new buffer."""
    key = tuple(map(id, histories))
    buf = _BUFFERS.get(key)
    if buf is None:
        buf = _BUFFERS[key] = _PendingBuffer(histories)
        if len(_BUFFERS) > _MAX_BUFFERS:
            _BUFFERS.popitem(last=False)
    else:
        _BUFFERS.move_to_end(key)
    return buf
