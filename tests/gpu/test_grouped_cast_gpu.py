"""kernels.grouped_cast on the GPU: one launch casts every member bit for bit as the twin
(payloads, transposed copies with their zero padding, scale_invs, recorded amaxes)."""
import pytest
import torch

from fp8train.kernels import grouped_cast, reference

pytestmark = pytest.mark.gpu
DEV = "cuda"
# the HF Llama h1024 weights (q, k/v, o, gate/up, down) and odd ones: tails in both dims
SHAPES = [(1024, 1024), (256, 1024), (2816, 1024), (1024, 2816), (70, 130), (16, 48), (1, 16), (200, 4096)]


@pytest.mark.parametrize("transpose", [True, False], ids=["transpose", "plain"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_matches_the_twin(dtype, fp8_dtype, transpose):
    g = torch.Generator(device=DEV).manual_seed(3)
    weights = [(torch.randn(s, generator=g, device=DEV) * 10 ** (i % 4 - 1)).to(dtype) for i, s in enumerate(SHAPES)]
    weights[4][3, 5] = float("inf")
    weights[5][0, 0] = float("nan")
    weights[0][7, 9] = -3e5 if dtype != torch.float16 else -6e4  # saturates
    scales = [torch.tensor(2.0 ** (i - 3), device=DEV) for i in range(len(SHAPES))]
    histories = [torch.rand(4, device=DEV) * 10 ** (i % 3) for i in range(len(SHAPES))]
    histories[1][0] = -1.0  # unrecorded
    want_hist = [h.clone() for h in histories]
    data, data_t, scale_inv, lay = grouped_cast.flat_outputs(tuple(SHAPES), fp8_dtype, transpose, DEV)
    data.view(torch.uint8).fill_(0x5A)
    data_t.view(torch.uint8).fill_(0x5A)
    grouped_cast.cast_weights(weights, scales, histories, data, data_t, scale_inv, transpose)
    for i, w in enumerate(weights):
        out, out_t = grouped_cast.views(lay, data, data_t, i)
        want = torch.empty_like(out)
        want_t = None if out_t is None else torch.empty_like(out_t)
        want_inv = torch.empty(1, device=DEV)
        reference.grouped_cast([w], [scales[i]], [want_hist[i][0]], [want], [want_t], [want_inv])
        assert torch.equal(out.view(torch.uint8), want.view(torch.uint8)), i
        if transpose:
            assert torch.equal(out_t.view(torch.uint8), want_t.view(torch.uint8)), i
        assert torch.equal(grouped_cast.scale_inv_of(scale_inv, i), want_inv), i
        assert torch.equal(histories[i], want_hist[i]), i


# ----------------------------------------------------------------------------- in a compiled model

def _compiled_losses(grouped: bool, mode, monkeypatch, calls: list):
    """A tiny converted HF Llama (FP32 weights, torch.autocast bf16), one eager step then five
    compiled (Inductor) steps; returns the losses."""
    import sys
    from pathlib import Path

    pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import hf_llama

    import fp8train
    from fp8train.modules import weight_group

    monkeypatch.setattr(weight_group, "GROUP_WEIGHT_CASTS", grouped)
    real = grouped_cast.cast_weights
    monkeypatch.setattr(grouped_cast, "cast_weights", lambda *a: (calls.append(len(a[0])), real(*a))[1])
    torch._dynamo.reset()
    recipe = fp8train.DelayedScaling()
    model = hf_llama.build_llama(hf_llama.SHAPES["tiny"], torch.device(DEV))
    fp8train.convert(model, recipe, filter_fn=hf_llama.not_lm_head)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    compiled = torch.compile(model, mode=mode)
    g = torch.Generator().manual_seed(0)
    losses = []
    for i in range(6):
        x, y = (torch.randint(0, 256, (2, 64), generator=g).to(DEV) for _ in range(2))
        if mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast("cuda", dtype=torch.bfloat16), fp8train.autocast(recipe=recipe):
            loss = (model if i == 0 else compiled)(input_ids=x, labels=y).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().clone())
    torch._dynamo.reset()
    return torch.stack(losses)


@pytest.mark.parametrize("mode", [None, "reduce-overhead"], ids=["default", "reduce-overhead"])
def test_compiled_model_casts_its_weights_in_one_launch(mode, monkeypatch):
    """Inductor (and CUDA graphs): the 14 weights of the tiny Llama go through one grouped
    cast per compiled step, and the losses are the ungrouped compiled run's bit for bit
    (same cast math, same GEMMs)."""
    calls, calls_off = [], []
    got = _compiled_losses(True, mode, monkeypatch, calls)
    want = _compiled_losses(False, mode, monkeypatch, calls_off)
    assert torch.equal(got, want), (got, want)
    assert calls and set(calls) == {14} and not calls_off, (calls, calls_off)
