"""FSDP2 (`torch.distributed.fsdp.fully_shard`) around fp8train models on CPU with gloo, 2 ranks
(3 and 4 in the slow tier), and the FP8 weight all-gather (issue 26). The cases run on any
device (inputs drawn on the CPU, then moved to ctx.device); tests/gpu/test_fsdp_gpu.py runs
them with NCCL, at 1 rank on a one-GPU machine.

Every rank builds the same model from one seed and wraps it as torchtitan does: each fp8train
module, then the root. Each rank trains on its half of every batch; an unsharded twin trains
on the whole batch on every rank. Compared per step: the FSDP loss (the mean of the ranks'
losses) with the twin's, relative difference <= 2e-3. Why not bit for bit: each rank sums its
half of the wgrad over tokens and FSDP's reduce-scatter adds the halves (another float32
order), and under current scaling each rank scales its half of the activations by that
half's amax. Under delayed scaling the ranks reduce their model's pending amaxes over the group before
each step's update (`reduce_delayed_amaxes(delayed_quantizers(model), group)`), so every rank
holds the same scales (checked). Not `fp8train.autocast(amax_reduction=group)`, which reduces
every live delayed quantizer of the process: a model of an earlier case, deleted but not yet
garbage-collected on one rank only, made the ranks' all-reduces differ in size (gloo aborted).
"""
from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fp8train
from fp8train.distributed import delayed_quantizers, reduce_delayed_amaxes

import gloo_harness

RECIPES = {"delayed": fp8train.DelayedScaling, "current": fp8train.CurrentScaling}
STEPS = 6
LOSS_RTOL = 2e-3


def _model(kind: str, device) -> nn.Module:
    """Two blocks of fp8train modules (`fused`), or plain nn.Linear layers converted by
    fp8train.convert (`converted`)."""
    if kind == "converted":
        model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64), nn.Linear(64, 64))
        return fp8train.convert(model).to(device)
    blocks = [nn.Sequential(fp8train.LayerNormLinear(64, 128), nn.GELU(), fp8train.Linear(128, 64),
                            fp8train.LayerNormMLP(64, 128)) for _ in range(2)]
    return nn.Sequential(*blocks).to(device)


def _batch(g: torch.Generator, ctx):
    """(x, y) (8, 6, 64) each: drawn on the CPU from `g` (the same numbers on every device),
    then moved to the case's device."""
    x, y = torch.randn(8, 6, 64, generator=g), torch.randn(8, 6, 64, generator=g)
    return x.to(ctx.device), y.to(ctx.device)


def _shard(model: nn.Module, **options) -> None:
    """fully_shard each fp8train module of `model` (already on the case's device), then the
    root, as torchtitan wraps blocks; options: fully_shard's (mesh, reshard_after_forward, ...)."""
    from torch.distributed.fsdp import fully_shard
    for m in model.modules():
        if isinstance(m, fp8train.modules.base.FP8Module):
            fully_shard(m, **options)
    fully_shard(model, **options)


def _fp8_gathered(ctx, recipe):
    """(model, optimizer): the converted model from the case's seed, its weights gathered in
    FP8, each Linear then the root fully_shard-ed."""
    from fp8train.distributed import fp8_all_gather
    torch.manual_seed(ctx.seed)
    model = _model("converted", ctx.device)
    fp8_all_gather(model, recipe)
    _shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _same_everywhere(t: torch.Tensor) -> bool:
    flat = t.detach().reshape(-1).float().clone()
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return all(torch.equal(flat, g) for g in gathered)


def _step_and_compare(loss, want, opts, step: int, rtol: float, what: str = "FSDP") -> None:
    """One optimizer step of the wrapped model (this rank's loss) and of its one-process twin
    (the whole batch's), then the ranks' mean loss against the twin's within rtol."""
    for lo, opt in zip((loss, want), opts):
        lo.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    got = loss.detach().clone()
    dist.all_reduce(got)
    got = float(got) / dist.get_world_size()
    assert abs(got - float(want)) <= rtol * float(want), f"step {step}: {what} loss {got} vs one process {float(want)}"


def case_trains_like_unsharded(ctx, kind: str, recipe: str, reshard: bool, mixed: bool = False,
                               fp8_gather: bool = False):
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from fp8train.distributed import fp8_all_gather
    torch.manual_seed(ctx.seed)
    model = _model(kind, ctx.device)
    twin = copy.deepcopy(model)
    if fp8_gather:  # the weights gathered in FP8, cast from the FP32 master shards
        assert fp8_all_gather(model, RECIPES[recipe]()) > 0
    options = {"reshard_after_forward": reshard}
    if mixed:  # bf16 compute copies of the FP32 master shards, gradients reduced in FP32
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    _shard(model, **options)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, twin)]
    r = RECIPES[recipe]()
    g = torch.Generator().manual_seed(ctx.seed)
    for step in range(STEPS):
        x, y = _batch(g, ctx)
        # the twin computes as FSDP's bf16 copies do: in bf16 (torch.autocast), master weights FP32
        twin_precision = torch.autocast(ctx.device.type, dtype=torch.bfloat16) if mixed else contextlib.nullcontext()
        if recipe == "delayed":  # every rank's pending amaxes become the group's maximum
            reduce_delayed_amaxes(delayed_quantizers(model), dist.group.WORLD)
        with fp8train.autocast(recipe=r):
            mine = x.chunk(ctx.world)[ctx.rank]
            loss = (model(mine).float() - y.chunk(ctx.world)[ctx.rank]).square().mean()
            with twin_precision:
                want = (twin(x).float() - y).square().mean()
        # bf16 weights against the twin's per-op autocast casts: 2e-2
        _step_and_compare(loss, want, opts, step, LOSS_RTOL if not mixed else 2e-2)
        if recipe == "delayed" and step > 0:  # the scales this step cast with, and the past amaxes
            for i, q in enumerate(delayed_quantizers(model)):  # (entry 0 is this step's own, not yet reduced)
                assert _same_everywhere(q.scale) and _same_everywhere(q.amax_history[1:]), f"quantizer {i} differs"
    for p in model.parameters():  # sharded FP32 masters, gradients reduced in FP32 also under bf16 compute
        assert type(p).__name__ == "DTensor" and p.dtype == torch.float32


def _train(model, opt, recipe, steps, ctx, g):
    losses = []
    for _ in range(steps):
        x, y = _batch(g, ctx)
        if isinstance(recipe, fp8train.DelayedScaling):
            reduce_delayed_amaxes(delayed_quantizers(model), dist.group.WORLD)
        with fp8train.autocast(recipe=recipe):
            loss = (model(x.chunk(ctx.world)[ctx.rank]) - y.chunk(ctx.world)[ctx.rank]).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return torch.stack(losses)


def case_checkpoint_resumes_bit_for_bit(ctx, recipe: str):
    """torch.distributed.checkpoint of a sharded converted model and its optimizer after 2
    steps, loaded into a fresh sharded model (quantizers made by convert(recipe=...)), then 2
    more steps: the losses, parameters and quantizer state of an uninterrupted 4-step run,
    bit for bit. The full state dict holds plain full-size weights and the quantizers."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                         set_state_dict)
    r = RECIPES[recipe]()

    def fresh():
        torch.manual_seed(ctx.seed)
        model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
        model = fp8train.convert(model, r).to(ctx.device)
        _shard(model)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    whole, whole_opt = fresh()
    want = _train(whole, whole_opt, r, 4, ctx, torch.Generator().manual_seed(ctx.seed))
    want_state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v.clone()
                  for k, v in whole.state_dict().items()}
    del whole, whole_opt

    first, first_opt = fresh()
    g = torch.Generator().manual_seed(ctx.seed)
    got = [_train(first, first_opt, r, 2, ctx, g)]
    # DCP writes one copy of a replicated buffer (one rank's): each rank's own pending amax
    # becomes the group's first, as the next step's entry would make it (no-op for current scaling)
    reduce_delayed_amaxes(delayed_quantizers(first), dist.group.WORLD)
    model_sd, optim_sd = get_state_dict(first, first_opt)
    path = f"{ctx.tmp}/dcp-{recipe}"
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    full = get_model_state_dict(first, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    del first, first_opt

    second, second_opt = fresh()
    model_sd, optim_sd = get_state_dict(second, second_opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(second, second_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    got.append(_train(second, second_opt, r, 2, ctx, g))
    assert torch.equal(torch.cat(got), want), (torch.cat(got), want)
    for k, v in second.state_dict().items():
        v = v.full_tensor() if hasattr(v, "full_tensor") else v
        assert torch.equal(v, want_state[k]), k
    if ctx.rank == 0:  # rank 0 holds the full state dict (cpu_offload)
        assert full["0.weight"].shape == (128, 64) and type(full["0.weight"]) is torch.Tensor
        assert "0.input_quantizer.scale" in full and "2.grad_output_quantizer.fp8_max" in full


def case_gradient_accumulation_keeps_the_fp8_weight(ctx, recipe: str):
    """Two microbatches per step under FSDP (reshard_after_forward=False, the gradient sync
    only on the last microbatch): is_first_microbatch=True casts each weight and keeps it,
    False reuses it (no weight cast: the delayed weight quantizers record no amax on the
    second microbatch). Losses against an unsharded twin accumulating the same microbatches
    of the whole batch, within the file's tolerance."""
    r = RECIPES[recipe]()
    torch.manual_seed(ctx.seed)
    model = _model("converted", ctx.device)
    twin = copy.deepcopy(model)
    _shard(model, reshard_after_forward=False)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, twin)]
    g = torch.Generator().manual_seed(ctx.seed)

    def run(m, x, y, first):
        h = x
        for layer in m:
            h = layer(h, is_first_microbatch=first) if isinstance(layer, fp8train.Linear) else layer(h)
        return (h - y).square().mean() / 2  # two microbatches: the mean over both
    for step in range(4):
        got = want = 0.0
        for micro in range(2):
            if recipe == "delayed":  # before every autocast entry: each one runs the scale update
                reduce_delayed_amaxes(delayed_quantizers(model), dist.group.WORLD)
            x, y = _batch(g, ctx)
            model.set_requires_gradient_sync(micro == 1)
            with fp8train.autocast(recipe=r):
                loss = run(model, x.chunk(ctx.world)[ctx.rank], y.chunk(ctx.world)[ctx.rank], micro == 0)
                twin_loss = run(twin, x, y, micro == 0)
            if micro == 1 and recipe == "delayed":  # the kept weights were not cast again
                assert all(float(m.weight_quantizer.amax_history[0]) == -1.0 for m in model
                           if isinstance(m, fp8train.Linear))
            loss.backward()
            twin_loss.backward()
            got, want = got + float(loss), want + float(twin_loss)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        total = torch.tensor(got, device=ctx.device)
        dist.all_reduce(total)
        got = float(total) / ctx.world
        assert abs(got - want) <= LOSS_RTOL * want, f"step {step}: FSDP loss {got} vs unsharded {want}"


_FP8_WEIGHTS = {"converted": 3, "fused": 8}  # per block: LayerNormLinear 1, Linear 1, LayerNormMLP 2 (fc1, fc2)


def _workspaces(model: nn.Module) -> list:
    """The FP8 weight workspaces (the layers' own weight casts) of model's fp8train layers."""
    names = ("_workspace", "_fc1_workspace", "_fc2_workspace")  # Linear, LayerNormLinear; LayerNormMLP
    return [getattr(m, n) for m in model.modules() for n in names if hasattr(m, n)]


def case_fp8_all_gather_is_the_master_gather_in_fp8(ctx, recipe: str, kind: str = "converted"):
    """fp8_all_gather(model, recipe) before fully_shard: every weight all-gather moves FP8
    bytes (uint8, a quarter of the FP32 master's), the layers take the gathered FP8 weights
    (their own weight casts never run), and training is bit for bit that of the same model
    whose FSDP gathers the FP32 master and casts it whole: the shards are cast with the scale
    the whole weight's cast uses (current scaling: the shards' amaxes all-reduced; delayed:
    the reduced history), so the gathered bytes are the whole weight's FP8 bytes. Outside
    fp8train.autocast the FP8-gathered layers compute with the dequantized weight, and say so."""
    from fp8train.distributed import fp8_all_gather
    r = RECIPES[recipe]()
    models = []
    for fp8_gather in (False, True):
        torch.manual_seed(ctx.seed)
        model = _model(kind, ctx.device)  # at 3 ranks its rows (128, 64, ...) shard unevenly
        if fp8_gather:
            assert fp8_all_gather(model, r) == _FP8_WEIGHTS[kind]
        _shard(model)
        models.append((model, torch.optim.AdamW(model.parameters(), lr=1e-3)))
    gathered = []  # (dtype, numel) of every all-gather, per model and step
    name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"  # FSDP2's
    original = getattr(dist, name)

    def recording(out, inp, *args, **kwargs):
        gathered.append((inp.dtype, inp.numel()))
        return original(out, inp, *args, **kwargs)
    g = torch.Generator().manual_seed(ctx.seed)
    for step in range(4):
        x, y = _batch(g, ctx)
        losses, dtypes = [], []
        if recipe == "delayed":  # both models' pending amaxes, before the one update of the step
            reduce_delayed_amaxes([q for m, _ in models for q in delayed_quantizers(m)], dist.group.WORLD)
        with fp8train.autocast(recipe=r):  # one region: each entry rolls every live quantizer
            for model, _ in models:
                gathered.clear()
                setattr(dist, name, recording)
                try:
                    loss = (model(x.chunk(ctx.world)[ctx.rank]) - y.chunk(ctx.world)[ctx.rank]).square().mean()
                    loss.backward()
                finally:
                    setattr(dist, name, original)
                losses.append(loss.detach())
                dtypes.append({d for d, _ in gathered})
        for _, opt in models:
            opt.step()
            opt.zero_grad(set_to_none=True)
        assert torch.equal(losses[0], losses[1]), f"step {step}: {losses}"
        # At 1 rank FSDP2 (torch 2.13) gathers nothing: it copies the pre-all-gather output
        # (the FP8 shard, here the whole weight) into the unsharded buffer, no collective
        if ctx.world > 1 or any(dtypes):
            assert dtypes[0] == {torch.float32}, dtypes
            assert dtypes[1] == {torch.uint8}, (step, dtypes)
    assert all(ws.fp8 is not None for ws in _workspaces(models[0][0]))
    assert all(ws.fp8 is None for ws in _workspaces(models[1][0]))  # the gathered FP8 weights, not own casts
    if ctx.device.type == "cuda" and kind == "converted":  # the C++ node takes the gathered weight too
        for model, _ in models:
            paths = set(fp8train.inspect.execution_paths(model).values())
            assert paths == {fp8train.modules.linear.CPP_NODE}, paths
    for pa, pb in zip(models[0][0].parameters(), models[1][0].parameters()):
        assert torch.equal(pa.full_tensor(), pb.full_tensor())
    mine = x.chunk(ctx.world)[ctx.rank]
    with torch.no_grad():
        with pytest.warns(UserWarning, match="computes with the dequantized FP8 weight"):
            got = models[1][0](mine)
        want = models[0][0](mine)  # the master weights, as torch computes
    # FP8-rounded weights (e4m3: ~3 % per weight), through 3 (converted) or 6 (fused) GEMMs: 4-9 % here
    assert 0 < (got - want).norm() <= 0.2 * want.norm(), float((got - want).norm() / want.norm())


def case_weights_cast_once_per_step(ctx, recipe: str):
    """reshard_after_forward frees each unsharded weight after the forward and gathers it again
    for the backward: that second FP8 pre-all-gather reuses the forward's bytes (the master
    and the scale are unchanged), so each weight is cast once per step, not twice; after the
    optimizer step (the masters change) and a delayed update (the scales change), cast again.
    The equality of the training with the master gather, with this cache in use, is
    case_fp8_all_gather_is_the_master_gather_in_fp8's."""
    from fp8train.distributed import fsdp
    r = RECIPES[recipe]()
    model, opt = _fp8_gathered(ctx, r)  # every Linear and the root reshard after forward
    casts = []
    original = fsdp.cast_consistent

    def counting(x, q, *args, **kwargs):
        casts.append(id(q))
        return original(x, q, *args, **kwargs)
    g = torch.Generator().manual_seed(ctx.seed)
    fsdp.cast_consistent = counting
    try:
        for step in range(3):
            casts.clear()
            _train(model, opt, r, 1, ctx, g)
            weights = [m.weight_quantizer for m in model if isinstance(m, fp8train.Linear)]
            assert sorted(casts) == sorted(id(q) for q in weights), f"step {step}: {len(casts)} casts"
    finally:
        fsdp.cast_consistent = original


def case_current_weight_scales_from_one_all_reduce_per_step(ctx):
    """Current scaling with the FP8 gather: precompute_fp8_weight_scales after each optimizer
    step gives every weight's scale from one all-reduce of all shards' amaxes, and the
    forward's gathers then reduce nothing; training is bit for bit that of the per-layer
    all-reduces (one per weight and gather)."""
    from fp8train.distributed import precompute_fp8_weight_scales
    r = fp8train.CurrentScaling()
    models = [_fp8_gathered(ctx, r) for _ in range(2)]
    reduces = []
    original = dist.all_reduce

    def counting(*args, **kwargs):
        reduces.append(1)
        return original(*args, **kwargs)
    dist.all_reduce = counting
    try:
        reduces.clear()
        assert precompute_fp8_weight_scales(models[1][0]) == 3 and len(reduces) == 1
        g = torch.Generator().manual_seed(ctx.seed)
        for step in range(4):
            x, y = _batch(g, ctx)
            losses, counts = [], []
            for i, (model, opt) in enumerate(models):
                reduces.clear()
                with fp8train.autocast(recipe=r):
                    loss = (model(x.chunk(ctx.world)[ctx.rank]) - y.chunk(ctx.world)[ctx.rank]).square().mean()
                counts.append(len(reduces))  # the forward's amax all-reduces (the gathers')
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if i == 1:
                    reduces.clear()
                    precompute_fp8_weight_scales(model)
                    assert len(reduces) == 1
                losses.append(loss.detach())
            assert counts == [3, 0], counts
            assert torch.equal(losses[0], losses[1]), f"step {step}: {losses}"
    finally:
        dist.all_reduce = original


def case_2d_mesh_fsdp_over_tp(ctx, recipe: str, sp: bool = False):
    """A 2 x 2 mesh (dp, tp) on 4 ranks: a column-parallel then a row-parallel fp8train.Linear
    over the mesh's tp groups, fully_shard over its dp groups. Each dp replica trains on half
    of every batch; the losses follow a single-process twin holding the full weights on the
    whole batch (the file's tolerance), and the delayed scales agree over the whole grid
    (amaxes reduced over tp, then dp). With `sp` (sequence parallelism) each tp rank holds
    half of its replica's sequence (dim 0): the column layer gathers it over tp in FP8 and the
    row layer reduce-scatters its output over tp, while FSDP gathers and reduce-scatters the
    weights over dp: the two shard on different mesh dims."""
    from torch.distributed.device_mesh import init_device_mesh
    from fp8train.distributed import AmaxReduction, reduce_delayed_amaxes
    mesh = init_device_mesh(ctx.device.type, (2, 2), mesh_dim_names=("dp", "tp"))
    tp, dp = mesh["tp"].get_group(), mesh["dp"].get_group()
    r = RECIPES[recipe]()

    def build(tp_group=None):
        torch.manual_seed(ctx.seed)  # the TP layers keep their shards of the unsharded draws
        kw = [{}, {}] if tp_group is None else [
            {"tp_group": tp_group, "parallel_mode": "column", "sequence_parallel": sp},
            {"tp_group": tp_group, "parallel_mode": "row", "sequence_parallel": sp}]
        return nn.Sequential(fp8train.Linear(64, 128, **kw[0]), nn.GELU(),
                             fp8train.Linear(128, 64, **kw[1])).to(ctx.device)
    model, twin = build(tp), build()
    _shard(model, mesh=mesh["dp"])
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, twin)]
    dp_rank, tp_rank = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    grid = AmaxReduction.tensor_and_data_parallel(tp, dp)

    def mine(t):  # this rank's part: its replica's half of the batch, and of that its sequence half
        t = t.chunk(2)[dp_rank]
        return t.chunk(2)[tp_rank].contiguous() if sp else t
    g = torch.Generator().manual_seed(ctx.seed)
    for step in range(5):
        x, y = _batch(g, ctx)
        if recipe == "delayed":
            reduce_delayed_amaxes(delayed_quantizers(model), grid)
        with fp8train.autocast(recipe=r):
            # with sp the replica's loss is the mean of its tp ranks' parts: each backpropagates
            # its half (the layers' tp collectives sum them)
            loss = (model(mine(x)) - mine(y)).square().mean() / (2 if sp else 1)
            want = (twin(x) - y).square().mean()
        for lo, opt in zip((loss, want), opts):
            lo.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        got = loss.detach().clone()
        if sp:
            dist.all_reduce(got, group=tp)
        dist.all_reduce(got, group=dp)
        got = float(got) / 2
        assert abs(got - float(want)) <= LOSS_RTOL * float(want), f"step {step}: {got} vs unsharded {float(want)}"
        if recipe == "delayed" and step > 0:
            for i, q in enumerate(delayed_quantizers(model)):
                assert _same_everywhere(q.scale), f"quantizer {i}: scales differ over the grid"


def case_compiled_matches_eager(ctx, recipe: str, eager_first: bool = True):
    """The torchtitan order (fp8_all_gather, fully_shard per layer and root, torch.compile,
    optimizer): after one eager step (which makes the activation quantizers), or from the
    first step (not eager_first: the converted root's first compiled call runs its forward once
    eagerly without gradients, fp8train.convert), the compiled model (aot_eager: Dynamo and
    AOTAutograd, no code generation) trains bit for bit like the same model left eager."""
    r = RECIPES[recipe]()
    runs = [list(_fp8_gathered(ctx, r)) for _ in range(2)]
    g = torch.Generator().manual_seed(ctx.seed)
    for step in range(4):
        x, y = _batch(g, ctx)
        if recipe == "delayed":
            reduce_delayed_amaxes([q for m, _ in runs for q in delayed_quantizers(m)], dist.group.WORLD)
        losses = []
        with fp8train.autocast(recipe=r):
            for i, (model, _) in enumerate(runs):
                m = torch.compile(model, backend="aot_eager") if (i == 1 and step == int(eager_first)) else model
                runs[i][0] = m
                loss = (m(x.chunk(ctx.world)[ctx.rank]) - y.chunk(ctx.world)[ctx.rank]).square().mean()
                loss.backward()
                losses.append(loss.detach())
        for _, opt in runs:
            opt.step()
            opt.zero_grad(set_to_none=True)
        assert torch.equal(losses[0], losses[1]), f"step {step}: {losses}"


def case_checkpoint_loads_into_another_world_size(ctx, recipe: str):
    """A checkpoint saved by a model sharded over 2 of the 4 ranks (trained 2 steps, its
    pending amaxes reduced first) and loaded by the same model sharded over all 4: the full
    model state (weights resharded, quantizers) is the saved one, and it trains on."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                         set_state_dict)
    from torch.distributed.device_mesh import DeviceMesh
    r = RECIPES[recipe]()
    path = f"{ctx.tmp}/dcp-reshard-{recipe}"
    pair_group = dist.new_group([0, 1])  # every rank makes it (a collective); ranks 0-1 use it
    pair = DeviceMesh.from_group(pair_group, ctx.device.type) if ctx.rank < 2 else None

    def sharded(mesh, seed):
        torch.manual_seed(seed)
        model = fp8train.convert(nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)), r).to(ctx.device)
        _shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)
    full_state = StateDictOptions(full_state_dict=True, cpu_offload=True)
    if ctx.rank < 2:
        model, opt = sharded(pair, ctx.seed)
        g = torch.Generator().manual_seed(ctx.seed)
        for _ in range(2):
            x, y = _batch(g, ctx)
            if recipe == "delayed":
                reduce_delayed_amaxes(delayed_quantizers(model), pair_group)
            with fp8train.autocast(recipe=r):
                loss = (model(x.chunk(2)[ctx.rank]) - y.chunk(2)[ctx.rank]).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        reduce_delayed_amaxes(delayed_quantizers(model), pair_group)  # see the resume case
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path, process_group=pair_group)
        want = get_model_state_dict(model, options=full_state)
        if ctx.rank == 0:
            torch.save(want, f"{path}-full.pt")
        del model, opt
    dist.barrier()
    model, opt = sharded(None, ctx.seed + 1)  # other initial weights: the load must replace them
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    got = get_model_state_dict(model, options=full_state)
    if ctx.rank == 0:
        want = torch.load(f"{path}-full.pt", weights_only=True)
        assert got.keys() == want.keys()
        for k in want:
            # current scaling's activation quantizers hold their rank's last scale and amax
            # (each rank casts its own batch; the next cast recomputes them): DCP keeps one
            # rank's copy, not necessarily rank 0's
            local = recipe == "current" and ("input_quantizer" in k or "grad_output_quantizer" in k) and \
                k.rsplit(".", 1)[1] in ("scale", "amax")
            assert local or torch.equal(got[k], want[k]), k
    losses = _train(model, opt, r, 2, ctx, torch.Generator().manual_seed(ctx.seed))
    assert torch.isfinite(losses).all()


def case_fp8_all_gather_leaves_tp_layers_alone(ctx):
    """fp8_all_gather on a column- then row-parallel Linear (over every rank) and a
    LayerNormMLP: the MLP's fc1 and fc2 are wrapped, the TP layers are not and one warning
    names both."""
    from fp8train.distributed import FP8GatherWeight, fp8_all_gather
    group = dist.group.WORLD
    model = nn.Sequential(fp8train.Linear(64, 128, tp_group=group, parallel_mode="column"),
                          fp8train.Linear(128, 64, tp_group=group, parallel_mode="row"),
                          fp8train.LayerNormMLP(64, 128)).to(ctx.device)
    with pytest.warns(UserWarning, match="fp8_all_gather: 2 fp8train layer") as caught:
        assert fp8_all_gather(model, fp8train.CurrentScaling()) == 2
    message = str(caught[0].message)
    assert "'0' (Linear(in=64, out=128, column-parallel" in message and "'1' (Linear" in message, message
    assert message.count("tensor-parallel (TP gathers its own weights)") == 2 and "'2'" not in message, message
    assert not isinstance(model[0].weight, FP8GatherWeight) and model[0].weight_quantizer is None
    assert isinstance(model[2].fc1_weight, FP8GatherWeight) and isinstance(model[2].fc2_weight, FP8GatherWeight)


def case_meta_init_trains_like_built_on_device(ctx, recipe: str, fp8_gather: bool = False):
    """torchtitan's way to build a big model: on the meta device, converted (with the recipe:
    the quantizers are on meta too), wrapped, then `to_empty` on the device and the weights
    written. The quantizers then hold a new quantizer's state (not the memory to_empty hands
    back), and the model trains as the same model built on the device, bit for bit."""
    from fp8train.distributed import fp8_all_gather
    r = RECIPES[recipe]()

    def layers():
        return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64), nn.Linear(64, 64))

    torch.manual_seed(ctx.seed)
    built = fp8train.convert(layers().to(ctx.device), r)
    with torch.device("meta"):
        meta = fp8train.convert(layers(), r)
    for m in (built, meta):
        if fp8_gather:
            fp8_all_gather(m, r)
        _shard(m)
    meta.to_empty(device=ctx.device)
    with torch.no_grad():
        for p, q in zip(meta.parameters(), built.parameters()):  # the init: this rank's shards
            p.copy_(q)
    for (name, a), b in zip(meta.state_dict().items(), built.state_dict().values()):
        assert torch.equal(a.full_tensor() if hasattr(a, "full_tensor") else a,
                           b.full_tensor() if hasattr(b, "full_tensor") else b), name
    models = (meta, built)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in models]
    g = torch.Generator().manual_seed(ctx.seed)
    for step in range(STEPS):
        x, y = _batch(g, ctx)
        if recipe == "delayed":
            reduce_delayed_amaxes(delayed_quantizers(meta) + delayed_quantizers(built), dist.group.WORLD)
        with fp8train.autocast(recipe=r):  # one region: a delayed update rolls both models' quantizers
            losses = [(m(x.chunk(ctx.world)[ctx.rank]) - y.chunk(ctx.world)[ctx.rank]).square().mean() for m in models]
        assert torch.equal(losses[0], losses[1]), f"step {step}: {losses}"
        for loss, opt in zip(losses, opts):
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)


def case_hf_llama_trains_like_unsharded(ctx, recipe: str):
    """A converted Hugging Face Llama as users shard one (HF's tiny shape, FP32 master weights
    under torch.autocast(bfloat16), fp8train.RMSNorm in place of HF's norms, each decoder layer
    then the root fully_shard-ed) trains as its unsharded twin on the whole batch; inside the
    shards the norms run their kernels and q/k/v and gate/up keep their shared input casts."""
    import sys
    from pathlib import Path
    from torch.distributed.fsdp import fully_shard
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import hf_llama
    torch.manual_seed(ctx.seed)
    model = hf_llama.build_llama(hf_llama.SHAPES["tiny"], ctx.device)
    fp8train.convert(model, filter_fn=hf_llama.not_lm_head)
    twin = copy.deepcopy(model)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, twin)]
    r = RECIPES[recipe]()
    g = torch.Generator().manual_seed(ctx.seed)
    for step in range(4):
        x = torch.randint(0, 256, (2 * ctx.world, 64), generator=g).to(ctx.device)
        if recipe == "delayed":
            reduce_delayed_amaxes(delayed_quantizers(model), dist.group.WORLD)
        with torch.autocast(ctx.device.type, dtype=torch.bfloat16), fp8train.autocast(recipe=r):
            mine = x.chunk(ctx.world)[ctx.rank]
            loss = model(input_ids=mine, labels=mine).loss
            want = twin(input_ids=x, labels=x).loss
        _step_and_compare(loss, want, opts, step, LOSS_RTOL)
    paths = fp8train.inspect.norm_paths(model)
    assert len(paths) == 5 and all(p.startswith("kernel") for p in paths.values()), paths
    assert len(fp8train.inspect.shared_input_casts(model)) == 4  # 2 layers x (q/k/v, gate/up)


# World 1 (NCCL on one GPU, tests/gpu/test_fsdp_gpu.py; the CPU suite runs worlds 2-4 only):
# FSDP2 still runs the FP8 pre/post all-gather hooks there, and the weight-amax all-reduces.
# Not at 1: the cases that need 4 ranks (a 2-rank sub-mesh, a 2 x 2 grid).
def _cases():
    out = []
    for kind in ("fused", "converted"):
        for recipe in RECIPES:
            out.append(gloo_harness.case(case_trains_like_unsharded, (1, 2), kind=kind, recipe=recipe, reshard=True))
    out.append(gloo_harness.case(case_trains_like_unsharded, (1, 2), kind="fused", recipe="delayed", reshard=False))
    out.append(gloo_harness.case(case_trains_like_unsharded, (1, 2), kind="converted", recipe="delayed", reshard=True,
                                 mixed=True))
    for recipe in RECIPES:  # the FP8 gather under a bf16 compute policy
        out.append(gloo_harness.case(case_trains_like_unsharded, (1, 2), kind="converted", recipe=recipe, reshard=True,
                                     mixed=True, fp8_gather=True))
    # the FP8 gather of LayerNormLinear, Linear and LayerNormMLP weights (FP32 compute)
    out.append(gloo_harness.case(case_trains_like_unsharded, (1, 2), kind="fused", recipe="current", reshard=True,
                                 fp8_gather=True))
    for recipe in RECIPES:
        out.append(gloo_harness.case(case_checkpoint_resumes_bit_for_bit, (1, 2), recipe=recipe))
        out.append(gloo_harness.case(case_checkpoint_loads_into_another_world_size, (4,), recipe=recipe))
        out.append(gloo_harness.case(case_gradient_accumulation_keeps_the_fp8_weight, (1, 2), recipe=recipe))
        out.append(gloo_harness.case(case_fp8_all_gather_is_the_master_gather_in_fp8, (1, 2, 3), recipe=recipe))
        out.append(gloo_harness.case(case_fp8_all_gather_is_the_master_gather_in_fp8, (1, 2, 3), recipe=recipe,
                                     kind="fused"))
    out.append(gloo_harness.case(case_current_weight_scales_from_one_all_reduce_per_step, (1, 2)))
    for recipe in RECIPES:
        out.append(gloo_harness.case(case_meta_init_trains_like_built_on_device, (1, 2), recipe=recipe))
    out.append(gloo_harness.case(case_meta_init_trains_like_built_on_device, (1, 2), recipe="current", fp8_gather=True))
    for recipe in RECIPES:
        out.append(gloo_harness.case(case_weights_cast_once_per_step, (1, 2), recipe=recipe))
    out.append(gloo_harness.case(case_fp8_all_gather_leaves_tp_layers_alone, (2,)))
    for recipe in RECIPES:
        out.append(gloo_harness.case(case_hf_llama_trains_like_unsharded, (1, 2), recipe=recipe))
    for recipe in RECIPES:  # at 3 ranks, in the slow tier: two Dynamo traces cost ~15 s of the 2-rank launch
        out.append(gloo_harness.case(case_compiled_matches_eager, (1, 3), recipe=recipe))
        out.append(gloo_harness.case(case_compiled_matches_eager, (1, 3), recipe=recipe, eager_first=False))
    for recipe in RECIPES:
        out.append(gloo_harness.case(case_2d_mesh_fsdp_over_tp, (4,), recipe=recipe))
        out.append(gloo_harness.case(case_2d_mesh_fsdp_over_tp, (4,), recipe=recipe, sp=True))
    return out


CASES = _cases()


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    return gloo_harness.cached_launcher(tmp_path_factory, __name__, "FSDP")


@pytest.mark.parametrize("world, case_id", gloo_harness.world_params(CASES, (2, 3, 4)))
def test_case(launches, world, case_id):
    gloo_harness.check(launches(world)[0], case_id)


def test_fp8_gather_weight_is_its_master_to_every_op():
    # FSDP2 shards and moves the weight with layout ops, which keep the wrapper (and its
    # extension points); everything else (an optimizer's arithmetic) runs on the master.
    from fp8train.distributed import FP8GatherWeight, fp8_all_gather
    model = nn.Sequential(fp8train.Linear(64, 32), fp8train.Linear(32, 48, bias=False), fp8train.Linear(48, 24))
    with pytest.warns(UserWarning, match="'2'"):  # 24 is not a multiple of 16: left alone
        assert fp8_all_gather(model, fp8train.DelayedScaling()) == 2
    w = model[0].weight
    assert isinstance(w, FP8GatherWeight) and isinstance(w, nn.Parameter) and w.requires_grad
    assert model[0].weight_quantizer is not None  # made now: the first gather is FP8 too
    master = w._master
    for part in (w.detach(), w.view(-1), w.split(16)[1], w.clone()):
        part = part[0] if isinstance(part, tuple) else part
        assert isinstance(part, FP8GatherWeight)
    doubled = w * 2
    assert type(doubled) is torch.Tensor and torch.equal(doubled, master * 2)
    with torch.no_grad():
        w.add_(1.0)
    assert w._master is master and torch.equal(master, (doubled / 2 + 1).detach())  # in place, on the master
    assert not isinstance(model[2].weight, FP8GatherWeight)


def test_fp8_all_gather_names_the_layers_it_leaves_alone():
    # One UserWarning per call naming every layer whose weights keep FSDP2's master-dtype
    # gather, by module path, and why (tensor-parallel layers: the 2-rank case above).
    from fp8train.distributed import FP8GatherWeight, fp8_all_gather
    model = nn.Sequential(fp8train.LayerNormLinear(64, 32), nn.Sequential(fp8train.Linear(32, 40)),
                          fp8train.LayerNormMLP(32, 64), fp8train.LayerNormMLP(32, 24))
    for attempt in range(2):  # the second call wraps nothing more and names the same layers again
        with pytest.warns(UserWarning) as caught:
            assert fp8_all_gather(model, fp8train.CurrentScaling()) == (3 if attempt == 0 else 0)
        assert len(caught) == 1, [str(w.message) for w in caught]
        message = str(caught[0].message)
        assert message.startswith("fp8_all_gather: 2 fp8train layer(s) keep FSDP2's master-dtype all-gather"), message
        assert "'1.0' (Linear(in=32, out=40)): dims not multiples of 16" in message, message
        assert "'3' (LayerNormMLP(hidden=32, ffn=24)): dims not multiples of 16" in message, message
        assert "'0'" not in message and "'2'" not in message, message
    for m, names in ((model[0], ("weight",)), (model[2], ("fc1_weight", "fc2_weight"))):
        for name in names:  # each weight's own GEMM's quantizer casts it
            w = getattr(m, name)
            assert isinstance(w, FP8GatherWeight) and w._quantizer_name == name + "_quantizer"
            assert getattr(m, w._quantizer_name) is not None
    assert not isinstance(model[3].fc1_weight, FP8GatherWeight)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing left alone: no warning
        assert fp8_all_gather(nn.Sequential(fp8train.Linear(32, 32)), fp8train.CurrentScaling()) == 1


def test_gpu_file_selects_cases_at_every_world_size():
    # tests/gpu/test_fsdp_gpu.py runs CASES under torchrun at min(GPUs, 4) ranks: at every such
    # world it selects cases (at 1, the FP8 gather of every module kind). No launch here.
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).parent / "gpu" / "test_fsdp_gpu.py"
    spec = importlib.util.spec_from_file_location("test_fsdp_gpu", path)
    gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu)
    ids = {c[0] for c in CASES}
    for world in (1, 2, 3, 4):
        assert gpu.selected(world) and set(gpu.selected(world)) <= ids, world
    for kind in ("", "-fused"):
        for recipe in RECIPES:
            assert f"fp8_all_gather_is_the_master_gather_in_fp8-{recipe}{kind}" in gpu.selected(1)
