"""DistributedDataParallel around fp8train models on CPU with gloo, 2 ranks
(tests/gpu/test_ddp_gpu.py runs the same cases with NCCL under torchrun).

DDP is where most users go first when they outgrow one GPU. What it does to an FP8 model:
it averages the gradients (hooks on the parameters' gradient accumulators, which the C++
nodes reach like any autograd node), and with `broadcast_buffers=True` (its default) it
copies from rank 0 at each forward every buffer that existed when it was made: the
quantizers' scaling state where they were made before (`convert(model, recipe)`), not where
the first FP8 forward made them. So with delayed scaling the ranks cast with rank 0's
scales, or each with its own, unless they reduce their amaxes
(`fp8train.autocast(amax_reduction=group)`); then the scales are the group's and the
broadcast changes nothing.

Each rank trains on its share of every batch; an unwrapped twin trains on the whole batch
(the models and batches of tests/test_fsdp.py). Compared per step: the ranks' mean loss with
the twin's, relative difference <= 2e-3 (each rank's wgrad sums its rows and DDP's
all-reduce adds the ranks' sums: another float32 order; under current scaling each rank
scales its rows by their own amax), and every rank's parameters after the step bit for bit.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import fp8train
from fp8train.distributed import delayed_quantizers, reduce_delayed_amaxes

import gloo_harness
from test_fsdp import LOSS_RTOL, STEPS, _batch, _model, _same_everywhere, _step_and_compare

RECIPES = {"delayed": fp8train.DelayedScaling, "current": fp8train.CurrentScaling, "block": fp8train.BlockScaling}


def _wrapped(model, ctx, **options) -> DDP:
    return DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None, **options)


def case_trains_like_one_process(ctx, kind: str, recipe: str):
    torch.manual_seed(ctx.seed)
    model = _model(kind, ctx.device)
    twin = copy.deepcopy(model)
    ddp = _wrapped(model, ctx)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (ddp, twin)]
    r = RECIPES[recipe]()
    g = torch.Generator().manual_seed(ctx.seed)
    for step in range(STEPS):
        x, y = _batch(g, ctx)
        if recipe == "delayed":  # every rank's pending amaxes become the group's maximum
            reduce_delayed_amaxes(delayed_quantizers(model), dist.group.WORLD)
        with fp8train.autocast(recipe=r):
            loss = (ddp(x.chunk(ctx.world)[ctx.rank]).float() - y.chunk(ctx.world)[ctx.rank]).square().mean()
            want = (twin(x).float() - y).square().mean()
        _step_and_compare(loss, want, opts, step, LOSS_RTOL, "DDP")
        for name, p in model.named_parameters():
            assert _same_everywhere(p), f"step {step}: {name} differs between ranks"
        if recipe == "delayed" and step > 0:  # the first step calibrates each rank's scales on its own rows
            for i, q in enumerate(delayed_quantizers(model)):
                assert _same_everywhere(q.scale), f"step {step}: quantizer {i}'s scale differs between ranks"


def case_delayed_scales_without_amax_reduction(ctx):
    """No amax reduction, ranks fed different data. DDP broadcasts the buffers it found when
    it was made: quantizers made before (convert(model, recipe)) get rank 0's scales and amax
    history at every forward, so the ranks cast with one scale; with broadcast_buffers=False,
    or quantizers made after (on the first FP8 forward), each rank keeps its own."""
    recipe = fp8train.DelayedScaling()
    equal = {}
    for made_before, broadcast in ((True, True), (True, False), (False, True)):
        torch.manual_seed(ctx.seed)
        model = _model("converted", ctx.device)
        if made_before:
            for m in model.modules():
                if isinstance(m, fp8train.Linear):
                    m.quantizers(recipe, ctx.device)
        ddp = _wrapped(model, ctx, broadcast_buffers=broadcast)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(ctx.seed)
        for _ in range(3):
            x, y = _batch(g, ctx)
            x = x * (1 + ctx.rank)  # rank 1's inputs twice rank 0's: other amaxes
            with fp8train.autocast(recipe=recipe):
                loss = (ddp(x.chunk(ctx.world)[ctx.rank]) - y.chunk(ctx.world)[ctx.rank]).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        # the input quantizers' scales (those of the grad outputs follow the loss, alike on both ranks)
        equal[made_before, broadcast] = all(_same_everywhere(m.input_quantizer.scale) for m in model.modules()
                                            if isinstance(m, fp8train.Linear))
        del ddp, model, opt
    want = {(True, True): True, (True, False): ctx.world == 1, (False, True): ctx.world == 1}
    assert equal == want, equal


def _cases():
    out = []
    for recipe in RECIPES:
        out.append(gloo_harness.case(case_trains_like_one_process, (1, 2), kind="converted", recipe=recipe))
    for recipe in ("delayed", "current"):
        out.append(gloo_harness.case(case_trains_like_one_process, (1, 2), kind="fused", recipe=recipe))
    out.append(gloo_harness.case(case_delayed_scales_without_amax_reduction, (1, 2)))
    return out


CASES = _cases()


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    return gloo_harness.cached_launcher(tmp_path_factory, __name__, "DDP")


@pytest.mark.parametrize("world, case_id", gloo_harness.world_params(CASES, (2,)))
def test_case(launches, world, case_id):
    gloo_harness.check(launches(world)[0], case_id)
