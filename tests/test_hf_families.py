"""fp8train.convert on transformers' other decoder families (tiny shapes, random init, FP32
parameters under torch.autocast(bfloat16), the default recipe): which Linears and norms it
replaces, the converted model outside fp8train.autocast is the original bit for bit, and
inside it trains a few steps like BF16. Llama itself has its own files (test_hf_llama_*)."""
import copy

import pytest
import torch

pytest.importorskip("transformers")

import fp8train  # noqa: E402
from fp8train.modules import gated_mlp  # noqa: E402
from helpers import HF_FAMILIES, hf_family_model  # noqa: E402


def _train(model, x, fp8: bool, steps: int = 3):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16), fp8train.autocast(enabled=fp8):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return torch.tensor(losses)


@pytest.mark.parametrize("family", list(HF_FAMILIES))
def test_convert_replaces_the_linears_and_llama_form_norms_and_trains_like_bf16(family):
    """Losses within 0.5% of BF16's at each of 3 steps (measured: up to 0.1%); a wrong
    conversion or cast moves them by more. Every converted Linear ran in FP8 (its input
    quantizer saw a nonzero amax), every replaced norm ran a path it names and every replaced
    MLP the fused kernels."""
    _, n_linear, n_norm, n_mlp = HF_FAMILIES[family]
    base = hf_family_model(family)
    model = copy.deepcopy(base)
    fp8train.convert(model, filter_fn=lambda name, *_: name != "lm_head")
    linears = [m for m in model.modules() if isinstance(m, fp8train.Linear)]
    assert len(linears) == n_linear
    assert sum(isinstance(m, fp8train.RMSNorm) for m in model.modules()) == n_norm
    assert sum(isinstance(m, fp8train.GatedMLP) for m in model.modules()) == n_mlp
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(model(input_ids=x).logits, base(input_ids=x).logits)  # outside fp8train.autocast
    want, got = _train(base, x, fp8=False), _train(model, x, fp8=True)
    torch.testing.assert_close(got, want, rtol=5e-3, atol=0)
    assert all(m.input_quantizer is not None and float(m.input_quantizer.amax) > 0 for m in linears)
    paths = fp8train.inspect.norm_paths(model)
    assert len(paths) == n_norm and all(p.startswith(("kernel", "formula")) for p in paths.values())
    mlps = fp8train.inspect.mlp_paths(model)
    assert len(mlps) == n_mlp and set(mlps.values()) <= {gated_mlp.FUSED}


@pytest.mark.slow  # Dynamo traces each model: ~20 s a family on a slow 2-core machine
@pytest.mark.parametrize("family", ["qwen3", "phi3", "gemma"])  # the ones unlike Llama in structure
def test_converted_model_compiles_fullgraph_and_trains_as_eager(family):
    """torch.compile(fullgraph=True) of the converted model (aot_eager: the traced ops as
    they are) trains as its eager twin: losses within 1e-5 relative over 3 steps (the eager
    norms run fp8train's kernels, the traced ones HF's formula: float32 rounding apart)."""
    model = hf_family_model(family)
    fp8train.convert(model, filter_fn=lambda name, *_: name != "lm_head")
    twin = copy.deepcopy(model)
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    got = _train(torch.compile(model, fullgraph=True, backend="aot_eager"), x, fp8=True)
    torch.testing.assert_close(got, _train(twin, x, fp8=True), rtol=1e-5, atol=0)
