"""Probe (GPU machine): where the FP8 Linear's host time goes, inside the real fwd+bwd loop of
benchmarks/linear.py's host_time (1024 x 1024, 256 tokens, delayed).

Builds a second copy of the extension (native.SOURCES) with -DFP8TRAIN_STAGE_CLOCKS (its own
module name, so the library's build is untouched), makes it the extension kernels/native.py
hands out for this process, and reads the per-stage host nanoseconds it adds up: the node's
stages and, inside each GEMM, cuBLASLt's (with the calls that took the cuBLASLt path). Beside
them: the loop's host time per fwd+bwd for nn.Linear and the FP8 layer, the forward alone, and
the Python around the node (autocast, the layer's plan, the node called with prepared
arguments), so the stages can be set against the whole.

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
made = {kind: make(kind, 1024, 1024, dev) for kind in ("bf16", "fp8 delayed")}
runs = {kind: fwd_bwd_fn(*m, x, dy) for kind, m in made.items()}
for run in runs.values():
    for _ in range(30):
        run()
torch.cuda.synchronize()
ITERS = 300
host = {kind: [] for kind in runs}
stages: dict = {}
lt_before = ext.lt_counts()
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
lt_after = ext.lt_counts()
calls = 5 * ITERS
print(f"\ncuBLASLt path: {(lt_after[0] - lt_before[0]) / calls:.1f} GEMMs per fwd+bwd, "
      f"at::_scaled_mm {(lt_after[1] - lt_before[1]) / calls:.1f}; algorithms cached {lt_after[2]}")


def per_call(fn, iters=ITERS, rounds=5):
    """Median over rounds of fn's host time per call, us (the GPU drained between rounds)."""
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        times.append((time.perf_counter() - t) / iters * 1e6)
    return statistics.median(times)


import fp8train  # noqa: E402
from fp8train.modules import linear as linear_mod  # noqa: E402

layer, recipe = made["fp8 delayed"]
bf16_layer = made["bf16"][0]


def fp8_forward():
    with fp8train.autocast(recipe=recipe):
        layer(x)


def autocast_only():
    with fp8train.autocast(recipe=recipe):
        pass


def plan_only():
    with fp8train.autocast(recipe=recipe):
        r, act = layer.fp8_plan(x, 1024)
        layer.quantizers(r, dev)


def prologue_only():  # the forward's Python up to the node, with the node's own call left out
    ext_saved = linear_mod.native.extension
    with fp8train.autocast(recipe=recipe):
        r, act = layer.fp8_plan(x, 1024)
        qi, qw, qg = layer.quantizers(r, dev)
        linear_mod.native.extension = lambda: _Nop
        try:
            linear_mod._native_forward(layer, x, layer.weight, layer.bias, qi, qw, qg, r.gemm, act, True, None)
        finally:
            linear_mod.native.extension = ext_saved


class _Nop:
    @staticmethod
    def linear_forward(*args):
        return x


args = {}


def capture(*a):
    args["a"] = a
    return ext.linear_forward(*a)


class _Capture:
    linear_forward = staticmethod(capture)


with fp8train.autocast(recipe=recipe):
    r, act = layer.fp8_plan(x, 1024)
    qi, qw, qg = layer.quantizers(r, dev)
    linear_mod.native.extension, saved = (lambda: _Capture), linear_mod.native.extension
    try:
        linear_mod._native_forward(layer, x, layer.weight, layer.bias, qi, qw, qg, r.gemm, act, True, None)
    finally:
        linear_mod.native.extension = saved
node_args = args["a"]


def node_only():
    ext.linear_forward(*node_args)


def node_fwd_bwd():
    ext.linear_forward(*node_args).backward(dy)


rows = [
    ("bf16 fwd+bwd", runs["bf16"]),
    ("bf16 forward", lambda: bf16_layer(x)),
    ("fp8 fwd+bwd", runs["fp8 delayed"]),
    ("fp8 forward (autocast, layer)", fp8_forward),
    ("  autocast enter+exit", autocast_only),
    ("  + fp8_plan + quantizers", plan_only),
    ("  + _native_forward's Python (no node)", prologue_only),
    ("  node forward alone (prepared args)", node_only),
    ("node fwd+bwd alone (prepared args)", node_fwd_bwd),
]
print("\nhost us per call (medians of 5 rounds of 300)")
for name, fn in rows:
    for _ in range(30):
        fn()
    print(f"  {name:<40} {per_call(fn):8.1f} us")

# One GEMM of the layer's forward shape alone: torch's bf16 GEMMs against the FP8 ones, and
# the extension's cuBLASLt stages per call (is cublasLtMatmul's own host time FP8's?)
a8 = torch.randn(256, 1024, device=dev).to(torch.float8_e4m3fn)
w8 = torch.randn(1024, 1024, device=dev).to(torch.float8_e4m3fn)
one = torch.ones((), device=dev)
bias = torch.randn(1024, device=dev, dtype=torch.bfloat16)
xb, wb = x.detach(), torch.randn(1024, 1024, device=dev, dtype=torch.bfloat16)
gemms = [
    ("torch.mm bf16", lambda: torch.mm(xb, wb.t())),
    ("torch.addmm bf16 (bias)", lambda: torch.addmm(bias, xb, wb.t())),
    ("torch._scaled_mm fp8 (bias)", lambda: torch._scaled_mm(a8, w8.t(), one, one, bias, None, torch.bfloat16, True)),
    ("ext.scaled_mm fp8 (bias)", lambda: ext.scaled_mm(a8, one, w8.t(), one, True, 1, bias, None)),
    ("ext.scaled_mm fp8", lambda: ext.scaled_mm(a8, one, w8.t(), one, True, 1, None, None)),
]
print("\none 256 x 1024 x 1024 GEMM, host us per call (medians of 5 rounds of 300); extension stages per call")
for name, fn in gemms:
    for _ in range(30):
        fn()
    ext.reset_stage_clocks()
    us = per_call(fn)
    clocks = {n: ns / 5 / ITERS / 1e3 for n, ns, calls in ext.stage_clocks() if n.startswith("gemm") and calls}
    inner = ", ".join(f"{n[6:]} {v:.1f}" for n, v in clocks.items())
    print(f"  {name:<30} {us:7.1f} us  {inner}")
