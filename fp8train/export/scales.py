"""Which scale each FP8 GEMM input of an exported layer gets, read from its quantizers.

  delayed scaling   the quantizer's stored `scale`, the one its casts use until the next
                    update (at the next fp8train.autocast entry); inputs and weights alike
  current scaling   weights: the exact scale of the weight as it is now, from its amax
                    (what the layer's next cast of it computes); activations: computed
                    in the graph from each input's own amax (dynamic quantization), as the
                    layer does in PyTorch

Nothing here writes to a quantizer: export leaves the scaling state untouched.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .. import scaling
from ..quantizer import CurrentScalingQuantizer, DelayedScalingQuantizer, Quantizer


class ExportScale(NamedTuple):
    """scale_inv () float32 for a fixed Q/DQ (ONNX y_scale), or None with `prev_scale` set
    for a scale computed in the graph (prev_scale is used where the amax is 0 or non-finite)."""

    scale_inv: Optional[torch.Tensor]
    prev_scale: Optional[torch.Tensor] = None


def no_scales_error(layer: str, what: str) -> RuntimeError:
    return RuntimeError(
        f"{layer}: no FP8 scale for its {what} yet: the layer has never run a forward under "
        "fp8train.autocast, so export_onnx has no scale to write. Run at least one forward "
        "(a training step, or a few calibration batches under torch.no_grad()) inside "
        "`with fp8train.autocast(recipe=fp8train.DelayedScaling()):` before exporting")


def _checked(q: Optional[Quantizer], layer: str, what: str) -> Quantizer:
    if q is None or (isinstance(q, DelayedScalingQuantizer) and not q.calibrated):
        raise no_scales_error(layer, what)
    if q.blockwise:
        raise NotImplementedError(f"{layer}: its {what} is block-scaled (fp8train.BlockScaling); ONNX export "
                                  "writes one scale per tensor: export a model trained with DelayedScaling or "
                                  "CurrentScaling")
    if q.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{layer}: its {what} is quantized to {q.dtype}; ONNX export handles "
                         "float8_e4m3fn forward GEMM inputs (Format.E4M3 and Format.HYBRID both use it)")
    return q


def input_scale(q: Optional[Quantizer], layer: str, what: str) -> ExportScale:
    """The scale of an activation (a GEMM's INPUT role)."""
    q = _checked(q, layer, what)
    if isinstance(q, CurrentScalingQuantizer):
        return ExportScale(None, q.scale.detach().float().clone())
    return ExportScale(_inverse(q.scale))


def weight_scale(q: Optional[Quantizer], weight: torch.Tensor, layer: str, what: str) -> ExportScale:
    """The fixed scale of a weight (a GEMM's WEIGHT role)."""
    q = _checked(q, layer, what)
    if isinstance(q, CurrentScalingQuantizer):
        amax = weight.detach().float().abs().amax()
        scale = scaling.compute_scale(amax, q.scale.detach().float(), float(q.fp8_max), power_of_two=q.power_of_two)
        return ExportScale(_inverse(scale))
    return ExportScale(_inverse(q.scale))


def _inverse(scale: torch.Tensor) -> torch.Tensor:
    # The same reciprocal the cast kernels write as scale_inv.
    return scaling.scale_inverse(scale.detach().float()).reshape(()).clone()


__all__ = ["ExportScale", "input_scale", "weight_scale", "no_scales_error"]
