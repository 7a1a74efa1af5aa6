"""The demo end to end (3 steps of a small configuration into a temporary folder), its
report.json schema, its settings, and the CLI entry points."""
import json
import subprocess
import sys

import pytest

from fp8train import cli, demo
from fp8train.demo.config import PRESETS, DemoConfig


@pytest.fixture(scope="module")
def demo_out(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo_out")
    assert cli.main(["demo", "--device", "cpu", "--steps", "3", "--batch-size", "2", "--seq-len", "32",
                     "--eval-every", "2", "--inspect-every", "2", "--out", str(out)]) == 0
    return out


def test_demo_writes_the_three_files(demo_out, capsys):
    for name in ("loss.png", "scaling.png", "report.json"):
        assert (demo_out / name).read_bytes()[:4 if name.endswith("png") else 1] in (b"\x89PNG", b"{"), name
    assert (demo_out / "numerics_fp8_delayed.jsonl").exists() and (demo_out / "numerics_fp8_current.jsonl").exists()


def test_report_schema(demo_out):
    report = json.loads((demo_out / "report.json").read_text())
    demo.check_report(report)
    assert [r["name"] for r in report["runs"]] == ["bf16", "fp8 delayed", "fp8 current"]
    assert report["runs"][0]["recipe"] is None and "DelayedScaling" in report["runs"][1]["recipe"]
    assert set(report["gaps"]) == {"fp8 delayed", "fp8 current"}
    assert report["config"]["steps"] == 3 and report["model"]["seq_len"] == 32
    assert report["device"]["type"] == "cpu" and report["versions"]["torch"]
    for run in report["runs"]:
        assert [s for s, _ in run["train_loss"]] == [1, 2, 3]
        assert [s for s, _ in run["val_loss"]] == [2, 3]  # every 2 steps and the last
        assert run["final_val_loss"] == run["val_loss"][-1][1] > 0
    bad = dict(report, runs=[{k: v for k, v in report["runs"][0].items() if k != "tokens_per_s"}])
    with pytest.raises(ValueError, match="tokens_per_s"):
        demo.check_report(bad)


def test_numerics_log_covers_the_fp8_runs(demo_out):
    from fp8train.inspect import load
    records = load(demo_out / "numerics_fp8_delayed.jsonl")
    assert {r["step"] for r in records} == {0, 2}
    assert {r["role"] for r in records} == {"input", "weight", "grad_output"}


def test_same_start_same_batches(demo_out):
    # The three runs start from the same weights and see the same first batch, so their
    # first losses agree to within the precision of the forward (bf16 vs FP8).
    report = json.loads((demo_out / "report.json").read_text())
    first = [r["train_loss"][0][1] for r in report["runs"]]
    assert max(first) - min(first) < 0.05 * first[0]


def test_config_checks_and_schedule():
    with pytest.raises(ValueError, match="steps"):
        DemoConfig(steps=0)
    with pytest.raises(ValueError, match="unknown GPT config"):
        DemoConfig(model="huge")
    cfg = DemoConfig(steps=100, warmup=10, lr=1.0, min_lr_ratio=0.1)
    assert cfg.lr_at(0) == 0.1 and cfg.lr_at(9) == 1.0 and cfg.lr_at(10) == 1.0
    assert cfg.lr_at(99) == pytest.approx(0.1, abs=1e-3)
    assert PRESETS["cuda"].model == "gpt125m" and PRESETS["cpu"].model == "tiny"
    with pytest.raises(SystemExit, match="steps"):
        demo.main(["--device", "cpu", "--steps", "-1"])


def test_cli_usage():
    assert cli.main(["--help"]) == 0
    assert cli.main(["nonsense"]) == 2


def test_module_entry_point():
    assert subprocess.run([sys.executable, "-m", "fp8train", "--help"], capture_output=True, text=True).returncode == 0


def test_replot_draws_the_figures_from_report_json(demo_out):
    for png in demo_out.glob("*.png"):
        png.unlink()
    assert demo.main(["--replot", "--out", str(demo_out)]) == []
    assert {p.name for p in demo_out.glob("*.png")} == {"loss.png", "scaling.png", "scaling_fp8_current.png"}
