"""Pure-torch twins of the block-scaled FP8 casts (issue 25's BlockScaling): the specification.

A block-scaled tensor is FP8 data of x's shape and one float32 `scale_inv` per block of a
2-D x (rows, cols). `block` = (block rows, block cols):

  (1, 128)    128 consecutive elements of a row   scale_inv (rows, ceil(cols / 128))
  (128, 1)    128 consecutive elements of a column scale_inv (ceil(rows / 128), cols)
  (128, 128)  square tiles                        scale_inv (ceil(rows / 128), ceil(cols / 128))

Where a dim is not a multiple of the block, the last block covers what is left (a tail).

Per block (`block_scale`): amax = max |x| over the block, NaN counted as inf;
  amax > 0 and finite  scale = fp8_max / amax (IEEE float32), clamped to [2^-126, 2^126];
                       with power_of_two, then rounded down to a power of two (its mantissa
                       cleared), so that no rounding enters through the scale: q * scale_inv
                       is exact and the largest element still maps inside the FP8 range;
  amax 0, inf or NaN   scale = 1: a block has no earlier scale to keep (the tensorwise casts
                       keep the previous one); a NaN stays NaN and an inf saturates, as there.
q = fp8(clamp(x * scale, -fp8_max, fp8_max)) rounded to nearest even (reference.saturating_cast,
elementwise with each element's block scale), scale_inv = 1 / scale (IEEE float32).
"""
from __future__ import annotations

from typing import Tuple

import torch

from .. import scaling
from .reference import saturating_cast

Block = Tuple[int, int]
BLOCKS = ((1, 128), (128, 1), (128, 128))


def _check(x: torch.Tensor, block: Block) -> None:
    if x.dim() != 2:
        raise ValueError(f"block cast: x must be 2-D (rows, cols), got shape {tuple(x.shape)}")
    if tuple(block) not in BLOCKS:
        raise ValueError(f"block cast: block must be one of {BLOCKS}, got {block!r}")


def blocks_of(shape, block: Block) -> Tuple[int, int]:
    """The (block rows, block cols) grid of a 2-D shape: ceil of each dim over the block's."""
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


def block_amax(x: torch.Tensor, block: Block) -> torch.Tensor:
    """max |x| per block as float32 (NaN counted as inf), shape blocks_of(x.shape, block)."""
    _check(x, block)
    a = x.detach().float().abs()
    a = torch.where(torch.isnan(a), torch.inf, a)
    (br, bc), (nr, nc) = block, blocks_of(x.shape, block)
    a = torch.nn.functional.pad(a, (0, nc * bc - a.shape[1], 0, nr * br - a.shape[0]))  # zeros: never the max
    return a.reshape(nr, br, nc, bc).amax(dim=(1, 3))


def block_scale(amax: torch.Tensor, fp8_max: float, power_of_two: bool = False) -> torch.Tensor:
    """The scale of each block from its amax (module docstring), float32."""
    # 1 where amax is 0 or not finite; power_of_two clears the mantissa (scaling.round_down_pow2)
    return scaling.compute_scale(amax, torch.ones_like(amax), fp8_max, power_of_two=power_of_two)


def expand(per_block: torch.Tensor, shape, block: Block) -> torch.Tensor:
    """Per-block values repeated over each block's elements, cut to `shape`."""
    # Rows by a gather, columns as a concatenation of each column block's values broadcast:
    # Inductor (CPU, torch 2.13) miscompiles the other forms of these values that were tried
    # (repeat_interleave or expand + reshape, then cut; a gather along the columns), x * them
    # reading wrong elements in a tail block (tests/test_block_scaling_compile.py).
    if block[0] > 1:
        per_block = per_block[torch.arange(shape[0], device=per_block.device) // block[0]]
    if block[1] == 1:
        return per_block
    widths = [min(block[1], shape[1] - j * block[1]) for j in range(per_block.shape[1])]
    return torch.cat([per_block[:, j:j + 1].expand(shape[0], w) for j, w in enumerate(widths)], 1)


def block_cast(x: torch.Tensor, fp8_dtype: torch.dtype, block: Block,
               power_of_two: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """(data, scale_inv): x (rows, cols) in FP8 with one scale per block (module docstring)."""
    _check(x, block)
    scale = block_scale(block_amax(x, block), scaling.fp8_max(fp8_dtype), power_of_two)
    data = saturating_cast(x, expand(scale, x.shape, block), fp8_dtype)
    return data, scaling.scale_inverse(scale)


def block_dequantize(data: torch.Tensor, scale_inv: torch.Tensor, block: Block) -> torch.Tensor:
    """float32 data * scale_inv of each element's block."""
    return data.float() * expand(scale_inv, data.shape, block)


def check_norm_args(fn: str, x, weight, rstd, out_dtype) -> None:
    """kernels.norm_block_cast's inputs: x (M, K), weight (K,), rstd (M,) float32, one device;
    x, weight and out_dtype float32, bf16 or fp16."""
    floats = (torch.float32, torch.bfloat16, torch.float16)
    if (x.dim() != 2 or tuple(weight.shape) != (x.shape[1],) or tuple(rstd.shape) != (x.shape[0],)
            or rstd.dtype != torch.float32 or x.dtype not in floats or weight.dtype not in floats
            or out_dtype not in floats or not (x.device == weight.device == rstd.device)):
        raise ValueError(f"{fn}: x (M, K), weight (K,) and rstd (M,) float32 on one device, x, weight and out_dtype "
                         f"float32, bf16 or fp16; got x {x.dtype} {tuple(x.shape)}, weight {weight.dtype} "
                         f"{tuple(weight.shape)}, rstd {rstd.dtype} {tuple(rstd.shape)}, out_dtype {out_dtype}")


__all__ = ["BLOCKS", "Block", "block_amax", "block_cast", "block_dequantize", "block_scale", "blocks_of", "check_norm_args", "expand"]
