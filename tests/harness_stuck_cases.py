"""Cases for tests/test_gloo_harness.py: one that passes, then one where rank 1 never joins
the collective rank 0 waits in (a hang), with a short per-case watchdog."""
import time

import torch
import torch.distributed as dist

CASE_TIMEOUT_S = 6  # short, yet far above what the fine case takes on a loaded 2-core CI machine


def case_fine(ctx):
    t = torch.ones(1, device=ctx.device)
    dist.all_reduce(t)
    assert t.item() == ctx.world


def case_rank1_never_joins(ctx):
    if ctx.rank == 1:
        time.sleep(120)  # far past the watchdog: this rank never reaches the barrier
    dist.barrier()


CASES = [("fine", case_fine, {}, (2,)), ("rank1_never_joins", case_rank1_never_joins, {}, (2,))]
