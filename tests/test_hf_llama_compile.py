"""A converted Hugging Face Llama (tiny shape, FP32 parameters under torch.autocast(bfloat16))
compiled with fullgraph=True on the CPU, both recipes: no graph break anywhere in the model,
and the compiled steps' losses are the eager steps' losses (aot_eager runs the traced ops as
they are, so bit for bit, with convert's fuse_norms off: fp8train.RMSNorm runs its norm
kernels eagerly and HF's formula when traced, so with it on the two agree to float32
rounding). The GPU side (Inductor, reduce-overhead, the C++ node for every
Linear) is tests/gpu/test_hf_llama_gpu.py."""
import copy

import pytest
import torch

pytest.importorskip("transformers")
import hf_llama  # noqa: E402

import fp8train  # noqa: E402

RECIPES = [pytest.param(fp8train.DelayedScaling(), id="delayed"),
           pytest.param(fp8train.CurrentScaling(), id="current", marks=pytest.mark.slow)]


def _steps_side_by_side(eager, model, compiled, recipe, batches, eager_first=True):
    """Each step of the eager twin and of the model in one FP8 region (one delayed-scaling
    update for both: it rolls every live quantizer); the model's first step runs eagerly
    where eager_first (it makes the quantizers), the rest compiled. Returns both loss
    trajectories."""
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (eager, model)]
    losses = ([], [])
    for i, (x, y) in enumerate(batches):
        with torch.autocast("cpu", dtype=torch.bfloat16), fp8train.autocast(recipe=recipe):
            out = [m(input_ids=x, labels=y).loss for m in (eager, model if i == 0 and eager_first else compiled)]
        for loss, opt, record in zip(out, opts, losses):
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            record.append(loss.detach())
    return torch.stack(losses[0]), torch.stack(losses[1])


def _batches():
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 256, (2, 64), generator=g), torch.randint(0, 256, (2, 64), generator=g))
            for _ in range(4)]


# make test keeps one fullgraph case, convert's default (fused norms); the rest of this file
# is slow (CI's make test-all): Dynamo's tracing takes 15-60 s a case on a slow 2-core machine
@pytest.mark.parametrize("fuse_norms", [pytest.param(False, id="hf-norms", marks=pytest.mark.slow),
                                        pytest.param(True, id="fused-norms")])
@pytest.mark.parametrize("recipe", RECIPES)
def test_converted_hf_llama_compiles_fullgraph_with_eager_losses(recipe, fuse_norms):
    """Bit for bit with HF's norms; with fp8train.RMSNorm (eager: its kernels' twins, traced:
    the formula) the losses agree to 1e-5 and the weights to 1e-4 relative after 4 steps."""
    model = hf_llama.build_llama(hf_llama.SHAPES["tiny"], torch.device("cpu"))
    assert next(model.parameters()).dtype == torch.float32
    fp8train.convert(model, recipe, filter_fn=hf_llama.not_lm_head, fuse_norms=fuse_norms)
    assert sum(isinstance(m, fp8train.Linear) for m in model.modules()) == 14  # 2 x (q k v o gate up down)
    assert sum(isinstance(m, fp8train.RMSNorm) for m in model.modules()) == (5 if fuse_norms else 0)
    twin = copy.deepcopy(model)
    want, got = _steps_side_by_side(twin, model, torch.compile(model, fullgraph=True, backend="aot_eager"), recipe,
                                    _batches())
    if not fuse_norms:
        assert torch.equal(got, want), (got, want)
        for (name, a), b in zip(model.state_dict().items(), twin.state_dict().values()):
            assert torch.equal(a, b), name
        return
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    for (name, a), b in zip(model.state_dict().items(), twin.state_dict().values()):
        if a.is_floating_point() and "quantizer" not in name:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)
    assert all(p.startswith("kernel") for p in fp8train.inspect.norm_paths(twin).values())


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_converted_hf_llama_compiles_without_an_eager_step(recipe):
    """convert(model) without a recipe (no quantizers yet), then torch.compile(model) at once:
    the first compiled call inside fp8train.autocast runs the forward once eagerly without
    gradients (convert._first_compiled_call), which makes the quantizers and ties q/k/v's and
    gate/up's input quantizers; training is then the eager twin's bit for bit. A compiled
    call outside fp8train.autocast before it leaves that for the first call inside."""
    model = hf_llama.build_llama(hf_llama.SHAPES["tiny"], torch.device("cpu"))
    fp8train.convert(model, filter_fn=hf_llama.not_lm_head, fuse_norms=False)  # bit for bit: HF's norms
    twin = copy.deepcopy(model)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x = torch.randint(0, 256, (2, 64))
    with torch.no_grad():
        compiled(input_ids=x)  # outside FP8: the torch composition, nothing made
    assert model.model.layers[0].self_attn.q_proj.input_quantizer is None and hasattr(model, "_infer_parameters")
    torch._dynamo.reset()
    want, got = _steps_side_by_side(twin, model, compiled, recipe, _batches(), eager_first=False)
    assert torch.equal(got, want), (got, want)
    assert not hasattr(model, "_infer_parameters")  # done once
    assert len(fp8train.inspect.shared_input_casts(model)) == 4  # 2 layers x (q/k/v, gate/up)
    for (name, a), b in zip(model.state_dict().items(), twin.state_dict().values()):
        assert torch.equal(a, b), name


def _compiles(model, recipe, lengths) -> int:
    """Dynamo frames compiled while torch.compile(model) (aot_eager) trains one step per length."""
    compiled = torch.compile(model, backend="aot_eager")
    g = torch.Generator().manual_seed(0)
    before = torch._dynamo.utils.counters["frames"]["ok"]  # cumulative over the process
    for length in lengths:
        x = torch.randint(0, 256, (2, length), generator=g)
        with torch.autocast("cpu", dtype=torch.bfloat16), fp8train.autocast(enabled=recipe is not None, recipe=recipe):
            compiled(input_ids=x, labels=x).loss.backward()
    return torch._dynamo.utils.counters["frames"]["ok"] - before


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_changing_sequence_lengths_compile_as_often_as_bf16(recipe):
    """Lengths that change between batches: Dynamo's static first graph, then one dynamic
    graph for the rest, as for the unconverted model; a size comparison in the layers' Python
    would be a guard and compile again (the GPU's cast operators had two:
    tests/gpu/test_hf_llama_usage_gpu.py). BlockScaling is left out: its torch-ops casts here
    (the CPU's) take whole blocks and tail blocks by different code, a guard of their own."""
    lengths = (64, 77, 93, 41, 100)
    torch._dynamo.reset()
    bf16 = _compiles(hf_llama.build_llama(hf_llama.SHAPES["tiny"], torch.device("cpu")), None, lengths)
    torch._dynamo.reset()
    model = hf_llama.build_llama(hf_llama.SHAPES["tiny"], torch.device("cpu"))
    fp8train.convert(model, recipe, filter_fn=hf_llama.not_lm_head)
    assert _compiles(model, recipe, lengths) == bf16
