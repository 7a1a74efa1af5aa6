"""Triton cast kernels: high precision -> FP8 (+ transposed copy) with the amax, in one pass.

Twins: reference.amax, reference.cast_amax, reference.cast_transpose_amax (the
specification; the GPU tests compare bit for bit). Scale conventions: fp8train/scaling.py.

Two kernels serve the three wrappers:
  _flat_kernel   contiguous x as one flat range: a persistent grid-stride loop over
                 blocks, 16-byte vector loads, one atomic amax per program.
  _tile_kernel   x as (rows, cols) with any row stride: a persistent loop over 2-D tiles;
                 with TRANSPOSE it also writes each tile transposed (through shared memory;
                 a float32 tile from its stored bytes, see _plan) into out_t and fills
                 out_t's padding columns with zeros; with DBIAS it writes each tile's column
                 sums (float32) into a partial-sum buffer that one colsum launch reduces
                 (kernels/colsum.py): the bias gradient of a grad-output cast, from the same read.
Every program takes part in the amax with a single `atomic_max` at its end, so a cast
costs (programs) atomics, a small multiple of the SM count, not one per block.

OWN_AMAX (current scaling in one launch, `PreparedCast(own_amax=True)`): each program first
reduces the amax of its share of x and stores it in a partial-amax slot of its own; the
programs meet at a grid-wide barrier (`_grid_sync`); then every program reduces the partials,
computes the scale and casts. The launch is cooperative, so the driver guarantees that every
program is resident at once (else it refuses the launch: no program can wait forever). It
replaces a zero fill, an amax launch and the cast launch: two fewer host calls per cast.

The cast itself (`_saturate`): y = float32(x) * scale, clamped to [-fp8_max, fp8_max] with
NaN kept, then converted with round-to-nearest-even; on Hopper that conversion is the
`cvt.rn.satfinite` instruction and rounds exactly like torch.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ContextManager, Optional, Tuple

import torch
import triton
import triton.language as tl

from .. import scaling
from . import native, reference
from .colsum import colsum_into
from .checks import FP8_DTYPES, check_dbias, check_fp8_out, check_fp8_outputs, check_scalar, check_scales
from .launcher import DirectKernel, LaunchOverride, hooks_installed, resident_programs
from .launcher import device_guard as _device_guard
from .scale_update import _FLT_MAX, compute_scale
from .transpose import store_transposed_tile

_INF_BITS: tl.constexpr = tl.constexpr(0x7F800000)  # float32 +inf as int32
_ROWS_BLOCK: tl.constexpr = tl.constexpr(1024)  # rows_amax entries one program loads per step
_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_FP8_MAX = {dtype: scaling.fp8_max(dtype) for dtype in FP8_DTYPES}


# --------------------------------------------------------------------------- launch shapes


@dataclass(frozen=True)
class FlatConfig:
    """Launch shape of `_flat_kernel` (contiguous inputs)."""

    block: int            # elements one program handles per loop step
    num_warps: int
    programs_per_sm: int  # grid = min(blocks, programs_per_sm * SMs); keep <= occupancy


@dataclass(frozen=True)
class TileConfig:
    """Launch shape of `_tile_kernel` (row-strided inputs, transposed copies)."""

    block_m: int          # tile rows of x: a run of block_m contiguous bytes in each out_t row
    block_n: int          # tile columns of x: a run of block_n contiguous bytes in each out row
    num_warps: int
    programs_per_sm: int  # grid = min(tiles, programs_per_sm * SMs); keep <= occupancy


_override = LaunchOverride()  # (FlatConfig, TileConfig) or None


def launch_configs(device: torch.device) -> Tuple[FlatConfig, TileConfig]:
    """The launch shapes every wrapper uses on `device` (benchmarks/cast.py --variants compares others).

    Hopper: a flat step of 4096 elements over 8 warps gives each thread 16 contiguous
    elements (two 16-byte loads of bf16, one 16-byte fp8 store). Compiled for sm_90 that
    kernel uses <= 48 registers in every variant (triton 3.6 and 3.9), so 4 programs of 256
    threads always fit on an SM: one wave, ~32 KiB of loads in flight per SM. A 128x64 tile
    stores 64-byte runs into out and 128-byte runs into out_t (whole 32-byte sectors); for
    bf16 input it needs ~63 registers, so 3 programs per SM fit (float32 inputs need up to
    117 and run a short second wave). Keep programs_per_sm at or below the "fit" the
    benchmark prints for the dtype that matters.
    """
    if _override.value is not None:
        return _override.value
    return _default_configs(device.type)


@functools.lru_cache(maxsize=None)
def _default_configs(device_type: str) -> Tuple[FlatConfig, TileConfig]:
    if device_type == "cuda":
        # Measured on the H200 (benchmarks/cast.py --variants, 2026-11-29): flat configs within
        # noise of each other at 94-96% of copy bandwidth; 128x64 tiles x 3 per SM gave 85%
        # for cast+transpose against 76% for 64x128 x 2.
        return FlatConfig(block=4096, num_warps=8, programs_per_sm=4), \
            TileConfig(block_m=128, block_n=64, num_warps=8, programs_per_sm=3)
    # Triton interpreter on CPU: small blocks so that small test shapes run several loop
    # steps per program, a tail block and partial edge tiles.
    return FlatConfig(block=64, num_warps=4, programs_per_sm=1), \
        TileConfig(block_m=16, block_n=32, num_warps=4, programs_per_sm=1)


def override_configs(flat: FlatConfig, tile: TileConfig) -> ContextManager[None]:
    """Use other launch shapes inside the block (benchmark variants, tests); not thread-safe."""
    return _override.using((flat, tile))


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 3  # interpreter: a few programs, so the grid-stride loops really stride


def _grid(work_items: int, programs_per_sm: int, device: torch.device) -> int:
    """Programs of a persistent 1-D grid: enough for the work, at most programs_per_sm per SM.
    In fp8train::cast_kernels' trace work_items is symbolic where the token count is: Python's
    max and min would guard on it, and a compiled HF Llama recompiled for every batch of 64
    or fewer tokens per sequence once it had gone dynamic; torch.sym_max / sym_min do not
    (eager calls keep Python's, ~2 us cheaper)."""
    cap = programs_per_sm * _sm_count(device)
    if type(work_items) is int:
        return max(1, min(work_items, cap))
    return torch.sym_max(1, torch.sym_min(work_items, cap))


# --------------------------------------------------------------------------- device code


@triton.jit
def _saturate(x, scale, FP8_MAX: tl.constexpr):
    """x * scale (float32) clamped to [-FP8_MAX, FP8_MAX], NaN kept (as torch's clamp keeps it).

    With NaN propagation Triton emits a single `min.NaN.xorsign.abs` for this symmetric clamp;
    the default tl.maximum / tl.minimum would drop NaN instead.
    """
    return tl.clamp(x * scale, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _abs_bits(x):
    """|x| (float32) as int32 bits, for the amax: non-negative floats order like their bit
    patterns, and every NaN pattern lies above inf's, so an integer max keeps NaN."""
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _amax_of_bits(bits):
    """max |x| from _abs_bits maxima as float32, NaN counted as +inf (reference.abs_max)."""
    return tl.minimum(tl.max(bits, axis=0), _INF_BITS).to(tl.float32, bitcast=True)


@triton.jit
def _resolve_scale(scale_ptr, scale_inv_ptr, from_amax_ptr, count_ptr,
                   FP8_MAX: tl.constexpr, FROM_AMAX: tl.constexpr, COUNT: tl.constexpr, POW2: tl.constexpr):
    """The scale this cast uses; program 0 writes scale_inv (and scale, count when FROM_AMAX).
    POW2 (with FROM_AMAX): the computed scale rounded down to a power of two."""
    amax = 0.0
    if FROM_AMAX:
        amax = tl.load(from_amax_ptr)
    return _scale_for(amax, scale_ptr, scale_inv_ptr, count_ptr, FP8_MAX, FROM_AMAX, COUNT, POW2)


@triton.jit
def _grid_sync(sync_ptr):
    """Wait until every program of the (cooperative) launch has called this: a grid-wide
    barrier on sync_ptr, an int64 count of arrivals that only grows (0 before the first
    launch). A program's ticket (the count it found) names its launch's round, and it leaves
    once the count has reached that round's end, so no reset is needed and no arrival can
    count for another round. Each program's earlier writes are visible to every program
    after it (release on arrival, acquire on leaving)."""
    tl.debug_barrier()  # the program's threads have written what they wrote before arriving
    nprog = tl.num_programs(0)
    ticket = tl.atomic_add(sync_ptr, 1, sem="acq_rel")
    end = (ticket // nprog + 1) * nprog
    while tl.atomic_add(sync_ptr, 0, sem="acquire") < end:
        pass
    tl.debug_barrier()


@triton.jit
def _resolve_scale_from_rows(scale_ptr, scale_inv_ptr, from_amax_ptr, count_ptr, rows_amax_ptr, n_rows_amax,
                             FP8_MAX: tl.constexpr, COUNT: tl.constexpr, POW2: tl.constexpr):
    """_resolve_scale with FROM_AMAX, the amax being the max of rows_amax (n_rows_amax >= 1
    non-negative float32, NaN counted as +inf): every program reduces the vector itself (from
    L2, the same value in every program), program 0 also stores it into from_amax."""
    offs = tl.arange(0, _ROWS_BLOCK)
    acc = tl.zeros([_ROWS_BLOCK], dtype=tl.int32)
    for start in range(0, n_rows_amax, _ROWS_BLOCK):
        # .cg (L2, not L1): under OWN_AMAX other programs of this launch wrote the vector
        v = tl.load(rows_amax_ptr + start + offs, mask=start + offs < n_rows_amax, other=0.0, cache_modifier=".cg")
        acc = tl.maximum(acc, _abs_bits(v))
    amax = _amax_of_bits(acc)
    if tl.program_id(0) == 0:
        tl.store(from_amax_ptr, amax)
    return _scale_for(amax, scale_ptr, scale_inv_ptr, count_ptr, FP8_MAX, True, COUNT, POW2)


@triton.jit
def _resolve_cast_scale(scale_ptr, scale_inv_ptr, from_amax_ptr, count_ptr, rows_amax_ptr, n_rows_amax,
                        FP8_MAX: tl.constexpr, FROM_AMAX: tl.constexpr, FROM_ROWS: tl.constexpr, COUNT: tl.constexpr,
                        POW2: tl.constexpr):
    """The cast kernels' _resolve_scale: FROM_ROWS (with FROM_AMAX) takes the amax as the max
    of the rows' amaxes (_resolve_scale_from_rows), else from from_amax."""
    if FROM_ROWS:
        scale = _resolve_scale_from_rows(scale_ptr, scale_inv_ptr, from_amax_ptr, count_ptr, rows_amax_ptr,
                                         n_rows_amax, FP8_MAX, COUNT, POW2)
    else:
        scale = _resolve_scale(scale_ptr, scale_inv_ptr, from_amax_ptr, count_ptr, FP8_MAX, FROM_AMAX, COUNT, POW2)
    return scale


@triton.jit
def _scale_for(amax, scale_ptr, scale_inv_ptr, count_ptr,
               FP8_MAX: tl.constexpr, FROM_AMAX: tl.constexpr, COUNT: tl.constexpr, POW2: tl.constexpr):
    """_resolve_scale's body, given the amax (used with FROM_AMAX only)."""
    scale = tl.load(scale_ptr)
    if FROM_AMAX:
        # Current scaling: every program computes the new scale itself, program 0 stores it.
        # Another program may load `scale` before or after that store; both give the same
        # result because compute_scale(a, compute_scale(a, s)) == compute_scale(a, s)
        # (a usable amax ignores the old scale, an unusable one returns it unchanged).
        scale = compute_scale(amax, scale, FP8_MAX, 1.0, POW2)
    if tl.program_id(0) == 0:
        if FROM_AMAX:
            tl.store(scale_ptr, scale)
            if COUNT:
                nonfinite = ~(tl.abs(amax) <= _FLT_MAX)
                tl.store(count_ptr, tl.load(count_ptr) + nonfinite.to(tl.int32))
        tl.store(scale_inv_ptr, tl.math.div_rn(1.0, scale))  # IEEE 1/scale == torch.reciprocal
    return scale


@triton.jit
def _flat_abs_max(x_ptr, n, pid, nprog, BLOCK: tl.constexpr):
    """reference.abs_max of this program's share of _flat_kernel's blocks (0.0 for none)."""
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    n_full = n // BLOCK
    for b in range(pid, n_full, nprog):
        x = tl.load(x_ptr + tl.cast(b, tl.int64) * BLOCK + offs).to(tl.float32)
        acc = tl.maximum(acc, _abs_bits(x))
    if pid == n_full % nprog:
        start = n_full * BLOCK
        x = tl.load(x_ptr + start + offs, mask=offs < n - start, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, _abs_bits(x))
    return _amax_of_bits(acc)


@triton.jit
def _tile_abs_max(x_ptr, M, N, stride_xm, pid, nprog, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """reference.abs_max of this program's share of _tile_kernel's tiles of x (0.0 for none)."""
    tiles_n = tl.cdiv(N, BLOCK_N)
    num_tiles = tl.cdiv(M, BLOCK_M) * tiles_n
    r = tl.arange(0, BLOCK_M)
    c = tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M], dtype=tl.int32)
    for t in range(pid, num_tiles, nprog):
        row0 = (t // tiles_n) * BLOCK_M
        col0 = (t % tiles_n) * BLOCK_N
        in_x = (row0 + r < M)[:, None] & (col0 + c < N)[None, :]
        x_tile = x_ptr + tl.cast(row0, tl.int64) * stride_xm + col0
        x = tl.load(x_tile + r[:, None] * stride_xm + c[None, :], mask=in_x, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, tl.max(_abs_bits(x), axis=1))
    return _amax_of_bits(acc)


@triton.jit
def _flat_kernel(
    x_ptr,          # (n,) bf16/fp16/fp32 input, contiguous
    out_ptr,        # (n,) fp8 output, contiguous (CAST)
    scale_ptr,      # () float32 scale: read; set from from_amax by program 0 (FROM_AMAX)
    scale_inv_ptr,  # () float32 output 1/scale, written by program 0 (CAST)
    amax_ptr,       # () float32 running amax: one atomic max per program (AMAX)
    from_amax_ptr,  # () float32 amax the scale is computed from (FROM_AMAX)
    count_ptr,      # () int32 nonfinite count, +1 when from_amax is inf/NaN (COUNT)
    skip_ptr,       # () int32: nonzero makes the launch a no-op (SKIP; a graphed cached weight)
    n,              # number of elements
    rows_amax_ptr,  # (n_rows_amax,) float32: from_amax <- their max first (FROM_ROWS; OWN_AMAX: (programs,))
    n_rows_amax,
    sync_ptr,       # (1,) int64 grid barrier's arrivals, 0 before the first launch (OWN_AMAX)
    FP8_MAX: tl.constexpr, CAST: tl.constexpr, AMAX: tl.constexpr, FROM_AMAX: tl.constexpr,
    FROM_ROWS: tl.constexpr, COUNT: tl.constexpr, POW2: tl.constexpr, SKIP: tl.constexpr, OWN_AMAX: tl.constexpr,
    BLOCK: tl.constexpr,
):
    if SKIP:
        if tl.load(skip_ptr) != 0:
            return
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    if OWN_AMAX:  # (with FROM_ROWS) x's amax first, one partial per program, then the barrier
        tl.store(rows_amax_ptr + pid, _flat_abs_max(x_ptr, n, pid, nprog, BLOCK))
        _grid_sync(sync_ptr)
        n_rows_amax = nprog
    if CAST:
        scale = _resolve_cast_scale(scale_ptr, scale_inv_ptr, from_amax_ptr, count_ptr, rows_amax_ptr, n_rows_amax,
                                    FP8_MAX, FROM_AMAX, FROM_ROWS, COUNT, POW2)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int32)  # running max of _abs_bits
    n_full = n // BLOCK
    # Full blocks: no masks, so loads and stores are 16-byte vectors whatever n is.
    for b in range(pid, n_full, nprog):
        start = tl.cast(b, tl.int64) * BLOCK  # tl.cast: b is a Python int in the interpreter
        x = tl.load(x_ptr + start + offs).to(tl.float32)
        if CAST:
            tl.store(out_ptr + start + offs, _saturate(x, scale, FP8_MAX).to(out_ptr.dtype.element_ty))
        if AMAX:
            acc = tl.maximum(acc, _abs_bits(x))
    # The partial last block (possibly empty) goes to the program next in the round robin.
    if pid == n_full % nprog:
        start = n_full * BLOCK  # <= n: no overflow in n's own integer type
        mask = offs < n - start
        x = tl.load(x_ptr + start + offs, mask=mask, other=0.0).to(tl.float32)
        if CAST:
            tl.store(out_ptr + start + offs, _saturate(x, scale, FP8_MAX).to(out_ptr.dtype.element_ty), mask=mask)
        if AMAX:
            acc = tl.maximum(acc, _abs_bits(x))
    if AMAX:
        # float atomic max orders negative values correctly, so an UNRECORDED (-1) start works.
        tl.atomic_max(amax_ptr, _amax_of_bits(acc))


@triton.jit
def _tile_kernel(
    x_ptr,          # (M, N) bf16/fp16/fp32 input, unit column stride, row stride stride_xm
    out_ptr,        # (M, N) fp8 output, row-major (CAST)
    out_t_ptr,      # (N, Mp) fp8 transposed copy, row-major; columns M..Mp-1 get zeros (TRANSPOSE)
    scale_ptr,      # () float32 scale: read; set from from_amax by program 0 (FROM_AMAX)
    scale_inv_ptr,  # () float32 output 1/scale, written by program 0 (CAST)
    amax_ptr,       # () float32 running amax: one atomic max per program (AMAX)
    from_amax_ptr,  # () float32 amax the scale is computed from (FROM_AMAX)
    count_ptr,      # () int32 nonfinite count, +1 when from_amax is inf/NaN (COUNT)
    partial_ptr,    # (row tiles, N) float32: row i = column sums of x's rows [i*BLOCK_M, (i+1)*BLOCK_M) (DBIAS)
    skip_ptr,       # () int32: nonzero makes the launch a no-op (SKIP; a graphed cached weight)
    M, N, Mp, stride_xm,
    rows_amax_ptr,  # (n_rows_amax,) float32: from_amax <- their max first (FROM_ROWS; OWN_AMAX: (programs,))
    n_rows_amax,
    sync_ptr,       # (1,) int64 grid barrier's arrivals, 0 before the first launch (OWN_AMAX)
    FP8_MAX: tl.constexpr, CAST: tl.constexpr, TRANSPOSE: tl.constexpr, AMAX: tl.constexpr,
    FROM_AMAX: tl.constexpr, FROM_ROWS: tl.constexpr, COUNT: tl.constexpr, POW2: tl.constexpr, DBIAS: tl.constexpr,
    SKIP: tl.constexpr, OWN_AMAX: tl.constexpr,
    FROM_OUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    if SKIP:
        if tl.load(skip_ptr) != 0:
            return
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    if OWN_AMAX:  # as in _flat_kernel
        tl.store(rows_amax_ptr + pid, _tile_abs_max(x_ptr, M, N, stride_xm, pid, nprog, BLOCK_M, BLOCK_N))
        _grid_sync(sync_ptr)
        n_rows_amax = nprog
    if CAST:
        scale = _resolve_cast_scale(scale_ptr, scale_inv_ptr, from_amax_ptr, count_ptr, rows_amax_ptr, n_rows_amax,
                                    FP8_MAX, FROM_AMAX, FROM_ROWS, COUNT, POW2)
    if TRANSPOSE:
        rows_covered = Mp  # tiles past row M write out_t's zero padding
    else:
        rows_covered = M
    tiles_n = tl.cdiv(N, BLOCK_N)
    num_tiles = tl.cdiv(rows_covered, BLOCK_M) * tiles_n
    r = tl.arange(0, BLOCK_M)
    c = tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M], dtype=tl.int32)  # per-row maxima of _abs_bits (a 2-D one costs ~60 registers)
    for t in range(pid, num_tiles, nprog):
        row0 = (t // tiles_n) * BLOCK_M
        col0 = (t % tiles_n) * BLOCK_N
        rows = row0 + r
        cols = col0 + c
        in_x = (rows < M)[:, None] & (cols < N)[None, :]
        # Tile origins in int64, offsets inside a tile in int32 (the wrapper bounds them).
        x_tile = x_ptr + tl.cast(row0, tl.int64) * stride_xm + col0
        x = tl.load(x_tile + r[:, None] * stride_xm + c[None, :], mask=in_x, other=0.0).to(tl.float32)
        if AMAX:
            acc = tl.maximum(acc, tl.max(_abs_bits(x), axis=1))
        if DBIAS:
            # Rows past M were loaded as 0 (the padding tiles of out_t write zero sums).
            tl.store(partial_ptr + tl.cast(t // tiles_n, tl.int64) * N + cols, tl.sum(x, axis=0), mask=cols < N)
        if CAST:
            y = _saturate(x, scale, FP8_MAX)  # (BLOCK_M, BLOCK_N)
            if TRANSPOSE:
                y = tl.where((rows < M)[:, None], y, 0.0)  # padding: +0.0 is byte 0x00
            q = y.to(out_ptr.dtype.element_ty)
            out_tile = out_ptr + tl.cast(row0, tl.int64) * N + col0
            tl.store(out_tile + r[:, None] * N + c[None, :], q, mask=in_x)
            if TRANSPOSE and FROM_OUT:
                # The tile's bytes reloaded from out (L2) in transposed order: see _plan.
                store_transposed_tile(out_tile, out_t_ptr + tl.cast(col0, tl.int64) * Mp + row0, N, Mp, r, c,
                                      rows < M, cols < N, rows < Mp)
            elif TRANSPOSE:
                # Transpose the bytes (a plain integer layout change through shared memory).
                q_t = tl.trans(q.to(tl.uint8, bitcast=True)).to(out_t_ptr.dtype.element_ty, bitcast=True)
                in_t = (cols < N)[:, None] & (rows < Mp)[None, :]
                out_t_tile = out_t_ptr + tl.cast(col0, tl.int64) * Mp + row0
                tl.store(out_t_tile + c[:, None] * Mp + r[None, :], q_t, mask=in_t)  # (BLOCK_N, BLOCK_M)
    if AMAX:
        tl.atomic_max(amax_ptr, _amax_of_bits(acc))


# --------------------------------------------------------------------------- host wrappers


def amax(x: torch.Tensor, amax_out: torch.Tensor) -> None:
    """reference.amax on the GPU: amax_out <- max(amax_out, abs_max(x)), no sync."""
    _check_input(x, "amax")
    check_scalar("amax", "amax_out", amax_out, torch.float32, x.device)
    if x.numel() == 0:
        reference.amax(x, amax_out)
        return
    _launch(x, None, None, None, None, amax_out, None, None, None, fp8_max=0.0)


def cast_amax(x: torch.Tensor, out: torch.Tensor, scale: torch.Tensor, scale_inv_out: torch.Tensor,
              amax_out: Optional[torch.Tensor] = None, from_amax: Optional[torch.Tensor] = None,
              nonfinite_count: Optional[torch.Tensor] = None, dbias_out: Optional[torch.Tensor] = None,
              power_of_two: bool = False) -> None:
    """reference.cast_amax on the GPU (same contract; see there).

    x must have unit stride in its last dim and leading dims that fold into one row stride
    (any contiguous tensor, or row slices of one); out must be contiguous.
    """
    _check_input(x, "cast_amax")
    check_fp8_out("cast_amax", "out", out, x.shape, x.device)
    check_scales("cast_amax", x.device, scale, scale_inv_out, amax_out, from_amax, nonfinite_count)
    check_dbias("cast_amax", dbias_out, x.shape[-1] if x.dim() else 1, x.device)
    launch_cast(x, out, None, scale, scale_inv_out, amax_out, from_amax, nonfinite_count, dbias_out,
                power_of_two=power_of_two)


def cast_transpose_amax(x: torch.Tensor, out: torch.Tensor, out_t: torch.Tensor, scale: torch.Tensor,
                        scale_inv_out: torch.Tensor, amax_out: Optional[torch.Tensor] = None,
                        from_amax: Optional[torch.Tensor] = None,
                        nonfinite_count: Optional[torch.Tensor] = None,
                        dbias_out: Optional[torch.Tensor] = None, power_of_two: bool = False) -> None:
    """reference.cast_transpose_amax on the GPU (same contract; see there).

    x      (M, N), unit column stride, any row stride >= N
    out    (M, N) fp8, contiguous
    out_t  (N, Mp) fp8, contiguous, Mp >= M: out_t[:, :M] = out.T and out_t[:, M:] = 0
    """
    if x.dim() != 2:
        raise ValueError(f"cast_transpose_amax: x must be 2-D (M, N); got shape {tuple(x.shape)}")
    _check_input(x, "cast_transpose_amax")
    m, n = x.shape
    check_fp8_outputs("cast_transpose_amax", m, n, x.device, out, out_t)
    check_scales("cast_transpose_amax", x.device, scale, scale_inv_out, amax_out, from_amax, nonfinite_count)
    check_dbias("cast_transpose_amax", dbias_out, n, x.device)
    launch_cast(x, out, out_t, scale, scale_inv_out, amax_out, from_amax, nonfinite_count, dbias_out,
                power_of_two=power_of_two)


def launch_cast(x, out, out_t, scale, scale_inv_out, amax_out, from_amax, nonfinite_count, dbias_out=None,
                skip=None, power_of_two: bool = False, traced: bool = False, rows_amax=None) -> None:
    """cast_amax (out_t None) or cast_transpose_amax with arguments already checked; with
    `skip` (a () int32 device flag) every launch of the cast reads the flag first and does
    nothing when it is nonzero (the cached-weight case of a CUDA graph); power_of_two as for
    the twins (used with from_amax only); traced: launched from a torch.library.triton_op's
    body (DirectKernel.traced; no dbias_out there). rows_amax (with from_amax): a float32
    vector of x's per-row amaxes (NaN as +inf), x's amax taken by traced code; the launch
    first sets from_amax to its max (twin: `from_amax.copy_(reference.abs_max(rows_amax))`,
    then the cast), which saves traced code a reduction kernel over the rows.

    For callers that own every buffer and have checked x (quantizers): the public wrappers
    above check, then call this. With out_t, x's rows are (M, N) = (numel / N, x.shape[-1])
    and x must be contiguous or a stack of rows (`_as_rows`).
    """
    if x.numel() == 0:
        if skip is not None and reference.skipped(skip):
            return
        if rows_amax is not None and from_amax is not None:
            from_amax.copy_(reference.abs_max(rows_amax))
        if out_t is None:
            reference.cast_amax(x, out, scale, scale_inv_out, amax_out, from_amax, nonfinite_count, dbias_out,
                                power_of_two)
        else:
            reference.cast_transpose_amax(x, out, out_t, scale, scale_inv_out, amax_out, from_amax, nonfinite_count,
                                          dbias_out, power_of_two)
        return
    _launch(x, out, out_t, scale, scale_inv_out, amax_out, from_amax, nonfinite_count, dbias_out,
            _FP8_MAX[out.dtype], skip, power_of_two, traced, rows_amax)


def _launch(x, out, out_t, scale, scale_inv_out, amax_out, from_amax, nonfinite_count, dbias_out,
            fp8_max: float, skip=None, power_of_two: bool = False, traced: bool = False, rows_amax=None) -> None:
    """Pick the kernel and launch it (arguments already checked)."""
    kernel, grid, make_args, partial_rows = _plan(x, out, out_t, scale, amax_out, from_amax, nonfinite_count,
                                                  dbias_out is not None, fp8_max, skip, power_of_two, rows_amax)
    if traced:
        if dbias_out is not None:
            raise ValueError("fp8 cast: a traced launch takes no dbias_out (traced code sums the columns itself)")
        kernel.traced(grid, *make_args(x, out, out_t, scale_inv_out, None))
        return
    partial = None
    if dbias_out is not None:
        partial = torch.empty((partial_rows, dbias_out.shape[0]), dtype=torch.float32, device=x.device)
    with _device_guard(x.device):
        kernel(grid, *make_args(x, out, out_t, scale_inv_out, partial))
    if partial is not None:
        colsum_into(partial[None], [dbias_out])


def _plan(x, out, out_t, scale, amax_out, from_amax, nonfinite_count, dbias: bool, fp8_max: float, skip=None,
          power_of_two: bool = False, rows_amax=None, own_amax: bool = False):
    """(kernel, grid, make_args, partial rows) for one cast; absent optional tensors are
    flagged off (and never touched). make_args(x, out, out_t, scale_inv_out, partial) gives
    the runtime arguments, so a PreparedCast can rebuild them for fresh buffers without
    planning again; `partial` is the (partial rows, N) float32 buffer of a cast with dbias.
    `skip` (fixed for the plan) is the () int32 flag of a skippable cast, or None.
    power_of_two only specialises casts that compute their scale (from_amax given); so does
    rows_amax (launch_cast). own_amax (with from_amax, a cast): the launch takes x's amax
    itself (the module docstring's OWN_AMAX), into scratch that the plan allocates and keeps;
    it must be launched cooperatively on at most the planned grid (PreparedCast does)."""
    cast = out is not None
    dummy = amax_out if amax_out is not None else scale  # stands in for unused pointer args
    amax_p = dummy if amax_out is None else amax_out
    from_p = dummy if from_amax is None else from_amax
    count_p = dummy if nonfinite_count is None else nonfinite_count
    scale_p = scale if cast else dummy
    skip_p = dummy if skip is None else skip
    own_amax = bool(own_amax) and from_amax is not None and cast
    from_rows = own_amax or (rows_amax is not None and from_amax is not None and cast)
    flags = (fp8_max, cast, amax_out is not None, from_amax is not None, from_rows,
             from_amax is not None and nonfinite_count is not None, bool(power_of_two) and from_amax is not None)
    device = x.device
    flat_cfg, tile_cfg = launch_configs(device)
    flat = out_t is None and not dbias and x.is_contiguous()
    if flat:
        n = x.numel()
        grid = _grid(triton.cdiv(n, flat_cfg.block), flat_cfg.programs_per_sm, device)
    else:
        m, n, row_stride = _row_layout(x)
        mp = m if out_t is None else out_t.shape[1]
        _check_tile_offsets(tile_cfg, row_stride, n, mp)
        row_tiles = triton.cdiv(mp, tile_cfg.block_m)
        grid = _grid(row_tiles * triton.cdiv(n, tile_cfg.block_n), tile_cfg.programs_per_sm, device)
    sync_p = dummy
    if own_amax:  # one partial amax per program, and the barrier's count of arrivals
        rows_amax = torch.empty(grid, dtype=torch.float32, device=device)
        sync_p = torch.zeros(1, dtype=torch.int64, device=device)
    # OWN_AMAX: the kernel reduces one partial per program and ignores n_rows
    rows_p, n_rows = (rows_amax, 0 if own_amax else rows_amax.numel()) if from_rows else (dummy, 0)
    if flat:
        def flat_args(x, out, out_t, scale_inv_out, partial):
            return (x, out if cast else x, scale_p, scale_inv_out if cast else dummy, amax_p, from_p, count_p, skip_p,
                    n, rows_p, n_rows, sync_p)
        return _flat(flat_cfg, *flags, skip is not None, own_amax), grid, flat_args, 0

    def tile_args(x, out, out_t, scale_inv_out, partial):
        out_p = out if cast else x
        return (x, out_p, out_t if out_t is not None else out_p, scale_p, scale_inv_out if cast else dummy,
                amax_p, from_p, count_p, partial if partial is not None else dummy, skip_p, m, n, mp, row_stride,
                rows_p, n_rows, sync_p)
    # A float32 tile's transposed copy is reloaded from out's bytes (store_transposed_tile):
    # tl.trans of the register tile wrote wrong bytes into out_t for tiles loaded as float32
    # on sm_90 with triton 3.6 (GPU tests, 2026-11-29; bf16/fp16 are exact and keep it).
    from_out = out_t is not None and x.dtype == torch.float32
    return (_tile(tile_cfg, out_t is not None, *flags, dbias, skip is not None, own_amax, from_out), grid,
            tile_args, row_tiles)


class PreparedCast:
    """launch_cast for a stream of same-shaped casts with fixed scale buffers (a quantizer's
    steady state): the plan and the compiled binary come from the first call's tensors, and
    each call only rebuilds the argument tuple and launches, about a third of the host time
    of planning every time. Calls that do not match the prepared case (another device
    current, x at a different 16-byte alignment, launch hooks installed, empty x) go
    through launch_cast.

    scale, amax_out, from_amax, nonfinite_count, power_of_two  as for launch_cast, fixed for all calls
    dbias  whether calls pass dbias_out; the partial-sum buffer is the preparation's own,
           reused by every call (each call's colsum reads it right after the launch, in
           stream order)
    skip   None, or the () int32 device flag of a skippable cast (fixed for all calls)
    own_amax  (with from_amax) current scaling's cast in one call: from_amax <- x's amax, then
           the cast with the scale computed from it; one cooperative launch (the module
           docstring's OWN_AMAX), else a zero fill, the amax launch and the cast launch
    """

    def __init__(self, x, out, out_t, scale, scale_inv_out, amax_out=None, from_amax=None, nonfinite_count=None,
                 dbias=False, skip=None, power_of_two=False, own_amax=False):
        own_amax = bool(own_amax) and from_amax is not None
        self._fixed = (scale, amax_out, from_amax, nonfinite_count, skip, power_of_two, own_amax)
        self._binary = None
        self._native = None  # the C++ launch (below); none where the cast goes through launch_cast
        if x.numel() == 0:
            return
        kernel, self._grid, self._make_args, rows = _plan(x, out, out_t, scale, amax_out, from_amax, nonfinite_count,
                                                          dbias, _FP8_MAX[out.dtype], skip, power_of_two,
                                                          own_amax=own_amax)
        self._partial = None
        if dbias:
            self._partial = torch.empty((rows, x.shape[-1]), dtype=torch.float32, device=x.device)
        self._device = x.device.index
        self._x_aligned = x.data_ptr() & 15 == 0
        binary = kernel.binary_for(*self._make_args(x, out, out_t, scale_inv_out, self._partial))
        if binary is not None and own_amax:
            # A cooperative launch is refused above the programs that fit at once; with fewer,
            # each program's share grows (the loops stride by the grid).
            self._grid = min(self._grid, resident_programs(binary, x.device))
            binary = binary if self._grid > 0 else None
        self._binary = binary
        self._tail = kernel.tail
        self._transposes = out_t is not None
        self._native = native.launch_for(self)  # the same launch from C++ (None: through Triton's launcher)

    @property
    def partial(self) -> Optional[torch.Tensor]:
        """The (row tiles, N) float32 partial column sums of a dbias cast (None without dbias)."""
        return self._partial if self._binary is not None else None

    def native_launch(self) -> Optional[tuple]:
        """This launch as kernels.native.Launch arguments (function, grid, block, shared,
        values, holes) and the fixed buffers they point into, for the C++ launcher; None
        where it launches through Triton (see the class). The call's own tensors are holes,
        filled per call in the order of _HOLES: x, data, data_t, scale_inv; the rest (this
        preparation's scale, amax and partial-sum buffers, the sizes) is fixed."""
        if self._binary is None:
            return None
        x, data, data_t, scale_inv = _HOLES
        args = self._make_args(x, data, data_t if self._transposes else None, scale_inv, self._partial)
        return native.launch_spec(self._binary, self._grid, args, _HOLES)

    def native_for(self, x):
        """The C++ Launch of this preparation for input x (holes: x, data, data_t, scale_inv),
        or None where x takes Triton's path (see the class; launch hooks are the caller's
        check)."""
        if (self._native is None or (x.data_ptr() & 15 == 0) != self._x_aligned
                or torch._C._cuda_getDevice() != self._device):
            return None
        return self._native

    def __call__(self, x, out, out_t, scale_inv_out, dbias_out=None) -> None:
        binary = self._binary
        if (binary is None or (x.data_ptr() & 15 == 0) != self._x_aligned or torch._C._cuda_getDevice() != self._device
                or hooks_installed()):
            scale, amax_out, from_amax, count, skip, pow2, own_amax = self._fixed
            if own_amax:
                from_amax.zero_()
                amax(x, from_amax)
            launch_cast(x, out, out_t, scale, scale_inv_out, amax_out, from_amax, count, dbias_out, skip, pow2)
            return
        partial = self._partial
        if self._native is not None and native.ENABLED:
            native.extension().launch(self._native, self._device, x, out, out_t, scale_inv_out)
        else:
            binary.run(self._grid, 1, 1, torch._C._cuda_getCurrentRawStream(self._device), binary.function,
                       binary.packed_metadata, None, None, None,
                       *self._make_args(x, out, out_t, scale_inv_out, partial), *self._tail)
        if dbias_out is not None:
            colsum_into(partial[None], [dbias_out])


class _Hole:
    """Stands in for one of a call's own tensors while a launch's fixed arguments are read."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}>"


_HOLES = (_Hole("x"), _Hole("data"), _Hole("data_t"), _Hole("scale_inv"))


@functools.lru_cache(maxsize=None)
def _flat(cfg: FlatConfig, fp8_max: float, cast: bool, amax: bool, from_amax: bool, from_rows: bool, count: bool,
          pow2: bool, skip: bool, own_amax: bool) -> DirectKernel:
    return DirectKernel(_flat_kernel, num_warps=cfg.num_warps, cooperative=own_amax, FP8_MAX=fp8_max, CAST=cast,
                        AMAX=amax, FROM_AMAX=from_amax, FROM_ROWS=from_rows, COUNT=count, POW2=pow2, SKIP=skip,
                        OWN_AMAX=own_amax, BLOCK=cfg.block)


@functools.lru_cache(maxsize=None)
def _tile(cfg: TileConfig, transpose: bool, fp8_max: float, cast: bool, amax: bool, from_amax: bool,
          from_rows: bool, count: bool, pow2: bool, dbias: bool, skip: bool, own_amax: bool,
          from_out: bool) -> DirectKernel:
    return DirectKernel(_tile_kernel, num_warps=cfg.num_warps, cooperative=own_amax, FP8_MAX=fp8_max, CAST=cast,
                        TRANSPOSE=transpose, AMAX=amax, FROM_AMAX=from_amax, FROM_ROWS=from_rows, COUNT=count,
                        POW2=pow2, DBIAS=dbias, SKIP=skip, OWN_AMAX=own_amax,
                        FROM_OUT=from_out, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n)


def _row_layout(x: torch.Tensor) -> Tuple[int, int, int]:
    """(M, N, row stride) of x seen as rows of its last dim; the kernel indexes x's storage
    from x's own data pointer, so no view is made."""
    cols = x.shape[-1] if x.dim() else 1
    m = x.numel() // cols if cols else 0
    if x.is_contiguous():
        return m, cols, cols
    return _as_rows(x)[1:]


def _as_rows(x: torch.Tensor) -> Tuple[torch.Tensor, int, int, int]:
    """x as (rows, cols) with a row stride and unit column stride: (view, M, N, row stride)."""
    cols = x.shape[-1] if x.dim() else 1
    try:
        rows = x.view(-1, cols)
    except RuntimeError:
        rows = None
    if rows is None or (rows.stride(1) != 1 and cols > 1):
        raise ValueError(f"fp8 cast: x of shape {tuple(x.shape)} and strides {tuple(x.stride())} is not a "
                         "stack of rows with unit stride in the last dim; pass x.contiguous()")
    m = rows.shape[0]
    return rows, m, cols, rows.stride(0) if m > 1 else cols


def _check_tile_offsets(cfg: TileConfig, row_stride: int, n: int, mp: int) -> None:
    # Offsets inside one tile are int32 (tile origins are int64). In a trace sym_max: no guard
    # on which size is the largest (see _grid), only the bound itself.
    longest = max(row_stride, n, mp) if type(mp) is int else torch.sym_max(torch.sym_max(row_stride, n), mp)
    if longest * max(cfg.block_m, cfg.block_n) >= 2**31:
        raise ValueError(f"fp8 cast: rows of {max(row_stride, n, mp)} elements are too long for the tiled "
                         f"kernel (int32 offsets inside a {cfg.block_m}x{cfg.block_n} tile)")


def _check_input(x: torch.Tensor, fn: str) -> None:
    if x.dtype not in _INPUT_DTYPES:
        raise ValueError(f"{fn}: x must be bfloat16, float16 or float32; got {x.dtype}")
