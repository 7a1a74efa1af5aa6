"""Collective matmuls: an FP8 GEMM whose input all-gather, or whose output reduce-scatter,
runs as a ring of per-chunk transfers overlapped with per-chunk GEMMs.

  all-gather matmul     out = G(AllGather(a_local))        column-parallel forward (SP input),
                                                           row-parallel dgrad (SP grad-output)
  matmul reduce-scatter out = ReduceScatter(G(a))          row-parallel forward (SP output),
                                                           column-parallel dgrad (SP grad-input)

G is a row-wise GEMM given as `gemm_rows(a_rows, out=None) -> out_rows` (fprop or dgrad from
fp8train.gemm, scales and weight bound in; `out`, where given, is the row block it writes),
so the rings know nothing of GEMM roles. Rows
of chunk c are rows [c*m, (c+1)*m) of the full tensor, m = rows per rank; chunk c belongs
to group rank c. The transfers are ring.RingComm steps (streams and events on CUDA), or on
CUDA where symmetric memory is available the copy engines' (symm_transport: no SMs taken
from the GEMMs; symm_transport.nccl_transport() forces the ring).
Results equal the non-overlapped path (one all-gather then one GEMM; one GEMM then one
reduce-scatter) up to the float32 summation order of the reduce-scatter.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from .. import gemm
from ..recipe import GemmConfig
from ..tensor import FP8_DTYPES
from . import symm_transport
from .groups import group_rank, group_size
from .ring import RingComm

GemmRows = Callable[..., torch.Tensor]  # gemm_rows(a_rows, out=None) -> (rows, n)
_ACCUM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_rows(name: str, a: torch.Tensor) -> None:
    if a.dtype not in FP8_DTYPES or a.dim() != 2:
        raise ValueError(f"{name}: expected 2-D FP8 rows (rows, k), got a {a.dtype} tensor of shape {tuple(a.shape)}")


def all_gather_matmul(a_local: torch.Tensor, gemm_rows: GemmRows, n: int, out_dtype: torch.dtype,
                      group=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """gemm_rows(AllGather(a_local)), the gather run as a ring under the GEMMs.

    a_local  (m, k) fp8: this rank's rows (the same m on every rank; any m)
    n, out_dtype  the GEMM's output columns and dtype: each chunk's GEMM writes its rows of
             the output in place
    returns  (out (size*m, n), a_gathered (size*m, k) fp8): the gathered input is kept for
             the wgrad GEMM, which then needs no second gather.

    Ring: at step s rank r multiplies chunk (r - s) mod size, its own first, while it sends
    that chunk to r + 1 and receives chunk (r - s - 1) from r - 1 straight into its rows of
    the gathered buffer. size - 1 transfers of m*k bytes per rank; the last step only
    computes. On CUDA all transfers are queued on the side stream up front (each forwards
    what the previous one received, which the stream's order guarantees), so they run back
    to back, and GEMM s waits only for transfer s - 1.
    """
    _check_rows("all_gather_matmul", a_local)
    if symm_transport.usable(group, a_local.device):
        return symm_transport.all_gather_matmul(a_local, gemm_rows, n, out_dtype, group)
    size, rank = group_size(group), group_rank(group)
    m, k = a_local.shape
    gathered = torch.empty((size * m, k), dtype=a_local.dtype, device=a_local.device)

    def rows(c: int) -> torch.Tensor:
        return gathered[c * m:(c + 1) * m]  # (m, k) contiguous: chunk c, group rank c's rows

    rows(rank).copy_(a_local)
    out = torch.empty((size * m, n), dtype=out_dtype, device=a_local.device)
    comm = RingComm(group, a_local.device)
    steps = [((rank - s) % size, (rank - s - 1) % size) for s in range(size)]  # (chunk used, chunk received)
    handles = []
    if comm.cuda:
        handles = [comm.start(rows(c), rows(c_in), after_compute=s == 0) for s, (c, c_in) in enumerate(steps[:-1])]
    for s, (c, c_in) in enumerate(steps):
        if s > 0:
            comm.wait(handles[s - 1])  # chunk c has arrived
        if not comm.cuda and s < size - 1:
            handles.append(comm.start(rows(c), rows(c_in)))
        gemm_rows(rows(c), out=out[c * m:(c + 1) * m])  # (m, n), written in place
    comm.finish()
    return out, gathered


def matmul_reduce_scatter(a: torch.Tensor, gemm_rows: GemmRows, group=None, *,
                          accum_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """This rank's rows of ReduceScatter(gemm_rows(a)): sum over ranks, rows split by rank.

    a          (M, k) fp8: every row, this rank's slice of the reduction dim (M divisible
               by the group size)
    gemm_rows  must return its rows in `accum_dtype`
    returns    (M / size, n) in accum_dtype: rows [r*M/size, (r+1)*M/size) on group rank r

    Ring: at step s rank r multiplies the rows of chunk c = (r - s - 1) mod size, adds the
    partial sum of chunk c received from r - 1 (the sum over ranks c+1 .. r-1), and sends
    the result on to r + 1; the GEMM of step s + 1 runs while it travels. Chunk c starts on
    rank c + 1 and ends, summed over every rank, on rank c after size steps.

    Note: partial sums travel and accumulate in `accum_dtype`. float32 (default) keeps the
    result within float32 rounding of the exact sum whatever the group size, at twice the
    bytes of bf16; bfloat16 halves the bytes and rounds once per hop, like a bf16 NCCL
    reduce-scatter. docs/distributed.md weighs the two.
    """
    _check_rows("matmul_reduce_scatter", a)
    if accum_dtype not in _ACCUM_DTYPES:
        raise ValueError(f"matmul_reduce_scatter: accum_dtype must be one of {_ACCUM_DTYPES}, got {accum_dtype}")
    size, rank = group_size(group), group_rank(group)
    if a.shape[0] % size:
        raise ValueError(f"matmul_reduce_scatter: {a.shape[0]} rows do not split evenly over {size} ranks; "
                         f"pad the rows (tokens) to a multiple of {size}")
    if symm_transport.usable(group, a.device):
        return symm_transport.matmul_reduce_scatter(a, gemm_rows, group, accum_dtype=accum_dtype)
    m = a.shape[0] // size
    comm = RingComm(group, a.device)
    acc = recv = handle = None
    for s in range(size):
        c = (rank - s - 1) % size
        acc = gemm_rows(a[c * m:(c + 1) * m])  # (m, n) this rank's partial of chunk c
        if acc.dtype != accum_dtype:
            raise TypeError(f"matmul_reduce_scatter: gemm_rows returned {acc.dtype}, expected {accum_dtype}")
        if s > 0:
            comm.wait(handle)
            acc += recv  # + the sum of chunk c over the ranks before this one
        if s < size - 1:
            recv = torch.empty_like(acc)
            handle = comm.start(acc, recv)
    comm.finish()
    return acc


def all_gather_fprop(x: torch.Tensor, x_scale_inv: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor,
                     config: GemmConfig, out_dtype: torch.dtype, group=None,
                     bias: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Column-parallel forward with a sequence-parallel input: Y (size*m, n) = AllGather(X) @ W^T.

    x (m, k) fp8 this rank's rows, cast with a group-consistent scale (fp8_comm.cast_consistent);
    w (n, k) fp8 this rank's weight shard. Returns (Y, X gathered (size*m, k) fp8)."""
    return all_gather_matmul(
        x, lambda rows, out=None: gemm.fprop(rows, x_scale_inv, w, w_scale_inv, config, out_dtype, bias, out=out),
        w.shape[0], out_dtype, group)


def all_gather_dgrad(dy: torch.Tensor, dy_scale_inv: torch.Tensor, w_t: torch.Tensor, w_scale_inv: torch.Tensor,
                     config: GemmConfig, out_dtype: torch.dtype, group=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Row-parallel backward with a sequence-parallel grad-output: dX (size*m, k) = AllGather(dY) @ W.

    dy (m, n) fp8 this rank's rows, group-consistent scale; w_t (k, n) the transposed copy of
    this rank's weight shard (n, k). Returns (dX, dY gathered (size*m, n) fp8, for wgrad)."""
    return all_gather_matmul(
        dy, lambda rows, out=None: gemm.dgrad(rows, dy_scale_inv, w_t, w_scale_inv, config, out_dtype, out=out),
        w_t.shape[0], out_dtype, group)


def fprop_reduce_scatter(x: torch.Tensor, x_scale_inv: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor,
                         config: GemmConfig, out_dtype: torch.dtype, group=None, bias: Optional[torch.Tensor] = None,
                         *, accum_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Row-parallel forward with a sequence-parallel output: this rank's rows of
    ReduceScatter(X @ W^T) + bias, in out_dtype.

    x (M, k) fp8 every row, this rank's input features; w (n, k) fp8 this rank's shard.
    The bias is added once, after the reduction (in accum_dtype)."""
    y = matmul_reduce_scatter(x, lambda rows: gemm.fprop(rows, x_scale_inv, w, w_scale_inv, config, accum_dtype),
                              group, accum_dtype=accum_dtype)
    if bias is not None:
        y += bias.to(accum_dtype)
    return y.to(out_dtype)


def dgrad_reduce_scatter(dy: torch.Tensor, dy_scale_inv: torch.Tensor, w_t: torch.Tensor, w_scale_inv: torch.Tensor,
                         config: GemmConfig, out_dtype: torch.dtype, group=None, *,
                         accum_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Column-parallel backward with a sequence-parallel input: this rank's rows of
    ReduceScatter(dY @ W), in out_dtype.

    dy (M, n) fp8 every row, this rank's output features; w_t (k, n) the transposed copy of
    this rank's weight shard (n, k)."""
    dx = matmul_reduce_scatter(dy, lambda rows: gemm.dgrad(rows, dy_scale_inv, w_t, w_scale_inv, config, accum_dtype),
                               group, accum_dtype=accum_dtype)
    return dx.to(out_dtype)
