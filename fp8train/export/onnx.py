"""fp8train.export_onnx: a model with fp8train layers -> an ONNX graph with FP8 Q/DQ pairs.

The export path is separate from training: it builds an inference twin of the model (every
fp8train layer replaced by its twin, twins.py; everything else copied), and exports that
with torch.onnx.export(dynamo=True), the two Q/DQ custom ops translated by qdq.py. The
model itself is never run, changed or moved, so no amax is recorded and no scale updates.
"""
from __future__ import annotations

import copy
import os
from typing import Any, Tuple, Union

import torch
from torch import nn

from ..modules.base import FP8Module
from .twins import make_twin

SUPPORTED_OPSETS = (19, 20, 21, 22, 23)  # float8 QuantizeLinear/DequantizeLinear exist from opset 19


def inference_twin(model: nn.Module) -> nn.Module:
    """A copy of `model` in eval mode with each fp8train layer replaced by its export twin.

    Only the modules that are not fp8train layers are deep-copied; the fp8train layers are
    read (parameters, scales) and not copied, so their quantizers are not duplicated.
    """
    memo = {id(m): make_twin(m) for m in model.modules() if isinstance(m, FP8Module)}
    if isinstance(model, FP8Module):
        return memo[id(model)]
    return copy.deepcopy(model, memo).eval()


def export_onnx(model: nn.Module, args: Union[torch.Tensor, Tuple[Any, ...]], path: Union[str, os.PathLike],
                opset: int = 21, dynamic_batch: bool = True):
    """Export `model` (containing fp8train Linear / LayerNormLinear / LayerNormMLP layers) for
    inference and write it to `path`; returns the onnx.ModelProto.

    args           example inputs, a tensor or a tuple of positional arguments; tensors
                   keep their dtype in the graph (bf16 inputs are cast to float32 inside it)
    opset          one of SUPPORTED_OPSETS
    dynamic_batch  dim 0 of every tensor input is a symbolic "batch" (export with batch >= 2:
                   torch.export specializes sizes 0 and 1)

    Every FP8 GEMM input becomes QuantizeLinear -> DequantizeLinear (FLOAT8E4M3FN zero point,
    saturate=1) with the layer's scale as an initializer (docs/onnx.md says which scale);
    raises RuntimeError naming a layer that has no FP8 scales yet.
    """
    if isinstance(opset, bool) or opset not in SUPPORTED_OPSETS:
        raise ValueError(f"export_onnx: opset {opset!r} is not supported; choose one of {SUPPORTED_OPSETS} "
                         "(FLOAT8E4M3FN QuantizeLinear/DequantizeLinear need opset 19 or later)")
    from .qdq import translation_table  # needs the optional `onnx` extra: pip install 'fp8train[onnx]'

    args = args if isinstance(args, tuple) else (args,)
    twin = inference_twin(model)
    dynamic_shapes = None
    if dynamic_batch:
        batch = torch.export.Dim("batch")
        dynamic_shapes = tuple({0: batch} if isinstance(a, torch.Tensor) and a.dim() > 0 else None for a in args)
    with torch.no_grad():
        program = torch.onnx.export(twin, args, dynamo=True, opset_version=opset, optimize=True,
                                    custom_translation_table=translation_table(opset),
                                    dynamic_shapes=dynamic_shapes, verbose=False)
    program.save(os.fspath(path))
    return program.model_proto
