"""FP8 GEMM roles on CPU (torch._scaled_mm's exact fp32 emulation). Layout and alignment rules
are enforced only by the GPU; tests/gpu/test_gemm_gpu.py checks those."""
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
    """Record every FP8 GEMM's fast-accumulation flag and output shape: torch._scaled_mm's
    calls (the CPU) and the C++ extension's `scaled_mm` calls from gemm.py (CUDA; a layer's
    first step runs the Python path, whose GEMMs go there)."""
    calls = []
    real = torch._scaled_mm

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
