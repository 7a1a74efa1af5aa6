"""Tensor-parallel fp8train.Linear on CPU with gloo: column / row, with and without sequence
parallelism, against the single-process layer holding the full weights.

One process-group launch per world size (2 and 4 processes, file:// rendezvous, loopback
only) runs every case below, as in test_distributed_comm.py. Every rank builds the full
input, grad-output and layer from the case's seed, runs its shard of the TP layer, gathers
the shards back and compares them with (a) a single-process fp8train.Linear holding the full
weights under the same recipe and (b) the float64 nn.Linear computation. Asserted bounds are
against (b), the float64 reference (SQNR >= 25 dB outputs, >= 20 dB gradients, and within
1 dB of the single-process FP8 layer's own SQNR against float64, up to 60 dB); (a) is recorded too. Rank 0 prints every measured SQNR as a "TP-SQNR" JSON line (pytest -s).
"""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

import fp8train
from fp8train.distributed import delayed_quantizers, reduce_delayed_amaxes, tp_comm

import gloo_harness
from helpers import RecordDgradOverlap, sqnr_db

BF16, F32 = torch.bfloat16, torch.float32
WORLDS = (2, 4)
RECIPES = {"delayed": fp8train.DelayedScaling, "current": fp8train.CurrentScaling}
IN, OUT = 64, 128        # shards of 16 at W = 4 (row) and 32 (column)
SEQ, BATCH = 8, 3        # x (SEQ, BATCH, IN): 3-D, SP splits SEQ
MIN_OUT_DB, MIN_GRAD_DB = 25.0, 20.0


# --------------------------------------------------------------------------- helpers


def _same_everywhere(t) -> bool:
    flat = t.detach().reshape(-1).float().clone()
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return all(torch.equal(flat, g) for g in gathered)


def _gather(t, dim):
    """Every rank's t concatenated along dim (test-side unsharding)."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.detach().contiguous())
    return torch.cat(parts, dim)


def _chunk(t, dim, ctx):
    return t.chunk(ctx.world, dim)[ctx.rank].contiguous()


def _tp_layer(ctx, mode, sp, dtype, bias=True, overlap=False, reduce_dtype=None):
    torch.manual_seed(ctx.seed)
    return fp8train.Linear(IN, OUT, bias=bias, params_dtype=dtype, device=ctx.device, tp_group=dist.group.WORLD,
                           parallel_mode=mode, sequence_parallel=sp, tp_overlap=overlap, tp_reduce_dtype=reduce_dtype)


def _full_layer(ctx, dtype, bias=True):
    torch.manual_seed(ctx.seed)
    return fp8train.Linear(IN, OUT, bias=bias, params_dtype=dtype, device=ctx.device)


def _inputs(ctx, act_dtype):
    g = torch.Generator().manual_seed(ctx.seed + 1)
    x = torch.randn(SEQ, BATCH, IN, generator=g).to(ctx.device, act_dtype)
    dy = torch.randn(SEQ, BATCH, OUT, generator=g).to(ctx.device, act_dtype)
    return x, dy


def _local_io(ctx, mode, sp, x, dy):
    """This rank's input and grad-output for the TP layer, from the full ones."""
    if mode == "column":
        return (_chunk(x, 0, ctx) if sp else x), _chunk(dy, -1, ctx)
    return _chunk(x, -1, ctx), (_chunk(dy, 0, ctx) if sp else dy)


def _unshard_results(ctx, mode, sp, y, dx, layer):
    """The TP layer's output, dX, dW, db as the full tensors."""
    if mode == "column":
        y = _gather(y, -1)
        dx = _gather(dx, 0) if sp else dx
        dw, db = _gather(layer.weight.grad, 0), _gather(layer.bias.grad, 0)
    else:
        y = _gather(y, 0) if sp else y
        dx = _gather(dx, -1)
        dw, db = _gather(layer.weight.grad, 1), layer.bias.grad
    return y, dx, dw, db


def _step(layers, xs, dys, recipe):
    """One training step of each layer inside one fp8train.autocast region (whose entry
    updates every delayed scale in the process, so all layers step together)."""
    xs = [x.detach().clone().requires_grad_(True) for x in xs]
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    with fp8train.autocast(recipe=recipe):
        ys = [layer(x) for layer, x in zip(layers, xs)]
    for y, dy in zip(ys, dys):
        y.backward(dy)
    return [(y.detach(), x.grad) for y, x in zip(ys, xs)]


def _float64_reference(weight, bias, x, dy):
    x64 = x.double().requires_grad_(True)
    w64 = weight.detach().double().requires_grad_(True)
    b64 = bias.detach().double().requires_grad_(True)
    y = torch.nn.functional.linear(x64, w64, b64)
    y.backward(dy.double())
    return y.detach(), x64.grad, w64.grad, b64.grad


# --------------------------------------------------------------------------- cases


def case_matches_single_process(ctx, mode, sp, recipe, dtype, overlap=False, reduce=None):
    """Two steps (delayed: amaxes reduced over the group between them) of the TP layer
    against the full-weight single-process layer and float64. reduce: None (partial sums in the
    activation dtype, the default) or "fp32" (tp_reduce_dtype=torch.float32)."""
    recipe = RECIPES[recipe]()
    act_dtype = dtype  # bf16 params with bf16 activations; float32 params with float32 activations
    reduce_dtype = {None: None, "fp32": F32}[reduce]
    tp, full = _tp_layer(ctx, mode, sp, dtype, overlap=overlap, reduce_dtype=reduce_dtype), _full_layer(ctx, dtype)
    x, dy = _inputs(ctx, act_dtype)
    x_local, dy_local = _local_io(ctx, mode, sp, x, dy)
    for step in range(2):
        if step and isinstance(recipe, fp8train.DelayedScaling):
            reduce_delayed_amaxes(delayed_quantizers(tp), dist.group.WORLD)
        (y, dx), ref = _step((tp, full), (x_local, x), (dy_local, dy), recipe)
    got = _unshard_results(ctx, mode, sp, y, dx, tp)
    ref = ref + (full.weight.grad, full.bias.grad)
    exact = _float64_reference(full.weight, full.bias, x, dy)
    names = ("y", "dx", "dw", "db")
    metrics = {}
    for name, g, r, e in zip(names, got, ref, exact):
        assert g.shape == r.shape, f"{name}: shape {tuple(g.shape)} vs {tuple(r.shape)}"
        metrics[name] = {"vs_fp8_single": round(sqnr_db(g, r), 1), "vs_float64": round(sqnr_db(g, e), 1),
                         "single_vs_float64": round(sqnr_db(r, e), 1)}
        bound = MIN_OUT_DB if name == "y" else MIN_GRAD_DB
        assert metrics[name]["vs_float64"] >= bound, f"{name}: {metrics[name]} (bound {bound} dB vs float64)"
        # ... and sharding costs no accuracy: within 1 dB of the single-process FP8 layer's
        # (capped at 60 dB: a float32 bias gradient sits near 140 dB, float32 summation order)
        floor = min(metrics[name]["single_vs_float64"] - 1.0, 60.0)
        assert metrics[name]["vs_float64"] >= floor, f"{name}: {metrics[name]}"
    # Scales that a gather decodes with one scale_inv must agree on every rank.
    if mode == "column":
        assert _same_everywhere(tp.input_quantizer.scale), "column: input scales differ across ranks"
    if sp and mode == "row":
        assert _same_everywhere(tp.grad_output_quantizer.scale), "row+SP: grad-output scales differ across ranks"
    if mode == "row" and not sp:
        assert _same_everywhere(tp.grad_output_quantizer.scale), "row: grad-output scales differ across ranks"
        assert _same_everywhere(tp.bias.grad), "row: the bias gradient differs across ranks"
    return metrics


def case_autocast_reduces_amaxes(ctx):
    """autocast(amax_reduction=group): the pending amaxes of every live delayed quantizer are
    reduced over the group before the update, so ranks that saw different data get the same
    scales; plain autocast leaves them rank-local."""
    torch.manual_seed(1234)  # the same layer on every rank ...
    layer = fp8train.Linear(64, 32, params_dtype=F32, device=ctx.device)
    recipe = fp8train.DelayedScaling(amax_history_len=4)
    x = torch.randn(8, 64).to(ctx.device) * (1.0 + ctx.rank)  # ... and data whose amax differs per rank
    for _ in range(2):
        with fp8train.autocast(recipe=recipe):
            layer(x).sum().backward()
    assert not _same_everywhere(layer.input_quantizer.scale), "rank-local amaxes should give rank-local scales"
    for _ in range(2):  # the first entry reduces the pending amax; the second step keeps them equal
        with fp8train.autocast(recipe=recipe, amax_reduction=dist.group.WORLD):
            layer(x).sum().backward()
    with fp8train.autocast(recipe=recipe, amax_reduction=dist.group.WORLD):
        pass
    for q in delayed_quantizers(layer):
        assert _same_everywhere(q.scale), f"{q.role.name}: scales differ across ranks after reduction"
        assert _same_everywhere(q.amax_history), f"{q.role.name}: histories differ across ranks after reduction"
    return {}


def case_overlap_matches_plain(ctx, mode, recipe):
    """tp_overlap (ring collective matmuls) against one collective + one GEMM, float32: the
    same casts, so equal up to float32 summation order (dW, from the same operands, exactly)."""
    recipe = RECIPES[recipe]()
    plain, ring = _tp_layer(ctx, mode, True, F32), _tp_layer(ctx, mode, True, F32, overlap=True)
    x, dy = _inputs(ctx, F32)
    x_local, dy_local = _local_io(ctx, mode, True, x, dy)
    (y0, dx0), (y1, dx1) = _step((plain, ring), (x_local, x_local), (dy_local, dy_local), recipe)
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx1, dx0, rtol=1e-5, atol=1e-5)
    assert torch.equal(ring.weight.grad, plain.weight.grad)
    assert torch.equal(ring.bias.grad, plain.bias.grad)


def case_dgrad_reduction_overlaps_wgrad(ctx, sp, sequential=False):
    """Column backward: dX's reduction (all-reduce, reduce-scatter under SP) is issued before
    the wgrad GEMM and waited for after it, so the two overlap. Inside
    tp_comm.sequential_reductions (the benchmarks' no-overlap baseline) it is waited for
    first, with the same gradient bits."""
    layer = _tp_layer(ctx, "column", sp, F32)
    x, dy = _inputs(ctx, F32)
    x_local, dy_local = _local_io(ctx, "column", sp, x, dy)

    def backward(order_ctx):
        xi = x_local.clone().requires_grad_(True)
        with fp8train.autocast(recipe=fp8train.CurrentScaling()):
            y = layer(xi)
        layer.weight.grad = None
        with order_ctx(), RecordDgradOverlap() as order:
            y.backward(dy_local)
        return order.events, xi.grad, layer.weight.grad

    events, dx, dw = backward(contextlib.nullcontext)
    assert events == ["issue", "wgrad", "done"], f"backward order: {events}"
    if sequential:
        events, dx_seq, dw_seq = backward(tp_comm.sequential_reductions)
        assert events == ["issue", "done", "wgrad"], f"sequential backward order: {events}"
        assert torch.equal(dx_seq, dx) and torch.equal(dw_seq, dw)


def case_outside_autocast(ctx, mode, sp):
    """Without fp8train.autocast the TP layer computes the full layer's float32 results."""
    tp, full = _tp_layer(ctx, mode, sp, F32), _full_layer(ctx, F32)
    x, dy = _inputs(ctx, F32)
    x_local, dy_local = _local_io(ctx, mode, sp, x, dy)
    xl = x_local.clone().requires_grad_(True)
    tp(xl).backward(dy_local)
    got = _unshard_results(ctx, mode, sp, tp(xl.detach()).detach(), xl.grad, tp)
    xf = x.clone().requires_grad_(True)
    full(xf).backward(dy)
    ref = (full(x).detach(), xf.grad, full.weight.grad, full.bias.grad)
    for name, g, r in zip(("y", "dx", "dw", "db"), got, ref):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


def case_init_is_slice_of_unsharded(ctx, mode, dtype):
    tp, full = _tp_layer(ctx, mode, False, dtype), _full_layer(ctx, dtype)
    dim = 0 if mode == "column" else 1
    assert torch.equal(tp.weight, _chunk(full.weight.detach(), dim, ctx))
    assert torch.equal(tp.bias, _chunk(full.bias.detach(), 0, ctx) if mode == "column" else full.bias.detach())


def case_state_dict_round_trip(ctx, mode, sp):
    """load_full_state_dict slices exactly; full_state_dict gathers exactly; quantizer state
    (from an FP8 step) is carried as is."""
    src = _full_layer(ctx, F32)
    x, dy = _inputs(ctx, F32)
    _step((src,), (x,), (dy,), fp8train.CurrentScaling())
    state = src.state_dict()
    g = torch.Generator().manual_seed(ctx.seed + 5)  # weights unlike the TP layer's own init
    state["weight"] = torch.randn(OUT, IN, generator=g).to(ctx.device)
    state["bias"] = torch.randn(OUT, generator=g).to(ctx.device)
    torch.manual_seed(ctx.seed + 99)
    tp = fp8train.Linear(IN, OUT, device=ctx.device, tp_group=dist.group.WORLD, parallel_mode=mode,
                         sequence_parallel=sp)
    tp.load_full_state_dict(state)
    dim = 0 if mode == "column" else 1
    assert torch.equal(tp.weight, _chunk(state["weight"], dim, ctx))
    assert torch.equal(tp.bias, _chunk(state["bias"], 0, ctx) if mode == "column" else state["bias"])
    back = tp.full_state_dict()
    assert back.keys() == state.keys(), f"{sorted(back)} vs {sorted(state)}"
    for k, v in state.items():
        assert torch.equal(back[k], v), f"{k} differs after the round trip"


def case_bad_configs(ctx):
    world = dist.group.WORLD
    bad = [
        (dict(parallel_mode="column"), "needs tp_group"),
        (dict(sequence_parallel=True), "needs parallel_mode"),
        (dict(tp_group=world), "without parallel_mode"),
        (dict(tp_group=world, parallel_mode="diagonal"), "must be None, 'column' or 'row'"),
        (dict(tp_group=world, parallel_mode="column", sequence_parallel=1), "must be a bool"),
        (dict(tp_group="world", parallel_mode="row"), "ProcessGroup"),
        (dict(tp_overlap=True), "needs parallel_mode"),
        (dict(tp_group=world, parallel_mode="column", tp_overlap=True), "needs sequence_parallel=True"),
        (dict(tp_reduce_dtype=F32), "tp_reduce_dtype needs parallel_mode"),
        (dict(tp_group=world, parallel_mode="row", tp_reduce_dtype=torch.int32), "tp_reduce_dtype must be one of"),
    ]
    for kw, msg in bad:
        with pytest.raises(ValueError, match=msg):
            fp8train.Linear(IN, OUT, **kw)
    with pytest.raises(ValueError, match="does not split evenly"):
        fp8train.Linear(IN, 16 * ctx.world + 16 * (ctx.world - 1) + 1, tp_group=world, parallel_mode="column")
    with pytest.raises(ValueError, match="multiples of 16"):
        fp8train.Linear(8 * ctx.world, OUT, tp_group=world, parallel_mode="row")
    with pytest.raises(ValueError, match="multiples of 16"):
        fp8train.Linear(IN, 24 * ctx.world, tp_group=world, parallel_mode="column")
    row_sp = fp8train.Linear(IN, OUT, device=ctx.device, tp_group=world, parallel_mode="row", sequence_parallel=True)
    with pytest.raises(ValueError, match="leading .sequence. dim"):
        row_sp(torch.randn(ctx.world + 1, IN // ctx.world, device=ctx.device))
    with pytest.raises(ValueError, match="takes this rank's input shard"):
        row_sp(torch.randn(ctx.world, IN, device=ctx.device))  # a row-parallel layer takes the input shard


def _cases():
    out = []

    def add(fn, worlds=WORLDS, **kw):
        out.append(gloo_harness.case(fn, worlds, **kw))

    for mode in ("column", "row"):
        for sp in (False, True):
            for recipe in RECIPES:
                for dtype in (BF16, F32):
                    add(case_matches_single_process, mode=mode, sp=sp, recipe=recipe, dtype=dtype)
            add(case_outside_autocast, mode=mode, sp=sp)
        for recipe in RECIPES:
            add(case_matches_single_process, mode=mode, sp=True, recipe=recipe, dtype=BF16, overlap=True)
            for overlap in (False, True):  # float32 partial sums under bf16 activations
                add(case_matches_single_process, mode=mode, sp=True, recipe=recipe, dtype=BF16, overlap=overlap,
                    reduce="fp32")
            add(case_overlap_matches_plain, mode=mode, recipe=recipe)
            add(case_state_dict_round_trip, worlds=(2,), mode=mode, sp=sp)
        for dtype in (BF16, F32):
            add(case_init_is_slice_of_unsharded, worlds=(2,), mode=mode, dtype=dtype)
    for sp in (False, True):
        add(case_dgrad_reduction_overlaps_wgrad, worlds=(2,), sp=sp)
    add(case_dgrad_reduction_overlaps_wgrad, worlds=(2,), sp=True, sequential=True)
    add(case_bad_configs)
    add(case_autocast_reduces_amaxes)
    return out


CASES = _cases()


# --------------------------------------------------------------------------- launch


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    return gloo_harness.cached_launcher(tmp_path_factory, __name__, "TP-SQNR")


@pytest.mark.parametrize("world, case_id", gloo_harness.world_params(CASES, WORLDS))
def test_case(launches, world, case_id):
    gloo_harness.check(launches(world)[0], case_id)


@pytest.mark.slow  # the world-2 cases again, under torchrun: make test-all
@pytest.mark.launch
def test_torchrun_launch(tmp_path):
    """The torchrun path that runs these cases on GPUs with NCCL (tests/gpu/test_tp_nccl_gpu.py),
    here with gloo: every case of world 2 reports, and none fails."""
    results, _ = gloo_harness.launch_torchrun(__name__, 2, str(tmp_path), "TP-SQNR")
    assert set(results) == {c[0] for c in CASES if 2 in c[3]}
    failed = {k: v for k, v in results.items() if v}
    assert not failed, "\n".join(f"{k}: {v}" for k, v in failed.items())
