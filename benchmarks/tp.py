"""Tensor-parallel MLP block: BF16 TP, FP8 TP without overlap, with the bulk overlap, with collective matmuls.

Run under torchrun, one process per GPU:

    torchrun --nproc-per-node N benchmarks/tp.py [--hidden 4096,8192] [--tokens 8192]

The block is the sequence-parallel Megatron MLP as one module:
fp8train.LayerNormMLP(h, 4h, activation="gelu_tanh", tp_group=..., sequence_parallel=True):
LayerNorm on this rank's rows, fc1 column-parallel (its input gathered once, in FP8, and
reused for wgrad), GELU(tanh), fc2 row-parallel (output reduce-scattered); forward +
backward, bf16 activations and parameters, `tokens` rows in all (tokens / N per rank).
Variants, side by side in one run: BF16 TP (the same module outside fp8train.autocast: torch
ops, the same collectives on bf16), FP8 TP sequential (FP8 gathers and GEMMs, partial sums
reduced in bf16, every collective waited for before the next GEMM: no overlap), FP8 TP (the
default: the same, with fc1's dX reduce-scatter beside its wgrad GEMM), FP8 TP with
tp_overlap (the SP gathers / reduce-scatters as collective matmuls, their chunks moved on
CUDA by the copy engines through symmetric memory), the same with the chunks moved by an
NCCL ring ("overlap nccl"), FP8 TP with float32 partial sums (tp_reduce_dtype=torch.float32);
with --graphed also BF16 TP and the four FP8 TP variants replayed from CUDA graphs (no host
bound). N=1 runs the same code with no
communication, so the script is exercised before multi-GPU machines exist; `--device cpu`
(gloo) is a smoke test of the code path only (its times mean nothing). Rank 0 prints the
table and writes JSON. Never asserts on time.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import gc
import os
import statistics
import time

import torch
import torch.distributed as dist

import fp8train
from fp8train.distributed import symm_transport, tp_comm


def tp_block(h: int, group, overlap: bool, device, dtype, reduce_dtype=None) -> fp8train.LayerNormMLP:
    """The SP MLP block; forward takes this rank's rows (tokens / N, h)."""
    return fp8train.LayerNormMLP(h, 4 * h, activation="gelu_tanh", params_dtype=dtype, device=device,
                                 tp_group=group, sequence_parallel=True, tp_overlap=overlap,
                                 tp_reduce_dtype=reduce_dtype)


def time_ms(step, device, warmup: int, iters: int, blocks: int = 5) -> float:
    """Median over `blocks` blocks of the mean step time of iters / blocks steps (one slow
    block, e.g. a late rank, does not move it)."""
    for _ in range(warmup):
        step()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    per_block, means = max(1, iters // blocks), []
    for _ in range(blocks):
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(per_block):
            step()
        sync()
        means.append((time.perf_counter() - t0) * 1e3 / per_block)
    return statistics.median(means)


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


# (name, tp_overlap, FP8, tp_reduce_dtype, graphed, context): "fp8 TP" reduces dX beside the
# wgrad GEMM (the bulk overlap, tp_comm.column_dgrad); "sequential" waits for it first
# (tp_comm.sequential_reductions), the FP8 TP without any overlap; "overlap" runs the
# collective matmuls, on CUDA with the copy engines (symm_transport), "overlap nccl" with the
# NCCL ring (symm_transport.nccl_transport)
_PLAIN, _SEQ, _NCCL = contextlib.nullcontext, tp_comm.sequential_reductions, symm_transport.nccl_transport
VARIANTS = (("bf16 TP", False, False, None, False, _PLAIN),
            ("fp8 TP sequential", False, True, None, False, _SEQ),
            ("fp8 TP", False, True, None, False, _PLAIN),
            ("fp8 TP overlap", True, True, None, False, _PLAIN),
            ("fp8 TP overlap nccl", True, True, None, False, _NCCL),
            ("fp8 TP fp32-reduce", False, True, torch.float32, False, _PLAIN))
GRAPHED = (("bf16 TP graphed", False, False, None, True, _PLAIN),
           ("fp8 TP sequential graphed", False, True, None, True, _SEQ),
           ("fp8 TP graphed", False, True, None, True, _PLAIN),
           ("fp8 TP overlap graphed", True, True, None, True, _PLAIN),
           ("fp8 TP overlap nccl graphed", True, True, None, True, _NCCL))


def build_step(h, group, device, dtype, x, dy, overlap, fp8, reduce_dtype, graphed):
    """One fwd+bwd step of a fresh block. Graphed: one eager step, then forward and backward
    captured in CUDA graphs (FP8: fp8train.make_graphed_callables, with the per-step amax
    all-reduce captured in the first graph; BF16: torch.cuda.make_graphed_callables)."""
    torch.manual_seed(1)
    block = tp_block(h, group, overlap, device, dtype, reduce_dtype if fp8 else None)
    recipe = fp8train.DelayedScaling() if fp8 else None

    def eager():
        if recipe is None:
            y = block(x)
        else:
            with fp8train.autocast(recipe=recipe, amax_reduction=group):
                y = block(x)
        y.backward(dy)
    if not graphed:
        return eager, block
    eager()
    sample = (x.detach().clone().requires_grad_(True),)
    if fp8:
        fp8train.make_graphed_callables(block, sample, recipe=recipe, amax_reduction=group)
        graphed_fn = block
    else:
        graphed_fn = torch.cuda.make_graphed_callables(block, sample)

    def replay():
        graphed_fn(x).backward(dy)
    return replay, block


def run_size(h, tokens, group, device, dtype, warmup, iters, trace_dir=None, graphed=False):
    world = dist.get_world_size(group)
    if tokens % world or (4 * h) % (16 * world):
        raise SystemExit(f"tokens ({tokens}) and 4h / 16 ({4 * h // 16}) must divide by the world size {world}")
    torch.manual_seed(0)
    x = torch.randn(tokens // world, h, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn_like(x)
    out = {}
    for name, overlap, fp8, reduce_dtype, graph, context in VARIANTS + (GRAPHED if graphed else ()):
        with context():  # around the capture of graphed variants and every eager step
            step, block = build_step(h, group, device, dtype, x, dy, overlap, fp8, reduce_dtype, graph)
            out[name] = time_ms(step, device, warmup, iters)
            if trace_dir and device.type == "cuda":
                rank = dist.get_rank()
                tag = name.replace(" ", "_")
                rows = trace_steps(step, os.path.join(trace_dir, f"{tag}_h{h}_rank{rank}.json"))
                if rank == 0:
                    print(f"\n{name}, h={h}, rank 0: device time per step by kernel (overlapped kernels both count)")
                    for key, ms, n in rows[:12]:
                        print(f"  {ms:7.3f} ms  x{n:<3} {key[:90]}")
        del step, block
        gc.collect()  # graphed blocks hold reference cycles; free them before the next variant
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
    p.add_argument("--graphed", action="store_true", help="also each variant's fwd+bwd replayed from CUDA graphs")
    args = p.parse_args()
    if args.device == "cuda":
        for var in ("NCCL_NVLS_ENABLE", "NVSHMEM_DISABLE_NVLS"):  # no NVLink multicast (device README)
            os.environ.setdefault(var, "0" if var == "NCCL_NVLS_ENABLE" else "1")
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16
    group, world, rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    rows = []
    for h in (int(v) for v in args.hidden.split(",")):
        if args.trace:
            os.makedirs(args.trace, exist_ok=True)
        if args.graphed and device.type != "cuda":
            raise SystemExit("--graphed needs CUDA")
        times = run_size(h, args.tokens, group, device, dtype, args.warmup, args.iters, args.trace, args.graphed)
        worst = {}
        for name, ms in times.items():  # the slowest rank sets the step time
            t = torch.tensor([ms], dtype=torch.float64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            worst[name] = float(t)
        rows.append({"h": h, **worst,
                     "fp8_vs_bf16": worst["fp8 TP"] / worst["bf16 TP"],
                     "bulk_vs_sequential": worst["fp8 TP"] / worst["fp8 TP sequential"],
                     "overlap_vs_sequential": worst["fp8 TP overlap"] / worst["fp8 TP sequential"],
                     "overlap_nccl_vs_sequential": worst["fp8 TP overlap nccl"] / worst["fp8 TP sequential"],
                     "overlap_vs_fp8": worst["fp8 TP overlap"] / worst["fp8 TP"],
                     "overlap_vs_bf16": worst["fp8 TP overlap"] / worst["bf16 TP"]})
        if args.graphed:
            rows[-1].update({"graphed_bulk_vs_sequential": worst["fp8 TP graphed"] / worst["fp8 TP sequential graphed"],
                             "graphed_overlap_vs_sequential":
                                 worst["fp8 TP overlap graphed"] / worst["fp8 TP sequential graphed"],
                             "graphed_overlap_nccl_vs_sequential":
                                 worst["fp8 TP overlap nccl graphed"] / worst["fp8 TP sequential graphed"],
                             "graphed_overlap_vs_fp8": worst["fp8 TP overlap graphed"] / worst["fp8 TP graphed"],
                             "graphed_overlap_vs_bf16": worst["fp8 TP overlap graphed"] / worst["bf16 TP graphed"]})
    if rank == 0:
        meta = {"date": datetime.date.today().isoformat(), "world": world, "tokens": args.tokens,
                "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (gloo smoke test)",
                "torch": torch.__version__,
                "nccl": ".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else None}
        print(f"\nTP MLP block fwd+bwd, N={world}, {args.tokens} tokens -- {meta['device']}, torch {meta['torch']}, "
              f"NCCL {meta['nccl']}, {meta['date']}")
        names = [v[0] for v in VARIANTS + (GRAPHED if args.graphed else ())]
        print(f"{'h':>6} {'variant':<28} {'ms':>9} {'vs bf16 TP':>11}")
        for r in rows:
            for name in names:
                print(f"{r['h']:>6} {name:<28} {r[name]:>9.3f} {r[name] / r['bf16 TP']:>10.2f}x")
            ratios = {k: v for k, v in r.items() if "_vs_" in k}
            print("       " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
