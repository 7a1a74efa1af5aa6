"""A converted Hugging Face Llama (tiny shape, FP32 parameters under torch.autocast(bfloat16),
as benchmarks/hf_llama.py trains it) on the GPU, both recipes:

* eager: every Linear runs the C++ node once its launches are prepared, float32 inputs (the
  RMSNorm outputs that feed q/k/v and gate/up) included;
* torch.compile (Inductor) and mode="reduce-overhead" (CUDA graphs around the step) train
  with the eager loss trajectory, with no recompile after the warm-up: both recipes and
  BlockScaling (its sibling Linears stacked when compiled, eager apart).

Tolerance: Inductor generates its own kernels for the casts and for HF's ops around the
GEMMs (it keeps float32 where eager rounds intermediates to bf16), so the compiled losses are
compared with eager's within 1% per step over 8 steps from the same weights and batches.
"""
import copy

import pytest
import torch

pytest.importorskip("transformers")
import hf_llama  # noqa: E402

import fp8train  # noqa: E402
from tests.helpers import converted_llama  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fresh_dynamo")]
CUDA = torch.device("cuda")
RECIPES = [pytest.param(fp8train.DelayedScaling(), id="delayed"), pytest.param(fp8train.CurrentScaling(), id="current")]
STEPS = 8


def _batches(n):
    g = torch.Generator().manual_seed(0)
    return [tuple(torch.randint(0, 256, (2, 64), generator=g).to(CUDA) for _ in range(2)) for _ in range(n)]


def _model(recipe):
    return converted_llama(recipe, CUDA)


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_linear_takes_the_cpp_node(recipe):
    model = _model(recipe)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    linears = {name: m for name, m in model.named_modules() if isinstance(m, fp8train.Linear)}
    assert len(linears) == 14
    nodes, dtypes = {}, {}

    def hook(name):
        def record(module, args, out):
            nodes[name] = out.grad_fn.name()
            dtypes[name] = args[0].dtype
        return record

    handles = [m.register_forward_hook(hook(name)) for name, m in linears.items()]
    for step, (x, y) in enumerate(_batches(4)):
        with torch.autocast("cuda", dtype=torch.bfloat16), fp8train.autocast(recipe=recipe):
            loss = model(input_ids=x, labels=y).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    for h in handles:
        h.remove()
    # the last step's nodes (delayed scaling: step 1 calibrates, step 2 prepares the launches)
    assert set(nodes.values()) == {"fp8train::LinearBackward"}, nodes
    assert set(fp8train.inspect.execution_paths(model).values()) == {"C++ node"}
    assert dtypes["model.layers.0.self_attn.q_proj"] == torch.float32  # HF's RMSNorm output
    assert dtypes["model.layers.0.mlp.down_proj"] == torch.bfloat16


@pytest.mark.parametrize("mode, eager_first", [(None, True), ("reduce-overhead", True), (None, False)],
                         ids=["default", "reduce-overhead", "default-compiled-first"])
# BlockScaling compiled: sibling Linears stacked (its default), also inside CUDA graphs
@pytest.mark.parametrize("recipe", RECIPES + [pytest.param(fp8train.BlockScaling(), id="block")])
def test_compiled_losses_follow_eager(recipe, mode, eager_first):
    """compiled-first: torch.compile(model) from the first step (convert's first-call pass
    runs the forward once eagerly without gradients: quantizers, shared input ties)."""
    model = _model(recipe)
    twin = copy.deepcopy(model)
    compiled = torch.compile(model, mode=mode)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True) for m in (twin, model)]
    losses = ([], [])
    frames = None
    for step, (x, y) in enumerate(_batches(STEPS)):
        if step == 3:  # warm-up done: delayed scaling's calibration flag flipped, graphs recorded
            frames = dict(torch._dynamo.utils.counters["frames"])
        if mode is not None:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast("cuda", dtype=torch.bfloat16), fp8train.autocast(recipe=recipe):
            out = [twin(input_ids=x, labels=y).loss,
                   (model if step == 0 and eager_first else compiled)(input_ids=x, labels=y).loss]
        for loss, opt, record in zip(out, opts, losses):
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            record.append(float(loss))
    want, got = torch.tensor(losses[0]), torch.tensor(losses[1])
    assert ((got - want).abs() <= 0.01 * want.abs()).all(), (got, want)
    assert dict(torch._dynamo.utils.counters["frames"]) == frames, "recompiled after the warm-up"
    assert len(fp8train.inspect.shared_input_casts(model)) == 4  # 2 layers x (q/k/v, gate/up), tied either way
