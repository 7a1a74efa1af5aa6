"""A converted Hugging Face Llama (tiny shape, FP32 parameters under torch.autocast(bfloat16))
compiled with fullgraph=True on the CPU, both recipes: no graph break anywhere in the model,
and the compiled steps' losses are the eager steps' losses (aot_eager runs the traced ops as
they are, so bit for bit). The GPU side (Inductor, reduce-overhead, the C++ node for every
Linear) is tests/gpu/test_hf_llama_gpu.py."""
import copy
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import hf_llama  # noqa: E402

import fp8train  # noqa: E402

RECIPES = [pytest.param(fp8train.DelayedScaling(), id="delayed"),
           pytest.param(fp8train.CurrentScaling(), id="current", marks=pytest.mark.slow)]


def _steps_side_by_side(eager, model, compiled, recipe, batches):
    """Each step of the eager twin and of the model in one FP8 region (one delayed-scaling
    update for both: it rolls every live quantizer); the model's first step runs eagerly
    (it makes the quantizers), the rest compiled. Returns both loss trajectories."""
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (eager, model)]
    losses = ([], [])
    for i, (x, y) in enumerate(batches):
        with torch.autocast("cpu", dtype=torch.bfloat16), fp8train.autocast(recipe=recipe):
            out = [m(input_ids=x, labels=y).loss for m in (eager, model if i == 0 else compiled)]
        for loss, opt, record in zip(out, opts, losses):
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            record.append(loss.detach())
    return torch.stack(losses[0]), torch.stack(losses[1])


@pytest.mark.parametrize("recipe", RECIPES)
def test_converted_hf_llama_compiles_fullgraph_with_eager_losses(recipe):
    model = hf_llama.build_llama(hf_llama.SHAPES["tiny"], torch.device("cpu"))
    assert next(model.parameters()).dtype == torch.float32
    fp8train.convert(model, recipe, filter_fn=hf_llama.not_lm_head)
    assert sum(isinstance(m, fp8train.Linear) for m in model.modules()) == 14  # 2 x (q k v o gate up down)
    twin = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 256, (2, 64), generator=g), torch.randint(0, 256, (2, 64), generator=g))
               for _ in range(4)]
    want, got = _steps_side_by_side(twin, model, torch.compile(model, fullgraph=True, backend="aot_eager"), recipe,
                                    batches)
    assert torch.equal(got, want), (got, want)
    for (name, a), b in zip(model.state_dict().items(), twin.state_dict().values()):
        assert torch.equal(a, b), name
