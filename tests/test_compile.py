"""torch.compile(fullgraph=True) of Linear, LayerNormLinear and LayerNormMLP on CPU.

Compiled and eager compute the same values: the casts trace as the twins' torch ops, the
norm and activation kernels are custom ops that call the twins (fp8train/ops.py), and the
GEMMs are the same emulation, so outputs, gradients and the scaling state are compared bit
for bit. Most cases
use the aot_eager backend (Dynamo + AOTAutograd + functionalization, no code generation: the
whole trace in ~1 s); one case runs Inductor (C++ code generation with gcc, ~10 s here).
"""
import copy
import math

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import fp8train
from fp8train import CurrentScaling, DelayedScaling
from fp8train.kernels import reference
from helpers import rel_err

DELAYED, CURRENT = DelayedScaling(amax_history_len=8), CurrentScaling()
STEPS = 3


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()  # no compiled code or counters leak between tests
    yield
    torch._dynamo.reset()


def make(kind: str, **kw):
    if kind == "linear":
        return fp8train.Linear(32, 48, **kw)
    if kind == "layernorm_linear":
        return fp8train.LayerNormLinear(32, 48, **kw)
    return fp8train.LayerNormMLP(32, 64, **kw)


def run_side_by_side(module, recipe, backend="aot_eager", steps=STEPS, shape=(2, 9, 32), **call_kw):
    """`steps` training steps of `module` compiled and of an eager copy, each step's FP8
    region shared (one scale update for both). Asserts bit-equal outputs, gradients and
    buffers after every step; returns the compile counter."""
    eager = copy.deepcopy(module)
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(module, fullgraph=True, backend=counter)
    for step in range(steps):
        x = torch.randn(shape, dtype=torch.bfloat16)
        xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
        with fp8train.autocast(recipe=recipe):
            yc = compiled(xc, **call_kw)
            ye = eager(xe, **call_kw)
        yc, ye = (yc[0], ye[0]) if isinstance(yc, tuple) else (yc, ye)
        yc.float().square().mean().backward()
        ye.float().square().mean().backward()
        assert torch.equal(yc, ye), f"step {step}: outputs differ"
        assert torch.equal(xc.grad, xe.grad), f"step {step}: input gradients differ"
        for (name, p), q in zip(module.named_parameters(), eager.parameters()):
            assert torch.equal(p.grad, q.grad), f"step {step}: {name}.grad differs"
        for (name, b), c in zip(module.named_buffers(), eager.buffers()):
            assert torch.equal(b, c), f"step {step}: {name} differs"
    return counter


# Delayed scaling compiles twice: the first call calibrates (one extra amax pass in the
# forward and in the backward), the flag flips, and the graph is specialised on it.
FRAMES = {"delayed": 2, "current": 1}
RECIPES = [pytest.param(DELAYED, id="delayed"), pytest.param(CURRENT, id="current")]


def frames_for(recipe) -> int:
    return FRAMES["delayed" if isinstance(recipe, DelayedScaling) else "current"]


@pytest.mark.parametrize("recipe", RECIPES)
def test_linear_compiled_matches_eager(recipe):
    counter = run_side_by_side(make("linear"), recipe)
    assert counter.frame_count == frames_for(recipe)


# make test keeps the delayed Linear (calibration, then the steady state); the rest is slow
KERNEL_OP_CASES = [pytest.param(recipe, kind, id=f"{name}-{kind}",
                                marks=() if (name, kind) == ("delayed", "linear") else pytest.mark.slow)
                   for name, recipe in (("delayed", DELAYED), ("current", CURRENT))
                   for kind in ("linear", "layernorm_mlp")]


@pytest.mark.parametrize("recipe, kind", KERNEL_OP_CASES)
def test_casts_as_the_kernel_operator_compile_to_eager(recipe, kind):
    # the casts trace as the operator fp8train::cast_kernels, a triton_op that mutates the
    # scaling state (on the CPU its body is the twin's torch ops, traced into the graph; on
    # CUDA the eager kernels: tests/gpu/test_compile_gpu.py). The same bits as eager, steps
    # after calibration included.
    counter = run_side_by_side(make(kind), recipe)
    assert counter.frame_count == frames_for(recipe)
    assert all("fp8train.cast_kernels" in g.code for g in counter.graphs)


@pytest.mark.parametrize("recipe, normalization, want_ln", [
    pytest.param(DELAYED, "LayerNorm", True, id="delayed-layernorm-ln_out"),
    pytest.param(CURRENT, "RMSNorm", False, id="current-rmsnorm"),
])
def test_layernorm_linear_compiled_matches_eager(recipe, normalization, want_ln):
    module = make("layernorm_linear", normalization=normalization, return_layernorm_output=want_ln)
    counter = run_side_by_side(module, recipe)
    assert counter.frame_count == frames_for(recipe)


@pytest.mark.parametrize("recipe", RECIPES)
def test_layernorm_linear_with_parts_compiled_matches_eager(recipe):
    # out_features=(q, k, v): the split of the one GEMM's output traces with it (the first
    # part's gradient only: the others' come back as zeros through the split)
    module = fp8train.LayerNormLinear(32, (32, 16, 16), return_layernorm_output=True)
    counter = run_side_by_side(module, recipe)
    assert counter.frame_count == frames_for(recipe)


@pytest.mark.parametrize("recipe, normalization, activation", [
    pytest.param(DELAYED, "LayerNorm", "gelu", id="delayed-layernorm-gelu"),
    pytest.param(CURRENT, "RMSNorm", "swiglu", id="current-rmsnorm-swiglu"),
])
def test_layernorm_mlp_compiled_matches_eager(recipe, normalization, activation):
    counter = run_side_by_side(make("layernorm_mlp", normalization=normalization, activation=activation), recipe)
    assert counter.frame_count == frames_for(recipe)


# make test runs current scaling, which computes a scale in every traced cast; delayed scaling
# computes one in its calibrating cast only (its updates run eagerly): slow tier.
POW2_RECIPES = [pytest.param(DelayedScaling(amax_history_len=8, power_of_two_scales=True), id="delayed-pow2",
                             marks=pytest.mark.slow),
                pytest.param(CurrentScaling(power_of_two_scales=True), id="current-pow2")]


def assert_power_of_two_scales(module):
    scales = [q.scale.item() for q in module.modules() if isinstance(q, fp8train.quantizer.Quantizer)]
    assert scales and all(math.frexp(s)[0] == 0.5 for s in scales), scales


@pytest.mark.parametrize("recipe", POW2_RECIPES)
def test_linear_with_power_of_two_scales_compiled_matches_eager(recipe):
    # The traced cast rounds the scales it computes (current scaling, the delayed calibration)
    # as the eager twins do: same bytes, gradients and scaling state, every scale a power of two.
    module = make("linear")
    counter = run_side_by_side(module, recipe)
    assert counter.frame_count == frames_for(recipe)
    assert_power_of_two_scales(module)


@pytest.mark.slow  # ~15 s of Inductor C++ compiles on a 2-core machine
def test_inductor_linear_with_power_of_two_scales_is_eager_bit_for_bit():
    module = make("linear")
    counter = run_side_by_side(module, CurrentScaling(power_of_two_scales=True), backend="inductor", steps=2)
    assert counter.frame_count == 1
    assert_power_of_two_scales(module)


@pytest.mark.slow  # 28 s of a cold Inductor start in a fresh CI clone; the traced rounding is in make test above
def test_inductor_rounds_scales_down_to_powers_of_two_as_eager():
    # The mantissa mask (scaling.round_down_pow2: a float32 -> int32 bit view) in Inductor's
    # C++ code: the same scales as eager over every edge case (zero, subnormal, inf, NaN,
    # powers of two and their neighbours) and random amaxes, with a margin.
    amax = torch.tensor([0.0, 1.4e-45, 1e-40, 2.0**-126, 1.0, 448.0, 3.0, 7.0 * 2.0**-10, 3e38,
                         float("inf"), float("nan")], dtype=torch.float32)
    amax = torch.cat([amax, torch.nextafter(amax, torch.tensor(float("inf"))),
                      torch.rand(4096) * 10.0 ** torch.randint(-30, 30, (4096,)).float()])
    prev = torch.full_like(amax, 0.5)
    fn = lambda a, p: fp8train.scaling.compute_scale(a, p, 448.0, 3, power_of_two=True)  # noqa: E731
    got = torch.compile(fn, backend="inductor")(amax, prev)
    assert torch.equal(got, fn(amax, prev))
    assert torch.equal(got, fp8train.scaling.round_down_pow2(got))


@pytest.mark.slow  # 26 s cold (Inductor's C++ for a whole LayerNormMLP step); make test keeps the traced-cast Inductor case
def test_inductor_compiles_layernorm_mlp_to_the_same_bits():
    # Inductor generates C++ for the glue around the custom ops and _scaled_mm; the ops
    # themselves stay calls, so the bits are unchanged.
    counter = run_side_by_side(make("layernorm_mlp"), CURRENT, backend="inductor", steps=2)
    assert counter.frame_count == 1


@pytest.mark.parametrize("kind", ["linear", "layernorm_linear", "layernorm_mlp"])
def test_no_graph_breaks_casts_and_fused_kernels_as_operators(kind):
    module = make(kind)
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    x = torch.randn(16, 32, dtype=torch.bfloat16, requires_grad=True)
    with fp8train.autocast(recipe=CURRENT):
        explanation = torch._dynamo.explain(module)(x)
        torch.compile(module, fullgraph=True, backend=capture)(x).sum().backward()
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    # The autograd.Function's forward and backward are subgraphs (submodules) of the graph.
    nodes = [n for g in graphs for sub in g.modules() if isinstance(sub, torch.fx.GraphModule)
             for n in sub.graph.nodes if n.op == "call_function"]
    ops = {str(n.target).removesuffix(".default") for n in nodes if str(n.target).startswith("fp8train.")}
    want = {"linear": set(),
            "layernorm_linear": {"fp8train.norm_fwd_fp8", "fp8train.norm_bwd"},
            "layernorm_mlp": {"fp8train.norm_fwd_fp8", "fp8train.act_fwd_fp8", "fp8train.act_bwd_fp8",
                              "fp8train.norm_bwd"}}[kind]
    assert ops == want | {"fp8train.cast_kernels", "fp8train.emulated_scaled_mm"}, ops
    fp8_values = [n for g in graphs for sub in g.modules() if isinstance(sub, torch.fx.GraphModule)
                  for n in sub.graph.nodes if getattr(n.meta.get("example_value"), "dtype", None)
                  in (torch.float8_e4m3fn, torch.float8_e5m2) and n.op in ("call_method", "call_function")]
    assert fp8_values, "no torch op in the traced graph makes an FP8 tensor"


STATES = ["delayed", "delayed-calibrating", "current"]


def _quantizer(kind: str, role=fp8train.TensorRole.INPUT):
    q = fp8train.quantizer_factory.make_quantizer(CURRENT if kind == "current" else DELAYED, role)
    if kind == "delayed":
        q.calibrated = True
        q.scale.fill_(3.25)
        q.amax_history.copy_(torch.tensor([0.5, 7.0, 2.0, -1, -1, -1, -1, -1]))
    return q


# Inductor's C++ compiles cost ~5 s each on a 2-core machine (~13 s cold): make test runs the
# one compile that takes the most branches (current scaling's first pass, scale and count; odd
# rows; the transposed copy and dbias), the rest is slow.
CAST_CASES = [pytest.param(kind, shape, transpose, dbias,
                           id=f"{kind}-{name}-{'t' if transpose else 'n'}{'-dbias' if dbias else ''}",
                           marks=() if (kind, name, transpose, dbias) == ("current", "3d-odd-rows", True, True)
                           else pytest.mark.slow)
              for kind in STATES for shape, name in (((20, 48), "2d"), ((3, 7, 32), "3d-odd-rows"))
              for transpose, dbias in ((True, True), (False, False), (True, False))]


@pytest.mark.parametrize("kind, shape, transpose, dbias", CAST_CASES)
def test_traced_cast_under_inductor_is_the_eager_cast(kind, shape, transpose, dbias):
    # ops.cast (what Quantizer.cast traces to) compiled by Inductor (C++ code on CPU) against
    # the eager cast, bit for bit: payload, transposed copy with its zero padding, scale_inv
    # and the scaling state; dbias (a float32 sum in another order) within float32 rounding.
    # Inputs span the e4m3 range edges, NaN and inf (inf saturates, both count in the amax).
    # On the CPU the operator fp8train::cast_kernels is its body, the twin's torch ops; the
    # per-row amaxes of current scaling are taken in the graph (ops.graph_row_abs_max) and
    # reduced by the operator, as on the GPU.
    torch.manual_seed(0)
    x = (torch.randn(shape) * torch.logspace(-6, 3, shape[-1])).to(torch.bfloat16)
    x.view(-1)[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0], dtype=torch.bfloat16)
    eager_q, traced_q = _quantizer(kind), _quantizer(kind)
    want = eager_q.cast(x, transpose=transpose, dbias=dbias)

    def traced(x):
        return fp8train.ops.cast(x, traced_q.dtype, traced_q.scaling_state(), transpose, dbias)

    data, data_t, scale_inv, db = torch.compile(traced, fullgraph=True, backend="inductor")(x)
    assert_same_fp8(data, want.data)
    assert (data_t is None) == (want.data_t is None)
    if data_t is not None:  # row-major, as the GEMMs take it (the CPU emulation would not notice)
        assert data_t.is_contiguous() and data.is_contiguous()
        assert_same_fp8(data_t, want.data_t)
    assert torch.equal(scale_inv, want.scale_inv)
    if dbias:  # inf - inf in a column: NaN both ways
        torch.testing.assert_close(db, want.dbias, rtol=1e-6, atol=0, equal_nan=True)
    for (name, a), b in zip(traced_q.named_buffers(), eager_q.buffers()):
        assert torch.equal(a, b), name


def test_current_scaling_hands_the_operator_per_row_amaxes():
    # The traced cast of a current-scaling quantizer takes one reduction of x with torch ops,
    # over each row (what Inductor can fuse into x's producer), and hands its (M,) result to
    # the operator, whose kernel reduces the rows. Delayed scaling's calibrated casts take none.
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    x = torch.randn(6, 32, dtype=torch.bfloat16)
    for kind in ("current", "delayed"):
        q = _quantizer(kind)
        torch.compile(lambda x: fp8train.ops.cast(x, q.dtype, q.scaling_state(), True, False),
                      fullgraph=True, backend=capture)(x)
    current, delayed = ([n for n in g.graph.nodes if n.op in ("call_function", "call_method")] for g in graphs)
    given = [n.args[-1] for n in current if "cast_kernels" in str(n.target)]
    reductions = [n for n in current if "amax" in str(n.target)]
    assert given == reductions and reductions[0].kwargs == {"dim": 1}
    assert given[0].meta["example_value"].shape == (6,)
    assert [n.args[-1] for n in delayed if "cast_kernels" in str(n.target)] == [None]
    assert not any("amax" in str(n.target) for n in delayed)


def test_graph_row_abs_max_is_reference_abs_max_per_row():
    # Per row: NaN counts as +inf, -0.0 and denormals keep their magnitude; no columns give 0,
    # no rows an empty vector.
    rows = torch.tensor([[1.0, -3.5, 0.0], [float("-inf"), 2.0, -0.0], [float("nan"), 1.0, 2.0],
                         [-1e-40, 0.0, -0.0], [-0.0, 0.0, -0.0]])
    got = fp8train.ops.graph_row_abs_max(rows)
    want = torch.stack([reference.abs_max(r) for r in rows])
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert got.tolist() == [3.5, float("inf"), float("inf"), torch.tensor(1e-40).item(), 0.0]
    bf16 = torch.randn(7, 13).to(torch.bfloat16)
    assert torch.equal(fp8train.ops.graph_row_abs_max(bf16), bf16.float().abs().amax(1))
    no_cols = fp8train.ops.graph_row_abs_max(torch.empty(4, 0, dtype=torch.bfloat16))
    assert no_cols.dtype == torch.float32 and torch.equal(no_cols, torch.zeros(4))
    assert fp8train.ops.graph_row_abs_max(torch.empty(0, 8)).shape == (0,)


def assert_same_fp8(got, want):
    """Bytes equal, except that a NaN may carry either sign (IEEE leaves a NaN's sign to the
    implementation; x86's default NaN, which Inductor's C++ clamp returns, is negative)."""
    nan = torch.isnan(want.float())
    assert torch.equal(torch.isnan(got.float()), nan)
    assert torch.equal(got.view(torch.uint8)[~nan], want.view(torch.uint8)[~nan])


def test_traced_cast_division_is_ieee():
    # The scale math divides in float64 and rounds once to float32 (scaling._div): the IEEE
    # float32 quotient. Checked against numpy's float32 division on hard cases.
    import numpy as np
    amax = torch.tensor([3.0, 7.0, 1e-30, 2.0**-140, 0.1, 1.7e38, 448.0, 5.0e-8], dtype=torch.float32)
    amax = torch.cat([amax, torch.rand(4096) * 10.0 ** torch.randint(-30, 30, (4096,)).float()])
    got = torch.compile(lambda a: fp8train.scaling._div(448.0, a), backend="inductor")(amax)
    with np.errstate(over="ignore"):  # 448 / 2**-140 overflows to inf, as in float32
        want = torch.from_numpy(np.float32(448.0) / amax.numpy())
    assert torch.equal(got, want)


def test_is_first_microbatch_under_compile():
    # True casts the weight and keeps it; False reuses the kept cast (no weight cast: the
    # weight quantizer records no amax); each value is one specialisation of the graph.
    module = make("linear")
    eager = copy.deepcopy(module)
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    for first in (True, False, False):
        x = torch.randn(8, 32, dtype=torch.bfloat16)
        with fp8train.autocast(recipe=DELAYED):
            yc = compiled(x, is_first_microbatch=first)
            ye = eager(x, is_first_microbatch=first)
            if not first:
                assert module.weight_quantizer.amax_history[0] == -1  # nothing cast this step
        assert torch.equal(yc, ye)
    assert torch.equal(module.weight_quantizer.amax_history, eager.weight_quantizer.amax_history)


def test_outside_autocast_compiles_to_plain_linear():
    module = make("linear")
    y = torch.compile(module, fullgraph=True, backend="aot_eager")(torch.ones(4, 32))
    assert torch.equal(y, torch.nn.functional.linear(torch.ones(4, 32), module.weight, module.bias))
    assert module.input_quantizer is None


def test_layers_compiled_between_graph_breaking_hooks_match_eager(device):
    # FSDP2's pre-forward hooks (Dynamo-disabled) break the graph around each layer, so
    # Linear.forward compiles once per layer: the second is a recompile, and Dynamo makes an
    # FSDP2 module's int attributes dynamic (allow_unspec_int_on_nn_module, set here as FSDP2
    # gets it). x's dim checked against `in_features` then became a symbol, which _LinearFn's
    # backward specialised: Dynamo in torch 2.11 (the GPU machine) failed an internal assertion
    # (overwrite_tensor_vt_proxy). Linear checks x against the weight's static dim instead.
    # Both steps of the two-layer model compiled (aot_eager) are bitwise the eager ones, but
    # for the bias gradients on CUDA: eager sums them in the grad cast's Triton kernel
    # (float32 column sums, its own order), traced code in a torch sum.
    def make():
        torch.manual_seed(0)
        layers = torch.nn.ModuleList([fp8train.Linear(64, 128, device=device), fp8train.Linear(128, 64, device=device)])
        for layer in layers:
            layer.register_forward_pre_hook(torch._dynamo.disable(lambda m, args: None))
        return layers
    recipe = fp8train.DelayedScaling()
    eager, compiled = make(), make()
    whole = torch.compile(lambda x: compiled[1](compiled[0](x)), backend="aot_eager")
    g = torch.Generator().manual_seed(1)
    with torch._dynamo.config.patch(allow_unspec_int_on_nn_module=True):
        for step in range(3):
            x = torch.randn(8, 6, 64, generator=g).to(device)
            run = (lambda x: eager[1](eager[0](x)), lambda x: compiled[1](compiled[0](x)) if step == 0 else whole(x))
            outs = []
            for fn, layers in zip(run, (eager, compiled)):
                xi = x.clone().requires_grad_(True)
                with fp8train.autocast(recipe=recipe):
                    y = fn(xi)
                y.square().mean().backward()
                outs.append({"y": y.detach(), "x.grad": xi.grad,
                             **{f"{n}.grad": p.grad for n, p in layers.named_parameters()}})
                layers.zero_grad(set_to_none=True)
            for name, want in outs[0].items():
                got = outs[1][name]
                if device.type == "cuda" and name.endswith("bias.grad"):
                    assert rel_err(got, want) < 1e-6, f"step {step}: {name}"
                else:
                    assert torch.equal(got, want), f"step {step}: {name}, max |diff| {(got - want).abs().max():.3g}"


@pytest.mark.parametrize("recipe", [CURRENT, fp8train.BlockScaling()], ids=["current", "block"])
def test_compiled_call_drops_the_eager_weight_workspace(recipe):
    # An eager step keeps the FP8 weight (and its transposed copy) for the next eager call; a
    # compiled call never reads it, so it drops it rather than hold it for good. Eager again
    # after that casts into a new workspace and computes what it did before.
    block = isinstance(recipe, fp8train.BlockScaling)
    module = make("linear")
    x = torch.randn(8, 32, dtype=torch.bfloat16)
    with fp8train.autocast(recipe=recipe):
        y0 = module(x)
    ws = module._workspace
    assert (ws.block if block else ws.fp8) is not None
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(module, fullgraph=True, backend=counter)
    with fp8train.autocast(recipe=recipe):
        yc = compiled(x)
        compiled(x)
    assert ws.fp8 is None and ws.block is None and counter.frame_count == 1
    with fp8train.autocast(recipe=recipe):
        y1 = module(x)
    assert (ws.block if block else ws.fp8) is not None
    assert torch.equal(yc, y0) and torch.equal(y1, y0)


def test_layers_nested_in_a_compiled_module_without_quantizers_say_what_to_do():
    """A module nests fp8train layers that never ran FP8 and is not the model
    fp8train.convert converted: the trace cannot make their quantizers, and says how."""
    model = torch.nn.Sequential(fp8train.Linear(32, 32), torch.nn.GELU())
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with fp8train.autocast(recipe=CurrentScaling()), pytest.raises(Exception, match="fp8train.convert converted"):
        compiled(torch.randn(4, 32))
    converted = fp8train.convert(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU()))
    torch._dynamo.reset()
    with fp8train.autocast(recipe=CurrentScaling()):  # its first compiled call makes them
        y = torch.compile(converted, backend="aot_eager", fullgraph=True)(torch.randn(4, 32))
    assert y.shape == (4, 32) and converted[0].input_quantizer is not None
