"""Byte transpose of an FP8 tensor into a padded transposed copy, on CUDA in Triton.

Twin: `transpose_reference` below (a torch copy). Used where a kernel writes only its
row-major FP8 output and the transposed copy the wgrad GEMM needs is made afterwards: the
float32 cast path and the activation/norm kernels (docs/design.md, "Known limits"). It
replaced torch's strided copy of a transposed view, ~0.3 TB/s on the H200: 1.7 ms of the T1
step before, 0.23 ms for the same three copies after (GPU tests and benchmarks/mlp.py,
2026-11-29).

Why no tl.trans: the kernels whose in-kernel `tl.trans` of fp8 bytes wrote wrong bytes on
the H200 (triton 3.6) motivate a different route here. Each tile is *loaded* already in
transposed index order (element [c, r] = src[r, c]) and stored row by row into dst; the
compiler's own layout conversion between the coalesced load and the coalesced store does
the exchange through shared memory.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .launcher import DirectKernel, device_guard

_BLOCK_M, _BLOCK_N, _WARPS, _PER_SM = 64, 64, 4, 4


@triton.jit
def _transpose_kernel(
    src_ptr,   # (M, N) uint8 view of the fp8 payload, row-major
    dst_ptr,   # (N, Mp) uint8 view of the transposed copy, row-major; columns M..Mp-1 get zeros
    skip_ptr,  # () int32: nonzero makes the launch a no-op (SKIP; a graphed cached weight)
    M, N, Mp,
    SKIP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    if SKIP:
        if tl.load(skip_ptr) != 0:
            return
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    num_tiles = tl.cdiv(Mp, BLOCK_M) * tiles_n
    r = tl.arange(0, BLOCK_M)
    c = tl.arange(0, BLOCK_N)
    for t in range(pid, num_tiles, nprog):
        rows = (t // tiles_n) * BLOCK_M + r  # (BLOCK_M,) rows of src = columns of dst
        cols = (t % tiles_n) * BLOCK_N + c   # (BLOCK_N,) columns of src = rows of dst
        col_ok = (cols < N)[:, None]
        v = tl.load(src_ptr + tl.cast(rows, tl.int64)[None, :] * N + cols[:, None],
                    mask=col_ok & (rows < M)[None, :], other=0)  # (BLOCK_N, BLOCK_M); 0 past row M: padding
        tl.store(dst_ptr + tl.cast(cols, tl.int64)[:, None] * Mp + rows[None, :], v,
                 mask=col_ok & (rows < Mp)[None, :])


@triton.jit
def store_transposed_tile(src_tile, dst_tile, ld_src, ld_dst, r, c, src_rows_ok, col_ok, dst_rows_ok):
    """Inside a kernel that has just stored a (BLOCK_M, BLOCK_N) fp8 tile at src_tile (row
    stride ld_src): write its bytes transposed, (BLOCK_N, BLOCK_M), at dst_tile (row stride
    ld_dst). r (BLOCK_M,) and c (BLOCK_N,) are aranges; src_rows_ok / col_ok mark the tile's
    rows and columns that were stored; dst_rows_ok (BLOCK_M,) the tile rows to write into dst
    (padding rows, stored or not, are written as byte 0).

    The bytes come back from src (an L2 hit) rather than from registers through tl.trans,
    which wrote foreign bytes on the H200 with triton 3.6 (activation._FUSED_TRANSPOSE_ON_CUDA).
    The barrier makes this program's stores visible to all its threads (bar.sync orders
    global memory within a CTA); the load in transposed index order and the row-wise store are
    _transpose_kernel's, whose compiler-made exchange the GPU tests find exact.
    """
    tl.debug_barrier()
    src = src_tile.to(tl.pointer_type(tl.uint8), bitcast=True)
    dst = dst_tile.to(tl.pointer_type(tl.uint8), bitcast=True)
    v = tl.load(src + r[None, :] * ld_src + c[:, None], mask=col_ok[:, None] & src_rows_ok[None, :], other=0,
                cache_modifier=".cg")  # (BLOCK_N, BLOCK_M); .cg: from L2, where the stores went
    tl.store(dst + c[:, None] * ld_dst + r[None, :], v, mask=col_ok[:, None] & dst_rows_ok[None, :])


@functools.lru_cache(maxsize=None)
def _kernel(skip: bool) -> DirectKernel:
    return DirectKernel(_transpose_kernel, num_warps=_WARPS, SKIP=skip, BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N)


def transpose_reference(src: torch.Tensor, dst: torch.Tensor, skip=None) -> None:
    """dst[:, :M] = src.T and dst[:, M:] = 0 (bytes); src (M, N), dst (N, Mp), Mp >= M.
    skip: None, or a () int32 flag; nonzero: do nothing."""
    if skip is not None and bool(skip.item()):
        return
    m = src.shape[0]
    dst[:, :m].copy_(src.t())
    dst[:, m:].view(torch.uint8).zero_()


def transpose_into(src: torch.Tensor, dst: torch.Tensor, skip=None) -> None:
    """transpose_reference, by the Triton kernel on CUDA. src (M, N) and dst (N, Mp) are
    contiguous tensors of one 1-byte dtype on one device; skip as there (read on the device)."""
    if src.dim() != 2 or dst.dim() != 2 or dst.shape[0] != src.shape[1] or dst.shape[1] < src.shape[0]:
        raise ValueError(f"transpose_into: need src (M, N) and dst (N, Mp >= M); got {tuple(src.shape)} and "
                         f"{tuple(dst.shape)}")
    if src.element_size() != 1 or dst.dtype != src.dtype or not (src.is_contiguous() and dst.is_contiguous()) \
            or src.device != dst.device:
        raise ValueError(f"transpose_into: src and dst must be contiguous 1-byte tensors of one dtype and device; "
                         f"got {src.dtype} on {src.device} and {dst.dtype} on {dst.device}")
    m, n = src.shape
    mp = dst.shape[1]
    if not src.is_cuda or m * n == 0 or max(m, n, mp) >= 2**31 // max(_BLOCK_M, _BLOCK_N):
        transpose_reference(src, dst, skip)
        return
    tiles = triton.cdiv(mp, _BLOCK_M) * triton.cdiv(n, _BLOCK_N)
    sms = torch.cuda.get_device_properties(src.device).multi_processor_count
    with device_guard(src.device):
        _kernel(skip is not None)(max(1, min(tiles, _PER_SM * sms)), src.view(torch.uint8), dst.view(torch.uint8),
                                  skip if skip is not None else dst, m, n, mp)
