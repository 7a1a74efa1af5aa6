"""FP8 GEMMs with torch._scaled_mm's contract, one function per GEMM role.

torch._scaled_mm computes (a * scale_a) @ (b * scale_b) with a (M, K) row-major and b (K, N)
column-major, K and N multiples of 16 (M is free), and takes the *inverse* scales. So each
role picks the layout it needs (docs/design.md, "Tensor roles and layouts"):

  FPROP  Y  (M, N) = X (M, K)          @ W^T: W (N, K) row-major is W^T column-major
  DGRAD  dX (M, K) = dY (M, N)         @ W:   W's transposed copy (K, N) row-major, .t()
  WGRAD  dW (N, K) = dY^T (N, Mp)      @ X:   X's transposed copy (K, Mp) row-major, .t()
         with Mp = M rounded up to 16; the padding columns of both copies are zero.
Accumulation precision comes from GemmConfig per role, never from the FP8 dtypes.

On the GPU the GEMM runs through the C++ extension's `scaled_mm` (csrc/lt_gemm.cpp: cuBLASLt
with its algorithm cached, the bytes torch._scaled_mm gives, less host time), the one the C++
nodes call; torch._scaled_mm itself on the CPU, in traced code and without the extension.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

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
    ext = native.gemm() if a.is_cuda else None
    if ext is not None and out_dtype in native.DTYPE_CODES:
        return ext.scaled_mm(a, a_scale_inv, b, b_scale_inv, config.fast_accum(role), native.DTYPE_CODES[out_dtype],
                             bias, out)
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


def fprop(x: torch.Tensor, x_scale_inv: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor,
          config: GemmConfig, out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None,
          out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Y (M, N) = X (M, K) @ W^T; x (M, K) and w (N, K) fp8 row-major."""
    return scaled_mm(x, x_scale_inv, w.t(), w_scale_inv, role=GemmRole.FPROP, config=config,
                     out_dtype=out_dtype, bias=bias, out=out)


def dgrad(dy: torch.Tensor, dy_scale_inv: torch.Tensor, w_t: torch.Tensor, w_scale_inv: torch.Tensor,
          config: GemmConfig, out_dtype: torch.dtype, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """dX (M, K) = dY (M, N) @ W; dy (M, N) fp8 row-major, w_t (K, N) W's transposed copy, row-major."""
    return scaled_mm(dy, dy_scale_inv, w_t.t(), w_scale_inv, role=GemmRole.DGRAD, config=config,
                     out_dtype=out_dtype, out=out)


def wgrad(dy_t: torch.Tensor, dy_scale_inv: torch.Tensor, x_t: torch.Tensor, x_scale_inv: torch.Tensor,
          config: GemmConfig, out_dtype: torch.dtype) -> torch.Tensor:
    """dW (N, K) = dY^T @ X from the padded transposed copies dy_t (N, Mp) and x_t (K, Mp)."""
    return scaled_mm(dy_t, dy_scale_inv, x_t.t(), x_scale_inv, role=GemmRole.WGRAD, config=config,
                     out_dtype=out_dtype)
