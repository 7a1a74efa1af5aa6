"""The C++ extension raises on bad arguments instead of ending the process: every entry point
(tests/extension_error_cases.py) called with bad arguments, in a subprocess, must raise a
Python exception, and the process must exit normally. On the GPU machine's torch 2.11 builds
a failed TORCH_CHECK with a number in its message ended the process with a segmentation
fault (kernels/native.py, LDFLAGS, says why)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fp8train.kernels import native

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the extension builds on Linux")


@pytest.fixture(scope="session")
def built():
    assert native.extension() is not None, f"the C++ extension did not build: {native.failure()}"


def test_every_entry_point_raises_on_bad_arguments(built, device):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "extension_error_cases.py"), str(device)],
                          env=env, capture_output=True, text=True, timeout=600)
    lines = done.stdout.splitlines()
    started = [line.split(" ", 1)[1] for line in lines if line.startswith("START ")]
    raised = {line.split(" ", 1)[1].split("\t")[0] for line in lines if line.startswith("RAISED ")}
    assert done.returncode == 0, (f"exit code {done.returncode} in case {started[-1] if started else None!r}:\n"
                                  + done.stderr[-3000:])
    returned = [line for line in lines if line.startswith("RETURNED ")]
    assert not returned, returned
    assert set(started) == raised and len(started) >= 25, done.stdout
    # The messages carry their numbers: the formatting path that crashed works.
    assert any("bad hole -5" in line for line in lines), done.stdout
