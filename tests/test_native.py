"""The C++ Linear node's CPU side: the launch ABI read from a compiled Triton kernel, the
packing of scalar parameters, the extension's build against this torch and its argument
checks, and the rule that CPU layers never take the node (its launches are CUDA only).
Its numerics are GPU tests (tests/gpu/test_native_gpu.py)."""
from __future__ import annotations

import struct
from types import SimpleNamespace

import pytest
import torch

import fp8train
from fp8train.kernels import native

triton = pytest.importorskip("triton")
from fp8train.kernels.launcher import kernel_params, pack_param  # noqa: E402


def fake_binary(signature: dict, **meta):
    """What kernel_params reads of a triton 3.6 CompiledKernel: src.signature (every
    parameter by name, 'constexpr' for those Triton folded) and the metadata fields."""
    fields = dict(num_ctas=1, num_warps=4, shared=0, launch_pdl=False, launch_cooperative_grid=False,
                  global_scratch_size=0, profile_scratch_size=0)
    fields.update(meta)
    return SimpleNamespace(src=SimpleNamespace(signature=signature), metadata=SimpleNamespace(**fields))


SIG = {"x_ptr": "*bf16", "out_ptr": "*fp8e4nv", "m": "i32", "one": "constexpr", "big": "i64", "f": "fp32",
       "BLOCK": "constexpr"}


def test_kernel_params_drop_constants_and_append_the_scratch_pointers():
    x, out = object(), object()
    args = (x, out, 77, 1, 2**40, 0.5)  # `one` was specialised to a constant; BLOCK is the declared constexpr
    params = kernel_params(fake_binary(SIG), args)
    assert params == [("*bf16", x), ("*fp8e4nv", out), ("i32", 77), ("i64", 2**40), ("fp32", 0.5),
                      ("*scratch", None), ("*scratch", None)]


def test_kernel_params_without_scratch_fields():
    """Binaries whose metadata has no scratch fields (older Triton) take no scratch pointers."""
    binary = fake_binary(SIG)
    del binary.metadata.global_scratch_size, binary.metadata.profile_scratch_size
    assert [t for t, _ in kernel_params(binary, (0, 0, 3, 1, 5, 1.0))] == ["*bf16", "*fp8e4nv", "i32", "i64", "fp32"]


@pytest.mark.parametrize("meta, signature", [
    (dict(num_ctas=2), SIG), (dict(launch_pdl=True), SIG),
    (dict(global_scratch_size=128), SIG), (dict(profile_scratch_size=64), SIG),
    ({}, dict(SIG, f="fp16")),                                  # a scalar type the C++ side does not pack
    ({}, {"x_ptr": "*bf16", "BLOCK": "constexpr"}),             # fewer parameters than arguments
    ({}, dict(SIG, BLOCK="i32")),                               # a trailing parameter that is not a constexpr
], ids=["cluster", "pdl", "global-scratch", "profile-scratch", "fp16-scalar", "short", "tail"])
def test_kernel_params_refuse_what_cuLaunchKernel_cannot_do(meta, signature):
    assert kernel_params(fake_binary(signature, **meta), (0, 0, 3, 1, 5, 1.0)) is None


@pytest.mark.parametrize("cooperative", [False, True])
def test_launch_spec_says_whether_the_launch_is_cooperative(cooperative):
    """A binary compiled for a cooperative launch (a grid-wide barrier: the cast kernels'
    OWN_AMAX) keeps its parameters; its spec asks the C++ launcher for a cooperative launch."""
    binary = fake_binary(SIG, launch_cooperative_grid=cooperative)
    binary.function = 1234
    x, out = torch.empty(4), torch.empty(4)
    (function, grid, block, shared, values, holes, coop), fixed = native.launch_spec(binary, 3, (x, out, 7, 1, 9, 0.5),
                                                                                     holes=(x,))
    assert (function, grid, block, coop) == (1234, 3, 128, cooperative)
    assert holes == [0, -1, -1, -1, -1, -1, -1] and values[1] == out.data_ptr() and fixed == [out]


@pytest.mark.parametrize("ty, value, raw", [
    ("i32", -3, struct.pack("<i", -3)), ("i32", 2**31 - 1, struct.pack("<i", 2**31 - 1)),
    ("i64", -(2**40), struct.pack("<q", -(2**40))), ("u64", 2**64 - 1, struct.pack("<Q", 2**64 - 1)),
    ("fp32", 0.1, struct.pack("<f", 0.1)), ("fp32", float("inf"), struct.pack("<f", float("inf"))),
    ("u1", True, b"\x01"), ("i1", 0, b"\x00"),
])
def test_pack_param_puts_the_bytes_in_the_low_end_of_the_slot(ty, value, raw):
    slot = pack_param(ty, value)
    assert 0 <= slot < 2**64
    assert slot.to_bytes(8, "little") == raw.ljust(8, b"\0")


@pytest.fixture(scope="module")
def ext():
    e = native.extension()
    assert e is not None, f"the C++ extension did not build: {native.failure()}"
    return e


def test_extension_builds_and_checks_its_launches(ext):
    ext.Launch(0, 1, 128, 0, [1, 2, 3], [0, -1, 3])
    with pytest.raises(RuntimeError, match="bad hole -2"):
        ext.Launch(0, 1, 128, 0, [1, 2], [0, -2])
    # a hole past the five of a cast: fine for a launch group's table (tests/test_replay.py),
    # refused where the launch runs as a cast
    wide = ext.Launch(0, 1, 128, 0, [1, 2], [0, 5])
    with pytest.raises(RuntimeError, match="cast launch with hole 5"):
        ext.launch(wide, 0, None, None, None, None)
    with pytest.raises(RuntimeError, match="one hole entry each"):
        ext.Launch(0, 1, 128, 0, [1, 2], [0])
    with pytest.raises(RuntimeError, match="at most 32"):
        ext.Launch(0, 1, 128, 0, [0] * 33, [-1] * 33)


def test_cpu_layers_never_take_the_native_node():
    layer = fp8train.Linear(32, 16)
    x = torch.randn(8, 32, requires_grad=True)
    for _ in range(3):
        with fp8train.autocast():
            y = layer(x)
        assert y.grad_fn.name() == "_LinearFnBackward"
        y.sum().backward()


# ------------------------------------------------------------------ the extension's FP8 GEMM
# On a CPU-only machine lt_gemm.cpp finds no libcublasLt (or gets CPU tensors) and every call
# is at::_scaled_mm's: these check that fallback's contract (bias fused or added, `out`
# written in place, counters); the cuBLASLt path's bytes are tests/gpu/test_lt_gemm_gpu.py's.

def _fp8_operands(m, k, n, seed):
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(m, k, generator=g) * 3).to(torch.float8_e4m3fn)
    b = (torch.randn(n, k, generator=g) * 3).to(torch.float8_e4m3fn).t()
    return a, torch.tensor(0.75), b, torch.tensor(1.25)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_extension_gemm_on_cpu_is_scaled_mm(ext, out_dtype):
    a, a_si, b, b_si = _fp8_operands(17, 64, 48, seed=1)
    bias = torch.randn(48, dtype=torch.float32)
    lt0, fallback0, _ = ext.lt_counts()
    got = ext.scaled_mm(a, a_si, b, b_si, True, native.DTYPE_CODES[out_dtype], bias, None)
    fuse = out_dtype == torch.bfloat16  # fused into bf16 outputs, added after into fp32 ones
    want = torch._scaled_mm(a, b, scale_a=a_si, scale_b=b_si, bias=bias.to(out_dtype) if fuse else None,
                            out_dtype=out_dtype)
    if not fuse:
        want = want + bias
    assert got.dtype == out_dtype and torch.equal(got, want)
    lt1, fallback1, _ = ext.lt_counts()
    assert (lt1 - lt0, fallback1 - fallback0) == (0, 1)


def test_block_gemm_tuning_switch_and_record(ext):
    """The switch takes bools and the record is a list of BlockGemmTuning: empty in a process
    that ran no CUDA block GEMM (its tuning: tests/gpu/test_block_scaling_gpu.py)."""
    native.set_block_gemm_tuning(True)
    native.set_block_gemm_tuning(False)  # the default
    assert native.block_gemm_tunings() == []
    assert native.BlockGemmTuning._fields == ("m", "n", "k", "answers", "pick", "first_us", "pick_us")


def test_extension_gemm_writes_out_in_place(ext):
    a, a_si, b, b_si = _fp8_operands(8, 32, 16, seed=2)
    full = torch.full((24, 16), 5.0, dtype=torch.float32)
    got = ext.scaled_mm(a, a_si, b, b_si, False, native.DTYPE_CODES[torch.float32], None, full[8:16])
    assert got.data_ptr() == full[8:16].data_ptr()
    assert torch.equal(full[8:16], torch._scaled_mm(a, b, scale_a=a_si, scale_b=b_si, out_dtype=torch.float32))
    assert bool((full[:8] == 5).all()) and bool((full[16:] == 5).all())


def test_gemm_on_cpu_does_not_take_the_extension(ext):
    from fp8train import gemm
    from fp8train.recipe import GemmConfig
    from fp8train.roles import GemmRole
    a, a_si, b, b_si = _fp8_operands(8, 32, 16, seed=3)
    before = ext.lt_counts()
    gemm.scaled_mm(a, a_si, b, b_si, role=GemmRole.FPROP, config=GemmConfig(), out_dtype=torch.bfloat16)
    assert ext.lt_counts() == before


def test_gemm_operator_for_traced_code_has_its_shape_function(ext):
    # torch.ops.fp8train_lt.scaled_mm: what compiled CUDA code calls (gemm.py). Its fake gives
    # the (M, N) row-major output of out_dtype; it has no CPU kernel (the CPU's GEMM is the
    # emulation), so a CPU call is refused by the dispatcher.
    from torch._subclasses.fake_tensor import FakeTensorMode
    assert native.gemm_op_loaded()
    a, a_si, b, b_si = _fp8_operands(17, 64, 48, seed=4)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in (a, a_si, b, b_si)]
        y = torch.ops.fp8train_lt.scaled_mm(*fake, True, torch.bfloat16, None)
    assert y.shape == (17, 48) and y.dtype == torch.bfloat16 and y.stride() == (48, 1)
    with pytest.raises(NotImplementedError, match="fp8train_lt::scaled_mm"):
        torch.ops.fp8train_lt.scaled_mm(a, a_si, b, b_si, True, torch.bfloat16, None)


def test_cast_plan_with_dbias_needs_its_colsum_launch(ext):
    """A plan with dbias partial sums takes their colsum launch too, with one hole (the call's
    dbias), and neither without the other."""
    partial = torch.zeros(1, 16)
    with pytest.raises(RuntimeError, match="needs its partial sums and their colsum launch"):
        ext.CastPlan(0, 1, True, [2, 16], [], [], partial, None, 0, [])
    with pytest.raises(RuntimeError, match="needs its partial sums and their colsum launch"):
        ext.CastPlan(0, 1, True, [2, 16], [], [], None, ext.Launch(0, 1, 128, 0, [0], [0]), 0, [])
    with pytest.raises(RuntimeError, match="needs its partial sums and their colsum launch"):
        ext.CastPlan(0, 1, True, [2, 16], [], [], partial, ext.Launch(0, 1, 128, 0, [0, 0], [0, 1]), 0, [])
    ext.CastPlan(0, 1, True, [2, 16], [], [], partial, ext.Launch(0, 1, 128, 0, [0, 0], [-1, 0]), 0, [])
    with pytest.raises(RuntimeError, match="bad dtype code"):  # dbias dtype: float32, bf16 or fp16 only
        ext.CastPlan(0, 1, True, [2, 16], [], [], partial, ext.Launch(0, 1, 128, 0, [0, 0], [-1, 0]), 7, [])


def test_weight_recast_refuses_what_its_plan_was_not_made_for(ext):
    """The nodes' weight re-cast (csrc recast, `recast_with`) checks the weight and the
    workspace against its plan before any launch (`recast_refusal`, which recast raises
    from): here CPU tensors (the GPU tests cover each buffer's refusal and the launches)."""
    plan = ext.CastPlan(0, 1, True, [2, 16], [], [], None, None, 0, [])  # bf16 (2, 16) -> e5m2
    w = torch.zeros(2, 16, dtype=torch.bfloat16)
    data = torch.zeros(2, 16, dtype=torch.float8_e5m2)
    assert "weight is not of the plan's shape, dtype and device" in ext.recast_refusal(plan, w, data, None, torch.ones(1))
    with pytest.raises(RuntimeError, match="re-cast plan for .2, 16. BFloat16 on cuda:0 got a weight"):
        ext.recast_with(plan, w, data, None, torch.ones(1))


def test_node_refusal_names_why_the_cpp_node_cannot_take_an_input(monkeypatch):
    # modules.linear.node_refusal, both C++ paths' (per-tensor and block) first check; its
    # device test asks the current CUDA device, stood in for here (the input's index is -1)
    from fp8train.modules import linear
    from fp8train.tensor import Float8Tensor
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: -1, raising=False)
    x = torch.zeros(4, 16, dtype=torch.bfloat16)
    assert linear.node_refusal(x, torch.bfloat16) is None
    assert linear.node_refusal(x.float(), torch.float16) is None
    assert "no C++ path for a torch.float64 input" in linear.node_refusal(x.double(), torch.bfloat16)
    assert "with torch.float64 activations" in linear.node_refusal(x, torch.float64)
    fp8 = Float8Tensor(torch.zeros(4, 16, dtype=torch.float8_e4m3fn), torch.ones(1), torch.bfloat16)
    assert linear.node_refusal(fp8, torch.bfloat16) == "Python node: a Float8Tensor input"
    monkeypatch.setattr(native, "hooks_installed", lambda: True)
    assert "launch hook" in linear.node_refusal(x, torch.bfloat16)
    monkeypatch.setattr(native, "hooks_installed", lambda: False)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    assert linear.node_refusal(x, torch.bfloat16) == "Python node: input on cuda:-1, not the current device"
