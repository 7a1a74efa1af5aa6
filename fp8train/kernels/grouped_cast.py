"""Many weights cast to FP8 (with transposed copies and amaxes) in one launch.

Twin: reference.grouped_cast (each member through reference.cast_amax /
cast_transpose_amax; the GPU tests compare bit for bit). A compiled step of a converted
model casts every weight of a delayed-scaling recipe before its forward
(modules/weight_group.py): with one launch per weight that is 28 launches of ~30 us of host
each for a 4-layer Llama from Inductor's code, where the GPU work is small.

The members are contiguous 2-D tensors (M, N) of one dtype, each with its own scale and
amax. Their addresses travel in an int64 table (one row per member, `_FIELDS`), cached per
set of addresses; the outputs are one flat FP8 buffer for the payloads and one for the
transposed copies, each member at an offset the layout fixes (`GroupLayout`). The grid is
persistent over the members' tiles in order; a program finds its tile's member by
comparing the tile index with the members' first tiles.
"""
from __future__ import annotations

import functools
from typing import Dict, List, NamedTuple, Sequence, Tuple

import torch
import triton
import triton.language as tl

from ..tensor import padded_rows
from . import reference
from .cast import _FP8_MAX, _abs_bits, _amax_of_bits, _saturate, _sm_count
from .launcher import DirectKernel, device_guard
from .transpose import store_transposed_tile

# Columns of the member table: input, scale and amax addresses; payload and transposed
# offsets in the flat outputs; M, N, Mp (the transposed copy's padded rows); first tile.
_FIELDS: tl.constexpr = tl.constexpr(9)
_ALIGN = 256  # bytes between members in the flat outputs (GEMM operands want >= 16)
# float32 slots between members' scale_invs: cuBLASLt refused (CUBLAS_STATUS_NOT_SUPPORTED)
# scale pointers 4 bytes apart on the H200; 16-byte aligned ones it takes.
SCALE_STRIDE = 4
_SCALE_STRIDE: tl.constexpr = tl.constexpr(SCALE_STRIDE)  # the same, for device code
_BLOCK_M, _BLOCK_N, _WARPS, _PER_SM = 64, 64, 4, 4


class GroupLayout(NamedTuple):
    """Where each member lives in the flat outputs, from the members' shapes alone."""

    shapes: Tuple[Tuple[int, int], ...]  # (M, N) per member
    offsets: Tuple[int, ...]             # payload (M, N) of member i at data[offsets[i]:]
    offsets_t: Tuple[int, ...]           # transposed copy (N, Mp) at data_t[offsets_t[i]:] (transpose)
    size: int                            # elements of the flat payload buffer
    size_t: int                          # of the flat transposed buffer (0 without transpose)


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def layout(shapes: Tuple[Tuple[int, int], ...], transpose: bool) -> GroupLayout:
    offsets, offsets_t, size, size_t = [], [], 0, 0
    for m, n in shapes:
        offsets.append(size)
        size += _aligned(m * n)
        offsets_t.append(size_t)
        if transpose:
            size_t += _aligned(n * padded_rows(m))
    return GroupLayout(shapes, tuple(offsets), tuple(offsets_t), size, size_t)


def scale_inv_of(scale_inv: torch.Tensor, i: int) -> torch.Tensor:
    """Member i's (1,) scale_inv in the flat scale_inv output."""
    return scale_inv[i * SCALE_STRIDE:i * SCALE_STRIDE + 1]


def views(lay: GroupLayout, data: torch.Tensor, data_t: torch.Tensor, i: int):
    """Member i's (payload (M, N), transposed copy (N, Mp) or None) in the flat outputs."""
    m, n = lay.shapes[i]
    payload = data[lay.offsets[i]:lay.offsets[i] + m * n].view(m, n)
    if data_t.numel() == 0:
        return payload, None
    mp = padded_rows(m)
    return payload, data_t[lay.offsets_t[i]:lay.offsets_t[i] + n * mp].view(n, mp)


# --------------------------------------------------------------------------- device code


@triton.jit
def _grouped_kernel(
    table_ptr,      # (G, _FIELDS) int64 member table
    like_ptr,       # any tensor of the members' dtype: the type of their addresses
    out_ptr,        # flat fp8 payloads
    out_t_ptr,      # flat fp8 transposed copies (TRANSPOSE)
    scale_inv_ptr,  # (G * SCALE_STRIDE,) float32 output: 1/scale of member g at g * SCALE_STRIDE
    G, total_tiles,
    FP8_MAX: tl.constexpr, TRANSPOSE: tl.constexpr, G_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    members = tl.arange(0, G_POW2)
    # Each member's first tile; absent members start past every tile.
    starts = tl.load(table_ptr + members * _FIELDS + 8, mask=members < G, other=2**62)
    r = tl.arange(0, BLOCK_M)
    c = tl.arange(0, BLOCK_N)
    for t in range(pid, total_tiles, nprog):
        g = tl.sum((starts <= t).to(tl.int32), axis=0) - 1
        row = table_ptr + g * _FIELDS
        x_ptr = tl.load(row).to(like_ptr.dtype)
        scale_p = tl.load(row + 1).to(scale_inv_ptr.dtype)
        amax_p = tl.load(row + 2).to(scale_inv_ptr.dtype)
        out_off = tl.load(row + 3)
        out_t_off = tl.load(row + 4)
        M = tl.load(row + 5)
        N = tl.load(row + 6)
        Mp = tl.load(row + 7)
        local = t - tl.load(row + 8)
        scale = tl.load(scale_p)
        if local == 0:
            tl.store(scale_inv_ptr + g * _SCALE_STRIDE, tl.math.div_rn(1.0, scale))  # IEEE 1/scale == torch.reciprocal
        tiles_n = tl.cdiv(N, BLOCK_N)
        row0 = (local // tiles_n) * BLOCK_M
        col0 = (local % tiles_n) * BLOCK_N
        rows = row0 + r
        cols = col0 + c
        rows_ok = rows < M
        in_x = rows_ok[:, None] & (cols < N)[None, :]
        x = tl.load(x_ptr + row0 * N + col0 + r[:, None] * N + c[None, :], mask=in_x, other=0.0).to(tl.float32)
        tl.atomic_max(amax_p, _amax_of_bits(tl.max(_abs_bits(x), axis=1)))
        q = _saturate(x, scale, FP8_MAX).to(out_ptr.dtype.element_ty)
        out_tile = out_ptr + out_off + row0 * N + col0
        tl.store(out_tile + r[:, None] * N + c[None, :], q, mask=in_x)
        if TRANSPOSE:
            # rows M..Mp-1 of the tile are the transposed copy's zero padding
            store_transposed_tile(out_tile, out_t_ptr + out_t_off + col0 * Mp + row0, N, Mp, r, c,
                                  rows_ok, cols < N, rows < Mp)


@functools.lru_cache(maxsize=None)
def _kernel(fp8_max: float, transpose: bool, g_pow2: int) -> DirectKernel:
    return DirectKernel(_grouped_kernel, num_warps=_WARPS, FP8_MAX=fp8_max, TRANSPOSE=transpose, G_POW2=g_pow2,
                        BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N)


# --------------------------------------------------------------------------- host wrapper

# Member tables on the device, per (device, member addresses, layout, transpose): the weights
# and the quantizers' buffers of a model stay where they are from step to step.
_tables: Dict[tuple, Tuple[torch.Tensor, int]] = {}


def _table(weights, scales, amaxes, lay: GroupLayout, transpose: bool) -> Tuple[torch.Tensor, int]:
    key = (weights[0].device, lay, transpose, tuple(w.data_ptr() for w in weights),
           tuple(s.data_ptr() for s in scales), tuple(a.data_ptr() for a in amaxes))
    found = _tables.get(key)
    if found is not None:
        return found
    rows, tile = [], 0
    for w, s, a, (m, n), off, off_t in zip(weights, scales, amaxes, lay.shapes, lay.offsets, lay.offsets_t):
        mp = padded_rows(m) if transpose else m
        rows.append([w.data_ptr(), s.data_ptr(), a.data_ptr(), off, off_t, m, n, mp, tile])
        tile += triton.cdiv(mp, _BLOCK_M) * triton.cdiv(n, _BLOCK_N)
    if len(_tables) >= 16:  # models rebuilt or moved: drop the old tables
        _tables.clear()
    host = torch.tensor(rows, dtype=torch.int64)
    device = weights[0].device
    if device.type != "cuda":
        table = host.to(device)
    else:
        # Allocated from a side stream: under CUDA graphs (mode="reduce-overhead") the first,
        # warm-up call allocates the current stream's memory from the graphs' pool, where a
        # tensor kept past the call fails cudagraph trees' check of live allocations.
        main = torch.cuda.current_stream(device)
        side = _side_stream(device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            table = host.to(device)
        main.wait_stream(side)
        table.record_stream(main)  # freed only after main's work on it (a dropped table)
    found = _tables[key] = (table, tile)
    return found


@functools.lru_cache(maxsize=None)
def _side_stream(device: torch.device) -> "torch.cuda.Stream":
    return torch.cuda.Stream(device)


def cast_weights(weights: Sequence[torch.Tensor], scales: Sequence[torch.Tensor], amaxes: Sequence[torch.Tensor],
                 data: torch.Tensor, data_t: torch.Tensor, scale_inv: torch.Tensor, transpose: bool) -> None:
    """reference.grouped_cast, on CUDA in one launch. weights: contiguous (M, N) tensors of
    one float dtype on one device; scales: () float32 each; amaxes: float32 tensors whose
    first element max-accumulates the weight's amax (a delayed quantizer's amax_history);
    data, data_t, scale_inv: the flat outputs of flat_outputs(shapes, ...) (data_t (0,)
    without transpose; scale_inv (G * SCALE_STRIDE,) float32, read through scale_inv_of)."""
    _check(weights, scales, amaxes)
    lay = layout(tuple((w.shape[0], w.shape[1]) for w in weights), transpose)
    _check_outputs(lay, len(weights), data, data_t, scale_inv, weights[0].device)
    if not weights[0].is_cuda:
        outs = [views(lay, data, data_t, i) for i in range(len(weights))]
        reference.grouped_cast(weights, scales, [a.view(-1)[0] for a in amaxes], [o for o, _ in outs],
                               [t for _, t in outs],
                               [scale_inv_of(scale_inv, i) for i in range(len(weights))])
        return
    table, tiles = _table(weights, scales, amaxes, lay, transpose)
    g = len(weights)
    grid = max(1, min(tiles, _PER_SM * _sm_count(weights[0].device)))
    with device_guard(weights[0].device):
        _kernel(_FP8_MAX[data.dtype], transpose, triton.next_power_of_2(g))(
            grid, table, weights[0], data, data_t if transpose else data, scale_inv, g, tiles)


def _check(weights, scales, amaxes) -> None:
    if not weights or not (len(weights) == len(scales) == len(amaxes)):
        raise ValueError(f"cast_weights: need as many weights, scales and amaxes (at least one); got "
                         f"{len(weights)}, {len(scales)}, {len(amaxes)}")
    dtype, device = weights[0].dtype, weights[0].device
    for w in weights:
        if w.dim() != 2 or not w.is_contiguous() or w.dtype != dtype or w.device != device or w.numel() == 0:
            raise ValueError(f"cast_weights: weights must be non-empty contiguous 2-D tensors of one dtype and "
                             f"device; got {tuple(w.shape)} {w.dtype} on {w.device} (first: {dtype} on {device})")
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"cast_weights: weights must be float32, bfloat16 or float16; got {dtype}")
    for s, a in zip(scales, amaxes):
        if any(t.dtype != torch.float32 or t.device != device or not t.is_contiguous() for t in (s, a)) \
                or s.numel() != 1 or a.numel() == 0:
            raise ValueError(f"cast_weights: scales (one element) and amaxes (at least one) must be contiguous "
                             f"float32 tensors on {device}")


def _check_outputs(lay: GroupLayout, g: int, data, data_t, scale_inv, device) -> None:
    if data.dtype not in _FP8_MAX or data.shape != (lay.size,) or data_t.dtype != data.dtype \
            or data_t.shape != (lay.size_t,) or scale_inv.shape != (g * SCALE_STRIDE,) \
            or scale_inv.dtype != torch.float32:
        raise ValueError(f"cast_weights: data, data_t and scale_inv must be flat_outputs' fp8 ({lay.size},), "
                         f"({lay.size_t},) and float32 ({g * SCALE_STRIDE},); got {tuple(data.shape)} {data.dtype}, "
                         f"{tuple(data_t.shape)} {data_t.dtype}, {tuple(scale_inv.shape)} {scale_inv.dtype}")
    for t in (data, data_t, scale_inv):
        if t.device != device:
            raise ValueError(f"cast_weights: outputs must be on {device}; got {t.device}")


def flat_outputs(shapes: Tuple[Tuple[int, int], ...], fp8_dtype: torch.dtype, transpose: bool,
                 device) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, GroupLayout]:
    """Fresh (data, data_t, scale_inv) for cast_weights, and their layout."""
    lay = layout(shapes, transpose)
    return (torch.empty(lay.size, dtype=fp8_dtype, device=device),
            torch.empty(lay.size_t, dtype=fp8_dtype, device=device),
            torch.empty(len(shapes) * SCALE_STRIDE, dtype=torch.float32, device=device), lay)


def member_casts(lay: GroupLayout, data, data_t, scale_inv) -> List[tuple]:
    """(payload, transposed copy or None, scale_inv (1,)) per member."""
    return [views(lay, data, data_t, i) + (scale_inv_of(scale_inv, i),) for i in range(len(lay.shapes))]
