"""The FSDP2 cases of the CPU suite (tests/test_fsdp.py) on GPUs with NCCL under torchrun.

One torchrun launch of test_fsdp.CASES at WORLD = min(GPUs, 4) ranks (1 on a one-GPU
machine), each test reading its case's record; the cases run unchanged (inputs drawn on the
CPU, then moved to cuda:LOCAL_RANK; models moved there before `fully_shard`). At 1 rank
FSDP2 still runs the FP8 pre/post all-gather hooks (torch 2.13 copies the FP8 shard into
the unsharded buffer in place of a collective) and the weight amaxes' NCCL all-reduces; the
cases that need 2 or 4 ranks run on machines that have them. The comparisons and their
tolerances are the CPU suite's: FSDP against an unsharded twin within 2e-3 (2e-2 under a
bf16 compute policy), and bit for bit where both sides run the same kernels on the same
device (FP8 gather against master gather, checkpoint resume, precomputed weight scales,
aot_eager against eager). Those assume, on the GPU, that the C++ nodes give the Python
Functions' bytes (the master-gather model's layers take them after their first calls; the
FP8-gathered layers stay on the Python Functions) and that the cast kernels' scales are
scaling.compute_scale's bit for bit: tests/gpu/test_native_gpu.py, test_mlp_node_gpu.py
and test_kernels_gpu.py check those. NVLink multicast stays off (gloo_harness.NCCL_ENV).
"""
from __future__ import annotations

from typing import List

import pytest
import torch

import gloo_harness
import test_fsdp

pytestmark = pytest.mark.gpu  # skipped without an FP8 GPU (conftest.fp8_gpu_reason)

WORLD = max(1, min(torch.cuda.device_count(), 4))


def selected(world: int) -> List[str]:
    """The ids of test_fsdp's cases that run at `world` ranks."""
    return [case_id for case_id, _, _, worlds in test_fsdp.CASES if world in worlds]


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """world -> the cases' results (one torchrun launch)."""
    return gloo_harness.cached_launcher(tmp_path_factory, "test_fsdp", "FSDP-NCCL", torchrun=True)


@pytest.mark.parametrize("case_id", selected(WORLD))
def test_case_nccl(launches, case_id):
    gloo_harness.check(launches(WORLD)[0], case_id)
