"""fp8train: FP8 mixed-precision training for PyTorch on Hopper GPUs."""
from . import precision
from .autocast import autocast
from .convert import convert
from .export import export_onnx
from .graphs import make_graphed_callables
from .modules import GatedMLP, LayerNormLinear, LayerNormMLP, Linear, RMSNorm
from . import inspect  # fp8train.inspect: Inspector, execution_paths
from .quantize import quantize
from .block_quantizer import BlockScalingQuantizer
from .quantizer import CurrentScalingQuantizer, DelayedScalingQuantizer, update_delayed_scales
from .recipe import BlockScaling, CurrentScaling, DelayedScaling, Format, GemmConfig
from .roles import GemmRole, TensorRole
from .tensor import Float8Tensor

__version__ = "0.1.0"

__all__ = [
    "autocast", "convert", "export_onnx", "Linear", "LayerNormLinear", "LayerNormMLP", "RMSNorm", "GatedMLP", "quantize", "Float8Tensor", "Format", "GemmConfig", "DelayedScaling",
    "CurrentScaling", "BlockScaling", "TensorRole", "GemmRole", "DelayedScalingQuantizer", "CurrentScalingQuantizer",
    "BlockScalingQuantizer",
    "update_delayed_scales", "precision", "make_graphed_callables",
]
