"""Probe (one GPU): why does a graphed fp8train MLP step cost more host time than a graphed
BF16 one, although its device time is lower? (benchmarks/small.py: the fastest graphed
rounds at h=1024 were ~0.3 ms apart.)

For the graphed forward+backward of benchmarks/small.py (no loss, no Adam: y.backward(dy)),
BF16 (torch.cuda.make_graphed_callables) and fp8train (fp8train.make_graphed_callables):
  * host us per iteration (issued without a sync; the device work is shorter), medians of
    interleaved rounds;
  * the CUDA runtime calls per iteration and their mean host time (torch.profiler), so a
    slow cudaGraphLaunch or an extra memcpy shows by name;
  * the node types of one capture of the same forward+backward (CUDAGraph debug dump):
    kernels, memsets, memcpys, others.

    PYTHONPATH=.:benchmarks python3 tools/probe_graph_launch.py [--h 1024]
"""
import argparse
import collections
import os
import re
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import fp8train  # noqa: E402
from mlp import fp8_mlp, torch_mlp  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--h", type=int, default=1024)
p.add_argument("--tokens", type=int, default=4096)
args = p.parse_args()
dev = torch.device("cuda")
h, f = args.h, 4 * args.h
x = torch.randn(args.tokens, h, device=dev, dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn(args.tokens, h, device=dev, dtype=torch.bfloat16)
recipe = fp8train.DelayedScaling()

bf16 = torch_mlp(h, f, torch.bfloat16, dev)
bf16_graphed = torch.cuda.make_graphed_callables(bf16, (x.detach().clone().requires_grad_(True),))
fp8 = fp8_mlp(h, f, torch.bfloat16, dev)
with fp8train.autocast(recipe=recipe):
    y = fp8(x)
y.backward(dy)
fp8train.make_graphed_callables(fp8, (x.detach().clone().requires_grad_(True),), recipe=recipe)
runs = {"bf16 graphed": lambda: bf16_graphed(x).backward(dy), "fp8train graphed": lambda: fp8(x).backward(dy)}
for run in runs.values():
    for _ in range(20):
        run()
torch.cuda.synchronize()

host = {name: [] for name in runs}
for _ in range(7):
    for name, run in runs.items():
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(50):
            run()
        host[name].append((time.perf_counter() - t) / 50 * 1e6)
        torch.cuda.synchronize()
print(f"\nhost us per graphed fwd+bwd (h={h}, {args.tokens} tokens; medians of 7 rounds of 50)")
for name, v in host.items():
    print(f"  {name:<18} {statistics.median(v):8.1f} us   rounds {' '.join(f'{s:.0f}' for s in v)}")

for name, run in runs.items():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(20):
            run()
        torch.cuda.synchronize()
    calls = collections.defaultdict(list)
    for e in prof.events():
        if e.name.startswith("cuda") or e.name.startswith("cu"):
            calls[e.name].append(e.cpu_time_total)
    print(f"\n{name}: CUDA runtime calls per iteration (mean host us each)")
    for call, ts in sorted(calls.items(), key=lambda kv: -sum(kv[1])):
        print(f"  {len(ts) / 20:5.1f}x {call:<34} {statistics.mean(ts):7.1f} us")


def node_types(step) -> collections.Counter:
    """Node types of one capture of `step`, from the CUDAGraph's debug dump (DOT)."""
    g = torch.cuda.CUDAGraph()
    g.enable_debug_mode()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(g):
        step()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "graph.dot")
        g.debug_dump(path)
        text = open(path).read()
    counts = collections.Counter()
    for kind in re.findall(r"\b(KERNEL|MEMSET|MEMCPY|HOST|EVENT_RECORD|WAIT_EVENT|EMPTY|GRAPH|MEM_ALLOC|MEM_FREE)\b",
                           text):
        counts[kind] += 1
    return counts


captures = {"bf16": lambda: bf16(x).backward(dy)}


def fp8_step():
    with fp8train.autocast(recipe=recipe):
        y = fp8_mlp_eager(x)
    y.backward(dy)


fp8_mlp_eager = fp8_mlp(h, f, torch.bfloat16, dev)
fp8_step()
captures["fp8train"] = fp8_step
print("\nnode types of one captured fwd+bwd (torch.cuda.graph, debug dump):")
for name, step in captures.items():
    try:
        print(f"  {name:<10} {dict(node_types(step))}")
    except Exception as e:  # the dump needs a CUDA build with graph debug support
        print(f"  {name:<10} not available: {type(e).__name__}: {str(e)[:120]}")
