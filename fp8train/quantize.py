"""`fp8train.quantize`: one-off quantization of a tensor, outside any module or recipe."""
from __future__ import annotations

import math
from typing import Optional, Union

import torch

from . import kernels, scaling
from .roles import TensorRole
from .tensor import FP8_DTYPES, Float8Tensor


def check_high_precision(x: torch.Tensor, what: str = "quantize") -> None:
    if isinstance(x, Float8Tensor):
        raise TypeError(f"{what}: input is already a Float8Tensor")
    if not x.dtype.is_floating_point or x.dtype in FP8_DTYPES or x.dtype == torch.float64:
        raise TypeError(f"{what}: expected a bfloat16, float16 or float32 tensor, got {x.dtype}")


def quantize(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn,
             scale: Optional[Union[float, torch.Tensor]] = None,
             role: Optional[TensorRole] = None) -> Float8Tensor:
    """Quantize `x` into a new Float8Tensor.

    scale=None  current scaling: scale = fp8_max(dtype) / amax(x) (scaling.compute_scale;
                an all-zero or non-finite x gets scale 1).
    scale=s     q = fp8(x * s), saturating; `s` a positive finite number or a 0-dim float32
                tensor on x's device.
    The cast equals `x.float().mul(scale).clamp(-max, max).to(dtype)` bit for bit.
    """
    check_high_precision(x)
    scaling.fp8_max(dtype)  # validates dtype
    x = x.contiguous()
    data = torch.empty(x.shape, dtype=dtype, device=x.device)
    out = Float8Tensor(data, torch.empty((), dtype=torch.float32, device=x.device), x.dtype, role)
    _cast(x, out, scale)
    return out


def quantize_into(src: torch.Tensor, dst: Float8Tensor, scale=None) -> None:
    """Re-quantize `src` into `dst`'s existing storage (current scaling unless `scale` given)."""
    check_high_precision(src, "Float8Tensor.copy_")
    if src.shape != dst.shape:
        raise ValueError(f"Float8Tensor.copy_: shape {tuple(src.shape)} does not match {tuple(dst.shape)}")
    if not dst.fp8_data.is_contiguous():
        raise ValueError("Float8Tensor.copy_: the destination payload must be contiguous")
    _cast(src.to(dst.device).contiguous(), dst, scale)
    dst._mark_rewritten()


def _cast(x: torch.Tensor, out: Float8Tensor, scale) -> None:
    if scale is None:
        amax = torch.zeros((), dtype=torch.float32, device=x.device)
        kernels.amax(x, amax)
        s = torch.ones((), dtype=torch.float32, device=x.device)
        kernels.cast_amax(x, out.fp8_data, s, out.scale_inv, from_amax=amax)
        return
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1 or scale.dtype != torch.float32:
            raise ValueError(f"quantize: scale must be a one-element float32 tensor, got {scale.dtype} "
                             f"of shape {tuple(scale.shape)}")
        s = scale.reshape(()).to(x.device)
    else:
        if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
            raise ValueError(f"quantize: scale must be a positive finite number, got {scale!r}")
        s = torch.tensor(float(scale), dtype=torch.float32, device=x.device)
    kernels.cast_amax(x, out.fp8_data, s, out.scale_inv)
