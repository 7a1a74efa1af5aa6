"""FSDP2 (`fully_shard`) gathering fp8train weights in FP8 (issue 26, item 2).

FSDP2 all-gathers each sharded weight before its module's forward, in the master dtype: 4
bytes per element with FP32 master weights, after which every rank casts the whole weight to
FP8 itself. `fp8_all_gather(model)` (before `fully_shard`) makes each FP8 GEMM weight of an
eligible fp8train.Linear, LayerNormLinear or LayerNormMLP (fc1 and fc2) an `FP8GatherWeight`:
the master weight, wrapped (every op runs on the master, so optimizers, state dicts and
FSDP's sharding see it), with FSDP2's two all-gather extension points:

  fsdp_pre_all_gather   the local shard cast to FP8 by that GEMM's weight quantizer with a
                        scale every rank agrees on (distributed.fp8_comm.cast_consistent: current
                        scaling all-reduces the shards' amaxes; delayed scaling reads the
                        scale, and its amax history must be reduced over the group each step,
                        as the FSDP tests do), handed to FSDP as uint8 bytes.
  fsdp_post_all_gather  the gathered bytes and the shared scale_inv as the Float8Tensor that
                        the layer's forward takes as its FP8 weight (no workspace cast); its
                        transposed copy for dgrad is made from the gathered bytes on demand.

Layers left as they are, named in one warning per call: tensor-parallel ones (TP gathers its
own weights) and ones whose dims do not take FP8 (they keep the master-dtype gather). The
layers' C++ nodes (Linear's, LayerNormMLP's) take the gathered weight as their FP8 weight as
the Python Functions do (WeightWorkspace.get / for_native hand it over uncast).
tests/gpu/test_fsdp_gpu.py runs the FSDP cases with NCCL at min(GPUs, 4) ranks.
"""
from __future__ import annotations

import warnings
import weakref
from typing import Optional

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from .. import kernels, scaling
from ..kernels import reference
from ..quantizer import DelayedScalingQuantizer, delayed_updates
from ..recipe import Recipe
from ..roles import TensorRole
from ..tensor import Float8Tensor
from .fp8_comm import cast_consistent, reduce_amax

_aten = torch.ops.aten
# Ops whose results are (views or copies of) the weight itself: FSDP2 shards, pads, copies and
# moves the parameter with them, and the results must keep the extension points.
_KEEP = {_aten.detach.default, _aten.alias.default, _aten.view.default, _aten.as_strided.default,
         _aten.slice.Tensor, _aten.split.Tensor, _aten.split_with_sizes.default, _aten.clone.default,
         _aten._to_copy.default, _aten.empty_like.default, _aten.new_zeros.default, _aten.new_empty.default,
         _aten.copy_.default, _aten._pin_memory.default}


class FP8GatherWeight(torch.Tensor):
    """An fp8train layer's master weight (any op runs on `_master`) that FSDP2 all-gathers in
    FP8, cast by the layer's quantizer `quantizer_name` (its GEMM's weight quantizer)."""

    _master: torch.Tensor

    @staticmethod
    def __new__(cls, master: torch.Tensor, layer_ref, quantizer_name: str = "weight_quantizer"):
        t = torch.Tensor._make_wrapper_subclass(cls, master.size(), strides=master.stride(),
                                                storage_offset=master.storage_offset(), dtype=master.dtype,
                                                layout=master.layout, device=master.device,
                                                requires_grad=master.requires_grad)
        t._master = master
        t._layer_ref = layer_ref
        t._quantizer_name = quantizer_name
        t._scale_ready = False  # precompute_fp8_weight_scales wrote the next gather's scale
        t._last_gather = None  # (key, outputs, metadata) of the last FP8 pre-all-gather
        return t

    def __repr__(self) -> str:
        return f"FP8GatherWeight({self._master!r})"

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        source = None  # (layer_ref, quantizer_name) of the wrapped weight

        def unwrap(t):
            nonlocal source
            source = t._layer_ref, t._quantizer_name
            return t._master
        wrapped = []

        def unwrap_all(t):
            wrapped.append(t._master)
            return unwrap(t)
        args, kwargs = tree_map_only(cls, unwrap_all, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func._schema.is_mutable:  # an in-place write (an optimizer step, a checkpoint load)
            # runs on the master below autograd, which leaves its version counter as it was:
            # bump it, so that the FP8 gather's cache (_gather_key) sees the new values
            for master in wrapped:
                torch.autograd.graph.increment_version(master)
        if func not in _KEEP:
            return out
        return tree_map_only(torch.Tensor, lambda t: cls(t, *source), out)

    def __tensor_flatten__(self):
        return ["_master"], (self._layer_ref, self._quantizer_name)

    @staticmethod
    def __tensor_unflatten__(inner, source, outer_size, outer_stride):
        return FP8GatherWeight(inner["_master"], *source)

    # ---------------------------------------------------------------- FSDP2's extension points
    def fsdp_pre_all_gather(self, mesh, outer_size=None, outer_stride=None, module=None, mp_policy=None):
        layer = self._layer_ref()
        q = getattr(layer, self._quantizer_name, None) if layer is not None else None
        if q is None:  # a layer freed, or its quantizers removed: as plain FSDP (policy dtype)
            dtype = getattr(mp_policy, "param_dtype", None) or self._master.dtype
            return (self._master.to(dtype),), None
        # The master and the scale unchanged since the last gather (the backward's re-gather
        # after reshard_after_forward, a later microbatch's): the same FP8 bytes, not cast again
        # (under current scaling no amax all-reduce either; every rank decides alike)
        last = self._last_gather
        if last is not None and not self._scale_ready and last[0] == self._gather_key(q):
            return last[1], last[2]
        if self._scale_ready:  # current scaling: precompute_fp8_weight_scales set q.scale already
            self._scale_ready = False
            data = torch.empty(self._master.shape, dtype=q.dtype, device=self._master.device)
            scale_inv = torch.empty(1, dtype=torch.float32, device=self._master.device)
            kernels.cast_trusted(self._master, data, None, q.scale, scale_inv)
        else:
            data, _, scale_inv, _ = cast_consistent(self._master, q, mesh.get_group())
        rows = outer_size[0] if outer_size is not None else data.shape[0] * mesh.size()
        padded = -(-rows // mesh.size())  # FSDP pads every shard to this many rows
        if data.shape[0] < padded:  # the last ranks' shards when the rows do not split evenly
            data = torch.cat([data, data.new_zeros(padded - data.shape[0], *data.shape[1:])])
        outputs, metadata = (data.view(torch.uint8),), (scale_inv, q.dtype, rows)
        self._last_gather = (self._gather_key(q), outputs, metadata)  # after the cast: it may write q.scale
        return outputs, metadata

    def _gather_key(self, q) -> tuple:
        """What an FP8 shard depends on: the quantizer, the master's values (its version,
        which __torch_dispatch__ bumps on every in-place op) and, for delayed scaling, the
        scale (it changes only at a delayed update, written by a kernel: counted, not
        versioned). A current scale follows from the master alone."""
        delayed = isinstance(q, DelayedScalingQuantizer)
        return id(q), q.dtype, self._master._version, delayed_updates() if delayed else None, q.calibrated

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        (gathered,) = all_gather_outputs
        if metadata is None:  # the master path
            if out is not None:
                return None
            return gathered, (gathered,)
        scale_inv, fp8_dtype, rows = metadata
        data = gathered.view(fp8_dtype)[:rows]  # the padding rows of uneven shards dropped
        if out is not None:  # FSDP reuses the unsharded weight: new bytes landed in its buffer
            if isinstance(out, Float8Tensor) and out._data.data_ptr() == data.data_ptr():
                out._scale_inv.copy_(scale_inv.reshape(()))
                out._mark_rewritten()
                return None
            raise RuntimeError("fp8train FSDP: the all-gather output changed form between steps (FP8 and master "
                               "gathers alternate); call every step inside fp8train.autocast or none")
        # param_dtype: the policy's compute dtype (the master's without one): the weight gradient
        # comes in it, as the other parameters' do (FSDP reduce-scatters them together)
        weight = Float8Tensor(data, scale_inv.reshape(()).clone(), param_dtype, TensorRole.WEIGHT)
        return weight, (data,)


def _gemm_weights(layer: nn.Module):
    """(GEMM prefix, weight name, weight quantizer name) of each FP8 GEMM of an fp8train layer:
    prefix p (FP8Module.GEMMS) has the weight `p + "weight"` and its quantizer
    `p + "weight_quantizer"` (Linear, LayerNormLinear: weight; LayerNormMLP: fc1_weight,
    fc2_weight). Empty for other modules."""
    from ..modules.base import QUANTIZER_NAMES, FP8Module
    if not isinstance(layer, FP8Module):
        return ()
    return tuple((p, p + "weight", p + QUANTIZER_NAMES[TensorRole.WEIGHT]) for p in layer.GEMMS)


def _left_alone(layer) -> Optional[str]:
    """Why fp8_all_gather leaves this fp8train layer's weights to FSDP2's own gather, or None."""
    if layer.tp_layout() is not None:
        return "tensor-parallel (TP gathers its own weights)"
    if not layer._fp8_dims:
        return "dims not multiples of 16 (it runs in high precision; the master-dtype gather stays)"
    return None


def fp8_all_gather(model: nn.Module, recipe: Recipe) -> int:
    """Make every FP8 GEMM weight of each eligible fp8train layer of `model` (Linear,
    LayerNormLinear, LayerNormMLP's fc1 and fc2) gather in FP8 under FSDP2 (call before
    `fully_shard`, and before building the optimizer). Their quantizers for `recipe` are made
    now, so the first gather is in FP8 too: FSDP2 keeps one form of each unsharded weight, and
    every gather is FP8 from then on (outside fp8train.autocast the layer computes with the
    dequantized FP8 weight, and says so once). Layers left alone (tensor-parallel, dims FP8
    cannot take) are named in one UserWarning. Returns how many weights it wrapped."""
    count, skipped = 0, []
    for name, m in model.named_modules():
        weights = _gemm_weights(m)
        if not weights:
            continue
        why = _left_alone(m)
        if why is not None:
            skipped.append(f"'{name or '<root>'}' ({m.describe()}): {why}")
            continue
        for prefix, weight_name, quantizer_name in weights:
            w = getattr(m, weight_name)
            if isinstance(w, FP8GatherWeight):
                continue
            m.quantizers(recipe, w.device, prefix)
            setattr(m, weight_name, nn.Parameter(FP8GatherWeight(w.data, weakref.ref(m), quantizer_name),
                                                 requires_grad=w.requires_grad))
            count += 1
    if skipped:
        warnings.warn(f"fp8_all_gather: {len(skipped)} fp8train layer(s) keep FSDP2's master-dtype all-gather: "
                      + "; ".join(skipped), UserWarning, stacklevel=2)
    return count


def precompute_fp8_weight_scales(model: nn.Module, group=None) -> int:
    """Current scaling with fp8_all_gather: the scales of every FP8-gathered weight of `model`
    from one all-reduce of all their shards' amaxes, instead of one all-reduce per weight at
    each gather. Call after the optimizer step (the masters' new values), before the next
    forward, on every rank of the FSDP group (`group`: its process group; None: the default).
    Each weight's next gather casts with the scale computed here (bit for bit the per-weight
    path's). Delayed scaling needs nothing (its scales come from the reduced histories).
    Returns how many weights it prepared."""
    from ..quantizer import CurrentScalingQuantizer
    todo = []
    for m in model.modules():
        for _, weight_name, quantizer_name in _gemm_weights(m):
            q = getattr(m, quantizer_name)
            weight = getattr(m, weight_name)
            local = getattr(weight, "_local_tensor", weight)  # the sharded DTensor's shard
            if isinstance(q, CurrentScalingQuantizer) and isinstance(local, FP8GatherWeight):
                todo.append((local, q))
    if not todo:
        return 0
    amax = torch.zeros(len(todo), dtype=torch.float32, device=todo[0][0]._master.device)
    for i, (local, _) in enumerate(todo):
        kernels.amax(local._master, amax[i])
    reduce_amax(amax, group)  # the whole weights' amaxes, one collective for all
    for i, (local, q) in enumerate(todo):
        q.amax.copy_(amax[i])
        reference.resolve_scale(q.scale, q.amax, q.nonfinite_count, scaling.fp8_max(q.dtype), q.power_of_two)
        local._scale_ready = True
    return len(todo)


__all__ = ["FP8GatherWeight", "fp8_all_gather", "precompute_fp8_weight_scales"]
