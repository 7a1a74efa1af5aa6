"""BlockScaling in the C++ Linear node (csrc/linear_node.cpp's block plans and GEMMs;
block_quantizer.BlockScalingQuantizer.native_plan) against the Python node it replaces: the
same bytes for every cast, output and gradient (both GEMM paths call the extension's cuBLASLt
block GEMM; the Python path is the reference, `native.ENABLED = False`)."""
from __future__ import annotations

import copy

import pytest
import torch

import fp8train
from fp8train import BlockScaling, gemm
from fp8train.kernels import native
from fp8train.modules import base
from fp8train.quantizer_factory import make_quantizer
from fp8train.roles import TensorRole
from tests.helpers import assert_bitwise, sgd_steps
from tests.test_shared_inputs import GROUPS, Block

pytest.importorskip("triton")

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("native_extension")]
CUDA = torch.device("cuda")
NATIVE_NODE = "fp8train::LinearBackward"


@pytest.mark.parametrize("role", [TensorRole.INPUT, TensorRole.GRAD_OUTPUT], ids=lambda r: r.name)
@pytest.mark.parametrize("shape, dtype, transpose, dbias", [
    ((256, 1024), torch.bfloat16, True, None),
    ((333, 256), torch.float32, True, torch.bfloat16),   # rows past a block: the zero padding of (K, Mp)
    ((64, 300), torch.bfloat16, False, None),            # a column tail block
    ((1000, 2048), torch.float32, False, torch.float32),
], ids=str)
def test_block_cast_plan_matches_the_python_cast(role, shape, dtype, transpose, dbias, monkeypatch):
    q = make_quantizer(BlockScaling(), role, device=CUDA)
    x = torch.randn(shape, device=CUDA) * torch.logspace(-3, 3, shape[1], device=CUDA)
    x[0, 0] = float("nan")
    x = x.to(dtype)
    plan = q.native_plan(shape, dtype, transpose, dbias)
    assert plan is not None
    with monkeypatch.context() as m:
        m.setattr(native, "ENABLED", False)  # the Python (Triton) launch: the reference
        want = q.cast(x, transpose=transpose, dbias=dbias is not None)
    for together in (False, True):  # a forward input's outputs, then a grad output's one buffer
        data, data_t, scale_inv, db, scale_inv_t = native.extension().cast_with(plan, x, together)
        assert_bitwise(data, want.data, "data")
        assert_bitwise(scale_inv, want.scale_inv, "scale_inv")
        assert scale_inv.stride() == (1, shape[0])  # the block GEMM's a_scale layout, no copy
        assert (data_t is None) == (want.data_t is None) == (scale_inv_t is None)
        if transpose:
            assert_bitwise(data_t, want.data_t, "data_t")
            assert_bitwise(scale_inv_t, want.scale_inv_t.t(), "scale_inv_t")
        assert (db is None) == (dbias is None)
        if dbias is not None:
            assert_bitwise(db, want.dbias.to(dbias), "dbias")
        assert data.data_ptr() % 256 == 0 and (data_t is None or data_t.data_ptr() % 256 == 0)


@pytest.mark.parametrize("shape, dtype, transpose, dbias", [
    ((4, 97, 256), torch.float32, True, False),     # 3-D, rows past a block
    ((256, 300), torch.bfloat16, False, True),      # a column tail block, dbias
], ids=str)
def test_eager_block_cast_takes_the_cpp_launcher(shape, dtype, transpose, dbias, monkeypatch):
    """BlockScalingQuantizer.cast of 1 x 128 blocks on CUDA runs its plan through the C++
    launcher (ext.cast_with), the same bytes and layouts as the Triton launch; Python launches
    where the node is off and for an input that is not 16-byte aligned."""
    q = make_quantizer(BlockScaling(), TensorRole.INPUT, device=CUDA)
    x = (torch.randn(shape, device=CUDA) * 30).to(dtype)
    calls = []
    ext = native.extension()

    class Spy:  # the extension, counting its standalone casts
        def __getattr__(self, name):
            return getattr(ext, name)

        def cast_with(self, plan, rows, together):
            calls.append(rows.shape)
            return ext.cast_with(plan, rows, together)
    spy = Spy()
    monkeypatch.setattr(native, "extension", lambda: spy)
    got = q.cast(x, transpose=transpose, dbias=dbias)
    assert calls == [torch.Size((x.numel() // shape[-1], shape[-1]))]
    monkeypatch.setattr(native, "ENABLED", False)
    want = q.cast(x, transpose=transpose, dbias=dbias)
    assert len(calls) == 1
    for field in ("data", "data_t", "scale_inv", "dbias", "scale_inv_t"):
        g, w = getattr(got, field), getattr(want, field)
        assert (g is None) == (w is None), field
        if g is not None:
            assert g.shape == w.shape and g.stride() == w.stride(), field
            assert_bitwise(g, w, field)
    monkeypatch.setattr(native, "ENABLED", True)
    flat = torch.empty(x.numel() + 1, device=CUDA, dtype=dtype)
    misaligned = flat[1:].view(shape)  # contiguous, not 16-byte aligned: Python launches
    misaligned.copy_(x)
    other = q.cast(misaligned, transpose=transpose, dbias=dbias)
    assert len(calls) == 1
    assert_bitwise(other.data, want.data, "misaligned input's data")


def test_weight_quantizer_has_no_plan():
    q = make_quantizer(BlockScaling(), TensorRole.WEIGHT, device=CUDA)
    assert q.native_plan((256, 256), torch.float32, True, None) is None  # tiles: only re-cast (native_recast)


@pytest.mark.parametrize("shape, dtype", [((384, 1024), torch.float32), ((300, 2816), torch.bfloat16),
                                          ((1000, 272), torch.float32)], ids=str)
@pytest.mark.parametrize("transpose", [False, True], ids=["no-t", "t"])
def test_weight_tile_plan_recasts_as_the_python_cast(shape, dtype, transpose):
    """The tile plan re-casts a changed weight into the kept cast's buffers: the bytes, scales
    and padding of a fresh Python cast of it. 300 x 2816: Mb 3, Kb 22, both grids padded;
    1000 x 272: Mp 1008, Kb 3."""
    q = make_quantizer(BlockScaling(), TensorRole.WEIGHT, device=CUDA)
    w = torch.randn(shape, device=CUDA).to(dtype)
    kept = q.cast(w, transpose=transpose)
    w2 = (torch.randn(shape, device=CUDA) * torch.logspace(-3, 3, shape[1], device=CUDA)).to(dtype)
    plan = q.native_recast(w2, kept, transpose)
    assert plan is not None
    ptrs = [t.data_ptr() for t in kept if isinstance(t, torch.Tensor)]
    si_t = gemm.tile_scales(kept.scale_inv_t) if transpose else None
    native.extension().recast_with(plan, w2, kept.data, kept.data_t, gemm.tile_scales(kept.scale_inv), si_t)
    want = q.cast(w2, transpose=transpose)
    assert [t.data_ptr() for t in kept if isinstance(t, torch.Tensor)] == ptrs
    assert_bitwise(kept.data, want.data, "data")
    assert_bitwise(gemm.tile_scales(kept.scale_inv), gemm.tile_scales(want.scale_inv), "scale_inv with padding")
    if transpose:
        assert_bitwise(kept.data_t, want.data_t, "data_t")
        assert_bitwise(gemm.tile_scales(kept.scale_inv_t), gemm.tile_scales(want.scale_inv_t), "scale_inv_t")
    # scales not laid out for the GEMM (the operand's shape, row-major): refused, with the reason
    row_major = gemm.tile_scales(kept.scale_inv).contiguous()
    why = native.extension().recast_refusal(plan, w2, kept.data, kept.data_t, row_major, si_t)
    assert why is not None and "tile scales" in why


def test_weight_tile_plan_needs_the_padded_scales():
    q = make_quantizer(BlockScaling(), TensorRole.WEIGHT, device=CUDA)
    w = torch.randn(256, 384, device=CUDA)  # Mb 2, Kb 3: both scale grids padded to 4 columns
    cast = q.cast(w, transpose=True)
    assert q.native_recast(w, cast, True) is not None
    unpadded = cast._replace(scale_inv=cast.scale_inv.contiguous(), scale_inv_t=cast.scale_inv_t.contiguous())
    assert q.native_recast(w, unpadded, True) is None
    kept = q.cast(w, transpose=False)
    assert q.native_recast(w, kept, True) is None  # no transposed buffer to write
    assert q.native_recast(w, kept, False) is not None


CASES = [
    # in, out, bias, params dtype, input shape, input dtype
    (1024, 1024, True, torch.bfloat16, (256, 1024), torch.bfloat16),
    (1024, 512, False, torch.float32, (4, 64, 1024), torch.float32),  # torch.autocast's float32 input
    (256, 384, True, torch.float32, (3, 100, 256), torch.bfloat16),   # 300 rows: a partial row block
    (2816, 1024, True, torch.float32, (512, 2816), torch.bfloat16),   # Kb = 22: padded tile scales
]


def _steps(layer, xs, dys, frozen_weight=False):
    outs = []
    for x, dy in zip(xs, dys):
        x = x.detach().clone().requires_grad_(x.requires_grad)
        with fp8train.autocast(recipe=BlockScaling()):
            y = layer(x)
        name = y.grad_fn.name() if y.grad_fn is not None else "none"
        y.backward(dy)
        outs.append((name, y.detach(), None if x.grad is None else x.grad.clone(),
                     {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}))
        layer.zero_grad(set_to_none=True)
    return outs


def _compare(got, want):
    for step, (g, w) in enumerate(zip(got, want)):
        assert_bitwise(g[1], w[1], f"step {step} output")
        assert (g[2] is None) == (w[2] is None)
        if w[2] is not None:
            assert_bitwise(g[2], w[2], f"step {step} dx")
        assert g[3].keys() == w[3].keys()
        for name in w[3]:
            assert g[3][name].dtype == w[3][name].dtype
            assert_bitwise(g[3][name], w[3][name], f"step {step} d{name}")


def _python_node(fn):
    native.ENABLED = False
    try:
        return fn()
    finally:
        native.ENABLED = True


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}-bias{int(c[2])}-{str(c[3])[6:]}-"
                         f"{'x'.join(map(str, c[4]))}-{str(c[5])[6:]}")
def test_block_linear_node_matches_the_python_node(case):
    """Four fwd+bwd steps in the C++ node (from the first: a block plan needs no preparation)
    and in the Python node on a twin: outputs and every gradient bit for bit (the node re-casts
    the weight from the second step on)."""
    k, n, bias, pdtype, shape, xdtype = case
    torch.manual_seed(3)
    layer = fp8train.Linear(k, n, bias=bias, params_dtype=pdtype, device=CUDA)
    twin = copy.deepcopy(layer)
    xs = [(torch.randn(shape, device=CUDA) * (1 + i)).to(xdtype).requires_grad_() for i in range(4)]
    dys = [torch.randn(*shape[:-1], n, device=CUDA).to(torch.bfloat16) for _ in range(4)]
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=xdtype == torch.float32):
        got = _steps(layer, xs, dys)
        want = _python_node(lambda: _steps(twin, xs, dys))
    assert [g[0] for g in got] == [NATIVE_NODE] * 4
    assert fp8train.inspect.execution_paths(torch.nn.Sequential(layer)) == {"0": "C++ node"}
    assert NATIVE_NODE not in [w[0] for w in want]
    _compare(got, want)


@pytest.mark.parametrize("params_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_block_linear_node_recasts_an_updated_weight_in_place(params_dtype):
    """The node re-casts the weight into the kept cast's buffers every step (the same
    addresses), after SGD moved it: bit for bit the Python node's fresh casts; an eval call
    without grad (no transposed copy written) drops the kept transposed copy, and the next
    training step casts it anew."""
    torch.manual_seed(5)
    layer = fp8train.Linear(640, 384, params_dtype=params_dtype, device=CUDA)
    twin = copy.deepcopy(layer)
    xs = [torch.randn(4, 64, 640, device=CUDA, dtype=torch.bfloat16) for _ in range(5)]

    def steps(m, eval_at=None):
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        out, kept = [], []
        for i, x in enumerate(xs):
            if i == eval_at:
                with torch.no_grad(), fp8train.autocast(recipe=BlockScaling()):
                    out.append((m(x),))
                continue
            x = x.clone().requires_grad_(True)
            with fp8train.autocast(recipe=BlockScaling()):
                y = m(x)
            y.float().pow(2).mean().backward()
            out.append((y.detach(), x.grad, m.weight.grad.clone()))
            opt.step()
            opt.zero_grad(set_to_none=True)
            kept.append(m._workspace.block.data.data_ptr())
        return out, kept
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=params_dtype == torch.float32):
        got, kept = steps(layer, eval_at=3)
        want, _ = _python_node(lambda: steps(twin, eval_at=3))
    assert kept[1] == kept[2] and kept[0] == kept[1]  # cast once by Python, then re-cast in place
    for i, (g, w) in enumerate(zip(got, want)):
        for j, (a, b) in enumerate(zip(g, w)):
            assert_bitwise(a, b, f"step {i} output {j}")


@pytest.mark.parametrize("what", ["frozen_input", "frozen_weight", "no_grad"])
def test_block_linear_node_variants_match(what):
    """No dgrad (no transposed weight), no wgrad (no transposed copy of X: the 1 x 128 cast
    alone), no graph at all."""
    layer = fp8train.Linear(512, 256, params_dtype=torch.float32, device=CUDA)
    if what == "frozen_weight":
        layer.weight.requires_grad_(False)
    twin = copy.deepcopy(layer)
    xs = [torch.randn(96, 512, device=CUDA, dtype=torch.bfloat16).requires_grad_(what != "frozen_input")
          for _ in range(3)]
    dys = [torch.randn(96, 256, device=CUDA, dtype=torch.bfloat16) for _ in range(3)]

    def run(m):
        if what == "no_grad":
            with torch.no_grad(), fp8train.autocast(recipe=BlockScaling()):
                return [("none", m(x), None, {}) for x in xs]
        return _steps(m, xs, dys)
    got = run(layer)
    want = _python_node(lambda: run(twin))
    if what != "no_grad":
        assert [g[0] for g in got] == [NATIVE_NODE] * 3
    assert fp8train.inspect.execution_paths(torch.nn.Sequential(layer)) == {"0": "C++ node"}
    _compare(got, want)


def test_rows_not_a_multiple_of_4_take_the_python_node():
    layer = fp8train.Linear(256, 256, device=CUDA)
    with fp8train.autocast(recipe=BlockScaling()):
        y = layer(torch.randn(70, 256, device=CUDA, requires_grad=True))
    assert y.grad_fn.name() != NATIVE_NODE
    assert "multiple of 4" in fp8train.inspect.execution_paths(torch.nn.Sequential(layer))["0"]


@pytest.mark.parametrize("params_dtype", [torch.float32, torch.bfloat16], ids=["fp32-autocast-bf16", "bf16"])
def test_shared_inputs_pass_their_block_cast_into_the_node(params_dtype, monkeypatch):
    """q/k/v and gate/up read one tensor each: the group's one Python block cast goes into
    the C++ node (pre-cast, with its transposed copy's scales); bit for bit untied layers."""
    monkeypatch.setattr(base, "SHARE_INPUT_CASTS", True)
    torch.manual_seed(0)
    tied = Block(d=256, f=512, dtype=params_dtype).to(CUDA)
    torch.manual_seed(0)
    untied = Block(d=256, f=512, dtype=params_dtype).to(CUDA)
    xs = [torch.randn(4, 128, 256, device=CUDA).to(params_dtype) for _ in range(3)]

    def steps(model):
        return sgd_steps(model, BlockScaling(), xs, params_dtype)
    with monkeypatch.context() as m:
        m.setattr(base, "SHARE_INPUT_CASTS", False)
        want = steps(untied)
    got = steps(tied)
    assert fp8train.inspect.shared_input_casts(tied) == GROUPS
    assert set(fp8train.inspect.execution_paths(tied).values()) == {"C++ node"}
    for i, ((y, dx, grads), (y_ref, dx_ref, grads_ref)) in enumerate(zip(got, want)):
        assert_bitwise(y, y_ref, f"step {i}: y")
        assert_bitwise(dx, dx_ref, f"step {i}: x.grad")
        for name in grads_ref:
            assert_bitwise(grads[name], grads_ref[name], f"step {i}: {name}.grad")
