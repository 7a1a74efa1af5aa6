"""A converted Hugging Face Llama saves with `save_pretrained` (safetensors) and resumes: the
weights through `from_pretrained`, the FP8 scaling state through `load_state_dict` of the
saved file after `convert`. The sibling ties (q/k/v, gate/up share one input quantizer) used
to stop the save: safetensors refuses one storage under several names."""

import pytest
import torch

pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")
import hf_llama  # noqa: E402

import fp8train  # noqa: E402
from helpers import converted_llama, llama_steps_side_by_side  # noqa: E402

RECIPES = [pytest.param(fp8train.DelayedScaling(), id="delayed"), pytest.param(fp8train.CurrentScaling(), id="current")]


@pytest.mark.parametrize("recipe", RECIPES)
def test_save_pretrained_and_resume(recipe, tmp_path):
    from transformers import LlamaForCausalLM

    cpu = torch.device("cpu")
    model = converted_llama(recipe, cpu)
    llama_steps_side_by_side([model], recipe, 2, cpu)
    assert fp8train.inspect.shared_input_casts(model)  # tied: the case that failed
    model.save_pretrained(tmp_path)
    saved = safetensors_torch.load_file(tmp_path / "model.safetensors")
    assert saved.keys() == model.state_dict().keys()

    resumed = LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa")  # the FP8 keys: unexpected
    fp8train.convert(resumed, recipe, filter_fn=hf_llama.not_lm_head)
    resumed.load_state_dict(saved)  # strict: every weight and every quantizer buffer
    for (name, a), b in zip(model.state_dict().items(), resumed.state_dict().values()):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    want, got = llama_steps_side_by_side([model, resumed], recipe, 2, cpu)  # fresh AdamW states for both
    assert torch.equal(got, want), (got, want)
    for (name, a), b in zip(model.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
