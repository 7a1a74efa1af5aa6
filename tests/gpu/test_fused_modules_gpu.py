"""LayerNormLinear / LayerNormMLP on the GPU: forward + backward captured in a CUDA graph and
replayed equal the eager steps bit for bit (outputs, every gradient, the scaling state).
(The device-parametrised accuracy tests of tests/test_fused_modules.py also run here.)"""
import pytest
import torch

import fp8train
from fp8train import CurrentScaling, DelayedScaling

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def modules():
    return [
        pytest.param(lambda: fp8train.LayerNormLinear(256, 512, device=CUDA), 256, 512, id="layernorm-linear"),
        pytest.param(lambda: fp8train.LayerNormMLP(256, 512, activation="gelu_tanh", device=CUDA), 256, 256,
                     id="mlp-gelu-tanh"),
        pytest.param(lambda: fp8train.LayerNormMLP(256, 384, activation="swiglu", normalization="RMSNorm",
                                                   device=CUDA), 256, 256, id="mlp-swiglu-rms"),
    ]


@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=16), CurrentScaling()], ids=["delayed", "current"])
@pytest.mark.parametrize("make, k, n", modules())
def test_fwd_bwd_replays_in_a_cuda_graph(make, k, n, recipe):
    torch.manual_seed(0)
    layer = make()
    static_x = torch.randn(3, 40, k, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    static_dy = torch.randn(3, 40, n, device=CUDA, dtype=torch.bfloat16)
    inputs = [(torch.randn_like(static_x), torch.randn_like(static_dy)) for _ in range(3)]
    params = list(layer.parameters())

    def step(first=False):
        with fp8train.autocast(recipe=recipe):
            y = layer(static_x, is_first_microbatch=first)
        (y * static_dy).sum().backward()  # dL/dy == static_dy
        return y

    def grads():
        return [static_x.grad.clone()] + [p.grad.clone() for p in params]

    def clear():
        static_x.grad = None
        for p in params:
            p.grad = None

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(first=True)
        for _ in range(2):
            step()
        snapshot = {key: v.clone() for key, v in layer.state_dict().items()}
        eager = []
        for x, dy in inputs:
            clear()
            static_x.data.copy_(x)
            static_dy.copy_(dy)
            y = step()
            eager.append((y.clone(), grads(), {key: v.clone() for key, v in layer.state_dict().items()}))
        layer.load_state_dict(snapshot)
        clear()
    torch.cuda.current_stream().wait_stream(side)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = step()
    for (x, dy), (y, g, state) in zip(inputs, eager):
        static_x.data.copy_(x)
        static_dy.copy_(dy)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_y, y)
        for got, want in zip(grads(), g):
            assert torch.equal(got, want)
        for key, value in layer.state_dict().items():
            assert torch.equal(value, state[key]), key
