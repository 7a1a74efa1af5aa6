"""Probe (GPU machine): how much of a small layer's fwd+bwd host time is Python's cyclic
garbage collector, for nn.Linear and fp8train.Linear (delayed, C++ node)?

Per kind, interleaved rounds of 300 fwd+bwd of benchmarks/linear.py's host_time layer
(1024 x 1024, 256 tokens): host us per iteration, collections per 1000 iterations by
generation and the time spent inside them (gc.callbacks), first with the collector as it
is, then after gc.freeze() (everything alive moves to the permanent generation, so a full
collection no longer walks torch's and the benchmark's objects), then with gc disabled.

    PYTHONPATH=.:benchmarks python3 tools/probe_gc.py
"""
import gc
import statistics
import sys
import time

import torch

sys.path.insert(0, "benchmarks")
from linear import fwd_bwd_fn, make  # noqa: E402

dev = torch.device("cuda")
ITERS, ROUNDS = 300, 5
x = torch.randn(256, 1024, device=dev, dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn(256, 1024, device=dev, dtype=torch.bfloat16)
runs = {kind: fwd_bwd_fn(*make(kind, 1024, 1024, dev), x, dy) for kind in ("bf16", "fp8 delayed")}
for run in runs.values():
    for _ in range(20):
        run()

gc_time = [0.0]
gc_counts = [0, 0, 0]
_start = [0.0]


def on_gc(phase, info):
    if phase == "start":
        _start[0] = time.perf_counter()
    else:
        gc_time[0] += time.perf_counter() - _start[0]
        gc_counts[info["generation"]] += 1


gc.callbacks.append(on_gc)


def measure(label):
    host = {k: [] for k in runs}
    spent = {k: [] for k in runs}
    counts = {k: [0, 0, 0] for k in runs}
    for _ in range(ROUNDS):
        for kind, run in runs.items():
            torch.cuda.synchronize()
            gc_time[0] = 0.0
            before = list(gc_counts)
            t0 = time.perf_counter()
            for _ in range(ITERS):
                run()
            host[kind].append((time.perf_counter() - t0) / ITERS * 1e6)
            torch.cuda.synchronize()
            spent[kind].append(gc_time[0] / ITERS * 1e6)
            counts[kind] = [c + a - b for c, a, b in zip(counts[kind], gc_counts, before)]
    print(f"\n[{label}] gc objects {len(gc.get_objects())}, frozen {gc.get_freeze_count()}")
    base = statistics.median(host["bf16"])
    for kind in runs:
        med = statistics.median(host[kind])
        per_k = [round(c * 1000 / (ITERS * ROUNDS), 1) for c in counts[kind]]
        print(f"  {kind:<12} {med:8.1f} us {med / base:6.2f}x   in gc {statistics.median(spent[kind]):6.1f} us/iter"
              f"   collections per 1000 iters (gen0, gen1, gen2): {per_k}")


measure("collector as is")
gc.freeze()
measure("after gc.freeze()")
gc.disable()
measure("gc disabled")
gc.enable()
