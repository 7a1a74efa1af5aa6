"""Which op of a backward pass breaks CUDA graph capture? One small capture per suspect."""
import torch

import fp8train
from fp8train import kernels

dev = torch.device("cuda")


class TritonInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        a = torch.zeros((), device=g.device)
        kernels.amax(g, a)
        return g * a


class ScaledMmInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        q = fp8train.quantize(g.detach().contiguous())
        w = fp8train.quantize(torch.ones(64, 64, device=g.device))
        return torch._scaled_mm(q.fp8_data, w.fp8_data.t(), q.scale_inv, w.scale_inv, out_dtype=g.dtype)


def linear_step(recipe):
    layer = fp8train.Linear(64, 64, device=dev)

    def fn(x):
        with fp8train.autocast(recipe=recipe):
            y = layer(x, is_first_microbatch=False)
        return y
    return fn


def attempt(name, fn, mode="global"):
    x = torch.randn(32, 64, device=dev, requires_grad=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(side):
            for _ in range(3):
                fn(x).sum().backward()
    except Exception as e:  # noqa: BLE001
        print(f"FAIL {name}: warm-up: {str(e).splitlines()[0][:150]}")
        return
    torch.cuda.current_stream().wait_stream(side)
    x.grad = None
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g, capture_error_mode=mode):
            fn(x).sum().backward()
        g.replay()
        torch.cuda.synchronize()
        print(f"OK   {name} [{mode}]")
    except Exception as e:  # noqa: BLE001
        print(f"FAIL {name} [{mode}]: {str(e).splitlines()[0][:150]}")
        torch.cuda.synchronize()


GRAD_Q = fp8train.CurrentScalingQuantizer(fp8train.TensorRole.GRAD_OUTPUT, torch.float8_e5m2, device=dev)


class CastInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        q = GRAD_Q.quantize(g.contiguous(), transpose=True)
        return q.dequantize(g.dtype)


import sys  # noqa: E402

if len(sys.argv) == 1:
  for mode in ("global", "thread_local", "relaxed"):
    attempt("current-scaling cast in backward", CastInBackward.apply, mode)
    attempt("triton kernel in backward", TritonInBackward.apply, mode)
    attempt("quantize + _scaled_mm in backward", ScaledMmInBackward.apply, mode)
    attempt("forward only Linear current", lambda x, f=linear_step(fp8train.CurrentScaling()): f(x.detach()) * x, mode)
    attempt("Linear fwd+bwd current", linear_step(fp8train.CurrentScaling()), mode)
    attempt("Linear fwd+bwd delayed", linear_step(fp8train.DelayedScaling()), mode)


def original_test_pattern(recipe, backward_with_grad, eager_on_default):
    """The first version of the graph test: which of its differences breaks capture?"""
    layer = fp8train.Linear(256, 512, device=dev)
    x = torch.randn(3, 40, 256, device=dev, requires_grad=True)
    dy = torch.randn(3, 40, 512, device=dev)

    def step(first=False):
        with fp8train.autocast(recipe=recipe):
            y = layer(x, is_first_microbatch=first)
        if backward_with_grad:
            y.backward(dy)
        else:
            (y * dy).sum().backward()
        return y

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(first=True)
        step()
    torch.cuda.current_stream().wait_stream(side)
    if eager_on_default:
        step()
    x.grad = layer.weight.grad = layer.bias.grad = None
    g = torch.cuda.CUDAGraph()
    name = f"pattern grad={backward_with_grad} eager_default={eager_on_default}"
    try:
        with torch.cuda.graph(g):
            step()
        g.replay()
        torch.cuda.synchronize()
        print(f"OK   {name}")
    except Exception as e:  # noqa: BLE001
        print(f"FAIL {name}: {str(e).splitlines()[0][:120]}")


if len(sys.argv) == 3:  # one pattern per process: a failed capture poisons the process
    original_test_pattern(fp8train.CurrentScaling(), sys.argv[1] == "1", sys.argv[2] == "1")
