"""Probe (one GPU): host time of one LayerNormMLP fwd+bwd in high precision, the torch
composition (nn.LayerNorm, nn.Linear, nn.GELU, nn.Linear modules) against fp8train's C++ node
(csrc/high_mlp.cpp, what a layer that auto precision kept out of FP8 runs), interleaved
rounds, medians; and the whole eager training step of benchmarks/small.py both ways.

    PYTHONPATH=.:benchmarks python3 tools/probe_high_mlp.py [--h 1024] [--tokens 256]
"""
import argparse
import statistics
import time

import torch

import fp8train
from fp8train import precision
from mlp import fp8_mlp, make_step, torch_mlp

p = argparse.ArgumentParser()
p.add_argument("--h", type=int, default=1024)
p.add_argument("--tokens", type=int, default=256)
p.add_argument("--step-tokens", type=int, default=4096)
args = p.parse_args()
dev = torch.device("cuda")
h, f = args.h, 4 * args.h
table = precision.PrecisionTable(precision.device_name(dev))
precision.use_table(table)
table.override("", precision.HIGH)
recipe = fp8train.DelayedScaling(auto_precision=True)


def fwd_bwd(model, x, dy, region):
    def run():
        with region():
            y = model(x)
        y.backward(dy)
    return run


def host_us(fn, iters=50):
    """us per call, calls back to back: at 256 tokens the device's share (~50 us) is far below
    the host's, so this is the host's time per call."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e6 / iters


x = torch.randn(args.tokens, h, device=dev, dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn(args.tokens, h, device=dev, dtype=torch.bfloat16)
calls = {"torch modules": fwd_bwd(torch_mlp(h, f, torch.bfloat16, dev), x, dy, lambda: fp8train.autocast(enabled=False)),
         "fp8train high (node)": fwd_bwd(fp8_mlp(h, f, torch.bfloat16, dev), x, dy,
                                         lambda: fp8train.autocast(recipe=recipe))}
for fn in calls.values():
    for _ in range(10):
        fn()
host = {k: [] for k in calls}
for _ in range(9):
    for k, fn in calls.items():
        host[k].append(host_us(fn))
base = statistics.median(host["torch modules"])
print(f"host time per fwd+bwd, h {h}, {args.tokens} tokens (median of 9 interleaved rounds):")
for k, v in host.items():
    print(f"  {k:<22} {statistics.median(v):8.1f} us {statistics.median(v) / base:6.2f}x")

xs = torch.randn(args.step_tokens, h, device=dev, dtype=torch.bfloat16)
target = torch.randn(args.step_tokens, h, device=dev)
steps = {"bf16 eager": make_step(torch_mlp(h, f, torch.bfloat16, dev), xs, target),
         "fp8train auto, high": make_step(fp8_mlp(h, f, torch.bfloat16, dev), xs, target, recipe)}
wall = {k: [] for k in steps}
for fn in steps.values():
    for _ in range(20):
        fn()
for _ in range(9):
    for k, fn in steps.items():
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        wall[k].append((time.perf_counter() - t) * 1e3 / 50)
base = statistics.median(wall["bf16 eager"])
print(f"eager training step, h {h}, {args.step_tokens} tokens (median of 9 interleaved rounds of 50 steps):")
for k, v in wall.items():
    ratios = [a / b for a, b in zip(v, wall["bf16 eager"])]
    print(f"  {k:<22} {statistics.median(v):8.3f} ms {statistics.median(v) / base:6.2f}x "
          f"(paired {statistics.median(ratios):.2f}x)")
