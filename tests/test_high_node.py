"""The high-precision C++ node (csrc/high_mlp.cpp) of LayerNormMLP and LayerNormLinear on the
CPU: the torch composition's bytes (output and every gradient) for each activation and for
the norm and Linear alone, with and without biases, 2-D and 3-D input, float32 and bf16, any
subset of inputs requiring grad; its autograd contract (version counters, a second backward,
double backward refused, no_grad); and which calls the layers route to it
(modules/high_node.py `takes`). The GPU half, and the layers under auto precision, is
tests/gpu/test_high_node_gpu.py."""
from __future__ import annotations

import pytest
import torch

import fp8train
from fp8train.kernels import native
from fp8train.modules import high_node
from tests.helpers import high_node_case, high_node_steps

ACTS = [*high_node.ACTIVATION_CODES, None]  # None: LayerNormLinear (the norm, then one Linear)


@pytest.fixture(scope="module")
def ext():
    e = native.extension()
    assert e is not None, f"the C++ extension did not build: {native.failure()}"
    return e


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(37, 48), (3, 13, 48)], ids=["2d", "3d"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("activation", ACTS, ids=[*high_node.ACTIVATION_CODES, "ln-linear"])
def test_node_gives_the_composition_bytes(ext, activation, bias, shape, dtype):
    torch.manual_seed(hash((activation, bias, shape)) % 1000)
    case = high_node_case(shape, 80, activation, bias, dtype, "cpu")
    high_node_steps(ext, case, activation)


@pytest.mark.parametrize("needs", [(False, True, True, True, True, True, True), (True, False, False, False, False,
                                                                                 False, False),
                                   (False, False, False, True, False, False, False),
                                   (True, True, False, False, True, True, False)], ids=["params", "x", "w1", "mixed"])
@pytest.mark.parametrize("activation", ["gelu_tanh", None], ids=["mlp", "ln-linear"])
def test_node_gives_only_the_gradients_asked_for(ext, needs, activation):
    torch.manual_seed(3)
    case = high_node_case((29, 32), 64, activation, True, torch.float32, "cpu", needs=needs)
    high_node_steps(ext, case, activation)


def test_nonfinite_values_go_through_as_in_the_composition(ext):
    torch.manual_seed(4)
    case = high_node_case((16, 32), 64, "relu", True, torch.float32, "cpu")
    with torch.no_grad():
        case["x"][0, 0] = float("inf")
        case["x"][1, 3] = float("nan")
        case["x"][2] = 0.0
    high_node_steps(ext, case, "relu")


def test_autograd_contract(ext):
    torch.manual_seed(5)
    case = high_node_case((8, 32), 64, "gelu", True, torch.float32, "cpu")
    x, p = case["x"], case["params"]
    y = ext.high_mlp_forward(x, *p, 1e-5, high_node.ACTIVATION_CODES["gelu"])
    assert y.grad_fn.name() == "fp8train::HighBackward"
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
    for code in (9, -1):  # -1 is the node's own LayerNormLinear mode
        with pytest.raises(RuntimeError, match="bad activation code"):
            ext.high_mlp_forward(x, *p, 1e-5, code)


def test_which_calls_the_layer_routes_to_the_node():
    layer = fp8train.LayerNormMLP(32, 64, activation="gelu_tanh", params_dtype=torch.bfloat16)
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    assert high_node.takes(layer, x, torch.bfloat16)
    assert high_node.takes(layer, x.view(2, 2, 32), torch.bfloat16)
    assert not high_node.takes(layer, x.view(2, 2, 1, 32), torch.bfloat16)  # 4-D: F.linear adds the bias apart
    assert not high_node.takes(layer, x.float(), torch.float32)  # the composition would cast the parameters
    assert not high_node.takes(layer, x, torch.float16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not high_node.takes(layer, x, torch.bfloat16)
    rms = fp8train.LayerNormMLP(32, 64, normalization="RMSNorm", params_dtype=torch.bfloat16)
    assert not high_node.takes(rms, x, torch.bfloat16)
    assert high_node.forward(layer, x, torch.bfloat16) is None  # CPU layers never take the extension
    ln_linear = fp8train.LayerNormLinear(32, 48, params_dtype=torch.bfloat16)
    assert high_node.takes(ln_linear, x, torch.bfloat16)
    assert not high_node.takes(fp8train.LayerNormLinear(32, (16, 16, 16), params_dtype=torch.bfloat16), x,
                               torch.bfloat16)  # output parts: one F.linear per part
    assert not high_node.takes(fp8train.LayerNormLinear(32, 48, return_layernorm_output=True,
                                                        params_dtype=torch.bfloat16), x, torch.bfloat16)
    assert high_node.forward(ln_linear, x, torch.bfloat16) is None


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
