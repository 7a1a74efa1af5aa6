"""Probe (GPU machine): the host cost of one torch._scaled_mm call against torch.mm / F.linear
and torch.empty, at the small layer's shapes (256 x 1024 @ 1024 x 1024) and a larger one.

Each op is called `iters` times back to back without a sync (the device work is a few us,
so the loop is host-bound) and timed with perf_counter; medians of 5 rounds, rounds
interleaved over the ops.

    PYTHONPATH=. python3 tools/probe_scaled_mm_host.py
"""
import statistics
import time

import torch
import torch.nn.functional as F

dev = torch.device("cuda")
E4M3 = torch.float8_e4m3fn
ITERS, ROUNDS = 500, 5


def ops_for(m, k, n):
    a = torch.randn(m, k, device=dev).to(E4M3)
    b = torch.randn(n, k, device=dev).to(E4M3).t()  # column-major (k, n)
    sa, sb = torch.ones((), device=dev), torch.ones((), device=dev)
    bias = torch.randn(n, device=dev, dtype=torch.bfloat16)
    a16, w16 = torch.randn(m, k, device=dev, dtype=torch.bfloat16), torch.randn(n, k, device=dev, dtype=torch.bfloat16)
    return {
        "torch.empty (m, n) bf16": lambda: torch.empty(m, n, device=dev, dtype=torch.bfloat16),
        "torch.empty (m, n) fp8": lambda: torch.empty(m, n, device=dev, dtype=E4M3),
        "torch.mm bf16": lambda: torch.mm(a16, w16.t()),
        "F.linear bf16 + bias": lambda: F.linear(a16, w16, bias),
        "_scaled_mm bf16 out": lambda: torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16),
        "_scaled_mm bf16 out, fast accum": lambda: torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16,
                                                                    use_fast_accum=True),
        "_scaled_mm bf16 out + bias": lambda: torch._scaled_mm(a, b, sa, sb, bias=bias, out_dtype=torch.bfloat16),
        "_scaled_mm fp32 out": lambda: torch._scaled_mm(a, b, sa, sb, out_dtype=torch.float32),
    }


for m, k, n in ((256, 1024, 1024), (4096, 1024, 4096)):
    ops = ops_for(m, k, n)
    for fn in ops.values():
        for _ in range(50):
            fn()
    torch.cuda.synchronize()
    samples = {name: [] for name in ops}
    for _ in range(ROUNDS):
        for name, fn in ops.items():
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(ITERS):
                fn()
            samples[name].append((time.perf_counter() - t) / ITERS * 1e6)
            torch.cuda.synchronize()
    print(f"\nhost us per call, {m} x {k} @ {k} x {n} (median of {ROUNDS} rounds of {ITERS}; "
          f"torch {torch.__version__})")
    for name, v in samples.items():
        print(f"  {name:<34} {statistics.median(v):7.1f} us   rounds {' '.join(f'{s:.1f}' for s in v)}")
