"""Where the host time of one FP8 Linear fwd+bwd goes (GPU machine): us/iter, cProfile top
functions, and the device kernels launched per iteration."""
import cProfile
import pstats
import sys
import time

import torch

import fp8train

dev = torch.device("cuda")
x = torch.randn(256, 1024, device=dev, dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn(256, 1024, device=dev, dtype=torch.bfloat16)


def make(kind):
    if kind == "bf16":
        layer = torch.nn.Linear(1024, 1024, device=dev, dtype=torch.bfloat16)
        return lambda: layer(x).backward(dy)
    layer = fp8train.Linear(1024, 1024, device=dev, params_dtype=torch.bfloat16)
    recipe = fp8train.DelayedScaling() if kind == "delayed" else fp8train.CurrentScaling()

    def run():
        with fp8train.autocast(recipe=recipe):
            y = layer(x)
        y.backward(dy)
    return run


for kind in ("bf16", "delayed", "current"):
    run = make(kind)
    for _ in range(30):
        run()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(200):
        run()
    host = (time.perf_counter() - t) / 200 * 1e6
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            run()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    print(f"\n== {kind}: host {host:.1f} us/iter, {len(kernels) / 10:.1f} device kernels/iter")
    names = {}
    for e in kernels:
        names[e.name[:90]] = names.get(e.name[:90], 0) + 1
    for n, c in sorted(names.items(), key=lambda kv: -kv[1]):
        print(f"   {c / 10:4.1f}x {n}")
    if kind != "bf16":
        prof_c = cProfile.Profile()
        prof_c.enable()
        for _ in range(100):
            run()
        prof_c.disable()
        pstats.Stats(prof_c, stream=sys.stdout).sort_stats("tottime").print_stats(22)
