"""The DDP cases of the CPU suite (tests/test_ddp.py) on GPUs with NCCL under torchrun: one
launch at WORLD = min(GPUs, 4) ranks (1 on a one-GPU machine), the cases unchanged (the
models' Linears on the C++ node after their first calls; DDP's gradient hooks fire from
it), with the CPU suite's tolerances. NVLink multicast stays off (gloo_harness.NCCL_ENV)."""
from __future__ import annotations

import pytest
import torch

import gloo_harness
import test_ddp

pytestmark = pytest.mark.gpu  # skipped without an FP8 GPU (conftest.fp8_gpu_reason)

WORLD = max(1, min(torch.cuda.device_count(), 4))


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """world -> the cases' results (one torchrun launch)."""
    return gloo_harness.cached_launcher(tmp_path_factory, "test_ddp", "DDP-NCCL", torchrun=True)


@pytest.mark.parametrize("case_id", [case_id for case_id, _, _, worlds in test_ddp.CASES if WORLD in worlds])
def test_case_nccl(launches, case_id):
    gloo_harness.check(launches(WORLD)[0], case_id)
