"""Copy-engine transfers for the collective matmuls on CUDA, through symmetric memory.

The NCCL ring (ring.RingComm) moves each chunk with NCCL kernels, which need SMs; beside a
GEMM that fills every SM they wait (docs/distributed.md: the overlap measured at N=2). Here
the bytes move by DMA instead: every rank of the group maps one workspace buffer of every
peer (torch.distributed._symmetric_memory, NVLink peer mappings; the copies use no multicast
object, and torch sets none up under TORCH_SYMM_MEM_DISABLE_MULTICAST=1, which this
project's scripts and tests set, as the GPU machines require), and a
peer's chunk is a plain device copy (`copy_`, cudaMemcpyAsync: the copy engines, no SMs)
from or to that mapping. Order across ranks comes from the workspace's barrier (a one-block
kernel on the compute stream that every rank must reach).

  all_gather_matmul (pull)      each rank copies its shard into its own workspace; barrier;
                                every rank multiplies its own chunk while a side stream pulls
                                the peers' chunks from their workspaces, each GEMM waiting
                                only for its chunk.
  matmul_reduce_scatter (push)  each rank multiplies the peers' chunks first and pushes each
                                partial into that peer's workspace (slot = own rank) from a
                                side stream while the next GEMM runs, its own chunk last;
                                barrier; each rank sums its slots in rank order.

Every operation starts with a barrier: no rank writes its workspace (or a peer's) before
every rank has finished reading what the previous operation left there. Results equal the
NCCL ring's and the non-overlapped path's (gathered bytes exactly; sums up to float32
summation order, here rank order, the same on every rank).
"""
from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Callable, Iterator, Optional, Tuple

import torch
import torch.distributed as dist

from .groups import group_rank, group_size

GemmRows = Callable[..., torch.Tensor]

_forced_nccl = False


@contextlib.contextmanager
def nccl_transport() -> Iterator[None]:
    """Inside the block the collective matmuls move chunks with NCCL (ring.RingComm) even where
    the copy engines could (benchmarks compare the two; the results are the same)."""
    global _forced_nccl
    saved, _forced_nccl = _forced_nccl, True
    try:
        yield
    finally:
        _forced_nccl = saved


def _group_name(group: Optional[dist.ProcessGroup]) -> str:
    return (group or dist.group.WORLD).group_name


@functools.lru_cache(maxsize=None)
def _enable(group_name: str) -> bool:
    """Symmetric memory for the group, once; False (with one warning) where it cannot be had."""
    try:
        from torch.distributed import _symmetric_memory as symm_mem
        with warnings.catch_warnings():  # newer torch: deprecated, as every group has it
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(group_name)
        return True
    except Exception as err:  # an old torch, no peer access, no CUDA IPC: the NCCL ring stays
        warnings.warn(f"fp8train: symmetric memory unavailable for group {group_name!r} ({err}); the collective "
                      "matmuls move chunks with NCCL", RuntimeWarning, stacklevel=3)
        return False


def usable(group: Optional[dist.ProcessGroup], device: torch.device) -> bool:
    """Whether the collective matmuls on `device` over `group` take the copy-engine path."""
    return (device.type == "cuda" and not _forced_nccl and group_size(group) > 1
            and dist.get_backend(group) == "nccl" and _enable(_group_name(group)))


_sizes: dict = {}    # group name -> the largest workspace asked for so far, in bytes
_handles: dict = {}  # group name -> the workspace handle of that size


def _workspace(group, nbytes: int):
    """The group's workspace handle, at least nbytes per rank. Growing it frees the old buffer,
    which a peer's copy may still be reading: so every rank first drains its GPU work and
    meets the others (only while the sizes settle, in the first steps; never under capture)."""
    from torch.distributed import _symmetric_memory as symm_mem
    name = _group_name(group)
    if nbytes <= _sizes.get(name, -1):
        return _handles[name]  # no rendezvous lookup per call on the eager host path
    if name in _sizes and not torch.cuda.is_current_stream_capturing():  # (torch refuses to grow there)
        torch.cuda.synchronize()
        dist.barrier(group=group, device_ids=[torch.cuda.current_device()])
        torch.cuda.synchronize()
    _sizes[name] = nbytes
    _handles[name] = symm_mem.get_symm_mem_workspace(name, min_size=nbytes)
    return _handles[name]


@functools.lru_cache(maxsize=None)
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def all_gather_matmul(a_local: torch.Tensor, gemm_rows: GemmRows, n: int, out_dtype: torch.dtype,
                      group=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """collective_matmul.all_gather_matmul's contract, the chunks pulled by the copy engines."""
    size, rank = group_size(group), group_rank(group)
    m, k = a_local.shape
    device = a_local.device
    gathered = torch.empty((size * m, k), dtype=a_local.dtype, device=device)
    out = torch.empty((size * m, n), dtype=out_dtype, device=device)
    ws = _workspace(group, m * k)
    compute, side = torch.cuda.current_stream(device), _side_stream(device)

    def rows(c: int) -> torch.Tensor:
        return gathered[c * m:(c + 1) * m]

    def shard_of(peer: int) -> torch.Tensor:  # peer's workspace, mapped here: (m, k) bytes
        return ws.get_buffer(peer, (m, k), torch.uint8)

    ws.barrier(channel=0)  # every rank is done reading the workspaces (previous operation)
    shard_of(rank).copy_(a_local.view(torch.uint8))
    rows(rank).copy_(a_local)
    ws.barrier(channel=1)  # every rank's shard is in its workspace
    side.wait_stream(compute)
    arrived = []
    with torch.cuda.stream(side):  # all pulls queued up front, back to back on the copy engines
        for s in range(1, size):
            peer = (rank - s) % size
            rows(peer).view(torch.uint8).copy_(shard_of(peer))
            done = torch.cuda.Event()
            done.record(side)
            arrived.append((peer, done))
    gemm_rows(rows(rank), out=out[rank * m:(rank + 1) * m])
    for peer, done in arrived:
        compute.wait_event(done)
        gemm_rows(rows(peer), out=out[peer * m:(peer + 1) * m])
    compute.wait_stream(side)
    return out, gathered


def matmul_reduce_scatter(a: torch.Tensor, gemm_rows: GemmRows, group=None, *,
                          accum_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """collective_matmul.matmul_reduce_scatter's contract (a's rows already checked to split
    evenly), the partial sums pushed by the copy engines."""
    size, rank = group_size(group), group_rank(group)
    m = a.shape[0] // size
    device = a.device
    compute, side = torch.cuda.current_stream(device), _side_stream(device)
    own = ws = None
    for s in range(1, size + 1):
        c = (rank + s) % size  # the peers' chunks first, this rank's own last
        part = gemm_rows(a[c * m:(c + 1) * m])  # (m, n) this rank's partial of chunk c
        if part.dtype != accum_dtype:
            raise TypeError(f"matmul_reduce_scatter: gemm_rows returned {part.dtype}, expected {accum_dtype}")
        if ws is None:  # the partials' shape is known after the first GEMM
            n = part.shape[1]
            ws = _workspace(group, size * m * n * part.element_size())
            # before any push: every rank is done reading its workspace (previous operation)
            ws.barrier(channel=0)
        if c == rank:
            own = part
            continue
        side.wait_stream(compute)
        with torch.cuda.stream(side):  # into slot `rank` of chunk c's owner
            ws.get_buffer(c, (m, n), accum_dtype, storage_offset=rank * m * n).copy_(part)
        part.record_stream(side)
    compute.wait_stream(side)
    ws.barrier(channel=1)  # every push to every rank has landed
    terms = [own if j == rank else ws.get_buffer(rank, (m, n), accum_dtype, storage_offset=j * m * n)
             for j in range(size)]
    acc = terms[0] + terms[1]  # rank order, the same on every rank; a new tensor, not the workspace
    for term in terms[2:]:
        acc += term
    return acc


__all__ = ["all_gather_matmul", "matmul_reduce_scatter", "nccl_transport", "usable"]
