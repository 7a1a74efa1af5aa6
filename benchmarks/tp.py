"""Tensor-parallel MLP block: BF16 TP, FP8 TP, FP8 TP with collective-matmul overlap.

Run under torchrun, one process per GPU:

    torchrun --nproc-per-node N benchmarks/tp.py [--hidden 4096,8192] [--tokens 8192]

The block is the sequence-parallel Megatron MLP as one module:
fp8train.LayerNormMLP(h, 4h, activation="gelu_tanh", tp_group=..., sequence_parallel=True):
LayerNorm on this rank's rows, fc1 column-parallel (its input gathered once, in FP8, and
reused for wgrad), GELU(tanh), fc2 row-parallel (output reduce-scattered); forward +
backward, bf16 activations and parameters, `tokens` rows in all (tokens / N per rank).
Variants, side by side in one run: BF16 TP (the same module outside fp8train.autocast: torch
ops, the same collectives on bf16), FP8 TP (FP8 gathers and GEMMs), FP8 TP with tp_overlap
(the SP gathers / reduce-scatters as ring collective matmuls). N=1 runs the same code with no
communication, so the script is exercised before multi-GPU machines exist; `--device cpu`
(gloo) is a smoke test of the code path only (its times mean nothing). Rank 0 prints the
table and writes JSON. Never asserts on time.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import time

import torch
import torch.distributed as dist

import fp8train


def tp_block(h: int, group, overlap: bool, device, dtype) -> fp8train.LayerNormMLP:
    """The SP MLP block; forward takes this rank's rows (tokens / N, h)."""
    return fp8train.LayerNormMLP(h, 4 * h, activation="gelu_tanh", params_dtype=dtype, device=device,
                                 tp_group=group, sequence_parallel=True, tp_overlap=overlap)


def time_ms(step, device, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        step()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    sync()
    return (time.perf_counter() - t0) * 1e3 / iters


def trace_steps(step, path: str, iters: int = 3) -> list:
    """`iters` steps under torch.profiler: the Chrome trace (every stream, NCCL included) to
    `path`, and the per-kernel device time per step (overlapped kernels both count)."""
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    prof.export_chrome_trace(path)
    rows = [(e.key, e.device_time_total / iters / 1e3, e.count // iters) for e in prof.key_averages()
            if e.device_time_total > 0 and e.device_type == torch.autograd.DeviceType.CUDA]
    return sorted(rows, key=lambda r: -r[1])


def run_size(h, tokens, group, device, dtype, warmup, iters, trace_dir=None):
    world = dist.get_world_size(group)
    if tokens % world or (4 * h) % (16 * world):
        raise SystemExit(f"tokens ({tokens}) and 4h / 16 ({4 * h // 16}) must divide by the world size {world}")
    torch.manual_seed(0)
    x = torch.randn(tokens // world, h, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn_like(x)
    out = {}
    for name, overlap, recipe in (("bf16 TP", False, None), ("fp8 TP", False, fp8train.DelayedScaling()),
                                  ("fp8 TP overlap", True, fp8train.DelayedScaling())):
        torch.manual_seed(1)
        block = tp_block(h, group, overlap, device, dtype)

        def step(block=block, recipe=recipe):
            if recipe is None:
                y = block(x)
            else:
                with fp8train.autocast(recipe=recipe, amax_reduction=group):
                    y = block(x)
            y.backward(dy)
        out[name] = time_ms(step, device, warmup, iters)
        if trace_dir and device.type == "cuda":
            rank = dist.get_rank()
            tag = name.replace(" ", "_")
            rows = trace_steps(step, os.path.join(trace_dir, f"{tag}_h{h}_rank{rank}.json"))
            if rank == 0:
                print(f"\n{name}, h={h}, rank 0: device time per step by kernel (overlapped kernels both count)")
                for key, ms, n in rows[:12]:
                    print(f"  {ms:7.3f} ms  x{n:<3} {key[:90]}")
        del block
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", default="4096,8192")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--json", default="benchmarks/results/tp.json")
    p.add_argument("--trace", default=None, help="directory for per-rank Chrome traces of 3 steps per variant (CUDA)")
    args = p.parse_args()
    if args.device == "cuda":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast (device README)
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16
    group, world, rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    rows = []
    for h in (int(v) for v in args.hidden.split(",")):
        if args.trace:
            os.makedirs(args.trace, exist_ok=True)
        times = run_size(h, args.tokens, group, device, dtype, args.warmup, args.iters, args.trace)
        worst = {}
        for name, ms in times.items():  # the slowest rank sets the step time
            t = torch.tensor([ms], dtype=torch.float64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            worst[name] = float(t)
        rows.append({"h": h, **worst,
                     "fp8_vs_bf16": worst["fp8 TP"] / worst["bf16 TP"],
                     "overlap_vs_fp8": worst["fp8 TP overlap"] / worst["fp8 TP"],
                     "overlap_vs_bf16": worst["fp8 TP overlap"] / worst["bf16 TP"]})
    if rank == 0:
        meta = {"date": datetime.date.today().isoformat(), "world": world, "tokens": args.tokens,
                "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (gloo smoke test)",
                "torch": torch.__version__,
                "nccl": ".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else None}
        print(f"\nTP MLP block fwd+bwd, N={world}, {args.tokens} tokens -- {meta['device']}, torch {meta['torch']}, "
              f"NCCL {meta['nccl']}, {meta['date']}")
        print(f"{'h':>6} {'bf16 TP ms':>11} {'fp8 TP ms':>10} {'overlap ms':>11} {'fp8/bf16':>9} "
              f"{'ovl/fp8':>8} {'ovl/bf16':>9}")
        for r in rows:
            print(f"{r['h']:>6} {r['bf16 TP']:>11.3f} {r['fp8 TP']:>10.3f} {r['fp8 TP overlap']:>11.3f} "
                  f"{r['fp8_vs_bf16']:>8.2f}x {r['overlap_vs_fp8']:>7.2f}x {r['overlap_vs_bf16']:>8.2f}x")
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
