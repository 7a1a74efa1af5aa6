"""Checkpoints of tensor-parallel layers with gloo on CPU (and under NCCL on GPUs through
tests/gpu/test_tp_nccl_gpu.py): load_full_state_dict / full_state_dict slice and gather
exactly (swiglu's [gate_r; up_r], Q/K/V parts), and sharded_state_dict through
torch.distributed.checkpoint restores every parameter and quantizer buffer bitwise, for
LayerNormMLP, LayerNormLinear (one output and Q/K/V parts) and the column / row Linear.
The modules, inputs and layouts come from test_tp_fused.py's helpers.
"""
from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.distributed as dist

import fp8train

import gloo_harness
from test_tp_fused import (BATCH, F32, FFN, HIDDEN, OUT, QKV, RECIPES, SEQ, WORLDS, _chunk, _io, _module,
                           _out_grads, _out_tuple, _param_specs, _run, _total)


def case_full_state_dict_round_trip(ctx, kind, activation="gelu_tanh"):
    """load_full_state_dict slices exactly (swiglu: [gate_r; up_r]); full_state_dict gathers
    exactly; quantizer state (from an FP8 step) is carried as is."""
    src = _module(ctx, kind, activation=activation)
    x, dy, d_ln = _io(ctx, kind, F32)
    _run(src, x, _out_grads(kind, dy), fp8train.CurrentScaling())
    state = src.state_dict()
    g = torch.Generator().manual_seed(ctx.seed + 5)  # parameters unlike the TP module's own init
    for name, _, _ in _param_specs(kind, activation):
        state[name] = torch.randn(state[name].shape, generator=g).to(ctx.device)
    tp = _module(ctx, kind, activation=activation, tp={"sp": True}, seed=ctx.seed + 99)
    tp.load_full_state_dict(state)
    for name, dim, parts in _param_specs(kind, activation):
        want = state[name] if dim is None else _chunk(state[name], dim, ctx, parts)
        assert torch.equal(getattr(tp, name), want), f"{name} was not sliced exactly"
    back = tp.full_state_dict()
    assert back.keys() == state.keys(), f"{sorted(back)} vs {sorted(state)}"
    for k, v in state.items():
        assert torch.equal(back[k], v), f"{k} differs after the round trip"
    sharded = _param_specs(kind, activation)[2][0]  # fc1_weight / weight
    with pytest.raises(ValueError, match="expected an unsharded"):
        tp.load_full_state_dict({**state, sharded: tp.state_dict()[sharded]})  # a shard is not the full tensor


def _dcp_dir(ctx) -> str:
    """A checkpoint directory every rank names alike, under the launch's directory."""
    return os.path.join(ctx.tmp, f"dcp-{ctx.seed}-world{ctx.world}")


def _layer(ctx, kind, seed, activation="swiglu"):
    if kind in ("column", "row"):
        torch.manual_seed(seed)
        return fp8train.Linear(HIDDEN, OUT, device=ctx.device, tp_group=dist.group.WORLD, parallel_mode=kind,
                               sequence_parallel=True)
    return _module(ctx, kind, activation=activation, tp={"sp": True}, seed=seed)


def _layer_input(ctx, kind, salt):
    g = torch.Generator().manual_seed(ctx.seed + salt)
    cols = HIDDEN // ctx.world if kind == "row" else HIDDEN
    rows = SEQ // ctx.world if kind != "row" else SEQ
    return torch.randn(rows, BATCH, cols, generator=g).to(ctx.device)


def case_dcp_round_trip(ctx, kind, recipe):
    """sharded_state_dict -> torch.distributed.checkpoint.save -> load into a fresh module
    (another init, its own FP8 step) -> load_sharded_state_dict: every parameter and quantizer
    buffer equals the saved module's bitwise, and the next FP8 step gives the same output."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor, Replicate, Shard

    recipe = RECIPES[recipe]()
    path = _dcp_dir(ctx)
    src, dst = _layer(ctx, kind, ctx.seed), _layer(ctx, kind, ctx.seed + 17)
    with fp8train.autocast(recipe=recipe):  # quantizers exist (and differ) in both
        _total(src(_layer_input(ctx, kind, 1))).backward()
        _total(dst(_layer_input(ctx, kind, 2))).backward()
    sd = src.sharded_state_dict()
    assert all(isinstance(t, DTensor) for v in sd.values() for t in (v if isinstance(v, list) else [v]))
    if kind == "mlp":  # swiglu: [gate; up] rows as (2, ffn, hidden), sharded on dim 1
        assert sd["fc1_weight"].shape == (2, FFN, HIDDEN) and sd["fc1_weight"].placements == (Shard(1),)
        assert sd["fc2_weight"].shape == (HIDDEN, FFN) and sd["fc2_weight"].placements == (Shard(1),)
        assert sd["layer_norm_weight"].placements == (Replicate(),)
    if kind == "row":
        assert sd["weight"].shape == (OUT, HIDDEN) and sd["bias"].placements == (Replicate(),)
    if kind == "qkv":  # [Q_r; K_r; V_r] is no DTensor's local part: one DTensor per part, each the unsharded part
        for name, dims in (("weight", (HIDDEN,)), ("bias", ())):
            assert [t.shape for t in sd[name]] == [(n, *dims) for n in QKV], name
            assert all(t.placements == (Shard(0),) for t in sd[name]), name
    dcp.save(sd, checkpoint_id=path)
    if kind == "qkv":  # what was saved is [Q; K; V] whatever the TP size: read back as plain full tensors
        full = src.full_state_dict()
        plain = {"weight": [torch.empty(n, HIDDEN, device=ctx.device) for n in QKV],
                 "bias": [torch.empty(n, device=ctx.device) for n in QKV]}
        dcp.load(plain, checkpoint_id=path)
        for name, parts in plain.items():
            assert torch.equal(torch.cat(parts), full[name]), f"the checkpoint's {name} is not [Q; K; V]"
    target = dst.sharded_state_dict()
    dcp.load(target, checkpoint_id=path)
    dst.load_sharded_state_dict(target)
    want = src.state_dict()
    have = dst.state_dict()
    assert have.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(have[k], v), f"{k} differs after the DCP round trip"
    x = _layer_input(ctx, kind, 3)
    with fp8train.autocast(recipe=recipe):
        ys = [_out_tuple(m(x)) for m in (src, dst)]
    assert all(torch.equal(a, b) for a, b in zip(*ys)), "the restored module computes differently"
    dist.barrier()
    if ctx.rank == 0:
        shutil.rmtree(path, ignore_errors=True)


def _cases():
    out = []
    for activation in ("swiglu", "gelu_tanh"):
        out.append(gloo_harness.case(case_full_state_dict_round_trip, WORLDS, kind="mlp", activation=activation))
    for kind in ("ln_linear", "qkv"):
        out.append(gloo_harness.case(case_full_state_dict_round_trip, WORLDS, kind=kind))
    for kind in ("mlp", "ln_linear", "column", "row", "qkv"):
        out.append(gloo_harness.case(case_dcp_round_trip, WORLDS, kind=kind,
                                     recipe="delayed" if kind in ("mlp", "row", "qkv") else "current"))
    return out


CASES = _cases()


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    return gloo_harness.cached_launcher(tmp_path_factory, __name__, "TP-CKPT")


@pytest.mark.parametrize("world, case_id", gloo_harness.world_params(CASES, WORLDS))
def test_case(launches, world, case_id):
    gloo_harness.check(launches(world)[0], case_id)
