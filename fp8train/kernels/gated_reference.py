"""Pure-torch twin of the gated activation kernels (kernels/gated.py): the specification.

A gated MLP of the Hugging Face Llama form computes down(act(gate(x)) * up(x)): act is silu
(SwiGLU: Llama, Mistral, Qwen2 and their copies) or gelu_tanh (GeGLU: Gemma's
gelu_pytorch_tanh). Its two elementwise steps, with gate's and up's outputs in separate
tensors g and u of one shape:

  forward   a = act(g) * u                                       (g's dtype)
  backward  dg = da * u * act'(g)                                (g's dtype)
            du = da * act(g)                                     (u's dtype)
  silu       act'(g) = s (1 + g (1 - s)),  s = sigmoid(g)
  gelu_tanh  act(g) = g sigmoid(z), z = 2 k (g + c g^3) (activation_reference's form)

Each is computed in float32 from the inputs, op for op as activation_reference's "swiglu"
(silu) and "gelu_tanh" (the same sigmoid, complement and fma; its Note says why the math is
written this way), and rounded once to the output dtype (round to nearest even). torch's
own composition, F.silu(g) * u in bf16, rounds act(g) to bf16 before the product: the two
differ in the last bit of some elements (gelu_tanh: in a few more, as torch's tanh form
and this sigmoid form differ by float32 ulps before that rounding).

Special inputs follow activation_reference's IEEE rules for silu and gelu_tanh: g = +inf
gives a = +inf * u and dg NaN; g = -inf gives NaN; NaN propagates.
"""
from __future__ import annotations

import torch

from .activation_reference import _sigmoid, _sigmoid_complement, act_forward, act_grad, fma

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
GATED_ACTIVATIONS = ("silu", "gelu_tanh")


def gated_forward(g: torch.Tensor, u: torch.Tensor, act: str) -> torch.Tensor:
    """act(g) * u as float32."""
    x = g.float()
    if act == "silu":
        return (x * _sigmoid(x)[0]) * u.float()
    return act_forward(x, act) * u.float()


def gated_grads(da: torch.Tensor, g: torch.Tensor, u: torch.Tensor, act: str):
    """(dg, du) as float32."""
    d, x, up = da.float(), g.float(), u.float()
    if act == "silu":
        s, e = _sigmoid(x)
        dg = (d * up) * (s * fma(x, _sigmoid_complement(x, s, e), 1.0))
        du = d * (x * s)
        return dg, du
    return act_grad(d * up, x, act), d * act_forward(x, act)


def gated_fwd(g: torch.Tensor, u: torch.Tensor, act: str, out: torch.Tensor) -> None:
    """out <- act(g) * u, rounded once to out's dtype.

    g, u, out  tensors of one shape on one device, contiguous; g and out bf16/fp16/fp32 of
               one dtype, u of any of the three (F.silu(g) * u's type promotion is not
               followed: the output takes g's dtype).
    act        "silu" or "gelu_tanh" (GATED_ACTIVATIONS).
    """
    check_fwd_args("gated_fwd", g, u, act, out)
    out.copy_(gated_forward(g.detach(), u.detach(), act))


def gated_bwd(da: torch.Tensor, g: torch.Tensor, u: torch.Tensor, act: str, dg_out: torch.Tensor,
              du_out: torch.Tensor) -> None:
    """dg_out <- da * u * act'(g), du_out <- da * act(g), each rounded once to its dtype.

    da, g, u, dg_out, du_out: one shape, one device, contiguous, bf16/fp16/fp32; dg_out has
    g's dtype and du_out u's. act as gated_fwd's.
    """
    check_bwd_args("gated_bwd", da, g, u, act, dg_out, du_out)
    dg, du = gated_grads(da.detach(), g.detach(), u.detach(), act)
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


def _check_act(fn: str, act) -> None:
    if act not in GATED_ACTIVATIONS:
        raise ValueError(f"{fn}: act must be one of {GATED_ACTIVATIONS}, got {act!r}")


def check_fwd_args(fn: str, g, u, act, out) -> None:
    _check_act(fn, act)
    _check_same(fn, ("g", "u", "out"), (g, u, out))
    _check_dtype(fn, "out", out, "g", g)


def check_bwd_args(fn: str, da, g, u, act, dg_out, du_out) -> None:
    _check_act(fn, act)
    _check_same(fn, ("g", "u", "da", "dg_out", "du_out"), (g, u, da, dg_out, du_out))
    _check_dtype(fn, "dg_out", dg_out, "g", g)
    _check_dtype(fn, "du_out", du_out, "u", u)


def check_cast_args(fn: str, act, *tensors, whole_blocks: bool = False) -> None:
    """The gated block casts' inputs (kernels.gated_block_cast, gated_grad_block_cast): 2-D
    tensors of one shape, dtype (bf16, fp16, float32) and device, any row stride; with
    whole_blocks, columns a multiple of 128 (each of the gradients' tiles is one side's)."""
    _check_act(fn, act)
    first = tensors[0]
    if any(not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape != first.shape or t.dtype != first.dtype
           or t.device != first.device for t in tensors) or first.dtype not in _DTYPES:
        raise ValueError(f"{fn}: the inputs must be 2-D bf16, fp16 or float32 tensors of one shape, dtype and "
                         f"device, got {[(tuple(t.shape), t.dtype) for t in tensors]}")
    if whole_blocks and first.shape[1] % 128:
        raise ValueError(f"{fn}: the inputs' columns must be a multiple of 128, got {first.shape[1]}")


__all__ = ["GATED_ACTIVATIONS", "gated_forward", "gated_grads", "gated_fwd", "gated_bwd", "check_fwd_args",
           "check_bwd_args", "check_cast_args"]
