"""The tensor-parallel test cases of the CPU suite, on GPUs with NCCL under torchrun.

Run unchanged on every visible GPU (one torchrun process per GPU, up to 4), one torchrun
launch per case module, each test reading its case's records:

* tests/test_tp_linear.py: column / row, with and without sequence parallelism and
  tp_overlap, both recipes, bf16 / fp32 params, both reduce dtypes, checkpoints, amax
  reduction;
* tests/test_tp_fused.py: tensor-parallel LayerNormLinear / LayerNormMLP, collective
  counts, full and DCP checkpoints;
* tests/gpu/tp_graph_cases.py (GPU only): CUDA-graphed TP LayerNormMLP steps against eager.

Outputs and gradients against the single-GPU layer holding the full weights and the float64
reference; scales bitwise identical across ranks. Needs two or more GPUs; NVLink multicast
stays off (gloo_harness.NCCL_ENV).
"""
from __future__ import annotations

import functools

import pytest
import torch

import gloo_harness
import test_tp_fused
import test_tp_linear
import tp_graph_cases

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 or more GPUs")]

WORLD = max(2, min(torch.cuda.device_count(), 4))


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    @functools.lru_cache(maxsize=None)
    def launch(module_name):
        return gloo_harness.launch_torchrun(module_name, WORLD, str(tmp_path_factory.mktemp("nccl")),
                                            "TP-SQNR" if module_name == "test_tp_linear" else "TP-FUSED-SQNR")
    return launch


@pytest.mark.parametrize("case_id", [c[0] for c in test_tp_linear.CASES if WORLD in c[3]])
def test_tp_linear_nccl(launches, case_id):
    results, _ = launches("test_tp_linear")
    assert case_id in results, f"case {case_id} did not report"
    errors = results[case_id]
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("case_id", [c[0] for c in test_tp_fused.CASES if WORLD in c[3]])
def test_tp_fused_nccl(launches, case_id):
    results, _ = launches("test_tp_fused")
    assert case_id in results, f"case {case_id} did not report"
    errors = results[case_id]
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("case_id", [c[0] for c in tp_graph_cases.CASES if WORLD in c[3]])
def test_tp_graphed_nccl(launches, case_id):
    results, _ = launches("tp_graph_cases")
    assert case_id in results, f"case {case_id} did not report"
    errors = results[case_id]
    assert not errors, "\n".join(errors)
