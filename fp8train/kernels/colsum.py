"""Column sums of float32 partial-sum rows, written in the gradient's dtype: one launch.

Twin: `colsum_reference` below (torch.sum over the rows, one rounding into the output).
The backward kernels with a bias or norm-parameter gradient (activation.act_bwd_fp8 with
dbias, norm.norm_bwd) leave per-program partial sums in a float32 scratch: S sums of P
rows of N columns, (S, P, N). Each sum's rows are reduced and written, rounded once, into
its output of any float dtype, where torch.sum and a copy into a bf16 output took two
launches (three for the norm's dgamma and dbeta). In a graphed training step each of those
tiny launches costs a few microseconds of device time (docs/benchmarks.md, seventh session).

Summation order: per column, blocks of BLOCK_P rows summed as a tree (tl.sum), blocks in
row order. Deterministic for a shape, but not torch.sum's order: results agree with the
twin within float32 rounding of the sum (the tests bound it), not bit for bit.
"""
from __future__ import annotations

import functools
from typing import Sequence

import torch
import triton
import triton.language as tl

from .launcher import DirectKernel, device_guard

_BLOCK_P, _BLOCK_N, _WARPS = 32, 64, 4


@triton.jit
def _colsum_kernel(
    src_ptr,   # (S, P, N) float32, contiguous: S sums of P partial rows
    dst0_ptr,  # (N,) any float dtype: sum 0
    dst1_ptr,  # (N,) any float dtype: sum 1 (TWO)
    P, N,
    TWO: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # One program per (sum, BLOCK_N columns); programs [0, blocks) take sum 0, the rest sum 1.
    pid = tl.program_id(0)
    blocks = tl.cdiv(N, BLOCK_N)
    which = pid // blocks
    cols = (pid - which * blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    r = tl.arange(0, BLOCK_P)
    base = src_ptr + tl.cast(which, tl.int64) * P * N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        rows = p0 + r
        tile = tl.load(base + tl.cast(rows, tl.int64)[:, None] * N + cols[None, :],
                       mask=(rows < P)[:, None] & col_ok[None, :], other=0.0)
        acc += tl.sum(tile, axis=0)
    if TWO:
        if which == 1:
            tl.store(dst1_ptr + cols, acc.to(dst1_ptr.dtype.element_ty), mask=col_ok)
        else:
            tl.store(dst0_ptr + cols, acc.to(dst0_ptr.dtype.element_ty), mask=col_ok)
    else:
        tl.store(dst0_ptr + cols, acc.to(dst0_ptr.dtype.element_ty), mask=col_ok)


@functools.lru_cache(maxsize=None)
def _kernel(two: bool) -> DirectKernel:
    return DirectKernel(_colsum_kernel, num_warps=_WARPS, TWO=two, BLOCK_P=_BLOCK_P, BLOCK_N=_BLOCK_N)


def _check(src: torch.Tensor, outs: Sequence[torch.Tensor]) -> None:
    if src.dtype != torch.float32 or src.dim() != 3 or not src.is_contiguous():
        raise ValueError(f"colsum: need a contiguous float32 (S, P, N) scratch, got {src.dtype} "
                         f"{tuple(src.shape)}{'' if src.is_contiguous() else ' (not contiguous)'}")
    if len(outs) != src.shape[0] or len(outs) not in (1, 2):
        raise ValueError(f"colsum: {src.shape[0]} sums need as many outputs (1 or 2), got {len(outs)}")
    for out in outs:
        if out.shape != (src.shape[2],) or not out.is_floating_point() or not out.is_contiguous() \
                or out.device != src.device:
            raise ValueError(f"colsum: each output must be a contiguous ({src.shape[2]},) float tensor on "
                             f"{src.device}, got {out.dtype} {tuple(out.shape)} on {out.device}")


def colsum_reference(src: torch.Tensor, outs: Sequence[torch.Tensor]) -> None:
    """outs[s] = src[s].sum(dim=0), summed in float32, rounded once into outs[s]'s dtype."""
    _check(src, outs)
    for s, out in enumerate(outs):
        out.copy_(src[s].sum(dim=0))


def colsum_into(src: torch.Tensor, outs: Sequence[torch.Tensor]) -> None:
    """colsum_reference by the Triton kernel (CUDA, or the interpreter: the launch code of the
    backward kernels calls it for their scratch). P = 0 writes zeros."""
    _check(src, outs)
    n = src.shape[2]
    if n == 0:
        return
    with device_guard(src.device):
        _kernel(len(outs) == 2)(len(outs) * triton.cdiv(n, _BLOCK_N), src, outs[0], outs[-1], src.shape[1], n)


def native_spec(partial: torch.Tensor, dtype: torch.dtype = torch.float32):
    """The column sums of `partial` (rows, N) float32 into an (N,) output of `dtype`, as
    kernels.native.Launch arguments whose one hole (index 0) is that output, and the fixed
    tensors they point into: the C++ cast plans' dbias (csrc/linear_node.cpp `cast`), the
    launch colsum_into makes for `partial[None]`. None where the launch must go through
    Triton (launcher.DirectKernel.binary_for)."""
    from . import native
    n = partial.shape[1]
    out = torch.empty(n, dtype=dtype, device=partial.device)  # stands for each call's dbias
    args = (partial[None], out, out, partial.shape[0], n)
    binary = _kernel(False).binary_for(*args)
    if binary is None:
        return None
    return native.launch_spec(binary, triton.cdiv(n, _BLOCK_N), args, holes=(out,))


__all__ = ["colsum_into", "colsum_reference", "native_spec"]
