"""The high-precision paths of LayerNormMLP and LayerNormLinear as one C++ autograd node
(csrc/high_mlp.cpp).

Where a layer runs outside FP8 inside fp8train.autocast (auto precision chose high precision,
or dims FP8 cannot take), the step is small enough that the host bounds it. The node runs the
torch composition's ATen ops (LayerNorm, F.linear, and for the MLP the activation and
F.linear) with one call forward and one autograd node backward, and gives its bytes
(tests/test_high_node.py on the CPU, tests/gpu/test_high_node_gpu.py). Outside autocast the
layers stay the plain torch composition (double backward works there; the node refuses it).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..kernels import native

# The node's activation codes (csrc/high_mlp.cpp `Activation`).
ACTIVATION_CODES = {"gelu": 0, "gelu_tanh": 1, "relu": 2, "swiglu": 3}


def takes(layer, x: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the node gives this call of a LayerNormMLP or LayerNormLinear the composition's
    bytes, device aside: not where RMSNorm or tensor parallelism runs, nor a LayerNormLinear
    with output parts or its norm output returned, nor input of other than 2 or 3 dims
    (F.linear adds the bias after the GEMM there), nor a dtype the composition would cast,
    nor under torch.autocast (its casts would come between the ops) or a torch.compile trace."""
    if not (x.dtype == dtype and 2 <= x.dim() <= 3 and layer.normalization == "LayerNorm"
            and not torch._C._is_any_autocast_enabled() and not torch.compiler.is_compiling()):
        return False
    if getattr(layer, "fc1_tp", None) is not None or getattr(layer, "tp", None) is not None:
        return False
    if getattr(layer, "out_parts", None) is not None or getattr(layer, "return_layernorm_output", False):
        return False
    return all(p is None or p.dtype == dtype for p in _params(layer))


def forward(layer, x: torch.Tensor, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """y through the node, or None where the caller's composition must run: `takes` says no,
    x is not on a GPU (CPU layers never build the extension), or the node is off
    (native.ENABLED) or unbuilt."""
    if not (native.ENABLED and x.is_cuda and takes(layer, x, dtype)):
        return None
    ext = native.extension()
    if ext is None:
        return None
    if hasattr(layer, "fc2_weight"):
        return ext.high_mlp_forward(x, *_params(layer), layer.eps, ACTIVATION_CODES[layer.activation])
    return ext.high_ln_linear_forward(x, *_params(layer), layer.eps)


def _params(layer) -> tuple:
    if hasattr(layer, "fc2_weight"):  # LayerNormMLP
        return (layer.layer_norm_weight, layer.layer_norm_bias, layer.fc1_weight, layer.fc1_bias, layer.fc2_weight,
                layer.fc2_bias)
    return layer.layer_norm_weight, layer.layer_norm_bias, layer.weight, layer.bias


__all__ = ["ACTIVATION_CODES", "forward", "takes"]
