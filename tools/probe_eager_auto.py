"""Probe (one GPU): why does an auto-precision step that chose high precision run slower than
the torch modules? benchmarks/small.py's eager step (loss and fused Adam eager) for
  bf16 eager        nn.Sequential(LayerNorm, Linear, GELU, Linear)
  fp8train high     fp8train.LayerNormMLP outside fp8train.autocast (its torch composition)
  fp8train auto     the same inside fp8train.autocast(DelayedScaling(auto_precision=True))
Prints wall time per step (median of interleaved rounds), host time to issue one step, the
cost of an empty autocast region, and each variant's ops per step (torch.profiler: CPU ops
with their counts, CUDA kernels), so a difference shows up as an op or a kernel.

    PYTHONPATH=. python3 tools/probe_eager_auto.py [--h 1024]
"""
import argparse
import os
import sys
import time

import torch

import fp8train

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from mlp import fp8_mlp, make_step, torch_mlp  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--h", type=int, default=1024)
p.add_argument("--tokens", type=int, default=4096)
args = p.parse_args()
dev = torch.device("cuda")
h, f = args.h, 4 * args.h
x = torch.randn(args.tokens, h, device=dev, dtype=torch.bfloat16)
target = torch.randn(args.tokens, h, device=dev)
auto = fp8train.DelayedScaling(auto_precision=True)
steps = {
    "bf16 eager": make_step(torch_mlp(h, f, torch.bfloat16, dev), x, target),
    "fp8train high": make_step(fp8_mlp(h, f, torch.bfloat16, dev), x, target),
    "fp8train auto": make_step(fp8_mlp(h, f, torch.bfloat16, dev), x, target, auto),
}
for step in steps.values():
    for _ in range(30):
        step()
torch.cuda.synchronize()

samples = {name: [] for name in steps}
host = {name: [] for name in steps}
for _ in range(7):
    for name, step in steps.items():
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(100):
            step()
        torch.cuda.synchronize()
        samples[name].append((time.perf_counter() - t) / 100 * 1e3)
        # host time to issue one step, the device idle first so nothing queues behind it
        torch.cuda.synchronize()
        t = time.perf_counter()
        step()
        host[name].append((time.perf_counter() - t) * 1e3)
        torch.cuda.synchronize()


def med(v):
    return sorted(v)[len(v) // 2]


for name in steps:
    print(f"{name:<16} wall {med(samples[name]):.3f} ms/step (min {min(samples[name]):.3f}, max "
          f"{max(samples[name]):.3f}); host to issue one step {med(host[name]):.3f} ms")

# the same steps timed as benchmarks/small.py times them (do_bench: L2 flush and events per
# call), three interleaved rounds
import triton.testing  # noqa: E402
bench = {name: [] for name in steps}
for _ in range(3):
    for name, step in steps.items():
        bench[name].append(triton.testing.do_bench(step, warmup=100, rep=300, return_mode="median"))
for name in steps:
    print(f"{name:<16} do_bench {med(bench[name]):.3f} ms/step (rounds {' '.join(f'{v:.3f}' for v in bench[name])})")

t = time.perf_counter()
for _ in range(1000):
    with fp8train.autocast(recipe=auto):
        pass
print(f"empty fp8train.autocast region: {(time.perf_counter() - t) * 1e3:.1f} us")

for name, step in steps.items():
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            step()
        torch.cuda.synchronize()
    print(f"--- {name}: 10 steps")
    print(prof.key_averages().table(sort_by="count", row_limit=40, max_name_column_width=55))
