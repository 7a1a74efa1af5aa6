"""Probe (2+ GPUs, torchrun): where does the graphed tensor-parallel LayerNormMLP case of
tests/gpu/tp_graph_cases.py stop? Runs that one case on every rank with each stage printed
(make_graphed_callables, every graph capture's begin and end, every step) and every
thread's stack dumped if a rank is still inside after --timeout seconds.

--mode sets the capture_error_mode of every torch.cuda.graph capture (torch's
make_graphed_callables uses "global", under which a CUDA call from another thread, such as
the NCCL watchdog's event queries, invalidates the capture).

    torchrun --nproc-per-node 2 tools/probe_tp_graph.py [--overlap] [--mode thread_local]
"""
import argparse
import faulthandler
import os
import sys
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist

here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(here, "..", "tests"), os.path.join(here, "..", "tests", "gpu")]
import tp_graph_cases  # noqa: E402

import fp8train  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--overlap", action="store_true")
p.add_argument("--activation", default="gelu_tanh")
p.add_argument("--mode", default="global", choices=["global", "thread_local", "relaxed"])
p.add_argument("--timeout", type=float, default=45)
args = p.parse_args()

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
torch.cuda.set_device(device)
dist.init_process_group("nccl", device_id=device)
t0 = time.perf_counter()


def say(what):
    print(f"[rank {rank} {time.perf_counter() - t0:6.1f}s] {what}", file=sys.stderr, flush=True)


class _Graph(torch.cuda.graph):
    def __init__(self, cuda_graph, pool=None, stream=None, capture_error_mode="global", **kw):
        super().__init__(cuda_graph, pool=pool, stream=stream, capture_error_mode=args.mode, **kw)

    def __enter__(self):
        say("capture begin")
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        say(f"capture end{' (with ' + repr(exc[1])[:200] + ')' if exc[1] is not None else ''}")
        return out


torch.cuda.graph = _Graph
_mgc = fp8train.make_graphed_callables


def _traced_mgc(*a, **k):
    say("make_graphed_callables begin")
    out = _mgc(*a, **k)
    say("make_graphed_callables end")
    return out


tp_graph_cases.fp8train.make_graphed_callables = _traced_mgc
faulthandler.dump_traceback_later(args.timeout, exit=True)
ctx = SimpleNamespace(rank=rank, world=world, device=device, seed=1234, tmp="/tmp")
try:
    say(f"case overlap={args.overlap} activation={args.activation} mode={args.mode}")
    result = tp_graph_cases.case_graphed_matches_eager(ctx, args.overlap, args.activation)
    say(f"PASSED {result}")
except Exception as exc:  # noqa: BLE001
    say(f"FAILED {exc!r}"[:2000])
faulthandler.cancel_dump_traceback_later()
faulthandler.dump_traceback_later(args.timeout, exit=True)
say("teardown: gc, synchronize, destroy_process_group")
import gc  # noqa: E402
gc.collect()
torch.cuda.synchronize()
dist.destroy_process_group()
faulthandler.cancel_dump_traceback_later()
say("teardown done")
