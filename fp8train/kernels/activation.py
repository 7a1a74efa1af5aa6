"""Triton kernels: the MLP activation (fc1 -> act -> fc2) fused with its FP8 casts, forward and backward.

Twins: activation_reference.act_amax, act_fwd_fp8, act_bwd_amax, act_bwd_fp8 (the
specification, with the formulas, the activations and the argument contracts; the wrappers
here have the same signatures and in-place behaviour). Scale conventions: fp8train/scaling.py.

Two kernels serve the four wrappers, both loops over 2-D tiles like cast._tile_kernel
(persistent but for the dbias backward; same scale resolution, saturation and amax bits):
  _act_fwd_kernel  h (M, F) [or (M, 2F) = gate | up] -> a = act(h) as fp8 (M, F) and its
                   transpose (F, Mp), amax of a.
  _act_bwd_kernel  da (M, F), h -> dh = da * act'(h) as fp8 (M, Fh) and its transpose
                   (Fh, Mp), amax of dh, and with dbias the column sums of dh: each program
                   then takes one column strip over a run of row tiles, sums its dh tiles
                   elementwise in registers and reduces them across rows once, into its
                   row of a float32 scratch that colsum.colsum_into reduces into dbias
                   (deterministic for a launch shape: no float atomics). For swiglu one
                   tile of da yields two output tiles, dgate at columns [c, c + BN) and
                   dup at [F + c, F + c + BN).
Every program does a single `atomic_max` for the amax at its end. On CUDA the transposed
copy is written from out's bytes after the kernel by kernels/transpose.py
(_FUSED_TRANSPOSE_ON_CUDA says why); the interpreter runs the in-kernel one
(transpose.store_transposed_tile, which the norm kernel uses on CUDA).

Differences from the twin: none in the float32 expressions, which are the twin's op for op
with every multiply-add an explicit tl.math.fma (the twin's `fma` rounds exactly like it),
except two: exp2, the GPU's ex2.approx (within 2 ulps, subnormal results flushed) where
torch's is its own; and the two reciprocals (the sigmoid's 1 / (1 + e), the erfc fit's t),
Triton's float32 `/`, div.full.f32 (within 2 ulps), where the twin divides exactly. The
IEEE quotient (tl.math.div_rn) is a multi-instruction sequence per element: with it the
gelu_tanh backward + dbias took 0.358 ms at 8192 x 16384 against 0.235 ms now, the forward
0.192 against 0.138 (a probe since deleted, H200, 2026-11-30; docs/benchmarks.md), and on inputs spread over
[-8, 8] not one fp8 byte of either differed from the twin's. The twin's Note shows how
each formula keeps such differences a few ulps in the float32 result, so a byte rarely
lands on the neighbouring fp8 value; the GPU tests bound that (see tests/gpu).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ContextManager, Optional

import torch
import triton
import triton.language as tl

from .. import scaling
from . import activation_reference as ref
from .cast import _abs_bits, _amax_of_bits, _resolve_scale, _saturate, _sm_count
from .colsum import colsum_into
from .launcher import DirectKernel, LaunchOverride, device_guard
from .launcher import scratch as launcher_scratch
from .transpose import store_transposed_tile, transpose_into

# Activation codes (constexpr ACT), in the order of ref.ACTIVATIONS.
_GELU: tl.constexpr = tl.constexpr(0)
_GELU_TANH: tl.constexpr = tl.constexpr(1)
_RELU: tl.constexpr = tl.constexpr(2)
_SWIGLU: tl.constexpr = tl.constexpr(3)
_ACT_CODES = {"gelu": 0, "gelu_tanh": 1, "relu": 2, "swiglu": 3}

_SQRT1_2: tl.constexpr = tl.constexpr(ref.SQRT1_2)
_INV_SQRT_2PI: tl.constexpr = tl.constexpr(ref.INV_SQRT_2PI)
_TANH_2K: tl.constexpr = tl.constexpr(ref.TANH_2K)
_TANH_C: tl.constexpr = tl.constexpr(ref.TANH_C)
_TANH_3C: tl.constexpr = tl.constexpr(ref.TANH_3C)
_LOG2E: tl.constexpr = tl.constexpr(ref.LOG2E)
_NEG_LOG2E: tl.constexpr = tl.constexpr(ref.NEG_LOG2E)
_NEG_HALF_LOG2E: tl.constexpr = tl.constexpr(ref.NEG_HALF_LOG2E)
_GELU_CUT: tl.constexpr = tl.constexpr(ref.GELU_CUT)
_ERFC_0: tl.constexpr = tl.constexpr(ref.ERFC_FIT[0])
_ERFC_1: tl.constexpr = tl.constexpr(ref.ERFC_FIT[1])
_ERFC_2: tl.constexpr = tl.constexpr(ref.ERFC_FIT[2])
_ERFC_3: tl.constexpr = tl.constexpr(ref.ERFC_FIT[3])
_ERFC_4: tl.constexpr = tl.constexpr(ref.ERFC_FIT[4])
_ERFC_5: tl.constexpr = tl.constexpr(ref.ERFC_FIT[5])
_ERFC_6: tl.constexpr = tl.constexpr(ref.ERFC_FIT[6])
_ERFC_7: tl.constexpr = tl.constexpr(ref.ERFC_FIT[7])
_ERFC_8: tl.constexpr = tl.constexpr(ref.ERFC_FIT[8])
_ERFC_9: tl.constexpr = tl.constexpr(ref.ERFC_FIT[9])


# --------------------------------------------------------------------------- launch shapes


@dataclass(frozen=True)
class ActConfig:
    """Launch shape of the activation kernels."""

    block_m: int          # tile rows: a run of block_m contiguous bytes in each out_t row
    block_n: int          # tile columns (of da / of each half of h): block_n contiguous bytes per out row
    num_warps: int
    programs_per_sm: int  # grid = min(tiles, programs_per_sm * SMs)


_override = LaunchOverride()  # ActConfig or None


def launch_config(device: torch.device, gated: bool) -> ActConfig:
    """The launch shape for an activation of kind `gated` (swiglu) on `device`.

    Hopper: measured by benchmarks/activation.py --variants (H200, triton 3.6, 2026-11-29,
    M x F = 4096 x 4096 and 8192 x 16384, bf16 in; docs/benchmarks.md). 64x64 tiles over 4
    warps were the fastest backward (dbias included) for both kinds, the forward within 5% of
    the best: gelu_tanh backward 0.080 -> 0.075 ms and 0.478 -> 0.440 ms against the earlier
    128x64 / 8 warps, swiglu backward 0.138 -> 0.086 ms and 0.919 -> 0.519 ms against 64x64 /
    8 warps (swiglu holds three input tiles live). Bytes do not bound them: the backward
    reaches ~37% (gelu_tanh) and ~50% (swiglu) of a device copy's bandwidth where torch's
    bf16 gelu backward reaches ~100%; the cost was the float32 math: with the division
    approximate (module docstring) the gelu_tanh backward + dbias runs 35% faster.
    """
    if _override.value is not None:
        return _override.value
    if device.type == "cuda":
        return ActConfig(block_m=64, block_n=64, num_warps=4, programs_per_sm=4 if gated else 8)
    # Triton interpreter on CPU: small tiles, so that test shapes run several loop steps per
    # program, partial edge tiles and padding tiles.
    return ActConfig(block_m=16, block_n=32, num_warps=4, programs_per_sm=1)


def override_config(config: ActConfig) -> ContextManager[None]:
    """Use another launch shape inside the block (benchmark variants, tests); not thread-safe."""
    return _override.using(config)


# --------------------------------------------------------------------------- device code


@triton.jit
def _sigmoid(z):
    """ref._sigmoid: (sigmoid(z), exp(-z)), 1 / (1 + exp(-z)) by div.full.f32 (module docstring:
    within 2 ulps of the twin's IEEE quotient); exp(-z) = inf gives +0 as there."""
    e = tl.exp2(z * _NEG_LOG2E)
    return 1.0 / (1.0 + e), e


@triton.jit
def _sigmoid_complement(z, s, e):
    """ref._sigmoid_complement: 1 - sigmoid(z) as exp(-z) sigmoid(z) for z >= 0, 1 - s below."""
    return tl.where(z >= 0.0, e * s, 1.0 - s)


@triton.jit
def _normal_cdf(x):
    """ref._normal_cdf: Phi(x) = erfc(-x / sqrt 2) / 2 by the same fit, fma for fma."""
    t = 1.0 / (1.0 + 0.5 * tl.abs(x * _SQRT1_2))  # div.full.f32, see the module docstring
    q = tl.math.fma(_ERFC_9, t, _ERFC_8)
    q = tl.math.fma(q, t, _ERFC_7)
    q = tl.math.fma(q, t, _ERFC_6)
    q = tl.math.fma(q, t, _ERFC_5)
    q = tl.math.fma(q, t, _ERFC_4)
    q = tl.math.fma(q, t, _ERFC_3)
    q = tl.math.fma(q, t, _ERFC_2)
    q = tl.math.fma(q, t, _ERFC_1)
    q = tl.math.fma(q, t, _ERFC_0)
    half = 0.5 * (t * tl.exp2(tl.math.fma(x * x, -0.5, q) * _LOG2E))  # erfc(|x| / sqrt 2) / 2
    cdf = tl.where(x < 0.0, half, 1.0 - half)
    return tl.where(x > _GELU_CUT, 1.0, tl.where(x < -_GELU_CUT, 0.0, cdf))


@triton.jit
def _normal_pdf(x):
    """ref._normal_pdf: exp(-x^2 / 2) / sqrt(2 pi), 0 where |x| > GELU_CUT."""
    pdf = tl.exp2((x * x) * _NEG_HALF_LOG2E) * _INV_SQRT_2PI
    return tl.where(tl.abs(x) > _GELU_CUT, 0.0, pdf)


@triton.jit
def _act(x, ACT: tl.constexpr):
    """ref.act_forward for the one-input activations (float32 in, float32 out)."""
    if ACT == _GELU:
        a = x * _normal_cdf(x)
    elif ACT == _GELU_TANH:
        s, _ = _sigmoid((x * _TANH_2K) * tl.math.fma(x * x, _TANH_C, 1.0))
        a = x * s
    else:  # _RELU: -0.0 and NaN pass through, like F.relu
        a = tl.where(x < 0.0, 0.0, x)
    return a


@triton.jit
def _act_grad(g, x, ACT: tl.constexpr):
    """ref.act_grad for the one-input activations: g * act'(x) (float32)."""
    if ACT == _GELU:
        dh = g * tl.math.fma(x, _normal_pdf(x), _normal_cdf(x))
    elif ACT == _GELU_TANH:
        x2 = x * x
        z = (x * _TANH_2K) * tl.math.fma(x2, _TANH_C, 1.0)
        s, e = _sigmoid(z)
        dz = _TANH_2K * tl.math.fma(x2, _TANH_3C, 1.0)
        dh = g * tl.math.fma((x * s) * _sigmoid_complement(z, s, e), dz, s)
    else:  # _RELU: torch's threshold_backward, so NaN x passes g through
        dh = tl.where(x <= 0.0, 0.0, g)
    return dh


@triton.jit
def _emit(v, rows, r, c, col_ok, row0, col0, M, N, Mp, out_ptr, out_t_ptr, scale,
          FP8_MAX: tl.constexpr, TRANSPOSE: tl.constexpr):
    """Quantize the float32 tile v (BLOCK_M, BLOCK_N) whose top-left is (row0, col0) of the
    (M, N) output: store it into out and, with TRANSPOSE, its bytes transposed into out_t.

    col_ok (BLOCK_N,) marks the tile's columns inside the output; rows past M (the padding
    tiles of out_t) are written as +0.0 bytes. This is cast._tile_kernel's store sequence.
    """
    y = _saturate(v, scale, FP8_MAX)  # (BLOCK_M, BLOCK_N)
    if TRANSPOSE:
        y = tl.where((rows < M)[:, None], y, 0.0)  # padding: +0.0 is byte 0x00
    q = y.to(out_ptr.dtype.element_ty)
    out_tile = out_ptr + tl.cast(row0, tl.int64) * N + col0
    tl.store(out_tile + r[:, None] * N + c[None, :], q, mask=(rows < M)[:, None] & col_ok[None, :])
    if TRANSPOSE:  # the bytes just stored, back from L2 in transposed order (rows past M: 0)
        store_transposed_tile(out_tile, out_t_ptr + tl.cast(col0, tl.int64) * Mp + row0, N, Mp, r, c, rows < M,
                              col_ok, rows < Mp)


@triton.jit
def _act_fwd_kernel(
    h_ptr,          # (M, F) bf16/fp16/fp32 fc1 output [(M, 2F) = gate | up for swiglu], unit column stride
    out_ptr,        # (M, F) fp8 activation, row-major (CAST)
    out_t_ptr,      # (F, Mp) fp8 transposed copy, row-major; columns M..Mp-1 get zeros (TRANSPOSE)
    scale_ptr,      # () float32 scale: read; set from from_amax by program 0 (FROM_AMAX)
    scale_inv_ptr,  # () float32 output 1/scale, written by program 0 (CAST)
    amax_ptr,       # () float32 running amax of the activation: one atomic max per program (AMAX)
    from_amax_ptr,  # () float32 amax the scale is computed from (FROM_AMAX)
    count_ptr,      # () int32 nonfinite count, +1 when from_amax is inf/NaN (COUNT)
    M, F, Mp,       # rows, activation columns, out_t row length (>= M)
    stride_hm,      # row stride of h, in elements
    ACT: tl.constexpr, FP8_MAX: tl.constexpr, CAST: tl.constexpr, TRANSPOSE: tl.constexpr,
    AMAX: tl.constexpr, FROM_AMAX: tl.constexpr, COUNT: tl.constexpr, POW2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    if CAST:
        scale = _resolve_scale(scale_ptr, scale_inv_ptr, from_amax_ptr, count_ptr, FP8_MAX, FROM_AMAX, COUNT, POW2)
    if TRANSPOSE:
        rows_covered = Mp  # tiles past row M write out_t's zero padding
    else:
        rows_covered = M
    tiles_n = tl.cdiv(F, BLOCK_N)
    num_tiles = tl.cdiv(rows_covered, BLOCK_M) * tiles_n
    r = tl.arange(0, BLOCK_M)
    c = tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M], dtype=tl.int32)  # per-row maxima of _abs_bits
    for t in range(pid, num_tiles, nprog):
        row0 = (t // tiles_n) * BLOCK_M
        col0 = (t % tiles_n) * BLOCK_N
        rows = row0 + r
        cols = col0 + c
        in_x = (rows < M)[:, None] & (cols < F)[None, :]
        # Tile origins in int64, offsets inside a tile in int32 (the wrapper bounds them).
        # Masked elements load 0, and act(0) = +0 for every act: they add nothing to the amax.
        h_tile = h_ptr + tl.cast(row0, tl.int64) * stride_hm + col0
        offs = r[:, None] * stride_hm + c[None, :]
        x = tl.load(h_tile + offs, mask=in_x, other=0.0).to(tl.float32)
        if ACT == _SWIGLU:
            up = tl.load(h_tile + F + offs, mask=in_x, other=0.0).to(tl.float32)
            s, _ = _sigmoid(x)
            a = (x * s) * up
        else:
            a = _act(x, ACT)
        if AMAX:
            acc = tl.maximum(acc, tl.max(_abs_bits(a), axis=1))
        if CAST:
            _emit(a, rows, r, c, cols < F, row0, col0, M, F, Mp, out_ptr, out_t_ptr, scale, FP8_MAX, TRANSPOSE)
    if AMAX:
        tl.atomic_max(amax_ptr, _amax_of_bits(acc))


@triton.jit
def _act_bwd_tile(da_ptr, h_ptr, out_ptr, out_t_ptr, scale, row0, col0, M, F, Fh, Mp, stride_dam, stride_hm, r, c,
                  ACT: tl.constexpr, FP8_MAX: tl.constexpr, CAST: tl.constexpr, TRANSPOSE: tl.constexpr):
    """One (BLOCK_M, BLOCK_N) tile of da at (row0, col0): dh = da * act'(h), cast and stored
    (CAST). Returns (dh, dh) for the one-input activations, (dgate, dup) for swiglu, whose
    tile of da yields two output tiles, dgate at columns [c, c + BN) and dup at [F + c, ...)."""
    rows = row0 + r
    cols = col0 + c
    col_ok = cols < F
    in_x = (rows < M)[:, None] & col_ok[None, :]
    # Masked elements load da = 0 and h = 0, so dh = +0 there: no effect on amax or dbias.
    da_tile = da_ptr + tl.cast(row0, tl.int64) * stride_dam + col0
    g = tl.load(da_tile + r[:, None] * stride_dam + c[None, :], mask=in_x, other=0.0).to(tl.float32)
    h_tile = h_ptr + tl.cast(row0, tl.int64) * stride_hm + col0
    offs_h = r[:, None] * stride_hm + c[None, :]
    x = tl.load(h_tile + offs_h, mask=in_x, other=0.0).to(tl.float32)
    if ACT == _SWIGLU:
        up = tl.load(h_tile + F + offs_h, mask=in_x, other=0.0).to(tl.float32)
        s, e = _sigmoid(x)
        v1 = (g * up) * (s * tl.math.fma(x, _sigmoid_complement(x, s, e), 1.0))  # dgate
        v2 = g * (x * s)  # dup
        if CAST:
            _emit(v1, rows, r, c, col_ok, row0, col0, M, Fh, Mp, out_ptr, out_t_ptr, scale, FP8_MAX, TRANSPOSE)
            _emit(v2, rows, r, c, col_ok, row0, F + col0, M, Fh, Mp, out_ptr, out_t_ptr, scale, FP8_MAX, TRANSPOSE)
    else:
        v1 = _act_grad(g, x, ACT)
        v2 = v1
        if CAST:
            _emit(v1, rows, r, c, col_ok, row0, col0, M, Fh, Mp, out_ptr, out_t_ptr, scale, FP8_MAX, TRANSPOSE)
    return v1, v2


@triton.jit
def _act_bwd_kernel(
    da_ptr,         # (M, F) bf16/fp16/fp32 gradient w.r.t. the activation, unit column stride
    h_ptr,          # (M, Fh) bf16/fp16/fp32 saved fc1 output, Fh = F (2F = gate | up for swiglu)
    out_ptr,        # (M, Fh) fp8 dh, row-major (CAST)
    out_t_ptr,      # (Fh, Mp) fp8 transposed copy of dh; columns M..Mp-1 get zeros (TRANSPOSE)
    dbias_ptr,      # (row splits, Fh) float32 scratch: row k gets the column sums of dh over split k (DBIAS)
    scale_ptr,      # () float32 scale: read; set from from_amax by program 0 (FROM_AMAX)
    scale_inv_ptr,  # () float32 output 1/scale, written by program 0 (CAST)
    amax_ptr,       # () float32 running amax of dh: one atomic max per program (AMAX)
    from_amax_ptr,  # () float32 amax the scale is computed from (FROM_AMAX)
    count_ptr,      # () int32 nonfinite count, +1 when from_amax is inf/NaN (COUNT)
    M, F, Mp,       # rows, columns of da, out_t row length (>= M)
    stride_dam,     # row stride of da, in elements
    stride_hm,      # row stride of h, in elements
    split_rows,     # DBIAS: row tiles per split (each program: one column strip x one split)
    ACT: tl.constexpr, FP8_MAX: tl.constexpr, CAST: tl.constexpr, TRANSPOSE: tl.constexpr,
    AMAX: tl.constexpr, FROM_AMAX: tl.constexpr, COUNT: tl.constexpr, POW2: tl.constexpr, DBIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    scale = 1.0
    if CAST:
        scale = _resolve_scale(scale_ptr, scale_inv_ptr, from_amax_ptr, count_ptr, FP8_MAX, FROM_AMAX, COUNT, POW2)
    if ACT == _SWIGLU:
        Fh = 2 * F
    else:
        Fh = F
    if TRANSPOSE:
        rows_covered = Mp  # tiles past row M write out_t's zero padding
    else:
        rows_covered = M
    tiles_n = tl.cdiv(F, BLOCK_N)
    row_tiles = tl.cdiv(rows_covered, BLOCK_M)
    r = tl.arange(0, BLOCK_M)
    c = tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M], dtype=tl.int32)  # per-row maxima of _abs_bits
    if DBIAS:
        # One column strip x one run of split_rows row tiles per program (the grid has one
        # program per pair): dh is summed elementwise in registers down the strip and reduced
        # across rows once at the end, instead of once per tile.
        strip = pid % tiles_n
        split = pid // tiles_n
        col0 = strip * BLOCK_N
        db1 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        db2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        first = split * split_rows
        last = tl.minimum(first + split_rows, row_tiles)
        for row_tile in range(first, last):
            v1, v2 = _act_bwd_tile(da_ptr, h_ptr, out_ptr, out_t_ptr, scale, row_tile * BLOCK_M, col0, M, F, Fh, Mp,
                                   stride_dam, stride_hm, r, c, ACT, FP8_MAX, CAST, TRANSPOSE)
            db1 += v1
            if AMAX:
                acc = tl.maximum(acc, tl.max(_abs_bits(v1), axis=1))
            if ACT == _SWIGLU:
                db2 += v2
                if AMAX:
                    acc = tl.maximum(acc, tl.max(_abs_bits(v2), axis=1))
        dbias_row = dbias_ptr + tl.cast(split, tl.int64) * Fh + col0  # split: a Python int when interpreted
        col_ok = col0 + c < F
        tl.store(dbias_row + c, tl.sum(db1, axis=0), mask=col_ok)
        if ACT == _SWIGLU:
            tl.store(dbias_row + F + c, tl.sum(db2, axis=0), mask=col_ok)
    else:
        num_tiles = row_tiles * tiles_n
        for t in range(pid, num_tiles, nprog):
            v1, v2 = _act_bwd_tile(da_ptr, h_ptr, out_ptr, out_t_ptr, scale, (t // tiles_n) * BLOCK_M,
                                   (t % tiles_n) * BLOCK_N, M, F, Fh, Mp, stride_dam, stride_hm, r, c, ACT, FP8_MAX,
                                   CAST, TRANSPOSE)
            if AMAX:
                acc = tl.maximum(acc, tl.max(_abs_bits(v1), axis=1))
                if ACT == _SWIGLU:
                    acc = tl.maximum(acc, tl.max(_abs_bits(v2), axis=1))
    if AMAX:
        tl.atomic_max(amax_ptr, _amax_of_bits(acc))


@functools.lru_cache(maxsize=None)
def _fwd(cfg: ActConfig, act: int, fp8_max: float, cast: bool, transpose: bool, amax: bool, from_amax: bool,
         count: bool, pow2: bool) -> DirectKernel:
    return DirectKernel(_act_fwd_kernel, num_warps=cfg.num_warps, ACT=act, FP8_MAX=fp8_max, CAST=cast,
                        TRANSPOSE=transpose, AMAX=amax, FROM_AMAX=from_amax, COUNT=count, POW2=pow2,
                        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n)


@functools.lru_cache(maxsize=None)
def _bwd(cfg: ActConfig, act: int, fp8_max: float, cast: bool, transpose: bool, amax: bool, from_amax: bool,
         count: bool, pow2: bool, dbias: bool) -> DirectKernel:
    return DirectKernel(_act_bwd_kernel, num_warps=cfg.num_warps, ACT=act, FP8_MAX=fp8_max, CAST=cast,
                        TRANSPOSE=transpose, AMAX=amax, FROM_AMAX=from_amax, COUNT=count, POW2=pow2, DBIAS=dbias,
                        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n)


# --------------------------------------------------------------------------- host wrappers


def act_amax(h: torch.Tensor, act: str, amax_out: torch.Tensor) -> None:
    """activation_reference.act_amax on the GPU: amax_out <- max(amax_out, abs_max(act(h))), no sync."""
    ref.check_amax_args("act_amax", h, act, amax_out)
    if h.numel() == 0:
        ref.act_amax(h, act, amax_out)
        return
    _launch_fwd("act_amax", h, act, None, None, None, None, amax_out, None, None, False)


def act_fwd_fp8(h: torch.Tensor, act: str, out: torch.Tensor, out_t: Optional[torch.Tensor],
                scale: torch.Tensor, scale_inv_out: torch.Tensor, amax_out: Optional[torch.Tensor] = None,
                from_amax: Optional[torch.Tensor] = None, nonfinite_count: Optional[torch.Tensor] = None,
                power_of_two: bool = False) -> None:
    """activation_reference.act_fwd_fp8 on the GPU (same contract; see there).

    h      (M, F) or (M, 2F) for swiglu, unit column stride, any row stride
    out    (M, F) fp8, contiguous
    out_t  (F, Mp) fp8, contiguous, Mp >= M, or None
    """
    ref.check_fwd_args("act_fwd_fp8", h, act, out, out_t, scale, scale_inv_out, amax_out, from_amax, nonfinite_count)
    if h.numel() == 0:
        ref.act_fwd_fp8(h, act, out, out_t, scale, scale_inv_out, amax_out, from_amax, nonfinite_count,
                        power_of_two)
        return
    _launch_fwd("act_fwd_fp8", h, act, out, out_t, scale, scale_inv_out, amax_out, from_amax, nonfinite_count,
                power_of_two)


def act_bwd_amax(da: torch.Tensor, h: torch.Tensor, act: str, amax_out: torch.Tensor) -> None:
    """activation_reference.act_bwd_amax on the GPU: amax_out <- max(amax_out, abs_max(dh)), no sync."""
    ref.check_bwd_amax_args("act_bwd_amax", da, h, act, amax_out)
    if h.numel() == 0:
        ref.act_bwd_amax(da, h, act, amax_out)
        return
    _launch_bwd("act_bwd_amax", da, h, act, None, None, None, None, amax_out, None, None, None, False)


def act_bwd_fp8(da: torch.Tensor, h: torch.Tensor, act: str, out: torch.Tensor, out_t: Optional[torch.Tensor],
                scale: torch.Tensor, scale_inv_out: torch.Tensor, amax_out: Optional[torch.Tensor] = None,
                from_amax: Optional[torch.Tensor] = None, nonfinite_count: Optional[torch.Tensor] = None,
                dbias_out: Optional[torch.Tensor] = None, power_of_two: bool = False) -> None:
    """activation_reference.act_bwd_fp8 on the GPU (same contract; see there).

    da         (M, F), h (M, Fh) with Fh = F (2F for swiglu), unit column strides, any row strides
    out        (M, Fh) fp8, contiguous;  out_t (Fh, Mp) fp8, contiguous, Mp >= M, or None
    dbias_out  (Fh,) or None. Allocates a float32 scratch of (splits, Fh) when given (the column
               sums of each split's run of row tiles, about one split per program per column
               strip), reduced into dbias_out by colsum.colsum_into.
    """
    ref.check_bwd_args("act_bwd_fp8", da, h, act, out, out_t, scale, scale_inv_out, amax_out, from_amax,
                       nonfinite_count, dbias_out)
    if h.numel() == 0:
        ref.act_bwd_fp8(da, h, act, out, out_t, scale, scale_inv_out, amax_out, from_amax, nonfinite_count,
                        dbias_out, power_of_two)
        return
    _launch_bwd("act_bwd_fp8", da, h, act, out, out_t, scale, scale_inv_out, amax_out, from_amax, nonfinite_count,
                dbias_out, power_of_two)


def _launch_fwd(fn, h, act, out, out_t, scale, scale_inv_out, amax_out, from_amax, nonfinite_count,
                power_of_two) -> None:
    """Launch _act_fwd_kernel on checked arguments; absent optional tensors are flagged off (never touched)."""
    m, f = h.shape[0], ref.out_features(h, act)
    out_t, copy_t = _transpose_plan(out_t, h)
    cfg = launch_config(h.device, act == "swiglu")
    mp = m if out_t is None else out_t.shape[1]
    stride_hm = _row_stride(h)
    _check_tile_offsets(fn, cfg, h.shape[1], stride_hm, mp)
    tiles = triton.cdiv(mp, cfg.block_m) * triton.cdiv(f, cfg.block_n)
    _, pointers, flags = _scalar_args(out, out_t, scale, scale_inv_out, amax_out, from_amax, nonfinite_count,
                                      power_of_two)
    kernel = _fwd(cfg, _ACT_CODES[act], *flags)
    with device_guard(h.device):
        kernel(_grid(tiles, cfg.programs_per_sm, h.device), h, _or(out, h), _or(out_t, _or(out, h)),
               *pointers, m, f, mp, stride_hm)
        _finish_transpose(out, copy_t)


def _launch_bwd(fn, da, h, act, out, out_t, scale, scale_inv_out, amax_out, from_amax, nonfinite_count,
                dbias_out, power_of_two) -> None:
    """Launch _act_bwd_kernel on checked arguments, then reduce the dbias partials."""
    m, f, fh = h.shape[0], da.shape[1], h.shape[1]
    out_t, copy_t = _transpose_plan(out_t, h, da)
    cfg = launch_config(h.device, act == "swiglu")
    mp = m if out_t is None else out_t.shape[1]
    stride_dam, stride_hm = _row_stride(da), _row_stride(h)
    _check_tile_offsets(fn, cfg, fh, max(stride_dam, stride_hm), mp)
    row_tiles, tiles_n = triton.cdiv(mp, cfg.block_m), triton.cdiv(f, cfg.block_n)
    programs = _grid(row_tiles * tiles_n, cfg.programs_per_sm, h.device)
    scratch, split_rows = None, row_tiles
    if dbias_out is not None:
        # One program per (column strip, run of split_rows row tiles), about as many programs
        # as the persistent grid has; each writes its strip's columns of its split's scratch
        # row, so every row is written: no zeroing. Rows of padding tiles (out_t's, past M)
        # add zeros.
        split_rows = triton.cdiv(row_tiles, max(1, programs // tiles_n))
        splits = triton.cdiv(row_tiles, split_rows)
        programs = splits * tiles_n
        scratch = launcher_scratch((splits, fh), h.device)  # (splits, Fh) float32
    stand_in, pointers, flags = _scalar_args(out, out_t, scale, scale_inv_out, amax_out, from_amax, nonfinite_count,
                                             power_of_two)
    kernel = _bwd(cfg, _ACT_CODES[act], *flags, scratch is not None)
    with device_guard(h.device):
        kernel(programs, da, h, _or(out, h), _or(out_t, _or(out, h)), _or(scratch, stand_in),
               *pointers, m, f, mp, stride_dam, stride_hm, split_rows)
        _finish_transpose(out, copy_t)
        if scratch is not None:
            colsum_into(scratch.unsqueeze(0), (dbias_out,))  # one launch, in dbias_out's dtype


# Whether the kernels write out_t themselves on CUDA (transpose.store_transposed_tile: each
# tile's bytes reloaded from out, in L2, in transposed order); otherwise they write out only
# and transpose.py copies its transposed bytes in a second launch. Off: measured slower. The
# in-kernel route is exact on the H200 (GPU tests, 2026-11-29) but at 8192 x 16384 took
# 0.361 ms against 0.297 (gelu_tanh forward) and 0.853 against 0.676 (swiglu backward with
# dbias) for the kernel plus the copy (benchmarks/activation.py, docs/benchmarks.md): each
# tile waits on a CTA barrier and a round trip to L2 before the next one's loads, and with
# 64 x 64 tiles that latency is not hidden. (The norm kernel's 32 x 128 tiles gain 5% from
# it; there it is on.) The first in-kernel route, tl.trans of the register tile, wrote
# foreign bytes into out_t on sm_90 with triton 3.6 (triton-lang/triton#11111).
_FUSED_TRANSPOSE_ON_CUDA = False


def _transpose_plan(out_t, *inputs):
    """(out_t the kernel writes, out_t to fill from out afterwards): see _FUSED_TRANSPOSE_ON_CUDA.

    Off CUDA (the interpreter) the kernel writes out_t itself, so the interpreter tests keep
    checking the in-kernel transpose. On CUDA, float32 inputs never take it (cast.py found
    wrong out_t bytes for tiles loaded as float32 first, and has the same workaround).
    """
    if out_t is None or not inputs[0].is_cuda:
        return out_t, None
    if _FUSED_TRANSPOSE_ON_CUDA and not any(t.dtype == torch.float32 for t in inputs):
        return out_t, None
    return None, out_t


def _finish_transpose(out, copy_t) -> None:
    if copy_t is not None:
        transpose_into(out, copy_t)


def _scalar_args(out, out_t, scale, scale_inv_out, amax_out, from_amax, nonfinite_count, power_of_two):
    """(stand-in tensor, the five scalar pointers, (FP8_MAX, CAST, TRANSPOSE, AMAX, FROM_AMAX, COUNT, POW2))."""
    cast = out is not None
    stand_in = amax_out if amax_out is not None else scale  # passed for pointer args a launch never touches
    pointers = (scale if cast else stand_in, scale_inv_out if cast else stand_in, _or(amax_out, stand_in),
                _or(from_amax, stand_in), _or(nonfinite_count, stand_in))
    flags = (scaling.fp8_max(out.dtype) if cast else 0.0, cast, out_t is not None, amax_out is not None,
             from_amax is not None, from_amax is not None and nonfinite_count is not None,
             bool(power_of_two) and from_amax is not None)
    return stand_in, pointers, flags


def _grid(tiles: int, programs_per_sm: int, device: torch.device) -> int:
    """Programs of the persistent 1-D grid: enough for the tiles, at most programs_per_sm per SM."""
    return max(1, min(tiles, programs_per_sm * _sm_count(device)))


def _or(t: Optional[torch.Tensor], stand_in: torch.Tensor) -> torch.Tensor:
    return stand_in if t is None else t


def _row_stride(t: torch.Tensor) -> int:
    return t.stride(0) if t.shape[0] > 1 else t.shape[1]


def _check_tile_offsets(fn: str, cfg: ActConfig, fh: int, row_stride: int, mp: int) -> None:
    # Offsets inside one tile are int32 (tile origins are int64); swiglu adds F to them.
    longest = max(row_stride, fh, mp)
    if longest * max(cfg.block_m, cfg.block_n) + fh >= 2**31:
        raise ValueError(f"{fn}: rows of {longest} elements are too long for the tiled kernel "
                         f"(int32 offsets inside a {cfg.block_m}x{cfg.block_n} tile)")
