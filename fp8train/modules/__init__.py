from .layernorm_linear import LayerNormLinear
from .layernorm_mlp import LayerNormMLP
from .linear import Linear

__all__ = ["Linear", "LayerNormLinear", "LayerNormMLP"]
