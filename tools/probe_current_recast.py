"""Probe (GPU machine): what the C++ weight re-cast saves current scaling's host time.
benchmarks/linear.py's host loop (1024 x 1024 layer, 256 tokens, one fwd+bwd per autocast
entry) for nn.Linear, FP8 current scaling with the weight re-cast in the node (the default)
and with it in Python (Quantizer.native_recast answering None, as before), and delayed
scaling; interleaved rounds, every other one reversed; medians and the median of each
round's own ratio to nn.Linear.

    PYTHONPATH=.:benchmarks python3 tools/probe_current_recast.py
"""
import statistics
import sys
import time

import torch

sys.path.insert(0, "benchmarks")
from fp8train.quantizer import CurrentScalingQuantizer, Quantizer  # noqa: E402
from linear import fwd_bwd_fn, make  # noqa: E402

dev = torch.device("cuda")
x = torch.randn(256, 1024, device=dev, dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn(256, 1024, device=dev, dtype=torch.bfloat16)


def python_recast(run):
    def wrapped():
        CurrentScalingQuantizer.native_recast = lambda self, *a: None
        try:
            run()
        finally:
            CurrentScalingQuantizer.native_recast = Quantizer.native_recast
    return wrapped


runs = {"nn.Linear": fwd_bwd_fn(*make("bf16", 1024, 1024, dev), x, dy),
        "current, C++ re-cast": fwd_bwd_fn(*make("fp8 current", 1024, 1024, dev), x, dy),
        "current, Python re-cast": python_recast(fwd_bwd_fn(*make("fp8 current", 1024, 1024, dev), x, dy)),
        "delayed": fwd_bwd_fn(*make("fp8 delayed", 1024, 1024, dev), x, dy)}
kinds = tuple(runs)
samples = {k: [] for k in kinds}
for run in runs.values():
    for _ in range(20):
        run()
for r in range(21):
    for kind in (kinds if r % 2 == 0 else kinds[::-1]):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(100):
            runs[kind]()
        samples[kind].append((time.perf_counter() - t0) / 100 * 1e6)
        torch.cuda.synchronize()
base = statistics.median(samples["nn.Linear"])
print("host time per fwd+bwd, 1024 x 1024, 256 tokens (21 interleaved rounds of 100):")
for kind in kinds:
    med = statistics.median(samples[kind])
    paired = statistics.median(a / b for a, b in zip(samples[kind], samples["nn.Linear"]))
    print(f"  {kind:<26} {med:8.1f} us {med / base:6.2f}x (paired {paired:.2f}x)")
