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

from typing import Iterable, List

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
    pending = [q.amax_history[0] for q in qs]  # () views into each history
    flat = torch.stack(pending)                # (n,) float32: one buffer, one collective
    reduce_amax(flat, groups)
    torch._foreach_copy_(pending, list(flat.unbind(0)))
