"""One process-group launch per world size, many cases inside it (STYLE habit 10).

A test module defines CASES = [(case_id, fn, kwargs, worlds), ...] with fn(ctx, **kwargs)
run on every rank (ctx: rank, world, device, a per-case seed, tmp: a directory all ranks
share; fn may return metrics to print). Every tensor and module a case makes lives on ctx.device, so the same cases run

* on CPU with gloo: `launch(module_name, world, tmp_dir)` spawns `world` processes on
  loopback (ctx.device is cpu);
* on GPUs with NCCL under torchrun: `launch_torchrun(module_name, world, tmp_dir)` runs
  `torchrun --nproc-per-node world tests/gloo_harness.py MODULE OUT_DIR` (this file's
  __main__; ctx.device is cuda:LOCAL_RANK, NVLink multicast off).

Both return ({case_id: [error text per failing rank]}, seconds). After a failure on any rank
the later cases are reported as not run (collectives would be out of step). A rank still
inside one case after CASE_TIMEOUT_S (a case module may set its own) prints every thread's
stack and exits, which ends the launch with that stack in its error output
(tests/test_gloo_harness.py). `metrics_tag` names the line rank 0 prints per case with
metrics (pytest -s).
"""
from __future__ import annotations

import faulthandler
import gc
import importlib
import json
import os
import signal
import subprocess
import sys
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
CASE_TIMEOUT_S = 150  # a rank still inside one case after this prints every thread's stack and exits


def run_cases(rank: int, world: int, device: torch.device, out_dir: str, module_name: str,
              metrics_tag: str) -> None:
    """Every case of module_name.CASES for this world size, on an initialised process group;
    writes OUT_DIR/rank{rank}.json ({case_id: None or error text})."""
    module = importlib.import_module(module_name)
    cases = module.CASES
    case_timeout_s = getattr(module, "CASE_TIMEOUT_S", CASE_TIMEOUT_S)  # a case module may set its own
    results, metrics, aborted = {}, {}, None
    for case_id, fn, kwargs, worlds in cases:
        if world not in worlds:
            continue
        if aborted:
            results[case_id] = f"not run: case {aborted} failed on some rank (collectives may be out of step)"
            continue
        ctx = SimpleNamespace(rank=rank, world=world, device=device, seed=zlib.crc32(case_id.encode()),
                              tmp=out_dir)  # tmp: a directory every rank of the launch shares
        # A rank stuck in a case (a collective its peers never joined, a hung CUDA graph
        # replay, which no NCCL watchdog sees) prints where it is and exits, so the launch
        # ends with that stack in its error output instead of running into the launch timeout.
        print(f"rank {rank}: case {case_id}", file=sys.stderr, flush=True)
        faulthandler.dump_traceback_later(case_timeout_s, exit=True)
        try:
            m = fn(ctx, **kwargs)
            if m:
                metrics[case_id] = m
            results[case_id] = None
        except Exception:
            results[case_id] = f"rank {rank}:\n{traceback.format_exc()}"
        failed = torch.tensor(float(results[case_id] is not None), device=device)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        faulthandler.cancel_dump_traceback_later()
        if failed.item():
            aborted = case_id
    if rank == 0:
        for case_id, m in metrics.items():
            print(metrics_tag, json.dumps({"world": world, "device": device.type, "case": case_id, **m}), flush=True)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


def _worker(rank: int, world: int, init_file: str, out_dir: str, module_name: str, metrics_tag: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only
    torch.set_num_threads(1)  # several processes share two cores
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=COLLECTIVE_TIMEOUT)
    try:
        run_cases(rank, world, torch.device("cpu"), out_dir, module_name, metrics_tag)
        dist.barrier()  # every rank has written its results
    except BaseException:
        dist.destroy_process_group()
        raise
    # Leave without the interpreter's teardown: in about 1 of 10 launches a C++ thread still
    # joinable at exit aborted a rank after its last case ("terminate called without an active
    # exception", SIGABRT), and the launch failed with every result written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _merge(out_dir: str, world: int) -> dict:
    merged: dict = {}
    for rank in range(world):
        with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
            for case_id, err in json.load(f).items():
                merged.setdefault(case_id, [])
                if err:
                    merged[case_id].append(err)
    return merged


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
    return _merge(tmp, world), time.perf_counter() - start


def cached_launcher(tmp_path_factory, module_name: str, metrics_tag: str, torchrun: bool = False):
    """For a module-scoped fixture: world -> (results, seconds), one launch per world size.
    A launch that fails (a timeout: ranks left waiting in a collective) is not retried: every
    later case of that world size gets the same error at once."""
    done: dict = {}

    def launch_world(world: int):
        if world not in done:
            tmp = str(tmp_path_factory.mktemp(f"{module_name}-world{world}"))
            try:
                done[world] = (launch_torchrun if torchrun else launch)(module_name, world, tmp, metrics_tag)
            except Exception as exc:  # noqa: BLE001 - kept and re-raised for every case
                done[world] = exc
        if isinstance(done[world], Exception):
            raise RuntimeError(f"the {world}-rank launch of {module_name} failed") from done[world]
        return done[world]
    return launch_world


_SHORT = {torch.bfloat16: "bf16", torch.float32: "fp32"}


def case(fn, worlds, **kwargs):
    """One CASES entry (id, fn, kwargs, worlds); the id is fn's name less `case_`, then each
    kwarg: a dtype by short name, True as its key, False as no<key>, anything else as str."""
    parts = [fn.__name__[len("case_"):]] + [
        _SHORT.get(v) or (k if v is True else f"no{k}" if v is False else str(v)) for k, v in kwargs.items()]
    return "-".join(parts), fn, kwargs, worlds


def world_params(cases, worlds):
    """pytest params (world, case_id) of every case at every world size it runs at, marked
    `launch`; worlds over 2 are also `slow` (make test-all): 4 ranks on a 2-core machine cost
    more than the rest of a file, and the ring steps that N > 2 adds run there and on GPUs."""
    import pytest

    return [pytest.param(w, c[0], id=f"world{w}-{c[0]}",
                         marks=(pytest.mark.launch, pytest.mark.slow) if w > 2 else pytest.mark.launch)
            for w in worlds for c in cases if w in c[3]]


def check(results: dict, case_id: str) -> None:
    """Fail with every rank's error text if the case failed (or did not report)."""
    assert case_id in results, f"case {case_id} did not report"
    errors = results[case_id]
    assert not errors, "\n".join(errors)


NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def launch_torchrun(module_name: str, world: int, tmp: str, metrics_tag: str = "METRICS"):
    """Run `module_name`.CASES under torchrun, one process per GPU with NCCL (gloo on CPU
    where CUDA is absent, which is how the CPU suite checks this path)."""
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    repo = os.path.dirname(tests_dir)
    case_dir = os.path.dirname(os.path.abspath(importlib.import_module(module_name).__file__))
    path = [repo, tests_dir, case_dir, os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, **NCCL_ENV, "PYTHONPATH": os.pathsep.join(path)}
    start = time.perf_counter()
    # its own session, so a timeout kills torchrun's workers too (signal to the process group)
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             f"--nproc-per-node={world}", os.path.abspath(__file__), module_name, tmp, metrics_tag],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise TimeoutError(f"the {world}-rank torchrun launch ran past {LAUNCH_TIMEOUT_S} s (ranks waiting in a "
                           f"collective?):\n{out[-3000:]}\n{err[-3000:]}") from None
    sys.stdout.write(out)
    if proc.returncode:
        raise RuntimeError(f"torchrun exited with {proc.returncode}:\n{err[-6000:]}")
    return _merge(tmp, world), time.perf_counter() - start


def _torchrun_main(module_name: str, out_dir: str, metrics_tag: str) -> None:
    """One rank under torchrun: NCCL on cuda:LOCAL_RANK where CUDA is present, else gloo on CPU."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        os.environ.update(NCCL_ENV)  # before NCCL initialises
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=COLLECTIVE_TIMEOUT, device_id=device)
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)
    try:
        run_cases(rank, world, device, out_dir, module_name, metrics_tag)
    finally:
        gc.collect()  # CUDA graphs a case left in reference cycles go before the communicators
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.destroy_process_group()


if __name__ == "__main__":
    _torchrun_main(*sys.argv[1:4])
