"""Export of fp8train models for inference (ONNX: onnx.py)."""
from .onnx import SUPPORTED_OPSETS, export_onnx, inference_twin
from .runtime import run_onnxruntime

__all__ = ["export_onnx", "inference_twin", "run_onnxruntime", "SUPPORTED_OPSETS"]
