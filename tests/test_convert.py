"""fp8train.convert on CPU: which layers are swapped, shared parameters, exact outputs outside
autocast, training inside, and the clear errors."""
import copy

import pytest
import torch
from torch import nn

import fp8train
from helpers import sqnr_db


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(64)
        self.up = nn.Linear(64, 128)
        self.down = nn.Linear(128, 64, bias=False)
        self.odd = nn.Linear(64, 10)  # 10 is not a multiple of 16: stays nn.Linear

    def forward(self, x):
        h = self.down(torch.nn.functional.gelu(self.up(self.norm(x)))) + x
        return self.odd(h)


def model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return nn.Sequential(Block(), nn.ReLU(), nn.Sequential(nn.Linear(10, 32), nn.Linear(32, 16))).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_swaps_eligible_linears_in_place_and_keeps_outputs(dtype):
    m = model(dtype=dtype)
    params_before = {n: p for n, p in m.named_parameters()}
    x = torch.randn(3, 7, 64, dtype=dtype)
    want = m(x)
    assert fp8train.convert(m) is m
    kinds = {n: type(mod) for n, mod in m.named_modules()}
    assert kinds["0.up"] is fp8train.Linear and kinds["0.down"] is fp8train.Linear
    assert kinds["2.1"] is fp8train.Linear
    assert kinds["0.odd"] is nn.Linear and kinds["2.0"] is nn.Linear  # in_features 10 / out_features 10
    assert m[0].up.name == "0.up"
    for n, p in m.named_parameters():  # the very same Parameter objects
        assert p is params_before[n], n
    assert torch.equal(m(x), want)


def test_filter_fn_and_recipe():
    m = model()
    seen = []

    def only_up(name, module):
        seen.append(name)
        return name.endswith("up")
    fp8train.convert(m, recipe=fp8train.CurrentScaling(), filter_fn=only_up)
    assert isinstance(m[0].up, fp8train.Linear) and type(m[0].down) is nn.Linear
    assert set(seen) == {"0.up", "0.down", "2.1"}
    assert isinstance(m[0].up.input_quantizer, fp8train.CurrentScalingQuantizer)
    assert "0.up.input_quantizer.scale" in m.state_dict()


def test_converted_model_trains_in_fp8_with_a_prebuilt_optimizer():
    m = model()
    ref = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)  # built before conversion
    fp8train.convert(m)
    x, target = torch.randn(32, 64), torch.randn(32, 16)
    recipe = fp8train.DelayedScaling()
    for _ in range(3):
        with fp8train.autocast(recipe=recipe):
            loss = torch.nn.functional.mse_loss(m(x), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert all(p.grad is not None for p in m.parameters())
    assert not torch.equal(m[0].up.weight, ref[0].up.weight)  # the optimizer updated the shared parameter
    with fp8train.autocast(recipe=recipe):
        y = m(x)
    assert sqnr_db(y, m(x)) > 20  # FP8 forward close to the same model in high precision


@pytest.mark.parametrize("recipe", [fp8train.DelayedScaling(), fp8train.CurrentScaling(), fp8train.BlockScaling()],
                         ids=["delayed", "current", "block"])
@pytest.mark.parametrize("cast", [lambda m: m.to(torch.bfloat16), lambda m: m.half()],
                         ids=["to-bf16", "half"])
def test_casting_a_converted_model_converts_its_parameters_not_its_scaling_state(recipe, cast):
    """model.to(dtype) after convert (pure-bf16 training): the layers' parameters take the
    dtype, the quantizers' state stays float32 with its bits, and the model then trains as
    one whose parameters alone were converted."""
    m = model()
    fp8train.convert(m, recipe)
    x = torch.randn(32, 64)
    with fp8train.autocast(recipe=recipe):
        m(x).float().pow(2).mean().backward()  # a step's scaling state (delayed: a recorded amax)
    m.zero_grad(set_to_none=True)
    twin = copy.deepcopy(m)
    state = copy.deepcopy(m.state_dict())
    assert cast(m) is m
    dtype = m[0].up.weight.dtype
    assert dtype != torch.float32
    for p in twin.parameters():  # the parameters alone
        p.data = p.data.to(dtype)
    for name, buf in m.named_buffers():
        if ".input_quantizer." in name or ".weight_quantizer." in name or ".grad_output_quantizer." in name:
            assert buf.dtype in (torch.float32, torch.int32), name
            assert name not in state or torch.equal(buf, state[name]), name
    with fp8train.autocast(recipe=recipe):  # one region: a delayed update rolls every live quantizer
        losses = [model_(x.to(dtype)).float().pow(2).mean() for model_ in (m, twin)]
    assert torch.equal(losses[0], losses[1])
    for (name, a), b in zip(m.state_dict().items(), twin.state_dict().values()):
        assert a.dtype == b.dtype and torch.equal(a, b), name


@pytest.mark.parametrize("recipe", [fp8train.DelayedScaling(), fp8train.CurrentScaling(), fp8train.BlockScaling()],
                         ids=["delayed", "current", "block"])
def test_meta_device_init_then_to_empty_starts_from_fresh_scaling_state(recipe):
    """Built on the meta device, converted, then materialised with to_empty (torchtitan's and
    FSDP2's way to build big models): the quantizers' buffers come back as uninitialised
    memory, and are refilled with a new quantizer's state. The model then trains as one built
    on the CPU with the same weights."""
    with torch.device("meta"):
        meta = model()
    fp8train.convert(meta, recipe)
    meta.to_empty(device="cpu")
    twin = fp8train.convert(model(), recipe)
    weights = {k: v for k, v in twin.state_dict().items() if "_quantizer." not in k}
    meta.load_state_dict(weights, strict=False)  # the weights alone, as an init would write them
    for (name, a), b in zip(meta.state_dict().items(), twin.state_dict().values()):
        assert torch.equal(a, b), name
    x = torch.randn(32, 64)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (meta, twin)]
    for _ in range(3):
        with fp8train.autocast(recipe=recipe):  # one region: a delayed update rolls every live quantizer
            losses = [m(x).float().pow(2).mean() for m in (meta, twin)]
        assert torch.equal(losses[0], losses[1])
        for loss, opt in zip(losses, opts):
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)


class Experts(nn.Module):
    """An MoE's experts as Hugging Face's MoE models hold them (transformers 5): one module
    with 3-D weights and its own matmuls, no nn.Linear."""

    def __init__(self, n=4, d=64, f=32):
        super().__init__()
        self.w = nn.Parameter(torch.randn(n, f, d) * 0.1)

    def forward(self, x):
        return torch.einsum("...d,nfd->...f", x, self.w)


def test_coverage_says_what_stays_in_high_precision():
    m = nn.Sequential(nn.Embedding(100, 64), nn.Linear(64, 64), nn.Linear(64, 10), Experts(), nn.Linear(32, 64))
    with pytest.warns(UserWarning, match=r"1 module\(s\) of type Experts hold (\d+)% .* not nn.Linear") as record:
        fp8train.convert(m, filter_fn=lambda name, mod: name != "4")
    # matrices outside the embedding: 64*64 (FP8) + 64*10 (dims) + 4*32*64 (experts) + 32*64 (left)
    share = round(100 * 4 * 32 * 64 / (64 * 64 + 64 * 10 + 4 * 32 * 64 + 32 * 64))
    assert f"hold {share}%" in str(record[0].message)
    rows = {c.name: (c.kind, c.params, c.reason) for c in fp8train.inspect.coverage(m)}
    Reason = fp8train.inspect.Reason
    assert rows == {"0": ("Embedding", 6400, Reason.EMBEDDING), "1": ("Linear", 4096, Reason.FP8),
                    "2": ("Linear", 640, Reason.DIMS), "3": ("Experts", 8192, Reason.NOT_LINEAR),
                    "4": ("Linear", 2048, Reason.LEFT)}


def test_convert_of_a_model_of_linears_says_nothing():
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fp8train.convert(model())  # its odd Linear stays, as documented: no warning for that


def test_errors():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        fp8train.convert(object())
    with pytest.raises(TypeError, match="filter_fn"):
        fp8train.convert(model(), filter_fn=3)
    with pytest.raises(ValueError):
        fp8train.convert(model(), recipe="delayed")
    m = model()
    m[0].up.register_forward_hook(lambda *a: None)
    with pytest.raises(ValueError, match="hooks"):
        fp8train.convert(m)
