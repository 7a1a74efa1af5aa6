"""The tensor-parallel test cases of the CPU suite, on GPUs with NCCL under torchrun.

Run unchanged on every visible GPU (one torchrun process per GPU, up to 4), one torchrun
launch per case module, each test reading its case's records:

* tests/test_tp_linear.py: column / row, with and without sequence parallelism and
  tp_overlap, both recipes, bf16 / fp32 params, both reduce dtypes, checkpoints, amax
  reduction;
* tests/test_tp_fused.py: tensor-parallel LayerNormLinear (one output, Q/K/V parts) /
  LayerNormMLP, collective counts;
* tests/test_tp_checkpoints.py: full and DCP checkpoints of every TP layer;
* tests/gpu/tp_graph_cases.py (GPU only): CUDA-graphed TP LayerNormMLP steps against eager.

Outputs and gradients against the single-GPU layer holding the full weights and the float64
reference; scales bitwise identical across ranks. Needs two or more GPUs; NVLink multicast
stays off (gloo_harness.NCCL_ENV).
"""
from __future__ import annotations


import pytest
import torch

import gloo_harness
import test_tp_checkpoints
import test_tp_fused
import test_tp_linear
import tp_graph_cases

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 or more GPUs")]

WORLD = max(2, min(torch.cuda.device_count(), 4))


MODULES = {"test_tp_linear": (test_tp_linear, "TP-SQNR"), "test_tp_fused": (test_tp_fused, "TP-FUSED-SQNR"),
           "test_tp_checkpoints": (test_tp_checkpoints, "TP-CKPT"), "tp_graph_cases": (tp_graph_cases, "TP-GRAPH")}


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """module name -> its cases' results at WORLD ranks (one torchrun launch per module)."""
    launchers = {name: gloo_harness.cached_launcher(tmp_path_factory, name, tag, torchrun=True)
                 for name, (_, tag) in MODULES.items()}
    return lambda name: launchers[name](WORLD)


@pytest.mark.parametrize("module, case_id", [pytest.param(name, c[0], id=f"{name}-{c[0]}")
                                             for name, (mod, _) in MODULES.items()
                                             for c in mod.CASES if WORLD in c[3]])
def test_case_nccl(launches, module, case_id):
    gloo_harness.check(launches(module)[0], case_id)
