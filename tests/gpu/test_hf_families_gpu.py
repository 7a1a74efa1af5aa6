"""fp8train.convert on transformers' families unlike Llama in structure (tests/helpers.py
HF_FAMILIES), on the GPU, the default recipe, FP32 parameters under torch.autocast(bfloat16):

* eager: after the warm-up every Linear runs the C++ node; the hidden-size norms run
  fp8train's norm kernels; Qwen3's q/k norms (over head_dim, on a 4-D view of the
  projection) run the formula with float32 weights and the kernels with bf16 ones;
* torch.compile (Inductor) follows the eager losses within 1% a step (the tolerance of
  tests/gpu/test_hf_llama_gpu.py: Inductor's own kernels for HF's ops and the casts).
"""
import copy

import pytest
import torch

pytest.importorskip("transformers")

import fp8train  # noqa: E402
from fp8train.modules import gated_mlp  # noqa: E402
from tests.helpers import HF_FAMILIES, hf_family_model  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fresh_dynamo")]
CUDA = torch.device("cuda")
CASES = [pytest.param("qwen3", torch.float32, id="qwen3-fp32"), pytest.param("qwen3", torch.bfloat16, id="qwen3-bf16"),
         pytest.param("phi3", torch.float32, id="phi3-fp32"), pytest.param("gemma", torch.float32, id="gemma-fp32")]


def _converted(family, dtype):
    model = hf_family_model(family, CUDA, dtype)
    return fp8train.convert(model, filter_fn=lambda name, *_: name != "lm_head")


def _step(model, opt, x):
    with torch.autocast("cuda", dtype=torch.bfloat16), fp8train.autocast():
        loss = model(input_ids=x, labels=x).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def _batches(n):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (2, 64), generator=g).to(CUDA) for _ in range(n)]


@pytest.mark.parametrize("family, dtype", CASES)
def test_eager_takes_the_cpp_node_and_the_norm_kernels(family, dtype):
    model = _converted(family, dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    for x in _batches(4):
        _step(model, opt, x)
    assert set(fp8train.inspect.execution_paths(model).values()) == {"C++ node"}
    paths = fp8train.inspect.norm_paths(model)
    assert len(paths) == HF_FAMILIES[family][2]
    for name, path in paths.items():
        head_norm = name.endswith(("q_norm", "k_norm"))
        want = "formula" if head_norm and dtype == torch.float32 else "kernel"  # bf16 q/k with float32 weights
        assert path.startswith(want), (name, path)
    mlps = fp8train.inspect.mlp_paths(model)  # gemma: GeGLU (gelu_tanh) on the gated kernels
    assert len(mlps) == HF_FAMILIES[family][3] and set(mlps.values()) <= {gated_mlp.FUSED}


@pytest.mark.parametrize("family, dtype", CASES)
def test_compiled_losses_follow_eager(family, dtype):
    model = _converted(family, dtype)
    twin = copy.deepcopy(model)
    compiled = torch.compile(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True) for m in (twin, model)]
    want, got = [], []
    for x in _batches(6):
        want.append(_step(twin, opts[0], x))
        got.append(_step(compiled, opts[1], x))
    want, got = torch.tensor(want), torch.tensor(got)
    assert ((got - want).abs() <= 0.01 * want.abs()).all(), (got, want)
