"""Inference twins: export-only copies of fp8train layers, written in plain torch ops plus
the two Q/DQ custom ops, so that torch.onnx.export sees the FP8 inference forward as it is.

Each twin computes what its layer computes in PyTorch under fp8train.autocast, no_grad:

    x ─Cast float32─> [norm] ─Q/DQ(x)─> MatMul(., Q/DQ(W^T)) ─+ bias─> Cast act dtype

with float32 arithmetic where the layer's kernels use float32 (norms, activations, the GEMM
accumulator) and a rounding to the activation dtype where the layer stores a tensor in it
(the GEMM outputs). The activation dtype is the input's (no torch.autocast during export).
Twins hold copies of the parameters and scales as buffers (float32: exact for bf16 and fp32
parameters) and never reference the layer they came from. A layer that runs in high
precision anyway is exported as a copy of itself (without its quantizers) running that path.
"""
from __future__ import annotations

import copy
from typing import Optional

import torch
from torch import nn

from ..gemm import _BIAS_OUT_DTYPES
from ..modules import LayerNormLinear, LayerNormMLP, Linear
from ..modules.base import FP8Module
from ..modules.layernorm_linear import layernorm_linear_outputs
from ..modules.layernorm_mlp import activation_high_precision
from ..modules.linear import _high_precision as linear_high_precision
from ..modules.norm import norm_high_precision
from .qdq import qdq, qdq_dynamic
from .scales import ExportScale, input_scale, weight_scale


class _QDQ(nn.Module):
    """One FP8 GEMM input's QuantizeLinear -> DequantizeLinear (fixed or dynamic scale)."""

    def __init__(self, scale: ExportScale):
        super().__init__()
        self.dynamic = scale.scale_inv is None
        self.register_buffer("scale_inv" if not self.dynamic else "prev_scale",
                             scale.prev_scale if self.dynamic else scale.scale_inv)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # float32 in, float32 out
        return qdq_dynamic(x, self.prev_scale) if self.dynamic else qdq(x, self.scale_inv)


class _Gemm(nn.Module):
    """Q/DQ(x) @ Q/DQ(W^T) + bias in float32; W^T (K, N) is stored transposed so the graph
    has a plain MatMul and no Transpose node."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], x_scale: ExportScale,
                 w_scale: ExportScale):
        super().__init__()
        self.register_buffer("weight_t", weight.detach().float().t().contiguous())  # (K, N)
        self.register_buffer("bias", bias.detach().float().clone() if bias is not None else None)
        self.input_qdq, self.weight_qdq = _QDQ(x_scale), _QDQ(w_scale)

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """(..., K) float32 -> (..., N) out_dtype."""
        y = torch.matmul(self.input_qdq(x), self.weight_qdq(self.weight_t))  # float32 accumulation
        if self.bias is not None:
            # The FP8 GEMM adds the bias in its epilogue after rounding it to the output dtype.
            y = y + (self.bias.to(out_dtype).float() if out_dtype in _BIAS_OUT_DTYPES else self.bias)
        return y.to(out_dtype)


class _Norm(nn.Module):
    def __init__(self, layer: FP8Module):
        super().__init__()
        self.normalization, self.eps = layer.normalization, layer.eps
        self.register_buffer("weight", layer.layer_norm_weight.detach().float().clone())
        bias = layer.layer_norm_bias
        self.register_buffer("bias", bias.detach().float().clone() if bias is not None else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # float32
        return norm_high_precision(x, self.weight, self.bias, self.normalization, self.eps)


def _gemm_of(layer: FP8Module, prefix: str, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> _Gemm:
    name = layer.describe()
    what = f"{prefix}input" if prefix else "input"
    x_scale = input_scale(getattr(layer, prefix + "input_quantizer"), name, what)
    w_scale = weight_scale(getattr(layer, prefix + "weight_quantizer"), weight, name, f"{prefix}weight")
    return _Gemm(weight, bias, x_scale, w_scale)


class LinearTwin(nn.Module):
    def __init__(self, layer: Linear):
        super().__init__()
        self.gemm = _gemm_of(layer, "", layer.weight, layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemm(x.float(), x.dtype)


class LayerNormLinearTwin(nn.Module):
    def __init__(self, layer: LayerNormLinear):
        super().__init__()
        self.norm = _Norm(layer)
        self.gemm = _gemm_of(layer, "", layer.weight, layer.bias)
        self.return_layernorm_output = layer.return_layernorm_output
        self.parts = layer.local_out_parts  # out_features=(q, k, v): one GEMM, split after

    def forward(self, x: torch.Tensor):
        ln = self.norm(x.float())  # the layer casts the float32 norm output straight to FP8
        y = self.gemm(ln, x.dtype)
        y = y if self.parts is None else y.split(self.parts, -1)
        return layernorm_linear_outputs(y, ln.to(x.dtype), self.return_layernorm_output)


class LayerNormMLPTwin(nn.Module):
    def __init__(self, layer: LayerNormMLP):
        super().__init__()
        self.norm = _Norm(layer)
        self.activation = layer.activation
        self.fc1 = _gemm_of(layer, "fc1_", layer.fc1_weight, layer.fc1_bias)
        self.fc2 = _gemm_of(layer, "fc2_", layer.fc2_weight, layer.fc2_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(self.norm(x.float()), x.dtype)  # fc1's output is stored in the activation dtype
        a = _activation(h.float(), self.activation)  # float32, cast straight to FP8
        return self.fc2(a, x.dtype)


def _activation(h: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "relu":
        # Max(h, 0), not Relu: ONNX Runtime (1.32, CPU, optimization level EXTENDED and up)
        # deletes a Relu feeding QuantizeLinear, which is right for integer zero points only;
        # with a float8 zero point the negatives then pass through.
        return torch.maximum(h, torch.zeros((), dtype=h.dtype, device=h.device))
    return activation_high_precision(h, activation)


class HighPrecisionTwin(nn.Module):
    """A layer whose dims are not multiples of 16: it runs in the activation dtype, no FP8."""

    def __init__(self, layer: FP8Module):
        super().__init__()
        # A copy: eval() and tracing must not reach the user's layer. Its quantizers (if a
        # checkpoint created any) are left out, so no live delayed quantizer is duplicated.
        self.layer = copy.deepcopy(layer, {id(q): None for q in layer.children()})

    def forward(self, x: torch.Tensor):
        layer = self.layer
        if isinstance(layer, Linear):
            return linear_high_precision(x, layer.weight, layer.bias, x.dtype)
        return layer._high_precision(x, x.dtype)


_TWINS = {Linear: LinearTwin, LayerNormLinear: LayerNormLinearTwin, LayerNormMLP: LayerNormMLPTwin}


def make_twin(layer: FP8Module) -> nn.Module:
    """The inference twin of one fp8train layer (raises naming the layer if it has no scales)."""
    kind = type(layer)
    if kind not in _TWINS:
        raise NotImplementedError(f"{layer.describe()}: ONNX export supports {sorted(k.__name__ for k in _TWINS)}, "
                                  f"not {kind.__name__}")
    twin = _TWINS[kind](layer) if layer._fp8_dims else HighPrecisionTwin(layer)
    return twin.eval()
