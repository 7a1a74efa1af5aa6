"""benchmarks/numerics.py's code path on the CPU (tiny shape, 2 seeds, a few steps): every
recipe trains from the same weights and batches per seed, the gaps are to the same seed's BF16
run, fp8train runs carry inspect statistics per role. Losses on the CPU after a few steps say
nothing about FP8 numerics and are not checked beyond being finite and close."""
import json
import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import numerics  # noqa: E402

pytestmark = pytest.mark.slow  # a GPU benchmark's CPU smoke run: make test-all


def test_numerics_benchmark_runs_on_cpu(tmp_path):
    out = tmp_path / "numerics.json"
    numerics.main(["--device", "cpu", "--shapes", "tiny", "--seeds", "2", "--steps", "4", "--schedule", "cosine",
                   "--warmup", "2", "--recipes", "bf16,fp8 delayed", "--eval-every", "2", "--inspect-every", "2",
                   "--val-batches", "1", "--json", str(out)])
    shape = json.loads(out.read_text())["shapes"]["tiny"]
    runs = shape["runs"]
    assert [(r["seed"], r["recipe"]) for r in runs] == [(0, "bf16"), (0, "fp8 delayed"), (1, "bf16"), (1, "fp8 delayed")]
    # the same seed starts from the same weights and batches: the first losses agree closely
    assert abs(runs[0]["train_loss"][0][1] - runs[1]["train_loss"][0][1]) < 0.01
    assert runs[0]["train_loss"][0][1] != runs[2]["train_loss"][0][1]  # another seed, another model
    assert [s for s, _ in runs[1]["val_loss"]] == [2, 4]
    assert set(runs[1]["inspect"]) == {"input", "weight", "grad_output"} and "inspect" not in runs[0]
    gap = shape["summary"]["fp8 delayed"]["val_gap_pct"]
    assert gap["min"] <= gap["mean"] <= gap["max"] and all(math.isfinite(v) for v in gap.values())
    assert shape["summary"]["bf16"]["final_val"]["min"] > 0


def test_cosine_schedule_warms_up_then_decays_to_a_tenth():
    lrs = [numerics.lr_at(s, 100, "cosine", 10, 1.0) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    assert lrs[-1] == pytest.approx(0.1, abs=1e-3)
    assert numerics.lr_at(7, 100, "const", 10, 3e-4) == 3e-4
