"""torch.compile(fullgraph=True) with Inductor on the GPU: compiled modules match eager.

The casts trace as the operator fp8train::cast_kernels (eager's cast kernel, launched by
Inductor); the fused norm and activation kernels stay fp8train:: custom ops that launch
eager's Triton kernels; the GEMMs stay operators. A Linear's output is eager's bit for bit;
elsewhere Inductor computes the glue between the operators in its own order (bf16 roundings
of intermediates it fuses away), so the checks leave room: outputs and gradients within
40 dB SQNR of eager, scaling state within 1%.
"""
import copy

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import fp8train
from fp8train import CurrentScaling, DelayedScaling
from helpers import sqnr_db

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda")
STEPS = 3


def modules():
    return [
        pytest.param(lambda: fp8train.Linear(256, 512, params_dtype=torch.bfloat16, device=DEVICE), 256, id="linear"),
        pytest.param(lambda: fp8train.LayerNormLinear(256, 512, params_dtype=torch.bfloat16, device=DEVICE), 256,
                     id="layernorm-linear"),
        pytest.param(lambda: fp8train.LayerNormMLP(256, 512, activation="gelu", params_dtype=torch.bfloat16,
                                                   device=DEVICE), 256, id="mlp-gelu"),
        pytest.param(lambda: fp8train.LayerNormMLP(256, 384, activation="swiglu", normalization="RMSNorm",
                                                   params_dtype=torch.bfloat16, device=DEVICE), 256,
                     id="mlp-swiglu-rms"),
    ]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=16), CurrentScaling()], ids=["delayed", "current"])
@pytest.mark.parametrize("make, k", modules())
def test_inductor_compiled_matches_eager(make, k, recipe):
    torch.manual_seed(0)
    module = make()
    eager = copy.deepcopy(module)
    compiled = torch.compile(module, fullgraph=True)  # Inductor
    code = []
    for step in range(STEPS):
        x = torch.randn(4, 48, k, device=DEVICE, dtype=torch.bfloat16)
        xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
        with fp8train.autocast(recipe=recipe):
            if step == 0:
                yc, code = run_and_get_code(compiled, xc)  # the generated code of the first compile
            else:
                yc = compiled(xc)
            ye = eager(xe)
        dy = torch.randn_like(ye)
        yc.backward(dy)
        ye.backward(dy)
        assert yc.dtype == ye.dtype == torch.bfloat16
        assert sqnr_db(yc, ye) >= 40, f"step {step}: output"
        if isinstance(module, fp8train.Linear):  # the cast and GEMM kernels of eager, nothing between
            assert torch.equal(yc, ye), f"step {step}: output"
        assert sqnr_db(xc.grad, xe.grad) >= 40, f"step {step}: input gradient"
        for (name, p), q in zip(module.named_parameters(), eager.parameters()):
            assert sqnr_db(p.grad, q.grad) >= 40, f"step {step}: {name}.grad"
        for (name, b), c in zip(module.named_buffers(), eager.buffers()):
            assert torch.allclose(b.float(), c.float(), rtol=1e-2, atol=0), f"step {step}: {name}"
    # The casts are eager's kernels, launched by Inductor; the fused norm / activation ones are custom ops.
    assert any("_tile_kernel" in c or "_flat_kernel" in c for c in code), "no cast kernel in Inductor's code"
    fused = not isinstance(module, fp8train.Linear)
    assert any("torch.ops.fp8train." in c for c in code) == fused


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_compiled_current_scaling_linear_is_eager_bit_for_bit(dtype):
    """Current scaling compiled (its per-row amaxes by torch ops in the graph,
    ops.graph_row_abs_max, reduced by the cast operator's kernel): a Linear's output and
    scaling state are eager's bit for bit (a max is exact in any order), with an amax far
    from the rest of x, its gradients within the module tests' 40 dB."""
    torch.manual_seed(0)
    module = fp8train.Linear(256, 512, params_dtype=torch.float32, device=DEVICE)
    eager = copy.deepcopy(module)
    compiled = torch.compile(module, fullgraph=True)
    recipe = CurrentScaling()
    for step in range(STEPS):
        x = torch.randn(4, 48, 256, device=DEVICE, dtype=dtype)
        x.view(-1)[:2] = torch.tensor([1e4, -3e-6], dtype=dtype)  # an amax far from the rest
        xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16), fp8train.autocast(recipe=recipe):
            yc = compiled(xc)
            ye = eager(xe)
        dy = torch.randn_like(ye)
        yc.backward(dy)
        ye.backward(dy)
        assert torch.equal(yc, ye), f"step {step}: output"
        assert sqnr_db(xc.grad, xe.grad) >= 40, f"step {step}: input gradient"
        for (name, p), q in zip(module.named_parameters(), eager.parameters()):
            assert sqnr_db(p.grad, q.grad) >= 40, f"step {step}: {name}.grad"
        for (name, b), c in zip(module.named_buffers(), eager.buffers()):  # the amaxes and scales: exact
            assert torch.equal(b, c), f"step {step}: {name}"
