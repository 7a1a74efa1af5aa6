"""FP8 GEMM roles on CPU (gemm.emulated_scaled_mm: float32 sums of exact FP8 products). Layout
and alignment rules are enforced only by the GPU; tests/gpu/test_lt_gemm_gpu.py checks those."""
import pytest
import torch

import fp8train
from fp8train import GemmConfig, GemmRole, gemm
from fp8train.kernels import native
from fp8train.tensor import padded_rows
from helpers import sqnr_db

CFG = GemmConfig()


def q(x, dtype=torch.float8_e4m3fn):
    return fp8train.quantize(x, dtype)


def exact(a, b):
    """What the FP8 GEMM must equal on CPU: the product of the dequantized operands."""
    return a.dequantize(torch.float64) @ b.dequantize(torch.float64)


@pytest.mark.parametrize("m", [1, 13, 64])
def test_fprop(m):
    x, w, bias = torch.randn(m, 48), torch.randn(32, 48), torch.randn(32)
    xq, wq = q(x), q(w)
    y = gemm.fprop(xq.fp8_data, xq.scale_inv, wq.fp8_data, wq.scale_inv, CFG, torch.float32, bias)
    assert y.shape == (m, 32)
    torch.testing.assert_close(y.double(), exact(xq, wq.t()) + bias.double(), rtol=1e-6, atol=1e-5)
    assert sqnr_db(y, x @ w.t() + bias) > 25


def test_fprop_fuses_bias_into_bf16_output():
    xq, wq, bias = q(torch.randn(16, 32)), q(torch.randn(16, 32)), torch.randn(16)
    y = gemm.fprop(xq.fp8_data, xq.scale_inv, wq.fp8_data, wq.scale_inv, CFG, torch.bfloat16, bias)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), exact(xq, wq.t()) + bias.bfloat16().double(), rtol=1e-2, atol=1e-2)


def test_dgrad_from_the_weights_transposed_copy():
    dy, w = torch.randn(13, 32), torch.randn(32, 48)
    dyq, wq = q(dy, torch.float8_e5m2), q(w)
    dx = gemm.dgrad(dyq.fp8_data, dyq.scale_inv, wq.transpose_data(), wq.scale_inv, CFG, torch.float32)
    assert dx.shape == (13, 48) and wq.transpose_is_cached()
    torch.testing.assert_close(dx.double(), exact(dyq, wq), rtol=1e-6, atol=1e-5)


def test_wgrad_from_padded_transposed_copies():
    m = 13
    dy, x = torch.randn(m, 32), torch.randn(m, 48)
    dyq, xq = q(dy, torch.float8_e5m2), q(x)
    dy_t, x_t = dyq.transpose_data(padded=True), xq.transpose_data(padded=True)
    assert dy_t.shape == (32, padded_rows(m)) and x_t.shape == (48, padded_rows(m))
    dw = gemm.wgrad(dy_t, dyq.scale_inv, x_t, xq.scale_inv, CFG, torch.float32)
    assert dw.shape == (32, 48)
    torch.testing.assert_close(dw.double(), exact(dyq.t(), xq), rtol=1e-6, atol=1e-5)


def test_dims_ok():
    assert gemm.dims_ok(16, 4096) and not gemm.dims_ok(16, 1000) and not gemm.dims_ok(0)


@pytest.fixture
def scaled_mm_calls(monkeypatch):
    """Record every FP8 GEMM's fast-accumulation flag and output shape: on CUDA the flag the
    kernel gets, from torch._scaled_mm's calls and the C++ extension's `scaled_mm` calls from
    gemm.py (a layer's first step runs the Python path, whose GEMMs go there); on the CPU,
    where the emulation has no such flag, the flag GemmConfig gives gemm.scaled_mm's role."""
    calls = []
    real = torch._scaled_mm
    real_role_gemm = gemm.scaled_mm

    def role_spy(a, *args, **kwargs):
        out = real_role_gemm(a, *args, **kwargs)
        if not a.is_cuda:
            calls.append((tuple(out.shape), kwargs["config"].fast_accum(kwargs["role"])))
        return out

    def spy(a, b, *args, **kwargs):
        out = real(a, b, *args, **kwargs)
        calls.append((tuple(out.shape), kwargs["use_fast_accum"]))
        return out

    class SpyExtension:
        def __init__(self, ext):
            self.ext = ext

        def scaled_mm(self, a, a_scale_inv, b, b_scale_inv, fast_accum, out_code, bias, out):
            y = self.ext.scaled_mm(a, a_scale_inv, b, b_scale_inv, fast_accum, out_code, bias, out)
            calls.append((tuple(y.shape), fast_accum))
            return y

    real_gemm = native.gemm

    def spy_gemm():
        ext = real_gemm()
        return None if ext is None else SpyExtension(ext)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    monkeypatch.setattr(native, "gemm", spy_gemm)
    monkeypatch.setattr(gemm, "scaled_mm", role_spy)
    return calls


@pytest.mark.parametrize("config", [
    GemmConfig(),
    GemmConfig(fprop_fast_accum=False, dgrad_fast_accum=True, wgrad_fast_accum=False),
    GemmConfig(fprop_fast_accum=False, dgrad_fast_accum=False, wgrad_fast_accum=True),
], ids=["default", "dgrad-fast", "wgrad-fast"])
@pytest.mark.parametrize("recipe_cls", [fp8train.DelayedScaling, fp8train.CurrentScaling], ids=["delayed", "current"])
def test_gemm_config_decides_which_gemms_use_fast_accumulation(scaled_mm_calls, config, recipe_cls, device):
    # Distinct M, K, N so each GEMM is identified by its output shape: fprop (M,N), dgrad (M,K), wgrad (N,K).
    m, k, n = 24, 64, 32
    layer = fp8train.Linear(k, n, device=device)
    x = torch.randn(m, k, device=device, requires_grad=True)
    with fp8train.autocast(recipe=recipe_cls(gemm=config)):
        y = layer(x)
    y.sum().backward()
    assert dict(scaled_mm_calls) == {
        (m, n): config.fast_accum(GemmRole.FPROP),
        (m, k): config.fast_accum(GemmRole.DGRAD),
        (n, k): config.fast_accum(GemmRole.WGRAD),
    }
    assert len(scaled_mm_calls) == 3


# ------------------------------------------------------------------ the CPU's FP8 GEMM


def _fp8(shape, dtype, spread=3.0):
    return (torch.randn(shape) * spread).to(dtype)


def _float32(v: float) -> float:
    return float(torch.tensor(v, dtype=torch.float64).float())


@pytest.mark.parametrize("dtypes", [(torch.float8_e4m3fn,) * 2, (torch.float8_e5m2, torch.float8_e4m3fn)],
                         ids=["e4m3", "e5m2xe4m3"])
def test_emulation_rounds_only_the_sum_and_the_scaling(dtypes):
    """K = 1: the product of two FP8 values is exact, so y = fp32(a b * fp32(sa sb)) exactly;
    float64 holds a b * s exactly (8 + 24 bits), so rounding it once is the intended value."""
    a, b = _fp8((19, 1), dtypes[0]), _fp8((1, 23), dtypes[1])
    sa, sb = torch.tensor(0.3), torch.tensor(1.7)
    y = gemm.emulated_scaled_mm(a, sa, b, sb, torch.float32)
    s = _float32(sa.item() * sb.item())
    want = (a.double() @ b.double() * s).float()
    assert y.dtype == torch.float32 and torch.equal(y, want)


@pytest.mark.parametrize("k", [16, 48, 1024])
def test_emulation_is_the_exact_product_within_float32_sums(k):
    a, b = _fp8((13, k), torch.float8_e4m3fn), _fp8((k, 40), torch.float8_e5m2)
    sa, sb = torch.tensor(0.02), torch.tensor(3.0)
    y = gemm.emulated_scaled_mm(a, sa, b.t().contiguous().t(), sb, torch.float32)  # b column-major
    exact = (a.double() @ b.double()) * sa.double() * sb.double()
    # float32 summation: |error| <= K 2^-24 sum |a b| s (+ the scaling's and output's roundings)
    bound = (k + 2) * 2.0**-24 * (a.double().abs() @ b.double().abs()) * sa.double() * sb.double()
    assert ((y.double() - exact).abs() <= bound).all()


def test_emulation_sums_in_float32_under_torch_autocast():
    """Inside torch.autocast(bfloat16) (how FP32-master-weight models train) the sums stay
    float32: autocast reached into the op's mm in eager code (not in compiled code) and
    rounded it to bf16 before the scaling, so eager and compiled steps differed."""
    a, b = _fp8((33, 64), torch.float8_e4m3fn), _fp8((64, 24), torch.float8_e4m3fn)
    sa, sb = torch.tensor(0.37), torch.tensor(1.9)
    want = gemm.emulated_scaled_mm(a, sa, b, sb, torch.bfloat16)  # the float32 math (tests above)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = gemm.emulated_scaled_mm(a, sa, b, sb, torch.bfloat16)
    assert torch.equal(got, want)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_emulation_adds_the_bias_rounded_to_the_output_dtype(out_dtype):
    """The GPU passes the bias in out_dtype (cuBLASLt's epilogue) and rounds the float32 sum
    once: y = out(fp32(a b s) + out(bias)), exact to compute for K = 1."""
    a, b = _fp8((9, 1), torch.float8_e4m3fn), _fp8((1, 32), torch.float8_e4m3fn)
    sa, sb, bias = torch.tensor(0.5), torch.tensor(0.25), torch.randn(32) * 10
    y = gemm.emulated_scaled_mm(a, sa, b, sb, out_dtype, bias)
    acc = (a.double() @ b.double() * 0.125).float()  # exact: a power-of-two scale
    want = (acc.double() + bias.to(out_dtype).double()).float().to(out_dtype)  # float32 sum, then out_dtype
    assert y.dtype == out_dtype and torch.equal(y, want)


def test_emulation_writes_out_in_place_and_broadcasts_row_and_column_scales():
    a, b = _fp8((8, 32), torch.float8_e4m3fn), _fp8((32, 16), torch.float8_e4m3fn)
    sa, sb = torch.rand(8, 1) + 0.5, torch.rand(1, 16) + 0.5
    full = torch.full((24, 16), 5.0, dtype=torch.bfloat16)
    got = gemm.emulated_scaled_mm(a, sa, b, sb, torch.bfloat16, out=full[8:16])
    assert got.data_ptr() == full[8:16].data_ptr()
    exact = (a.double() @ b.double()) * sa.double() * sb.double()
    torch.testing.assert_close(full[8:16].double(), exact, rtol=2**-8, atol=1e-6)
    assert bool((full[:8] == 5).all()) and bool((full[16:] == 5).all())


def test_emulation_propagates_nan_and_inf():
    a = torch.tensor([[1.0, 2.0], [float("nan"), 1.0], [float("inf"), 1.0], [float("inf"), 0.0]]).to(torch.float8_e5m2)
    b = torch.tensor([[1.0], [1.0]]).to(torch.float8_e5m2)
    y = gemm.emulated_scaled_mm(a, torch.tensor(1.0), b, torch.tensor(1.0), torch.float32)
    assert y[0].item() == 3.0 and y[1].isnan().item() and y[2].item() == float("inf") and y[3].item() == float("inf")


def test_cpu_layers_never_call_torchs_scaled_mm(monkeypatch):
    """torch._scaled_mm's CPU kernel runs at ~0.04 GFLOP/s on some CPUs (oneDNN on AVX-512 +
    AMX Xeons): the CPU path must not depend on it."""
    def refuse(*args, **kwargs):
        raise AssertionError("torch._scaled_mm called on the CPU")

    monkeypatch.setattr(torch, "_scaled_mm", refuse)
    x = torch.randn(2, 5, 32, requires_grad=True)
    for recipe in (fp8train.DelayedScaling(), fp8train.CurrentScaling()):
        layer = fp8train.Linear(32, 48)
        with fp8train.autocast(recipe=recipe):
            y = layer(x)
        y.sum().backward()
    assert x.grad is not None and layer.weight.grad is not None
