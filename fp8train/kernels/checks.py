"""Argument checks shared by the kernel wrappers and their twins (cast, norm, activation):
each raises ValueError naming the function and the argument. Pure torch (the twins must not
import triton)."""
from __future__ import annotations

from typing import Optional

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def check_scalar(fn: str, name: str, t, dtype: torch.dtype, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor) or t.numel() != 1 or t.dtype != dtype or t.device != device:
        got = f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{fn}: {name} must be a one-element {dtype} tensor on {device}; got {got}")


def check_scales(fn: str, device: torch.device, scale, scale_inv_out, amax_out: Optional[torch.Tensor],
                 from_amax: Optional[torch.Tensor], nonfinite_count: Optional[torch.Tensor]) -> None:
    """The scale arguments of every cast (contract: reference.cast_amax)."""
    check_scalar(fn, "scale", scale, torch.float32, device)
    check_scalar(fn, "scale_inv_out", scale_inv_out, torch.float32, device)
    if amax_out is not None:
        check_scalar(fn, "amax_out", amax_out, torch.float32, device)
    if from_amax is not None:
        check_scalar(fn, "from_amax", from_amax, torch.float32, device)
        if amax_out is not None and amax_out.data_ptr() == from_amax.data_ptr():
            # The kernels read from_amax in every program while others max into amax_out.
            raise ValueError(f"{fn}: from_amax and amax_out must be different buffers")
    if nonfinite_count is not None:
        check_scalar(fn, "nonfinite_count", nonfinite_count, torch.int32, device)


def check_fp8_out(fn: str, name: str, t, shape, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype not in FP8_DTYPES:
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{fn}: {name} must be float8_e4m3fn or float8_e5m2; got {got}")
    if t.shape != shape or t.device != device or not t.is_contiguous():
        raise ValueError(f"{fn}: {name} must be a contiguous tensor of shape {tuple(shape)} on {device}; "
                         f"got {tuple(t.shape)} (contiguous={t.is_contiguous()}) on {t.device}")


def check_fp8_outputs(fn: str, m: int, n: int, device: torch.device, out, out_t) -> None:
    """out (M, N) fp8 and the optional transposed copy out_t (N, Mp >= M) of the same dtype."""
    check_fp8_out(fn, "out", out, (m, n), device)
    if out_t is None:
        return
    if not isinstance(out_t, torch.Tensor) or out_t.dim() != 2 or out_t.shape[0] != n or out_t.shape[1] < m:
        got = tuple(out_t.shape) if isinstance(out_t, torch.Tensor) else type(out_t).__name__
        raise ValueError(f"{fn}: out_t must be (N, Mp) = ({n}, >= {m}) for out of shape ({m}, {n}); got {got}")
    check_fp8_out(fn, "out_t", out_t, out_t.shape, device)
    if out_t.dtype != out.dtype:
        raise ValueError(f"{fn}: out ({out.dtype}) and out_t ({out_t.dtype}) must share an FP8 dtype")


def check_dbias(fn: str, dbias_out, n: int, device: torch.device) -> None:
    """dbias_out: None, or an (N,) float32 tensor for the column sums of x's rows."""
    if dbias_out is None:
        return
    if (not isinstance(dbias_out, torch.Tensor) or dbias_out.dtype != torch.float32 or dbias_out.shape != (n,)
            or dbias_out.device != device or not dbias_out.is_contiguous()):
        got = (f"{dbias_out.dtype} {tuple(dbias_out.shape)} on {dbias_out.device}"
               if isinstance(dbias_out, torch.Tensor) else type(dbias_out).__name__)
        raise ValueError(f"{fn}: dbias_out must be a contiguous float32 tensor of shape ({n},) on {device}; "
                         f"got {got}")


__all__ = ["FP8_DTYPES", "check_scalar", "check_scales", "check_fp8_out", "check_fp8_outputs", "check_dbias"]
