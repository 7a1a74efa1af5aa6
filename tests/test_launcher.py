"""DirectKernel's check of its constexprs, on CPU (no launch): the kernel's trailing
tl.constexpr parameters must be given exactly, whether the kernel's module reads its
annotations as strings (`from __future__ import annotations`, as fp8train's kernels do) or
as the tl.constexpr class itself (as a kernel annotated with it does)."""
import pytest

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from fp8train.kernels.launcher import DirectKernel  # noqa: E402
from fp8train.kernels.transpose import _transpose_kernel  # noqa: E402  (string annotations)


@triton.jit
def _class_annotated(x_ptr, n, BLOCK: tl.constexpr, FLAG: tl.constexpr):
    tl.store(x_ptr + tl.arange(0, BLOCK), tl.zeros((BLOCK,), tl.float32) + FLAG, mask=tl.arange(0, BLOCK) < n)


def test_class_annotated_constexprs():
    assert DirectKernel(_class_annotated, num_warps=4, BLOCK=128, FLAG=1).tail == (128, 1)


def test_string_annotated_constexprs():
    k = DirectKernel(_transpose_kernel, num_warps=4, SKIP=False, BLOCK_M=64, BLOCK_N=32)
    assert k.tail == (False, 64, 32)


@pytest.mark.parametrize("constexprs", [dict(BLOCK=128), dict(BLOCK=128, FLAG=1, n=3), dict(BLOCK=1, FLAG=1, X=2)],
                         ids=["missing", "runtime-as-constexpr", "unknown"])
def test_wrong_constexprs_are_a_clear_error(constexprs):
    with pytest.raises(ValueError, match="trailing constexpr parameters"):
        DirectKernel(_class_annotated, num_warps=4, **constexprs)


def test_wrong_string_annotated_constexprs_are_a_clear_error():
    with pytest.raises(ValueError, match="trailing constexpr parameters"):
        DirectKernel(_transpose_kernel, num_warps=4, BLOCK_M=64, BLOCK_N=32)
