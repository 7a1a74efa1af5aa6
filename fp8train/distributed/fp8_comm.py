"""FP8 all-gather and group-consistent current scaling.

Under sequence parallelism each rank of the tensor-parallel group holds a block of rows
(tokens) of a layer's input; the column-parallel GEMM needs all of them. Here the rows are
cast to FP8 *before* the gather, with a scale every rank of the group agrees on, and the
gathered FP8 bytes go straight to the FP8 GEMM: no dequantized copy exists anywhere.

Row layout after a gather along dim 0: rank r's rows land at rows [r*m, (r+1)*m) (group
rank order), m being the per-rank row count. A (s, b, h) sequence-parallel input gathered
along dim 0 has the same row order as its (s*b, h) flattening.

Note: FP8 payloads travel as uint8 views. The collectives only move bytes; gloo refuses
float8 tensors and NCCL's float8 support depends on its version, while a view costs nothing.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from .. import kernels
from ..quantizer import Cast, CurrentScalingQuantizer, DelayedScalingQuantizer, Quantizer
from ..tensor import FP8_DTYPES, padded_rows
from .groups import GroupsLike, as_reduction, group_size

_CASTABLE = (torch.bfloat16, torch.float16, torch.float32)


def _all_gather_into(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    # torch >= 2.13 names it all_gather_single (all_gather_into_tensor is deprecated there);
    # the GPU machine's torch 2.11 has only the old name. Looked up per call, so tests can
    # count collectives by wrapping the torch.distributed functions.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, inp, group=group)


def all_gather_fp8(data: torch.Tensor, group=None) -> torch.Tensor:
    """Concatenate every rank's FP8 `data` along dim 0, in group rank order.

    data  (m, ...) float8, contiguous, the same shape on every rank
    returns (size * m, ...) of data's dtype, a new tensor (also when the group has one rank)
    """
    if data.dtype not in FP8_DTYPES:
        raise TypeError(f"all_gather_fp8: expected a float8_e4m3fn or float8_e5m2 tensor, got {data.dtype}")
    if data.dim() == 0:
        raise ValueError("all_gather_fp8: data must have a leading (row) dimension to gather along")
    size = group_size(group)
    data = data.contiguous()
    out = torch.empty((size * data.shape[0], *data.shape[1:]), dtype=data.dtype, device=data.device)
    _all_gather_into(out.view(torch.uint8), data.view(torch.uint8), group)
    return out


def reduce_amax(amax: torch.Tensor, groups: GroupsLike = None) -> torch.Tensor:
    """In place: amax <- max over the ranks of `groups` (a process group or an AmaxReduction).

    amax  float32 tensor (one amax, or several stacked: the reduction is elementwise).
    A NaN is turned into +inf first (fp8train records a NaN amax as inf anyway), so a
    non-finite amax on any rank is non-finite on every rank, whatever the backend's MAX does
    with NaN. Returns amax.
    """
    if amax.dtype != torch.float32:
        raise TypeError(f"reduce_amax: amax must be float32, got {amax.dtype}")
    amax.nan_to_num_(nan=math.inf, posinf=math.inf)  # in place, one launch; inf stays inf
    for group in as_reduction(groups).groups:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax


def cast_consistent(x: torch.Tensor, quantizer: Quantizer, groups: GroupsLike = None, *,
                    transpose: bool = False) -> Cast:
    """Cast this rank's x with a scale that is identical on every rank of `groups`.

    x  (m, k) or any shape cast along its last dim, bfloat16 / float16 / float32
    Returns the quantizer's Cast(data, data_t, scale_inv): data x's shape, data_t the padded
    transposed copy (k, padded_rows(m)) when `transpose`.

    Current scaling: the local amax pass, one all-reduce (MAX) per group, then the cast
    kernel derives the scale from the shared amax. The quantizer's `amax` and `scale` end up
    holding the group's values, exactly as after its own cast of the whole tensor.
    Delayed scaling: the scale comes from the amax history, identical on every rank as long
    as the histories are reduced before each update (`reduce_delayed_amaxes`); only the
    first cast of a fresh quantizer, which calibrates from the tensor's own amax, needs the
    group here: it calibrates from the group's amax (one all-reduce, once).
    """
    if x.dtype not in _CASTABLE:
        raise TypeError(f"cast_consistent: expected a bfloat16, float16 or float32 tensor, got {x.dtype}")
    x = x.detach().contiguous()
    if not isinstance(quantizer, (CurrentScalingQuantizer, DelayedScalingQuantizer)):
        raise TypeError(f"cast_consistent: unsupported quantizer {type(quantizer).__name__}"
                        + (" (BlockScaling does not run with tensor parallelism or FSDP2's fp8_all_gather yet)"
                           if quantizer.blockwise else ""))
    if quantizer.calibrated and isinstance(quantizer, DelayedScalingQuantizer):
        return quantizer.cast(x, transpose=transpose)  # the usual delayed cast (a prepared launch)
    out = quantizer.allocate(x.shape, x.device, transpose=transpose)
    # The quantizer's producer sequence with the cast kernel as the producer: the amax pass,
    # the group's all-reduce through the hook, then the cast from the shared amax. (Delayed
    # calibration: this rank's own amax goes into the pending history entry, which
    # reduce_delayed_amaxes makes the group's at the next update.)
    quantizer.produce(
        lambda amax_out: kernels.amax(x, amax_out),
        lambda scale, amax_out, from_amax, count, pow2: kernels.cast_trusted(
            x, out.data, out.data_t, scale, out.scale_inv, amax_out, from_amax, count, power_of_two=pow2),
        amax_hook=lambda amax: reduce_amax(amax, groups))
    return out


def transpose_rows(data: torch.Tensor) -> torch.Tensor:
    """The padded transposed copy (k, padded_rows(M)) of FP8 rows (M, k), zero beyond column M:
    the layout the wgrad GEMM reads (gemm.wgrad). On CUDA the Triton byte transpose."""
    if data.dim() != 2:
        raise ValueError(f"transpose_rows: expected (rows, cols) FP8 data, got shape {tuple(data.shape)}")
    m, k = data.shape
    out = torch.empty((k, padded_rows(m)), dtype=data.dtype, device=data.device)
    if data.is_cuda:
        from ..kernels import transpose  # imports triton: CUDA only

        transpose.transpose_into(data.contiguous(), out)
    else:
        out[:, :m].copy_(data.t())
        out[:, m:].view(torch.uint8).zero_()
    return out


def gather_cast(x: torch.Tensor, quantizer: Quantizer, group=None, *, transpose: bool = False,
                amax_groups: Optional[GroupsLike] = None) -> Cast:
    """Cast this rank's rows to FP8 with a group-consistent scale, then all-gather the bytes.

    x            (m, k) this rank's rows (the same m on every rank), high precision
    group        the gather (tensor-parallel) group
    amax_groups  the groups the scale must agree over (default: `group`); when given it must
                 include the gather group, e.g. AmaxReduction.tensor_and_data_parallel
    Returns Cast(data (size*m, k) fp8 gathered, data_t, scale_inv (1,) shared by every rank).

    data_t (k, padded_rows(size*m)) is formed by transposing *after* the gather, once, so
    its columns are the gathered rows in order with the zero padding at the end only, and m
    may be any row count. (Gathering the per-rank transposed copies instead would need m to
    be a multiple of 16, else each rank's zero padding would sit between ranks' tokens, and
    a byte reshuffle after the gather anyway: all-gathers concatenate along dim 0.) The
    wgrad GEMM can equally call `transpose_rows` on the gathered data later, in backward,
    so that only one 1-byte copy is held between forward and backward.
    """
    if x.dim() != 2:
        raise ValueError(f"gather_cast: expected this rank's rows as (m, k), got shape {tuple(x.shape)}")
    local = cast_consistent(x, quantizer, group if amax_groups is None else amax_groups)
    data = all_gather_fp8(local.data, group)
    return Cast(data, transpose_rows(data) if transpose else None, local.scale_inv)
