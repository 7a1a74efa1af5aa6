"""benchmarks/norm.py's code path under the Triton interpreter (its `--device cpu` smoke test):
every op and launch-shape variant runs and reports a time, so the GPU machine's first run of
a new sweep is not spent on a broken script. Times mean nothing here.

Run with `TRITON_INTERPRET=1 python -m pytest tests/interpret` (skipped otherwise).
"""
from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET", "0").lower() not in ("1", "true", "yes", "on"):
    pytest.skip("Triton interpreter tests: run with TRITON_INTERPRET=1", allow_module_level=True)
pytest.importorskip("triton")

import norm as norm_bench  # noqa: E402


def test_norm_benchmark_runs_every_variant():
    rows, copy_gbs = norm_bench.run_size(40, 96, torch.device("cpu"), variants=True)
    ops = {(r["op"], r["config"] or "-") for r in rows}
    assert ("torch bf16 backward", "-") in ops and ("backward (dx, dgamma, dbeta)", "-") in ops
    forward_shapes = {cfg for op, cfg in ops if op == "fp8 forward + transpose"}
    backward_shapes = {cfg for op, cfg in ops if op.startswith("backward")}
    assert len(forward_shapes) == 1 + len(norm_bench.ROW_VARIANTS)
    assert len(backward_shapes) == 1 + len(norm_bench.BWD_VARIANTS)
    assert copy_gbs > 0 and all(r["ms"] > 0 for r in rows)
