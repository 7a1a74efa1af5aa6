"""The C++ Linear node (fp8train/csrc/linear_node.cpp, kernels/native.py) against the Python
node it replaces: the same bytes for every cast, output, gradient and scaling state.

The Python path is the reference: `native.ENABLED = False` runs it on a twin layer with the
same parameters and inputs. The C++ node takes over from the call after the Python path has
prepared a shape's launches, so each run checks which node made each output."""
from __future__ import annotations

import copy

import pytest
import torch

import fp8train
from fp8train import CurrentScaling, DelayedScaling
from fp8train.kernels import native
from fp8train.quantizer_factory import make_quantizer
from fp8train.roles import TensorRole
from tests.helpers import assert_bitwise

pytest.importorskip("triton")

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("native_extension")]
CUDA = torch.device("cuda")
NATIVE_NODE = "fp8train::LinearBackward"


@pytest.fixture
def python_node():
    """Run the body with the C++ node off; restore it after."""
    class Switch:
        def __enter__(self):
            native.ENABLED = False

        def __exit__(self, *exc):
            native.ENABLED = True
    return Switch()


def node_name(y: torch.Tensor) -> str:
    return y.grad_fn.name() if y.grad_fn is not None else "none"


@pytest.mark.parametrize("recipe", [DelayedScaling(), CurrentScaling(), CurrentScaling(power_of_two_scales=True)],
                         ids=["delayed", "current", "current-pow2"])  # pow2: the plan launches the POW2 binaries
@pytest.mark.parametrize("shape, dtype, transpose, dbias", [
    ((256, 1024), torch.bfloat16, True, None),
    ((333, 48), torch.bfloat16, True, torch.bfloat16),   # odd rows: padded transposed copy, partial last tile
    ((77, 4096), torch.float16, False, None),            # the flat kernel
    ((1000, 272), torch.bfloat16, False, torch.float32),  # tile kernel for dbias alone; float32 bias
    ((96, 160), torch.bfloat16, True, torch.float16),    # a bias dtype other than the input's
    ((64, 160), torch.float32, False, None),
], ids=str)
def test_cast_plan_matches_the_python_launch(recipe, shape, dtype, transpose, dbias):
    """A plan's cast against the prepared Python launch it was made from: data, transposed
    copy, scale_inv, dbias and the amax it records, byte for byte. The plan writes dbias in
    the bias dtype; the Python path's float32 sums, cast as autograd casts them, must give
    the same bytes."""
    role = TensorRole.GRAD_OUTPUT if dbias else TensorRole.INPUT
    q = make_quantizer(recipe, role, device=CUDA)
    x = (torch.randn(shape, device=CUDA) * 3).to(dtype)
    x[0, 0] = 40.0  # the amax
    for _ in range(2):  # calibration (delayed), then the prepared steady-state launch
        q.cast(x, transpose=transpose, dbias=dbias is not None)
    plan = q.native_plan(tuple(shape), dtype, transpose, dbias)
    assert plan is not None
    state = [b.clone() for b in q.buffers()]
    want = q.cast(x, transpose=transpose, dbias=dbias is not None)
    if dbias is not None:
        want = want._replace(dbias=want.dbias.to(dbias))
    state_after = [b.clone() for b in q.buffers()]
    for together in (False, True):  # a forward input's outputs, then a grad output's one buffer
        with torch.no_grad():
            for b, s in zip(q.buffers(), state):
                b.copy_(s)
        got = native.extension().cast_with(plan, x, together)
        for name, g, w in zip(("data", "data_t", "scale_inv", "dbias"), got, want):
            assert (g is None) == (w is None), name
            if w is not None:
                assert_bitwise(g, w, name)
                assert g.is_contiguous() and g.data_ptr() % 256 == 0, name  # the cuBLASLt path's alignment
        for b, s in zip(q.buffers(), state_after):
            assert_bitwise(b, s, "quantizer state")
        shares = got[0].untyped_storage().data_ptr() == got[2].untyped_storage().data_ptr()
        assert shares == (together or not transpose)  # scale_inv lives with what is saved


@pytest.mark.parametrize("bias_dtype", [torch.bfloat16, torch.float16])
def test_cast_plan_dbias_rounds_as_torch_does(bias_dtype):
    """The plan's dbias in a 16-bit bias dtype against torch's conversion of the float32 sums,
    bit for bit, with columns that sum to NaN, +-inf, values past fp16's range, and
    halfway cases (torch's NaN is the GPU's canonical one; so must ours be)."""
    q = make_quantizer(DelayedScaling(), TensorRole.GRAD_OUTPUT, device=CUDA)
    x = torch.randn(300, 128, device=CUDA)
    x[7, 3] = float("nan")
    x[9, 4], x[10, 5] = float("inf"), -float("inf")
    x[:, 6] = 300.0  # 90000: past fp16's largest finite value
    x[:, 7:9] = 0.0
    x[0, 7], x[1, 7], x[2, 7] = 1.0, 2.0 ** -8, 2.0 ** -20  # just past bf16's halfway point: rounds up
    x[0, 8], x[1, 8] = 1.0, 2.0 ** -8                       # halfway: rounds to even (1.0)
    x = x.to(torch.bfloat16)
    for _ in range(2):
        q.cast(x, transpose=True, dbias=True)
    plan = q.native_plan((300, 128), torch.bfloat16, True, bias_dtype)
    want = q.cast(x, transpose=True, dbias=True).dbias  # float32 sums (scales move: dbias does not)
    got = native.extension().cast_with(plan, x)[3]
    assert got.dtype == bias_dtype
    assert want[3].isnan() and want[4].isinf() and want[5].isinf()
    assert_bitwise(got, want.to(bias_dtype), "dbias")


def test_plans_wait_for_the_python_preparation_and_are_dropped_with_it():
    q = make_quantizer(DelayedScaling(), TensorRole.INPUT, device=CUDA)
    x = torch.randn(64, 256, device=CUDA, dtype=torch.bfloat16)
    assert q.native_plan((64, 256), torch.bfloat16, True, None) is None  # nothing prepared
    q.cast(x, transpose=True)  # calibrates: no steady-state launch yet
    assert q.native_plan((64, 256), torch.bfloat16, True, None) is None
    q.cast(x, transpose=True)
    assert q.native_plan((64, 256), torch.bfloat16, True, None) is not None
    q.to(CUDA, torch.float32)  # buffers may move: preparations and plans go
    assert q.native_plan((64, 256), torch.bfloat16, True, None) is None


@pytest.mark.parametrize("recipe", [DelayedScaling(), CurrentScaling()], ids=["delayed", "current"])
@pytest.mark.parametrize("shape, dtype, transpose", [
    ((512, 1024), torch.bfloat16, True),
    ((333, 64), torch.bfloat16, True),  # odd rows: the transposed buffer is padded to 336 columns
    ((256, 96), torch.float16, False),
], ids=str)
def test_weight_recast_plan_matches_requantize(recipe, shape, dtype, transpose):
    """A weight quantizer's re-cast plan (native_recast), run by the C++ side into the
    workspace as the nodes run it, against the Python requantize of the same weight into the
    same workspace: payload, transposed copy, scale_inv and the quantizer's state after, byte
    for byte (current scaling: the memset, the amax pass and the cast). A weight or a
    workspace the plan was not made for is refused."""
    q = make_quantizer(recipe, TensorRole.WEIGHT, device=CUDA)
    w = (torch.randn(shape, device=CUDA) * 3).to(dtype)
    ws = q.quantize(w, transpose=transpose)  # delayed: calibrates; current: prepares
    q.requantize(w, ws, transpose=transpose)  # delayed: prepares the steady-state launch
    w = (torch.randn(shape, device=CUDA) * 5).to(dtype)
    w[1, 2] = -70.0  # the amax
    state = [b.clone() for b in q.buffers()]
    q.requantize(w, ws, transpose=transpose)
    want = [ws._data.clone(), ws._scale_inv.clone()] + ([ws.transpose_data(padded=True).clone()] if transpose else [])
    want_state = [b.clone() for b in q.buffers()]
    with torch.no_grad():
        for b, v in zip(q.buffers(), state):
            b.copy_(v)
        for t in [ws._data, ws._scale_inv] + ([ws._transpose] if transpose else []):
            if t.dtype == torch.float32:  # scale_inv (a 0-d tensor: no byte view)
                t.fill_(float("nan"))
            else:
                t.view(torch.uint8).fill_(0x55)  # garbage the plan must overwrite
    plan = q.native_recast(w, ws, transpose)
    assert plan is not None
    assert ws.transpose_is_cached() == transpose  # the bookkeeping: the buffer is the valid copy again
    data_t = ws._transpose if transpose else None
    native.extension().recast_with(plan, w, ws._data, data_t, ws._scale_inv)
    got = [ws._data, ws._scale_inv] + ([ws.transpose_data(padded=True)] if transpose else [])
    for name, g, v in zip(("payload", "scale_inv", "transposed copy"), got, want):
        assert_bitwise(g, v, name)
    for g, v in zip(q.buffers(), want_state):
        assert_bitwise(g, v, "quantizer state")
    # the check recast runs before any launch (a refusal raises there), called on its own
    refusal = native.extension().recast_refusal
    assert refusal(plan, w, ws._data, data_t, ws._scale_inv) is None
    assert "weight is not of the plan's shape" in refusal(plan, w[1:].contiguous(), ws._data, data_t, ws._scale_inv)
    assert "weight is not contiguous" in refusal(plan, w.t().contiguous().t(), ws._data, data_t, ws._scale_inv)
    assert "payload" in refusal(plan, w, ws._data.view(-1)[: ws._data.numel() - shape[1]].view(-1, shape[1]), data_t,
                                ws._scale_inv)
    assert "scale_inv" in refusal(plan, w, ws._data, data_t, ws._data.view(-1)[:1])
    assert "transposed buffer" in refusal(plan, w, ws._data, None if transpose else ws._data, ws._scale_inv)
    if transpose:  # a transposed copy whose row pitch is not the plan's
        assert "row pitch" in refusal(plan, w, ws._data, data_t[:, :16].contiguous(), ws._scale_inv)


@pytest.mark.parametrize("recipe", [DelayedScaling(), CurrentScaling()], ids=["delayed", "current"])
def test_linear_node_recasts_its_weight_itself(recipe, monkeypatch):
    """Once the C++ node runs, the weight's steady-state re-cast is its own launches (no Python
    requantize), with either recipe; it follows in-place weight updates between steps, and
    is_first_microbatch=False re-casts nothing: the Python node's bytes, step after step."""
    quantizer_type = type(make_quantizer(recipe, TensorRole.WEIGHT, device=CUDA))
    python_casts = [0]
    requantize = quantizer_type.requantize

    def counted(self, *args, **kwargs):
        if self.role == TensorRole.WEIGHT:
            python_casts[0] += 1
        return requantize(self, *args, **kwargs)
    monkeypatch.setattr(quantizer_type, "requantize", counted)
    torch.manual_seed(11)
    layer = fp8train.Linear(256, 512, params_dtype=torch.bfloat16, device=CUDA)
    twin = copy.deepcopy(layer)
    flags = [None, None, None, None, True, False, None]
    xs = [torch.randn(3, 7, 256, device=CUDA, dtype=torch.bfloat16) for _ in flags]
    dys = [torch.randn(3, 7, 512, device=CUDA, dtype=torch.bfloat16) for _ in flags]
    updates = [0.01 * torch.randn_like(layer.weight) for _ in flags]

    def steps(m, enabled):
        native.ENABLED = enabled
        out, casts = [], []
        try:
            for i, flag in enumerate(flags):
                x = xs[i].clone().requires_grad_(True)
                before = python_casts[0]
                with fp8train.autocast(recipe=recipe):
                    y = m(x, is_first_microbatch=flag)
                casts.append(python_casts[0] - before)
                y.backward(dys[i])
                out.append((node_name(y), y.detach(), x.grad, m.weight.grad.clone(), m.bias.grad.clone()))
                m.zero_grad(set_to_none=True)
                if i + 1 < len(flags) and flags[i + 1] is not False:
                    with torch.no_grad():
                        m.weight.add_(updates[i])
            return out, casts
        finally:
            native.ENABLED = True
    got, got_casts = steps(layer, True)
    want, want_casts = steps(twin, False)
    native_from = 2 if isinstance(recipe, DelayedScaling) else 1  # delayed: calibration, then preparation
    assert [g[0] for g in got][native_from:] == [NATIVE_NODE] * (len(flags) - native_from)
    assert got_casts[native_from:] == [0] * (len(flags) - native_from), got_casts
    # the Python node: the first step makes the workspace (quantize), then one re-cast a step but False's
    assert want_casts == [0, 1, 1, 1, 1, 0, 1], want_casts
    for step, (g, w) in enumerate(zip(got, want)):
        for name, a, b in zip(("output", "dx", "dw", "db"), g[1:], w[1:]):
            assert_bitwise(a, b, f"step {step} {name}")
    for name, a, b in (("payload", layer.weight_fp8.fp8_data, twin.weight_fp8.fp8_data),
                       ("scale_inv", layer.weight_fp8.scale_inv, twin.weight_fp8.scale_inv)):
        assert_bitwise(a, b, f"weight workspace {name}")


CASES = [
    # in, out, bias, params dtype, input shape, input dtype, recipe
    (1024, 1024, True, torch.bfloat16, (256, 1024), torch.bfloat16, DelayedScaling()),
    (1024, 1024, False, torch.float32, (4, 65, 1024), torch.bfloat16, DelayedScaling()),
    (64, 48, True, torch.float32, (333, 64), torch.bfloat16, CurrentScaling()),
    (256, 512, True, torch.bfloat16, (3, 7, 256), torch.float16, CurrentScaling()),
    # float32 input with a transposed copy (HF models' q/k/v and gate/up under torch.autocast
    # with float32 parameters: their RMSNorm returns float32), both recipes
    (128, 64, True, torch.float32, (100, 128), torch.float32, DelayedScaling()),
    (1024, 256, False, torch.float32, (2, 50, 1024), torch.float32, CurrentScaling()),
]


def _steps(layer, xs, dys, recipe, first_microbatch=None):
    outs = []
    for i, (x, dy) in enumerate(zip(xs, dys)):
        x = x.detach().clone().requires_grad_(x.requires_grad)
        with fp8train.autocast(recipe=recipe):
            mb = None if first_microbatch is None else (i == 0 if first_microbatch else False)
            y = layer(x, is_first_microbatch=mb)
        name = node_name(y)
        y.backward(dy)
        outs.append((name, y.detach(), None if x.grad is None else x.grad.clone(),
                     {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}))
        layer.zero_grad(set_to_none=True)
    return outs


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}-bias{int(c[2])}-{str(c[3])[6:]}-"
                         f"{'x'.join(map(str, c[4]))}-{str(c[5])[6:]}-{type(c[6]).__name__}")
def test_linear_node_matches_the_python_node(case, python_node):
    """Six fwd+bwd steps of one layer with the C++ node and of its twin with the Python node
    (and Triton's own launcher for every cast): outputs, every gradient and the scaling state
    identical; the C++ node ran from the first step after the launches were prepared."""
    k, n, bias, pdtype, shape, xdtype, recipe = case
    layer = fp8train.Linear(k, n, bias=bias, params_dtype=pdtype, device=CUDA)
    twin = copy.deepcopy(layer)
    xs = [(torch.randn(shape, device=CUDA) * (1 + i)).to(xdtype).requires_grad_() for i in range(6)]
    dys = [torch.randn(*shape[:-1], n, device=CUDA).to(xdtype) for _ in range(6)]
    got = _steps(layer, xs, dys, recipe)
    got_state = {name: t.clone() for name, t in layer.state_dict().items()}  # before the twin's steps roll it
    ws = layer.weight_fp8  # re-cast in place by the C++ node's forward from step 3 (delayed scaling)
    got_ws = (ws.fp8_data.clone(), ws.scale_inv.clone(), ws.transpose_data().clone())
    with python_node:
        want = _steps(twin, xs, dys, recipe)
    # delayed scaling: step 1 calibrates, step 2 prepares; current scaling: step 1 prepares
    python_steps = 2 if isinstance(recipe, DelayedScaling) else 1
    native_steps = [g[0] == NATIVE_NODE for g in got]
    assert native_steps == [False] * python_steps + [True] * (6 - python_steps), native_steps
    assert NATIVE_NODE not in [w[0] for w in want]
    for step, (g, w) in enumerate(zip(got, want)):
        assert_bitwise(g[1], w[1], f"step {step} output")
        assert_bitwise(g[2], w[2], f"step {step} dx")
        assert g[3].keys() == w[3].keys()
        for name in w[3]:
            assert g[3][name].dtype == w[3][name].dtype
            assert_bitwise(g[3][name], w[3][name], f"step {step} d{name}")
    ws = twin.weight_fp8
    for what, g, w in zip(("payload", "scale_inv", "transposed copy"), got_ws,
                          (ws.fp8_data, ws.scale_inv, ws.transpose_data())):
        assert_bitwise(g, w, f"weight workspace {what}")
    want_state = twin.state_dict()
    assert got_state.keys() == want_state.keys()
    for name, t in want_state.items():
        assert_bitwise(got_state[name], t, name)


@pytest.mark.parametrize("what", ["frozen_input", "frozen_weight", "no_grad", "cached_weight", "torch_autocast"])
def test_linear_node_variants_match(what, python_node):
    """The C++ node's other cases: no dgrad, no wgrad (and no transposed copy of X), no
    graph at all, a cached FP8 weight over microbatches, torch.autocast's dtype."""
    layer = fp8train.Linear(512, 256, params_dtype=torch.float32, device=CUDA)
    if what in ("frozen_weight", "torch_autocast"):  # torch_autocast: a float32 input without transposed copy
        layer.weight.requires_grad_(False)
    twin = copy.deepcopy(layer)
    xdtype = torch.float32 if what == "torch_autocast" else torch.bfloat16
    xs = [torch.randn(96, 512, device=CUDA, dtype=xdtype).requires_grad_(what != "frozen_input") for _ in range(5)]
    dys = [torch.randn(96, 256, device=CUDA, dtype=torch.bfloat16) for _ in range(5)]
    recipe = DelayedScaling()

    def run(m):
        if what == "no_grad":
            outs = []
            for x in xs:
                with torch.no_grad(), fp8train.autocast(recipe=recipe):
                    outs.append(("none", m(x), None, {}))
            return outs
        if what == "torch_autocast":
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return _steps(m, xs, dys, recipe)
        return _steps(m, xs, dys, recipe, first_microbatch=True if what == "cached_weight" else None)

    got = run(layer)
    with python_node:
        want = run(twin)
    if what != "no_grad":
        assert [g[0] for g in got][2:] == [NATIVE_NODE] * 3, [g[0] for g in got]
    for step, (g, w) in enumerate(zip(got, want)):
        assert_bitwise(g[1], w[1], f"step {step} output")
        assert (g[2] is None) == (w[2] is None)
        if w[2] is not None:
            assert_bitwise(g[2], w[2], f"step {step} dx")
        assert g[3].keys() == w[3].keys()
        for name in w[3]:
            assert_bitwise(g[3][name], w[3][name], f"step {step} d{name}")


def test_linear_node_backward_twice(python_node):
    """retain_graph=True keeps the saved FP8 tensors for a second backward (same gradients);
    without it, a second backward is a clear error."""
    layer = fp8train.Linear(256, 128, device=CUDA, params_dtype=torch.bfloat16)
    x = torch.randn(64, 256, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(64, 128, device=CUDA, dtype=torch.bfloat16)
    for _ in range(3):
        with fp8train.autocast():
            y = layer(x)
        y.backward(dy)
    assert node_name(y) == NATIVE_NODE
    x.grad, layer.weight.grad, layer.bias.grad = None, None, None
    with fp8train.autocast():
        y = layer(x)
    y.backward(dy, retain_graph=True)
    first = x.grad.clone(), layer.weight.grad.clone()
    x.grad = None
    layer.weight.grad = None
    y.backward(dy)
    assert_bitwise(x.grad, first[0], "dx")
    assert_bitwise(layer.weight.grad, first[1], "dw")
    with fp8train.autocast():
        y = layer(x)
    y.backward(dy)
    with pytest.raises(RuntimeError, match="second time"):
        y.backward(dy)


def test_linear_node_in_a_cuda_graph(python_node):
    """The C++ node's launches are captured like Triton's: replays of a captured fwd+bwd
    (with the delayed-scaling update) give what eager steps of the Python node give."""
    layer = fp8train.Linear(256, 256, device=CUDA, params_dtype=torch.float32)
    twin = copy.deepcopy(layer)
    recipe = DelayedScaling()
    xs = [torch.randn(128, 256, device=CUDA, dtype=torch.bfloat16) for _ in range(7)]
    dy = torch.randn(128, 256, device=CUDA, dtype=torch.bfloat16)
    static_x = xs[0].clone().requires_grad_()
    got = []

    def step():
        with fp8train.autocast(recipe=recipe):
            y = layer(static_x)
        y.backward(dy)
        return y

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # eager warm-up: calibrate, prepare, then the C++ node
        for x in xs[:3]:
            static_x.data.copy_(x)
            y = step()
            got.append((y.detach().clone(), static_x.grad.clone(), layer.weight.grad.clone()))
            static_x.grad, layer.weight.grad, layer.bias.grad = None, None, None
    torch.cuda.current_stream().wait_stream(side)
    assert node_name(y) == NATIVE_NODE
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = step()
    for x in xs[3:]:
        static_x.data.copy_(x)
        graph.replay()
        got.append((static_y.detach().clone(), static_x.grad.clone(), layer.weight.grad.clone()))
    with python_node:
        want = []
        for x in xs:
            xg = x.clone().requires_grad_()
            with fp8train.autocast(recipe=recipe):
                y = twin(xg)
            y.backward(dy)
            want.append((y.detach(), xg.grad.clone(), twin.weight.grad.clone()))
            twin.zero_grad(set_to_none=True)
    for step_i, (g, w) in enumerate(zip(got, want)):
        for what, a, b in zip(("y", "dx", "dw"), g, w):
            assert_bitwise(a, b, f"step {step_i} {what}")


def test_cpp_node_output_can_be_modified_in_place():
    # The node returns a 3-D output that is not a view (at::_unsafe_view), as F.linear does:
    # `y += residual` is legal and its gradient is the out-of-place one's.
    torch.manual_seed(0)
    layer = fp8train.Linear(256, 256, params_dtype=torch.bfloat16, device=CUDA)
    x = torch.randn(4, 33, 256, device=CUDA, dtype=torch.bfloat16)
    r = torch.randn(4, 33, 256, device=CUDA, dtype=torch.bfloat16)
    grads = []
    for step in range(4):  # steps 0-1 prepare the launches (delayed scaling); 2 and 3 run the node
        inplace = step == 3
        xi = x.clone().requires_grad_()
        with fp8train.autocast(recipe=DelayedScaling()):
            y = layer(xi)
        if step >= 2:
            assert node_name(y) == NATIVE_NODE and not y._is_view()
        if inplace:
            y += r
        else:
            y = y + r
        y.float().square().sum().backward()
        grads.append(xi.grad)
    assert torch.equal(grads[2], grads[3])
