"""fp8train.inspect: statistics against hand-computed values, the Inspector's hooks on a
tiny GPT (records match the quantizers' own amax bookkeeping), and `fp8train inspect`."""
import json
import math

import pytest
import torch

import fp8train
from fp8train import cli
from fp8train.inspect import FIELDS, Inspector, activation_grad, applied_scale, load, quantization_stats
from fp8train.models import GPT, GPTConfig

E4M3 = torch.float8_e4m3fn


def stats(x, scale, dtype=E4M3, sample=None):
    return dict(zip(FIELDS, quantization_stats(torch.tensor(x), torch.tensor(scale), dtype, sample).tolist()))


def test_stats_hand_computed():
    # e4m3fn: max 448, smallest subnormal 2**-9 ~ 0.00195. With scale 1:
    #   0.0      zero: neither saturated nor flushed, not counted among the nonzero values
    #   0.0004   below 2**-10 (half the smallest subnormal): casts to 0 -> flushed, error 0.0004
    #   1, -3, 2.5, 448   exact in e4m3 (2.5 = 1.25 * 2): no error
    #   500, -1000        |x| > 464 (448 + half the top step of 32): clamped to +-448, errors 52 and 552
    x = [0.0, 0.0004, 1.0, -3.0, 500.0, -1000.0, 2.5, 448.0]
    s = stats(x, 1.0)
    assert s["amax"] == 1000.0 and s["scale"] == 1.0 and s["numel"] == 8
    assert s["saturated"] == 2 / 8
    assert s["underflow"] == pytest.approx(1 / 7)  # one of the seven nonzero values
    signal = 0.0004**2 + 1 + 9 + 500**2 + 1000**2 + 2.5**2 + 448**2   # 1450720.25000016
    noise = 0.0004**2 + 52**2 + 552**2                                 # 307408.00000016
    assert s["sqnr_db"] == pytest.approx(10 * math.log10(signal / noise), rel=1e-9)  # 6.739 dB


def test_stats_with_scale_and_sampling():
    # scale 0.5: 1000 -> 500 still saturates, 500 -> 250 no longer does; 0.0004 -> 0.0002 flushes.
    s = stats([0.0004, 500.0, -1000.0, 3.0], 0.5)
    assert s["saturated"] == 1 / 4 and s["underflow"] == 1 / 4
    # Errors: 500 * 0.5 = 250 rounds to 256 in e4m3 (steps of 16 in [128, 256)), 3 * 0.5 = 1.5 is exact.
    q = torch.tensor([500.0 * 0.5]).to(E4M3).float().item()
    noise = 0.0004**2 + (500 - q / 0.5) ** 2 + (1000 - 448 / 0.5) ** 2
    signal = 0.0004**2 + 500**2 + 1000**2 + 9
    assert s["sqnr_db"] == pytest.approx(10 * math.log10(signal / noise), rel=1e-6)
    # sample=4 of 8 elements: every second one (0, 2, 4, 6); amax still sees all of them.
    s = stats([1.0, 1000.0, 2.0, 1000.0, 3.0, 1000.0, 4.0, 1000.0], 1.0, sample=4)
    assert s["numel"] == 4 and s["saturated"] == 0.0 and s["amax"] == 1000.0


def test_stats_edge_cases():
    assert math.isinf(stats([1.0, 2.0, 0.5], 1.0)["sqnr_db"])  # exact round trip: no noise
    assert math.isnan(stats([0.0, 0.0], 1.0)["sqnr_db"])       # no signal
    e5m2 = stats([70000.0, 1e-6], 1.0, torch.float8_e5m2)      # e5m2: max 57344, smallest 2**-16
    assert e5m2["saturated"] == 0.5 and e5m2["underflow"] == 0.5
    # Just above fp8_max rounds to fp8_max anyway: not counted (current scaling's own amax
    # times its scale can exceed 448 by a float32 rounding error).
    assert stats([450.0, 464.0, 1.0], 1.0)["saturated"] == 0.0
    assert stats([60000.0], 1.0, torch.float8_e5m2)["saturated"] == 0.0


def test_applied_scale_follows_the_recipe():
    x = torch.tensor([2.0, -7.0])
    current = fp8train.CurrentScalingQuantizer(fp8train.TensorRole.INPUT, E4M3)
    assert applied_scale(current, x).item() == 448 / 7
    delayed = fp8train.DelayedScalingQuantizer(fp8train.TensorRole.INPUT, E4M3, history_len=4)
    delayed.scale.fill_(3.0)
    assert applied_scale(delayed, x).item() == 3.0


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu", "swiglu"])
def test_activation_grad_matches_autograd(activation):
    from fp8train.modules.layernorm_mlp import activation_high_precision
    h = torch.randn(5, 8, requires_grad=True)
    da = torch.randn(5, 4 if activation == "swiglu" else 8)
    expected, = torch.autograd.grad(activation_high_precision(h, activation), h, da)
    torch.testing.assert_close(activation_grad(h.detach(), da, activation), expected)


def _train(model, inspector, recipe, steps):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(steps):
        x = torch.randint(0, 256, (2, 32))
        with inspector.step(step):
            with fp8train.autocast(recipe=recipe):
                _, loss = model(x, torch.roll(x, -1, 1))
            loss.backward()
            assert bool(model.blocks[0].proj._forward_hooks) == (step % inspector.every == 0)
        opt.step()
        opt.zero_grad()


def test_inspector_records_every_gemm_on_inspection_steps_only(tmp_path):
    model = GPT(GPTConfig.named("tiny", seq_len=32, n_layer=1))
    log = tmp_path / "numerics.jsonl"
    inspector = Inspector(model, every=2, path=log)
    _train(model, inspector, fp8train.DelayedScaling(amax_history_len=4), steps=3)
    inspector.close()
    records = load(log)
    assert records == json.loads(json.dumps(inspector.records))
    gemms = {"blocks.0.qkv", "blocks.0.proj", "blocks.0.mlp.fc1", "blocks.0.mlp.fc2"}
    assert {r["step"] for r in records} == {0, 2}
    assert {(r["layer"], r["role"]) for r in records} == {(g, role) for g in gemms
                                                          for role in ("input", "weight", "grad_output")}
    assert len(records) == 2 * 12 and not model.blocks[0].proj._forward_hooks
    by = {(r["layer"], r["role"]): r for r in records if r["step"] == 2}
    assert by[("blocks.0.proj", "grad_output")]["dtype"] == "float8_e5m2"
    # The last step's pending amaxes are what the kernels saw: exact for the plain Linear and
    # the weights, close for the norm output that the inspector recomputes in float32.
    layer = model.blocks[0]
    for role, q in (("input", layer.proj.input_quantizer), ("weight", layer.proj.weight_quantizer),
                    ("grad_output", layer.proj.grad_output_quantizer),
                    ("weight", layer.mlp.fc1_weight_quantizer)):
        rec = by[("blocks.0.proj" if q is not layer.mlp.fc1_weight_quantizer else "blocks.0.mlp.fc1", role)]
        assert rec["amax"] == q.amax_history[0].item() and rec["scale"] == q.scale.item()
    assert by[("blocks.0.qkv", "input")]["amax"] == pytest.approx(layer.qkv.input_quantizer.amax_history[0].item(),
                                                                  rel=1e-3)
    assert by[("blocks.0.mlp.fc1", "grad_output")]["amax"] == pytest.approx(
        layer.mlp.fc1_grad_output_quantizer.amax_history[0].item(), rel=0.1)
    assert all(r["sqnr_db"] is None or r["sqnr_db"] > 15 for r in records)


def test_inspector_sees_the_grad_output_of_every_part():
    """LayerNormLinear(in, (q, k, v)) casts the parts' gradients side by side as one
    GRAD_OUTPUT, zeros for a part without one: the inspector records that tensor."""
    model = torch.nn.Sequential(fp8train.LayerNormLinear(32, (32, 16, 16)))
    inspector = Inspector(model, every=1)
    x = torch.randn(6, 32, requires_grad=True)
    dq, dv = torch.randn(6, 32), 10 * torch.randn(6, 16)  # dv holds the amax
    with inspector.step(0):
        with fp8train.autocast(recipe=fp8train.DelayedScaling()):
            q, _, v = model(x)
        torch.autograd.backward((q, v), (dq, dv))  # k gets no gradient
    (rec,) = [r for r in inspector.records if r["role"] == "grad_output"]
    q_grad = model[0].grad_output_quantizer
    assert rec["numel"] == 6 * 64 and rec["amax"] == q_grad.amax_history[0].item() == dv.abs().max().item()


def test_inspector_skips_high_precision_steps_and_checks_arguments():
    model = GPT(GPTConfig.named("tiny", seq_len=32, n_layer=1))
    inspector = Inspector(model, every=1)
    with inspector.step(0):
        model(torch.zeros(1, 8, dtype=torch.long))[0].sum().backward()  # outside fp8train.autocast
    assert inspector.records == []
    with pytest.raises(ValueError, match="every"):
        Inspector(model, every=0)
    with pytest.raises(ValueError, match="no fp8train layers"):
        Inspector(torch.nn.Linear(16, 16))


def test_cli_inspect_plots(tmp_path, capsys):
    model = GPT(GPTConfig.named("tiny", seq_len=32, n_layer=1))
    log = tmp_path / "n.jsonl"
    inspector = Inspector(model, every=1, path=log)
    _train(model, inspector, fp8train.CurrentScaling(), steps=2)
    png = tmp_path / "n.png"
    assert cli.main(["inspect", str(log), "--plot", str(png)]) == 0
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    out = capsys.readouterr().out
    assert "blocks.0.mlp.fc2" in out and "SQNR" in out
    assert cli.main(["inspect", str(tmp_path / "missing.jsonl")]) == 1


def test_execution_paths_say_which_node_ran_and_why():
    # On the CPU every eager FP8 call runs the Python node; the GPU side (the C++ node for
    # every Linear of a converted HF Llama) is tests/gpu/test_hf_llama_gpu.py.
    model = torch.nn.Sequential(fp8train.Linear(32, 16), torch.nn.ReLU(), fp8train.Linear(16, 32))
    assert fp8train.inspect.execution_paths(model) == {"0": "no eager FP8 call yet", "2": "no eager FP8 call yet"}
    with fp8train.autocast():
        model(torch.randn(4, 32)).sum().backward()
    paths = fp8train.inspect.execution_paths(model)
    assert paths == {"0": "Python node: the C++ node runs on CUDA tensors only",
                     "2": "Python node: the C++ node runs on CUDA tensors only"}

