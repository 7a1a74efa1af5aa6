"""The activation between fc1 and fc2 of LayerNormMLP: its torch definition (outside
autocast) and its fused FP8 forward and backward (inside), each writing the next GEMM's FP8
operand with the transposed copy wgrad needs."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .. import kernels, ops
from ..kernels import replay
from ..kernels.activation_reference import out_features
from ..quantizer import Cast, Quantizer

ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "swiglu")


def activation_high_precision(h: torch.Tensor, activation: str) -> torch.Tensor:
    """The torch definition of each activation (swiglu: h = [gate, up] -> silu(gate) * up)."""
    if activation == "gelu":
        return F.gelu(h)
    if activation == "gelu_tanh":
        return F.gelu(h, approximate="tanh")
    if activation == "relu":
        return F.relu(h)
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def activation_fp8(h: torch.Tensor, activation: str, q: Quantizer, transpose: bool,
                   found: Optional[list] = None) -> Cast:
    """act(h) (M, F) straight into FP8 with q's scaling (+ its transposed copy (F, Mp)).
    found: a list that gets the launch group that ran or was built (kernels/replay.py), or None."""
    if torch.compiler.is_compiling():  # traced code: the same kernels as a custom op (fp8train/ops.py)
        return Cast(*ops.act_fwd_fp8(h, activation, q.dtype, q.scaling_state(), transpose))
    aq = q.allocate((h.shape[0], out_features(h, activation)), h.device, transpose=transpose)
    key = ("act_fwd", h.shape, h.stride(), h.dtype, activation, transpose, h.device.index)
    group = replay.run(q._prepared, key, (h, aq.data, aq.data_t, aq.scale_inv), q.replay_fixed(), lambda: q.produce(
        lambda amax_out: kernels.act_amax(h, activation, amax_out),
        lambda scale, amax_out, from_amax, count, pow2: kernels.act_fwd_fp8(
            h, activation, aq.data, aq.data_t, scale, aq.scale_inv, amax_out, from_amax, count, pow2)))
    if found is not None:
        found.append(group)
    return aq


def activation_backward_fp8(da: torch.Tensor, h: torch.Tensor, activation: str, q: Quantizer,
                            dbias_dtype: Optional[torch.dtype], found: Optional[list] = None) -> Cast:
    """dh = da * act'(h) (M, F1) straight into FP8 with q's scaling, with its transposed copy
    (F1, Mp) and, when dbias_dtype is given, fc1's bias gradient (F1,) in that dtype."""
    if torch.compiler.is_compiling():  # traced code: the same kernels as a custom op (fp8train/ops.py)
        parts, db = ops.act_bwd_fp8(da, h, activation, q.dtype, q.scaling_state(), True, dbias_dtype)
        return Cast(*parts, db)
    dhq = q.allocate(h.shape, h.device, transpose=True)  # (M, F1), (F1, Mp)
    db = torch.empty(h.shape[1], dtype=dbias_dtype, device=h.device) if dbias_dtype is not None else None
    key = ("act_bwd", da.shape, da.stride(), da.dtype, h.shape, h.stride(), h.dtype, activation, dbias_dtype,
           h.device.index)
    group = replay.run(q._prepared, key, (da, h, dhq.data, dhq.data_t, dhq.scale_inv, db), q.replay_fixed(),
                       lambda: q.produce(
                           lambda amax_out: kernels.act_bwd_amax(da, h, activation, amax_out),
                           lambda scale, amax_out, from_amax, count, pow2: kernels.act_bwd_fp8(
                               da, h, activation, dhq.data, dhq.data_t, scale, dhq.scale_inv, amax_out, from_amax,
                               count, db, pow2)))
    if found is not None:
        found.append(group)
    return Cast(dhq.data, dhq.data_t, dhq.scale_inv, db)


__all__ = ["ACTIVATIONS", "activation_high_precision", "activation_fp8", "activation_backward_fp8"]
