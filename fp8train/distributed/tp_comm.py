"""The FP8 GEMMs of a tensor-parallel layer with their communication, one helper per mode and
direction, shared by the TP Linear (parallel_linear.py) and the fused modules
(parallel_fused.py).

Notation as in docs/distributed.md: a TP group of W ranks; M rows (tokens) of the full
activation, m = M / W per rank under sequence parallelism (SP).

  column_fprop   Y (M, N/W) = X W_local^T + b_local; under SP X is gathered as FP8 bytes from
                 every rank's rows (m, K), cast beforehand with a group-consistent scale
  column_dgrad   dX = sum over ranks of dY_local W_local: all-reduce (M, K), or under SP
                 reduce-scatter to this rank's rows (m, K); returned as a PendingReduction
                 (the collective issued, not waited for) so the caller runs wgrad meanwhile
  row_fprop      Y = sum over ranks of X_local W_local^T, then + b once: all-reduce (M, N), or
                 under SP this rank's rows (m, N) of the reduce-scatter
  row_grad_output  dY's FP8 operands for dgrad and wgrad: a local cast (M, N) without SP; under
                 SP the rows (m, N) cast with a group-consistent scale and gathered as FP8

Note: partial sums (the row-parallel output, the column-parallel dX) are computed and reduced
in tp.accum_dtype(act_dtype): the activation dtype by default (one rounding per hop, the
bytes of a BF16 reduce-scatter), or float32 with tp_reduce_dtype=torch.float32 (cast to the
activation dtype once after the reduction, so the result does not depend on W beyond float32
summation order, at twice the bytes). With
`tp.overlap` (SP only) the four SP communication points run as the ring collective matmuls
of collective_matmul.py instead of one collective next to one GEMM.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Tuple

import torch
import torch.distributed as dist

from .. import gemm
from ..modules.weight_workspace import weight_operands, weight_transposed
from ..quantizer import Cast, Quantizer
from ..recipe import GemmConfig
from .collective_matmul import all_gather_dgrad, all_gather_fprop, dgrad_reduce_scatter, fprop_reduce_scatter
from .fp8_comm import _all_gather_into, all_gather_fp8, cast_consistent, transpose_rows
from .tp_config import TPConfig

# --------------------------------------------------------------------------- collectives

_sequential = False  # sequential_reductions(): column_dgrad waits before it returns


@contextlib.contextmanager
def sequential_reductions() -> Iterator[None]:
    """Inside the block column_dgrad waits for dX's reduction before it returns, so the wgrad
    GEMM runs after it (the order before the bulk overlap): the benchmarks' no-overlap
    baseline and tests. Applies to what runs, or is captured into a CUDA graph, inside the
    block; not thread-safe."""
    global _sequential
    saved, _sequential = _sequential, True
    try:
        yield
    finally:
        _sequential = saved


def all_reduce_sum(t: torch.Tensor, tp: TPConfig) -> torch.Tensor:
    """In place: t <- the sum of t over the ranks. Returns t."""
    dist.all_reduce(t, group=tp.group)
    return t


def _reduce_scatter_rows(t: torch.Tensor, tp: TPConfig, async_op: bool):
    """(out (M/W, ...), the work handle when async_op, else None)."""
    out = torch.empty((t.shape[0] // tp.world, *t.shape[1:]), dtype=t.dtype, device=t.device)
    rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # see _all_gather_into
    return out, rs(out, t, group=tp.group, async_op=async_op)


def reduce_scatter_rows(t: torch.Tensor, tp: TPConfig) -> torch.Tensor:
    """This rank's rows (M/W, ...) of the sum over ranks of t (M, ...)."""
    return _reduce_scatter_rows(t.contiguous(), tp, async_op=False)[0]


class PendingReduction:
    """A sum over the TP group issued with async_op=True and not yet waited for; `wait()`
    returns it in `dtype`. Between the two the caller runs work that does not read it (the
    column-parallel backward: the wgrad GEMM), which the collective runs beside.

    NCCL: an async collective runs on ProcessGroupNCCL's stream, which waits for the current
    stream at issue (a synchronous one, async_op=False, runs on the current stream itself, so
    it could not overlap); `wait()` makes the current stream wait for it without blocking the
    host, an event wait that a CUDA graph capture records like the ring's (ring.py). gloo: it
    runs in gloo's threads and `wait()` blocks the host. The input is referenced here until
    `wait()`, so its memory is not reused while the collective reads it, whatever the backend
    keeps alive on its own.
    """

    __slots__ = ("_out", "_work", "_dtype", "_input")

    def __init__(self, out: torch.Tensor, work, dtype: torch.dtype, inp: Optional[torch.Tensor] = None):
        self._out, self._work, self._dtype, self._input = out, work, dtype, inp

    def wait(self) -> torch.Tensor:
        if self._work is not None:  # None: already reduced (the ring), or a rank outside the group
            self._work.wait()
            self._work = self._input = None
        out = self._out
        return out if out.dtype == self._dtype else out.to(self._dtype)


def _start_sum(t: torch.Tensor, tp: TPConfig, dtype: torch.dtype) -> PendingReduction:
    """Issue the sum over ranks of t (M, ...): this rank's rows (M/W, ...) under SP
    (reduce-scatter), else all of it (all-reduce, in place); wait() casts it to dtype."""
    if tp.sequence_parallel:
        t = t.contiguous()
        out, work = _reduce_scatter_rows(t, tp, async_op=True)
        return PendingReduction(out, work, dtype, t)
    return PendingReduction(t, dist.all_reduce(t, group=tp.group, async_op=True), dtype)


def all_gather_rows(t: torch.Tensor, tp: TPConfig) -> torch.Tensor:
    """(W*m, ...): every rank's t (m, ...) in rank order."""
    t = t.contiguous()
    out = torch.empty((tp.world * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    _all_gather_into(out, t, tp.group)
    return out


def all_gather_dim(t: torch.Tensor, tp: TPConfig, dim: int) -> torch.Tensor:
    """Every rank's t (the same shape everywhere) concatenated along `dim` in rank order
    (unsharding a parameter; not on the training path)."""
    parts = [torch.empty_like(t) for _ in range(tp.world)]
    dist.all_gather(parts, t.detach().contiguous(), group=tp.group)
    return torch.cat(parts, dim=dim)


def rows(t: torch.Tensor) -> torch.Tensor:
    """t as (rows, last dim); 2-D tensors pass through without a view."""
    return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])


# --------------------------------------------------------------------------- column parallel


def column_fprop(xq: Cast, w_fp8, config: GemmConfig, act_dtype: torch.dtype, bias: Optional[torch.Tensor],
                 need_wgrad: bool, tp: TPConfig) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """Y (M, N/W) = X @ W_local^T + b_local. Returns (Y, X^T (K, Mp) fp8 for wgrad or None, X's scale_inv).

    xq  X cast to FP8: (M, K) the same on every rank without SP (with its transposed copy
        when need_wgrad); under SP this rank's rows (m, K) cast with a scale identical on
        every rank (cast_consistent, or a producer with the group's amax). Under SP the rows
        are gathered once, as FP8 bytes; the gathered rows' transposed copy is formed here,
        after the gather, so the wgrad GEMM needs no second gather.
    """
    if not tp.sequence_parallel:
        return gemm.fprop(xq.data, xq.scale_inv, *weight_operands(w_fp8), config, act_dtype, bias), xq.data_t, \
            xq.scale_inv
    if tp.overlap:
        y, x_data = all_gather_fprop(xq.data, xq.scale_inv, *weight_operands(w_fp8), config, act_dtype, tp.group,
                                     bias)
    else:
        x_data = all_gather_fp8(xq.data, tp.group)  # (M, K)
        y = gemm.fprop(x_data, xq.scale_inv, *weight_operands(w_fp8), config, act_dtype, bias)
    return y, (transpose_rows(x_data) if need_wgrad else None), xq.scale_inv


def column_dgrad(dy_data: torch.Tensor, dy_scale_inv: torch.Tensor, w_fp8, config: GemmConfig,
                 act_dtype: torch.dtype, tp: TPConfig) -> PendingReduction:
    """dX: the sum over ranks of dY_local (M, N/W) @ W_local, in act_dtype; (M, K) without
    SP (all-reduce), this rank's rows (m, K) under SP (reduce-scatter).

    Returns it pending: the dgrad GEMM is queued and its reduction issued, not waited for.
    The caller queues the wgrad GEMM (independent of dX) and then calls `.wait()`, so the
    reduction runs beside wgrad ("bulk" overlap; the same ops as reducing first, reordered).
    Under tp.overlap the ring has already reduced dX by the time this returns.
    """
    accum = tp.accum_dtype(act_dtype)
    if tp.sequence_parallel and tp.overlap:
        return PendingReduction(dgrad_reduce_scatter(dy_data, dy_scale_inv, *weight_transposed(w_fp8), config,
                                                     act_dtype, tp.group, accum_dtype=accum), None, act_dtype)
    dx = gemm.dgrad(dy_data, dy_scale_inv, *weight_transposed(w_fp8), config, accum)  # (M, K) partial
    pending = _start_sum(dx, tp, act_dtype)
    return PendingReduction(pending.wait(), None, act_dtype) if _sequential else pending



# --------------------------------------------------------------------------- row parallel


def row_fprop(x_data: torch.Tensor, x_scale_inv: torch.Tensor, w_fp8, config: GemmConfig, act_dtype: torch.dtype,
              bias: Optional[torch.Tensor], tp: TPConfig) -> torch.Tensor:
    """The sum over ranks of X_local (M, K/W) @ W_local^T, + b added once after the
    reduction, in act_dtype: (M, N) without SP, this rank's rows (m, N) under SP."""
    accum = tp.accum_dtype(act_dtype)
    if tp.sequence_parallel and tp.overlap:
        return fprop_reduce_scatter(x_data, x_scale_inv, *weight_operands(w_fp8), config, act_dtype, tp.group, bias,
                                    accum_dtype=accum)
    y = gemm.fprop(x_data, x_scale_inv, *weight_operands(w_fp8), config, accum)  # (M, N) partial
    y = reduce_scatter_rows(y, tp) if tp.sequence_parallel else all_reduce_sum(y, tp)
    if bias is not None:
        y += bias.to(accum)
    return y.to(act_dtype)


def row_grad_output(dy: torch.Tensor, q_grad: Quantizer, w_fp8, config: GemmConfig, act_dtype: torch.dtype,
                    need_dgrad: bool, need_wgrad: bool, need_dbias: bool, tp: TPConfig):
    """The backward of row_fprop up to wgrad. Returns (dX (M, K/W) or None, dY^T (N, Mp) fp8
    or None, dY's scale_inv, db (N,) float32 or None).

    dy  (M, N) the same on every rank without SP: a local cast agrees across ranks, and db
        comes from the same pass. Under SP this rank's rows (m, N): cast with the group's
        scale and gathered as FP8 (with dgrad as a ring under tp.overlap); db is the
        all-reduced sum of every rank's rows, so each rank holds the full bias gradient.
    """
    if not tp.sequence_parallel:
        dy_data, dy_t, dy_scale_inv, db = q_grad.cast(dy, transpose=need_wgrad, dbias=need_dbias)  # (M, N), (N, Mp)
        dx = gemm.dgrad(dy_data, dy_scale_inv, *weight_transposed(w_fp8), config, act_dtype) if need_dgrad else None
        return dx, dy_t, dy_scale_inv, db
    local = cast_consistent(dy, q_grad, tp.group)  # (m, N)
    if tp.overlap and need_dgrad:
        dx, dy_data = all_gather_dgrad(local.data, local.scale_inv, *weight_transposed(w_fp8), config, act_dtype,
                                       tp.group)
    else:
        dy_data = all_gather_fp8(local.data, tp.group)  # (M, N)
        dx = gemm.dgrad(dy_data, local.scale_inv, *weight_transposed(w_fp8), config,
                        act_dtype) if need_dgrad else None
    dy_t = transpose_rows(dy_data) if need_wgrad else None  # (N, Mp)
    db = all_reduce_sum(dy.sum(0, dtype=torch.float32), tp) if need_dbias else None
    return dx, dy_t, local.scale_inv, db
