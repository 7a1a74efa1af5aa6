"""The demo and CLI run end to end (a few steps of a tiny configuration)."""
import subprocess
import sys

import pytest

from fp8train import cli, demo


def test_demo_runs_all_three_recipes(capsys):
    results = demo.main(["--device", "cpu", "--steps", "3", "--hidden", "32", "--ffn", "64", "--tokens", "32"])
    assert [r.name for r in results] == ["bf16", "fp8 delayed", "fp8 current"]
    assert all(len(r.losses) == 3 and r.val_loss > 0 for r in results)
    out = capsys.readouterr().out
    assert "gap vs bf16" in out and "fp8 current" in out


def test_cli_usage():
    assert cli.main(["--help"]) == 0
    assert cli.main(["nonsense"]) == 2


@pytest.mark.parametrize("entry", [[sys.executable, "-m", "fp8train", "--help"]])
def test_module_entry_point(entry):
    assert subprocess.run(entry, capture_output=True, text=True).returncode == 0
