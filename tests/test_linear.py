"""fp8train.Linear against torch.nn.Linear, checkpoints, microbatch caching, bad input."""
import copy
import io

import pytest
import torch
import torch.nn.functional as F

import fp8train
from fp8train import CurrentScaling, DelayedScaling, Format, TensorRole
from helpers import fp8_bytes, sqnr_db

RECIPES = {
    "delayed-hybrid": DelayedScaling(),
    "delayed-e4m3": DelayedScaling(fp8_format=Format.E4M3, amax_history_len=16),
    "current-hybrid": CurrentScaling(),
    "current-e4m3": CurrentScaling(fp8_format=Format.E4M3),
}


def twins(k, n, params_dtype=torch.float32, bias=True, device="cpu"):
    layer = fp8train.Linear(k, n, bias=bias, params_dtype=params_dtype, device=device)
    ref = torch.nn.Linear(k, n, bias=bias, dtype=params_dtype, device=device)
    ref.load_state_dict(layer.state_dict(), strict=False)
    return layer, ref


@pytest.mark.parametrize("params_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(7, 48), (2, 5, 48)], ids=str)
def test_outside_autocast_is_exactly_nn_linear(params_dtype, shape, device):
    layer, ref = twins(48, 32, params_dtype, device=device)
    x = torch.randn(shape, dtype=params_dtype, device=device, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    y, y_ref = layer(x), ref(x_ref)
    assert torch.equal(y, y_ref)
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    assert torch.equal(x.grad, x_ref.grad) and torch.equal(layer.weight.grad, ref.weight.grad)
    assert torch.equal(layer.bias.grad, ref.bias.grad)


# Measured on CPU (2026-11-29, torch 2.13, 3 seeds): output SQNR 28.4-29.0 dB; dgrad 24.3-29.3 dB
# (HYBRID's e5m2 gradients sit at the low end); wgrad 23.9-28.9 dB.
@pytest.mark.parametrize("params_dtype", [torch.float32, torch.bfloat16], ids=["fp32-master", "bf16"])
@pytest.mark.parametrize("shape, k, n", [((37, 64), 64, 48), ((3, 7, 96), 96, 160), ((2, 3, 5, 32), 32, 16)],
                         ids=["2d-odd-m", "3d", "4d"])
@pytest.mark.parametrize("recipe", RECIPES.values(), ids=RECIPES.keys())
def test_fp8_matches_nn_linear_by_sqnr(recipe, shape, k, n, params_dtype, device):
    layer, ref = twins(k, n, params_dtype, device=device)
    x = torch.randn(shape, dtype=torch.bfloat16, device=device, requires_grad=True)
    dy = torch.randn(*shape[:-1], n, dtype=torch.bfloat16, device=device)
    with fp8train.autocast(recipe=recipe):
        y = layer(x)
    y.backward(dy)
    x64 = x.detach().double().requires_grad_()
    ref64 = copy.deepcopy(ref).double()
    y64 = ref64(x64)
    y64.backward(dy.double())
    assert y.dtype == torch.bfloat16 and y.shape == y64.shape
    assert layer.weight.grad.dtype == params_dtype and layer.bias.grad.dtype == params_dtype
    assert sqnr_db(y, y64) >= 25
    assert sqnr_db(x.grad, x64.grad) >= 20
    assert sqnr_db(layer.weight.grad, ref64.weight.grad) >= 20
    assert sqnr_db(layer.bias.grad, ref64.bias.grad) >= 40  # bias grad is a high-precision sum


def test_dims_not_multiple_of_16_run_in_high_precision_with_one_warning(device):
    layer, ref = twins(40, 24, device=device)
    x = torch.randn(5, 40, dtype=torch.bfloat16, device=device)
    with fp8train.autocast():
        with pytest.warns(UserWarning, match=r"Linear\(in=40, out=24\): FP8 GEMMs need dims that are multiples "
                                             r"of 16; this layer runs in torch.bfloat16"):
            y = layer(x)
        with warnings_as_errors():
            layer(x)  # no second warning
    assert torch.equal(y, F.linear(x, ref.weight.bfloat16(), ref.bias.bfloat16()))


class warnings_as_errors:
    def __enter__(self):
        import warnings
        self._ctx = warnings.catch_warnings()
        self._ctx.__enter__()
        warnings.simplefilter("error")

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)


def test_torch_autocast_sets_the_activation_dtype():
    layer, _ = twins(32, 16)
    x = torch.randn(4, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16), fp8train.autocast():
        y = layer(x)
    assert y.dtype == torch.bfloat16


# ---------------------------------------------------------------- weight workspace
CACHING_RECIPES = [fp8train.DelayedScaling(), fp8train.CurrentScaling()]


@pytest.fixture(params=CACHING_RECIPES, ids=lambda r: type(r).__name__)
def caching_recipe(request):
    return request.param


@pytest.fixture
def weight_casts(monkeypatch, caching_recipe):
    """Count casts made by the recipe's weight quantizers: False for a new Float8Tensor, True
    for an in-place re-cast of the existing workspace."""
    calls = []
    cls = (fp8train.DelayedScalingQuantizer if isinstance(caching_recipe, fp8train.DelayedScaling)
           else fp8train.CurrentScalingQuantizer)
    real_quantize, real_requantize = cls.quantize, cls.requantize

    def spy_quantize(self, x, **kw):
        if self.role is TensorRole.WEIGHT and kw.get("out") is None:
            calls.append(False)
        return real_quantize(self, x, **kw)

    def spy_requantize(self, x, out, **kw):
        if self.role is TensorRole.WEIGHT:
            calls.append(True)
        return real_requantize(self, x, out, **kw)

    monkeypatch.setattr(cls, "quantize", spy_quantize)
    monkeypatch.setattr(cls, "requantize", spy_requantize)
    return calls


def test_is_first_microbatch_caches_the_weight_cast(weight_casts, caching_recipe, device):
    layer = fp8train.Linear(32, 16, device=device)
    x = torch.randn(8, 32, device=device)
    with fp8train.autocast(recipe=caching_recipe):
        y1 = layer(x, is_first_microbatch=True)
    ws = layer.weight_fp8
    assert weight_casts == [False] and ws.transpose_is_cached() is False  # x needs no grad: no transpose
    with torch.no_grad():
        layer.weight.add_(1.0)  # the cache must now be stale on purpose
    fp8train.update_delayed_scales()  # a scale update must not desynchronise the cached payload
    with fp8train.autocast(recipe=caching_recipe):
        y2 = layer(x, is_first_microbatch=False)
    assert weight_casts == [False] and layer.weight_fp8 is ws and torch.equal(y1, y2)
    with fp8train.autocast(recipe=caching_recipe):
        y3 = layer(x, is_first_microbatch=None)
    assert weight_casts == [False, True] and layer.weight_fp8 is ws  # re-cast in place
    assert not torch.equal(y3, y1)
    with fp8train.autocast(recipe=caching_recipe):
        layer(x, is_first_microbatch=True)
    assert weight_casts == [False, True, True]


def test_cached_weight_builds_its_transpose_on_demand(device):
    layer = fp8train.Linear(32, 16, device=device)
    with fp8train.autocast():
        layer(torch.randn(8, 32, device=device), is_first_microbatch=True)
        x = torch.randn(8, 32, device=device, requires_grad=True)
        layer(x, is_first_microbatch=False).sum().backward()
    ws = layer.weight_fp8
    assert ws.transpose_is_cached() and torch.equal(fp8_bytes(ws.transpose_data()), fp8_bytes(ws.fp8_data).t())
    assert x.grad is not None


# ---------------------------------------------------------------- checkpoints
def make_model(seed, device="cpu"):
    torch.manual_seed(seed)
    return torch.nn.Sequential(fp8train.Linear(32, 64), torch.nn.GELU(), fp8train.Linear(64, 16)).to(device)


def train(model, opt, recipe, batches):
    losses = []
    for x, t in batches:
        with fp8train.autocast(recipe=recipe):
            loss = F.mse_loss(model(x).float(), t)  # CUDA's mse_loss backward needs one dtype
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if torch.isfinite(loss):
            opt.step()
        losses.append(loss.detach())
    return losses


def batches(n, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(24, 32, generator=g, dtype=torch.bfloat16).to(device), torch.randn(24, 16, generator=g).to(device))
            for _ in range(n)]


@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=8), CurrentScaling()], ids=["delayed", "current"])
def test_checkpoint_resumes_bit_identically(recipe, device):
    data = batches(10, device=device)
    model = make_model(0, device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    straight = train(model, opt, recipe, data)

    model = make_model(0, device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    first = train(model, opt, recipe, data[:5])
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    assert any(k.endswith("input_quantizer.scale") for k in ckpt["model"])
    resumed = make_model(123, device)  # different init: everything must come from the checkpoint
    resumed.load_state_dict(ckpt["model"])
    opt = torch.optim.Adam(resumed.parameters(), lr=1e-2)
    opt.load_state_dict(ckpt["opt"])
    second = train(resumed, opt, recipe, data[5:])
    assert torch.equal(torch.stack(straight), torch.stack(first + second))


def test_checkpoint_of_a_layer_that_never_ran_fp8_loads_into_a_used_one():
    fresh, used = make_model(0), make_model(1)
    train(used, torch.optim.SGD(used.parameters(), lr=0.1), DelayedScaling(), batches(1))
    used.load_state_dict(fresh.state_dict(), strict=False)
    assert torch.equal(used[0].weight, fresh[0].weight)


# ---------------------------------------------------------------- non-finite batches
def observe_weights(model, recipe):
    """All that a step with non-finite activations may leave behind in the scaling state: the
    (finite) amaxes of the weights it cast. Input and gradient amaxes are discarded."""
    with fp8train.autocast(recipe=recipe):
        for layer in (model[0], model[2]):
            layer.weight_quantizer.quantize(layer.weight)


@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=16), CurrentScaling()], ids=["delayed", "current"])
@pytest.mark.parametrize("bad_value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_a_nonfinite_batch_leaves_scaling_state_finite(recipe, bad_value, device):
    clean = batches(6, device=device)
    bad_x = clean[2][0].clone()
    bad_x[3, 7] = bad_value
    model = make_model(0, device)
    got = train(model, torch.optim.Adam(model.parameters(), lr=1e-2), recipe,
                clean[:2] + [(bad_x, clean[2][1])] + clean[2:])

    for layer in (model[0], model[2]):
        for q in (layer.input_quantizer, layer.weight_quantizer, layer.grad_output_quantizer):
            assert torch.isfinite(q.scale) and q.scale > 0
            if hasattr(q, "amax_history"):
                assert torch.isfinite(q.amax_history).all()
    assert model[0].input_quantizer.nonfinite_count.item() == 1
    # The next clean step computes what float64 computes with the same weights, at FP8 accuracy.
    x, _ = batches(1, seed=1, device=device)[0]
    with fp8train.autocast(recipe=recipe):
        y = model(x)
    assert sqnr_db(y, copy.deepcopy(model).double()(x.double())) >= 25

    if bad_value != bad_value:
        # NaN: that step's loss is what the data gives, the loop skips its update, and every
        # later step is exactly that of a run in which the step only cast the weights.
        assert torch.isnan(got[2])
        ref = make_model(0, device)
        ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
        expected = train(ref, ref_opt, recipe, clean[:2])
        observe_weights(ref, recipe)
        expected += train(ref, ref_opt, recipe, clean[2:])
        assert torch.equal(torch.stack(got[:2] + got[3:]), torch.stack(expected))
    # inf: the cast saturates it to the largest FP8 value (the definition of every cast), so
    # that step's loss is finite; only its amax is kept away from the scale.


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize("x, fp8, err, match", [
    (torch.ones(4, 32, dtype=torch.int64), False, TypeError, "floating-point"),
    (torch.ones(4, 32, dtype=torch.int64), True, TypeError, "floating-point"),
    (torch.ones(4, 32, dtype=torch.float64), True, TypeError, "float64 input cannot run in FP8"),
    (torch.ones(4, 31), True, ValueError, "in_features=32"),
    (torch.ones(4, 31), False, ValueError, "in_features=32"),
    (torch.tensor(1.0), True, ValueError, "in_features=32"),
], ids=["int", "int-fp8", "float64-fp8", "features-fp8", "features", "scalar"])
def test_bad_input_names_the_layer(x, fp8, err, match):
    layer = fp8train.Linear(32, 16)
    layer.name = "blocks.0.proj"
    with fp8train.autocast(enabled=fp8), pytest.raises(err, match=match) as info:
        layer(x)
    assert "Linear 'blocks.0.proj'(in=32, out=16)" in str(info.value)


def test_float64_outside_autocast_is_plain_nn_linear():
    layer, ref = twins(32, 16, torch.float64)
    x = torch.randn(3, 32, dtype=torch.float64)
    assert torch.equal(layer(x), ref(x))


def test_float8_input_of_the_wrong_role_is_refused():
    layer = fp8train.Linear(32, 16)
    grad_like = fp8train.quantize(torch.randn(4, 32), torch.float8_e5m2, role=TensorRole.GRAD_OUTPUT)
    with fp8train.autocast(), pytest.raises(TypeError, match=r"role GRAD_OUTPUT .* must be quantized for role INPUT"):
        layer(grad_like)
    with pytest.raises(TypeError, match="outside fp8train.autocast"):
        layer(fp8train.quantize(torch.randn(4, 32), role=TensorRole.INPUT))


def test_float8_input_of_the_right_role_is_used_as_is(device):
    layer = fp8train.Linear(32, 16, device=device)
    x = torch.randn(2, 4, 32, device=device)
    xq = fp8train.quantize(x, role=TensorRole.INPUT)
    with fp8train.autocast(recipe=CurrentScaling()):
        y_pre = layer(xq)
        y = layer(xq.dequantize())  # quantizing the dequantized values again is lossless here
    assert y_pre.shape == (2, 4, 16) and torch.equal(y_pre, y)


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="in_features"):
        fp8train.Linear(0, 16)
    with pytest.raises(ValueError, match="out_features"):
        fp8train.Linear(16, 2.5)


@pytest.mark.parametrize("kind", ["linear", "layernorm_linear", "layernorm_mlp"])
def test_outputs_of_3d_inputs_can_be_modified_in_place(kind):
    # As with nn.Linear: `y += residual` on a layer's output is legal and its gradient is the
    # out-of-place one's. A view returned by an autograd.Function made autograd raise on it
    # (and FSDP2 warn that such an op would drop its pre-backward hook).
    make = {"linear": lambda: fp8train.Linear(32, 32), "layernorm_linear": lambda: fp8train.LayerNormLinear(32, 32),
            "layernorm_mlp": lambda: fp8train.LayerNormMLP(32, 64)}[kind]
    torch.manual_seed(0)
    layer = make()
    x = torch.randn(2, 5, 32)
    r = torch.randn(2, 5, 32)
    grads = []
    for inplace in (False, True):
        xi = x.clone().requires_grad_()
        with fp8train.autocast():
            y = layer(xi)
        assert not y._is_view()
        if inplace:
            y += r
        else:
            y = y + r
        y.square().sum().backward()
        grads.append(xi.grad)
    assert torch.equal(grads[0], grads[1])
