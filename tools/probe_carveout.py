"""Probe (torchrun, N GPUs): does the bulk overlap (dX's reduce-scatter beside the wgrad GEMM)
hide anything, and does leaving SMs to NCCL while that wgrad runs help?

cuBLAS GEMMs fill every SM; an NCCL kernel queued beside one may only start when SMs free
up, so "beside" can still mean "after". torch._C._set_sm_carveout_experimental(n) makes
cuBLAS(Lt) GEMMs leave n SMs free. Variants of benchmarks/tp.py's SP LayerNormMLP block
(graphed fwd+bwd; the slowest rank's median): sequential (wait, then wgrad), bulk (the
default), bulk with a carveout of n SMs on the GEMMs issued while dX's reduction is pending
(fc1's wgrad only), and a carveout on every GEMM of the step (its cost alone).

    torchrun --nproc-per-node 2 tools/probe_carveout.py [--hidden 4096,8192]
"""
import argparse
import contextlib
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from tp import build_step, time_ms  # noqa: E402

from fp8train import gemm  # noqa: E402
from fp8train.distributed import tp_comm  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--hidden", default="4096,8192")
p.add_argument("--tokens", type=int, default=8192)
args = p.parse_args()
for var, val in (("NCCL_NVLS_ENABLE", "0"), ("NVSHMEM_DISABLE_NVLS", "1"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")):
    os.environ.setdefault(var, val)
torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
dist.init_process_group("nccl")
dev = torch.device("cuda", torch.cuda.current_device())
group, world, rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
set_carveout = getattr(torch._C, "_set_sm_carveout_experimental", None)
if set_carveout is None:
    raise SystemExit("this torch has no torch._C._set_sm_carveout_experimental")

pending = [0]
orig_start, orig_wait, orig_wgrad = tp_comm._start_sum, tp_comm.PendingReduction.wait, gemm.wgrad


@contextlib.contextmanager
def carveout_while_pending(n):
    """GEMMs (wgrad) issued while a dX reduction is pending leave n SMs free."""
    def start(*a, **k):
        pending[0] += 1
        return orig_start(*a, **k)

    def wait(self):
        if self._work is not None:
            pending[0] -= 1
        return orig_wait(self)

    def wgrad(*a, **k):
        if not pending[0]:
            return orig_wgrad(*a, **k)
        set_carveout(n)
        try:
            return orig_wgrad(*a, **k)
        finally:
            set_carveout(None)
    tp_comm._start_sum, tp_comm.PendingReduction.wait, gemm.wgrad = start, wait, wgrad
    try:
        yield
    finally:
        tp_comm._start_sum, tp_comm.PendingReduction.wait, gemm.wgrad = orig_start, orig_wait, orig_wgrad


@contextlib.contextmanager
def carveout_everywhere(n):
    set_carveout(n)
    try:
        yield
    finally:
        set_carveout(None)


variants = [("sequential", tp_comm.sequential_reductions), ("bulk", contextlib.nullcontext)]
variants += [(f"bulk, wgrad leaves {n} SMs", lambda n=n: carveout_while_pending(n)) for n in (8, 16, 32)]
variants += [("sequential, all GEMMs leave 16 SMs", lambda: _both(tp_comm.sequential_reductions(),
                                                                   carveout_everywhere(16)))]


@contextlib.contextmanager
def _both(a, b):
    with a, b:
        yield


for h in (int(v) for v in args.hidden.split(",")):
    torch.manual_seed(0)
    x = torch.randn(args.tokens // world, h, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    rows = []
    for _ in range(2):  # two interleaved rounds
        for name, ctx in variants:
            with ctx():
                step, block = build_step(h, group, dev, torch.bfloat16, x, dy, False, True, None, True)
                ms = time_ms(step, dev, 10, 30)
            t = torch.tensor([ms], dtype=torch.float64, device=dev)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            rows.append((name, float(t)))
            del step, block
            import gc
            gc.collect()
            torch.cuda.synchronize()
    if rank == 0:
        print(f"\nh={h}, N={world}, {args.tokens} tokens, graphed fwd+bwd (slowest rank; two rounds)")
        base = {}
        for name, ms in rows:
            base.setdefault(name, []).append(ms)
        seq = min(base["sequential"])
        for name, v in base.items():
            print(f"  {name:<36} {' '.join(f'{m:7.3f}' for m in v)} ms   best vs sequential {seq / min(v):.3f}x")
dist.destroy_process_group()
