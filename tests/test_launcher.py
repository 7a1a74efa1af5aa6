"""DirectKernel's check of its constexprs and options, on CPU (no launch): the kernel's trailing
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


def test_a_register_cap_is_a_launch_option_and_no_traced_launch():
    # maxnreg goes to Triton with num_warps (eager launches); a traced launch (wrap_triton)
    # cannot pass it to Inductor, so it says so rather than dropping the cap
    k = DirectKernel(_class_annotated, num_warps=8, maxnreg=128, BLOCK=128, FLAG=1)
    assert k._options["maxnreg"] == 128 and k.tail == (128, 1)
    assert "maxnreg" not in DirectKernel(_class_annotated, num_warps=8, BLOCK=128, FLAG=1)._options
    with pytest.raises(NotImplementedError, match="register cap"):
        k.traced(1, None, 1)


def _kernel_modules():
    import importlib
    import pkgutil

    import fp8train.kernels as package
    for info in pkgutil.iter_modules(package.__path__):
        yield importlib.import_module(f"fp8train.kernels.{info.name}")


def _jit_kernels():
    seen = {}
    for module in _kernel_modules():
        for name, value in vars(module).items():
            if isinstance(value, triton.JITFunction) and value.fn.__module__ == module.__name__:
                seen[f"{module.__name__.rsplit('.', 1)[1]}.{name}"] = value
    return seen


def test_there_are_kernels_to_check():
    names = set(_jit_kernels())
    assert {"block_kernel._block_cast_kernel", "block_kernel._block_cast_both_kernel",
            "scale_update._scale_update_kernel"} <= names


@pytest.mark.parametrize("name", sorted(_jit_kernels()))
def test_inductor_can_reload_the_kernel_source(name, tmp_path):
    """A kernel launched from a torch.library.triton_op (DirectKernel.traced) reaches Inductor,
    which writes the kernel, the jit functions it calls and the constexpr globals they read
    into a new Python file (a constexpr as tl.constexpr(repr(value))) and imports it in a
    worker. That file must import: a global tl.constexpr(float("inf")) was written as
    `tl.constexpr(inf)`, a NameError that failed the compile (H200, torch 2.11, 2026-12-02)."""
    import importlib.util

    wrapper = pytest.importorskip("torch._inductor.codegen.wrapper")
    kernel = _jit_kernels()[name]
    path = tmp_path / "inductor_copy.py"
    path.write_text("import triton\nimport triton.language as tl\n@triton.jit\n"  # Inductor's own lines
                    + wrapper.user_defined_triton_kernel_transitive_closure_source_code(kernel))
    spec = importlib.util.spec_from_file_location(f"inductor_copy_{abs(hash(name))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    copied = getattr(module, kernel.fn.__name__)
    assert isinstance(copied, triton.JITFunction)
    assert copied.src == kernel.src
