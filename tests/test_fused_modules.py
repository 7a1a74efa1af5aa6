"""LayerNormLinear and LayerNormMLP: exact torch parity outside autocast, FP8 accuracy inside
(SQNR against the high-precision composition in float64), checkpoints, and errors. On CPU the
fused kernels run as their pure-torch twins; the `device` fixture repeats these on the GPU."""
import io

import pytest
import torch
import torch.nn.functional as F

import fp8train
from fp8train import CurrentScaling, DelayedScaling
from fp8train.modules.layernorm_mlp import activation_high_precision
from helpers import sqnr_db

RECIPES = [pytest.param(DelayedScaling(amax_history_len=16), id="delayed"), pytest.param(CurrentScaling(), id="current")]
NORMS = ["LayerNorm", "RMSNorm"]
ACTS = ["gelu", "gelu_tanh", "relu", "swiglu"]
# FP8 accuracy. One GEMM (LayerNormLinear) must meet the core issue's Linear thresholds:
# output >= 25 dB, gradients >= 20 dB. The MLP runs two FP8 GEMMs in series, so up to twice
# the quantization noise reaches its output and its input gradient: 3 dB lower (22 / 17).
# Measured on CPU with these shapes (2026-11-29): MLP outputs 24.8-26.1 dB; gradients
# 20.2-27.9 dB for gelu/gelu_tanh/swiglu. relu: 14.6-23.7 dB, because where FP8 moves fc1's
# output across zero the mask flips and that element's gradient is wholly wrong (the
# kernel's relu backward itself is checked exactly against autograd in the kernel tests):
# 13 dB for relu's gradients.
OUT_DB, GRAD_DB = 25, 20
MLP_OUT_DB, MLP_GRAD_DB, RELU_GRAD_DB = 22, 17, 13


def norm_ref(x, w, b, normalization, eps=1e-5):
    if normalization == "LayerNorm":
        return F.layer_norm(x, (x.shape[-1],), w, b, eps)
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def randomize_norm(m):
    with torch.no_grad():  # gamma/beta away from 1/0 so their gradients are exercised
        m.layer_norm_weight.uniform_(0.5, 1.5)
        if m.layer_norm_bias is not None:
            m.layer_norm_bias.normal_(0, 0.1)
    return m


# ---------------------------------------------------------------- outside autocast: exact
@pytest.mark.parametrize("normalization", NORMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_layernorm_linear_is_exactly_the_torch_composition(normalization, dtype, device):
    m = randomize_norm(fp8train.LayerNormLinear(48, 32, normalization=normalization, params_dtype=dtype,
                                                device=device, return_layernorm_output=True))
    x = torch.randn(3, 5, 48, dtype=dtype, device=device)
    y, ln = m(x)
    want_ln = norm_ref(x, m.layer_norm_weight, m.layer_norm_bias, normalization)
    assert torch.equal(ln, want_ln) and torch.equal(y, F.linear(want_ln, m.weight, m.bias))


@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("normalization", NORMS)
def test_layernorm_mlp_is_exactly_the_torch_composition(activation, normalization, device):
    m = randomize_norm(fp8train.LayerNormMLP(32, 48, normalization=normalization, activation=activation,
                                             device=device))
    x = torch.randn(2, 7, 32, device=device)
    ln = norm_ref(x, m.layer_norm_weight, m.layer_norm_bias, normalization)
    h = F.linear(ln, m.fc1_weight, m.fc1_bias)
    want = F.linear(activation_high_precision(h, activation), m.fc2_weight, m.fc2_bias)
    assert torch.equal(m(x), want)
    assert m.fc1_weight.shape == ((96 if activation == "swiglu" else 48), 32)


# ---------------------------------------------------------------- inside autocast: FP8 accuracy
def grads_of(module, x, loss_fn):
    module.zero_grad(set_to_none=True)
    x.grad = None
    loss_fn(module(x)).backward()
    return {"x": x.grad.clone(), **{n: p.grad.clone() for n, p in module.named_parameters()}}


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("normalization", NORMS)
@pytest.mark.parametrize("pdtype", [torch.float32, torch.bfloat16], ids=["fp32-params", "bf16-params"])
def test_layernorm_linear_fp8_accuracy(recipe, normalization, pdtype, device):
    torch.manual_seed(1)
    m = randomize_norm(fp8train.LayerNormLinear(64, 48, normalization=normalization, params_dtype=pdtype,
                                                device=device))
    ref = randomize_norm(fp8train.LayerNormLinear(64, 48, normalization=normalization, device=device).double())
    ref.load_state_dict({k: v.double() for k, v in m.state_dict().items()}, strict=False)
    x = torch.randn(3, 13, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    target = torch.randn(3, 13, 48, device=device)
    loss = lambda y: F.mse_loss(y.float(), target)  # noqa: E731
    with fp8train.autocast(recipe=recipe):
        m(x)  # calibrate (delayed scaling's first step takes the tensors' own amax)
        got = grads_of(m, x, lambda y: loss(y))
        y = m(x)
    xd = x.detach().double().requires_grad_()
    want = grads_of(ref, xd, lambda y: F.mse_loss(y, target.double()))
    assert sqnr_db(y, ref(xd)) >= OUT_DB
    for name, g in got.items():
        assert sqnr_db(g, want[name]) >= GRAD_DB, name


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("normalization", NORMS)
def test_layernorm_mlp_fp8_accuracy(recipe, activation, normalization, device):
    torch.manual_seed(2)
    kw = dict(normalization=normalization, activation=activation, device=device)
    m = randomize_norm(fp8train.LayerNormMLP(64, 96, **kw))
    ref = fp8train.LayerNormMLP(64, 96, **kw).double()
    ref.load_state_dict({k: v.double() for k, v in m.state_dict().items()})
    x = torch.randn(5, 11, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    target = torch.randn(5, 11, 64, device=device)
    with fp8train.autocast(recipe=recipe):
        m(x)
        got = grads_of(m, x, lambda y: F.mse_loss(y.float(), target))
        y = m(x)
    xd = x.detach().double().requires_grad_()
    want = grads_of(ref, xd, lambda y: F.mse_loss(y, target.double()))
    assert sqnr_db(y, ref(xd)) >= MLP_OUT_DB
    floor = RELU_GRAD_DB if activation == "relu" else MLP_GRAD_DB
    for name, g in got.items():
        assert sqnr_db(g, want[name]) >= floor, name


def test_layernorm_output_gradient_flows(device):
    m = fp8train.LayerNormLinear(32, 16, device=device, return_layernorm_output=True)
    x = torch.randn(8, 32, device=device, requires_grad=True)
    with fp8train.autocast(recipe=CurrentScaling()):
        y, ln = m(x)
    g = torch.randn(8, 32, device=device)
    (ln * g).sum().backward()  # only through the norm output: y gets no gradient
    ref_x = x.detach().clone().requires_grad_()
    (norm_ref(ref_x, m.layer_norm_weight.detach(), m.layer_norm_bias.detach(), "LayerNorm") * g).sum().backward()
    # dX = the norm's backward of g; the GEMM path contributes exactly zero (its dY is zero).
    assert sqnr_db(x.grad, ref_x.grad) > 40
    assert m.weight.grad is None or float(m.weight.grad.abs().max()) == 0.0


def test_is_first_microbatch_reuses_both_weight_casts(device):
    m = fp8train.LayerNormMLP(32, 64, device=device)
    x = torch.randn(4, 32, device=device)
    with fp8train.autocast():
        y1 = m(x, is_first_microbatch=True)
        w1, w2 = m._fc1_workspace.fp8, m._fc2_workspace.fp8
        with torch.no_grad():
            m.fc1_weight.add_(1.0)
        y2 = m(x, is_first_microbatch=False)
    assert m._fc1_workspace.fp8 is w1 and m._fc2_workspace.fp8 is w2 and torch.equal(y1, y2)


# ---------------------------------------------------------------- out_features=(q, k, v): one GEMM, several parts
PARTS = (64, 32, 32)  # unequal, as Q, K, V with grouped-query attention
SHAPES = [pytest.param((39,), id="2d"), pytest.param((3, 13), id="3d")]  # the input's leading dims


def part_slices(parts):
    starts = [sum(parts[:i]) for i in range(len(parts))]
    return [slice(a, a + n) for a, n in zip(starts, parts)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("normalization", NORMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_layernorm_linear_parts_are_exactly_separate_linears(shape, normalization, dtype, device):
    """Outside autocast: the norm, then one F.linear per part with that part's weight and bias
    rows, bitwise; so are the gradients of x, the weight, the bias and the norm parameters."""
    m = randomize_norm(fp8train.LayerNormLinear(48, PARTS, normalization=normalization, params_dtype=dtype,
                                                device=device, return_layernorm_output=True))
    x = torch.randn(*shape, 48, dtype=dtype, device=device, requires_grad=True)
    got = m(x)
    grads = [torch.randn_like(t) for t in got]
    torch.autograd.backward(got, grads)
    ref = {n: p.detach().clone().requires_grad_() for n, p in m.named_parameters()}
    xr = x.detach().clone().requires_grad_()
    ln = norm_ref(xr, ref["layer_norm_weight"], ref.get("layer_norm_bias"), normalization)
    want = [F.linear(ln, ref["weight"][s], ref["bias"][s]) for s in part_slices(PARTS)] + [ln]
    torch.autograd.backward(want, grads)
    assert len(got) == len(PARTS) + 1
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"output {i}"
    assert torch.equal(x.grad, xr.grad)
    for n, p in m.named_parameters():
        assert torch.equal(p.grad, ref[n].grad), n


def fp8_parts_step(m, x, targets, recipe):
    """Calibrate, then one step with the parts' summed MSE (a one-output layer's output split
    like the parts): (the parts' outputs, {x and every parameter: gradient})."""
    parts = lambda out: out if isinstance(out, tuple) else out.split(PARTS, -1)  # noqa: E731
    loss = lambda out: sum(F.mse_loss(y.float(), t.to(y.dtype).float()) for y, t in zip(parts(out), targets))  # noqa
    with fp8train.autocast(recipe=recipe):
        m(x)  # calibrate (delayed scaling's first step takes the tensors' own amax)
        grads = grads_of(m, x, loss)
        ys = parts(m(x))
    return ys, grads


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("pdtype", [torch.float32, torch.bfloat16], ids=["fp32-params", "bf16-params"])
def test_layernorm_linear_parts_fp8_accuracy(shape, recipe, pdtype, device):
    """Inside autocast every part meets the one-output layer's bounds against float64, and the
    layer computes bitwise what LayerNormLinear(in, q + k + v) with the same parameters
    computes, split: one norm, one cast, one GEMM (and one of each in backward)."""
    torch.manual_seed(3)
    normalization = "LayerNorm" if len(shape) == 1 else "RMSNorm"
    m = randomize_norm(fp8train.LayerNormLinear(64, PARTS, normalization=normalization, params_dtype=pdtype,
                                                device=device))
    ref = fp8train.LayerNormLinear(64, PARTS, normalization=normalization, device=device).double()
    ref.load_state_dict({k: v.double() for k, v in m.state_dict().items()})
    single = fp8train.LayerNormLinear(64, sum(PARTS), normalization=normalization, params_dtype=pdtype,
                                      device=device)
    single.load_state_dict(m.state_dict())
    x = torch.randn(*shape, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    targets = [torch.randn(*shape, n, device=device, dtype=torch.float64) for n in PARTS]
    ys, got = fp8_parts_step(m, x, targets, recipe)
    xd = x.detach().double().requires_grad_()
    want = grads_of(ref, xd, lambda out: sum(F.mse_loss(y, t) for y, t in zip(out, targets)))
    assert isinstance(ys, tuple) and [y.shape for y in ys] == [(*shape, n) for n in PARTS]
    for i, (y, y64) in enumerate(zip(ys, ref(xd))):
        assert sqnr_db(y, y64) >= OUT_DB, f"part {i}"
    assert got.keys() == {"x", *dict(m.named_parameters())} and {"weight", "bias", "layer_norm_weight"} <= got.keys()
    for name, g in got.items():
        assert sqnr_db(g, want[name]) >= GRAD_DB, name
    ys1, got1 = fp8_parts_step(single, x, targets, recipe)
    for i, (y, y1) in enumerate(zip(ys, ys1)):
        assert torch.equal(y, y1), f"part {i}"
    for name, g in got.items():
        assert torch.equal(g, got1[name]), name


def test_layernorm_linear_parts_layout_and_description():
    m = fp8train.LayerNormLinear(32, [32, 16, 16], return_layernorm_output=True)
    assert m.out_features == (32, 16, 16) and m.out_parts == (32, 16, 16)
    one = fp8train.LayerNormLinear(32, 64)
    assert {k: v.shape for k, v in m.state_dict().items()} == {k: v.shape for k, v in one.state_dict().items()}
    assert "out_features=(32, 16, 16)" in repr(m) and "out=(32, 16, 16)" in m.describe()
    assert isinstance(one(torch.randn(4, 32)), torch.Tensor)
    q, k, v, ln = m(torch.randn(4, 32))
    assert (q.shape, k.shape, v.shape, ln.shape) == ((4, 32), (4, 16), (4, 16), (4, 32))


@pytest.mark.parametrize("out, match", [
    ((), r"out_features=\(\) has no parts"),
    ((32, 0, 16), r"out_features part 1 must be a positive int, got 0"),
    ((32, -16), r"part 1 must be a positive int, got -16"),
    ((32.0, 16), r"part 0 must be a positive int, got 32.0"),
    ((32, True), r"part 1 must be a positive int, got True"),
    ((32, "16"), r"part 1 must be a positive int, got '16'"),
    (0, r"out_features must be a positive int or a tuple of positive ints"),
    ("64", r"out_features must be a positive int or a tuple"),
])
def test_layernorm_linear_parts_bad_arguments(out, match):
    with pytest.raises(ValueError, match=match):
        fp8train.LayerNormLinear(32, out)


# ---------------------------------------------------------------- checkpoints
def make_stack(seed, device):
    torch.manual_seed(seed)
    return torch.nn.Sequential(fp8train.LayerNormLinear(32, 64, device=device),
                               fp8train.LayerNormMLP(64, 128, activation="swiglu", normalization="RMSNorm",
                                                     device=device))


def train(model, opt, recipe, data):
    losses = []
    for x, t in data:
        with fp8train.autocast(recipe=recipe):
            loss = F.mse_loss(model(x).float(), t)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


@pytest.mark.parametrize("recipe", RECIPES)
def test_checkpoint_resumes_bit_identically(recipe, device):
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(24, 32, generator=g).to(device), torch.randn(24, 64, generator=g).to(device))
            for _ in range(10)]
    model = make_stack(0, device)
    straight = train(model, torch.optim.Adam(model.parameters(), lr=1e-2), recipe, data)
    model = make_stack(0, device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    first = train(model, opt, recipe, data[:5])
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    assert "1.fc2_grad_output_quantizer.scale" in ckpt["model"]
    resumed = make_stack(7, device)
    resumed.load_state_dict(ckpt["model"])
    opt = torch.optim.Adam(resumed.parameters(), lr=1e-2)
    opt.load_state_dict(ckpt["opt"])
    second = train(resumed, opt, recipe, data[5:])
    assert torch.equal(torch.stack(straight), torch.stack(first + second))


# ---------------------------------------------------------------- errors and fallbacks
def test_bad_arguments():
    with pytest.raises(ValueError, match="normalization"):
        fp8train.LayerNormLinear(32, 16, normalization="BatchNorm")
    with pytest.raises(ValueError, match="eps"):
        fp8train.LayerNormMLP(32, 64, eps=-1.0)
    with pytest.raises(ValueError, match="activation"):
        fp8train.LayerNormMLP(32, 64, activation="tanh")
    with pytest.raises(ValueError, match="hidden_size"):
        fp8train.LayerNormMLP(0, 64)
    with pytest.raises(ValueError, match="in_features=32"):
        fp8train.LayerNormLinear(32, 16)(torch.randn(4, 31))


def test_dims_that_fp8_cannot_take_run_in_high_precision_and_say_so(device):
    m = fp8train.LayerNormMLP(40, 64, device=device)
    x = torch.randn(4, 40, device=device)
    with pytest.warns(UserWarning, match="multiples of 16"):
        with fp8train.autocast():
            y = m(x)
    assert torch.equal(y, m(x))
