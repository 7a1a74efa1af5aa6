"""Where the host time of one LayerNormMLP fwd+bwd goes (GPU machine): host us/iter of the
torch modules (LayerNorm, Linear, GELU(tanh), Linear; bf16) and of fp8train.LayerNormMLP
under delayed scaling (autocast entry included): through its C++ node (the default), through
the Python Function with the norm and activation launches replayed from C++
(kernels/replay.py; layernorm_mlp_native.ENABLED off) and all through Python
(native.ENABLED off), and through the node with its GEMMs on at::_scaled_mm (native.set_lt_gemm);
the device kernels each launches per iteration, and a cProfile of the
default one (by own time, then by cumulative time).

    PYTHONPATH=. python3 tools/host_profile_mlp.py [--h 1024] [--tokens 256]
"""
import argparse
import cProfile
import pstats
import sys
import time

import torch

import fp8train
from fp8train.kernels import native
from fp8train.modules import layernorm_mlp_native

p = argparse.ArgumentParser()
p.add_argument("--h", type=int, default=1024)
p.add_argument("--tokens", type=int, default=256)
args = p.parse_args()
dev = torch.device("cuda")
h, f = args.h, 4 * args.h
x = torch.randn(args.tokens, h, device=dev, dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn(args.tokens, h, device=dev, dtype=torch.bfloat16)


def make(kind):
    if kind == "bf16":
        model = torch.nn.Sequential(torch.nn.LayerNorm(h), torch.nn.Linear(h, f), torch.nn.GELU("tanh"),
                                    torch.nn.Linear(f, h)).to(dev, torch.bfloat16)
        return lambda: model(x).backward(dy)
    model = fp8train.LayerNormMLP(h, f, activation="gelu_tanh", params_dtype=torch.bfloat16, device=dev)
    recipe = fp8train.DelayedScaling()
    launches, node = kind != "fp8 delayed, python launches", kind.startswith("fp8 delayed") and "," not in kind
    lt = kind != "fp8 delayed (_scaled_mm)"

    def run():
        native.ENABLED, layernorm_mlp_native.ENABLED = launches, node
        native.set_lt_gemm(lt)
        try:
            with fp8train.autocast(recipe=recipe):
                y = model(x)
            y.backward(dy)
        finally:
            native.ENABLED = layernorm_mlp_native.ENABLED = True
            native.set_lt_gemm(True)
    return run


for kind in ("bf16", "fp8 delayed", "fp8 delayed (_scaled_mm)", "fp8 delayed, launch groups",
             "fp8 delayed, python launches"):
    run = make(kind)
    for _ in range(30):
        run()
    samples = []
    for _ in range(5):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(200):
            run()
        samples.append((time.perf_counter() - t) / 200 * 1e6)
        torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            run()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    print(f"\n== {kind}: host {sorted(samples)[2]:.1f} us/iter (median of 5), {len(kernels) / 10:.1f} device "
          "kernels/iter")
    names = {}
    for e in kernels:
        names[e.name[:90]] = names.get(e.name[:90], 0) + 1
    for n, c in sorted(names.items(), key=lambda kv: -kv[1]):
        print(f"   {c / 10:4.1f}x {n}")
    if kind == "fp8 delayed":
        prof_c = cProfile.Profile()
        prof_c.enable()
        for _ in range(100):
            run()
        prof_c.disable()
        stats = pstats.Stats(prof_c, stream=sys.stdout)
        stats.sort_stats("tottime").print_stats(30)
        stats.sort_stats("cumtime").print_stats(30)
