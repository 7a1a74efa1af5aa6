"""Shared inputs on CUDA (issue 24 item 4; CPU side: tests/test_shared_inputs.py): an
HF-Llama-like block (q/k/v on one norm output, gate/up on another) casts each shared input once
per step, and trains bit for bit like untied layers (the detection off). Both run the C++ node
from the third step (delayed scaling calibrates on the first, the Python node prepares the
launches on the second): untied layers cast x inside the C++ call, tied ones pass the group's
one Python cast (Quantizer.cast_shared) into it."""
from __future__ import annotations

import pytest
import torch

import fp8train
from fp8train.kernels import native
from fp8train.modules import base
from tests.helpers import assert_bitwise, sgd_steps
from tests.test_shared_inputs import GROUPS, Block, count_input_casts

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
RECIPES = [pytest.param(fp8train.DelayedScaling(), id="delayed"), pytest.param(fp8train.CurrentScaling(), id="current")]


@pytest.fixture(autouse=True)
def sharing_on(monkeypatch):
    # the switch is off by default until the GPU run; these tests are about it switched on
    monkeypatch.setattr(base, "SHARE_INPUT_CASTS", True)


@pytest.mark.parametrize("params_dtype", [torch.float32, torch.bfloat16], ids=["fp32-autocast-bf16", "bf16"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_block_casts_each_shared_input_once_and_matches_untied_layers(recipe, params_dtype, monkeypatch):
    assert native.ENABLED and native.extension() is not None, native.failure()
    torch.manual_seed(0)
    tied = Block(d=256, f=512, dtype=params_dtype).to(CUDA)
    torch.manual_seed(0)
    untied = Block(d=256, f=512, dtype=params_dtype).to(CUDA)
    g = torch.Generator(device=CUDA).manual_seed(1)
    xs = [torch.randn(4, 128, 256, device=CUDA, generator=g).to(params_dtype) for _ in range(4)]
    with monkeypatch.context() as m:
        m.setattr(base, "SHARE_INPUT_CASTS", False)
        want = sgd_steps(untied, recipe, xs, params_dtype)

    casts = count_input_casts(monkeypatch)
    got = sgd_steps(tied, recipe, xs, params_dtype)
    assert fp8train.inspect.shared_input_casts(tied) == GROUPS
    paths = fp8train.inspect.execution_paths(tied)
    assert set(paths.values()) == {"C++ node"}, paths
    assert set(fp8train.inspect.execution_paths(untied).values()) == {"C++ node"}
    # casts of the shared inputs: step 1 casts for q and k (v ties to them, and is served) and
    # for gate and up (the tie forms at up's first call); from step 2 one per group
    tied_casts = [c for c in casts if c is tied.q.input_quantizer or c is tied.gate.input_quantizer]
    assert len(tied_casts) == 4 + 2 * (len(xs) - 1), len(tied_casts)
    for i, ((y, dx, grads), (y_ref, dx_ref, grads_ref)) in enumerate(zip(got, want)):
        assert_bitwise(y, y_ref, f"step {i}: y")
        assert_bitwise(dx, dx_ref, f"step {i}: x.grad")
        for name in grads_ref:
            assert_bitwise(grads[name], grads_ref[name], f"step {i}: {name}.grad")
