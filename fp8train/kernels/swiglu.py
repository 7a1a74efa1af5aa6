"""Triton kernels: a gated MLP's silu(g) * u and its backward, one launch each way.

Twins: swiglu_reference.swiglu_fwd, swiglu_bwd (the specification and the argument checks;
same signatures, same in-place contract). The float32 expressions are the twin's op for op
with activation.py's sigmoid, so kernel and twin differ only where the GPU's exp2 and
reciprocal (ex2.approx, div.full.f32: within 2 ulps) differ from torch's; after rounding to
bf16 that rarely moves a bit (the GPU tests bound it).

The tensors are contiguous and of one shape, so both kernels run over flat element
offsets: each program takes BLOCK consecutive elements of every tensor.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ContextManager

import torch
import triton
import triton.language as tl

from . import swiglu_reference as ref
from .activation import _sigmoid, _sigmoid_complement
from .launcher import DirectKernel, LaunchOverride, device_guard


@dataclass(frozen=True)
class SwigluConfig:
    block: int      # elements per program
    num_warps: int


_override = LaunchOverride()  # SwigluConfig or None


def launch_config(device: torch.device) -> SwigluConfig:
    """The launch shape on `device`. CUDA: 2048 elements over 8 warps, 8 elements (16 bytes
    of bf16) per thread and tensor, the shape of a plain elementwise kernel. The interpreter:
    small blocks, so that test shapes span several programs and a partial last one."""
    if _override.value is not None:
        return _override.value
    if device.type == "cuda":
        return SwigluConfig(block=2048, num_warps=8)
    return SwigluConfig(block=64, num_warps=4)


def override_config(config: SwigluConfig) -> ContextManager[None]:
    """Use another launch shape inside the block (benchmark variants, tests); not thread-safe."""
    return _override.using(config)


@triton.jit
def _swiglu_fwd_kernel(g_ptr, u_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.cast(tl.program_id(0), tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s, _ = _sigmoid(x)
    tl.store(out_ptr + offs, ((x * s) * up).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(da_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n, BLOCK: tl.constexpr):
    offs = tl.cast(tl.program_id(0), tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    d = tl.load(da_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s, e = _sigmoid(x)
    dg = (d * up) * (s * tl.math.fma(x, _sigmoid_complement(x, s, e), 1.0))
    du = d * (x * s)
    tl.store(dg_ptr + offs, dg.to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + offs, du.to(du_ptr.dtype.element_ty), mask=mask)


@functools.lru_cache(maxsize=None)
def _kernel(backward: bool, cfg: SwigluConfig) -> DirectKernel:
    return DirectKernel(_swiglu_bwd_kernel if backward else _swiglu_fwd_kernel, num_warps=cfg.num_warps,
                        BLOCK=cfg.block)


def swiglu_fwd(g: torch.Tensor, u: torch.Tensor, out: torch.Tensor) -> None:
    """swiglu_reference.swiglu_fwd on the GPU (same contract; see there)."""
    ref.check_fwd_args("swiglu_fwd", g, u, out)
    _launch(False, g, u, out)


def swiglu_bwd(da: torch.Tensor, g: torch.Tensor, u: torch.Tensor, dg_out: torch.Tensor,
               du_out: torch.Tensor) -> None:
    """swiglu_reference.swiglu_bwd on the GPU (same contract; see there)."""
    ref.check_bwd_args("swiglu_bwd", da, g, u, dg_out, du_out)
    _launch(True, da, g, u, dg_out, du_out)


def _launch(backward: bool, *tensors: torch.Tensor) -> None:
    n = tensors[0].numel()
    if n == 0:
        return
    cfg = launch_config(tensors[0].device)
    with device_guard(tensors[0].device):
        _kernel(backward, cfg)(triton.cdiv(n, cfg.block), *tensors, n)


__all__ = ["SwigluConfig", "launch_config", "override_config", "swiglu_fwd", "swiglu_bwd"]
