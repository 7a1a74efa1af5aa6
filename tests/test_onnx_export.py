"""fp8train.export_onnx: the exported graph (Q/DQ pairs counted, scales read back, onnx.checker)
and its outputs in ONNX Runtime against the PyTorch FP8 inference forward (the model itself
under fp8train.autocast in torch.no_grad()), for every module type and the demo GPT.

Every case trains a few steps so scales exist, exports at batch 2 and runs ONNX Runtime at
batch 5 (dynamic batch). The max relative error max|ort - torch| / max|torch| of each case is
printed at the end of the module's run ("ONNX Runtime vs PyTorch FP8").
"""
import collections
import gc

import numpy as np
import onnx
import onnx.numpy_helper

import pytest
import torch

import fp8train
from fp8train import CurrentScaling, DelayedScaling
from fp8train.export import SUPPORTED_OPSETS, run_onnxruntime
from fp8train.models.gpt import GPT, GPTConfig
from fp8train.quantizer import _REGISTRY

# Tolerance on the max relative error. The graph computes what the layer computes: the same
# float32 norms and activations, the same FP8 casts, float32 GEMM accumulation, the same
# roundings to the activation dtype (bias included). Two things may differ:
#   * the order of float32 accumulation (ONNX Runtime's MatMul vs torch's): float32 ulps,
#     which can move one 16-bit output rounding (2^-8 relative for bf16);
#   * casts near an FP8 rounding tie: QuantizeLinear computes x / scale_inv, fp8train x * scale;
#     they differ in the last float32 bit, and where x * scale sits on a tie (bf16 inputs put
#     it there often: x and the amax behind the scale have 8-bit mantissas) the FP8 value
#     moves one e4m3 step (2^-3 of it), which moves every output of that row by that step
#     times a weight.
# Measured on CPU (2026-11-29): 0 for most cases, up to 7e-3 where a tie flipped (bf16), 5e-7
# for the float32 GPT. The tolerance allows a few flipped ties.
TOL = 2e-2
BATCH_EXPORT, BATCH_RUN = 2, 5
DELAYED = DelayedScaling(amax_history_len=16)


def _linear():
    return fp8train.Linear(48, 80), (7, 48)


def _linear_2d_no_bias():
    return fp8train.Linear(64, 32, bias=False), (64,)


def _ln_linear(norm, ln_out=False):
    return lambda: (fp8train.LayerNormLinear(64, 96, normalization=norm, return_layernorm_output=ln_out), (5, 64))


def _ln_linear_parts():
    return fp8train.LayerNormLinear(64, (64, 32, 32), return_layernorm_output=True), (5, 64)


def _mlp(act, norm):
    return lambda: (fp8train.LayerNormMLP(32, 112, activation=act, normalization=norm), (9, 32))


# (id, factory -> (module, per-sample input shape), FP8 GEMMs)
MODULES = [
    ("linear-3d", _linear, 1),
    ("linear-2d-nobias", _linear_2d_no_bias, 1),
    ("lnlinear-LayerNorm", _ln_linear("LayerNorm"), 1),
    ("lnlinear-RMSNorm-lnout", _ln_linear("RMSNorm", ln_out=True), 1),
    ("mlp-gelu-LayerNorm", _mlp("gelu", "LayerNorm"), 2),
    ("mlp-gelu_tanh-RMSNorm", _mlp("gelu_tanh", "RMSNorm"), 2),
    ("mlp-relu-LayerNorm", _mlp("relu", "LayerNorm"), 2),
    ("mlp-swiglu-RMSNorm", _mlp("swiglu", "RMSNorm"), 2),
    ("lnlinear-qkv-lnout", _ln_linear_parts, 1),
]
# Every module case in bf16 (the training dtype: the graph casts around Q/DQ); three in
# float32 as well (no casts). make test runs one case of each module kind in bf16 (~3 s
# each on a 2-core machine), make test-all the rest (slow).
FP32_CASES = ("linear-3d", "lnlinear-RMSNorm-lnout", "mlp-swiglu-RMSNorm")
FAST_CASES = ("linear-3d", "lnlinear-qkv-lnout", "mlp-swiglu-RMSNorm")
MODULE_CASES = [pytest.param(*m, dtype, id=f"{m[0]}-{tag}",
                             marks=() if tag == "bf16" and m[0] in FAST_CASES else pytest.mark.slow)
                for m in MODULES for dtype, tag in ((torch.bfloat16, "bf16"), (torch.float32, "fp32"))
                if dtype == torch.bfloat16 or m[0] in FP32_CASES]


@pytest.fixture(scope="module")
def errors(request):
    """Collects each case's max relative error and prints them after the module's tests."""
    found = {}
    yield found
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is None or capture is None or not found:
        return
    with capture.global_and_fixture_disabled():
        reporter.write_line("")
        reporter.write_line(f"ONNX Runtime vs PyTorch FP8, max |ort - torch| / max |torch| (tolerance {TOL:g}):")
        for name, err in found.items():
            reporter.write_line(f"  {name:45s} {err:.3g}")


def train(model, make_input, recipe, steps=3):
    """A few FP8 training steps, so every quantizer has a history and a scale."""
    for _ in range(steps):
        with fp8train.autocast(recipe=recipe):
            out = model(make_input())
        out = out[0] if isinstance(out, tuple) else out
        out.float().square().mean().backward()


def fp8_forward(model, x, recipe):
    # Entering autocast runs the per-step scale update first; the export afterwards writes the
    # scales this forward used (the cast itself only records an amax, it changes no scale).
    with torch.no_grad(), fp8train.autocast(recipe=recipe):
        return model(x)


def max_rel_err(out, ref) -> float:
    return float((out.double() - ref.double()).abs().max() / ref.double().abs().max())


def initializers(proto):
    return {t.name: onnx.numpy_helper.to_array(t) for t in proto.graph.initializer}


def qdq_pairs(proto):
    """The y_scale initializer value of every QuantizeLinear -> DequantizeLinear pair, after
    checking the pair's form: FLOAT8E4M3FN zero point, saturate=1, one scale for both."""
    nodes, inits = proto.graph.node, initializers(proto)
    consumers = collections.defaultdict(list)
    for n in nodes:
        for name in n.input:
            consumers[name].append(n)
    init_types = {t.name: t.data_type for t in proto.graph.initializer}
    scales = []
    for q in (n for n in nodes if n.op_type == "QuantizeLinear"):
        assert init_types[q.input[2]] == onnx.TensorProto.FLOAT8E4M3FN
        assert {a.name: a.i for a in q.attribute}.get("saturate", 1) == 1
        (dq,) = consumers[q.output[0]]
        assert dq.op_type == "DequantizeLinear" and dq.input[1:] == q.input[1:]
        assert all(c.op_type == "MatMul" for c in consumers[dq.output[0]])
        scales.append(float(inits[q.input[1]]) if q.input[1] in inits else None)  # None: computed in the graph
    assert sum(n.op_type == "DequantizeLinear" for n in nodes) == len(scales)
    return scales


def expected_delayed_scales(model):
    """1 / scale of every INPUT and WEIGHT quantizer: what the pairs must carry."""
    out = []
    for name, q in model.named_modules():
        if name.endswith(("input_quantizer", "weight_quantizer")):
            out.append(float(torch.reciprocal(q.scale)))
    return sorted(out)


def snapshot(model):
    state = {k: v.clone() for k, v in model.state_dict().items()}
    fp8 = {n: m.weight_fp8.fp8_data.clone() for n, m in model.named_modules()
           if getattr(m, "weight_fp8", None) is not None}
    gc.collect()  # quantizers of earlier tests' models may die in cycles at any time: count the live ones
    return state, fp8, len(_REGISTRY.live())


def assert_same_state(before, after):
    (s0, w0, n0), (s1, w1, n1) = before, after
    assert s0.keys() == s1.keys() and all(torch.equal(s0[k], s1[k]) for k in s0), "export changed the state_dict"
    assert all(torch.equal(w0[k].view(torch.uint8), w1[k].view(torch.uint8)) for k in w0), "export recast a weight"
    assert n0 == n1, "export created delayed-scaling quantizers"


def export_and_compare(tmp_path, model, shape, dtype, recipe, gemms, errors, name):
    train(model, lambda: torch.randn(BATCH_EXPORT, *shape, dtype=dtype, requires_grad=True), recipe)
    x = torch.randn(BATCH_RUN, *shape, dtype=dtype)
    ref = fp8_forward(model, x, recipe)
    before = snapshot(model)
    proto = fp8train.export_onnx(model, torch.randn(BATCH_EXPORT, *shape, dtype=dtype), tmp_path / "m.onnx")
    assert_same_state(before, snapshot(model))
    onnx.checker.check_model(onnx.load(tmp_path / "m.onnx"), full_check=True)
    scales = qdq_pairs(proto)
    assert len(scales) == 2 * gemms
    if isinstance(recipe, DelayedScaling):
        assert sorted(scales) == expected_delayed_scales(model)
    if dtype != torch.float32:  # ONNX Runtime's QuantizeLinear takes float32: the graph casts
        assert any(n.op_type == "Cast" for n in proto.graph.node)
    outs = run_onnxruntime(tmp_path / "m.onnx", x)
    refs = ref if isinstance(ref, tuple) else (ref,)
    assert len(outs) == len(refs)
    for out, r in zip(outs, refs):
        assert out.dtype == r.dtype and out.shape == r.shape
    err = max(max_rel_err(o, r) for o, r in zip(outs, refs))
    errors[name] = err
    assert err <= TOL, f"{name}: max relative error {err:.3g} > {TOL:.3g}"
    return proto


@pytest.mark.parametrize("name,factory,gemms,dtype", MODULE_CASES)
def test_module_matches_onnxruntime(tmp_path, errors, name, factory, gemms, dtype):
    model, shape = factory()
    export_and_compare(tmp_path, model, shape, dtype, DELAYED, gemms, errors, f"{name}-{str(dtype)[6:]}-delayed")


# make test runs the MLP (two GEMMs); the Linear and LayerNormLinear in make test-all.
@pytest.mark.parametrize("name,factory,gemms", [pytest.param(*MODULES[i], id=MODULES[i][0],
                                                             marks=pytest.mark.slow if i != 7 else ())
                                                for i in (0, 3, 7)])
def test_current_scaling_quantizes_activations_in_the_graph(tmp_path, errors, name, factory, gemms):
    model, shape = factory()
    proto = export_and_compare(tmp_path, model, shape, torch.bfloat16, CurrentScaling(), gemms, errors,
                               f"{name}-bf16-current")
    # Weights get a fixed scale from their amax; each activation's scale is computed in the graph.
    scales = qdq_pairs(proto)
    assert scales.count(None) == gemms
    assert sum(n.op_type == "ReduceMax" for n in proto.graph.node) == gemms


@pytest.mark.parametrize("recipe", [pytest.param(DELAYED, id="delayed"),
                                    pytest.param(CurrentScaling(), id="current", marks=pytest.mark.slow)])
def test_gpt_matches_onnxruntime(tmp_path, errors, recipe):
    cfg = GPTConfig.named("tiny", seq_len=32)
    model = GPT(cfg)
    tokens = lambda b: torch.randint(0, cfg.vocab_size, (b, 16))  # noqa: E731
    for _ in range(2):
        with fp8train.autocast(recipe=recipe):
            _, loss = model(tokens(BATCH_EXPORT), tokens(BATCH_EXPORT))
        loss.backward()
    x = tokens(BATCH_RUN)
    ref = fp8_forward(model, x, recipe)
    before = snapshot(model)
    proto = fp8train.export_onnx(model, tokens(BATCH_EXPORT), tmp_path / "gpt.onnx")
    assert_same_state(before, snapshot(model))
    assert model.training  # only the exported copy is in eval mode
    onnx.checker.check_model(proto, full_check=True)
    # Per block: QKV (LayerNormLinear), proj (Linear), fc1 and fc2 (LayerNormMLP).
    assert len(qdq_pairs(proto)) == 2 * 4 * cfg.n_layer
    (out,) = run_onnxruntime(tmp_path / "gpt.onnx", x)
    err = max_rel_err(out, ref)
    errors[f"gpt-tiny-fp32-{type(recipe).__name__}"] = err
    assert err <= TOL


def test_gpt_bf16_exports(tmp_path):
    # A bf16 GPT computes embeddings, attention and residual adds in bf16: the graph is valid
    # ONNX, but ONNX Runtime's CPU provider has no bf16 Add/MatMul, so it is not run here.
    model = GPT(GPTConfig.named("tiny", seq_len=32, n_layer=1), dtype=torch.bfloat16)
    with fp8train.autocast(recipe=DELAYED):
        model(torch.randint(0, 256, (2, 16)))
    proto = fp8train.export_onnx(model, torch.randint(0, 256, (2, 16)), tmp_path / "gpt.onnx")
    onnx.checker.check_model(proto, full_check=True)
    assert len(qdq_pairs(proto)) == 8


@pytest.mark.parametrize("opset", [19, pytest.param(20, marks=pytest.mark.slow)])
def test_older_opsets(tmp_path, opset):
    model = fp8train.Linear(32, 48)
    train(model, lambda: torch.randn(3, 32, dtype=torch.bfloat16), DELAYED)
    x = torch.randn(BATCH_RUN, 32, dtype=torch.bfloat16)
    ref = fp8_forward(model, x, DELAYED)
    proto = fp8train.export_onnx(model, torch.randn(2, 32, dtype=torch.bfloat16), tmp_path / "m.onnx", opset=opset)
    assert {o.version for o in proto.opset_import if o.domain == ""} == {opset}
    assert len(qdq_pairs(proto)) == 2
    (out,) = run_onnxruntime(tmp_path / "m.onnx", x)
    assert max_rel_err(out, ref) <= TOL


def test_static_batch(tmp_path):
    model = fp8train.Linear(32, 16)
    train(model, lambda: torch.randn(3, 32), DELAYED)
    proto = fp8train.export_onnx(model, torch.randn(2, 32), tmp_path / "m.onnx", dynamic_batch=False)
    dims = proto.graph.input[0].type.tensor_type.shape.dim
    assert [d.dim_value for d in dims] == [2, 32]


def test_never_run_model_is_refused(tmp_path):
    model = torch.nn.Sequential(fp8train.Linear(32, 32), torch.nn.GELU(), fp8train.LayerNormMLP(32, 64))
    with pytest.raises(RuntimeError, match=r"Linear\(in=32, out=32\).*never run a forward under fp8train.autocast"):
        fp8train.export_onnx(model, torch.randn(2, 32), tmp_path / "m.onnx")
    assert not (tmp_path / "m.onnx").exists()
    # Checked before anything is traced, for the layer that lacks scales, wherever it sits.
    with fp8train.autocast(recipe=DELAYED):
        model[0](torch.randn(2, 32))
    with pytest.raises(RuntimeError, match=r"LayerNormMLP\(hidden=32, ffn=64\).*fc1_input"):
        fp8train.export_onnx(model, torch.randn(2, 32), tmp_path / "m.onnx")


@pytest.mark.parametrize("opset", [17, 18, 24, True])
def test_unsupported_opset_is_refused(tmp_path, opset):
    model = fp8train.Linear(32, 32)
    with pytest.raises(ValueError, match=r"choose one of \(19, 20, 21, 22, 23\)"):
        fp8train.export_onnx(model, torch.randn(2, 32), tmp_path / "m.onnx", opset=opset)
    assert SUPPORTED_OPSETS == (19, 20, 21, 22, 23)


def test_high_precision_layer_exports_without_qdq(tmp_path):
    # Dims that are not multiples of 16 run in the activation dtype inside autocast: no Q/DQ.
    model = fp8train.Linear(24, 40)
    x = torch.randn(BATCH_RUN, 24)
    with pytest.warns(UserWarning, match="multiples of 16"):
        ref = fp8_forward(model, x, DELAYED)
    before = snapshot(model)
    proto = fp8train.export_onnx(model, torch.randn(2, 24), tmp_path / "m.onnx")
    assert_same_state(before, snapshot(model))
    assert model.training  # the exported copy went to eval(), not the model
    assert qdq_pairs(proto) == []
    (out,) = run_onnxruntime(tmp_path / "m.onnx", x)
    assert max_rel_err(out, ref) <= TOL


def test_export_twin_is_fp8_not_high_precision(tmp_path):
    # The comparison above would be vacuous if both sides ran in high precision.
    model, shape = _mlp("gelu", "LayerNorm")()
    train(model, lambda: torch.randn(2, *shape), DELAYED)
    x = torch.randn(BATCH_RUN, *shape)
    fp8 = fp8_forward(model, x, DELAYED)
    fp8train.export_onnx(model, torch.randn(2, *shape), tmp_path / "m.onnx")
    (out,) = run_onnxruntime(tmp_path / "m.onnx", x)
    with torch.no_grad():
        high = model(x)
    assert max_rel_err(out, high) > 1e-2 and max_rel_err(out, high) > 100 * max_rel_err(out, fp8)
    assert np.isfinite(out.numpy()).all()
