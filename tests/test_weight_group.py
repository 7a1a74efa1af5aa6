"""Grouped weight casts in compiled forwards (modules/weight_group.py, ops.cast_weights):
one operator casts every eligible weight of a converted model, each cast the one its layer
would make itself."""
import copy
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import fp8train
from fp8train import ops
from fp8train.kernels import grouped_cast
from fp8train.modules import weight_group
from fp8train.quantizer import Cast, DelayedScalingQuantizer, update_delayed_scales
from fp8train.roles import TensorRole

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def _calibrated(shape, seed, dtype=torch.float32, fp8=torch.float8_e4m3fn):
    """A weight and a calibrated delayed quantizer with a history."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(shape, generator=g) * (seed + 1)).to(dtype)
    q = DelayedScalingQuantizer(TensorRole.WEIGHT, fp8, history_len=4)
    q.cast(w)  # calibrates
    update_delayed_scales()
    return w, q


@pytest.mark.parametrize("transpose", [True, False], ids=["transpose", "plain"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_each_member_is_its_own_cast(dtype, transpose):
    """cast_weights against each quantizer's own cast, bit for bit: payload, transposed copy,
    scale_inv and the amax recorded in the history (odd shapes, an inf and a NaN)."""
    shapes = [(48, 32), (70, 130), (16, 16)]
    members = [_calibrated(s, i, dtype) for i, s in enumerate(shapes)]
    members[1][0][3, 4] = float("inf")
    members[2][0][0, 0] = float("nan")
    twins = [copy.deepcopy(q) for _, q in members]
    casts = ops.cast_weights([w for w, _ in members], [q.scaling_state() for _, q in members], torch.float8_e4m3fn,
                             transpose)
    for (w, q), twin, (data, data_t, scale_inv) in zip(members, twins, casts):
        want = twin.cast(w, transpose=transpose)
        assert torch.equal(data.view(torch.uint8), want.data.view(torch.uint8))
        assert (data_t is None) == (not transpose)
        if transpose:
            assert torch.equal(data_t.view(torch.uint8), want.data_t.view(torch.uint8))
        assert torch.equal(scale_inv, want.scale_inv)
        assert torch.equal(q.amax_history, twin.amax_history)


def test_layout_aligns_members():
    lay = grouped_cast.layout(((3, 16), (70, 130)), True)
    assert lay.offsets == (0, 256) and lay.offsets_t == (0, 256)
    assert lay.size == 256 + 9216 and lay.size_t == 256 + 10496  # 70 * 130 and 130 * 80 rounded up to 256


def test_bad_members_are_refused():
    w, q = _calibrated((32, 16), 0)
    with pytest.raises(ValueError, match="calibrated delayed"):
        fresh = DelayedScalingQuantizer(TensorRole.WEIGHT, torch.float8_e4m3fn, history_len=4)
        ops.cast_weights([w], [fresh.scaling_state()], torch.float8_e4m3fn, True)
    out = grouped_cast.flat_outputs(((32, 16),), torch.float8_e4m3fn, False, "cpu")[:3]
    with pytest.raises(ValueError, match="contiguous 2-D"):
        grouped_cast.cast_weights([w.t()], [q.scale], [q.amax_history], *out, False)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        grouped_cast.cast_weights([w.double()], [q.scale], [q.amax_history], *out, False)
    with pytest.raises(ValueError, match="as many"):
        grouped_cast.cast_weights([w], [], [q.amax_history], *out, False)
    with pytest.raises(ValueError, match="flat_outputs"):
        grouped_cast.cast_weights([w], [q.scale], [q.amax_history], *out, True)


# ----------------------------------------------------------------------------- a converted HF Llama

pytest.importorskip("transformers")
import hf_llama  # noqa: E402

_OPS = ("fp8train.cast_kernels", "fp8train.cast_weights")


def _op_calls(graphs) -> dict:
    counts = dict.fromkeys(_OPS, 0)
    for sub in (s for gm in graphs for s in gm.modules()):
        if isinstance(sub, torch.fx.GraphModule):
            for node in sub.graph.nodes:
                name = str(node.target).split(".default")[0]
                if node.op == "call_function" and name in counts:
                    counts[name] += 1
    return counts


def _recording_backend(graphs: list):
    from torch._dynamo.backends.common import aot_autograd

    aot = aot_autograd(fw_compiler=lambda gm, _: gm, bw_compiler=lambda gm, _: gm)

    def backend(gm, example_inputs):
        graphs.append(gm)
        return aot(gm, example_inputs)
    return backend


def _train(grouped: bool, recipe, monkeypatch):
    """A tiny converted HF Llama and its eager twin, step by step in one FP8 region each (one
    delayed-scaling update for both): the model's first step eager, then three compiled
    (fullgraph). Returns (the model's losses, the twin's, Dynamo's graphs, model)."""
    monkeypatch.setattr(weight_group, "GROUP_WEIGHT_CASTS", grouped)
    model = hf_llama.build_llama(hf_llama.SHAPES["tiny"], torch.device("cpu"))
    fp8train.convert(model, recipe, filter_fn=hf_llama.not_lm_head)
    twin = copy.deepcopy(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, twin)]
    graphs = []
    compiled = torch.compile(model, fullgraph=True, backend=_recording_backend(graphs))
    g = torch.Generator().manual_seed(0)
    losses = ([], [])
    for i in range(4):
        x, y = torch.randint(0, 256, (2, 64), generator=g), torch.randint(0, 256, (2, 64), generator=g)
        with torch.autocast("cpu", dtype=torch.bfloat16), fp8train.autocast(recipe=recipe):
            out = [(model if i == 0 else compiled)(input_ids=x, labels=y).loss, twin(input_ids=x, labels=y).loss]
        for loss, opt, record in zip(out, opts, losses):
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            record.append(loss.detach())
    return torch.stack(losses[0]), torch.stack(losses[1]), graphs, model


@pytest.mark.slow
def test_compiled_llama_casts_its_weights_in_one_op(monkeypatch):
    """14 Linears: one cast_weights call and no per-layer weight cast in the compiled graph
    (what is left: 8 tied input casts, 14 gradient casts), the eager twin's losses bit for
    bit (aot_eager runs the traced ops as they are), one graph (no recompile), the group
    disarmed and every pending slot empty after the steps."""
    torch._dynamo.reset()
    got, want, graphs, model = _train(True, fp8train.DelayedScaling(), monkeypatch)
    assert torch.equal(got, want), (got, want)
    assert len(graphs) == 1
    assert _op_calls(graphs) == {"fp8train.cast_kernels": 2 * 4 + 14, "fp8train.cast_weights": 1}
    layers = [m for m in model.modules() if isinstance(m, fp8train.Linear)]
    assert len(layers) == 14 and all(m._workspace.pending == [None] for m in layers)
    group = weight_group.WeightCastGroup.of(model)
    assert group.layers == layers and group.armed == group.filled == [False]
    assert all(m._workspace.group is group for m in layers)


@pytest.mark.slow
def test_ungrouped_graph_casts_each_weight(monkeypatch):
    """The switch off: the same model's graph casts each weight itself (14 more casts)."""
    torch._dynamo.reset()
    got, want, graphs, _ = _train(False, fp8train.DelayedScaling(), monkeypatch)
    assert torch.equal(got, want) and len(graphs) == 1
    assert _op_calls(graphs) == {"fp8train.cast_kernels": 2 * 4 + 14 + 14, "fp8train.cast_weights": 0}


@pytest.mark.slow
def test_not_grouped_for_current_scaling(monkeypatch):
    torch._dynamo.reset()
    _, _, graphs, _ = _train(True, fp8train.CurrentScaling(), monkeypatch)
    assert _op_calls(graphs)["fp8train.cast_weights"] == 0


def test_eligibility():
    """Grouped: a calibrated delayed quantizer of the active recipe over a plain 2-D weight;
    not: an uncalibrated one, another recipe's, a layer with CUDA-graph weight caching."""
    recipe = fp8train.DelayedScaling()
    layer = fp8train.Linear(32, 16)
    assert weight_group._quantizer_if_eligible(layer, recipe) is None  # no quantizers yet
    with fp8train.autocast(recipe=recipe):
        layer(torch.randn(4, 32))
    assert weight_group._quantizer_if_eligible(layer, recipe) is layer.weight_quantizer
    assert weight_group._quantizer_if_eligible(layer, fp8train.DelayedScaling(amax_history_len=8)) is None
    layer.weight_cast_skip = torch.zeros((), dtype=torch.int32)
    assert weight_group._quantizer_if_eligible(layer, recipe) is None


def test_convert_hooks_the_model_once(monkeypatch):
    """One group and one pair of hooks per model; an eager forward arms and disarms the
    group and casts nothing through it (eager layers never read the slots)."""
    monkeypatch.setattr(weight_group, "GROUP_WEIGHT_CASTS", True)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 16))
    fp8train.convert(model)
    fp8train.convert(model)  # nothing left to convert: the same group, hooked once
    group = weight_group.WeightCastGroup.of(model)
    assert len(group.layers) == 2 and len(model._forward_pre_hooks) == 1 and len(model._forward_hooks) == 1
    seen = []
    model[1].register_forward_pre_hook(lambda m, a: seen.append(list(group.armed)))
    with fp8train.autocast(recipe=fp8train.DelayedScaling()):
        model(torch.randn(4, 32))
    assert seen == [[True]] and group.armed == [False]
    assert all(m._workspace.pending == [None] for m in group.layers)


def test_pending_cast_is_taken_once():
    """A layer called twice in one forward takes the grouped cast once, then casts itself."""
    w, q = _calibrated((32, 16), 3)
    ws = fp8train.modules.weight_workspace.WeightWorkspace()
    marker = Cast(torch.zeros(32, 16, dtype=torch.float8_e4m3fn), None, torch.ones(1))
    ws.pending[0] = marker
    assert ws._get_traced(w, q, None, need_transpose=False) is marker
    assert ws.pending == [None]
    again = ws._get_traced(w, q, None, need_transpose=False)
    assert again is not marker and again.data.shape == (32, 16)
    ws.pending[0] = marker  # no transposed copy where the call needs one: cast anew
    assert ws._get_traced(w, q, None, need_transpose=True).data_t is not None
