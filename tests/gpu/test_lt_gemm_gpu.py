"""The extension's FP8 GEMM (fp8train/csrc/lt_gemm.cpp: cuBLASLt with a cached algorithm)
against torch._scaled_mm: the same bytes, for the three roles' layouts and dtypes, odd M,
bias fused or added, fast accumulation on and off, row blocks of a larger output, strided
operands, a CUDA graph and a second thread.

Bit equality is what the file promises: the descriptors, workspace limit and heuristic query
are torch's own (at::cuda::blas::scaled_gemm's), so cuBLASLt picks the kernel torch runs.
Each test also checks through `lt_counts` that its calls took the cuBLASLt path, so none
can pass by falling back to at::_scaled_mm."""
from __future__ import annotations

import threading

import pytest
import torch

import fp8train
from fp8train import gemm
from fp8train.kernels import native
from fp8train.recipe import GemmConfig
from fp8train.roles import GemmRole
from tests.helpers import assert_bitwise

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
CODES = native.DTYPE_CODES


@pytest.fixture(scope="module")
def ext():
    e = native.extension()
    if e is None:
        pytest.fail(f"the C++ extension did not build: {native.failure()}")
    assert e.lt_version() > 0, "libcublasLt was not found: the extension's GEMMs are at::_scaled_mm's"
    return e


class Counted:
    """lt_counts' (cuBLASLt calls, at::_scaled_mm calls) made inside the block."""
    def __init__(self, ext):
        self.ext = ext

    def __enter__(self):
        self.start = self.ext.lt_counts()
        return self

    def __exit__(self, *exc):
        end = self.ext.lt_counts()
        self.lt, self.fallback = end[0] - self.start[0], end[1] - self.start[1]


def operands(m, k, n, a_dtype, b_dtype, seed):
    """a (m, k) row-major, b (k, n) column-major, one-element float32 inverse scales."""
    g = torch.Generator(device=CUDA).manual_seed(seed)
    a = (torch.randn(m, k, device=CUDA, generator=g) * 3).to(a_dtype)
    b = (torch.randn(n, k, device=CUDA, generator=g) * 3).to(b_dtype).t()
    a_si = torch.rand((), device=CUDA, generator=g) + 0.5
    b_si = torch.rand((), device=CUDA, generator=g) + 0.5
    return a, a_si, b, b_si


def torch_ref(a, a_si, b, b_si, fast, out_dtype, bias=None):
    fuse = bias is not None and out_dtype in (torch.bfloat16, torch.float16)
    y = torch._scaled_mm(a, b, scale_a=a_si, scale_b=b_si, bias=bias if fuse else None, out_dtype=out_dtype,
                         use_fast_accum=fast)
    return y + bias if bias is not None and not fuse else y


SHAPES = [(1, 16, 16), (17, 64, 48), (256, 1024, 1024), (4095, 1024, 4096), (8192, 4096, 1024), (33, 2048, 16)]
DTYPES = [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)]  # fprop; dgrad and wgrad (e5m2 gradients)


@pytest.mark.parametrize("m,k,n", SHAPES, ids=[f"{m}x{k}x{n}" for m, k, n in SHAPES])
@pytest.mark.parametrize("dtypes", DTYPES, ids=["e4m3-e4m3", "e5m2-e4m3", "e4m3-e5m2"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("fast", [True, False], ids=["fast", "exact"])
def test_bytes_match_scaled_mm(ext, m, k, n, dtypes, out_dtype, fast):
    a, a_si, b, b_si = operands(m, k, n, *dtypes, seed=m + k + n)
    with Counted(ext) as c:
        got = ext.scaled_mm(a, a_si, b, b_si, fast, CODES[out_dtype], None, None)
    assert (c.lt, c.fallback) == (1, 0)
    assert got.shape == (m, n) and got.dtype == out_dtype and got.is_contiguous()
    assert_bitwise(got, torch_ref(a, a_si, b, b_si, fast, out_dtype), f"{m}x{k}x{n}")


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("bias_dtype", [torch.bfloat16, torch.float32], ids=["bf16-bias", "fp32-bias"])
def test_bias(ext, out_dtype, bias_dtype):
    """Fused into bf16/fp16 outputs (cuBLASLt's epilogue), added after into fp32 ones; a bias
    of another dtype is converted to the output's first, as gemm.scaled_mm always did."""
    a, a_si, b, b_si = operands(300, 512, 768, E4M3, E4M3, seed=5)
    bias = torch.randn(768, device=CUDA, dtype=bias_dtype)
    with Counted(ext) as c:
        got = ext.scaled_mm(a, a_si, b, b_si, True, CODES[out_dtype], bias, None)
    assert (c.lt, c.fallback) == (1, 0)
    assert_bitwise(got, torch_ref(a, a_si, b, b_si, True, out_dtype, bias.to(out_dtype)), "biased output")


def test_row_block_of_a_larger_output(ext):
    """`out`: a row block of a larger (rows, N) output, written in place, other rows untouched."""
    a, a_si, b, b_si = operands(128, 256, 512, E4M3, E4M3, seed=6)
    full = torch.full((384, 512), 7.0, device=CUDA, dtype=torch.bfloat16)
    block = full[128:256]
    with Counted(ext) as c:
        got = ext.scaled_mm(a, a_si, b, b_si, True, CODES[torch.bfloat16], None, block)
    assert (c.lt, c.fallback) == (1, 0)
    assert got.data_ptr() == block.data_ptr()
    assert_bitwise(full[128:256], torch_ref(a, a_si, b, b_si, True, torch.bfloat16), "block")
    assert bool((full[:128] == 7).all()) and bool((full[256:] == 7).all())


def test_strided_operands(ext):
    """a with a leading stride over K (columns of a wider tensor) and b a column slice of a
    wider column-major matrix: cuBLASLt's lda/ldb, the bytes of a contiguous copy."""
    wide_a, a_si, wide_b, b_si = operands(200, 1024, 256, E4M3, E4M3, seed=7)
    a, b = wide_a[:, :512], wide_b[:512, :]  # (200, 512) stride (1024, 1); (512, 256) stride (1, 1024)
    assert a.stride() == (1024, 1) and b.stride() == (1, 1024)
    with Counted(ext) as c:
        got = ext.scaled_mm(a, a_si, b, b_si, False, CODES[torch.bfloat16], None, None)
    assert (c.lt, c.fallback) == (1, 0)
    assert_bitwise(got, torch_ref(a.contiguous(), a_si, b.t().contiguous().t(), b_si, False, torch.bfloat16), "strided")


def test_switch_and_fallback(ext):
    """set_lt_gemm(False) sends calls to at::_scaled_mm (same bytes); operands the cuBLASLt path
    does not take (K not a multiple of 16) go there too, and get its error."""
    a, a_si, b, b_si = operands(64, 128, 256, E4M3, E4M3, seed=8)
    want = torch_ref(a, a_si, b, b_si, True, torch.bfloat16)
    native.set_lt_gemm(False)
    try:
        with Counted(ext) as c:
            got = ext.scaled_mm(a, a_si, b, b_si, True, CODES[torch.bfloat16], None, None)
    finally:
        native.set_lt_gemm(True)
    assert (c.lt, c.fallback) == (0, 1)
    assert_bitwise(got, want, "switched off")
    a8 = torch.zeros(32, 40, device=CUDA).to(E4M3)
    b8 = torch.zeros(32, 40, device=CUDA).to(E4M3).t()
    with Counted(ext) as c, pytest.raises(RuntimeError):
        ext.scaled_mm(a8, a_si, b8, b_si, True, CODES[torch.bfloat16], None, None)
    assert (c.lt, c.fallback) == (0, 1)


def test_scales_are_read_on_the_device_each_call(ext):
    """The cached algorithm carries no scale: new scale values (same tensors, rewritten in
    place, as delayed scaling does) change the next output."""
    a, a_si, b, b_si = operands(64, 256, 256, E4M3, E4M3, seed=9)
    first = ext.scaled_mm(a, a_si, b, b_si, True, CODES[torch.float32], None, None)
    a_si.mul_(2)
    second = ext.scaled_mm(a, a_si, b, b_si, True, CODES[torch.float32], None, None)
    assert_bitwise(second, torch_ref(a, a_si, b, b_si, True, torch.float32), "after the scale changed")
    assert torch.equal(second, first * 2)


def test_graph_capture(ext):
    """Captured in a CUDA graph (the algorithm chosen during capture), replays compute the
    current operands' product."""
    a, a_si, b, b_si = operands(512, 1024, 1024, E5M2, E4M3, seed=10)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph):
            y = ext.scaled_mm(a, a_si, b, b_si, False, CODES[torch.bfloat16], None, None)
    torch.cuda.current_stream().wait_stream(stream)
    for seed in (11, 12):
        a2, a2_si, b2, b2_si = operands(512, 1024, 1024, E5M2, E4M3, seed=seed)
        a.copy_(a2), a_si.copy_(a2_si), b.copy_(b2), b_si.copy_(b2_si)
        graph.replay()
        assert_bitwise(y, torch_ref(a2, a2_si, b2, b2_si, False, torch.bfloat16), f"replay {seed}")


def test_another_thread(ext):
    """The algorithm cache is per thread (the autograd engine runs backward on its own): a
    thread that never saw the problem chooses again and gets the same bytes."""
    a, a_si, b, b_si = operands(96, 512, 384, E4M3, E4M3, seed=13)
    want = ext.scaled_mm(a, a_si, b, b_si, True, CODES[torch.bfloat16], None, None)
    out = {}

    def work():
        out["y"] = ext.scaled_mm(a, a_si, b, b_si, True, CODES[torch.bfloat16], None, None)
        torch.cuda.synchronize()
    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert_bitwise(out["y"], want, "second thread")


@pytest.mark.parametrize("role", list(GemmRole), ids=lambda r: r.name)
def test_gemm_module_routes_through_the_extension(ext, role):
    """gemm.fprop/dgrad/wgrad on CUDA tensors take the extension's GEMM, with the role's fast
    accumulation from GemmConfig."""
    config = GemmConfig(fprop_fast_accum=True, dgrad_fast_accum=False, wgrad_fast_accum=True)
    a, a_si, b, b_si = operands(160, 512, 256, E5M2 if role != GemmRole.FPROP else E4M3, E4M3, seed=14)
    with Counted(ext) as c:
        got = gemm.scaled_mm(a, a_si, b, b_si, role=role, config=config, out_dtype=torch.bfloat16)
    assert (c.lt, c.fallback) == (1, 0)
    assert_bitwise(got, torch_ref(a, a_si, b, b_si, config.fast_accum(role), torch.bfloat16), role.name)


def test_linear_steps_take_the_cublaslt_path(ext):
    """An FP8 Linear's fwd+bwd (the C++ node once its launches are prepared) runs its three
    GEMMs through cuBLASLt."""
    layer = fp8train.Linear(512, 256, params_dtype=torch.bfloat16, device=CUDA)
    x = torch.randn(64, 512, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    for step in range(4):
        with Counted(ext) as c:
            with fp8train.autocast():
                y = layer(x)
            y.backward(torch.randn_like(y))
        assert (c.lt, c.fallback) == (3, 0), f"step {step}: {c.lt} cuBLASLt, {c.fallback} at::_scaled_mm calls"


def test_many_problems(ext):
    """Variable token counts make a problem each: past the per-thread list's bound (256) the
    list starts over, and every call still takes the cuBLASLt path with torch's bytes."""
    _, _, b, b_si = operands(16, 256, 128, E4M3, E4M3, seed=15)
    a_all, a_si, _, _ = operands(300, 256, 16, E4M3, E4M3, seed=16)
    with Counted(ext) as c:
        for m in (*range(1, 301), 1, 2):  # 300 distinct M, then two seen before the list started over
            got = ext.scaled_mm(a_all[:m], a_si, b, b_si, True, CODES[torch.bfloat16], None, None)
            if m % 37 == 1:
                assert_bitwise(got, torch_ref(a_all[:m], a_si, b, b_si, True, torch.bfloat16), f"M={m}")
    assert (c.lt, c.fallback) == (302, 0)


def test_operands_off_256_bytes_go_to_scaled_mm(ext):
    """An operand 16- but not 256-byte aligned (rows of a larger tensor from an odd row) is
    left to at::_scaled_mm: cuBLASLt's heuristic, asked as torch asks it, assumes 256."""
    big, a_si, b, b_si = operands(65, 16, 32, E4M3, E4M3, seed=17)
    a = big[1:]  # starts 16 bytes in
    assert a.data_ptr() % 256 == 16
    with Counted(ext) as c:
        got = ext.scaled_mm(a, a_si, b, b_si, True, CODES[torch.bfloat16], None, None)
    assert (c.lt, c.fallback) == (0, 1)
    assert_bitwise(got, torch_ref(a, a_si, b, b_si, True, torch.bfloat16), "misaligned rows")
