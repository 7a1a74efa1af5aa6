"""A converted Hugging Face Llama (tiny shape) evaluated as people evaluate one, on the CPU:
`generate` and forward passes under torch.inference_mode inside fp8train.autocast, before
training and between its steps. Inference tensors keep no version counter and refuse
in-place writes outside inference mode: the sibling ties and the shared-cast memo read x's
version, and what layers keep between steps (quantizers, FP8 weight workspaces) must stay
ordinary tensors that a training step may rewrite."""
import copy

import pytest
import torch

pytest.importorskip("transformers")
import hf_llama  # noqa: E402

import fp8train  # noqa: E402
from helpers import converted_llama  # noqa: E402

RECIPES = [pytest.param(fp8train.DelayedScaling(), id="delayed"), pytest.param(fp8train.CurrentScaling(), id="current"),
           pytest.param(fp8train.BlockScaling(), id="block")]


def _batches(n):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (2, 64), generator=g) for _ in range(n)]


def _train(model, recipe, batches):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for x in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16), fp8train.autocast(recipe=recipe):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return torch.stack(losses)


def _model(recipe, with_quantizers=True):
    return converted_llama(recipe if with_quantizers else None, torch.device("cpu"))


@pytest.mark.parametrize("recipe", RECIPES)
def test_generate_under_inference_mode_is_generate_under_no_grad(recipe):
    model = _model(recipe)
    _train(model, recipe, _batches(1))
    model.eval()
    prompt = _batches(2)[1][:, :9]
    out = {}
    with torch.autocast("cpu", dtype=torch.bfloat16), fp8train.autocast(recipe=recipe):  # one region: one set of delayed scales
        for mode in (torch.no_grad, torch.inference_mode):
            with mode():
                out[mode] = model.generate(prompt, max_new_tokens=5, do_sample=False, output_scores=True,
                                           return_dict_in_generate=True)
    assert torch.equal(out[torch.no_grad].sequences, out[torch.inference_mode].sequences)
    for a, b in zip(out[torch.no_grad].scores, out[torch.inference_mode].scores):
        assert torch.equal(a, b)


@pytest.mark.parametrize("with_quantizers", [True, False], ids=["convert-with-recipe", "convert-without"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_inference_mode_first_call_then_training(recipe, with_quantizers):
    """An evaluation under inference_mode before the first training step: what the layers
    keep is made there and then trained. Current and block scaling keep no scaling history,
    so training then matches a model that skipped the evaluation bit for bit; delayed scaling
    records the evaluation's amaxes (as any evaluation inside fp8train.autocast does)."""
    model = _model(recipe, with_quantizers)
    twin = copy.deepcopy(model)
    batches = _batches(3)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16), fp8train.autocast(recipe=recipe):
        model(input_ids=batches[0], labels=batches[0])
    for name, t in list(model.named_buffers()):
        assert not t.is_inference(), name
    for name, layer in model.named_modules():
        ws = getattr(layer, "_workspace", None)
        for kept in (ws.fp8, ws.block) if ws is not None else ():
            if kept is not None:
                payload = kept._data if isinstance(kept, fp8train.Float8Tensor) else kept.data
                assert not payload.is_inference(), name
    got = _train(model, recipe, batches)
    assert torch.isfinite(got).all()
    if not isinstance(recipe, fp8train.DelayedScaling):
        want = _train(twin, recipe, batches)
        assert torch.equal(got, want), (got, want)
        assert fp8train.inspect.shared_input_casts(model) == fp8train.inspect.shared_input_casts(twin)
