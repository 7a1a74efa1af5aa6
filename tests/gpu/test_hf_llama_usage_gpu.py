"""A converted Hugging Face Llama (tiny shape) used as people use one, on the GPU:

* torch.compile with sequence lengths that change from batch to batch (odd token counts: the
  wgrad GEMM's K is the token count, padded in the transposed copies): losses within 1% of
  eager per step, as tests/gpu/test_hf_llama_gpu.py compares them, and no compile more than
  BF16's compiled model makes;
* `generate` (KV cache: decode steps of one token per sequence) inside fp8train.autocast, also
  under torch.inference_mode before any training step;
* `model.to(torch.bfloat16)` after FP8 steps (pure-bf16 training): the parameters take the
  dtype, the scaling state stays float32, and the C++ nodes then train it bit for bit as a
  model whose parameters alone were converted.
"""
import copy

import pytest
import torch
import torch._functorch.config
import torch._inductor.config

pytest.importorskip("transformers")
import hf_llama  # noqa: E402

import fp8train  # noqa: E402
from fp8train.quantizer import Quantizer  # noqa: E402
from tests.helpers import converted_llama, llama_steps_side_by_side, sqnr_db  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fresh_dynamo")]
CUDA = torch.device("cuda")
RECIPES = [pytest.param(fp8train.DelayedScaling(), id="delayed"), pytest.param(fp8train.CurrentScaling(), id="current"),
           pytest.param(fp8train.BlockScaling(), id="block")]



def _frames() -> int:
    return torch._dynamo.utils.counters["frames"]["ok"]  # cumulative over the process: take differences


@pytest.mark.parametrize("recipe, lengths", [
    pytest.param(fp8train.CurrentScaling(), (64, 77, 93, 41), id="current"),
    # BlockScaling: 41 tokens x 2 rows make the 128 x 1 scales' row count 1, which torch's own
    # tensor metadata guards on (one compile more than BF16's for batches of 128 tokens or
    # fewer: docs/design.md, known limits)
    pytest.param(fp8train.BlockScaling(), (64, 77, 93, 100), id="block")])
def test_compiled_with_changing_sequence_lengths_follows_eager(recipe, lengths):
    """Losses within 1% of eager per step, and no more compiles than BF16's compiled model
    makes for the same lengths (Dynamo's static first graph, then a dynamic one; Inductor's
    own guards, such as a length's alignment, split it alike for both). The cast operators'
    grids and offset check used to guard on the token count: 41 tokens after 77 compiled
    once more (H200, 2026-12-03). Inductor's graph cache is off: a cached graph brings back
    the guards of the trace that made it."""
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        _compare_compiles(recipe, lengths)


def _compare_compiles(recipe, lengths):
    before = _frames()
    llama_steps_side_by_side([torch.compile(hf_llama.build_llama(hf_llama.SHAPES["tiny"], CUDA))], None, None, CUDA,
                             lengths=lengths)
    bf16_frames = _frames() - before
    torch._dynamo.reset()
    model = converted_llama(recipe, CUDA)
    twin = copy.deepcopy(model)
    before = _frames()
    want, got = llama_steps_side_by_side([twin, torch.compile(model)], recipe, None, CUDA, lengths=lengths)
    assert ((got - want).abs() <= 0.01 * want.abs()).all(), (got, want)
    assert _frames() - before == bf16_frames, (_frames() - before, bf16_frames)


@pytest.mark.parametrize("recipe", RECIPES)
def test_generate_inside_fp8_autocast(recipe):
    model = converted_llama(recipe, CUDA)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    x = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0)).to(CUDA)
    with torch.autocast("cuda", dtype=torch.bfloat16), fp8train.autocast(recipe=recipe):
        model(input_ids=x, labels=x).loss.backward()
    opt.step()
    model.eval()
    prompt = x[:, :11]
    runs = {}
    for fp8 in (True, False):
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16), fp8train.autocast(enabled=fp8, recipe=recipe):
            runs[fp8] = model.generate(prompt, max_new_tokens=6, do_sample=False, output_scores=True,
                                       return_dict_in_generate=True)
    out = runs[True]
    assert out.sequences.shape == (2, 17) and torch.equal(out.sequences[:, :11], prompt)
    assert all(torch.isfinite(s).all() for s in out.scores)
    # the first scores come from the same prompt: FP8 against high precision
    assert sqnr_db(out.scores[0].float(), runs[False].scores[0].float()) > 20


@pytest.mark.parametrize("recipe", RECIPES)
def test_inference_mode_evaluation_then_training(recipe):
    """torch.inference_mode: generate as under no_grad (one FP8 region: one set of delayed
    scales), before training made the layers' FP8 state, which training then rewrites."""
    model = converted_llama(recipe, CUDA)
    prompt = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(0)).to(CUDA)
    out = {}
    with torch.autocast("cuda", dtype=torch.bfloat16), fp8train.autocast(recipe=recipe):
        for mode in (torch.inference_mode, torch.no_grad):  # inference mode first: it makes the workspaces
            with mode():
                out[mode] = model.generate(prompt, max_new_tokens=4, do_sample=False)
    assert torch.equal(out[torch.inference_mode], out[torch.no_grad])
    for name, t in model.named_buffers():
        assert not t.is_inference(), name
    losses = llama_steps_side_by_side([model], recipe, 3, CUDA)[0]
    assert torch.isfinite(losses).all()


@pytest.mark.parametrize("recipe", RECIPES)
def test_to_bfloat16_after_fp8_steps(recipe):
    model = converted_llama(recipe, CUDA)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 256, (2, 64), generator=g).to(CUDA) for _ in range(4)]

    def step(models, x):
        with torch.autocast("cuda", dtype=torch.bfloat16), fp8train.autocast(recipe=recipe):
            losses = [m(input_ids=x, labels=x).loss for m in models]  # one region: delayed updates roll all alike
        for m, loss in zip(models, losses):
            loss.backward()
            with torch.no_grad():
                for p in m.parameters():
                    p -= 1e-3 * p.grad
            m.zero_grad(set_to_none=True)
        return losses

    for x in batches[:2]:  # the C++ nodes' launches prepared on float32 weights
        step([model], x)
    twin = copy.deepcopy(model)
    assert model.to(torch.bfloat16) is model
    for p in twin.parameters():  # what .to does, but to the parameters and HF's own buffers (RoPE's) alone
        p.data = p.data.to(torch.bfloat16)
    for module in twin.modules():
        if not isinstance(module, Quantizer):
            for name, buf in module._buffers.items():
                if buf is not None and buf.is_floating_point():
                    module._buffers[name] = buf.to(torch.bfloat16)
    q = model.model.layers[0].self_attn.q_proj.input_quantizer
    assert {b.dtype for b in q.buffers()} <= {torch.float32, torch.int32}
    for x in batches[2:]:
        got, want = step([model, twin], x)
        assert torch.equal(got, want), (got, want)
    for (name, a), b in zip(model.state_dict().items(), twin.state_dict().values()):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert set(fp8train.inspect.execution_paths(model).values()) == {"C++ node"}
