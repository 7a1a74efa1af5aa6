"""Triton block-scaled FP8 cast: one pass over x, each block's amax, scale and FP8 values.

Twin: block_reference.block_cast (the specification; blocks, tails, scales and edge cases are
documented there). One program casts one tile that holds whole blocks, so the amax, the
scale and the cast come from a single read of the tile:

  (1, 128)    tile ROWS x 128: one scale per row of the tile
  (128, 1)    tile 128 x COLS: one scale per column of the tile
  (128, 128)  tile 128 x 128: one scale for the tile

The amax is taken on |x|'s bit patterns as integers (cast.py's _abs_bits: NaN orders above
inf and is then counted as inf), so a NaN can never hide in a block's amax. Where x's dims
are not multiples of the tile, masked lanes load 0, which no amax picks. The kernel matched
its twin bit for bit on the H200 (2026-12-01, tests/gpu/test_block_cast_gpu.py).

block_cast_both: modes 0 and 1 from each 128 x 128 tile, read once, the second cast stored
transposed (the operands of a layer's wgrad); bit for bit the twin's composition under the
Triton interpreter (tests/interpret) and on the H200 (tests/gpu/test_block_cast_gpu.py).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ContextManager, Optional, Tuple

import torch
import triton
import triton.language as tl

from .. import scaling
from . import block_reference, gated_reference
from .cast import _INF_BITS, _abs_bits, _saturate
from .gated import _ACT_CODES as _GATED_ACT_CODES
from .gated import _gated_act, _gated_dg, _gated_du
from .launcher import DirectKernel, LaunchOverride, device_guard
from .scale_update import compute_scale
from .transpose import store_transposed_tile
from ..tensor import padded_rows

_ROWS, _COLS, _TILE = 0, 1, 2
_MODES = {(1, 128): _ROWS, (128, 1): _COLS, (128, 128): _TILE}


@dataclass(frozen=True)
class BlockShapes:
    """Launch shapes of the block cast kernels: (tile rows, tile cols, warps) per mode, each
    tile whole blocks (1 x 128: 128 columns; 128 x 1: 128 rows; 128 x 128: the block), and the
    warps, register cap and clamp of block_cast_both's 128 x 128 tiles."""

    # the fastest of benchmarks/cast.py --block --variants on the H200 (2026-12-02) over a
    # float32 8192 x 1024 and a bf16 8192 x 2816 input; both: at HF Llama h2048's sizes
    # (float32 8192 x 2048, bf16 8192 x 5632), 4 warps 72-80% of a copy, 8 warps 64-68%
    rows: Tuple[int, int, int] = (32, 128, 4)
    cols: Tuple[int, int, int] = (128, 64, 4)
    tiles: Tuple[int, int, int] = (128, 128, 16)
    # The two-way cast's warps. A 128 x 128 tile in registers: at 4 warps ~250 registers a
    # thread, two programs (8 warps) an SM.
    both: int = 4
    # The two-way cast's register cap a thread (0: ptxas's choice; 128 at 8 warps: two programs
    # an SM) and whether it clamps before the FP8 conversion. On the GPU Triton's conversion
    # saturates by itself (cvt.rn.satfinite: out-of-range and inf to the largest finite value,
    # NaN kept), so the clamp repeats it (same bytes, 2 of ~18 instructions an element, and ~40
    # registers at 8 warps); the interpreter's conversion does not saturate, so there it always
    # clamps. H100, fifty-ninth session: without the clamp 3-5% faster; bf16 at 8 warps capped
    # at 128 another 2-4%; the forms' GPU tests pass without it (H100 and H200).
    both_regs: int = 0
    both_clamp: bool = True
    # The warps of the two-way cast's gated MLP forms (GATED: the product act(g) * u, and its
    # gradients dg | du, whose tiles read three inputs). H100,
    # sixtieth session, bf16 8192 x 2816: the product 4 warps 57.7% of a copy (8: 53.4%, 16:
    # 49.9%; 56 bytes of spills at 4), the gradients 8 warps 54.1% (4: 33.7%, 616 bytes of
    # spills; 16: 48.3%).
    gated: Tuple[int, int] = (4, 8)
    # The warps of the RMS norm's form (float32 x in a converted HF Llama), apart from the
    # product's since the sixty-third session (they were one field): float32 x and weight, 4
    # warps, clamp and masks 255 registers and 104 bytes of spills; 8 warps, unclamped, unmasked
    # 128, two programs an SM (tools/kernel_resources.py, triton 3.9's ptxas). Not yet timed apart.
    norm: int = 4
    # The gradients' form as two launches, one per side (dg's tiles, du's), each compiled for
    # its side: the run-time choice between them holds 255 registers at 8 warps, one side 128
    # each unmasked (triton 3.9's ptxas). Not yet timed.
    gated_sides: bool = False
    # The transposed copy's bytes packed four rows to a 32-bit word in registers (the tile's rows
    # loaded permuted; on the GPU two cvt ...x2.f32 make a word) and exchanged through shared
    # memory as words, where tl.trans of the FP8 tile moves single bytes: SASS instructions a
    # thread, bf16 at 8 warps unmasked (tools/kernel_resources.py, triton 3.9's ptxas), the plain
    # cast 1272 -> 1040, the product 2160 -> 1920, the norm 1528 -> 1296, dg's side 2568 -> 2336
    # (but 128 -> 171 registers there). H100, sixty-second session: on top of the unmasked
    # forms no measurable gain (hf_llama h1024 compiled); the default forms packed not yet timed.
    packed_t: bool = False
    # Whole tiles (M and K multiples of 128) launch a kernel without masks: fewer registers and
    # instructions. With it, 8 warps and no clamp, the plain cast, the product's and the norm's
    # (float32 x) take 127-128 registers (triton 3.9's ptxas, tools/kernel_resources.py), so two
    # programs of 8 warps fit an SM without a cap, which a traced launch cannot pass; at 4 warps
    # the norm's spills 104-280 bytes. H100, sixty-second session, with 8 warps, no clamp and
    # gated_sides (hf_llama.py's "unmasked"): a compiled h1024 step 0.13 ms slower, the two-way
    # casts 1.73 against 1.61 ms.
    even: bool = False

    def __post_init__(self):
        for name, (tm, tk, warps), fixed in (("rows", self.rows, (None, 128)), ("cols", self.cols, (128, None)),
                                             ("tiles", self.tiles, (128, 128))):
            pow2 = all(v > 0 and v & (v - 1) == 0 for v in (tm, tk, warps))
            if not pow2 or any(f is not None and v != f for v, f in zip((tm, tk), fixed)):
                raise ValueError(f"BlockShapes.{name}: (tile rows, tile cols, warps) must be powers of two with "
                                 f"whole blocks per tile ({fixed}, None: any), got {(tm, tk, warps)}")
        warp_fields = [("both", self.both)]
        if not isinstance(self.gated, tuple) or len(self.gated) != 2:
            raise ValueError(f"BlockShapes.gated: (warps of the product's form, of the gradients' form), got "
                             f"{self.gated!r}")
        warp_fields += [("gated", w) for w in self.gated] + [("norm", self.norm)]
        for name, warps in warp_fields:
            if isinstance(warps, bool) or not isinstance(warps, int) or warps < 1 or warps & (warps - 1) or warps > 32:
                raise ValueError(f"BlockShapes.{name}: warps, a power of two up to 32, got {warps!r}")
        if isinstance(self.both_regs, bool) or not isinstance(self.both_regs, int) or \
                not (self.both_regs == 0 or 24 <= self.both_regs <= 255):
            raise ValueError(f"BlockShapes.both_regs: 0 (no cap) or a register cap from 24 to 255, got {self.both_regs!r}")
        for name in ("both_clamp", "even", "gated_sides", "packed_t"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"BlockShapes.{name}: a bool, got {getattr(self, name)!r}")

    def of(self, mode: int) -> Tuple[int, int, int]:
        return (self.rows, self.cols, self.tiles)[mode]

    def both_warps(self, gated: int = 0) -> int:
        """The warps of the two-way cast's form `gated` (its kernel's GATED: 0 plain, 1 the
        gated product, 2 its gradients, 3 the norm's output)."""
        return (self.both, self.gated[0], self.gated[1], self.norm)[gated]


_override = LaunchOverride()  # BlockShapes or None


def launch_shapes() -> BlockShapes:
    """The launch shapes every block cast uses (benchmarks/cast.py --block --variants compares others)."""
    return _override.value or BlockShapes()


def override_shapes(shapes: BlockShapes) -> ContextManager[None]:
    """Use other launch shapes inside the block (benchmark variants, tests); not thread-safe."""
    return _override.using(shapes)


@triton.jit
def _scale_of(bits, FP8_MAX: tl.constexpr, POW2: tl.constexpr):
    """block_reference.block_scale from an amax held as |x| bits (NaN counted as inf)."""
    amax = tl.minimum(bits, _INF_BITS).to(tl.float32, bitcast=True)
    return compute_scale(amax, 1.0, FP8_MAX, 1.0, POW2)  # 1 where the amax is 0 or not finite


@triton.jit
def _scaled(x, scale, FP8_MAX: tl.constexpr, CLAMP: tl.constexpr):
    """x * scale for an FP8 conversion: clamped (_saturate), or not where the conversion
    saturates by itself (BlockShapes.both_clamp)."""
    if CLAMP:
        return _saturate(x, scale, FP8_MAX)
    return x * scale


@triton.jit
def _block_cast_kernel(
    x_ptr,      # (M, K) bf16/fp16/fp32, row stride stride_xm, unit column stride
    out_ptr,    # (M, K) fp8, row-major
    sinv_ptr,   # (blocks of M, blocks of K) float32 scale_inv, strides (stride_sr, stride_sc)
    M, K, stride_xm, stride_sr, stride_sc,
    MODE: tl.constexpr, FP8_MAX: tl.constexpr, POW2: tl.constexpr,
    TILE_M: tl.constexpr, TILE_K: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_k = tl.cdiv(K, TILE_K)
    row0 = (pid // tiles_k) * TILE_M
    col0 = (pid % tiles_k) * TILE_K
    r = row0 + tl.arange(0, TILE_M)
    c = col0 + tl.arange(0, TILE_K)
    inside = (r < M)[:, None] & (c < K)[None, :]
    x = tl.load(x_ptr + tl.cast(r, tl.int64)[:, None] * stride_xm + c[None, :], mask=inside,
                other=0.0).to(tl.float32)
    bits = _abs_bits(x)
    if MODE == 0:  # (1, 128): a scale per row; the tile is one block wide
        scale = _scale_of(tl.max(bits, axis=1), FP8_MAX, POW2)  # (TILE_M,)
        y = _saturate(x, scale[:, None], FP8_MAX)
        tl.store(sinv_ptr + tl.cast(r, tl.int64) * stride_sr + (col0 // 128) * stride_sc, tl.math.div_rn(1.0, scale),
                 mask=r < M)
    elif MODE == 1:  # (128, 1): a scale per column; the tile is one block tall
        scale = _scale_of(tl.max(bits, axis=0), FP8_MAX, POW2)  # (TILE_K,)
        y = _saturate(x, scale[None, :], FP8_MAX)
        tl.store(sinv_ptr + (row0 // 128) * stride_sr + tl.cast(c, tl.int64) * stride_sc, tl.math.div_rn(1.0, scale),
                 mask=c < K)
    else:  # (128, 128): the tile is the block
        scale = _scale_of(tl.max(tl.max(bits, axis=1), axis=0), FP8_MAX, POW2)
        y = _saturate(x, scale, FP8_MAX)
        tl.store(sinv_ptr + (row0 // 128) * stride_sr + (col0 // 128) * stride_sc, tl.math.div_rn(1.0, scale))
    tl.store(out_ptr + tl.cast(r, tl.int64)[:, None] * K + c[None, :], y.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _round_to(x, DTYPE: tl.constexpr):
    """x (float32) rounded to the dtype of code DTYPE (_ROUND_CODES), as float32."""
    if DTYPE == 1:
        x = x.to(tl.bfloat16).to(tl.float32)
    elif DTYPE == 2:
        x = x.to(tl.float16).to(tl.float32)
    return x


@triton.jit
def _gated_tile(x_ptr, x1_ptr, x2_ptr, r, c, col0, in_r, in_c, inside, K1, stride_xm, stride_x1m, stride_x2m,
                GATED: tl.constexpr, ACT: tl.constexpr, SIDE: tl.constexpr):
    """The two-way cast's tile computed from other tensors (_block_cast_both_kernel's GATED),
    float32, rounded to the dtype the unfused kernel or formula would have stored it in: a
    gated MLP's (gated.py's kernels' arithmetic, x_ptr's dtype), or an RMS norm's output
    (rms_norm_formula's, with its rstd given)."""
    if GATED == 3:  # an RMS norm's output: weight (x1_ptr) * (x * rstd (x2_ptr), rounded to x's dtype)
        v = tl.load(x_ptr + r * stride_xm + c[None, :], mask=inside, other=0.0).to(tl.float32)
        rstd = tl.load(x2_ptr + r, mask=in_r[:, None], other=0.0)
        h = (v * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(x1_ptr + c, mask=in_c, other=0.0).to(tl.float32)[None, :]
        # ACT: the product's dtype (torch's promotion of weight and x); lanes past M or K give +0
        # (the transposed copy's zero padding), where a negative weight times 0 would give -0
        return tl.where(inside, _round_to(w * h, ACT), 0.0)
    if GATED == 1:  # act(g) * u; g at x_ptr, u at x1_ptr
        g = tl.load(x_ptr + r * stride_xm + c[None, :], mask=inside, other=0.0).to(tl.float32)
        u = tl.load(x1_ptr + r * stride_x1m + c[None, :], mask=inside, other=0.0).to(tl.float32)
        x = _gated_act(g, ACT) * u
    else:  # columns 0..K1: dg, K1..2 K1: du, of one (M, K1) element each; da, g, u at x_ptr, x1_ptr, x2_ptr
        # SIDE 1 or 2: this launch's tiles are all dg's or all du's (a constexpr: one side's
        # code alone holds fewer registers than the run-time choice between the two, SIDE 0)
        if SIDE == 0:
            dg_side = col0 < K1
            k = c - tl.where(dg_side, 0, K1)
        elif SIDE == 1:
            dg_side = True
            k = c
        else:
            dg_side = False
            k = c - K1
        d = tl.load(x_ptr + r * stride_xm + k[None, :], mask=inside, other=0.0).to(tl.float32)
        g = tl.load(x1_ptr + r * stride_x1m + k[None, :], mask=inside, other=0.0).to(tl.float32)
        if dg_side:
            u = tl.load(x2_ptr + r * stride_x2m + k[None, :], mask=inside, other=0.0).to(tl.float32)
            x = _gated_dg(d, g, u, ACT)
        else:
            x = _gated_du(d, g, ACT)
    return x.to(x_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _fp8x4(a0, a1, a2, a3, FP8: tl.constexpr, PTX: tl.constexpr):
    """Four float32 tensors of one shape converted to FP8 (saturating, round to nearest
    even) and packed into int32 words, a0's byte the lowest (little-endian: a0..a3 in
    memory order). PTX: two cvt.rn.satfinite ...x2.f32, the conversion Triton's own emits
    (a, b -> a's byte high, b's low), the word made of their halves; else the conversion and
    shifts (the interpreter)."""
    if PTX and FP8 == tl.float8e5:
        words = tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; cvt.rn.satfinite.e5m2x2.f32 lo, $2, $1; cvt.rn.satfinite.e5m2x2.f32 hi, $4, $3; "
            "mov.b32 $0, {lo, hi}; }", "=r,r,r,r,r", [a0, a1, a2, a3], dtype=tl.int32, is_pure=True, pack=1)
    elif PTX:
        words = tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; "
            "mov.b32 $0, {lo, hi}; }", "=r,r,r,r,r", [a0, a1, a2, a3], dtype=tl.int32, is_pure=True, pack=1)
    else:
        b0 = a0.to(FP8).to(tl.uint8, bitcast=True).to(tl.int32)
        b1 = a1.to(FP8).to(tl.uint8, bitcast=True).to(tl.int32)
        b2 = a2.to(FP8).to(tl.uint8, bitcast=True).to(tl.int32)
        b3 = a3.to(FP8).to(tl.uint8, bitcast=True).to(tl.int32)
        words = b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)
    return words


@triton.jit
def _block_cast_both_kernel(
    x_ptr,       # (M, K1) bf16/fp16/fp32, row stride stride_xm, unit column stride: columns 0..K1 of x
    x1_ptr,      # (M, K2 - K1) likewise, row stride stride_x1m: columns K1..K2 (PARTS > 1)
    x2_ptr,      # (M, K - K2) likewise, row stride stride_x2m: columns K2..K (PARTS > 1)
    out_ptr,     # (M, K) fp8, row-major: x in 1 x 128 blocks
    out_t_ptr,   # (K, Mp) fp8, row-major: x in 128 x 1 blocks, transposed; zero in columns M..Mp
    sinv_ptr,    # (M, Kb) float32, strides (stride_sr, stride_sc)
    sinv_t_ptr,  # (Mb, K) float32, row-major
    M, K, K1, K2, stride_xm, stride_x1m, stride_x2m, stride_sr, stride_sc, out_t_cols,
    FP8_MAX: tl.constexpr, POW2: tl.constexpr, PARTS: tl.constexpr, CLAMP: tl.constexpr,
    GATED: tl.constexpr, ACT: tl.constexpr, EVEN: tl.constexpr, SIDE: tl.constexpr, PACK: tl.constexpr,
    COLS: tl.constexpr, KEEP: tl.constexpr,
):
    """Modes 0 and 1 of _block_cast_kernel over one 128 x 128 tile held in registers, the
    second cast stored transposed (what a 1 x 128 cast, a 128 x 1 cast and a byte transpose
    give). With PARTS > 1, x comes as up to three column-stacked parts (a stacked tie's
    output gradients, modules/stacked.py; K1 and K2 multiples of 128, so each tile reads one
    part), read where they lie rather than from a concatenated copy; PARTS = 1 reads x_ptr
    alone (the other parts' arguments unused).

    GATED computes the tile from a gated MLP's tensors instead of loading it (ACT: the
    activation's code, gated.py's), each value rounded to x_ptr's dtype first, as the
    unfused kernels store it (gated_reference): 1, the forward's act(g) * u, g at x_ptr and u
    at x1_ptr, (M, K) each; 2, the backward's dg | du side by side (K = 2 K1), from da at
    x_ptr, g at x1_ptr, u at x2_ptr, (M, K1) each; 3, an RMS norm's output weight * (x *
    rstd, rounded to x's dtype), rounded to the dtype of code ACT (_ROUND_CODES), from x at
    x_ptr, weight (K,) at x1_ptr and rstd (M,) float32 at x2_ptr (rms_norm_formula's, given).
    SIDE (GATED 2 only; 0 otherwise): 1 or 2, this launch casts dg's tiles or du's alone,
    over a grid of M's and K1's tiles (BlockShapes.gated_sides: two launches).

    Each scale is computed once: a row's or column's amax, reduced in the tile's layout, sits
    in every thread that shares the row or column, and computing the scale there (two IEEE
    divisions) was a third of the kernel's instructions. So the 256 amaxes go through the
    tile's own scale_inv slots and come back one per thread, whose scales go out and back
    the same way; the slots end with 1 / scale. bar.sync orders the CTA's global stores
    before its later loads; .cg reads them from L2, where they went. (H200, 2026-12-02: 34 ->
    17 instructions an element, 58% -> 72-80% of a copy's bandwidth at h2048's sizes.)

    PACK (BlockShapes.packed_t): 0, the transposed copy from tl.trans of the FP8 tile (a byte
    a thread per element through shared memory, a quarter of the kernel's instructions); 1
    or 2, packed in registers: the tile's rows loaded permuted, so that a thread's four
    register rows are four consecutive rows of x, whose bytes of one column make a 32-bit
    word of the transposed copy; the words go through shared memory. 2 converts with PTX
    (_fp8x4), 1 with shifts (the interpreter, which has no inline PTX).

    COLS 0: the 1 x 128 cast alone (sinv_t_ptr unused): a stacked tie's parts, or a computed
    tile, for a wgrad that does not read the transposed copy (BlockScaling(fp8_wgrad=False)).
    KEEP (COLS 0 only): out_t_ptr is an (M, K) row-major tensor of the activations' dtype that
    takes the tile's values (a computed tile's product, dg | du or norm output, for that
    wgrad to read), where it is otherwise unused."""
    pid = tl.program_id(0)
    if SIDE != 0:  # GATED 2, one side's tiles: a grid over K1's columns, du's from column K1
        tiles_k = K1 // 128
        col0 = (pid % tiles_k) * 128 + (K1 if SIDE == 2 else 0)
    else:
        tiles_k = tl.cdiv(K, 128)
        col0 = (pid % tiles_k) * 128
    row0 = (pid // tiles_k) * 128
    if PACK:  # tile row 32 j + q holds row 4 q + j: a thread's register rows j = 0..3 (of q) are consecutive
        lr = tl.arange(0, 128)
        r = row0 + 4 * (lr % 32) + lr // 32
    else:
        r = row0 + tl.arange(0, 128)
    c = col0 + tl.arange(0, 128)
    i = tl.arange(0, 256) % 128  # the scale exchange's lanes: 0..127 the rows' slots, 128..255 the columns'
    is_row = tl.arange(0, 256) < 128
    if EVEN:  # whole tiles: constant masks, which the compiler drops
        in_r = tl.full([128], 1, tl.int1)
        in_c = tl.full([128], 1, tl.int1)
        used = tl.full([256], 1, tl.int1) if COLS else is_row
    else:
        in_r = r < M
        in_c = c < K
        used = tl.where(is_row, row0 + i < M, (col0 + i < K) & COLS)
    inside = in_r[:, None] & in_c[None, :]
    if GATED != 0:
        x = _gated_tile(x_ptr, x1_ptr, x2_ptr, tl.cast(r, tl.int64)[:, None], c, col0, in_r, in_c, inside, K1,
                        stride_xm, stride_x1m, stride_x2m, GATED, ACT, SIDE)
    elif PARTS == 1:
        x = tl.load(x_ptr + tl.cast(r, tl.int64)[:, None] * stride_xm + c[None, :], mask=inside,
                    other=0.0).to(tl.float32)
    else:
        start = tl.where(col0 < K1, 0, tl.where(col0 < K2, K1, K2))
        src = tl.where(col0 < K1, x_ptr, tl.where(col0 < K2, x1_ptr, x2_ptr))
        stride = tl.where(col0 < K1, stride_xm, tl.where(col0 < K2, stride_x1m, stride_x2m))
        x = tl.load(src + tl.cast(r, tl.int64)[:, None] * stride + (c - start)[None, :], mask=inside,
                    other=0.0).to(tl.float32)
    bits = _abs_bits(x)
    row_slots = sinv_ptr + tl.cast(r, tl.int64) * stride_sr + (col0 // 128) * stride_sc
    col_slots = sinv_t_ptr + (row0 // 128) * K + c
    tl.store(row_slots.to(tl.pointer_type(tl.int32), bitcast=True), tl.max(bits, axis=1), mask=in_r)
    if COLS:
        tl.store(col_slots.to(tl.pointer_type(tl.int32), bitcast=True), tl.max(bits, axis=0), mask=in_c)
    tl.debug_barrier()
    slot = tl.where(is_row, sinv_ptr + tl.cast(row0 + i, tl.int64) * stride_sr + (col0 // 128) * stride_sc,
                    sinv_t_ptr + (row0 // 128) * K + col0 + i)
    amax_bits = tl.load(slot.to(tl.pointer_type(tl.int32), bitcast=True), mask=used, other=0, cache_modifier=".cg")
    scale = _scale_of(amax_bits, FP8_MAX, POW2)
    tl.store(slot, scale, mask=used)
    tl.debug_barrier()
    row_scale = tl.load(row_slots, mask=in_r, other=1.0, cache_modifier=".cg")
    if COLS:
        col_scale = tl.load(col_slots, mask=in_c, other=1.0, cache_modifier=".cg")
    y = _scaled(x, row_scale[:, None], FP8_MAX, CLAMP)
    tl.store(out_ptr + tl.cast(r, tl.int64)[:, None] * K + c[None, :], y.to(out_ptr.dtype.element_ty), mask=inside)
    if KEEP:
        tl.store(out_t_ptr + tl.cast(r, tl.int64)[:, None] * K + c[None, :], x.to(out_t_ptr.dtype.element_ty),
                 mask=inside)
    # rows M..Mp of the tile loaded 0: their bytes are out_t's zero padding
    if COLS:
        if PACK:
            # (rows 4 q + j, columns) -> 4 x (q, columns), then one word of rows 4 q..4 q + 3 each
            t = tl.reshape(_scaled(x, col_scale[None, :], FP8_MAX, CLAMP), (4, 32, 128))
            even_j, odd_j = tl.split(tl.reshape(tl.permute(t, (1, 2, 0)), (32, 128, 2, 2)))
            t0, t2 = tl.split(even_j)
            t1, t3 = tl.split(odd_j)
            words = _fp8x4(t0, t1, t2, t3, out_t_ptr.dtype.element_ty, PACK == 2)  # (q, columns)
            q = row0 // 4 + tl.arange(0, 32)
            tl.store(out_t_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + tl.cast(c, tl.int64)[:, None] *
                     (out_t_cols // 4) + q[None, :], tl.trans(words), mask=in_c[:, None])
        else:
            y_t = tl.trans(_scaled(x, col_scale[None, :], FP8_MAX, CLAMP).to(out_t_ptr.dtype.element_ty))
            tl.store(out_t_ptr + tl.cast(c, tl.int64)[:, None] * out_t_cols + r[None, :], y_t, mask=in_c[:, None])
    tl.debug_barrier()  # every thread has read its scales before the slots change
    tl.store(slot, tl.math.div_rn(1.0, scale), mask=used)


@triton.jit
def _weight_tiles_kernel(
    x_ptr,       # (M1, K) bf16/fp16/fp32, row stride stride_xm, unit column stride: rows 0..M1 of x
    x1_ptr,      # (M2 - M1, K) likewise: rows M1..M2 of x (a stacked weight's second part)
    x2_ptr,      # (M - M2, K) likewise: rows M2..M (its third part)
    out_ptr,     # (M, K) fp8, row-major: x in 128 x 128 tiles
    out_t_ptr,   # (K, Mp) fp8, row-major: out's bytes transposed, zero in columns M..Mp (TRANSPOSE)
    sinv_ptr,    # (Mb, Kb4) float32 row-major: the tiles' scale_inv, 1 in columns Kb..Kb4
    sinv_t_ptr,  # (Kb, Mb4) float32 row-major: the same transposed, 1 in columns Mb..Mb4 (TRANSPOSE)
    M, K, M1, M2, stride_xm, out_t_cols,
    FP8_MAX: tl.constexpr, POW2: tl.constexpr, TRANSPOSE: tl.constexpr,
):
    """A weight's 128 x 128 tile cast (mode 2 of _block_cast_kernel) with what both of its
    GEMMs read, from one launch: the payload, its bytes transposed (the dgrad's W^T), and the
    tile scales laid out as cuBLASLt's block scaling takes a B operand's, rows padded to a
    multiple of 4 (gemm.tile_scales sees them as (Kb4, Mb) with strides (1, Kb4) without a
    copy): where the byte transpose and two padded copies per step were three more launches.
    x may come in up to three parts stacked along the rows (modules/stacked.py's weights,
    M1 and M2 multiples of 128, so each tile reads one part; one part: M1 = M2 = M), read
    where they lie rather than from a concatenated copy."""
    pid = tl.program_id(0)
    tiles_k = tl.cdiv(K, 128)
    rb = pid // tiles_k
    cb = pid % tiles_k
    r = rb * 128 + tl.arange(0, 128)
    c = cb * 128 + tl.arange(0, 128)
    inside = (r < M)[:, None] & (c < K)[None, :]
    start = tl.where(rb * 128 < M1, 0, tl.where(rb * 128 < M2, M1, M2))
    src = tl.where(rb * 128 < M1, x_ptr, tl.where(rb * 128 < M2, x1_ptr, x2_ptr))
    x = tl.load(src + tl.cast(r - start, tl.int64)[:, None] * stride_xm + c[None, :], mask=inside,
                other=0.0).to(tl.float32)
    scale = _scale_of(tl.max(tl.max(_abs_bits(x), axis=1), axis=0), FP8_MAX, POW2)
    y = _saturate(x, scale, FP8_MAX).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + tl.cast(r, tl.int64)[:, None] * K + c[None, :], y, mask=inside)
    kb4 = tl.cdiv(tiles_k, 4) * 4
    pad = tl.arange(0, 4)
    sinv = tl.math.div_rn(1.0, scale)
    tl.store(sinv_ptr + rb * kb4 + cb, sinv)
    # the last tile of a row of tiles writes the row's padding
    tl.store(sinv_ptr + rb * kb4 + tiles_k + pad, tl.full([4], 1.0, tl.float32),
             mask=(tiles_k + pad < kb4) & (pad * 0 + cb == tiles_k - 1))
    if TRANSPOSE:
        # The bytes just stored, read back transposed, not tl.trans(y): with float32 x, Triton
        # 3.6's code for the transposed FP8 values was wrong in whole rows on the H200
        # (2026-12-02; bf16 x was right). Rows M..Mp load 0: out_t's zero padding.
        i = tl.arange(0, 128)
        store_transposed_tile(out_ptr + tl.cast(rb * 128, tl.int64) * K + cb * 128,
                              out_t_ptr + tl.cast(cb * 128, tl.int64) * out_t_cols + rb * 128, K, out_t_cols, i, i,
                              r < M, c < K, r < out_t_cols)
        tiles_m = tl.cdiv(M, 128)
        mb4 = tl.cdiv(tiles_m, 4) * 4
        tl.store(sinv_t_ptr + cb * mb4 + rb, sinv)
        tl.store(sinv_t_ptr + cb * mb4 + tiles_m + pad, tl.full([4], 1.0, tl.float32),
                 mask=(tiles_m + pad < mb4) & (pad * 0 + rb == tiles_m - 1))


@functools.lru_cache(maxsize=None)
def _weight_kernel(fp8_max: float, pow2: bool, transpose: bool, warps: int) -> DirectKernel:
    return DirectKernel(_weight_tiles_kernel, num_warps=warps, FP8_MAX=fp8_max, POW2=pow2, TRANSPOSE=transpose)


# the Triton interpreter: its FP8 conversion does not saturate (there the two-way cast always
# clamps), and it runs no inline PTX (there the packed transposed copy packs with shifts)
_INTERPRETED = not isinstance(_block_cast_both_kernel, triton.runtime.jit.JITFunction)


def _both_kernel(fp8_max: float, pow2: bool, shapes: BlockShapes, shape: Tuple[int, int], parts: int = 1,
                 gated: int = 0, act: int = 0, side: int = 0, word_aligned: bool = True, cols: bool = True,
                 keep: bool = False) -> DirectKernel:
    """The two-way cast of an (M, K) `shape` under `shapes` (its warps, register cap and clamp;
    gated forms: their warps, no cap, as a traced launch cannot pass one), specialized on
    whole tiles (M and K multiples of 128: no masks); side: the kernel's SIDE; word_aligned:
    whether the transposed copy starts on a 4-byte boundary (packed_t stores it in words);
    cols, keep: the kernel's COLS (False: no transposed copy, so nothing to pack) and KEEP."""
    clamp = shapes.both_clamp or _INTERPRETED
    even = shapes.even and shape[0] % 128 == 0 and shape[1] % 128 == 0
    pack = (1 if _INTERPRETED else 2) if shapes.packed_t and word_aligned and cols else 0
    if gated:
        return _both_binary(fp8_max, pow2, shapes.both_warps(gated), None, clamp, parts, gated, act, even, side,
                            pack, cols, keep)
    return _both_binary(fp8_max, pow2, shapes.both, shapes.both_regs or None, clamp, parts, 0, 0, even, 0, pack,
                        cols, keep)


@functools.lru_cache(maxsize=None)
def _both_binary(fp8_max: float, pow2: bool, warps: int, regs, clamp: bool, parts: int, gated: int,
                 act: int, even: bool, side: int, pack: int, cols: bool = True, keep: bool = False) -> DirectKernel:
    return DirectKernel(_block_cast_both_kernel, num_warps=warps, maxnreg=regs, FP8_MAX=fp8_max, POW2=pow2,
                        PARTS=parts, CLAMP=clamp, GATED=gated, ACT=act, EVEN=even, SIDE=side, PACK=pack, COLS=cols,
                        KEEP=keep)


@functools.lru_cache(maxsize=None)
def _kernel(mode: int, fp8_max: float, pow2: bool, shape: Tuple[int, int, int]) -> DirectKernel:
    tile_m, tile_k, warps = shape
    return DirectKernel(_block_cast_kernel, num_warps=warps, MODE=mode, FP8_MAX=fp8_max, POW2=pow2, TILE_M=tile_m,
                        TILE_K=tile_k)


MAX_PARTS = 3  # the most row-stacked parts one weight tile cast reads (q/k/v)


def _stacked(parts, dim: int, fn: str) -> Tuple[list, int, int, int]:
    """(parts, total, end1, end2) of x given as one 2-D tensor or up to MAX_PARTS parts stacked
    along `dim` (0: rows, 1: columns), of one dtype, device and size along the other dim, each
    but the last a multiple of 128 along `dim`: the kernels' x, x1, x2, M or K, and M1, M2 or
    K1, K2 (the first two parts' ends; the total where parts are absent). fn: the caller, for
    the errors."""
    parts = [parts] if isinstance(parts, torch.Tensor) else list(parts)
    if not parts or len(parts) > MAX_PARTS or any(p.dim() != 2 for p in parts):
        raise ValueError(f"{fn}: x must be a 2-D tensor or 1 to {MAX_PARTS} 2-D parts, got "
                         f"{[tuple(p.shape) for p in parts]}")
    first = parts[0]
    if any(p.shape[1 - dim] != first.shape[1 - dim] or p.dtype != first.dtype or p.device != first.device
           for p in parts):
        raise ValueError(f"{fn}: x's parts must share their {('column', 'row')[dim]} count, dtype and device")
    if any(p.shape[dim] % 128 for p in parts[:-1]):
        raise ValueError(f"{fn}: every part but the last needs a multiple of 128 {('rows', 'columns')[dim]}, got "
                         f"{[p.shape[dim] for p in parts]}")
    ends = [sum(p.shape[dim] for p in parts[:i + 1]) for i in range(len(parts))]
    total = ends[-1]
    ends = (ends + [total, total])[:MAX_PARTS]
    return parts, total, ends[0], ends[1]


def weight_tiles_into(x, out: torch.Tensor, scales: torch.Tensor, out_t=None, scales_t=None,
                      power_of_two: bool = False, traced: bool = False) -> None:
    """x (M, K) in 128 x 128 tiles into out (M, K) fp8 and scales (Mb, Kb4) (Kb4: Kb rounded up
    to 4; the tiles' scale_inv in its first Kb columns, 1 in the rest); with out_t (K, Mp) (Mp >= M
    a multiple of 16) and scales_t (Kb, Mb4) also the payload's bytes transposed (zero in
    columns M..Mp) and the scales transposed, likewise padded. x may be a list of up to
    MAX_PARTS row-stacked parts (each but the last a multiple of 128 rows: a stacked weight's
    members, read in place). One launch of the Triton kernel (twin: kernels.weight_tiles
    dispatches). traced: as block_cast_into's."""
    parts, m, m1, m2 = _stacked(x, 0, "weight_tiles_into")
    if len(parts) > 1:  # one row stride for all
        parts = [p if p.is_contiguous() else p.contiguous() for p in parts]
    x = parts[0]
    k = x.shape[1]
    x_shape = (m, k)
    mb, kb = -(-m // 128), -(-k // 128)
    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    if out.shape != x_shape or out.dtype not in fp8 or not out.is_contiguous():
        raise ValueError(f"weight_tiles_into: out must be a contiguous fp8 tensor of x's shape {x_shape}")
    want = [("scales", scales, (mb, -(-kb // 4) * 4))]
    if (out_t is None) != (scales_t is None):
        raise ValueError("weight_tiles_into: out_t and scales_t come together")
    if out_t is not None:
        if out_t.dim() != 2 or out_t.shape[0] != k or out_t.shape[1] < m or out_t.shape[1] % 16 or \
                out_t.dtype != out.dtype or not out_t.is_contiguous():
            raise ValueError(f"weight_tiles_into: out_t must be a contiguous {out.dtype} tensor ({k}, Mp), Mp >= {m} "
                             f"a multiple of 16, got {tuple(out_t.shape)}")
        want.append(("scales_t", scales_t, (kb, -(-mb // 4) * 4)))
    for name, t, shape in want:
        if tuple(t.shape) != shape or t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"weight_tiles_into: {name} must be a contiguous float32 tensor of shape {shape}")
    if x.stride(1) != 1 and k > 1:
        x = x.contiguous()
    if m * k == 0:
        return
    transpose = out_t is not None
    kernel = _weight_kernel(scaling.fp8_max(out.dtype), bool(power_of_two), transpose, launch_shapes().tiles[2])
    # absent parts: the last one again (no tile reads it); one part: x itself throughout
    xs = (x, *parts[1:], *parts[-1:] * (MAX_PARTS - len(parts))) if len(parts) > 1 else (x,) * MAX_PARTS
    args = (*xs, out, out_t if transpose else out, scales, scales_t if transpose else scales, m, k, m1, m2,
            x.stride(0) if m > 1 else k, out_t.shape[1] if transpose else 16)
    if traced:
        kernel.traced(mb * kb, *args)
        return
    with device_guard(x.device):
        kernel(mb * kb, *args)


class _Hole:
    """Stands in for one of a C++ call's own tensors while a launch's fixed arguments are read."""

    def __init__(self, name: str):
        self.name = name


# csrc/linear_node.cpp's Hole order
_NATIVE_HOLES = (_Hole("x"), _Hole("data"), _Hole("data_t"), _Hole("scale_inv"), _Hole("scale_inv_t"))


def native_launch(shape, x_dtype: torch.dtype, fp8_dtype: torch.dtype, transpose: bool, power_of_two: bool,
                  device: torch.device, tiles: bool = False):
    """The C++ launch (kernels.native.launch_spec: (Launch arguments, fixed tensors)) of one
    block cast of a contiguous (M, K) `shape` input, into the outputs as csrc/linear_node.cpp's
    block_cast allocates them: payload (M, K), scale_inv (M, Kb) column-major, and with
    `transpose` the transposed copy (K, Mp) and its (Mb, K) scales (block_cast_both_into's
    launch; else block_cast_into's 1 x 128). tiles: a weight's 128 x 128 tile cast into its
    workspace instead (weight_tiles_into's launch: padded scale buffers (Mb, round_up(Kb, 4)),
    with `transpose` the transposed copy (K, padded_rows(M)) and (Kb, round_up(Mb, 4)) scales).
    Holes: x, data, data_t, scale_inv, scale_inv_t. None where the C++ launcher cannot make it
    (see launch_spec)."""
    from . import native
    m, k = shape
    fp8_max, pow2 = scaling.fp8_max(fp8_dtype), bool(power_of_two)
    # the binary is specialised on the arguments' dtypes and 16-byte alignment (and the ints):
    # small aligned stand-ins compile the one the call's own tensors get
    like = lambda dtype: torch.empty(16, dtype=dtype, device=device)  # noqa: E731
    x, data, data_t, scale_inv, scale_inv_t = _NATIVE_HOLES
    if tiles:
        kernel = _weight_kernel(fp8_max, pow2, bool(transpose), launch_shapes().tiles[2])
        grid = triton.cdiv(m, 128) * triton.cdiv(k, 128)
        ints = (m, k, m, m, k, padded_rows(m) if transpose else 16)  # one part: M1 = M2 = M
        samples = (like(x_dtype), like(x_dtype), like(x_dtype), like(fp8_dtype), like(fp8_dtype),
                   like(torch.float32), like(torch.float32))
        holes = (x, x, x, data, data_t, scale_inv, scale_inv_t) if transpose else \
            (x, x, x, data, data, scale_inv, scale_inv)
    elif transpose:
        kernel = _both_kernel(fp8_max, pow2, launch_shapes(), (m, k))
        grid = triton.cdiv(m, 128) * triton.cdiv(k, 128)
        ints = (m, k, k, k, k, k, k, 1, m, -(-m // 128) * 128)  # one part: K1 = K2 = K, strides K
        samples = (like(x_dtype), like(x_dtype), like(x_dtype), like(fp8_dtype), like(fp8_dtype),
                   like(torch.float32), like(torch.float32))
        holes = (x, x, x, data, data_t, scale_inv, scale_inv_t)
    else:
        tiles = launch_shapes().of(_ROWS)
        kernel = _kernel(_ROWS, fp8_max, pow2, tiles)
        grid = triton.cdiv(m, tiles[0]) * triton.cdiv(k, tiles[1])
        ints = (m, k, k, 1, m)
        samples = (like(x_dtype), like(fp8_dtype), like(torch.float32))
        holes = (x, data, scale_inv)
    with device_guard(device):
        binary = kernel.binary_for(*samples, *ints)
    return None if binary is None else native.launch_spec(binary, grid, (*holes, *ints), _NATIVE_HOLES)


def _dense_2d(t: torch.Tensor) -> bool:
    """t (rows, cols) row-major, or column-major (the GEMM's layout of 1 x 128 scales)."""
    return t.is_contiguous() or t.t().is_contiguous()


def block_cast_into(x: torch.Tensor, out: torch.Tensor, scale_inv_out: torch.Tensor, block, power_of_two: bool = False,
                    traced: bool = False) -> None:
    """block_reference.block_cast into given buffers, by the Triton kernel: out (M, K) fp8,
    scale_inv_out (float32, block_reference.blocks_of(x.shape, block)); x (M, K). Callers
    dispatch (kernels.block_cast: the twin off CUDA). traced: launched as a triton_op's body
    launches (DirectKernel.traced)."""
    block = tuple(block)
    if x.dim() != 2 or block not in _MODES:
        raise ValueError(f"block_cast_into: x must be 2-D and block one of {tuple(_MODES)}; got "
                         f"{tuple(x.shape)} and {block}")
    if out.shape != x.shape or out.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2) or not out.is_contiguous():
        raise ValueError(f"block_cast_into: out must be a contiguous fp8 tensor of x's shape {tuple(x.shape)}")
    grid_shape = block_reference.blocks_of(x.shape, block)
    if (tuple(scale_inv_out.shape) != grid_shape or scale_inv_out.dtype != torch.float32
            or not _dense_2d(scale_inv_out)):
        raise ValueError(f"block_cast_into: scale_inv_out must be a float32 tensor of shape {grid_shape}, row- or "
                         "column-major")
    if x.stride(1) != 1 and x.shape[1] > 1:
        x = x.contiguous()
    if x.numel() == 0:
        return
    mode = _MODES[block]
    shape = launch_shapes().of(mode)
    tile_m, tile_k, _ = shape
    m, k = x.shape
    grid = triton.cdiv(m, tile_m) * triton.cdiv(k, tile_k)
    kernel = _kernel(mode, scaling.fp8_max(out.dtype), bool(power_of_two), shape)
    args = (x, out, scale_inv_out, m, k, x.stride(0) if m > 1 else k, *scale_inv_out.stride())
    if traced:
        kernel.traced(grid, *args)
        return
    with device_guard(x.device):
        kernel(grid, *args)


def block_cast_both_into(x, out: torch.Tensor, out_t: torch.Tensor, scale_inv_out: torch.Tensor,
                         scale_inv_t_out: torch.Tensor, power_of_two: bool = False, traced: bool = False) -> None:
    """x (M, K) in 1 x 128 blocks into out (M, K) and scale_inv_out (M, Kb), and in 128 x 1
    blocks transposed into out_t (K, Mp) (Mp = M rounded up to 128, zero bytes beyond M) and
    scale_inv_t_out (Mb, K): one read of x, by the Triton kernel (twin: two block_cast calls
    and a byte transpose; kernels.block_cast_both dispatches). x may be a list of up to
    MAX_PARTS column-stacked parts (each but the last a multiple of 128 columns: a stacked
    tie's output gradients, read in place). out_t and scale_inv_t_out None: the 1 x 128 cast
    alone (parts for BlockScaling(fp8_wgrad=False)). traced: as block_cast_into's."""
    parts, k, k1, k2 = _stacked(x, 1, "block_cast_both_into")
    _launch_both(parts, (parts[0].shape[0], k), k1, k2, out, out_t, scale_inv_out, scale_inv_t_out, power_of_two,
                 traced, "block_cast_both_into", len(parts))


def gated_block_cast_into(g: torch.Tensor, u: torch.Tensor, act: str, out: torch.Tensor, out_t: torch.Tensor,
                          scale_inv_out: torch.Tensor, scale_inv_t_out: torch.Tensor, power_of_two: bool = False,
                          traced: bool = False, keep: Optional[torch.Tensor] = None) -> None:
    """block_cast_both_into of a gated MLP's product act(g) * u (g's dtype, as gated.py's
    kernel rounds it), computed in the cast's own read of g and u, so the product is never
    stored: g and u (M, K) of one dtype, row strides of their own (the stacked gate/up GEMM's
    halves). keep (M, K), with out_t and scale_inv_t_out None: the product stored there too,
    in keep's dtype. Twin: gated_reference.gated_forward rounded to g's dtype, then
    block_cast_both."""
    gated_reference.check_cast_args("gated_block_cast_into", act, g, u)
    _launch_both((g, u, u), tuple(g.shape), g.shape[1], g.shape[1], out, out_t, scale_inv_out, scale_inv_t_out,
                 power_of_two, traced, "gated_block_cast_into", 1, 1, _GATED_ACT_CODES[act], keep)


def gated_grad_block_cast_into(da: torch.Tensor, g: torch.Tensor, u: torch.Tensor, act: str, out: torch.Tensor,
                               out_t: torch.Tensor, scale_inv_out: torch.Tensor, scale_inv_t_out: torch.Tensor,
                               power_of_two: bool = False, traced: bool = False,
                               keep: Optional[torch.Tensor] = None) -> None:
    """block_cast_both_into of the gated product's gradients side by side, dg | du (M, 2 K),
    each in g's dtype (gated.py's backward kernel rounds them so), computed in the cast's own
    reads of da, g and u (M, K each, K a multiple of 128: every tile is one side's), so
    neither gradient is stored (keep (M, 2 K), with out_t and scale_inv_t_out None: stored
    there, in keep's dtype). Twin: gated_reference.gated_grads rounded, concatenated, then
    block_cast_both."""
    gated_reference.check_cast_args("gated_grad_block_cast_into", act, da, g, u, whole_blocks=True)
    k = g.shape[1]
    _launch_both((da, g, u), (g.shape[0], 2 * k), k, k, out, out_t, scale_inv_out, scale_inv_t_out, power_of_two,
                 traced, "gated_grad_block_cast_into", 1, 2, _GATED_ACT_CODES[act], keep)


# the dtype a computed tile is rounded to (GATED 3's ACT)
_ROUND_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def norm_block_cast_into(x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, out_dtype: torch.dtype,
                         out: torch.Tensor, out_t: torch.Tensor, scale_inv_out: torch.Tensor,
                         scale_inv_t_out: torch.Tensor, power_of_two: bool = False, traced: bool = False,
                         keep: Optional[torch.Tensor] = None) -> None:
    """block_cast_both_into of an RMS norm's output y = weight * (x * rstd rounded to x's
    dtype), rounded to out_dtype (rms_norm_formula's arithmetic, its rstd given), computed in
    the cast's read of x, so y is never stored: x (M, K) any row stride, weight (K,), rstd
    (M,) float32. keep (M, K), with out_t and scale_inv_t_out None: y stored there too, in
    keep's dtype. Twin: that product in torch ops, then block_cast_both."""
    block_reference.check_norm_args("norm_block_cast_into", x, weight, rstd, out_dtype)
    _launch_both((x, weight, rstd), tuple(x.shape), x.shape[1], x.shape[1], out, out_t, scale_inv_out,
                 scale_inv_t_out, power_of_two, traced, "norm_block_cast_into", 1, 3, _ROUND_CODES[out_dtype], keep)


def _launch_both(xs, x_shape, k1: int, k2: int, out, out_t, scale_inv_out, scale_inv_t_out, power_of_two: bool,
                 traced: bool, fn: str, parts: int, gated: int = 0, act: int = 0,
                 keep: Optional[torch.Tensor] = None) -> None:
    """The two-way cast kernel over a tile grid of x_shape (M, K) into the checked buffers, its
    inputs xs (up to MAX_PARTS tensors, each with its own row stride). out_t and
    scale_inv_t_out both None: the 1 x 128 cast alone (the kernel's COLS 0), and with keep (a
    computed tile's form) the tile's values stored in keep too (KEEP)."""
    xs = [p.contiguous() if p.stride(-1) != 1 and p.shape[-1] > 1 else p for p in xs]
    m, k = x_shape
    mp = -(-m // 128) * 128
    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    cols = out_t is not None or scale_inv_t_out is not None
    if out.shape != x_shape or out.dtype not in fp8 or not out.is_contiguous():
        raise ValueError(f"{fn}: out must be a contiguous fp8 tensor of x's shape {x_shape}")
    if keep is not None and (cols or not gated or tuple(keep.shape) != x_shape or not keep.is_contiguous()
                             or not keep.dtype.is_floating_point or keep.dtype in fp8):
        raise ValueError(f"{fn}: keep must be a contiguous float tensor of shape {x_shape}, given for a "
                         "computed tile without the transposed copy (out_t and scale_inv_t_out None)")
    if cols and (out_t is None or tuple(out_t.shape) != (k, mp) or out_t.dtype != out.dtype
                 or not out_t.is_contiguous()):
        raise ValueError(f"{fn}: out_t must be a contiguous {out.dtype} tensor of shape {(k, mp)} "
                         "(or None with scale_inv_t_out None: no transposed copy)")
    checked = [("scale_inv_out", scale_inv_out, block_reference.blocks_of(x_shape, (1, 128)),
                scale_inv_out is not None and _dense_2d(scale_inv_out))]
    if cols:
        checked.append(("scale_inv_t_out", scale_inv_t_out, block_reference.blocks_of(x_shape, (128, 1)),
                        scale_inv_t_out is not None and scale_inv_t_out.is_contiguous()))
    for name, t, shape, dense in checked:
        if not dense or tuple(t.shape) != shape or t.dtype != torch.float32:
            raise ValueError(f"{fn}: {name} must be a float32 tensor of shape {shape}"
                             + (", row- or column-major" if name == "scale_inv_out" else ", contiguous"))
    if m * k == 0:
        return
    shapes = launch_shapes()
    fp8_max, pow2 = scaling.fp8_max(out.dtype), bool(power_of_two)
    # packed_t stores words: a traced launch sees no address (an allocation's start is aligned,
    # a view's offset says the rest)
    aligned = cols and shapes.packed_t and out_t.storage_offset() % 4 == 0 and (traced or out_t.data_ptr() % 4 == 0)
    if gated == 2 and shapes.gated_sides:  # one launch per side, each over K1's tiles
        launches = [(_both_kernel(fp8_max, pow2, shapes, x_shape, parts, gated, act, side, aligned, cols,
                                  keep is not None),
                     triton.cdiv(m, 128) * (k1 // 128)) for side in (1, 2)]
    else:
        launches = [(_both_kernel(fp8_max, pow2, shapes, x_shape, parts, gated, act, word_aligned=aligned, cols=cols,
                                  keep=keep is not None),
                     triton.cdiv(m, 128) * triton.cdiv(k, 128))]
    if not cols:  # out_t's pointer takes keep (KEEP); else unused, as scale_inv_t_out's
        out_t, scale_inv_t_out = out if keep is None else keep, scale_inv_out
    # absent parts: the last one again (no tile reads it); one part: x itself throughout
    xs = (*xs, *xs[-1:] * (MAX_PARTS - len(xs)))
    strides = tuple(p.stride(0) if m > 1 and p.dim() == 2 else p.shape[-1] for p in xs)
    args = (*xs, out, out_t, scale_inv_out, scale_inv_t_out, m, k, k1, k2, *strides, *scale_inv_out.stride(), mp)
    for kernel, grid in launches:
        if traced:
            kernel.traced(grid, *args)
            continue
        with device_guard(xs[0].device):
            kernel(grid, *args)


__all__ = ["BlockShapes", "MAX_PARTS", "block_cast_both_into", "block_cast_into", "gated_block_cast_into",
           "gated_grad_block_cast_into", "launch_shapes", "norm_block_cast_into", "native_launch", "override_shapes", "weight_tiles_into"]
