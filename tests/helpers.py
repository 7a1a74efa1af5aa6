"""Shared test helpers: SQNR, bf16 bit patterns, FP8 byte comparison, poisoned outputs, the
TP backward's reduction / wgrad order."""
import contextlib
import math

import pytest
import torch


# Parameter lists the kernel tests share: the FP8 formats, and the input dtypes a cast reads.
FP8_FORMATS = [pytest.param(torch.float8_e4m3fn, id="e4m3"), pytest.param(torch.float8_e5m2, id="e5m2")]
INPUT_DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16"),
                pytest.param(torch.float32, id="fp32")]


def sqnr_db(actual: torch.Tensor, reference: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of `actual` against `reference`, in dB (float64)."""
    ref = reference.detach().double()
    noise = (actual.detach().double() - ref).pow(2).sum()
    return float(10 * torch.log10(ref.pow(2).sum() / noise)) if noise > 0 else float("inf")


def rel_err(actual: torch.Tensor, reference: torch.Tensor) -> float:
    """||actual - reference|| / ||reference||, in float64."""
    return ((actual.double() - reference.double()).norm() / reference.double().norm()).item()


def all_bf16_values(device="cpu") -> torch.Tensor:
    """Every one of the 65536 bfloat16 bit patterns (NaNs, infs, subnormals included)."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32, device=device).to(torch.int16)
    return bits.view(torch.bfloat16)


def fp8_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def int_bits(t: torch.Tensor) -> torch.Tensor:
    """t's bits as the signed integer dtype of its element size."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_bitwise(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Same dtype, shape and bits (NaN payloads included); names the first differing elements."""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    diff = int_bits(got) != int_bits(want)
    if diff.any():
        at = diff.nonzero()[:5].tolist()
        g = [int_bits(got)[tuple(i)].item() for i in at]
        w = [int_bits(want)[tuple(i)].item() for i in at]
        pytest.fail(f"{what}: {int(diff.sum())} of {diff.numel()} differ; at {at}: got {g}, want {w}")


def poisoned(shape, dtype, byte: int, device="cuda") -> torch.Tensor:
    """A tensor of `dtype` whose every byte is `byte` (an output a kernel must overwrite)."""
    size = torch.empty((), dtype=dtype).element_size()
    return torch.full((*shape[:-1], shape[-1] * size), byte, dtype=torch.uint8, device=device).view(dtype)


def fp8_order(t: torch.Tensor) -> torch.Tensor:
    """fp8 bytes on a line where neighbouring values differ by 1 (+0 and -0 both at 0)."""
    b = t.view(torch.uint8).int()
    return torch.where(b >= 0x80, -(b & 0x7F), b & 0x7F)


class RecordDgradOverlap:
    """While active, records in order (`.events`) what the TP backward does around its
    activation-gradient reductions, from the host's view:

      "issue"  a sum over ranks (all-reduce / reduce-scatter) of a tensor of 2 or more dims
               is called (parameter gradients and amaxes are vectors or scalars: not recorded)
      "done"   its result is ready: a synchronous call returned, or an async one's wait()
      "wgrad"  fp8train.gemm.wgrad is called

    The library looks the torch.distributed functions and gemm.wgrad up per call, so
    replacing the attributes is enough; a deprecated name forwarding to the new one records
    once."""

    REDUCTIONS = {"all_reduce": 0, "reduce_scatter_single": 1, "reduce_scatter_tensor": 1}  # name: tensor arg

    def __enter__(self):
        import torch.distributed as dist
        from fp8train import gemm

        self.events = []
        self._orig = [(dist, n, getattr(dist, n)) for n in self.REDUCTIONS if hasattr(dist, n)]
        self._orig.append((gemm, "wgrad", gemm.wgrad))
        events, depth = self.events, [0]

        class _Work:  # an async collective's handle: "done" when waited for
            def __init__(self, work):
                self._work = work

            def wait(self, *args, **kwargs):
                out = self._work.wait(*args, **kwargs)
                events.append("done")
                return out

        def reduction(fn, arg):
            def recorded(*args, **kwargs):
                t = args[arg] if len(args) > arg else kwargs.get("tensor" if arg == 0 else "input")
                record = depth[0] == 0 and t.dim() >= 2
                if record:
                    events.append("issue")
                depth[0] += 1
                try:
                    work = fn(*args, **kwargs)
                finally:
                    depth[0] -= 1
                if record and work is None:
                    events.append("done")
                return _Work(work) if record and work is not None else work
            return recorded

        def wgrad(*args, **kwargs):
            events.append("wgrad")
            return self._orig[-1][2](*args, **kwargs)

        for owner, name, fn in self._orig[:-1]:
            setattr(owner, name, reduction(fn, self.REDUCTIONS[name]))
        gemm.wgrad = wgrad
        return self

    def __exit__(self, *exc):
        for owner, name, fn in self._orig:
            setattr(owner, name, fn)


def autocast_steps(module, xs, dys, recipe, grad_x: bool = True):
    """Per step (grad_fn name, y, x.grad, parameter grads) of module's forward inside
    fp8train.autocast(recipe) and backward with dy, then its state_dict after the last step.

    Run all of one module's steps before its twin's: every autocast entry rolls every live
    delayed quantizer, so interleaved steps would roll each module's histories at the other's
    entries."""
    import fp8train  # here: the helpers' other users need no fp8train import
    out = []
    for x, dy in zip(xs, dys):
        x = x.detach().clone().requires_grad_(grad_x)
        with fp8train.autocast(recipe=recipe):
            y = module(x)
        name = y.grad_fn.name() if y.grad_fn is not None else "none"
        if y.requires_grad:
            y.backward(dy)
        out.append((name, y.detach(), x.grad,
                    {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}))
        module.zero_grad(set_to_none=True)
    return out, {n: t.clone() for n, t in module.state_dict().items()}


def assert_same_steps(got, want) -> None:
    """Two autocast_steps results bit for bit: each step's output, input and parameter
    gradients (the same ones present), then the final state."""
    (steps, state), (steps_ref, state_ref) = got, want
    assert len(steps) == len(steps_ref)
    for i, ((_, y, dx, grads), (_, y_ref, dx_ref, grads_ref)) in enumerate(zip(steps, steps_ref)):
        assert_bitwise(y, y_ref, f"step {i}: y")
        assert (dx is None) == (dx_ref is None), f"step {i}: x.grad presence"
        if dx is not None:
            assert_bitwise(dx, dx_ref, f"step {i}: x.grad")
        assert grads.keys() == grads_ref.keys(), f"step {i}: which parameters got gradients"
        for name in grads_ref:
            assert_bitwise(grads[name], grads_ref[name], f"step {i}: {name}.grad")
    assert state.keys() == state_ref.keys()
    for name, t in state_ref.items():
        assert_bitwise(state[name], t, name)


def high_node_case(shape, ffn: int, activation, bias: bool, dtype, device, needs=(True,) * 7) -> dict:
    """Input, parameters and output gradient for the C++ high-precision node, in `dtype`: a
    LayerNormMLP's (LayerNorm weight and bias, fc1, fc2: the node's argument order) or, for
    activation None, a LayerNormLinear's (LayerNorm, then a Linear of `ffn` outputs);
    needs[i]: whether the i-th of (x, *params) requires grad."""
    k = shape[-1]
    f1 = 2 * ffn if activation == "swiglu" else ffn

    def t(*size, scale=1.0, shift=0.0):
        return torch.randn(*size, device=device).mul(scale).add(shift).to(dtype)
    params = [t(k, scale=0.5, shift=1.0), t(k, scale=0.1) if bias else None, t(f1, k, scale=k ** -0.5),
              t(f1, scale=0.1) if bias else None]
    if activation is not None:
        params += [t(k, ffn, scale=ffn ** -0.5), t(k, scale=0.1) if bias else None]
    x = t(*shape)
    for leaf, need in zip([x] + params, needs):
        if leaf is not None:
            leaf.requires_grad_(need)
    out = k if activation is not None else ffn
    return {"x": x, "params": params, "dy": t(*shape[:-1], out)}


def high_node_steps(ext, case, activation, eps: float = 1e-5) -> None:
    """The node (ext.high_mlp_forward, or ext.high_ln_linear_forward for activation None)
    against the torch composition it stands for: output and every gradient bit for bit, and
    the same inputs given gradients."""
    import torch.nn.functional as F

    from fp8train.modules import high_node
    from fp8train.modules.activation import activation_high_precision
    x, params, dy = case["x"], case["params"], case["dy"]
    leaves = [t for t in [x] + params if t is not None]

    def composition():
        y = F.linear(F.layer_norm(x, (x.shape[-1],), params[0], params[1], eps), params[2], params[3])
        if activation is None:
            return y
        return F.linear(activation_high_precision(y, activation), params[4], params[5])

    def node():
        if activation is None:
            return ext.high_ln_linear_forward(x, *params, eps)
        return ext.high_mlp_forward(x, *params, eps, high_node.ACTIVATION_CODES[activation])

    results = []
    for fn in (composition, node):
        y = fn()
        if y.requires_grad:
            y.backward(dy)
        results.append((y.detach(), [None if t.grad is None else t.grad.clone() for t in leaves]))
        for t in leaves:
            t.grad = None
    (y_want, g_want), (y_got, g_got) = results
    assert_bitwise(y_got, y_want, "output")
    for i, (got, want) in enumerate(zip(g_got, g_want)):
        assert (got is None) == (want is None), f"gradient {i}: given {got is not None}, composition {want is not None}"
        if want is not None:
            assert_bitwise(got, want, f"gradient {i}")


@contextlib.contextmanager
def own_precision_table(device, path):
    """A fresh auto-precision table for `device`'s model, saved at `path`, in use inside; the
    table in use before comes back after."""
    from fp8train import precision
    name = precision.device_name(device)
    saved = precision._TABLES.get(name)
    table = precision.PrecisionTable(name, path)
    precision.use_table(table)
    try:
        yield table
    finally:
        if saved is None:
            precision._TABLES.pop(name, None)
        else:
            precision._TABLES[name] = saved
        precision.refresh()


def free_port() -> int:
    """A free TCP port on the loopback interface (for a torchrun rendezvous)."""
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def make_input(shape, dtype, device="cuda") -> torch.Tensor:
    """Random values over ~24 binades with NaN, +-inf, -0 and subnormals sprinkled in (the
    kernels' GPU tests against their twins)."""
    x = (torch.randn(shape, device=device) * torch.exp2(torch.randint(-12, 12, shape, device=device).float())).to(dtype)
    flat = x.view(-1)
    if flat.numel() >= 16:
        tiny = torch.finfo(dtype).tiny
        specials = torch.tensor([math.nan, -math.nan, math.inf, -math.inf, -0.0, tiny / 8, -tiny / 2, 6e4, -5e5],
                                device=device).to(dtype)
        idx = torch.randint(0, flat.numel(), (specials.numel() * 4,), device=device)
        flat[idx] = specials.repeat(4)
    return x


def sgd_steps(model, recipe, xs, params_dtype, fp8: bool = True):
    """Per step: (output, input grad, parameter grads) of a squared-mean loss under `recipe`
    (with torch.autocast to bf16 where the parameters are float32); SGD between steps.
    fp8=False: fp8train's autocast off (recipe unused), the reference without FP8. A compiled
    model's gradients are named as its original module's (without `_orig_mod.`)."""
    import fp8train
    named = getattr(model, "_orig_mod", model).named_parameters
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for x in xs:
        x = x.clone().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=params_dtype == torch.float32), \
                (fp8train.autocast(recipe=recipe) if fp8 else fp8train.autocast(enabled=False)):
            y = model(x)
        y.float().pow(2).mean().backward()
        out.append((y.detach(), x.grad, {n: p.grad.clone() for n, p in named()}))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out


def converted_llama(recipe, device, shape: str = "tiny"):
    """benchmarks/hf_llama.py's LlamaForCausalLM at `shape` (FP32 parameters), converted with
    `recipe` (None: the quantizers come at the first FP8 call), the LM head left out."""
    import fp8train
    import hf_llama  # benchmarks/ is on sys.path (conftest.py)
    model = hf_llama.build_llama(hf_llama.SHAPES[shape], device)
    return fp8train.convert(model, recipe, filter_fn=hf_llama.not_lm_head)


# transformers decoder families beside Llama: (config overrides, fp8train.Linear count,
# fp8train.RMSNorm count, fp8train.GatedMLP count after convert) at 2 layers (tests/test_hf_families.py)
HF_FAMILIES = {
    "mistral": ({}, 14, 5, 2),
    "qwen2": ({}, 14, 5, 2),
    "qwen3": ({"head_dim": 16}, 14, 9, 2),  # q_norm and k_norm over head_dim, after the projections
    "phi3": ({"pad_token_id": 0}, 8, 5, 0),  # fused qkv_proj and gate_up_proj: its MLPs stay
    "gemma": ({"head_dim": 16}, 14, 0, 2),  # norms y * (1 + weight): another formula, they stay; GeGLU MLPs
    "olmo2": ({}, 14, 0, 2),  # weight * x rounded after the product: another formula
}


def hf_family_model(family: str, device="cpu", dtype=torch.float32, seed: int = 0):
    """A tiny causal LM of `family` (HF_FAMILIES; random init, vocab 256, hidden 64, 2 layers,
    GQA 4/2) with parameters in `dtype`."""
    import transformers
    config = transformers.AutoConfig.for_model(
        family, vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, **HF_FAMILIES[family][0])
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).to(device)


def llama_steps_side_by_side(models, recipe, steps, device, shape=(2, 64), lengths=None):
    """`steps` AdamW steps of HF causal LMs on the same random byte batches (`shape`, or
    sequence lengths `lengths`, one step each, batch shape[0]), each step's forwards in one
    FP8 region (a delayed update rolls every live quantizer: every model sees the same
    updates; recipe None: no FP8), the backwards after it exits (a checkpointed forward's
    recomputation runs there). Returns each model's losses."""
    import fp8train
    g = torch.Generator().manual_seed(0)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, fused=device.type == "cuda") for m in models]
    losses = [[] for _ in models]
    for length in lengths or (shape[1],) * steps:
        x = torch.randint(0, 256, (shape[0], length), generator=g).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16), \
                fp8train.autocast(enabled=recipe is not None, recipe=recipe):
            out = [m(input_ids=x, labels=x, use_cache=False).loss for m in models]
        for loss, opt, record in zip(out, opts, losses):
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            record.append(loss.detach())
    return [torch.stack(record) for record in losses]
