"""The two export-only ops an FP8 GEMM input becomes in ONNX, and their translations.

    qdq(x, scale_inv)          QuantizeLinear -> DequantizeLinear with a fixed scale (an
                               initializer): delayed scaling, weights under current scaling
    qdq_dynamic(x, prev_scale) the same pair with a scale computed in the graph from the
                               tensor's own amax (activations under current scaling)

Both are torch custom ops (`fp8train_export::...`) so torch.onnx.export(dynamo=True) keeps
them as single nodes and hands them to the onnxscript functions below; their torch bodies
compute what ONNX Runtime computes (used only when the export twin is run in PyTorch).

Note: scale conventions. fp8train's `scale` multiplies on the way into FP8,
q = fp8(sat(x * scale)); ONNX QuantizeLinear's `y_scale` divides, q = fp8(sat(x / y_scale)),
and DequantizeLinear multiplies by it. So y_scale = scale_inv = 1 / scale, the value every
fp8train Float8Tensor carries. x / scale_inv and x * scale can differ in the last float32
bit, which moves an FP8 rounding only when x * scale lies within that bit of a tie.
Saturation: `saturate=1`, out-of-range values clamp to +-448 as fp8train's casts do.
"""
from __future__ import annotations

import functools

import torch

from .. import scaling

E4M3_MAX = scaling.fp8_max(torch.float8_e4m3fn)


@torch.library.custom_op("fp8train_export::qdq", mutates_args=())
def qdq(x: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """x (float32) through e4m3 with y_scale = scale_inv () float32; returns float32."""
    return _fake_quant(x, scale_inv)


@torch.library.custom_op("fp8train_export::qdq_dynamic", mutates_args=())
def qdq_dynamic(x: torch.Tensor, prev_scale: torch.Tensor) -> torch.Tensor:
    """x (float32) through e4m3 with the scale of current scaling: compute_scale(amax(x))."""
    amax = x.abs().amax()  # NaN propagates, and compute_scale then keeps prev_scale
    scale = scaling.compute_scale(amax, prev_scale, E4M3_MAX)
    return _fake_quant(x, scaling.scale_inverse(scale))


@qdq.register_fake
def _(x, scale_inv):
    return torch.empty_like(x)


@qdq_dynamic.register_fake
def _(x, prev_scale):
    return torch.empty_like(x)


def _fake_quant(x: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    q = (x / scale_inv).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.to(x.dtype) * scale_inv


@functools.lru_cache(maxsize=None)
def translation_table(opset: int) -> dict:
    """{custom op: onnxscript function} for torch.onnx.export, written in `opset` (the
    exporter does not convert a custom translation's nodes down to the model's opset)."""
    import onnx  # the optional `onnx` extra: imported only when exporting
    import onnxscript

    op = onnxscript.values.Opset("", opset)
    zero = onnx.helper.make_tensor("zero_point", onnx.TensorProto.FLOAT8E4M3FN, [], [0.0])

    def pair(x, y_scale):
        zp = op.Constant(value=zero)
        return op.DequantizeLinear(op.QuantizeLinear(x, y_scale, zp, saturate=1), y_scale, zp)

    def qdq_onnx(x, scale_inv):
        return pair(x, scale_inv)

    def qdq_dynamic_onnx(x, prev_scale):
        # scaling.compute_scale in ONNX ops: fp8_max / amax clamped to [2^-126, 2^126],
        # the previous scale where the amax is 0, inf or NaN (NaN fails both comparisons).
        amax = op.ReduceMax(op.Abs(x), keepdims=0)
        scale = op.Clip(op.Div(op.Constant(value_float=E4M3_MAX), amax),
                        op.Constant(value_float=scaling.SCALE_MIN), op.Constant(value_float=scaling.SCALE_MAX))
        usable = op.And(op.Greater(amax, op.Constant(value_float=0.0)),
                        op.Less(amax, op.Constant(value_float=float("inf"))))
        return pair(x, op.Reciprocal(op.Where(usable, scale, prev_scale)))

    return {torch.ops.fp8train_export.qdq.default: qdq_onnx,
            torch.ops.fp8train_export.qdq_dynamic.default: qdq_dynamic_onnx}


__all__ = ["qdq", "qdq_dynamic", "translation_table", "E4M3_MAX"]
