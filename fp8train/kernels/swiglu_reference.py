"""Pure-torch twin of the SwiGLU kernels (kernels/swiglu.py): the specification.

A gated MLP of the Hugging Face Llama form computes down(silu(gate(x)) * up(x)). Its two
elementwise steps, with gate's and up's outputs in separate tensors g and u of one shape:

  forward   a = silu(g) * u                                      (g's dtype)
  backward  dg = da * u * s (1 + g (1 - s)),  s = sigmoid(g)     (g's dtype)
            du = da * silu(g)                                    (u's dtype)

Each is computed in float32 from the inputs, op for op as activation_reference's "swiglu"
(the same sigmoid, complement and fma; its Note says why the math is written this way), and
rounded once to the output dtype (round to nearest even). torch's own composition,
F.silu(g) * u in bf16, rounds silu(g) to bf16 before the product: the two differ in the
last bit of some elements.

Special inputs follow activation_reference's IEEE rules for silu: g = +inf gives a = +inf *
u and dg NaN; g = -inf gives NaN; NaN propagates.
"""
from __future__ import annotations

import torch

from .activation_reference import _sigmoid, _sigmoid_complement, fma

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def swiglu_forward(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """silu(g) * u as float32."""
    x = g.float()
    return (x * _sigmoid(x)[0]) * u.float()


def swiglu_grads(da: torch.Tensor, g: torch.Tensor, u: torch.Tensor):
    """(dg, du) as float32."""
    d, x, up = da.float(), g.float(), u.float()
    s, e = _sigmoid(x)
    dg = (d * up) * (s * fma(x, _sigmoid_complement(x, s, e), 1.0))
    du = d * (x * s)
    return dg, du


def swiglu_fwd(g: torch.Tensor, u: torch.Tensor, out: torch.Tensor) -> None:
    """out <- silu(g) * u, rounded once to out's dtype.

    g, u, out  tensors of one shape on one device, contiguous; g and out bf16/fp16/fp32 of
               one dtype, u of any of the three (F.silu(g) * u's type promotion is not
               followed: the output takes g's dtype).
    """
    check_fwd_args("swiglu_fwd", g, u, out)
    out.copy_(swiglu_forward(g.detach(), u.detach()))


def swiglu_bwd(da: torch.Tensor, g: torch.Tensor, u: torch.Tensor, dg_out: torch.Tensor,
               du_out: torch.Tensor) -> None:
    """dg_out <- da * u * silu'(g), du_out <- da * silu(g), each rounded once to its dtype.

    da, g, u, dg_out, du_out: one shape, one device, contiguous, bf16/fp16/fp32; dg_out has
    g's dtype and du_out u's.
    """
    check_bwd_args("swiglu_bwd", da, g, u, dg_out, du_out)
    dg, du = swiglu_grads(da.detach(), g.detach(), u.detach())
    dg_out.copy_(dg)
    du_out.copy_(du)


# --------------------------------------------------------------------------- argument checks


def _check_same(fn: str, names, tensors) -> None:
    first = tensors[0]
    for name, t in zip(names, tensors):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{fn}: {name} must be a tensor, got {type(t).__name__}")
        if t.dtype not in _DTYPES:
            raise ValueError(f"{fn}: {name} must be bfloat16, float16 or float32; got {t.dtype}")
        if t.shape != first.shape or t.device != first.device:
            raise ValueError(f"{fn}: {names[0]} and {name} must have one shape and device; got "
                             f"{tuple(first.shape)} on {first.device} and {tuple(t.shape)} on {t.device}")
        if not t.is_contiguous():
            raise ValueError(f"{fn}: {name} must be contiguous (pass {name}.contiguous())")


def _check_dtype(fn: str, out_name: str, out: torch.Tensor, src_name: str, src: torch.Tensor) -> None:
    if out.dtype != src.dtype:
        raise ValueError(f"{fn}: {out_name} must have {src_name}'s dtype {src.dtype}; got {out.dtype}")


def check_fwd_args(fn: str, g, u, out) -> None:
    _check_same(fn, ("g", "u", "out"), (g, u, out))
    _check_dtype(fn, "out", out, "g", g)


def check_bwd_args(fn: str, da, g, u, dg_out, du_out) -> None:
    _check_same(fn, ("g", "u", "da", "dg_out", "du_out"), (g, u, da, dg_out, du_out))
    _check_dtype(fn, "dg_out", dg_out, "g", g)
    _check_dtype(fn, "du_out", du_out, "u", u)


__all__ = ["swiglu_forward", "swiglu_grads", "swiglu_fwd", "swiglu_bwd", "check_fwd_args", "check_bwd_args"]
