"""Triton LayerNorm / RMSNorm kernels: forward straight into FP8 (+ transposed copy, amax), backward.

Twins: norm_reference.norm_stats, norm_fwd_fp8, norm_bwd (the specification, with the
contracts documented there; the GPU tests compare within float32 tolerances, since the
kernels sum rows in another order than torch). Scale conventions: fp8train/scaling.py.

Two kernels serve the three wrappers, both on persistent 1-D grids (a small multiple of the
SM count) whose programs take blocks of BLOCK_M rows in turn and loop over K in chunks of
BLOCK_N columns, so any K >= 1 works:
  _norm_fwd_kernel  loop 1: the row statistics (mean, M2 merged chunk by chunk with Chan's
                    formula: one read, no cancellation), or their load when STATS_READY;
                    loop 2: y, then any of the fp8 cast (+ the tile transposed into out_t,
                    through shared memory), y_out, the amax. norm_stats is this kernel
                    without the cast, and without loop 2 unless it wants the amax.
  _norm_bwd_kernel  loop 1: the per-row sums of g and g * xhat; loop 2: dx, and the column
                    sums for dweight / dbias into this program's row of a (P, K) scratch,
                    which the wrapper reduces with torch.sum (deterministic: no atomics).
Loop 2 re-reads x right after loop 1 read it, and walks K backwards, so that it starts with
the chunks read last: the second read comes from L1 when a step holds a whole row (the row
configs up to K = 4096) and mostly from L2 otherwise. The cast's amax costs one atomic max
per program, as in cast.py.

On CUDA the transposed copy is written from out's bytes after the row kernel by
kernels/transpose.py (_FUSED_TRANSPOSE_ON_CUDA says why); the interpreter runs the tile
kernel (TileConfig), which writes each tile of out and then its bytes transposed into out_t,
reloaded from L2 (transpose.store_transposed_tile).

Why two loops over one row block for the transposed copy (TileConfig): a tile of out_t needs
the statistics of its BLOCK_M rows over the whole K before it can be written, and those rows
do not fit on chip. The alternative, a stats launch and then cast.py-style 2-D tiles over
the whole tensor, reads x twice from DRAM and adds a launch; here the second read follows
the first within one program, so much of it hits L2 (all of it when every resident
program's 32 rows fit: 32 x K x 2 bytes x 264 programs = 34 MB at K = 2048, bf16). The
price: M / 32 work items rather than 2-D tiles, and a grid that is small for small M.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ContextManager, Optional, Tuple

import torch
import triton
import triton.language as tl

from .. import scaling
from . import norm_reference
from .cast import _abs_bits, _amax_of_bits, _resolve_scale, _saturate, _sm_count
from .colsum import colsum_into
from .launcher import DirectKernel, LaunchOverride, device_guard, scratch
from .norm_reference import check_bwd_args, check_fwd_args, check_stats_args
from .transpose import store_transposed_tile, transpose_into

# --------------------------------------------------------------------------- launch shapes


def _power_of_two(name: str, v: int) -> None:
    if v < 1 or v & (v - 1):
        raise ValueError(f"norm launch config: {name} must be a power of two >= 1; got {v}")


@dataclass(frozen=True)
class RowConfig:
    """Launch shape of a row-block kernel: loop steps of block_m rows x block_n columns."""

    block: int            # elements per loop step, block_m * block_n (as far as K allows)
    max_block_n: int      # rows up to this long: a whole row per step, as many rows as fit in block
    long_block_m: int     # longer rows: steps of long_block_m rows x (block // long_block_m) columns
    num_warps: int
    programs_per_sm: int  # grid = min(row blocks, programs_per_sm * SMs); keep <= occupancy

    def __post_init__(self):
        for name in ("block", "max_block_n", "long_block_m", "num_warps"):
            _power_of_two(name, getattr(self, name))
        if self.long_block_m > self.block:
            raise ValueError(f"norm launch config: long_block_m {self.long_block_m} > block {self.block}")

    def shape(self, k: int) -> Tuple[int, int]:
        """(block_m, block_n) for rows of k elements."""
        block_n = triton.next_power_of_2(k)
        if block_n <= self.max_block_n:
            return max(1, self.block // block_n), block_n
        return self.long_block_m, self.block // self.long_block_m


@dataclass(frozen=True)
class TileConfig:
    """Launch shape of norm_fwd_fp8 with a transposed copy: rows in blocks of block_m, 2-D tiles."""

    block_m: int          # tile rows: a run of block_m contiguous bytes in each out_t row
    block_n: int          # tile columns: a run of block_n contiguous bytes in each out row
    num_warps: int
    programs_per_sm: int  # grid = min(row blocks, programs_per_sm * SMs)

    def __post_init__(self):
        for name in ("block_m", "block_n", "num_warps"):
            _power_of_two(name, getattr(self, name))


@dataclass(frozen=True)
class NormConfigs:
    rows: RowConfig       # norm_stats; norm_fwd_fp8 without out_t
    tiles: TileConfig     # norm_fwd_fp8 with out_t
    bwd: RowConfig        # norm_bwd, rows up to bwd.max_block_n long
    wide_bwd: RowConfig   # norm_bwd, longer rows
    narrow_bwd: Optional[RowConfig] = None  # norm_bwd, rows up to narrow_bwd.max_block_n long (before bwd)

    def bwd_for(self, k: int) -> RowConfig:
        """The backward's launch shape for rows of k elements."""
        n = triton.next_power_of_2(k)
        if self.narrow_bwd is not None and n <= self.narrow_bwd.max_block_n:
            return self.narrow_bwd
        return self.bwd if n <= self.bwd.max_block_n else self.wide_bwd


_override = LaunchOverride()  # NormConfigs or None


def launch_configs(device: torch.device) -> NormConfigs:
    """The launch shapes every wrapper uses on `device`.

    Hopper: measured by benchmarks/norm.py --variants (H200, triton 3.6, 2026-11-29; LayerNorm,
    bf16 in, M x K = 4096x1024, 8192x4096, 8192x8192; docs/benchmarks.md). Forward rows:
    steps of 4096 elements over 4 warps, 4 programs per SM, 14-17% faster than 8 warps x 3
    at K >= 4096. Tiles (the in-kernel transposed copy, _FUSED_TRANSPOSE_ON_CUDA) of 32 x 128
    over 8 warps, 2 per SM (whole 32-byte sectors of out_t, 128-byte runs of out) won over 7
    other tile shapes at every size. The backward keeps a
    whole row's column sums in registers: up to K = 4096 steps of 4096 elements over 8 warps
    (2 per SM); up to 8192 one row per step over 16 warps (1 per SM), 2.8x faster at K = 8192
    than steps of 4 rows x 1024 with a read-modify-write of the scratch row in L2, which
    longer rows still take. Rows up to K = 1024 (2026-11-30): the same 4096-element steps
    over 4 warps, 4 per SM. In the graphed small-MLP step (4096 x 1024, benchmarks/small.py's
    profile) the backward went from 28 to 10 us and the two colsum launches, now reducing
    twice as many scratch rows, from 11 to 19 us: 10 us saved. At 4096 x 512 0.038 -> 0.033
    ms; at K = 4096 the shape lost (0.092 -> 0.115 ms), at 2048 the shapes were within the
    noise (standalone timings of these small launches moved by up to 2x between runs).
    """
    if _override.value is not None:
        return _override.value
    return _default_configs(device.type)


@functools.lru_cache(maxsize=None)
def _default_configs(device_type: str) -> NormConfigs:
    if device_type == "cuda":
        return NormConfigs(
            rows=RowConfig(block=4096, max_block_n=4096, long_block_m=1, num_warps=4, programs_per_sm=4),
            tiles=TileConfig(block_m=32, block_n=128, num_warps=8, programs_per_sm=2),
            bwd=RowConfig(block=4096, max_block_n=4096, long_block_m=4, num_warps=8, programs_per_sm=2),
            wide_bwd=RowConfig(block=8192, max_block_n=8192, long_block_m=4, num_warps=16, programs_per_sm=1),
            narrow_bwd=RowConfig(block=4096, max_block_n=1024, long_block_m=4, num_warps=4, programs_per_sm=4))
    # Triton interpreter on CPU: small steps, so that small test shapes run several row
    # blocks per program, several chunks per row, tail chunks and partial tiles; the backward
    # takes K = 48 whole with wide_bwd and K = 100 in chunks.
    small = RowConfig(block=64, max_block_n=32, long_block_m=4, num_warps=4, programs_per_sm=1)
    return NormConfigs(rows=small, tiles=TileConfig(block_m=8, block_n=16, num_warps=4, programs_per_sm=1), bwd=small,
                       wide_bwd=RowConfig(block=128, max_block_n=64, long_block_m=4, num_warps=4, programs_per_sm=1))


def override_configs(configs: NormConfigs) -> ContextManager[None]:
    """Use other launch shapes inside the block (benchmark variants, tests); not thread-safe."""
    return _override.using(configs)


def _programs(work_items: int, programs_per_sm: int, device: torch.device) -> int:
    return max(1, min(work_items, programs_per_sm * _sm_count(device)))


@functools.lru_cache(maxsize=None)
def _direct(fn, num_warps: int, constexprs: Tuple[Tuple[str, object], ...]) -> DirectKernel:
    return DirectKernel(fn, num_warps=num_warps, **dict(constexprs))


# --------------------------------------------------------------------------- device code


@triton.jit
def _row_stats(x_rows, row_ok, K, EPS: tl.constexpr, LAYER: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(mean, rstd) float32 (BLOCK_M,) of the rows starting at x_rows (BLOCK_M, 1) pointers.

    LayerNorm: each chunk's mean and sum of squared deviations (exact two-pass inside the
    chunk), merged into the running ones (Chan et al.):
        n = na + nb,  d = mean_b - mean_a,  mean = mean_a + d * nb / n,
        M2 = M2_a + M2_b + d^2 * na * nb / n.
    RMSNorm: the sum of squares (mean returned as zeros).
    """
    c = tl.arange(0, BLOCK_N)
    mean = tl.zeros([BLOCK_M], dtype=tl.float32)
    m2 = tl.zeros([BLOCK_M], dtype=tl.float32)  # LayerNorm: M2; RMSNorm: sum of x^2
    for k0 in range(0, K, BLOCK_N):
        cols = k0 + c
        mask = row_ok[:, None] & (cols < K)[None, :]
        x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)  # (BLOCK_M, BLOCK_N)
        if LAYER:
            na = tl.cast(k0, tl.float32)  # tl.cast: k0 is a Python int in the interpreter
            nb = tl.cast(tl.minimum(K - k0, BLOCK_N), tl.float32)
            mean_b = tl.sum(x, axis=1) / nb
            dev = tl.where(mask, x - mean_b[:, None], 0.0)
            delta = mean_b - mean
            n = na + nb
            mean = mean + delta * (nb / n)
            m2 = m2 + tl.sum(dev * dev, axis=1) + delta * delta * (na * nb / n)
        else:
            m2 = m2 + tl.sum(x * x, axis=1)
    var = m2 / tl.cast(K, tl.float32)
    rstd = tl.math.div_rn(1.0, tl.sqrt_rn(var + EPS))  # IEEE 1 / sqrt, as torch.rsqrt on CPU
    return mean, rstd


@triton.jit
def _norm_fwd_kernel(
    x_ptr,          # (M, K) bf16/fp16/fp32 input, unit column stride, row stride stride_xm
    w_ptr,          # (K,) gamma, bf16/fp16/fp32
    b_ptr,          # (K,) beta, bf16/fp16/fp32 (HAS_BIAS)
    mean_ptr,       # (M,) float32 row means: written, or read when STATS_READY (LAYER)
    rstd_ptr,       # (M,) float32 1 / sqrt(var + eps): written, or read when STATS_READY
    out_ptr,        # (M, K) fp8 output, row-major (CAST)
    out_t_ptr,      # (K, Mp) fp8 transposed copy, row-major; columns M..Mp-1 get zeros (TRANSPOSE)
    y_ptr,          # (M, K) x.dtype normalized output, row-major (STORE_Y)
    scale_ptr,      # () float32 scale: read; set from from_amax by program 0 (FROM_AMAX)
    scale_inv_ptr,  # () float32 output 1/scale, written by program 0 (CAST)
    amax_ptr,       # () float32 running amax of y: one atomic max per program (AMAX)
    from_amax_ptr,  # () float32 amax the scale is computed from (FROM_AMAX)
    count_ptr,      # () int32 nonfinite count, +1 when from_amax is inf/NaN (COUNT)
    M, K, Mp, stride_xm,
    EPS: tl.constexpr, FP8_MAX: tl.constexpr, LAYER: tl.constexpr, HAS_BIAS: tl.constexpr,
    STATS_READY: tl.constexpr, CAST: tl.constexpr, TRANSPOSE: tl.constexpr, STORE_Y: tl.constexpr,
    AMAX: tl.constexpr, FROM_AMAX: tl.constexpr, COUNT: tl.constexpr, POW2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    if CAST:
        scale = _resolve_scale(scale_ptr, scale_inv_ptr, from_amax_ptr, count_ptr, FP8_MAX, FROM_AMAX, COUNT, POW2)
    if TRANSPOSE:
        rows_covered = Mp  # blocks past row M write out_t's zero padding
    else:
        rows_covered = M
    r = tl.arange(0, BLOCK_M)
    c = tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M], dtype=tl.int32)  # per-row maxima of _abs_bits(y)
    for blk in range(pid, tl.cdiv(rows_covered, BLOCK_M), nprog):
        rows = blk * BLOCK_M + r
        row_ok = rows < M
        rows64 = rows.to(tl.int64)
        x_rows = x_ptr + rows64[:, None] * stride_xm  # (BLOCK_M, 1)
        if STATS_READY:
            rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
            mean = tl.zeros([BLOCK_M], dtype=tl.float32)
            if LAYER:
                mean = tl.load(mean_ptr + rows, mask=row_ok, other=0.0)
        else:
            mean, rstd = _row_stats(x_rows, row_ok, K, EPS, LAYER, BLOCK_M, BLOCK_N)
            tl.store(rstd_ptr + rows, rstd, mask=row_ok)
            if LAYER:
                tl.store(mean_ptr + rows, mean, mask=row_ok)
        if CAST or AMAX or STORE_Y:
            n_chunks = tl.cdiv(K, BLOCK_N)
            for i in range(n_chunks):
                k0 = (n_chunks - 1 - i) * BLOCK_N  # backwards: the chunks loop 1 read last are the likeliest in L2
                cols = k0 + c
                col_ok = cols < K
                mask = row_ok[:, None] & col_ok[None, :]
                x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
                if LAYER:
                    xhat = (x - mean[:, None]) * rstd[:, None]  # norm_reference.normalize's order
                else:
                    xhat = x * rstd[:, None]
                if HAS_BIAS:  # one rounding, as the twin's fma (the compiler would fuse y = xhat * w + b anyway)
                    b = tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
                    y = tl.math.fma(xhat, w[None, :], b[None, :])
                else:
                    y = xhat * w[None, :]
                if AMAX:  # masked elements hold b or NaN (rows past M): keep them out
                    acc = tl.maximum(acc, tl.max(_abs_bits(tl.where(mask, y, 0.0)), axis=1))
                row_major = rows64[:, None] * K + cols[None, :]  # (BLOCK_M, BLOCK_N) into out / y_out
                if STORE_Y:
                    tl.store(y_ptr + row_major, y.to(y_ptr.dtype.element_ty), mask=mask)
                if CAST:
                    y8 = _saturate(y, scale, FP8_MAX)
                    if TRANSPOSE:
                        y8 = tl.where(row_ok[:, None], y8, 0.0)  # padding: +0.0 is byte 0x00
                    q = y8.to(out_ptr.dtype.element_ty)
                    tl.store(out_ptr + row_major, q, mask=mask)
                    if TRANSPOSE:  # the bytes just stored, back from L2 in transposed order (rows past M: 0)
                        row0 = blk * BLOCK_M
                        store_transposed_tile(out_ptr + tl.cast(row0, tl.int64) * K + k0,
                                              out_t_ptr + tl.cast(k0, tl.int64) * Mp + row0, K, Mp, r, c, row_ok,
                                              col_ok, rows < Mp)
    if AMAX:
        tl.atomic_max(amax_ptr, _amax_of_bits(acc))


@triton.jit
def _norm_bwd_kernel(
    dy_ptr,         # (M, K) bf16/fp16/fp32 gradient of y, unit column stride, row stride stride_dym
    x_ptr,          # (M, K) forward input, unit column stride, row stride stride_xm
    w_ptr,          # (K,) gamma, bf16/fp16/fp32
    mean_ptr,       # (M,) float32 row means of the forward (LAYER)
    rstd_ptr,       # (M,) float32 row rstd of the forward
    dx_ptr,         # (M, K) x.dtype gradient of x, row-major
    part_ptr,       # (2 if HAS_DBIAS else 1, P, K) float32: [0, p] = program p's column sums of dy * xhat,
                    #   [1, p] those of dy; zeroed by the wrapper unless ONE_CHUNK (then fully written)
    M, K, stride_dym, stride_xm,
    LAYER: tl.constexpr, HAS_DBIAS: tl.constexpr, ONE_CHUNK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    r = tl.arange(0, BLOCK_M)
    c = tl.arange(0, BLOCK_N)
    part_w = part_ptr + tl.cast(pid, tl.int64) * K  # (K,) this program's row of the dweight partials
    part_b = part_w + tl.cast(nprog, tl.int64) * K  # (K,) and of the dbias partials (HAS_DBIAS)
    acc_w = tl.zeros([BLOCK_N], dtype=tl.float32)   # ONE_CHUNK: the partials stay in registers
    acc_b = tl.zeros([BLOCK_N], dtype=tl.float32)
    k_f = tl.cast(K, tl.float32)
    for blk in range(pid, tl.cdiv(M, BLOCK_M), nprog):
        rows = blk * BLOCK_M + r
        row_ok = rows < M
        rows64 = rows.to(tl.int64)
        x_rows = x_ptr + rows64[:, None] * stride_xm     # (BLOCK_M, 1)
        dy_rows = dy_ptr + rows64[:, None] * stride_dym  # (BLOCK_M, 1)
        rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
        mean = tl.zeros([BLOCK_M], dtype=tl.float32)
        if LAYER:
            mean = tl.load(mean_ptr + rows, mask=row_ok, other=0.0)
        # Loop 1: per-row sums of g and g * xhat.
        s_g = tl.zeros([BLOCK_M], dtype=tl.float32)
        s_gx = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_N):
            cols = k0 + c
            mask = row_ok[:, None] & (cols < K)[None, :]
            xhat, g, dy = _xhat_g(x_rows, dy_rows, w_ptr, cols, mask, mean, rstd, K, LAYER)
            s_g += tl.sum(g, axis=1)
            s_gx += tl.sum(g * xhat, axis=1)
        c_g = s_g / k_f    # mean_K(g)
        c_gx = s_gx / k_f  # mean_K(g * xhat)
        # Loop 2: dx, and the column sums of this row block; backwards, as in _norm_fwd_kernel.
        n_chunks = tl.cdiv(K, BLOCK_N)
        for i in range(n_chunks):
            k0 = (n_chunks - 1 - i) * BLOCK_N
            cols = k0 + c
            col_ok = cols < K
            mask = row_ok[:, None] & col_ok[None, :]
            xhat, g, dy = _xhat_g(x_rows, dy_rows, w_ptr, cols, mask, mean, rstd, K, LAYER)
            if LAYER:
                dx = (g - c_g[:, None] - xhat * c_gx[:, None]) * rstd[:, None]
            else:
                dx = (g - xhat * c_gx[:, None]) * rstd[:, None]
            tl.store(dx_ptr + rows64[:, None] * K + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
            col_w = tl.sum(dy * xhat, axis=0)  # (BLOCK_N,)
            col_b = tl.sum(dy, axis=0)
            if ONE_CHUNK:
                acc_w += col_w
                acc_b += col_b
            else:  # this program's own row of the scratch: no other program touches it
                tl.store(part_w + cols, tl.load(part_w + cols, mask=col_ok) + col_w, mask=col_ok)
                if HAS_DBIAS:
                    tl.store(part_b + cols, tl.load(part_b + cols, mask=col_ok) + col_b, mask=col_ok)
    if ONE_CHUNK:
        tl.store(part_w + c, acc_w, mask=c < K)
        if HAS_DBIAS:
            tl.store(part_b + c, acc_b, mask=c < K)


@triton.jit
def _xhat_g(x_rows, dy_rows, w_ptr, cols, mask, mean, rstd, K, LAYER: tl.constexpr):
    """xhat, g = dy * weight and dy (float32, (BLOCK_M, BLOCK_N)), all 0 where masked."""
    x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
    if LAYER:
        xhat = (x - mean[:, None]) * rstd[:, None]
    else:
        xhat = x * rstd[:, None]
    xhat = tl.where(mask, xhat, 0.0)  # masked columns would hold -mean * rstd (NaN for a NaN row)
    return xhat, dy * w[None, :], dy


# --------------------------------------------------------------------------- host wrappers


# Whether norm_fwd_fp8 writes out_t from inside the kernel on CUDA (TileConfig, with
# transpose.store_transposed_tile: each tile's bytes reloaded from out, in L2, in transposed
# order); otherwise the row kernel writes out and transpose.py copies its transposed bytes.
# Off: measured slower where the norm costs most. The in-kernel route is exact on the H200
# (GPU tests, 2026-11-29) but took 0.090 against 0.086 ms at 8192 x 4096 and 0.170 against
# 0.158 ms at 8192 x 8192 for the row kernel (4 warps x 4 per SM) plus the copy
# (benchmarks/norm.py, docs/benchmarks.md). The first in-kernel route, tl.trans of the
# register tile, wrote foreign bytes into out_t on sm_90 with triton 3.6 for bf16 and fp16
# inputs whenever the kernel also computed the statistics (triton-lang/triton#11111).
_FUSED_TRANSPOSE_ON_CUDA = False


def norm_stats(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float,
               mean_out: Optional[torch.Tensor], rstd_out: torch.Tensor,
               amax_out: Optional[torch.Tensor] = None) -> None:
    """norm_reference.norm_stats on the GPU (same contract; see there)."""
    check_stats_args("norm_stats", x, weight, bias, eps, mean_out, rstd_out, amax_out)
    if x.shape[0] == 0:
        norm_reference.norm_stats(x, weight, bias, eps, mean_out, rstd_out, amax_out)
        return
    _launch_fwd(x, weight, bias, eps, mean_out, rstd_out, None, None, None, None, amax_out, None, None, None,
                stats_ready=False, power_of_two=False)


def norm_fwd_fp8(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float,
                 mean_out: Optional[torch.Tensor], rstd_out: torch.Tensor, out: torch.Tensor,
                 out_t: Optional[torch.Tensor], scale: torch.Tensor, scale_inv_out: torch.Tensor,
                 amax_out: Optional[torch.Tensor] = None, from_amax: Optional[torch.Tensor] = None,
                 nonfinite_count: Optional[torch.Tensor] = None, y_out: Optional[torch.Tensor] = None,
                 stats_ready: bool = False, power_of_two: bool = False) -> None:
    """norm_reference.norm_fwd_fp8 on the GPU (same contract; see there)."""
    check_fwd_args("norm_fwd_fp8", x, weight, bias, eps, mean_out, rstd_out, out, out_t, scale, scale_inv_out,
                   amax_out, from_amax, nonfinite_count, y_out)
    m = x.shape[0]
    if m == 0:
        norm_reference.norm_fwd_fp8(x, weight, bias, eps, mean_out, rstd_out, out, out_t, scale, scale_inv_out,
                                    amax_out, from_amax, nonfinite_count, y_out, stats_ready, power_of_two)
        return
    args = (x, weight, bias, eps, mean_out, rstd_out, out)
    scalars = (scale, scale_inv_out, amax_out, from_amax, nonfinite_count, y_out)
    if out_t is not None and x.is_cuda and not (_FUSED_TRANSPOSE_ON_CUDA and x.dtype != torch.float32):
        # The row-major kernel, then kernels/transpose.py: see _FUSED_TRANSPOSE_ON_CUDA.
        _launch_fwd(*args, None, *scalars, stats_ready=stats_ready, power_of_two=power_of_two)
        transpose_into(out, out_t)
        return
    _launch_fwd(*args, out_t, *scalars, stats_ready=stats_ready, power_of_two=power_of_two)


def norm_fwd(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float,
             mean_out: Optional[torch.Tensor], rstd_out: torch.Tensor, y_out: torch.Tensor) -> None:
    """norm_reference.norm_fwd on the GPU (same contract; see there): norm_fwd_fp8's kernel
    without the cast, with the row-major launch shape of norm_stats."""
    norm_reference.check_stats_args("norm_fwd", x, weight, bias, eps, mean_out, rstd_out, None)
    norm_reference.check_y_out("norm_fwd", x, y_out)
    if x.shape[0] == 0:
        norm_reference.norm_fwd(x, weight, bias, eps, mean_out, rstd_out, y_out)
        return
    _launch_fwd(x, weight, bias, eps, mean_out, rstd_out, None, None, None, None, None, None, None, y_out,
                stats_ready=False, power_of_two=False)


def norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mean: Optional[torch.Tensor],
             rstd: torch.Tensor, dx_out: torch.Tensor, dweight_out: torch.Tensor,
             dbias_out: Optional[torch.Tensor] = None) -> None:
    """norm_reference.norm_bwd on the GPU (same contract; see there).

    Allocates a (1 or 2, P, K) float32 scratch for the per-program column sums (P = grid size,
    a small multiple of the SM count), reduced by colsum.colsum_into: deterministic for a device.
    """
    check_bwd_args("norm_bwd", dy, x, weight, mean, rstd, dx_out, dweight_out, dbias_out)
    m, k = x.shape
    if m == 0:
        norm_reference.norm_bwd(dy, x, weight, mean, rstd, dx_out, dweight_out, dbias_out)
        return
    cfg = launch_configs(x.device).bwd_for(k)
    block_m, block_n = cfg.shape(k)
    programs = _programs(triton.cdiv(m, block_m), cfg.programs_per_sm, x.device)
    one_chunk = block_n >= k
    # chunked rows add into their programs' scratch rows: zeroed first
    parts = scratch((1 if dbias_out is None else 2, programs, k), x.device, zeroed=not one_chunk)
    kernel = _direct(_norm_bwd_kernel, cfg.num_warps, (
        ("LAYER", mean is not None), ("HAS_DBIAS", dbias_out is not None), ("ONE_CHUNK", one_chunk),
        ("BLOCK_M", block_m), ("BLOCK_N", block_n)))
    with device_guard(x.device):
        kernel(programs, dy, x, weight, rstd if mean is None else mean, rstd, dx_out, parts,
               m, k, _row_stride(dy), _row_stride(x))
        # dgamma (and dbeta) from the programs' partial sums, in their dtypes: one launch
        colsum_into(parts, (dweight_out,) if dbias_out is None else (dweight_out, dbias_out))


def _launch_fwd(x, weight, bias, eps, mean_out, rstd_out, out, out_t, scale, scale_inv_out, amax_out, from_amax,
                nonfinite_count, y_out, stats_ready: bool, power_of_two: bool) -> None:
    """Launch _norm_fwd_kernel; absent optional tensors are flagged off (and never touched)."""
    m, k = x.shape
    cast = out is not None
    cfgs = launch_configs(x.device)
    if out_t is None:
        block_m, block_n = cfgs.rows.shape(k)
        num_warps, per_sm = cfgs.rows.num_warps, cfgs.rows.programs_per_sm
    else:
        block_m, block_n = cfgs.tiles.block_m, cfgs.tiles.block_n
        num_warps, per_sm = cfgs.tiles.num_warps, cfgs.tiles.programs_per_sm
    mp = m if out_t is None else out_t.shape[1]
    programs = _programs(triton.cdiv(mp, block_m), per_sm, x.device)
    kernel = _direct(_norm_fwd_kernel, num_warps, (
        ("EPS", float(eps)), ("FP8_MAX", scaling.fp8_max(out.dtype) if cast else 0.0),
        ("LAYER", mean_out is not None), ("HAS_BIAS", bias is not None), ("STATS_READY", bool(stats_ready)),
        ("CAST", cast), ("TRANSPOSE", out_t is not None), ("STORE_Y", y_out is not None),
        ("AMAX", amax_out is not None), ("FROM_AMAX", from_amax is not None),
        ("COUNT", from_amax is not None and nonfinite_count is not None),
        ("POW2", bool(power_of_two) and from_amax is not None), ("BLOCK_M", block_m), ("BLOCK_N", block_n)))
    either = lambda t: rstd_out if t is None else t  # stands in for unused pointer arguments
    with device_guard(x.device):
        kernel(programs, x, weight, either(bias), either(mean_out), rstd_out, either(out), either(out_t),
               either(y_out), either(scale), either(scale_inv_out), either(amax_out), either(from_amax),
               either(nonfinite_count), m, k, mp, _row_stride(x))


def _row_stride(t: torch.Tensor) -> int:
    return t.stride(0) if t.shape[0] > 1 else t.shape[1]
