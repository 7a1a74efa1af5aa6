"""FP8 GEMMs with torch._scaled_mm's contract, one function per GEMM role.

torch._scaled_mm computes (a * scale_a) @ (b * scale_b) with a (M, K) row-major and b (K, N)
column-major, K and N multiples of 16 (M is free), and takes the *inverse* scales. So each
role picks the layout it needs (docs/design.md, "Tensor roles and layouts"):

  FPROP  Y  (M, N) = X (M, K)          @ W^T: W (N, K) row-major is W^T column-major
  DGRAD  dX (M, K) = dY (M, N)         @ W:   W's transposed copy (K, N) row-major, .t()
  WGRAD  dW (N, K) = dY^T (N, Mp)      @ X:   X's transposed copy (K, Mp) row-major, .t()
         with Mp = M rounded up to 16; the padding columns of both copies are zero.
Accumulation precision comes from GemmConfig per role, never from the FP8 dtypes.

Block-scaled operands (recipe.BlockScaling: 2-D scale_invs, one per block) take the same
entry points, which pass them to `block_scaled_mm`: in every role A is the row-blocked
(1 x 128) operand and B's transpose holds 128 x 128 tiles (fprop, dgrad) or row blocks
(wgrad), each operand with its blocks along the reduction dim K (docs/design.md, "Block
scaling"). On the CPU it runs as `emulated_block_scaled_mm`; on CUDA through the extension's
`block_scaled_mm` (cuBLASLt's block scaling, the algorithm cached as below), or without it
torch.nn.functional.scaled_mm's blockwise scaling (`_cuda_block_scaled_mm`).

On the GPU the GEMM runs through the C++ extension's `scaled_mm` (csrc/lt_gemm.cpp: cuBLASLt
with its algorithm cached, the bytes torch._scaled_mm gives, less host time), the one the C++
nodes call; traced code calls the same GEMM as the operator torch.ops.fp8train_lt.scaled_mm,
and torch._scaled_mm runs only without the extension (or into a given `out`). On the CPU it
runs as `emulated_scaled_mm`, a float32 matmul of the FP8 values (torch's own CPU
_scaled_mm runs at ~0.04 GFLOP/s through oneDNN on some CPUs, AVX-512 + AMX Xeons among them).
"""
from __future__ import annotations

import functools
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .kernels import native
from .recipe import GemmConfig
from .roles import GemmRole

# Bias can be fused only into bf16/fp16 outputs (cuBLASLt epilogue), and must match them.
_BIAS_OUT_DTYPES = (torch.bfloat16, torch.float16)


def dims_ok(*dims: int) -> bool:
    """FP8 GEMMs need the layer dims (K and N) to be multiples of 16."""
    return all(d % 16 == 0 and d > 0 for d in dims)


def check_device(device: torch.device) -> None:
    """Raise on a GPU without FP8 tensor cores (checked once per device, in eager code)."""
    # Traced code (torch.compile) skips it: Dynamo would trace past the cache on every
    # compile; the layer's first eager call, or torch._scaled_mm itself, reports the GPU.
    if not torch.compiler.is_compiling():
        _check_device(device)


def check_tensor_device(x: torch.Tensor) -> None:
    """check_device(x.device) for a layer's input on every call: a CPU tensor needs no check
    and a CUDA one is looked up by index (building x.device costs more than the lookup)."""
    if x.is_cuda and not torch.compiler.is_compiling():
        _check_cuda_index(x.get_device())


@functools.lru_cache(maxsize=None)
def _check_cuda_index(index: int) -> None:
    _check_device(torch.device("cuda", index))


@functools.lru_cache(maxsize=None)
def _check_device(device: torch.device) -> None:
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise RuntimeError(f"{torch.cuda.get_device_name(device)} has no FP8 tensor cores (needs compute "
                           "capability 8.9+, e.g. H100/H200); run outside fp8train.autocast")


def scaled_mm(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor, b_scale_inv: torch.Tensor, *,
              role: GemmRole, config: GemmConfig, out_dtype: torch.dtype,
              bias: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(a * a_scale_inv) @ (b * b_scale_inv) [+ bias]; a (M, K) row-major, b (K, N) column-major.
    `out` (M, N) contiguous, of out_dtype: written in place (a row block of a larger output)."""
    if not a.is_cuda:
        return emulated_scaled_mm(a, a_scale_inv, b, b_scale_inv, out_dtype, bias, out)
    ext = native.gemm()
    if ext is not None and out_dtype in native.DTYPE_CODES:
        return ext.scaled_mm(a, a_scale_inv, b, b_scale_inv, config.fast_accum(role), native.DTYPE_CODES[out_dtype],
                             bias, out)
    if out is None and out_dtype in native.DTYPE_CODES and native.gemm_op_loaded():  # traced code
        return torch.ops.fp8train_lt.scaled_mm(a, a_scale_inv, b, b_scale_inv, config.fast_accum(role), out_dtype,
                                               bias)
    if bias is None:
        return torch._scaled_mm(a, b, scale_a=a_scale_inv, scale_b=b_scale_inv, out_dtype=out_dtype,
                                use_fast_accum=config.fast_accum(role), out=out)
    if bias.dtype != out_dtype:  # checked here: even a no-op .to() costs a dispatch
        bias = bias.to(out_dtype)
    fuse_bias = out_dtype in _BIAS_OUT_DTYPES
    out = torch._scaled_mm(a, b, scale_a=a_scale_inv, scale_b=b_scale_inv, bias=bias if fuse_bias else None,
                           out_dtype=out_dtype, use_fast_accum=config.fast_accum(role), out=out)
    if not fuse_bias:
        out += bias
    return out


def emulated_scaled_mm(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor, b_scale_inv: torch.Tensor,
                       out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None,
                       out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The FP8 GEMM in float32 torch ops: the CPU's path and the math the GPU's must match.

    Every FP8 value (e4m3 or e5m2) and every product of two is exact in float32 (4 and 8
    significant bits), so `a.float() @ b.float()` rounds only in its float32 sums, as the
    GPU's full-precision accumulation does. The result is multiplied by a_scale_inv *
    b_scale_inv (0-d, or broadcasting (M, 1) and (1, N) row and column scales), the bias
    (first rounded to out_dtype, as the GPU path passes it) is added in float32 and the sum
    rounded once to out_dtype: what cuBLASLt's epilogue does.
    Layouts and alignment are not checked (the GPU checks them); fast accumulation has no
    CPU meaning. Runs at the speed of the CPU's float32 matmul, whatever its FP8 support.
    """
    y = torch.ops.fp8train.emulated_scaled_mm(a, a_scale_inv, b, b_scale_inv, out_dtype, bias)
    return y if out is None else out.copy_(y)


# A custom op, so that Inductor calls it as it is: traced, its bias rounding would be dropped
# (Inductor keeps float32 through a cast to bf16 that feeds float32 math), and compiled code
# would no longer give eager's bits. Fixed stride order rather than the default exact strides
# (as the CUDA operator, csrc/lt_gemm.cpp): with exact strides Inductor copied a one-element
# scale_inv computed in the graph once per GEMM reading it.
_GEMM_TAGS = (torch.Tag.needs_fixed_stride_order,)


@torch.library.custom_op("fp8train::emulated_scaled_mm", mutates_args=(), tags=_GEMM_TAGS)
def _emulated_scaled_mm(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor, b_scale_inv: torch.Tensor,
                        out_dtype: torch.dtype, bias: Optional[torch.Tensor]) -> torch.Tensor:
    # Autocast would run this mm in bf16 (a custom op's body runs under the caller's autocast
    # in eager code, not in compiled code): the float32 sums are the specification.
    with torch.autocast(a.device.type, enabled=False):
        y = torch.mm(a.float(), b.float())  # (M, N) float32
    y.mul_(a_scale_inv * b_scale_inv)
    if bias is not None:
        y.add_(bias.to(out_dtype))
    return y.to(out_dtype)


@_emulated_scaled_mm.register_fake
def _(a, a_scale_inv, b, b_scale_inv, out_dtype, bias):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


def emulated_block_scaled_mm(a: torch.Tensor, a_scale_inv: torch.Tensor, a_block: Tuple[int, int], b: torch.Tensor,
                             b_scale_inv: torch.Tensor, b_block: Tuple[int, int], out_dtype: torch.dtype,
                             bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The block-scaled FP8 GEMM (kernels/block_reference.py's layouts) in float32 torch ops.

    a (M, K) with a_block (1, 128) or (128, 128), b (K, N) with b_block (128, 1) or
    (128, 128): blocks along the reduction dim K are 128 long on both sides, so each 128-wide
    slice kb of K has one scale per row of a (or per 128 rows) and one per column of b (or
    per 128 columns). As the GPU's blockwise GEMMs do (FP32 promotion): each slice's products
    are summed in float32 (exact products, as in emulated_scaled_mm), the partial sum is
    multiplied by its a and b scales, and the slices are accumulated in float32 in order of
    kb; the bias (first rounded to out_dtype, as emulated_scaled_mm) is added in float32 and
    the total rounded once to out_dtype.
    """
    return torch.ops.fp8train.emulated_block_scaled_mm(a, a_scale_inv, list(a_block), b, b_scale_inv, list(b_block),
                                                       out_dtype, bias)


# A custom op, as emulated_scaled_mm: Inductor calls it as it is, so that compiled code gives
# eager's bits (traced, the bias's rounding to out_dtype would be dropped, and the scales'
# repeat_interleave + cut below is a form Inductor miscompiles: block_reference.expand).
@torch.library.custom_op("fp8train::emulated_block_scaled_mm", mutates_args=(), tags=_GEMM_TAGS)
def _emulated_block_scaled_mm(a: torch.Tensor, a_scale_inv: torch.Tensor, a_block: List[int], b: torch.Tensor,
                              b_scale_inv: torch.Tensor, b_block: List[int], out_dtype: torch.dtype,
                              bias: Optional[torch.Tensor]) -> torch.Tensor:
    a_block, b_block = tuple(a_block), tuple(b_block)
    m, k = a.shape
    n = b.shape[1]
    if a_block not in ((1, 128), (128, 128)) or b_block not in ((128, 1), (128, 128)):
        raise ValueError(f"emulated_block_scaled_mm: blocks {a_block} x {b_block}; a takes (1, 128) or (128, 128), "
                         "b (128, 1) or (128, 128)")
    if b.shape[0] != k:
        raise ValueError(f"emulated_block_scaled_mm: a {tuple(a.shape)} and b {tuple(b.shape)} do not chain")
    kb = -(-k // 128)
    sa = a_scale_inv.repeat_interleave(a_block[0], dim=0)[:m]  # (M, Kb)
    sb = b_scale_inv.repeat_interleave(b_block[1], dim=1)[:, :n]  # (Kb, N)
    if sa.shape != (m, kb) or sb.shape != (kb, n):
        raise ValueError(f"emulated_block_scaled_mm: scale_inv shapes {tuple(a_scale_inv.shape)} / "
                         f"{tuple(b_scale_inv.shape)} do not fit a {tuple(a.shape)} / b {tuple(b.shape)}")
    with torch.autocast(a.device.type, enabled=False):  # float32 sums (see emulated_scaled_mm)
        acc = torch.zeros(m, n, dtype=torch.float32, device=a.device)
        for i in range(kb):
            part = torch.mm(a[:, i * 128:(i + 1) * 128].float(), b[i * 128:(i + 1) * 128].float())
            acc += part * (sa[:, i:i + 1] * sb[i:i + 1, :])
        if bias is not None:
            acc += bias.to(out_dtype).float()
    return acc.to(out_dtype)


@_emulated_block_scaled_mm.register_fake
def _(a, a_scale_inv, a_block, b, b_scale_inv, b_block, out_dtype, bias):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


ROW = (1, 128)     # 1 x 128 blocks: one scale per row and 128-wide slice of K
TILE = (128, 128)  # 128 x 128 tiles


def block_scaled(a_scale_inv: torch.Tensor, b_scale_inv: torch.Tensor) -> bool:
    """Whether a GEMM's operands are block-scaled (2-D scale_invs) rather than per-tensor
    ((1,) or ()); a mix of the two is an error that names its likely cause."""
    a_block, b_block = a_scale_inv.dim() == 2, b_scale_inv.dim() == 2
    if a_block != b_block:
        raise ValueError(
            f"fp8train: a GEMM got a per-block scaled and a per-tensor scaled operand (scale_inv shapes "
            f"{tuple(a_scale_inv.shape)} and {tuple(b_scale_inv.shape)}): under BlockScaling every operand is "
            "cast by the layer's own block quantizers (Float8Tensor inputs and FSDP2's fp8_all_gather weights "
            "are per-tensor scaled)")
    return a_block


def block_scaled_mm(a: torch.Tensor, a_scale_inv: torch.Tensor, bt: torch.Tensor, bt_scale_inv: torch.Tensor,
                    bt_block: Tuple[int, int], *, out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None,
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(a * its block scale_invs) @ (bt * its block scale_invs)^T [+ bias], each operand with
    its blocks along its rows (the reduction dim K):

      a   (M, K) fp8 row-major, 1 x 128 blocks: a_scale_inv (M, ceil(K / 128))
      bt  (N, K) fp8 row-major (B^T, as fprop's W), bt_block TILE: bt_scale_inv
          (ceil(N / 128), ceil(K / 128)); bt_block ROW: bt_scale_inv (N, ceil(K / 128))

    Scale tensors may be strided views. CPU: emulated_block_scaled_mm (the specification);
    CUDA: torch.nn.functional.scaled_mm's blockwise scaling. `out`: written in place. Always
    FP32 promotion, whatever a GemmConfig says: cuBLASLt has no fast accumulation with
    128 x 128 blocks ("scaled_gemm doesn't support fast accum with 128x128 blockwise scaling")."""
    if bt_block not in (ROW, TILE):
        raise ValueError(f"block_scaled_mm: bt_block must be {ROW} or {TILE}, got {bt_block!r}")
    if a.is_cuda:
        y = _cuda_block_scaled_mm(a, a_scale_inv, bt, bt_scale_inv, bt_block, out_dtype, bias)
    else:
        b_block = (bt_block[1], bt_block[0])  # B (K, N) = bt^T: its blocks run along K, its columns
        y = emulated_block_scaled_mm(a, a_scale_inv, ROW, bt.t(), bt_scale_inv.t(), b_block, out_dtype, bias)
    return y if out is None else out.copy_(y)


def _cuda_block_scaled_mm(a, a_scale_inv, bt, bt_scale_inv, bt_block, out_dtype, bias) -> torch.Tensor:
    """block_scaled_mm on CUDA. First the operands as cuBLASLt's block scaling takes them, in
    torch ops (in traced code Inductor makes them): A's rows zero-padded to a multiple of 4
    where M is not (a copy of A; the output cut back: cuBLASLt found no algorithm for M = 70,
    took 64, 72 and 300, torch 2.11, 2026-12-01); a 1 x 128 operand's (rows, Kb) scales
    column-major (strides (1, rows)); 128 x 128 tiles as a (round_up(Kb, 4), Nb) view with
    strides (1, round_up(Kb, 4)) (the layouts ATen's ScaledBlas.cpp checks, torch 2.13). Then
    the GEMM: the extension's (csrc/lt_gemm.cpp: cuBLASLt with its algorithm cached; traced
    code calls its operator fp8train_lt::block_scaled_mm) where native.BLOCK_GEMM is on (the
    default) and the extension built, else torch.nn.functional.scaled_mm's blockwise scaling (torch >=
    2.10; traced code calls it through the operator fp8train::cuda_block_scaled_mm: Dynamo in
    torch 2.11 cannot trace torch._scaled_mm_v2). tests/gpu/test_block_scaling_gpu.py checks
    both against the emulation."""
    if a.dtype != torch.float8_e4m3fn or bt.dtype != torch.float8_e4m3fn:
        raise NotImplementedError(
            f"fp8train: the blockwise GEMM takes e4m3 operands only, got {a.dtype} x {bt.dtype}; use "
            "BlockScaling(fp8_format=Format.E4M3) (its default) on CUDA")
    m = a.shape[0]
    a, a_scale_inv, padded = rows_to_multiple_of_4(a, a_scale_inv)
    tiles = tuple(bt_block) == TILE
    scale_a = _column_major(a_scale_inv)
    scale_b = tile_scales(bt_scale_inv) if tiles else _column_major(bt_scale_inv)
    ext = native.gemm() if native.BLOCK_GEMM else None
    if ext is not None and out_dtype in native.DTYPE_CODES:
        y = ext.block_scaled_mm(a, scale_a, bt.t(), scale_b, tiles, native.DTYPE_CODES[out_dtype], bias)
    elif native.BLOCK_GEMM and out_dtype in native.DTYPE_CODES and native.gemm_op_loaded():  # traced code
        y = torch.ops.fp8train_lt.block_scaled_mm(a, scale_a, bt.t(), scale_b, tiles, out_dtype, bias)
    else:
        if not hasattr(F, "scaled_mm") or not hasattr(getattr(F, "ScalingType", None), "BlockWise128x128"):
            raise NotImplementedError(
                "fp8train: block-scaled FP8 GEMMs on CUDA need torch.nn.functional.scaled_mm with blockwise "
                f"ScalingType (BlockWise1x128, BlockWise128x128; torch >= 2.10; this torch is {torch.__version__}) "
                "or the C++ extension's block GEMM (fp8train.kernels.native.BLOCK_GEMM = True)")
        gemm_fn = torch.ops.fp8train.cuda_block_scaled_mm if torch.compiler.is_compiling() else _torch_block_gemm
        y = gemm_fn(a, scale_a, bt, scale_b, tiles, out_dtype, bias)
    return y[:m] if padded else y


def rows_to_multiple_of_4(a: torch.Tensor, a_scale_inv: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, bool]:
    """(a, a_scale_inv, padded): A (M, K) fp8 and its (M, Kb) scales with rows appended up to
    a multiple of 4 (zero bytes, unit scales) where M is not one. A symbolic M (a graph traced
    with dynamic shapes) not known to be a multiple of 4 is padded whatever its value, perhaps
    by no rows, and without a tensor of round_up(M, 4) - M rows: a branch on M % 4 would guard
    the graph on the token count's residue, and so would a size that may be 0 (torch's tensor
    metadata asks whether each size is 0 or 1); four rows are appended and the result cut to
    round_up(M, 4), a size never below 4, for every M alike (H200, torch 2.11: lengths 77 and
    93, then 100, compiled twice)."""
    m = a.shape[0]
    if statically_known_true(m % 4 == 0):
        return a, a_scale_inv, False
    rows = -(-m // 4) * 4
    zeros = a.new_zeros((4, a.shape[1]), dtype=torch.uint8)
    a = torch.cat((a.view(torch.uint8), zeros))[:rows].view(a.dtype)  # as bytes: cat and pad take no fp8
    return a, torch.cat((a_scale_inv, a_scale_inv.new_ones((4, a_scale_inv.shape[1]))))[:rows], True


def _torch_block_gemm(a: torch.Tensor, scale_a: torch.Tensor, bt: torch.Tensor, scale_b: torch.Tensor, tiles: bool,
                      out_dtype: torch.dtype, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """torch.nn.functional.scaled_mm's blockwise GEMM of operands laid out by _cuda_block_scaled_mm."""
    kinds = F.ScalingType
    # both scale layouts are column-major views; no copy unless a compiler laid them out otherwise
    scale_a, scale_b = _column_major(scale_a), _column_major(scale_b)
    fuse_bias = bias is not None and out_dtype in _BIAS_OUT_DTYPES
    y = F.scaled_mm(a, bt.t(), scale_a, kinds.BlockWise1x128, scale_b,
                    kinds.BlockWise128x128 if tiles else kinds.BlockWise1x128,
                    bias=bias.to(out_dtype) if fuse_bias else None, output_dtype=out_dtype, use_fast_accum=False)
    if bias is not None and not fuse_bias:
        y += bias.to(out_dtype)
    return y


# fixed stride order: the scales keep the layouts made for them
_cuda_block_scaled_mm_op = torch.library.custom_op("fp8train::cuda_block_scaled_mm", _torch_block_gemm,
                                                   mutates_args=(), device_types="cuda", tags=_GEMM_TAGS)


@_cuda_block_scaled_mm_op.register_fake
def _(a, scale_a, bt, scale_b, tiles, out_dtype, bias):
    return a.new_empty((a.shape[0], bt.shape[0]), dtype=out_dtype)


def _column_major(s: torch.Tensor) -> torch.Tensor:
    """s (rows, Kb) with strides (1, rows): a copy unless it is laid out so already."""
    return s if s.stride(0) == 1 or s.shape[0] == 1 else s.t().contiguous().t()


def tile_scales(s: torch.Tensor) -> torch.Tensor:
    """bt's tile scales (Nb, Kb) as torch's BlockWise128x128 B operand: (round_up(Kb, 4), Nb)
    with strides (1, round_up(Kb, 4)), the padding entries 1 (no block of K reads them). A view,
    no copy, where s is contiguous with Kb a multiple of 4, or the first Kb columns of a
    (Nb, round_up(Kb, 4)) buffer (the weight cast's scales: block_quantizer._tiles)."""
    nb, kb = s.shape
    kb4 = -(-kb // 4) * 4
    if kb % 4 == 0 and s.is_contiguous():
        return s.t()
    if nb > 0 and s.stride() == (kb4, 1) and _holds(s, nb * kb4):
        return s.as_strided((kb4, nb), (1, kb4))
    padded = s.new_ones(nb, kb4)
    padded[:, :kb].copy_(s)
    return padded.t()


def _holds(s: torch.Tensor, numel: int) -> bool:
    """Whether s's storage holds `numel` elements from s's offset on (in traced code, where
    the only such strided scales are the weight cast's padded buffers, taken as so)."""
    if torch.compiler.is_compiling():
        return True
    return (s.storage_offset() + numel) * s.element_size() <= s.untyped_storage().nbytes()


def fprop(x: torch.Tensor, x_scale_inv: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor,
          config: GemmConfig, out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None,
          out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Y (M, N) = X (M, K) @ W^T; x (M, K) and w (N, K) fp8 row-major (block-scaled: X in
    1 x 128 blocks, W in 128 x 128 tiles)."""
    if block_scaled(x_scale_inv, w_scale_inv):
        return block_scaled_mm(x, x_scale_inv, w, w_scale_inv, TILE, out_dtype=out_dtype, bias=bias, out=out)
    return scaled_mm(x, x_scale_inv, w.t(), w_scale_inv, role=GemmRole.FPROP, config=config,
                     out_dtype=out_dtype, bias=bias, out=out)


def dgrad(dy: torch.Tensor, dy_scale_inv: torch.Tensor, w_t: torch.Tensor, w_scale_inv: torch.Tensor,
          config: GemmConfig, out_dtype: torch.dtype, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """dX (M, K) = dY (M, N) @ W; dy (M, N) fp8 row-major, w_t (K, N) W's transposed copy, row-major
    (block-scaled: dY in 1 x 128 blocks, w_t in W's tiles transposed, w_scale_inv (Kb, Nb))."""
    if block_scaled(dy_scale_inv, w_scale_inv):
        return block_scaled_mm(dy, dy_scale_inv, w_t, w_scale_inv, TILE, out_dtype=out_dtype, out=out)
    return scaled_mm(dy, dy_scale_inv, w_t.t(), w_scale_inv, role=GemmRole.DGRAD, config=config,
                     out_dtype=out_dtype, out=out)


def wgrad(dy_t: torch.Tensor, dy_scale_inv: torch.Tensor, x_t: torch.Tensor, x_scale_inv: torch.Tensor,
          config: GemmConfig, out_dtype: torch.dtype) -> torch.Tensor:
    """dW (N, K) = dY^T @ X from the padded transposed copies dy_t (N, Mp) and x_t (K, Mp)
    (block-scaled: both in 1 x 128 blocks along Mp, scale_invs (N, Mb) and (K, Mb): the
    transposed copies' own, Cast.scale_inv_t)."""
    if block_scaled(dy_scale_inv, x_scale_inv):
        return block_scaled_mm(dy_t, dy_scale_inv, x_t, x_scale_inv, ROW, out_dtype=out_dtype)
    return scaled_mm(dy_t, dy_scale_inv, x_t.t(), x_scale_inv, role=GemmRole.WGRAD, config=config,
                     out_dtype=out_dtype)
