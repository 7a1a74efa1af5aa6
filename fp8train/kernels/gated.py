"""Triton kernels: a gated MLP's act(g) * u (act silu or gelu_tanh) and its backward, one
launch each way.

Twins: gated_reference.gated_fwd, gated_bwd (the specification and the argument checks;
same signatures, same in-place contract). The float32 expressions are the twin's op for op
with activation.py's sigmoid and gelu_tanh, so kernel and twin differ only where the GPU's exp2 and
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

from . import gated_reference as ref
from .activation import _ACT_CODES as _ACTIVATION_CODES
from .activation import _SWIGLU, _act, _act_grad, _sigmoid, _sigmoid_complement
from .launcher import DirectKernel, LaunchOverride, device_guard


@dataclass(frozen=True)
class GatedConfig:
    block: int      # elements per program
    num_warps: int


_override = LaunchOverride()  # GatedConfig or None
# ACT codes: the activation family's, silu under its swiglu's code (whose gate takes silu)
_ACT_CODES = {"silu": _ACTIVATION_CODES["swiglu"], "gelu_tanh": _ACTIVATION_CODES["gelu_tanh"]}


def launch_config(device: torch.device) -> GatedConfig:
    """The launch shape on `device`. CUDA: 2048 elements over 8 warps, 8 elements (16 bytes
    of bf16) per thread and tensor, the shape of a plain elementwise kernel. The interpreter:
    small blocks, so that test shapes span several programs and a partial last one."""
    if _override.value is not None:
        return _override.value
    if device.type == "cuda":
        return GatedConfig(block=2048, num_warps=8)
    return GatedConfig(block=64, num_warps=4)


def override_config(config: GatedConfig) -> ContextManager[None]:
    """Use another launch shape inside the block (benchmark variants, tests); not thread-safe."""
    return _override.using(config)


@triton.jit
def _gated_act(x, ACT: tl.constexpr):
    """ref.gated_forward's act(x) (float32)."""
    if ACT == _SWIGLU:
        s, _ = _sigmoid(x)
        a = x * s
    else:
        a = _act(x, ACT)
    return a


@triton.jit
def _gated_dg(d, x, up, ACT: tl.constexpr):
    """ref.gated_grads' dg = d * up * act'(x) (float32)."""
    if ACT == _SWIGLU:
        s, e = _sigmoid(x)
        dg = (d * up) * (s * tl.math.fma(x, _sigmoid_complement(x, s, e), 1.0))
    else:
        dg = _act_grad(d * up, x, ACT)
    return dg


@triton.jit
def _gated_du(d, x, ACT: tl.constexpr):
    """ref.gated_grads' du = d * act(x) (float32)."""
    if ACT == _SWIGLU:
        s, _ = _sigmoid(x)
        du = d * (x * s)
    else:
        du = d * _act(x, ACT)
    return du


@triton.jit
def _gated_fwd_kernel(g_ptr, u_ptr, out_ptr, n, ACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.cast(tl.program_id(0), tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (_gated_act(x, ACT) * up).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gated_bwd_kernel(da_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n, ACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.cast(tl.program_id(0), tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    d = tl.load(da_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dg = _gated_dg(d, x, up, ACT)
    du = _gated_du(d, x, ACT)
    tl.store(dg_ptr + offs, dg.to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + offs, du.to(du_ptr.dtype.element_ty), mask=mask)


@functools.lru_cache(maxsize=None)
def _kernel(backward: bool, act: str, cfg: GatedConfig) -> DirectKernel:
    return DirectKernel(_gated_bwd_kernel if backward else _gated_fwd_kernel, num_warps=cfg.num_warps,
                        ACT=_ACT_CODES[act], BLOCK=cfg.block)


def gated_fwd(g: torch.Tensor, u: torch.Tensor, act: str, out: torch.Tensor) -> None:
    """gated_reference.gated_fwd on the GPU (same contract; see there)."""
    ref.check_fwd_args("gated_fwd", g, u, act, out)
    _launch(False, act, g, u, out)


def gated_bwd(da: torch.Tensor, g: torch.Tensor, u: torch.Tensor, act: str, dg_out: torch.Tensor,
              du_out: torch.Tensor) -> None:
    """gated_reference.gated_bwd on the GPU (same contract; see there)."""
    ref.check_bwd_args("gated_bwd", da, g, u, act, dg_out, du_out)
    _launch(True, act, da, g, u, dg_out, du_out)


def _launch(backward: bool, act: str, *tensors: torch.Tensor) -> None:
    n = tensors[0].numel()
    if n == 0:
        return
    cfg = launch_config(tensors[0].device)
    with device_guard(tensors[0].device):
        _kernel(backward, act, cfg)(triton.cdiv(n, cfg.block), *tensors, n)


__all__ = ["GatedConfig", "launch_config", "override_config", "gated_fwd", "gated_bwd"]
