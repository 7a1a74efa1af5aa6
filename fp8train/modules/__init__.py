from .layernorm_linear import LayerNormLinear
from .layernorm_mlp import LayerNormMLP
from .linear import Linear
from .gated_mlp import GatedMLP
from .rms_norm import RMSNorm

__all__ = ["Linear", "LayerNormLinear", "LayerNormMLP", "RMSNorm", "GatedMLP"]
