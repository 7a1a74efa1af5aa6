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


def _exact_exp2(data: np.ndarray) -> np.ndarray:
    """exp2 of float32 values in float64, rounded to float32: correctly rounded but where the
    float64 value lies within its own few ulps of a float32 rounding boundary (~2^-28 of
    inputs), and the same for an element wherever it sits in a tensor."""
    return np.exp2(np.asarray(data, dtype=np.float64)).astype(np.float32)


@pytest.fixture
def same_exp2(monkeypatch, exact_conversions):
    """One exp2 for kernel and twin (_exact_exp2): the interpreter's tl.exp2 and the twin's
    torch.exp2 (float32 tensors), so that what is left between them is their formulas alone.
    (torch's own float32 exp2 is no fixed function of the element either: on the CPU its
    vectorized body and scalar tail may differ in the last bit.)"""
    from triton.runtime import interpreter as _interpreter
    original = torch.exp2

    def exp2(t, *args, **kwargs):
        if args or kwargs or t.dtype != torch.float32:
            return original(t, *args, **kwargs)
        return torch.from_numpy(_exact_exp2(t.detach().cpu().numpy())).reshape(t.shape)

    monkeypatch.setattr(torch, "exp2", exp2)
    monkeypatch.setattr(_interpreter.InterpreterBuilder, "create_exp2",
                        lambda self, arg: self.unary_op(arg, _exact_exp2))


@pytest.fixture
def unmasked():
    """block_kernel.BlockShapes.even on for the test: whole tiles launch the two-way cast's
    kernel without masks (the others still take the masked one)."""
    import dataclasses

    from fp8train.kernels import block_kernel
    shapes = dataclasses.replace(block_kernel.launch_shapes(), even=True)
    even = lambda shape: block_kernel._both_kernel(448.0, False, shapes, shape).constexprs["EVEN"]  # noqa: E731
    assert even((128, 256)) is True and even((200, 256)) is False
    with block_kernel.override_shapes(shapes):
        yield


@pytest.fixture(params=[False, True], ids=["packed", "packed-unmasked"])
def packed(request):
    """block_kernel.BlockShapes.packed_t on for the test (with even, or not): the two-way
    cast's transposed copy packed a word of four rows at a time (here with shifts: the
    interpreter runs no inline PTX)."""
    import dataclasses

    from fp8train.kernels import block_kernel
    shapes = dataclasses.replace(block_kernel.launch_shapes(), packed_t=True, even=request.param)
    pack = lambda **kw: block_kernel._both_kernel(448.0, False, shapes, (128, 256), **kw).constexprs["PACK"]  # noqa: E731
    assert pack() == 1 and pack(word_aligned=False) == 0
    with block_kernel.override_shapes(shapes):
        yield
