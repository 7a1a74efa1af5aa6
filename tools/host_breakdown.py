"""Inclusive host time of each stage of an FP8 Linear fwd+bwd, measured inside the real loop
(GPU machine): wraps the stages with perf_counter, runs the loop, prints us per iteration.
Unlike cProfile it adds ~0.2 us per wrapped call, so small Python functions are not inflated."""
import collections
import sys
import time

import torch

import fp8train
from fp8train import gemm, kernels, quantizer
from fp8train.kernels import cast, launcher
from fp8train.modules import base, linear, weight_workspace

TOTALS = collections.Counter()
autocast_mod = sys.modules["fp8train.autocast"]


def wrap(owner, name, label=None):
    fn = getattr(owner, name)
    label = label or f"{getattr(owner, '__name__', owner)}.{name}"

    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            TOTALS[label] += time.perf_counter() - t
    setattr(owner, name, timed)


dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
x = torch.randn(256, 1024, device=dev, dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn(256, 1024, device=dev, dtype=torch.bfloat16)
kind = sys.argv[1] if len(sys.argv) > 1 else "delayed"
layer = fp8train.Linear(1024, 1024, device=dev, params_dtype=torch.bfloat16)
recipe = fp8train.DelayedScaling() if kind == "delayed" else fp8train.CurrentScaling()


def run():
    with fp8train.autocast(recipe=recipe):
        y = layer(x)
    y.backward(dy)


for _ in range(50):
    run()
for owner, name in [(torch, "_scaled_mm"), (torch, "empty"), (launcher.DirectKernel, "__call__"),
                    (cast, "_launch"), (kernels, "cast_trusted"), (quantizer.Quantizer, "cast"),
                    (quantizer.Quantizer, "quantize"), (autocast_mod, "update_delayed_scales"),
                    (linear._LinearFn, "forward"), (linear._LinearFn, "backward"), (linear.Linear, "forward"),
                    (weight_workspace.WeightWorkspace, "get"), (gemm, "scaled_mm"), (linear, "_native_forward"),
                    (quantizer.Quantizer, "requantize"), (quantizer.Quantizer, "native_plan"),
                    (base.FP8Module, "fp8_plan"), (base.FP8Module, "quantizers"), (cast.PreparedCast, "__call__"),
                    (autocast_mod.autocast, "__enter__"), (autocast_mod.autocast, "__exit__")]:
    wrap(owner, name)
n = 500
torch.cuda.synchronize() if dev.type == "cuda" else None
t0 = time.perf_counter()
for _ in range(n):
    with fp8train.autocast(recipe=recipe):
        t1 = time.perf_counter()
        y = layer(x)
        TOTALS["(fwd: layer(x) call)"] += time.perf_counter() - t1
    t1 = time.perf_counter()
    y.backward(dy)
    TOTALS["(bwd: y.backward)"] += time.perf_counter() - t1
total = (time.perf_counter() - t0) / n * 1e6
torch.cuda.synchronize() if dev.type == "cuda" else None
print(f"{kind}: {total:.1f} us per fwd+bwd (wrapped)")
for label, secs in TOTALS.most_common():
    print(f"  {label:<48} {secs / n * 1e6:8.1f} us/iter")

ref = torch.nn.Linear(1024, 1024, device=dev, dtype=torch.bfloat16)
for _ in range(50):
    ref(x).backward(dy)
torch.cuda.synchronize() if dev.type == "cuda" else None
t0 = time.perf_counter()
for _ in range(n):
    ref(x).backward(dy)
print(f"nn.Linear bf16: {(time.perf_counter() - t0) / n * 1e6:.1f} us per fwd+bwd")

# Is the loop host-bound? Device time of the same fwd+bwd, from the kernels the profiler saw.
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    for _ in range(20):
        run()
    torch.cuda.synchronize()
gpu_us = sum(e.device_time_total for e in prof.key_averages()) / 20
print(f"device time of the FP8 fwd+bwd: {gpu_us:.1f} us per iteration (summed kernel time)")


# The cost of a Python autograd.Function itself: the same two launches (a multiply forward,
# a multiply backward) through a C++ node and through a Python node.
class _Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        return t * 2.0

    @staticmethod
    def backward(ctx, g):
        return g * 2.0


def host_loop(fn, n=1000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return us


print(f"C++ node  (t * 2).backward:        {host_loop(lambda: (x * 2.0).backward(dy)):.1f} us")
print(f"Python node _Scale.apply.backward: {host_loop(lambda: _Scale.apply(x).backward(dy)):.1f} us")
