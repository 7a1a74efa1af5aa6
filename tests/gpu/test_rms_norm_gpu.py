"""fp8train.RMSNorm on the GPU (modules/rms_norm.py): the cast its kernel makes for the sibling
Linears is the cast they would make of its output, and a converted HF Llama (tiny shape,
FP32 parameters under torch.autocast(bfloat16)) trains with fused norms as with HF's.

Tolerances: the norm kernels sum each row in another order than torch (kernels/norm.py), so
y and the gradients differ from HF's formula in their last float32 bits, and the losses of
the two models by a few 1e-4 of their value over 6 steps (the FP8 casts can flip a byte).
"""
import copy

import pytest
import torch

pytest.importorskip("transformers")
import hf_llama  # noqa: E402

import fp8train  # noqa: E402
from fp8train.modules import rms_norm  # noqa: E402
from fp8train.modules.norm import norm_fp8  # noqa: E402
from fp8train.quantizer_factory import make_quantizer  # noqa: E402
from fp8train.roles import TensorRole  # noqa: E402

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
RECIPES = [pytest.param(fp8train.CurrentScaling(), id="current"), pytest.param(fp8train.DelayedScaling(), id="delayed")]


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("shape", [(8192, 1024), (333, 2048), (77, 4096)], ids=str)
def test_the_norms_cast_is_the_cast_of_its_output(recipe, shape):
    """float32 x and weight: the kernel's FP8 bytes, transposed copy and scale_inv equal a
    fresh quantizer's cast of the y the kernel wrote, bit for bit (the cast reads the float32 y
    the kernel computed), and so do the two quantizers' states."""
    g = torch.Generator(device=CUDA).manual_seed(shape[0])
    x = torch.randn(shape, generator=g, device=CUDA) * 3
    weight = torch.randn(shape[1], generator=g, device=CUDA) * 0.5 + 1
    mine, other = (make_quantizer(recipe, TensorRole.INPUT, device=CUDA) for _ in range(2))
    for step in range(3):  # delayed: calibration, then from the history
        cast, _, _, y = norm_fp8(x * (step + 1), weight, None, False, 1e-6, mine, True, True)
        want = other.cast(y, transpose=True)
        for name, a, b in (("data", cast.data, want.data), ("data_t", cast.data_t, want.data_t),
                           ("scale_inv", cast.scale_inv, want.scale_inv)):
            assert torch.equal(a.view(torch.uint8) if a.dtype != torch.float32 else a,
                               b.view(torch.uint8) if b.dtype != torch.float32 else b), (name, step)
        for (name, a), b in zip(mine.state_dict().items(), other.state_dict().values()):
            assert torch.equal(a, b), (name, step)
        if isinstance(recipe, fp8train.DelayedScaling):
            fp8train.update_delayed_scales()


@pytest.mark.parametrize("recipe", RECIPES)
def test_converted_llama_trains_with_fused_norms_as_with_hfs(recipe):
    """Every Linear on the C++ node, the four decoder norms casting for q/k/v and gate/up
    (delayed scaling; current: q/k/v and gate/up cast the norms' outputs themselves), the
    final norm (lm_head's, high precision) normalizing alone; losses within 1e-3 of the
    model with HF's norms at every step, gradients of the norms' weights within 2e-2."""
    models = []
    for fuse in (True, False):
        model = hf_llama.build_llama(hf_llama.SHAPES["tiny"], CUDA)
        # HF's MLPs in both (fuse_mlps=False): the two models differ in their norms alone
        fp8train.convert(model, recipe, filter_fn=hf_llama.not_lm_head, fuse_norms=fuse, fuse_mlps=False)
        models.append(model)
    g = torch.Generator().manual_seed(0)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in models]
    for step in range(6):
        x = torch.randint(0, 256, (2, 64), generator=g).to(CUDA)
        with torch.autocast("cuda", dtype=torch.bfloat16), fp8train.autocast(recipe=recipe):
            losses = [m(input_ids=x, labels=x).loss for m in models]  # one region: delayed updates roll all alike
        for loss in losses:
            loss.backward()
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-3, atol=0, msg=f"step {step}")
        for name, p in models[0].named_parameters():
            if "layernorm" in name or name == "model.norm.weight":
                q = dict(models[1].named_parameters())[name]
                err = (p.grad - q.grad).norm() / q.grad.norm()
                assert err < 2e-2, (name, step, err.item())
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert set(fp8train.inspect.execution_paths(models[0]).values()) == {"C++ node"}
    norms = fp8train.inspect.norm_paths(models[0])
    assert norms.pop("model.norm") == rms_norm._NO_READER
    fused = rms_norm.FUSED if isinstance(recipe, fp8train.DelayedScaling) else rms_norm._READERS_CAST
    assert set(norms.values()) == {fused} and len(norms) == 4


def test_first_step_and_steady_state_normalize_alike():
    """A norm with no reader yet (a fresh or resumed model's first step: kernels.norm_fwd) and
    the same norm casting for its readers write the same y. Bit for bit where both take the
    row statistics from norm_stats' launch: current scaling (norm_stats first) and delayed
    scaling's calibration. Delayed scaling's steady state is one launch that sums the rows in
    its own kernel (and in tiles for a float32 input's transposed copy): rstd may differ in
    the last float32 bit there (seen on the H200 for bf16 inputs, 2026-12-04), and y, rounded
    after it, by up to two ulps."""
    g = torch.Generator(device=CUDA).manual_seed(7)
    for recipe in (fp8train.CurrentScaling(), fp8train.DelayedScaling()):
        for dtype in (torch.float32, torch.bfloat16):
            x = (torch.randn(512, 1024, generator=g, device=CUDA) * 3).to(dtype)
            weight = (torch.randn(1024, generator=g, device=CUDA) * 0.5 + 1).to(dtype)
            rstd, y = torch.empty(512, device=CUDA), torch.empty_like(x)
            fp8train.kernels.norm_fwd(x, weight, None, 1e-6, None, rstd, y)
            q = make_quantizer(recipe, TensorRole.INPUT, device=CUDA)
            for call in range(2):  # delayed: calibration (two passes), then one launch
                _, _, rstd_fused, y_fused = norm_fp8(x, weight, None, False, 1e-6, q, True, True)
                one_launch = isinstance(recipe, fp8train.DelayedScaling) and call == 1
                if not one_launch:
                    assert torch.equal(y_fused, y) and torch.equal(rstd_fused, rstd), (recipe, dtype, call)
                else:
                    torch.testing.assert_close(rstd_fused, rstd, rtol=2.0**-22, atol=0)
                    # rstd's last bit, then y's own rounding: up to two float32 ulps of y
                    ulp = 2.0**-21 if dtype == torch.float32 else 2.0**-7
                    torch.testing.assert_close(y_fused, y, rtol=ulp, atol=0)
