"""Shared by the interpreter tests (run with TRITON_INTERPRET=1)."""
import numpy as np
import pytest
import torch


@pytest.fixture
def exact_conversions(monkeypatch):
    """Exact conversions in the interpreter: fp32 -> fp8 by ml_dtypes (RNE), bf16 <-> fp32 as on the GPU."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    tl = pytest.importorskip("triton.language")
    from triton.runtime import interpreter as _interpreter
    targets = {tl.float8e4nv: ml_dtypes.float8_e4m3fn, tl.float8e5: ml_dtypes.float8_e5m2}
    original = _interpreter._convert_float

    def convert(data, src, dst, rounding_mode):
        if src == tl.float32 and dst in targets and rounding_mode == _interpreter._ir.ROUNDING_MODE.RTNE:
            return np.asarray(data, dtype=np.float32).astype(targets[dst]).view(np.uint8)
        if src == tl.bfloat16 and dst == tl.float32:  # exact widening; the interpreter flushes subnormals
            return np.asarray(data).view(np.uint16).astype(np.uint32) << np.uint32(16)
        if src == tl.float32 and dst == tl.bfloat16:  # fptrunc rounds to nearest even; the interpreter truncates
            f32 = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))
            return f32.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        return original(data, src, dst, rounding_mode)

    monkeypatch.setattr(_interpreter, "_convert_float", convert)
