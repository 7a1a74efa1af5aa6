"""benchmarks/tp.py's code path under torchrun on CPU (gloo), at N=1 and N=2: it runs, and
rank 0 writes one row per size with the three variants. Times on CPU mean nothing and are
not checked (the benchmark itself runs on the GPU machine)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import free_port

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # a GPU benchmark's CPU smoke run under torchrun: make test-all
@pytest.mark.launch
@pytest.mark.parametrize("world", [1, 2])
def test_tp_benchmark_runs_under_torchrun(world, tmp_path):
    out = tmp_path / "tp.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", str(ROOT / "benchmarks" / "tp.py"), "--device=cpu", "--hidden=64",
           "--tokens=64", "--warmup=1", "--iters=1", f"--json={out}"]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["meta"]["world"] == world
    (row,) = result["rows"]
    assert row["h"] == 64 and all(row[k] > 0 for k in ("bf16 TP", "fp8 TP", "fp8 TP overlap", "fp8 TP fp32-reduce"))
