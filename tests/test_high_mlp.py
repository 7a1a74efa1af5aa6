"""LayerNormMLP's high-precision C++ node (csrc/high_mlp.cpp) on the CPU: the torch
composition's bytes (output and every gradient) for each activation, with and without
biases, 2-D and 3-D input, float32 and bf16, any subset of inputs requiring grad; its autograd
contract (version counters, a second backward, double backward refused, no_grad); and which
calls the layer routes to it (modules/layernorm_mlp_high.py `takes`). The GPU half, and the
layer under auto precision, is tests/gpu/test_high_mlp_gpu.py."""
from __future__ import annotations

import pytest
import torch

import fp8train
from fp8train.kernels import native
from fp8train.modules import layernorm_mlp_high as mlp_high
from tests.helpers import high_mlp_case, high_mlp_steps

ACTS = list(mlp_high.ACTIVATION_CODES)


@pytest.fixture(scope="module")
def ext():
    e = native.extension()
    assert e is not None, f"the C++ extension did not build: {native.failure()}"
    return e


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(37, 48), (3, 13, 48)], ids=["2d", "3d"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("activation", ACTS)
def test_node_gives_the_composition_bytes(ext, activation, bias, shape, dtype):
    torch.manual_seed(hash((activation, bias, shape)) % 1000)
    case = high_mlp_case(shape, 80, activation, bias, dtype, "cpu")
    high_mlp_steps(ext, case, activation)


@pytest.mark.parametrize("needs", [(False, True, True, True, True, True, True), (True, False, False, False, False,
                                                                                 False, False),
                                   (False, False, False, True, False, False, False),
                                   (True, True, False, False, True, True, False)], ids=["params", "x", "w1", "mixed"])
def test_node_gives_only_the_gradients_asked_for(ext, needs):
    torch.manual_seed(3)
    case = high_mlp_case((29, 32), 64, "gelu_tanh", True, torch.float32, "cpu", needs=needs)
    high_mlp_steps(ext, case, "gelu_tanh")


def test_nonfinite_values_go_through_as_in_the_composition(ext):
    torch.manual_seed(4)
    case = high_mlp_case((16, 32), 64, "relu", True, torch.float32, "cpu")
    with torch.no_grad():
        case["x"][0, 0] = float("inf")
        case["x"][1, 3] = float("nan")
        case["x"][2] = 0.0
    high_mlp_steps(ext, case, "relu")


def test_autograd_contract(ext):
    torch.manual_seed(5)
    case = high_mlp_case((8, 32), 64, "gelu", True, torch.float32, "cpu")
    x, p = case["x"], case["params"]
    y = ext.high_mlp_forward(x, *p, 1e-5, mlp_high.ACTIVATION_CODES["gelu"])
    assert y.grad_fn.name() == "fp8train::HighMLPBackward"
    y.sum().backward(retain_graph=True)
    first = x.grad.clone()
    y.sum().backward()  # retained: the same gradient again
    torch.testing.assert_close(x.grad, 2 * first, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="second time"):
        y.sum().backward()
    y = ext.high_mlp_forward(x, *p, 1e-5, 0)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(y.sum(), x, create_graph=True)
    y = ext.high_mlp_forward(x, *p, 1e-5, 0)
    with torch.no_grad():
        p[2].add_(1.0)  # fc1's weight changed in place before the backward
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    with torch.no_grad():
        z = ext.high_mlp_forward(x, *p, 1e-5, 0)
    assert z.grad_fn is None and not z.requires_grad
    with pytest.raises(RuntimeError, match="2-D or 3-D"):
        ext.high_mlp_forward(x.view(2, 2, 2, 32), *p, 1e-5, 0)
    with pytest.raises(RuntimeError, match="bad activation code"):
        ext.high_mlp_forward(x, *p, 1e-5, 9)


def test_which_calls_the_layer_routes_to_the_node():
    layer = fp8train.LayerNormMLP(32, 64, activation="gelu_tanh", params_dtype=torch.bfloat16)
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    assert mlp_high.takes(layer, x, torch.bfloat16)
    assert mlp_high.takes(layer, x.view(2, 2, 32), torch.bfloat16)
    assert not mlp_high.takes(layer, x.view(2, 2, 1, 32), torch.bfloat16)  # 4-D: F.linear adds the bias apart
    assert not mlp_high.takes(layer, x.float(), torch.float32)  # the composition would cast the parameters
    assert not mlp_high.takes(layer, x, torch.float16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not mlp_high.takes(layer, x, torch.bfloat16)
    rms = fp8train.LayerNormMLP(32, 64, normalization="RMSNorm", params_dtype=torch.bfloat16)
    assert not mlp_high.takes(rms, x, torch.bfloat16)
    assert mlp_high.forward(layer, x, torch.bfloat16) is None  # CPU layers never take the extension


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_high_path_norm_of_mixed_dtypes_is_computed_wide_and_rounded_once(normalization):
    """Float32 master weights with bf16 activations (torch's CUDA norms refuse the mix): the
    norm runs in float32 and is rounded once to x's dtype, within half a bf16 ulp of float64
    plus float32's own error; one dtype is exactly norm_high_precision."""
    from fp8train.modules.norm import norm_high_precision, norm_high_precision_in
    torch.manual_seed(6)
    x = (torch.randn(41, 96) * 3 + 1).to(torch.bfloat16)
    w, b = torch.randn(96) * 0.5 + 1, (torch.randn(96) if normalization == "LayerNorm" else None)
    got = norm_high_precision_in(x, w, b, normalization, 1e-5)
    assert got.dtype == torch.bfloat16
    ref = norm_high_precision(x.double(), w.double(), None if b is None else b.double(), normalization, 1e-5)
    ulp = torch.finfo(torch.bfloat16).eps * ref.abs().clamp_min(2.0 ** -126)
    assert ((got.double() - ref).abs() <= 0.5 * ulp + 1e-5 * ref.abs().clamp_min(1.0)).all()
    same = x.float()
    torch.testing.assert_close(norm_high_precision_in(same, w, b, normalization, 1e-5),
                               norm_high_precision(same, w, b, normalization, 1e-5), rtol=0, atol=0)
