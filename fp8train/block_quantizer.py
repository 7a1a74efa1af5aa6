"""Block-scaled quantizers (recipe.BlockScaling): per-block scales from each block's own amax,
no state; their casts return a BlockCast (per-block scale_invs, and data_t's own)."""
from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F

from . import kernels, ops
from .kernels.block_reference import Block, blocks_of
from .quantizer import Quantizer
from .recipe import BlockScaling, Recipe
from .roles import TensorRole
from .tensor import padded_rows


class BlockCast(NamedTuple):
    """A block-scaled cast's outputs (BlockScalingQuantizer.cast): Cast's fields with per-block
    2-D scale_invs, and data_t with its own. (data, scale_inv) and (data_t, scale_inv_t) are
    each an FP8 tensor with its blocks laid along its rows, in its own frame.
    Note: a separate type, not a fifth field of Cast, so that code unpacking a per-tensor
    Cast into four names stays as it is."""

    data: torch.Tensor                # x's shape, fp8, row-major
    data_t: Optional[torch.Tensor]    # (cols, padded rows) fp8 transposed copy, zero padded; or None
    scale_inv: torch.Tensor           # (blocks of rows, blocks of cols) float32, one 1/scale per block
    dbias: Optional[torch.Tensor] = None        # (cols,) float32 column sums of x's rows
    scale_inv_t: Optional[torch.Tensor] = None  # data_t's per-block scale_inv (with data_t)

    @property
    def transposed_scale_inv(self) -> Optional[torch.Tensor]:
        return self.scale_inv_t


ROW_BLOCKS: Block = (1, 128)    # inputs and gradients: 128 along each row (the GEMM's reduction dim)
TILE_BLOCKS: Block = (128, 128)  # weights


class BlockScalingQuantizer(Quantizer):
    """Block-scaled casts (recipe.BlockScaling; the blocks and edge cases are
    kernels/block_reference.py's): one scale per block from the block's own amax, so like
    current scaling it keeps no state; its state_dict holds fp8_max alone (the format).

    `block`: ROW_BLOCKS (1 x 128) for INPUT and GRAD_OUTPUT, TILE_BLOCKS (128 x 128) for
    WEIGHT. cast(x, transpose=True) returns with data_t the operand of the GEMM that reduces
    over x's rows (docs/design.md, "Block scaling"), each with its blocks along its rows:
      row blocks   x also cast with 128 x 1 blocks (on CUDA from the same read of x,
                   kernels.block_cast_both), written transposed into data_t (cols, rows
                   rounded up to 128, zero padded: the wgrad's reduction dim holds whole
                   blocks), scale_inv_t (cols, ceil(rows / 128)), a transposed view of the
                   (ceil(rows / 128), cols) scales the cast writes;
      tiles        the same tiles transposed, no second cast: data_t (cols, padded_rows(rows))
                   the payload's bytes transposed, scale_inv_t = scale_inv.t().
    No Float8Tensor form (its scale_inv is one number): `quantize` refuses; layers use `cast`.
    """

    blockwise = True

    def __init__(self, role: TensorRole, dtype: torch.dtype, device=None, power_of_two: bool = False):
        super().__init__(role, dtype, device, power_of_two)
        self.block = TILE_BLOCKS if role is TensorRole.WEIGHT else ROW_BLOCKS

    def cast(self, x: torch.Tensor, *, transpose: bool = False, dbias: bool = False) -> BlockCast:
        x = self._checked(x)
        rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # (M, K)
        traced = torch.compiler.is_compiling()
        if self.block == ROW_BLOCKS and not traced and rows.is_cuda:
            made = self._native_cast(rows, transpose, dbias)
            if made is not None:
                data, data_t, scale_inv, db, scale_inv_cols = made
                return BlockCast(data.view(x.shape), data_t, scale_inv, db,
                                 None if scale_inv_cols is None else scale_inv_cols.t())
        if self.block == TILE_BLOCKS:
            data, scale_inv, data_t, scale_inv_t = _tiles(rows, self.dtype, transpose, self.power_of_two, traced)
        else:
            data, scale_inv, data_t, scale_inv_t = _rows(rows, self.dtype, transpose, self.power_of_two, traced)
        db = rows.sum(0, dtype=torch.float32) if dbias else None
        return BlockCast(data.view(x.shape), data_t, scale_inv, db, scale_inv_t)

    def cast_stacked(self, parts, *, transpose: bool = False) -> BlockCast:
        """cast(torch.cat(parts), transpose=transpose) for a WEIGHT quantizer, the parts
        (row-stacked 2-D weights, each but the last a multiple of 128 rows: a stacked tie's,
        modules/stacked.py) read where they lie, without the concatenated copy: one launch of
        the tile cast over up to block_kernel.MAX_PARTS parts (traced: the operator
        fp8train::weight_tiles_stacked); more parts are concatenated first."""
        from .kernels.block_kernel import MAX_PARTS
        if self.block != TILE_BLOCKS or len(parts) > MAX_PARTS:
            return self.cast(torch.cat(list(parts)), transpose=transpose)
        parts = [self._checked(p) for p in parts]
        traced = torch.compiler.is_compiling()
        if traced:
            data, scales, data_t, scales_t = torch.ops.fp8train.weight_tiles_stacked(
                [p.detach() for p in parts], self.dtype, transpose, self.power_of_two)
        else:
            data, scales, data_t, scales_t = _new_tiles(parts, self.dtype, transpose, self.power_of_two)
        mb, kb = blocks_of(data.shape, TILE_BLOCKS)
        if not transpose:
            return BlockCast(data, None, scales[:, :kb])
        return BlockCast(data, data_t, scales[:, :kb], None, scales_t[:, :mb])

    def cast_parts(self, parts, *, transpose: bool = True, dbias: bool = False) -> BlockCast:
        """cast(torch.cat(parts, dim=-1), transpose=transpose, dbias=dbias) for a GRAD quantizer
        (1 x 128 blocks), the parts (..., N_i) column-stacked (each N_i but the last a multiple
        of 128: a stacked tie's output gradients, modules/stacked.py) read where they lie,
        without the concatenated copy: one launch of the two-way cast (without transpose, its
        1 x 128 half) over up to block_kernel.MAX_PARTS parts (traced: the operator
        fp8train::block_cast_parts); more parts, or other blocks, are concatenated first. data
        is (M, sum N_i)."""
        from .kernels.block_kernel import MAX_PARTS
        rows = [p.reshape(-1, p.shape[-1]) for p in (self._checked(p) for p in parts)]
        if self.block != ROW_BLOCKS or len(rows) > MAX_PARTS:
            return self.cast(torch.cat(rows, dim=1), transpose=transpose, dbias=dbias)
        if torch.compiler.is_compiling():
            data, scale_inv, data_t, scale_inv_cols = torch.ops.fp8train.block_cast_parts(
                [r.detach() for r in rows], self.dtype, transpose, self.power_of_two)
        else:
            data, scale_inv, data_t, scale_inv_cols = _new_cast(rows, self.dtype, transpose, self.power_of_two)
        db = torch.cat([r.sum(0, dtype=torch.float32) for r in rows]) if dbias else None
        if not transpose:
            return BlockCast(data, None, scale_inv, db, None)
        return BlockCast(data, data_t, scale_inv, db, scale_inv_cols.t())

    def cast_gated(self, g: torch.Tensor, u: torch.Tensor, act: str) -> BlockCast:
        """cast(act(g) * u, transpose=True) for an INPUT quantizer (1 x 128 blocks), the product
        rounded to g's dtype as the gated kernel stores it (kernels/gated_reference.py), but
        computed inside the cast's own read of g and u and never stored (kernels.gated_block_cast;
        traced: the operator fp8train::gated_block_cast). g, u (M, K): a gated MLP's gate and
        up outputs, any row stride (the halves of the stacked gate/up GEMM's output)."""
        return self._gated((g, u), act)

    def cast_gated_kept(self, g: torch.Tensor, u: torch.Tensor, act: str, keep: torch.dtype
                        ) -> Tuple[BlockCast, torch.Tensor]:
        """(cast(act(g) * u), the product in `keep`): cast_gated without the transposed copy,
        the product stored by the same kernel (BlockScaling(fp8_wgrad=False): the next layer's
        bf16 wgrad reads it). Traced: the operator fp8train::computed_block_cast_kept."""
        return self._kept((g, u), act, keep)

    def cast_gated_grad_kept(self, da: torch.Tensor, g: torch.Tensor, u: torch.Tensor, act: str,
                             keep: torch.dtype) -> Tuple[BlockCast, torch.Tensor]:
        """(cast(dg | du), dg | du in `keep`): cast_gated_grad likewise (the gate/up GEMM's
        bf16 wgrad reads them)."""
        return self._kept((da, g, u), act, keep)

    def cast_gated_grad(self, da: torch.Tensor, g: torch.Tensor, u: torch.Tensor, act: str) -> BlockCast:
        """cast_parts([dg, du]) for a GRAD quantizer, dg and du the gradients of act(g) * u
        given da (kernels/gated_reference.py, each rounded to g's dtype), computed inside the
        cast's reads of da, g and u and never stored (kernels.gated_grad_block_cast; traced:
        fp8train::gated_block_cast). data is (M, 2K); K a multiple of 128."""
        return self._gated((da, g, u), act)

    def cast_norm(self, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, out_dtype: torch.dtype
                  ) -> BlockCast:
        """cast(y, transpose=True) for an INPUT quantizer, y an RMS norm's output weight * (x *
        rstd rounded to x's dtype) in out_dtype (modules/rms_norm.py's formula, its rstd given),
        computed inside the cast's read of x and never stored (kernels.norm_block_cast; traced:
        the operator fp8train::norm_block_cast). x (..., K), rstd x's leading shape (or with
        a trailing 1)."""
        if self.block != ROW_BLOCKS:
            raise ValueError(f"{type(self).__name__}({self.role.name}): the norm's cast takes 1 x 128 blocks")
        x = self._checked(x).detach()
        rows = x.reshape(-1, x.shape[-1])
        rstd = rstd.detach().reshape(-1)
        if torch.compiler.is_compiling():
            data, scale_inv, data_t, scale_inv_cols = torch.ops.fp8train.norm_block_cast(
                rows, weight.detach(), rstd, out_dtype, self.dtype, self.power_of_two)
        else:
            data, scale_inv, data_t, scale_inv_cols = _new_norm_cast(rows, weight.detach(), rstd, out_dtype, self.dtype,
                                                                     self.power_of_two)
        return BlockCast(data, data_t, scale_inv, None, scale_inv_cols.t())

    def cast_norm_kept(self, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, out_dtype: torch.dtype,
                       keep: torch.dtype) -> Tuple[BlockCast, torch.Tensor]:
        """(cast(y), y in `keep`): cast_norm without the transposed copy, y (in out_dtype,
        then `keep`) stored by the same kernel, for a bf16 wgrad (BlockScaling(fp8_wgrad=False))."""
        if self.block != ROW_BLOCKS:
            raise ValueError(f"{type(self).__name__}({self.role.name}): the norm's cast takes 1 x 128 blocks")
        x = self._checked(x).detach()
        rows = x.reshape(-1, x.shape[-1])
        return self._kept((rows, weight.detach(), rstd.detach().reshape(-1)), out_dtype, keep)

    def _kept(self, inputs, how, keep: torch.dtype) -> Tuple[BlockCast, torch.Tensor]:
        """A computed one-way cast with its values kept: inputs (g, u) or (da, g, u) with `how`
        the activation, or (x rows, weight, rstd) with `how` the norm's out_dtype."""
        if self.block != ROW_BLOCKS:
            raise ValueError(f"{type(self).__name__}({self.role.name}): the gated casts take 1 x 128 blocks")
        if isinstance(how, str):
            inputs = [self._checked(t).detach() for t in inputs]
        if torch.compiler.is_compiling():
            data, scale_inv, kept = torch.ops.fp8train.computed_block_cast_kept(
                list(inputs), how if isinstance(how, str) else "", None if isinstance(how, str) else how, keep,
                self.dtype, self.power_of_two)
        else:
            data, scale_inv, kept = _new_kept(list(inputs), how, keep, self.dtype, self.power_of_two)
        return BlockCast(data, None, scale_inv, None, None), kept

    def _gated(self, inputs, act: str) -> BlockCast:
        if self.block != ROW_BLOCKS:
            raise ValueError(f"{type(self).__name__}({self.role.name}): the gated casts take 1 x 128 blocks")
        inputs = [self._checked(t).detach() for t in inputs]
        if torch.compiler.is_compiling():
            data, scale_inv, data_t, scale_inv_cols = torch.ops.fp8train.gated_block_cast(
                inputs, act, self.dtype, self.power_of_two)
        else:
            data, scale_inv, data_t, scale_inv_cols = _new_gated(inputs, act, self.dtype, self.power_of_two)
        return BlockCast(data, data_t, scale_inv, None, scale_inv_cols.t())

    def _native_cast(self, rows: torch.Tensor, transpose: bool, dbias: bool):
        """rows (M, K) cast by the C++ launcher through native_plan's plan (ext.cast_with: the
        outputs in one allocation, one launch, no Python launch path; the bytes and layouts of
        _new_cast's; sibling layers' shared cast takes it every step); or None where Python
        launches: the C++ node off, launch hooks (a profiler), rows not contiguous and 16-byte
        aligned on the current device, no plan."""
        from .kernels import native
        if (not native.ENABLED or not rows.is_contiguous() or rows.data_ptr() & 15 or rows.numel() == 0
                or rows.get_device() != torch._C._cuda_getDevice() or native.hooks_installed()):
            return None
        plan = self.native_plan(tuple(rows.shape), rows.dtype, transpose, torch.float32 if dbias else None)
        if plan is None:
            return None
        return native.extension().cast_with(plan, rows, False)

    def quantize(self, x, *, transpose=False, out=None):
        raise NotImplementedError(f"{self.role.name} quantizer: a block-scaled cast has no Float8Tensor form "
                                  "(its scale_inv is one number); use .cast(x), which returns data and per-block "
                                  "scale_inv")

    def requantize(self, x, out, *, transpose=False, skip=None):
        self.quantize(x)

    def allocate(self, shape, device, *, transpose=False):
        raise NotImplementedError(f"{self.role.name} quantizer: block-scaled casts are not written by producer "
                                  "kernels (norm, activation) yet")

    def produce(self, first_pass, cast, amax_hook=None):
        self.allocate(None, None)

    def native_plan(self, shape, dtype: torch.dtype, transpose: bool, dbias_dtype: Optional[torch.dtype]):
        """The C++ cast plan (kernels/native.py) of this quantizer's cast of a contiguous 2-D
        input of `shape` and `dtype` on the current CUDA device: one launch of the block cast
        kernel (block_kernel.native_launch), dbias (dbias_dtype) from the same float32 column
        sums as `cast`; None for 128 x 128 tiles (weights: Python casts them, the node may
        re-cast them, native_recast) or where the C++ launcher cannot run it. Made on the first
        call, kept with the preparations."""
        key = ("native", tuple(shape), dtype, transpose, dbias_dtype)
        prepared = self._prepared
        if key in prepared:
            return prepared[key]
        from .kernels import block_kernel, native
        ext = native.extension()
        plan = None
        if (self.block == ROW_BLOCKS and ext is not None and dtype in native.DTYPE_CODES
                and (dbias_dtype is None or dbias_dtype in native.DTYPE_CODES)):
            device = torch._C._cuda_getDevice()
            spec = block_kernel.native_launch(shape, dtype, self.dtype, transpose, self.power_of_two,
                                              torch.device("cuda", device))
            if spec is not None:
                m, k = shape
                plan = ext.CastPlan(device, native.DTYPE_CODES[dtype], self.dtype == torch.float8_e5m2, [m, k],
                                    [k, -(-m // 128) * 128] if transpose else [], [ext.Launch(*spec[0])], None,
                                    None, native.DTYPE_CODES[dbias_dtype or torch.float32], list(spec[1]),
                                    block=True, block_dbias=dbias_dtype is not None)
        prepared[key] = plan
        return plan

    def native_recast(self, w: torch.Tensor, kept: BlockCast, transpose: bool):
        """The C++ re-cast plan (csrc/linear_node.cpp `recast`, a tile plan) that casts the
        weight `w` into `kept`'s buffers in place, the node's first step: one launch of the
        one-launch tile cast (block_kernel.native_launch(tiles=True)); or None where Python
        must cast: `kept` not of _tiles' form (its scales the first columns of padded
        buffers) or without the transposed copy `transpose` wants, w not a
        contiguous, 16-byte aligned 2-D CUDA tensor of kept's shape and device, no extension.
        Made on the first call, kept with the preparations."""
        if self.block != TILE_BLOCKS or not w.is_cuda or w.dim() != 2 \
                or not w.is_contiguous() or w.data_ptr() & 15 or kept.data.shape != w.shape \
                or kept.data.dtype != self.dtype or kept.data.device != w.device:
            return None
        if transpose and kept.data_t is None:
            return None
        for s in (kept.scale_inv, kept.scale_inv_t) if transpose else (kept.scale_inv,):
            if s.stride() != (_round4(s.shape[1]), 1):  # not a padded buffer's first columns
                return None
        key = ("recast", tuple(w.shape), w.dtype, transpose)
        prepared = self._prepared
        if key in prepared:
            return prepared[key]
        from .kernels import block_kernel, native
        ext = native.extension()
        plan = None
        if ext is not None and w.dtype in native.DTYPE_CODES:
            device = w.get_device()
            spec = block_kernel.native_launch(w.shape, w.dtype, self.dtype, transpose, self.power_of_two,
                                              torch.device("cuda", device), tiles=True)
            if spec is not None:
                m, k = w.shape
                plan = ext.CastPlan(device, native.DTYPE_CODES[w.dtype], self.dtype == torch.float8_e5m2, [m, k],
                                    [k, padded_rows(m)] if transpose else [], [ext.Launch(*spec[0])], None, None,
                                    native.DTYPE_CODES[torch.float32], list(spec[1]), block=True, tiles=True)
        prepared[key] = plan
        return plan

    def _steady_launches(self, shape, dtype, transpose, dbias):
        return None  # native_plan makes the block cast's plan itself

    def matches(self, recipe: Recipe, role: TensorRole) -> bool:
        return isinstance(recipe, BlockScaling) and self.dtype == recipe.fp8_format.dtype(role)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, block={self.block[0]}x{self.block[1]}"


def _scales(shape, device: torch.device, block: Block) -> torch.Tensor:
    """An empty float32 scale_inv for the blocks of a (rows, cols) `shape`: 1 x 128 blocks'
    (M, Kb) column-major, the layout the CUDA GEMM takes for its A operand
    (gemm._column_major: else a copy per GEMM); the others row-major."""
    n_rows, n_cols = blocks_of(shape, block)
    if tuple(block) == ROW_BLOCKS:
        return torch.empty((n_cols, n_rows), dtype=torch.float32, device=device).t()
    return torch.empty((n_rows, n_cols), dtype=torch.float32, device=device)


def _new_cast(rows, dtype: torch.dtype, both: bool, power_of_two: bool, traced: bool = False):
    """rows (M, K) cast in 1 x 128 blocks into fresh buffers: (data, scale_inv, data_t,
    scale_inv_cols). both: rows also in 128 x 1 blocks, transposed into data_t (K, Mb * 128)
    with scale_inv_cols (Mb, K), from one read of rows on CUDA (kernels.block_cast_both); else
    the last two are None. rows may be a list of column-stacked parts (cast_parts; without
    both, the two-way kernel's 1 x 128 half reads them in place). traced: inside the operator
    fp8train::block_cast (or block_cast_parts)."""
    first = rows if isinstance(rows, torch.Tensor) else rows[0]
    m, device = first.shape[0], first.device
    k = first.shape[1] if isinstance(rows, torch.Tensor) else sum(p.shape[1] for p in rows)
    data = torch.empty((m, k), dtype=dtype, device=device)
    scale_inv = _scales((m, k), device, ROW_BLOCKS)
    if not both:
        if isinstance(rows, torch.Tensor):
            kernels.block_cast(rows, data, scale_inv, ROW_BLOCKS, power_of_two, traced)
        else:
            kernels.block_cast_both(rows, data, None, scale_inv, None, power_of_two, traced)
        return data, scale_inv, None, None
    data_t = torch.empty((k, padded_rows(m, 128)), dtype=dtype, device=device)
    scale_inv_cols = _scales((m, k), device, (128, 1))
    kernels.block_cast_both(rows, data, data_t, scale_inv, scale_inv_cols, power_of_two, traced)
    return data, scale_inv, data_t, scale_inv_cols


def _new_gated(inputs, act: str, dtype: torch.dtype, power_of_two: bool, traced: bool = False):
    """_new_cast(..., both=True)'s buffers and layouts, filled by a gated cast: inputs (g, u),
    the product act(g) * u (M, K); or (da, g, u), its gradients dg | du (M, 2K)."""
    first = inputs[0]
    m, k = first.shape
    data, scale_inv, data_t, scale_inv_cols = _both_buffers(m, k if len(inputs) == 2 else 2 * k, dtype, first.device)
    cast = kernels.gated_block_cast if len(inputs) == 2 else kernels.gated_grad_block_cast
    cast(*inputs, act, data, data_t, scale_inv, scale_inv_cols, power_of_two, traced)
    return data, scale_inv, data_t, scale_inv_cols


def _new_kept(inputs, how, keep: torch.dtype, dtype: torch.dtype, power_of_two: bool, traced: bool = False):
    """(data, scale_inv, kept): a computed cast's 1 x 128 half and its values in `keep`, from
    one kernel: inputs (g, u) the product, (da, g, u) dg | du (how: the activation), or
    (x, weight, rstd) an RMS norm's output (how: its out_dtype)."""
    first = inputs[0]
    m, k = first.shape
    width = 2 * k if len(inputs) == 3 and isinstance(how, str) else k
    data = torch.empty((m, width), dtype=dtype, device=first.device)
    scale_inv = _scales((m, width), first.device, ROW_BLOCKS)
    kept = torch.empty((m, width), dtype=keep, device=first.device)
    if not isinstance(how, str):
        kernels.norm_block_cast(*inputs, how, data, None, scale_inv, None, power_of_two, traced, keep=kept)
    elif len(inputs) == 2:
        kernels.gated_block_cast(*inputs, how, data, None, scale_inv, None, power_of_two, traced, keep=kept)
    else:
        kernels.gated_grad_block_cast(*inputs, how, data, None, scale_inv, None, power_of_two, traced, keep=kept)
    return data, scale_inv, kept


def _both_buffers(m: int, k: int, dtype: torch.dtype, device):
    """_new_cast(..., both=True)'s fresh buffers: (data, scale_inv, data_t, scale_inv_cols)."""
    return (torch.empty((m, k), dtype=dtype, device=device), _scales((m, k), device, ROW_BLOCKS),
            torch.empty((k, padded_rows(m, 128)), dtype=dtype, device=device), _scales((m, k), device, (128, 1)))


def _new_norm_cast(x, weight, rstd, out_dtype: torch.dtype, dtype: torch.dtype, power_of_two: bool,
                   traced: bool = False):
    """_both_buffers filled by kernels.norm_block_cast: an RMS norm's output cast both ways."""
    data, scale_inv, data_t, scale_inv_cols = _both_buffers(*x.shape, dtype, x.device)
    kernels.norm_block_cast(x, weight, rstd, out_dtype, data, data_t, scale_inv, scale_inv_cols, power_of_two, traced)
    return data, scale_inv, data_t, scale_inv_cols


def _rows(rows: torch.Tensor, dtype: torch.dtype, transpose: bool, power_of_two: bool, traced: bool):
    """rows (M, K) in 1 x 128 blocks: (data, scale_inv, data_t, scale_inv_t), the last two
    with transpose (rows also in 128 x 1 blocks, transposed: BlockScalingQuantizer.cast) else None."""
    if traced:  # the eager kernels as the operator fp8train::block_cast, launched by Inductor
        data, scale_inv, data_t, scale_inv_cols = torch.ops.fp8train.block_cast(
            rows.detach(), dtype, False, transpose, power_of_two)
    else:
        data, scale_inv, data_t, scale_inv_cols = _new_cast(rows, dtype, transpose, power_of_two)
    return data, scale_inv, (data_t if transpose else None), (scale_inv_cols.t() if transpose else None)


def _tiles(w: torch.Tensor, dtype: torch.dtype, transpose: bool, power_of_two: bool, traced: bool):
    """w (M, K) in 128 x 128 tiles: (data, scale_inv (Mb, Kb), data_t (K, Mp), scale_inv_t
    (Kb, Mb)), the last two with transpose (the payload's bytes transposed) else None, from
    one launch on CUDA. Each scale_inv is the first columns of a buffer whose rows are padded
    to a multiple of 4 with 1s: gemm.tile_scales reads it as the block GEMM's operand without
    a copy (apart, a cast, a byte transpose and a padded copy of the scales per GEMM ran)."""
    mb, kb = blocks_of(w.shape, TILE_BLOCKS)
    if traced:  # the Triton kernel launched by Inductor (operator fp8train::block_cast)
        data, scales, data_t, scales_t = torch.ops.fp8train.block_cast(w.detach(), dtype, True, transpose,
                                                                       power_of_two)
    else:
        data, scales, data_t, scales_t = _new_tiles(w, dtype, transpose, power_of_two)
    if not transpose:
        return data, scales[:, :kb], None, None
    return data, scales[:, :kb], data_t, scales_t[:, :mb]


def _round4(n: int) -> int:
    return -(-n // 4) * 4


def _new_tiles(w, dtype: torch.dtype, transpose: bool, power_of_two: bool, traced: bool = False):
    """_tiles' fresh buffers, from one launch on CUDA (kernels.weight_tiles): (data, scales
    (Mb, round4(Kb)), data_t (K, Mp), scales_t (Kb, round4(Mb))), the last two None
    without transpose. w: a 2-D tensor, or a list of row-stacked parts (cast_stacked)."""
    first = w if isinstance(w, torch.Tensor) else w[0]
    m = first.shape[0] if isinstance(w, torch.Tensor) else sum(p.shape[0] for p in w)
    k, device = first.shape[1], first.device
    mb, kb = blocks_of((m, k), TILE_BLOCKS)
    data = torch.empty((m, k), dtype=dtype, device=device)
    scales = torch.empty((mb, _round4(kb)), dtype=torch.float32, device=device)
    data_t = scales_t = None
    if transpose:
        data_t = torch.empty((k, padded_rows(m)), dtype=dtype, device=device)
        scales_t = torch.empty((kb, _round4(mb)), dtype=torch.float32, device=device)
    kernels.weight_tiles(w, data, scales, data_t, scales_t, power_of_two, traced)
    return data, scales, data_t, scales_t


@torch.library.triton_op("fp8train::block_cast", mutates_args=())
def _block_cast_op(rows: torch.Tensor, fp8_dtype: torch.dtype, tiles: bool, both: bool,
                   power_of_two: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """_new_cast (row blocks; both: the transposed 128 x 1 cast too) or _new_tiles (tiles;
    both: the transposed copy too, scales padded) as an operator for traced code: its body launches the
    Triton kernels through wrap_triton, so Inductor launches them from its own code (off CUDA:
    fp8train::block_cast_cpu). Absent outputs are empty (0,) tensors."""
    if rows.is_cuda:
        if tiles:
            data, scales, data_t, scales_t = _new_tiles(rows, fp8_dtype, both, power_of_two, traced=True)
        else:
            data, scales, data_t, scales_t = _new_cast(rows, fp8_dtype, both, power_of_two, traced=True)
        if not both:
            data_t, scales_t = rows.new_empty(0, dtype=torch.float32), rows.new_empty(0, dtype=torch.float32)
        return data, scales, data_t, scales_t
    return torch.ops.fp8train.block_cast_cpu(rows, fp8_dtype, tiles, both, power_of_two)


@torch.library.custom_op("fp8train::block_cast_cpu", mutates_args=())
def _block_cast_cpu_op(rows: torch.Tensor, fp8_dtype: torch.dtype, tiles: bool, both: bool,
                       power_of_two: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp8train::block_cast off CUDA: ops.block_cast's torch ops run as one opaque operator,
    which Inductor calls rather than fuses. Traced into the graph, Inductor's CPU code (torch
    2.13) fused a tensor's 1 x 128 and 128 x 1 casts, whose loops differ ((M, Kb, 128) and
    (K, Mb, 128)), and failed an assertion in its loop split wherever both dims held whole
    blocks (a Linear after SiLU, widths 384, 128 tokens; tests/test_block_scaling_compile.py)."""
    if tiles:
        data, _, scale_inv, _, _ = ops.block_cast(rows, fp8_dtype, TILE_BLOCKS, power_of_two, False, False)
        mb, kb = scale_inv.shape
        scales = F.pad(scale_inv, (0, _round4(kb) - kb), value=1.0)
        if both:
            data_t = ops.bytes_transposed(data, padded_rows(rows.shape[0]))
            scales_t = F.pad(scale_inv.t(), (0, _round4(mb) - mb), value=1.0)
    else:
        data, data_t, scales, _, scale_inv_t = ops.block_cast(rows, fp8_dtype, ROW_BLOCKS, power_of_two, both, False)
        scales_t = scale_inv_t.t() if both else None
    if not both:
        data_t, scales_t = rows.new_empty(0, dtype=torch.float32), rows.new_empty(0, dtype=torch.float32)
    return tuple(t.contiguous() for t in (data, scales, data_t, scales_t))


@_block_cast_cpu_op.register_fake
def _(rows, fp8_dtype, tiles, both, power_of_two):
    m, k = rows.shape
    block = TILE_BLOCKS if tiles else ROW_BLOCKS
    mb, kb = blocks_of((m, k), block)
    data = rows.new_empty((m, k), dtype=fp8_dtype)
    scales = rows.new_empty((mb, _round4(kb)) if tiles else (mb, kb), dtype=torch.float32)
    if not both:
        return data, scales, rows.new_empty(0, dtype=torch.float32), rows.new_empty(0, dtype=torch.float32)
    if tiles:
        return data, scales, rows.new_empty((k, padded_rows(m)), dtype=fp8_dtype), \
            rows.new_empty((kb, _round4(mb)), dtype=torch.float32)
    col_blocks = blocks_of((m, k), (128, 1))[0]
    return data, scales, rows.new_empty((k, padded_rows(m, 128)), dtype=fp8_dtype), \
        rows.new_empty((col_blocks, k), dtype=torch.float32)


@torch.library.triton_op("fp8train::block_cast_parts", mutates_args=())
def _block_cast_parts_op(parts: List[torch.Tensor], fp8_dtype: torch.dtype, both: bool, power_of_two: bool
                         ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """_block_cast_op's 1 x 128 cast (both: with its transposed 128 x 1 copy) of the parts'
    column concatenation (BlockScalingQuantizer.cast_parts), the parts read in place by one
    Triton launch on CUDA; elsewhere _block_cast_op's body on the concatenation. Absent
    outputs are empty (0,) tensors."""
    if parts[0].is_cuda:
        data, scales, data_t, scales_t = _new_cast(parts, fp8_dtype, both, power_of_two, traced=True)
        if not both:
            data_t, scales_t = data.new_empty(0, dtype=torch.float32), data.new_empty(0, dtype=torch.float32)
        return data, scales, data_t, scales_t
    return _block_cast_op(torch.cat(parts, dim=1), fp8_dtype, False, both, power_of_two)


@torch.library.triton_op("fp8train::weight_tiles_stacked", mutates_args=())
def _weight_tiles_stacked_op(parts: List[torch.Tensor], fp8_dtype: torch.dtype, both: bool, power_of_two: bool
                             ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """_block_cast_op's tiles (both: the transposed copy too) of the parts' row concatenation
    (BlockScalingQuantizer.cast_stacked), the parts read in place by one Triton launch on
    CUDA; elsewhere _block_cast_op's body on the concatenation."""
    if parts[0].is_cuda:
        data, scales, data_t, scales_t = _new_tiles(parts, fp8_dtype, both, power_of_two, traced=True)
        if not both:
            data_t, scales_t = data.new_empty(0, dtype=torch.float32), data.new_empty(0, dtype=torch.float32)
        return data, scales, data_t, scales_t
    return _block_cast_op(torch.cat(parts), fp8_dtype, True, both, power_of_two)


@torch.library.triton_op("fp8train::gated_block_cast", mutates_args=())
def _gated_block_cast_op(inputs: List[torch.Tensor], act: str, fp8_dtype: torch.dtype, power_of_two: bool
                         ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """_new_gated as an operator for traced code (BlockScalingQuantizer.cast_gated and
    cast_gated_grad: inputs (g, u) or (da, g, u)): on CUDA one Triton launch from Inductor's
    code; elsewhere fp8train::gated_block_cast_cpu."""
    if inputs[0].is_cuda:
        return _new_gated(inputs, act, fp8_dtype, power_of_two, traced=True)
    return torch.ops.fp8train.gated_block_cast_cpu(inputs, act, fp8_dtype, power_of_two)


@torch.library.custom_op("fp8train::gated_block_cast_cpu", mutates_args=())
def _gated_block_cast_cpu_op(inputs: List[torch.Tensor], act: str, fp8_dtype: torch.dtype, power_of_two: bool
                             ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp8train::gated_block_cast off CUDA: the twin, opaque to Inductor (as block_cast_cpu)."""
    return tuple(t.contiguous() for t in _new_gated(inputs, act, fp8_dtype, power_of_two))


@_gated_block_cast_cpu_op.register_fake
def _(inputs, act, fp8_dtype, power_of_two):
    m, k = inputs[0].shape
    return tuple(t.contiguous() for t in _both_buffers(m, k if len(inputs) == 2 else 2 * k, fp8_dtype,
                                                       inputs[0].device))


@torch.library.triton_op("fp8train::norm_block_cast", mutates_args=())
def _norm_block_cast_op(x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, out_dtype: torch.dtype,
                        fp8_dtype: torch.dtype, power_of_two: bool
                        ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """_new_norm_cast as an operator for traced code (BlockScalingQuantizer.cast_norm): on CUDA
    one Triton launch from Inductor's code; elsewhere fp8train::norm_block_cast_cpu."""
    if x.is_cuda:
        return _new_norm_cast(x, weight, rstd, out_dtype, fp8_dtype, power_of_two, traced=True)
    return torch.ops.fp8train.norm_block_cast_cpu(x, weight, rstd, out_dtype, fp8_dtype, power_of_two)


@torch.library.custom_op("fp8train::norm_block_cast_cpu", mutates_args=())
def _norm_block_cast_cpu_op(x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, out_dtype: torch.dtype,
                            fp8_dtype: torch.dtype, power_of_two: bool
                            ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp8train::norm_block_cast off CUDA: the twin, opaque to Inductor (as block_cast_cpu)."""
    return tuple(t.contiguous() for t in _new_norm_cast(x, weight, rstd, out_dtype, fp8_dtype, power_of_two))


@_norm_block_cast_cpu_op.register_fake
def _(x, weight, rstd, out_dtype, fp8_dtype, power_of_two):
    return tuple(t.contiguous() for t in _both_buffers(*x.shape, fp8_dtype, x.device))


@torch.library.triton_op("fp8train::computed_block_cast_kept", mutates_args=())
def _computed_block_cast_kept_op(inputs: List[torch.Tensor], act: str, out_dtype: Optional[torch.dtype],
                                 keep: torch.dtype, fp8_dtype: torch.dtype, power_of_two: bool
                                 ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """_new_kept as an operator for traced code (BlockScalingQuantizer.cast_gated_kept,
    cast_gated_grad_kept: act the activation; cast_norm_kept: act "", out_dtype the norm's):
    on CUDA one Triton launch from Inductor's code; elsewhere fp8train::computed_block_cast_kept_cpu."""
    if inputs[0].is_cuda:
        return _new_kept(inputs, act or out_dtype, keep, fp8_dtype, power_of_two, traced=True)
    return torch.ops.fp8train.computed_block_cast_kept_cpu(inputs, act, out_dtype, keep, fp8_dtype, power_of_two)


@torch.library.custom_op("fp8train::computed_block_cast_kept_cpu", mutates_args=())
def _computed_block_cast_kept_cpu_op(inputs: List[torch.Tensor], act: str, out_dtype: Optional[torch.dtype],
                                     keep: torch.dtype, fp8_dtype: torch.dtype, power_of_two: bool
                                     ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp8train::computed_block_cast_kept off CUDA: the twin, opaque to Inductor (as block_cast_cpu)."""
    return tuple(t.contiguous() for t in _new_kept(inputs, act or out_dtype, keep, fp8_dtype, power_of_two))


@_computed_block_cast_kept_cpu_op.register_fake
def _(inputs, act, out_dtype, keep, fp8_dtype, power_of_two):
    m, k = inputs[0].shape
    width = 2 * k if act and len(inputs) == 3 else k
    return (inputs[0].new_empty((m, width), dtype=fp8_dtype),
            inputs[0].new_empty(blocks_of((m, width), ROW_BLOCKS), dtype=torch.float32),
            inputs[0].new_empty((m, width), dtype=keep))


def transpose_padded(data: torch.Tensor, cols: int) -> torch.Tensor:
    """(K, cols) fp8: data (M, K)'s bytes transposed, zero in columns M.. (cols >= M)."""
    out = torch.empty(data.shape[1], cols, dtype=data.dtype, device=data.device)
    kernels.byte_transpose(data, out)
    return out


def transpose_tiles(cast: BlockCast) -> BlockCast:
    """A WEIGHT's block cast with its transposed copy added from its own bytes (the same
    tiles, no second cast): what cast(w, transpose=True) returns, from cast(w)."""
    if cast.data_t is not None:
        return cast
    data = cast.data
    mb = cast.scale_inv.shape[0]
    scales_t = cast.scale_inv.new_ones(cast.scale_inv.shape[1], _round4(mb))  # padded as _tiles' (tile_scales)
    scales_t[:, :mb].copy_(cast.scale_inv.t())
    return cast._replace(data_t=transpose_padded(data, padded_rows(data.shape[0])), scale_inv_t=scales_t[:, :mb])
