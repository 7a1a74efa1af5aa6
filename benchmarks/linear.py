"""FP8 Linear fwd+bwd against nn.Linear in BF16, side by side in one run (GPU machine).

Part 1, GEMM-sized layers: M = 8192 tokens, K = N in {1024, 2048, 4096, 8192}, bf16 params and
activations; median time of forward + backward (triton.testing.do_bench), TFLOP/s counted as
6 * M * K * N, and the ratio to BF16.
Part 2, host overhead: a 1024 -> 1024 layer on 256 tokens, where the GPU work is tiny; the
host time to issue one fwd+bwd (perf_counter over many iterations, no sync inside), and its
ratio to nn.Linear (target <= 1.5x; torchao eager measured 12.8x), through fp8train's C++
Linear node (the default on CUDA) and through its Python autograd node.

Prints tables, writes JSON (--json). Never asserts on time.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time

import torch
import triton
from torch import nn

import fp8train
from fp8train.kernels import native

RECIPES = {"fp8 delayed": fp8train.DelayedScaling(), "fp8 current": fp8train.CurrentScaling()}


def make(kind, k, n, device):
    if kind == "bf16":
        return nn.Linear(k, n, device=device, dtype=torch.bfloat16), None
    return fp8train.Linear(k, n, params_dtype=torch.bfloat16, device=device), RECIPES[kind]


def fwd_bwd_fn(layer, recipe, x, dy):
    if recipe is None:
        def run():
            layer(x).backward(dy)
    else:
        def run():
            with fp8train.autocast(recipe=recipe):
                y = layer(x)
            y.backward(dy)
    return run


def gemm_sized(sizes, m, device):
    rows = []
    for kn in sizes:
        x = torch.randn(m, kn, device=device, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(m, kn, device=device, dtype=torch.bfloat16)
        base = None
        for kind in ("bf16", *RECIPES):
            layer, recipe = make(kind, kn, kn, device)
            run = fwd_bwd_fn(layer, recipe, x, dy)
            ms = triton.testing.do_bench(run, warmup=100, rep=500, grad_to_none=[x, *layer.parameters()],
                                         return_mode="median")
            base = base or ms
            rows.append({"K=N": kn, "M": m, "kind": kind, "ms": ms, "tflops": 6 * m * kn * kn / ms / 1e9,
                         "ratio_to_bf16": ms / base})
    return rows


def on_python_node(run):
    """run with fp8train's C++ Linear node switched off (the Python autograd node instead)."""
    def wrapped():
        native.ENABLED = False
        try:
            run()
        finally:
            native.ENABLED = True
    return wrapped


def on_scaled_mm(run):
    """run with the extension's GEMMs on at::_scaled_mm instead of cuBLASLt with a cached
    algorithm (csrc/lt_gemm.cpp)."""
    def wrapped():
        native.set_lt_gemm(False)
        try:
            run()
        finally:
            native.set_lt_gemm(True)
    return wrapped


def host_time(device, iters=100, tokens=256, dim=1024, rounds=21):
    """Median over rounds; each round times every kind in turn, so all see the same host load,
    in the reverse order every other round (a b ... b a: no kind always runs first after the
    sync). Many short rounds, because the host's speed drifts within seconds. The FP8 kinds run
    through the C++ Linear node (the default) and the Python one; delayed scaling also with the
    node's GEMMs on at::_scaled_mm (what the cached cuBLASLt path saves)."""
    x = torch.randn(tokens, dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, dim, device=device, dtype=torch.bfloat16)
    runs = {kind: fwd_bwd_fn(*make(kind, dim, dim, device), x, dy) for kind in ("bf16", *RECIPES)}
    for kind in RECIPES:
        runs[f"{kind} (python node)"] = on_python_node(fwd_bwd_fn(*make(kind, dim, dim, device), x, dy))
    runs["fp8 delayed (_scaled_mm)"] = on_scaled_mm(fwd_bwd_fn(*make("fp8 delayed", dim, dim, device), x, dy))
    kinds = tuple(runs)
    samples = {kind: [] for kind in kinds}
    for run in runs.values():
        for _ in range(20):
            run()
    for r in range(rounds):
        for kind in (kinds if r % 2 == 0 else kinds[::-1]):
            run = runs[kind]
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(iters):
                run()
            samples[kind].append((time.perf_counter() - t0) / iters * 1e6)
            torch.cuda.synchronize()
    med = {kind: sorted(v)[len(v) // 2] for kind, v in samples.items()}
    # also the median of each round's own ratio: the host's speed drifts between rounds (2x
    # within a minute on the GPU machine) and moves a round's kinds together
    paired = {kind: statistics.median(a / b for a, b in zip(v, samples["bf16"])) for kind, v in samples.items()}
    return [{"kind": kind, "host_us": med[kind], "ratio_to_nn_linear": med[kind] / med["bf16"],
             "paired_ratio_to_nn_linear": paired[kind], "samples_us": samples[kind]} for kind in kinds]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--m", type=int, default=8192)
    p.add_argument("--json", default="benchmarks/results/linear.json")
    args = p.parse_args()
    device = torch.device("cuda")
    meta = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "triton": triton.__version__,
            "cpp_node": "built" if native.extension() is not None else f"not built: {native.failure()}"}
    gemm_rows = gemm_sized(args.sizes, args.m, device)
    host_rows = host_time(device)

    print(f"\nFP8 Linear fwd+bwd vs nn.Linear BF16 -- {meta}")
    print(f"{'K=N':>6} {'kind':<12} {'ms':>8} {'TFLOP/s':>8} {'vs bf16':>8}")
    for r in gemm_rows:
        print(f"{r['K=N']:>6} {r['kind']:<12} {r['ms']:>8.3f} {r['tflops']:>8.0f} {r['ratio_to_bf16']:>7.2f}x")
    print("\nHost time per fwd+bwd, 1024x1024 layer, 256 tokens (target: <= 1.5x nn.Linear; median of the "
          "rounds, then the median of the rounds' own ratios)")
    for r in host_rows:
        print(f"{r['kind']:<26} {r['host_us']:>8.1f} us {r['ratio_to_nn_linear']:>7.2f}x "
              f"(paired {r['paired_ratio_to_nn_linear']:.2f}x)")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"meta": meta, "gemm_sized": gemm_rows, "host_time": host_rows}, f, indent=1)


if __name__ == "__main__":
    main()
