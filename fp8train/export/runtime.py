"""Run an exported model in ONNX Runtime with torch tensors in and out, bfloat16 included
(ONNX Runtime's Python API has no numpy type for bfloat16: such tensors travel as raw bytes)."""
from __future__ import annotations

import ctypes
import os
from typing import TYPE_CHECKING, List, Union

import torch

if TYPE_CHECKING:  # an optional extra: imported where used
    import onnxruntime


def _to_ort(t: torch.Tensor):
    import onnx
    import onnxruntime as ort

    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(t.view(torch.int16).numpy(), onnx.TensorProto.BFLOAT16)
    return ort.OrtValue.ortvalue_from_numpy(t.numpy())


def _to_torch(v) -> torch.Tensor:
    if v.data_type() != "tensor(bfloat16)":
        return torch.from_numpy(v.numpy())
    out = torch.empty(v.shape(), dtype=torch.bfloat16)
    ctypes.memmove(out.data_ptr(), v.data_ptr(), v.tensor_size_in_bytes())
    return out


def run_onnxruntime(model: Union[str, os.PathLike, "onnxruntime.InferenceSession"], *inputs: torch.Tensor
                    ) -> List[torch.Tensor]:
    """Outputs of the ONNX model (a path or an InferenceSession) for `inputs`, given in the
    order of the graph's inputs, on the CPU execution provider."""
    import onnxruntime as ort

    session = model if isinstance(model, ort.InferenceSession) else ort.InferenceSession(
        os.fspath(model), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    if len(names) != len(inputs):
        raise ValueError(f"run_onnxruntime: the graph takes {len(names)} inputs {names}, got {len(inputs)}")
    feeds = {name: _to_ort(t) for name, t in zip(names, inputs)}
    return [_to_torch(v) for v in session.run_with_ort_values(None, feeds)]


__all__ = ["run_onnxruntime"]
