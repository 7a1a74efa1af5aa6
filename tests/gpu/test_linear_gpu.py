"""What only the GPU shows: cuBLASLt layout rules, fast accumulation, CUDA graph capture.
(Every device-parametrised test in tests/ also runs here on CUDA.)"""
import pytest
import torch

import fp8train
from fp8train import CurrentScaling, DelayedScaling, GemmConfig, gemm
from fp8train.quantizer import _REGISTRY
from helpers import rel_err

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


@pytest.mark.parametrize("m, k, n", [(13, 64, 48), (4096, 1024, 2048), (1000, 4096, 16)], ids=str)
def test_gemm_roles_on_cublaslt(m, k, n):
    x, w, dy = (torch.randn(*s, device=CUDA) for s in ((m, k), (n, k), (m, n)))
    xq, wq = fp8train.quantize(x), fp8train.quantize(w)
    dyq = fp8train.quantize(dy, torch.float8_e5m2)
    full = GemmConfig(fprop_fast_accum=False)
    # Full accumulation into float32. Hopper's FP8 tensor cores keep ~14 mantissa bits inside
    # each MMA chunk even then (measured 0.8e-4 at K=64, 1.3e-4 at K=8192), so 5e-4, not 1e-6.
    y = gemm.fprop(xq.fp8_data, xq.scale_inv, wq.fp8_data, wq.scale_inv, full, torch.float32)
    assert rel_err(y, xq.dequantize(torch.float64) @ wq.dequantize(torch.float64).t()) < 5e-4
    dx = gemm.dgrad(dyq.fp8_data, dyq.scale_inv, wq.transpose_data(), wq.scale_inv, full, torch.float32)
    assert rel_err(dx, dyq.dequantize(torch.float64) @ wq.dequantize(torch.float64)) < 5e-4
    dw = gemm.wgrad(dyq.transpose_data(padded=True), dyq.scale_inv, xq.transpose_data(padded=True), xq.scale_inv,
                    full, torch.float32)
    assert rel_err(dw, dyq.dequantize(torch.float64).t() @ xq.dequantize(torch.float64)) < 5e-4


def test_bias_is_fused_for_bf16_and_added_for_fp32():
    xq, wq = fp8train.quantize(torch.randn(64, 128, device=CUDA)), fp8train.quantize(torch.randn(32, 128, device=CUDA))
    bias = torch.randn(32, device=CUDA)
    ref = xq.dequantize(torch.float64) @ wq.dequantize(torch.float64).t() + bias.double()
    assert rel_err(gemm.fprop(xq.fp8_data, xq.scale_inv, wq.fp8_data, wq.scale_inv, GemmConfig(), torch.bfloat16, bias), ref) < 1e-2
    assert rel_err(gemm.fprop(xq.fp8_data, xq.scale_inv, wq.fp8_data, wq.scale_inv, GemmConfig(), torch.float32, bias), ref) < 3e-3


def test_fast_accumulation_is_what_the_config_says():
    """Fast and full accumulation give different bits at large K; the layer's outputs must be
    bit-identical to _scaled_mm called with the flag GemmConfig names for each GEMM."""
    m, k, n = 256, 8192, 256
    layer = fp8train.Linear(k, n, bias=False, device=CUDA)
    x = torch.randn(m, k, device=CUDA, requires_grad=True)
    dy = torch.randn(m, n, device=CUDA)
    recipe = CurrentScaling(gemm=GemmConfig(fprop_fast_accum=True, dgrad_fast_accum=False))
    with fp8train.autocast(recipe=recipe):
        y = layer(x)
    y.backward(dy)
    xq, wq = fp8train.quantize(x.detach()), layer.weight_fp8
    dyq = fp8train.quantize(dy, torch.float8_e5m2)

    def mm(a, b, fast, out):
        return torch._scaled_mm(a.fp8_data, b, a.scale_inv, wq.scale_inv, out_dtype=out, use_fast_accum=fast)

    assert torch.equal(y, mm(xq, wq.fp8_data.t(), True, torch.float32))
    assert not torch.equal(y, mm(xq, wq.fp8_data.t(), False, torch.float32))
    w_t = wq.transpose_data().t()
    assert torch.equal(x.grad, mm(dyq, w_t, False, torch.float32))
    assert not torch.equal(x.grad, mm(dyq, w_t, True, torch.float32))


@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=16), CurrentScaling()], ids=["delayed", "current"])
def test_linear_fwd_bwd_replays_in_a_cuda_graph(recipe):
    """Forward + backward with is_first_microbatch=False, captured once and replayed: every
    replay equals the eager step on the same inputs (outputs, gradients, scaling state)."""
    torch.manual_seed(0)
    layer = fp8train.Linear(256, 512, device=CUDA)
    static_x = torch.randn(3, 40, 256, device=CUDA, requires_grad=True)
    static_dy = torch.randn(3, 40, 512, device=CUDA)
    inputs = [(torch.randn_like(static_x), torch.randn_like(static_dy)) for _ in range(4)]

    def step(first=False):
        with fp8train.autocast(recipe=recipe):
            y = layer(static_x, is_first_microbatch=first)
        # A scalar loss whose gradient w.r.t. y is exactly static_dy.
        (y * static_dy).sum().backward()
        return y

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up and eager reference on a side stream, as for any capture
        step(first=True)  # calibrates, compiles the kernels, caches the FP8 weight and its transpose
        for _ in range(2):
            step()
        snapshot = {k: v.clone() for k, v in layer.state_dict().items()}
        eager = []
        for x, dy in inputs:
            static_x.grad = layer.weight.grad = layer.bias.grad = None
            static_x.data.copy_(x)
            static_dy.copy_(dy)
            y = step()
            eager.append((y.clone(), static_x.grad.clone(), layer.weight.grad.clone(), layer.bias.grad.clone(),
                          {k: v.clone() for k, v in layer.state_dict().items()}))
        layer.load_state_dict(snapshot)  # back to the scaling state before the eager steps, in place
        static_x.grad = layer.weight.grad = layer.bias.grad = None
    torch.cuda.current_stream().wait_stream(side)
    assert _REGISTRY._batches is not None  # pointer tables stay valid: nothing to build during capture

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = step()
    for (x, dy), (y, dx, dw, db, state) in zip(inputs, eager):
        static_x.data.copy_(x)
        static_dy.copy_(dy)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_y, y) and torch.equal(static_x.grad, dx)
        assert torch.equal(layer.weight.grad, dw) and torch.equal(layer.bias.grad, db)
        for key, value in layer.state_dict().items():
            assert torch.equal(value, state[key]), key


def test_cuda_graph_capture_survives_a_freed_layer():
    layer = fp8train.Linear(64, 64, device=CUDA)
    x = torch.randn(32, 64, device=CUDA, requires_grad=True)

    def step():
        with fp8train.autocast(recipe=DelayedScaling()):
            layer(x, is_first_microbatch=False).sum().backward()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        doomed = fp8train.Linear(64, 64, device=CUDA)
        with fp8train.autocast(recipe=DelayedScaling()):
            doomed(x).sum().backward()
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    del doomed
    import gc
    gc.collect()  # its quantizers die: the registry is stale, its built batch still valid
    x.grad = layer.weight.grad = layer.bias.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.isfinite(layer.input_quantizer.scale) and layer.input_quantizer.amax_history[1] > 0
