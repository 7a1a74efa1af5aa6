"""Automatic per-layer precision (fp8train/precision.py) on CPU: the decision logic with
injected tables, the measuring path on tiny layers, the on-disk table, the report."""
from __future__ import annotations

import json

import pytest
import torch

import fp8train
from fp8train import precision
from fp8train.precision import FP8, HIGH, PrecisionTable, ShapeKey
from tests.helpers import own_precision_table

CPU = torch.device("cpu")
RECIPES = [pytest.param(fp8train.DelayedScaling, id="delayed"), pytest.param(fp8train.CurrentScaling, id="current")]


@pytest.fixture
def table(tmp_path):
    """A fresh table for this machine's CPU, saved under tmp_path; the old one comes back after."""
    with own_precision_table(CPU, tmp_path / "table.json") as t:
        yield t


def layers():
    torch.manual_seed(0)
    return {
        "Linear": lambda: fp8train.Linear(48, 32, params_dtype=torch.float32),
        "LayerNormLinear": lambda: fp8train.LayerNormLinear(48, 32, params_dtype=torch.float32),
        "LayerNormMLP": lambda: fp8train.LayerNormMLP(48, 64, activation="gelu_tanh", params_dtype=torch.float32),
    }


def twins(make):
    a = make()
    b = make()
    b.load_state_dict(a.state_dict())
    return a, b


def step(layer, x, recipe):
    x = x.detach().requires_grad_()
    with fp8train.autocast(recipe=recipe):
        y = layer(x)
    y.float().pow(2).sum().backward()
    return y.detach(), x.grad, [p.grad for p in layer.parameters()]


def test_recipe_option_is_validated():
    assert fp8train.DelayedScaling(auto_precision=True).auto_precision
    for cls in (fp8train.DelayedScaling, fp8train.CurrentScaling):
        with pytest.raises(ValueError, match="auto_precision must be a bool"):
            cls(auto_precision=1)


@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear", "LayerNormMLP"])
@pytest.mark.parametrize("recipe_cls", RECIPES)
def test_layer_choosing_high_precision_computes_exactly_the_high_precision_path(kind, recipe_cls, table):
    table.override(kind, HIGH)
    auto, plain = twins(layers()[kind])
    x = torch.randn(3, 7, 48, dtype=torch.bfloat16)
    y, dx, grads = step(auto, x, recipe_cls(auto_precision=True))
    # The reference: the same layer's own high-precision path in the activation dtype.
    xr = x.detach().requires_grad_()
    yr = plain.high_precision_forward(xr, torch.bfloat16)
    yr.float().pow(2).sum().backward()
    assert y.dtype == torch.bfloat16 and torch.equal(y, yr.detach())
    assert torch.equal(dx, xr.grad)
    for g, gr in zip(grads, [p.grad for p in plain.parameters()]):
        assert torch.equal(g, gr)
    assert all(q is None for q in auto.children()), "a high-precision layer creates no quantizers"
    (entry,) = auto.precision_choices.values()
    assert entry.choice == HIGH and entry.source == "override"


@pytest.mark.parametrize("kind", ["Linear", "LayerNormMLP"])
def test_layer_choosing_fp8_runs_the_fp8_path(kind, table):
    table.override("", FP8)
    auto, plain = twins(layers()[kind])
    x = torch.randn(20, 48, dtype=torch.bfloat16)
    got = step(auto, x, fp8train.DelayedScaling(auto_precision=True))
    want = step(plain, x, fp8train.DelayedScaling())
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert any(q is not None for q in auto.children())


def test_missing_entry_is_measured_once_and_saved(table, monkeypatch):
    layer = fp8train.Linear(32, 16, params_dtype=torch.float32)
    x = torch.randn(10, 32)
    with fp8train.autocast(recipe=fp8train.CurrentScaling(auto_precision=True)):
        layer(x)
    (key, entry) = next(iter(layer.precision_choices.items()))
    assert key == str(ShapeKey("Linear", (32, 16, 1), 16, "float32", "CurrentScaling"))
    assert entry.source == "measured" and entry.fp8_ms > 0 and entry.high_ms > 0
    assert entry.choice == (FP8 if entry.fp8_ms < entry.high_ms else HIGH)
    on_disk = json.loads(table.path.read_text())
    assert on_disk["device"] == table.device_name and key in on_disk["entries"]
    # Another layer of the same dims and a token count in the same bucket: no new measurement.
    monkeypatch.setattr(precision, "measure", lambda *a, **k: pytest.fail("measured twice"))
    other = fp8train.Linear(32, 16, params_dtype=torch.float32)
    with fp8train.autocast(recipe=fp8train.CurrentScaling(auto_precision=True)):
        other(torch.randn(2, 7, 32))
    assert other.precision_choices[key].choice == entry.choice


def test_layernorm_linear_with_parts_is_measured_and_runs_either_path(table):
    """out_features=(q, k, v): its key names the parts, the measurement runs the tuple of
    outputs backward, and a high-precision choice computes the layer's own high-precision
    path (one F.linear per part)."""
    layer = fp8train.LayerNormLinear(32, (32, 16, 16), params_dtype=torch.float32)
    x = torch.randn(10, 32)
    recipe = fp8train.CurrentScaling(auto_precision=True)
    with fp8train.autocast(recipe=recipe):
        layer(x)
    ((key, entry),) = layer.precision_choices.items()
    assert key == str(ShapeKey("LayerNormLinear", (32, "32+16+16", "LayerNorm", 1), 16, "float32", "CurrentScaling"))
    assert entry.source == "measured" and entry.fp8_ms > 0 and entry.high_ms > 0
    table.override("LayerNormLinear[32x32+16+16x", HIGH)
    with fp8train.autocast(recipe=recipe):
        ys = layer(x)
    want = layer.high_precision_forward(x, torch.float32)
    assert len(ys) == len(want) == 3 and all(torch.equal(y, w) for y, w in zip(ys, want))


def test_measuring_leaves_the_layer_state_alone(table):
    """Measurement runs a twin with its own quantizers: the layer's scaling state and
    parameters stay bit for bit what they were."""
    layer = fp8train.Linear(32, 16, params_dtype=torch.float32)
    recipe = fp8train.DelayedScaling(auto_precision=True)
    step(layer, torch.randn(8, 32), fp8train.DelayedScaling())  # quantizers exist and hold state
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    entry = precision.decide(layer, 1000, torch.float32, recipe, CPU)  # a new bucket: measured now
    assert entry.source == "measured"
    after = layer.state_dict()
    assert after.keys() == before.keys()
    for k, v in before.items():
        assert torch.equal(after[k], v), k


def test_overrides_replace_cached_choices(table):
    layer = fp8train.Linear(32, 16, params_dtype=torch.float32)
    x = torch.randn(8, 32)
    recipe = fp8train.DelayedScaling(auto_precision=True)
    table.override("Linear[32x16", HIGH)
    assert not layer.runs_fp8(x, recipe, torch.float32)
    table.override("Linear[32x16", FP8)
    assert layer.runs_fp8(x, recipe, torch.float32)
    table.entries.clear()
    table.overrides.clear()
    table.record(layer.precision_key(16, torch.float32, recipe), fp8_ms=2.0, high_ms=1.0)
    assert layer.runs_fp8(x, recipe, torch.float32), "cached until refresh()"
    precision.refresh()
    assert not layer.runs_fp8(x, recipe, torch.float32)


def test_table_round_trip_and_errors(tmp_path):
    t = PrecisionTable("NVIDIA H200", tmp_path / "t.json")
    key = ShapeKey("LayerNormMLP", (1024, 4096, "LayerNorm", "gelu", 1), 4096, "bfloat16", "DelayedScaling")
    assert t.record(key, 0.9, 0.6).choice == HIGH
    t.override("tokens<=64 ", FP8)
    back = PrecisionTable.load(t.path)
    assert back.lookup(key).choice == HIGH and back.lookup(key).high_ms == 0.6
    assert back.overrides == {"tokens<=64 ": FP8}
    with pytest.raises(ValueError, match="was measured on 'NVIDIA H200', not 'NVIDIA H100'"):
        PrecisionTable.load(t.path, "NVIDIA H100")
    with pytest.raises(ValueError, match="choice must be one of"):
        t.override("x", "bf16")
    bad = json.loads(t.path.read_text())
    bad["entries"][str(key)]["choice"] = "int8"
    t.path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="unknown choice 'int8'"):
        PrecisionTable.load(t.path)


@pytest.mark.parametrize("fp8_ms, want", [(0.5, FP8), (0.949, FP8), (0.951, HIGH), (0.99, HIGH), (1.0, HIGH),
                                         (1.2, HIGH)])
def test_fp8_must_be_clearly_faster(fp8_ms, want):
    """FP8 is chosen only at least FP8_MIN_GAIN (5%) faster than high precision; a closer win
    keeps high precision and says why."""
    assert precision.FP8_MIN_GAIN == 0.05
    t = PrecisionTable("NVIDIA H200")
    key = ShapeKey("Linear", (1024, 1024, 1), 256, "bfloat16", "DelayedScaling")
    entry = t.record(key, fp8_ms, 1.0)
    assert entry.choice == want and t.lookup(key) is entry
    assert ("fp8 not 5% faster" in entry.reason()) == (want == HIGH and fp8_ms < 1.0), entry.reason()


@pytest.mark.parametrize("tokens,want", [(1, 16), (16, 16), (17, 32), (4096, 4096), (4097, 8192)])
def test_token_buckets(tokens, want):
    assert precision.bucket(tokens) == want


def test_report_names_each_layer_and_its_reason(table):
    table.override("LayerNormMLP", HIGH)
    table.override("Linear[", FP8)
    model = torch.nn.Sequential(fp8train.LayerNormMLP(32, 64, params_dtype=torch.float32),
                                fp8train.Linear(32, 16, params_dtype=torch.float32),
                                fp8train.Linear(16, 16, params_dtype=torch.float32))
    with fp8train.autocast(recipe=fp8train.DelayedScaling(auto_precision=True)):
        model[1](model[0](torch.randn(4, 32)))
    text = precision.report(model)
    assert "0: high for LayerNormMLP[32x64xLayerNormxgelux1] tokens<=16 float32 DelayedScaling: override" in text
    assert "1: fp8 for Linear[32x16x1] tokens<=16 float32 DelayedScaling: override" in text
    assert "2: no auto-precision decision yet" in text


class _DriftingClock:
    """A fake clock for time_pair: each step call advances it by the step's cost times the
    machine's slowdown, which grows with every call (a host getting slower during the
    measurement)."""

    def __init__(self, drift: float):
        self.now, self.calls, self.drift = 0.0, 0, drift

    def step(self, cost: float):
        def run():
            self.calls += 1
            self.now += cost * (1 + self.drift * self.calls)
        return run

    def __call__(self) -> float:
        return self.now


def test_time_pair_interleaves_rounds():
    log = []
    clock = _DriftingClock(0.0)
    a, b = clock.step(2e-3), clock.step(1e-3)
    fa = lambda: (log.append("a"), a())  # noqa: E731
    fb = lambda: (log.append("b"), b())  # noqa: E731
    a_ms, b_ms = precision.time_pair(fa, fb, torch.device("cpu"), warmup=1, iters=2, blocks=2, clock=clock)
    assert "".join(log) == "ab" + "aabbbbaa" * 2  # warm-up, then blocks of rounds a b b a
    assert a_ms == pytest.approx(2.0) and b_ms == pytest.approx(1.0)


@pytest.mark.parametrize("drift", [0.002, 0.02])
def test_time_pair_keeps_the_faster_step_faster_while_the_host_slows(drift):
    """b costs 3% less than a, and the host slows by `drift` per step. Timing a's steps then
    b's (the old order) makes b look slower; interleaved blocks give b's 3% back."""
    clock = _DriftingClock(drift)
    a, b = clock.step(1.00), clock.step(0.97)
    a_ms, b_ms = precision.time_pair(a, b, torch.device("cpu"), warmup=0, iters=10, blocks=3, clock=clock)
    assert b_ms / a_ms == pytest.approx(0.97, rel=1e-9)

    clock = _DriftingClock(drift)  # the old order, for contrast: the drift decides
    a, b = clock.step(1.00), clock.step(0.97)

    def one_after_the_other(step) -> float:
        t0 = clock()
        for _ in range(30):
            step()
        return clock() - t0
    assert one_after_the_other(a) < one_after_the_other(b)
