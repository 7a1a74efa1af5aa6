"""Probe (one GPU): where the host time of a graphed small MLP step goes, BF16
(torch.cuda.make_graphed_callables) against fp8train (fp8train.make_graphed_callables):
wall time per step (median of interleaved rounds), a cProfile of each step's Python (top
functions by own time), and the FP8 step's CUDA runtime calls (torch.profiler).
The step is benchmarks/small.py's (loss and fused Adam eager).

    PYTHONPATH=. python3 tools/probe_graphed_host.py [--h 1024]
"""
import argparse
import cProfile
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from small import graphed_bf16, graphed_fp8  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--h", type=int, default=1024)
p.add_argument("--tokens", type=int, default=4096)
args = p.parse_args()
dev = torch.device("cuda")
x = torch.randn(args.tokens, args.h, device=dev, dtype=torch.bfloat16)
target = torch.randn(args.tokens, args.h, device=dev)
steps = {name: build(args.h, 4 * args.h, dev, x, target) for name, build in
         (("bf16 graphed", graphed_bf16), ("fp8train graphed", graphed_fp8))}
for step, _ in steps.values():
    for _ in range(20):
        step()
# This host's time per step moves by +-20% between runs: interleaved rounds, medians.
samples = {name: [] for name in steps}
for _ in range(7):
    for name, (step, _) in steps.items():
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(100):
            step()
        torch.cuda.synchronize()
        samples[name].append((time.perf_counter() - t) / 100 * 1e3)
for name, v in samples.items():
    print(f"{name}: wall {sorted(v)[len(v) // 2]:.3f} ms per step (median of 7 rounds; "
          f"min {min(v):.3f}, max {max(v):.3f})")
for name, (step, _) in steps.items():
    print(f"--- {name}: cProfile of 100 steps")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(100):
        step()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)
del steps

# Does the host wait on the device somewhere in the FP8 step (a synchronize, a blocking copy)?
# The CUDA runtime calls of a few steps, by their own host time.
step, model = graphed_fp8(args.h, 4 * args.h, dev, x, target)
for _ in range(10):
    step()
torch.cuda.synchronize()
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
    for _ in range(20):
        step()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=16, max_name_column_width=60))
