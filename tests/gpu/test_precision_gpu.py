"""Auto precision on the GPU: the measuring path with real kernels and CUDA events, and a
layer that follows the measured choice. Which choice wins is a timing matter and is not
asserted (benchmarks/small.py shows it); what is asserted is that the table, the layer and
its outputs agree with each other."""
from __future__ import annotations

import pytest
import torch

import fp8train
from fp8train import precision
from fp8train.precision import FP8, PrecisionTable

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")


@pytest.fixture
def table(tmp_path):
    name = precision.device_name(DEV)
    saved = precision._TABLES.get(name)
    t = PrecisionTable(name, tmp_path / "table.json")
    precision.use_table(t)
    yield t
    precision._TABLES.pop(name, None)
    if saved is not None:
        precision._TABLES[name] = saved
    precision.refresh()


@pytest.mark.parametrize("recipe_cls", [fp8train.DelayedScaling, fp8train.CurrentScaling], ids=["delayed", "current"])
def test_measured_choice_is_followed(recipe_cls, table):
    torch.manual_seed(0)
    auto = fp8train.LayerNormMLP(256, 1024, activation="gelu_tanh", params_dtype=torch.bfloat16, device=DEV)
    plain = fp8train.LayerNormMLP(256, 1024, activation="gelu_tanh", params_dtype=torch.bfloat16, device=DEV)
    plain.load_state_dict(auto.state_dict())
    x = torch.randn(4, 100, 256, device=DEV, dtype=torch.bfloat16)
    with fp8train.autocast(recipe=recipe_cls(auto_precision=True)):
        y = auto(x)
    (key, entry) = next(iter(auto.precision_choices.items()))
    assert "LayerNormMLP[256x1024xLayerNormxgelu_tanhx1] tokens<=512 bfloat16" in key
    assert entry.source == "measured" and entry.fp8_ms > 0 and entry.high_ms > 0
    assert entry.choice == (FP8 if entry.fp8_ms < (1 - precision.FP8_MIN_GAIN) * entry.high_ms else precision.HIGH)
    if entry.choice == FP8:
        with fp8train.autocast(recipe=recipe_cls()):
            want = plain(x)
    else:
        want = plain.high_precision_forward(x, torch.bfloat16)
    assert torch.equal(y, want)
    assert table.path.exists()
