"""One gloo process-group launch per world size, many cases inside it (STYLE habit 10).

A test module defines CASES = [(case_id, fn, kwargs, worlds), ...] with fn(ctx, **kwargs)
run on every rank (ctx: rank, world, a per-case seed; fn may return metrics to print), and
calls `launch(module_name, world, tmp_dir)`: it spawns `world` processes on loopback, runs
the module's cases in order and returns {case_id: [error text per failing rank]}. After a
failure on any rank the later cases are reported as not run (collectives would be out of
step). `metrics_tag` names the line rank 0 prints per case with metrics (pytest -s).
"""
from __future__ import annotations

import importlib
import json
import os
import time
import traceback
import zlib
from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

LAUNCH_TIMEOUT_S = 240  # the whole launch; each collective times out after COLLECTIVE_TIMEOUT
COLLECTIVE_TIMEOUT = timedelta(seconds=60)


def _worker(rank: int, world: int, init_file: str, out_dir: str, module_name: str, metrics_tag: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only
    torch.set_num_threads(1)  # several processes share two cores
    cases = importlib.import_module(module_name).CASES
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=COLLECTIVE_TIMEOUT)
    results, metrics, aborted = {}, {}, None
    for case_id, fn, kwargs, worlds in cases:
        if world not in worlds:
            continue
        if aborted:
            results[case_id] = f"not run: case {aborted} failed on some rank (collectives may be out of step)"
            continue
        ctx = SimpleNamespace(rank=rank, world=world, seed=zlib.crc32(case_id.encode()))
        try:
            m = fn(ctx, **kwargs)
            if m:
                metrics[case_id] = m
            results[case_id] = None
        except Exception:
            results[case_id] = f"rank {rank}:\n{traceback.format_exc()}"
        failed = torch.tensor(float(results[case_id] is not None))
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if failed.item():
            aborted = case_id
    if rank == 0:
        for case_id, m in metrics.items():
            print(metrics_tag, json.dumps({"world": world, "case": case_id, **m}), flush=True)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def launch(module_name: str, world: int, tmp: str, metrics_tag: str = "METRICS"):
    """Run `module_name`.CASES on `world` gloo ranks; ({case_id: [errors]}, seconds)."""
    init_file = os.path.join(tmp, f"init{world}")
    start = time.perf_counter()
    ctx = mp.start_processes(_worker, args=(world, init_file, tmp, module_name, metrics_tag), nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    try:
        while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {world}-process gloo launch ran past {LAUNCH_TIMEOUT_S} s")
    finally:
        for p in ctx.processes:  # only ours, by handle
            if p.is_alive():
                p.kill()
    merged: dict = {}
    for rank in range(world):
        with open(os.path.join(tmp, f"rank{rank}.json")) as f:
            for case_id, err in json.load(f).items():
                merged.setdefault(case_id, [])
                if err:
                    merged[case_id].append(err)
    return merged, time.perf_counter() - start
