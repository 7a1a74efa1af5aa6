"""The distributed test harness itself (tests/gloo_harness.py): a rank stuck in a case makes
its launch fail within seconds, with that rank's stack in the error output, instead of
running into the launch timeout (a GPU run once hung for minutes with no trace)."""
import time

import pytest

import gloo_harness

pytestmark = [pytest.mark.slow, pytest.mark.launch]  # checks of the harness, not of fp8train: make test-all


def test_a_stuck_rank_ends_a_gloo_launch(tmp_path, capfd):
    start = time.monotonic()
    with pytest.raises(Exception):
        gloo_harness.launch("harness_stuck_cases", 2, str(tmp_path))
    assert time.monotonic() - start < 60
    err = capfd.readouterr().err
    assert "case_rank1_never_joins" in err  # faulthandler's dump names the function it hung in


def test_a_stuck_rank_ends_a_torchrun_launch_with_its_stack(tmp_path):
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="torchrun exited") as exc:
        gloo_harness.launch_torchrun("harness_stuck_cases", 2, str(tmp_path))
    assert time.monotonic() - start < 90
    assert "case_rank1_never_joins" in str(exc.value)
    assert "rank 0: case fine" in str(exc.value) and "rank 1: case rank1_never_joins" in str(exc.value)
