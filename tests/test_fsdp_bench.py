"""benchmarks/fsdp.py's code path under torchrun on CPU (gloo), 2 ranks, tiny shape: it runs
every fp8train variant and rank 0 writes a row for each. Times on CPU mean nothing and are not
checked (the benchmark runs on the GPU machine)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import free_port

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # a GPU benchmark's CPU smoke run under torchrun: make test-all
@pytest.mark.launch
def test_fsdp_benchmark_runs_under_torchrun(tmp_path):
    out = tmp_path / "fsdp.json"
    variants = "bf16 fsdp,fp8 master-gather,fp8 fp8-gather,fp8 fp8-gather current"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", str(ROOT / "benchmarks" / "fsdp.py"), "--device=cpu", "--shapes=tiny",
           "--rounds=1", "--steps=1", "--profile-steps=0", f"--variants={variants}", f"--json={out}"]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["world"] == 2
    rows = result["shapes"]["tiny"]["rows"]
    assert [r["variant"] for r in rows] == variants.split(",")
    assert all(r["wall_ms"] > 0 and r["vs bf16 fsdp"] > 0 for r in rows)
