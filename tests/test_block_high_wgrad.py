"""BlockScaling(fp8_wgrad=False): the fprop and dgrad GEMMs block-scaled in FP8 as with the
default, the wgrad in the activations' dtype from X and dY themselves, so neither is cast a
second time (no transposed copies) and X is kept in the activations' dtype for the backward.
The GPU side (times, the CUDA GEMMs): benchmarks/hf_llama.py's `hiwgrad` variants."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import fp8train
from fp8train import BlockScaling
from fp8train.modules import gated_mlp, stacked
from helpers import sqnr_db
from tests.test_gated_stacked import _NormedBlock, _batches, _model
from tests.test_shared_inputs import _train
from tests.test_stacked_siblings import _aot_recording_backend

HIGH = BlockScaling(fp8_wgrad=False)


def test_recipe_takes_fp8_wgrad_as_a_bool():
    assert BlockScaling().fp8_wgrad is True and HIGH.fp8_wgrad is False
    with pytest.raises(ValueError, match="fp8_wgrad"):
        BlockScaling(fp8_wgrad=0)


def _step(recipe, x, dy, params_dtype, autocast_bf16, seed=3):
    torch.manual_seed(seed)
    layer = fp8train.Linear(x.shape[-1], dy.shape[-1], params_dtype=params_dtype)
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast_bf16), fp8train.autocast(recipe=recipe):
        y = layer(x)
    y.backward(dy.to(y.dtype))
    return layer, x, y


@pytest.mark.parametrize("shape, n, x_dtype, autocast_bf16", [
    ((3, 45, 304), 272, torch.float32, True),     # FP32 master weights, float32 x under autocast (HF Llama)
    ((130, 128), 256, torch.bfloat16, False),     # bf16 x, float32 weights: bf16 activations
    ((2, 70, 256), 384, torch.float32, False),    # float32 throughout: the wgrad in float32
], ids=["autocast-f32-3d", "bf16-x", "f32"])
def test_wgrad_is_the_high_precision_product_and_the_rest_is_unchanged(shape, n, x_dtype, autocast_bf16):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g).to(x_dtype)
    dy = torch.randn(*shape[:-1], n, generator=g)
    base, xb, yb = _step(BlockScaling(), x, dy, torch.float32, autocast_bf16)
    high, xh, yh = _step(HIGH, x, dy, torch.float32, autocast_bf16)
    # the forward, dX (FP8 dgrad) and the bias gradient do not depend on the wgrad's precision
    assert torch.equal(yh, yb) and torch.equal(xh.grad, xb.grad)
    assert torch.equal(high.bias.grad, base.bias.grad)
    act = yh.dtype
    assert high.weight.grad.dtype == torch.float32
    # dW = dY^T X over the M rows, from the operands in the activations' dtype; the product
    # rounded once to that dtype (bf16: half an ulp, 2^-9 relative) plus float32 summation
    x2 = x.reshape(-1, shape[-1]).to(act).double()
    dy2 = dy.reshape(-1, n).to(act).double()
    want = dy2.t() @ x2
    m = x2.shape[0]
    ulp = 2.0**-8 if act == torch.bfloat16 else 2.0**-23
    bound = ulp * want.abs() + m * 2.0**-23 * (dy2.abs().t() @ x2.abs())
    assert ((high.weight.grad.double() - want).abs() <= bound).all()
    # closer to the float64 wgrad than the FP8 one (e4m3 operands: ~29 dB on such data)
    exact = dy.reshape(-1, n).double().t() @ x.reshape(-1, shape[-1]).double()
    assert sqnr_db(high.weight.grad, exact) > sqnr_db(base.weight.grad, exact) + 10.0


def _saved(recipe, x, dy):
    """(dtype, shape) of each tensor a BlockScaling Linear's step saves for its backward."""
    torch.manual_seed(0)
    layer = fp8train.Linear(x.shape[-1], dy.shape[-1], bias=False)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append((t.dtype, tuple(t.shape))), t)[1],
                                                 lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16), fp8train.autocast(recipe=recipe):
            y = layer(x.requires_grad_())
    y.backward(dy.to(y.dtype))
    return saved


def test_the_backward_keeps_x_itself_not_its_transposed_fp8_copy():
    x, dy = torch.randn(200, 256), torch.randn(200, 128)
    fp8 = torch.float8_e4m3fn
    base, high = _saved(BlockScaling(), x, dy), _saved(HIGH, x, dy)
    assert (fp8, (256, 256)) in base  # X^T's FP8 copy, rows padded to 256
    assert not any(dtype == fp8 for dtype, _ in high)
    assert (torch.bfloat16, (200, 256)) in high


def _row_casts(gm: torch.fx.GraphModule) -> dict:
    """Counts of the 1 x 128 casts in a graph and its subgraphs: fp8train::block_cast of row
    blocks and fp8train::block_cast_parts each with (both) or without its transposed copy,
    the gated and norm casts, which always make one, and their one-way forms that keep the
    computed values (fp8train::computed_block_cast_kept)."""
    n = {"both": 0, "one-way": 0, "parts both": 0, "parts one-way": 0, "fused": 0, "kept": 0}
    for sub in gm.modules():
        if not isinstance(sub, torch.fx.GraphModule):
            continue
        for node in sub.graph.nodes:
            name = str(node.target)
            if node.op != "call_function" or "fp8train" not in name:
                continue
            if name.removesuffix(".default").endswith(".block_cast") and not node.args[2]:  # (rows, dtype, tiles, both, pow2)
                n["both" if node.args[3] else "one-way"] += 1
            elif "block_cast_parts" in name:  # (parts, dtype, both, pow2)
                n["parts both" if node.args[2] else "parts one-way"] += 1
            elif "gated_block_cast" in name or "norm_block_cast" in name:
                n["fused"] += 1
            elif "computed_block_cast_kept" in name:
                n["kept"] += 1
    return n


@pytest.mark.parametrize("autocast_bf16", [False, True], ids=["fp32", "autocast-bf16"])
def test_compiled_llama_layer_casts_one_way_and_trains_as_eager(autocast_bf16, monkeypatch):
    """A converted Llama layer's shape (RMSNorms, a stacked q/k tie, a gated MLP of stacked
    gate/up) compiled after one eager step: one graph, the eager model's losses bit for bit,
    and no cast with a transposed copy (the default recipe's graph has them): the norms' and
    the gated MLP's casts one-way, keeping what the bf16 wgrads read; the stacked ties'
    gradients cast one way where they lie (no concatenated dY)."""
    monkeypatch.setattr(stacked, "EAGER", True)
    batches = _batches(4)
    torch.manual_seed(0)
    want = _train(_NormedBlock(), HIGH, batches, autocast_bf16)
    runs = {}
    for recipe in (HIGH, BlockScaling()):
        torch.manual_seed(0)
        model = _NormedBlock()
        _train(model, recipe, batches[:1], autocast_bf16)
        graphs = []
        compiled = torch.compile(model, fullgraph=True, backend=_aot_recording_backend(graphs, []))
        runs[recipe.fp8_wgrad] = _train(compiled, recipe, batches[1:], autocast_bf16), graphs
        assert len(graphs) == 1, f"{len(graphs)} graphs: recompiled"
    losses, graphs = runs[False]
    assert torch.equal(losses, want[1:]), (losses, want)
    casts = _row_casts(graphs[0])
    # o's input and gradient and down's gradient one way (down's input is the gated node's
    # cast); the q/k tie's gradients where they lie;
    # both norms' outputs, the product and dg | du computed and kept
    assert casts == {"both": 0, "one-way": 3, "parts both": 0, "parts one-way": 1, "fused": 0, "kept": 4}, casts
    default = _row_casts(runs[True][1][0])
    assert default == {"both": 3, "one-way": 0, "parts both": 1, "parts one-way": 0, "fused": 4, "kept": 0}, default
    # the same model trains alike with either wgrad (FP8's is within its rounding of BF16's)
    assert torch.allclose(runs[True][0], losses, rtol=0.02)


@pytest.mark.parametrize("autocast_bf16", [False, True], ids=["fp32", "autocast-bf16"])
def test_gated_node_keeps_the_product_and_trains_as_the_unfused_mlp(autocast_bf16, monkeypatch):
    """The stacked gate/up node under fp8_wgrad=False: its casts are one-way and keep the
    product (down's X, the node's output) and dg | du (gate/up's dY) for the bf16 wgrads.
    Four SGD steps with GATED on and off: the same losses and weights, bit for bit, and the
    gated casts once each way a step, each keeping its values."""
    monkeypatch.setattr(stacked, "EAGER", True)
    calls = []
    from fp8train import kernels
    for name in ("gated_block_cast", "gated_grad_block_cast"):
        fn = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _fn=fn, _name=name, **k: (
            calls.append((_name, k.get("keep") is not None and a[-5] is None)), _fn(*a, **k))[1])
    batches = _batches(rows=37)  # 74 tokens: a tail block of rows
    monkeypatch.setattr(stacked, "GATED", False)
    off = _model()
    want = _train(off, HIGH, batches, autocast_bf16)
    assert calls == []
    monkeypatch.setattr(stacked, "GATED", True)
    on = _model()
    got = _train(on, HIGH, batches, autocast_bf16)
    assert torch.equal(got, want), (got, want)
    for (name, p), q in zip(on.named_parameters(), off.parameters()):
        assert torch.equal(p, q), name
    assert calls == [("gated_block_cast", True), ("gated_grad_block_cast", True)] * 4
    assert on.mlp._path[0] == gated_mlp.GATED_NODE


def test_fused_modules_take_a_high_precision_wgrad():
    """LayerNormLinear and LayerNormMLP under BlockScaling run their GEMMs through the same
    node: their weights' gradients are the high-precision products too (SQNR against float64
    well above the FP8 wgrad's)."""
    torch.manual_seed(0)
    for layer in (fp8train.LayerNormLinear(256, 384, normalization="RMSNorm"),
                  fp8train.LayerNormMLP(256, 512, activation="swiglu", normalization="RMSNorm")):
        x = torch.randn(2, 70, 256)
        grads = {}
        for recipe in (BlockScaling(), HIGH, None):
            layer.zero_grad(set_to_none=True)
            if recipe is None:  # the layer's own high-precision path, float64
                ref = layer.double()
                ref(x.double()).pow(2).mean().backward()
                grads[None] = [p.grad.clone() for p in ref.parameters()]
                layer.float()
                continue
            with fp8train.autocast(recipe=recipe):
                layer(x).pow(2).mean().backward()
            grads[recipe.fp8_wgrad] = [p.grad.clone() for p in layer.parameters()]
        for i, (name, p) in enumerate(layer.named_parameters()):
            if p.dim() != 2:
                continue
            fp8_db, high_db = sqnr_db(grads[True][i], grads[None][i]), sqnr_db(grads[False][i], grads[None][i])
            assert high_db > fp8_db, (type(layer).__name__, name, fp8_db, high_db)


@pytest.mark.slow  # Inductor's C++ compiles
def test_inductor_compiled_llama_layer_trains_as_eager(monkeypatch):
    """The same layer through Inductor under autocast (the kept casts' operator opaque off
    CUDA, its fake shapes what Inductor allocates): the compiled losses follow the eager ones."""
    monkeypatch.setattr(stacked, "EAGER", True)
    batches = _batches(4)
    torch.manual_seed(0)
    want = _train(_NormedBlock(), HIGH, batches, True)
    torch.manual_seed(0)
    model = _NormedBlock()
    _train(model, HIGH, batches[:1], True)
    got = _train(torch.compile(model, fullgraph=True), HIGH, batches[1:], True)
    # the eager norm is fp8train's kernel twin, the compiled one the formula: float32 rounding
    # apart (1.2e-5 measured on the CPU, torch 2.13), as test_gated_stacked's Inductor check
    assert ((got - want[1:]).abs() / want[1:].abs()).max() < 1e-4, (got, want)
