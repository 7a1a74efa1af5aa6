"""A converted Hugging Face Llama saves with `save_pretrained` (safetensors) and resumes: the
weights through `from_pretrained`, the FP8 scaling state through `load_state_dict` of the
saved file after `convert`. The sibling ties (q/k/v, gate/up share one input quantizer) used
to stop the save: safetensors refuses one storage under several names."""
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import hf_llama  # noqa: E402

import fp8train  # noqa: E402

RECIPES = [pytest.param(fp8train.DelayedScaling(), id="delayed"), pytest.param(fp8train.CurrentScaling(), id="current")]


def _train(models, recipe, batches):
    """Loss per step of each model, side by side in one FP8 region per step (each delayed-scaling
    update rolls every live quantizer, any model's); SGD without state, so a resumed model
    continues like the original."""
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in models]
    losses = [[] for _ in models]
    for x in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16), fp8train.autocast(recipe=recipe):
            out = [m(input_ids=x, labels=x).loss for m in models]
        for loss, opt, record in zip(out, opts, losses):
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            record.append(loss.detach())
    return [torch.stack(r) for r in losses]


@pytest.mark.parametrize("recipe", RECIPES)
def test_save_pretrained_and_resume(recipe, tmp_path):
    from transformers import LlamaForCausalLM

    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 256, (2, 64), generator=g) for _ in range(4)]
    model = hf_llama.build_llama(hf_llama.SHAPES["tiny"], torch.device("cpu"))
    fp8train.convert(model, recipe, filter_fn=hf_llama.not_lm_head)
    _train([model], recipe, batches[:2])
    assert fp8train.inspect.shared_input_casts(model)  # tied: the case that failed
    model.save_pretrained(tmp_path)
    saved = safetensors_torch.load_file(tmp_path / "model.safetensors")
    assert saved.keys() == model.state_dict().keys()

    resumed = LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa")  # the FP8 keys: unexpected
    fp8train.convert(resumed, recipe, filter_fn=hf_llama.not_lm_head)
    resumed.load_state_dict(saved)  # strict: every weight and every quantizer buffer
    for (name, a), b in zip(model.state_dict().items(), resumed.state_dict().values()):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    want, got = _train([model, resumed], recipe, batches[2:])
    assert torch.equal(got, want), (got, want)
    for (name, a), b in zip(model.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
