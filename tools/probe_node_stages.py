"""Probe (GPU machine): where the C++ Linear node's host time goes, stage by stage, inside the
real fwd+bwd loop of benchmarks/linear.py's host_time (1024 x 1024, 256 tokens, delayed).

Builds a second copy of csrc/linear_node.cpp with -DFP8TRAIN_STAGE_CLOCKS (its own module
name, so the library's build is untouched), makes it the extension kernels/native.py hands
out for this process, and reads the per-stage host nanoseconds it adds up. Beside them: the
loop's host time per fwd+bwd for nn.Linear and the FP8 layer, so the stages can be set
against the whole.

    PYTHONPATH=.:benchmarks python3 tools/probe_node_stages.py
"""
import statistics
import sys
import time

import torch
from torch.utils.cpp_extension import load

sys.path.insert(0, "benchmarks")
from fp8train.kernels import native  # noqa: E402
from linear import fwd_bwd_fn, make  # noqa: E402

native._find_ninja()
native._ext = load(name="fp8train_linear_node_clocks", sources=native.SOURCES,
                   extra_cflags=["-O1", "-DFP8TRAIN_STAGE_CLOCKS"], extra_ldflags=["-ldl"], verbose=False)
ext = native._ext

dev = torch.device("cuda")
x = torch.randn(256, 1024, device=dev, dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn(256, 1024, device=dev, dtype=torch.bfloat16)
runs = {kind: fwd_bwd_fn(*make(kind, 1024, 1024, dev), x, dy) for kind in ("bf16", "fp8 delayed")}
for run in runs.values():
    for _ in range(30):
        run()
torch.cuda.synchronize()
ITERS = 300
host = {kind: [] for kind in runs}
stages: dict = {}
for _ in range(5):
    for kind, run in runs.items():
        ext.reset_stage_clocks()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(ITERS):
            run()
        host[kind].append((time.perf_counter() - t) / ITERS * 1e6)
        torch.cuda.synchronize()
        if kind != "bf16":
            for name, ns, calls in ext.stage_clocks():
                stages.setdefault(name, []).append((ns / ITERS / 1e3, calls / ITERS))
base = statistics.median(host["bf16"])
print("\nhost us per fwd+bwd (medians of 5 rounds of 300)")
for kind, v in host.items():
    print(f"  {kind:<14} {statistics.median(v):8.1f} us  {statistics.median(v) / base:5.2f}x")
print("\nC++ node stages, us per fwd+bwd (median of the rounds), calls per fwd+bwd")
for name, v in stages.items():
    print(f"  {name:<34} {statistics.median(u for u, _ in v):7.1f} us  {v[0][1]:4.1f}x")
