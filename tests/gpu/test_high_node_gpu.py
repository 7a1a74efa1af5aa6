"""The high-precision C++ node (csrc/high_mlp.cpp) of LayerNormMLP and LayerNormLinear on the
GPU: the torch composition's bytes from the extension calls (cuBLAS picks kernels by operand
layout, so the backward's GEMMs must be issued as autograd issues them), and from the layers
where auto precision chose high precision, step after step, against the same layer outside
autocast (the composition itself); the cases the layers keep on the composition."""
from __future__ import annotations

import copy

import pytest
import torch

import fp8train
from fp8train import precision
from fp8train.kernels import native
from fp8train.modules import high_node
from tests.helpers import assert_bitwise, high_node_case, high_node_steps, own_precision_table

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
NODE = "fp8train::HighBackward"


@pytest.fixture
def high_table(tmp_path):
    """Auto precision pinned to high precision for every layer, on a table of this test's own."""
    with own_precision_table(CUDA, tmp_path / "table.json") as table:
        table.override("", precision.HIGH)
        yield table


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("shape", [(509, 256), (3, 171, 256), (4096, 1024)], ids=["odd-2d", "odd-3d", "4096x1024"])
@pytest.mark.parametrize("activation", [*high_node.ACTIVATION_CODES, None], ids=[*high_node.ACTIVATION_CODES, "ln-linear"])
def test_node_gives_the_composition_bytes(native_extension, activation, shape, dtype):
    torch.manual_seed(11)
    case = high_node_case(shape, 4 * shape[-1] if shape[-1] < 1024 else 4096, activation, True, dtype, CUDA)
    high_node_steps(native_extension, case, activation)


@pytest.mark.parametrize("needs", [(False, True, True, True, True, True, True), (True, False, False, False, False,
                                                                                 False, False),
                                   (False, False, False, False, False, True, True)], ids=["params", "x", "fc2"])
@pytest.mark.parametrize("activation", ["gelu_tanh", None], ids=["mlp", "ln-linear"])
def test_node_gives_only_the_gradients_asked_for(native_extension, needs, activation):
    torch.manual_seed(12)
    case = high_node_case((300, 128), 512, activation, False, torch.bfloat16, CUDA, needs=needs)
    high_node_steps(native_extension, case, activation)


LAYERS = {"mlp-gelu_tanh": lambda: fp8train.LayerNormMLP(256, 512, activation="gelu_tanh",
                                                          params_dtype=torch.bfloat16, device=CUDA),
          "mlp-swiglu": lambda: fp8train.LayerNormMLP(256, 512, activation="swiglu", params_dtype=torch.bfloat16,
                                                      device=CUDA),
          "ln-linear": lambda: fp8train.LayerNormLinear(256, 384, params_dtype=torch.bfloat16, device=CUDA)}


@pytest.mark.parametrize("kind", list(LAYERS))
@pytest.mark.parametrize("recipe", [fp8train.DelayedScaling, fp8train.CurrentScaling], ids=["delayed", "current"])
def test_layer_under_auto_high_precision_trains_as_the_composition(high_table, kind, recipe):
    """Three steps with an in-place update between them, 3-D input: the layer that chose high
    precision (the node) against its twin outside autocast (the torch composition)."""
    torch.manual_seed(13)
    auto = LAYERS[kind]()
    plain = copy.deepcopy(auto)
    out_features = 384 if kind == "ln-linear" else 256
    for step in range(3):
        x = torch.randn(2, 97, 256, device=CUDA, dtype=torch.bfloat16)
        dy = torch.randn(2, 97, out_features, device=CUDA, dtype=torch.bfloat16)
        outs = []
        for layer, region in ((auto, fp8train.autocast(recipe=recipe(auto_precision=True))),
                              (plain, fp8train.autocast(enabled=False))):
            xi = x.clone().requires_grad_(True)
            with region:
                y = layer(xi)
            y.backward(dy)
            outs.append((y, xi.grad, [p.grad.clone() for p in layer.parameters()]))
            with torch.no_grad():
                for p in layer.parameters():
                    p.sub_(0.01 * p.grad)
            layer.zero_grad(set_to_none=True)
        (y_got, dx_got, g_got), (y_want, dx_want, g_want) = outs
        assert y_got.grad_fn.name() == NODE
        assert y_want.grad_fn.name() != NODE
        assert_bitwise(y_got.detach(), y_want.detach(), f"step {step} output")
        assert_bitwise(dx_got, dx_want, f"step {step} dx")
        for i, (a, b) in enumerate(zip(g_got, g_want)):
            assert_bitwise(a, b, f"step {step} parameter {i}")
    assert "high" in precision.report(auto)


def test_layer_keeps_the_composition_where_the_node_does_not_apply(high_table):
    torch.manual_seed(14)
    recipe = fp8train.DelayedScaling(auto_precision=True)
    x = torch.randn(64, 128, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    cases = {
        "rmsnorm": (fp8train.LayerNormMLP(128, 256, normalization="RMSNorm", params_dtype=torch.bfloat16,
                                          device=CUDA), x),
        "4-d input": (fp8train.LayerNormMLP(128, 256, params_dtype=torch.bfloat16, device=CUDA), x.view(2, 2, 16, 128)),
        "fp32 params": (fp8train.LayerNormMLP(128, 256, params_dtype=torch.float32, device=CUDA), x),
    }
    for what, (layer, inp) in cases.items():
        with fp8train.autocast(recipe=recipe):
            y = layer(inp)
        assert y.grad_fn.name() != NODE, what
    cases = {
        "ln-linear parts": (fp8train.LayerNormLinear(128, (64, 64), params_dtype=torch.bfloat16, device=CUDA), x),
        "ln-linear returning its norm": (fp8train.LayerNormLinear(128, 64, return_layernorm_output=True,
                                                                  params_dtype=torch.bfloat16, device=CUDA), x),
        "ln-linear fp32 params": (fp8train.LayerNormLinear(128, 64, params_dtype=torch.float32, device=CUDA), x),
    }
    for what, (layer, inp) in cases.items():
        with fp8train.autocast(recipe=recipe):
            out = layer(inp)
        first = out[0] if isinstance(out, tuple) else out
        assert first.grad_fn.name() != NODE, what
    with fp8train.autocast(recipe=recipe):
        assert fp8train.LayerNormLinear(128, 64, params_dtype=torch.bfloat16, device=CUDA)(x).grad_fn.name() == NODE
    layer = fp8train.LayerNormMLP(128, 256, params_dtype=torch.bfloat16, device=CUDA)
    with fp8train.autocast(recipe=recipe):
        assert layer(x).grad_fn.name() == NODE
        with torch.autocast("cuda", dtype=torch.bfloat16):
            assert layer(x).grad_fn.name() != NODE, "torch.autocast"
        native.ENABLED = False
        try:
            assert layer(x).grad_fn.name() != NODE, "native.ENABLED off"
        finally:
            native.ENABLED = True
