"""fp8train.BlockScaling under torch.compile on the CPU: the traced block cast (the operator
fp8train::block_cast, whose CPU body is the custom op fp8train::block_cast_cpu, ops.block_cast's
torch ops opaque to Inductor) gives the eager cast's bytes and scales, also under Inductor; Linear, LayerNormLinear and
LayerNormMLP compile fullgraph (no graph break) and train bit for bit as eagerly; the kept
weight cast of is_first_microbatch holds under compile; the CUDA GEMM traces as one operator
(its numbers, torch.nn.functional.scaled_mm's blockwise scaling, and a compiled Linear on CUDA
are tests/gpu/test_block_scaling_gpu.py's)."""
import contextlib
import copy

from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import pytest
import torch

import fp8train
from fp8train import BlockScaling, TensorRole, gemm
from fp8train.quantizer_factory import make_quantizer
from helpers import rel_err

ROLES = (TensorRole.INPUT, TensorRole.WEIGHT, TensorRole.GRAD_OUTPUT)


def _casts(quantizers, x):
    # every role's cast with its transposed copy, and the grad-output's bias sums
    return [q.cast(x, transpose=True, dbias=q.role is TensorRole.GRAD_OUTPUT) for q in quantizers]


@pytest.mark.parametrize("backend, shape, power_of_two, dtype", [
    ("aot_eager", (3, 45, 304), False, torch.bfloat16), ("aot_eager", (3, 45, 304), True, torch.bfloat16),
    ("aot_eager", (256, 384), False, torch.float32),
    pytest.param("inductor", (3, 45, 304), False, torch.float32, marks=pytest.mark.slow),
    pytest.param("inductor", (2, 128, 384), True, torch.bfloat16, marks=pytest.mark.slow)], ids=str)
def test_traced_block_cast_is_the_eager_cast(backend, shape, power_of_two, dtype):
    # Rows and columns with tails (135 x 304: the twin's form) or whole blocks (256 x 384:
    # ops._traced_block_cast's view of x as blocks); Inductor calls the CPU cast as an opaque
    # operator (fp8train::block_cast_cpu: when it compiled the casts' torch ops it cast tail
    # blocks wrong, and failed on whole blocks after SiLU, design.md "torch.compile")
    _check_traced_casts(_extreme_input(shape, dtype), backend, power_of_two)


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_traced_tile_cast_is_the_eager_cast(backend):
    # the weight's scales sit in buffers padded with 1 to 4 columns, both GEMMs' scale operands
    # read from them in place (gemm.tile_scales' as_strided view over the padding, which the
    # traced code must keep): every role's cast as eager's, and the weight's GEMM operands too
    x = _extreme_input((3, 45, 304), torch.bfloat16)  # W (135, 304): Mb 2, Kb 3, both grids padded
    _check_traced_casts(x, backend)
    q = make_quantizer(BlockScaling(), TensorRole.WEIGHT)

    def operands(w):
        c = q.cast(w, transpose=True)
        return c, gemm.tile_scales(c.scale_inv) * 1, gemm.tile_scales(c.scale_inv_t) * 1

    w = x.reshape(-1, 304)
    torch._dynamo.reset()
    got, fprop_scales, dgrad_scales = torch.compile(operands, backend=backend, fullgraph=True)(w)
    eager = q.cast(w, transpose=True)
    for operand, s in ((fprop_scales, eager.scale_inv), (dgrad_scales, eager.scale_inv_t)):
        want = torch.ones(-(-s.shape[1] // 4) * 4, s.shape[0])  # (Kb rounded up to 4, Mb): the padding 1
        want[: s.shape[1]] = s.t()
        assert torch.equal(operand, want)
    assert torch.equal(got.scale_inv, eager.scale_inv) and torch.equal(got.scale_inv_t, eager.scale_inv_t)
    nan = eager.data.float().isnan()
    assert torch.equal(got.data.view(torch.uint8)[~nan], eager.data.view(torch.uint8)[~nan])
    nan_t = eager.data_t.float().isnan()
    assert torch.equal(got.data_t.view(torch.uint8)[~nan_t], eager.data_t.view(torch.uint8)[~nan_t])


def test_traced_block_casts_are_the_kernel_operator():
    # the casts trace as the operator fp8train::block_cast (a triton_op: on the CPU its body is
    # fp8train::block_cast_cpu; on CUDA the eager kernels, tests/gpu/test_block_scaling_gpu.py)
    x = _extreme_input((3, 45, 304), torch.bfloat16)
    graph = torch._dynamo.explain(lambda t: _casts([make_quantizer(BlockScaling(), r) for r in ROLES], t))(x)
    assert graph.graph_break_count == 0
    assert str(graph.graphs[0].code).count("fp8train.block_cast") == len(ROLES)


def _extreme_input(shape, dtype):
    # magnitudes over 8 decades (blocks with very different scales), a zero block, an inf, a NaN
    torch.manual_seed(0)
    x = torch.randn(shape) * torch.logspace(-4, 4, shape[-1])
    x[..., 2:9, 128:256] = 0.0
    x[..., 40, 300 - 30] = float("inf")
    x[..., 3, 7] = float("nan")
    return x.to(dtype)


def _check_traced_casts(x, backend, power_of_two=False):
    recipe = BlockScaling(power_of_two_scales=power_of_two)
    quantizers = [make_quantizer(recipe, role) for role in ROLES]
    want = _casts(quantizers, x)
    torch._dynamo.reset()  # one code object compiled per case: under Dynamo's recompile limit
    got = torch.compile(lambda t: _casts(quantizers, t), backend=backend, fullgraph=True)(x)
    for role, g, w in zip(ROLES, got, want):
        for field in w._fields:
            a, b = getattr(g, field), getattr(w, field)
            if b is None:
                assert a is None, (role, field)
                continue
            assert a.shape == b.shape and a.dtype == b.dtype, (role, field)
            if field == "dbias" and backend == "inductor":  # a float32 sum over rows, in Inductor's order
                finite = b.isfinite()  # x's inf and NaN columns: the same inf and NaN
                assert torch.equal(a[~finite].nan_to_num(), b[~finite].nan_to_num()), (role, field)
                assert rel_err(a[finite], b[finite]) < 1e-6, (role, field)
                continue
            if a.element_size() == 1:
                # bytes, but a NaN's sign: IEEE leaves it open for x * scale, and Inductor's CPU
                # code gives float32 NaN * 1 the byte 0xFF where eager gives 0x7F (torch 2.13)
                nan = b.float().isnan()
                assert torch.equal(a.float().isnan(), nan), (role, field)
                same = torch.equal(a.view(torch.uint8)[~nan], b.view(torch.uint8)[~nan])
            else:
                same = torch.equal(a.view(torch.int32), b.view(torch.int32))
            assert same, (role, field)


def _layers():
    torch.manual_seed(1)
    return {"linear": fp8train.Linear(304, 272),
            "qkv_parts": fp8train.LayerNormLinear(160, (128, 64, 80), normalization="RMSNorm"),
            "layernorm_mlp": fp8train.LayerNormMLP(160, 304, activation="swiglu", normalization="RMSNorm"),
            "whole_blocks": torch.nn.Sequential(fp8train.Linear(256, 384), torch.nn.SiLU(), fp8train.Linear(384, 256))}


@pytest.mark.parametrize("kind", ["linear", pytest.param("qkv_parts", marks=pytest.mark.slow),
                                  pytest.param("layernorm_mlp", marks=pytest.mark.slow)])
def test_compiled_layers_train_as_eager(kind):
    # FP32 master weights under bf16 autocast, 3-D inputs whose rows (135) and K are not
    # multiples of 128; fullgraph: no graph break around the block-scaled GEMMs
    eager = _layers()[kind]
    module = copy.deepcopy(eager)
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True)
    k = 304 if kind == "linear" else 160
    g = torch.Generator().manual_seed(2)
    with fp8train.autocast(recipe=BlockScaling()):  # quantizers made eagerly, before the trace
        module(torch.randn(2, 16, k))
        eager(torch.randn(2, 16, k))
    for step in range(2):
        x = torch.randn(3, 45, k, generator=g)
        outs = []
        for fn, layer in ((eager, eager), (compiled, module)):
            xi = x.clone().requires_grad_(True)
            with torch.autocast("cpu", dtype=torch.bfloat16), fp8train.autocast(recipe=BlockScaling()):
                ys = fn(xi)
            ys = ys if isinstance(ys, tuple) else (ys,)
            sum(y.float().square().mean() for y in ys).backward()
            outs.append([y.detach() for y in ys] + [xi.grad] + [p.grad for p in layer.parameters()])
            layer.zero_grad(set_to_none=True)
        assert len(outs[0]) == len(outs[1])
        for i, (a, b) in enumerate(zip(*outs)):
            assert torch.equal(a, b), f"step {step}, tensor {i}"


@pytest.mark.slow  # Inductor's C++ compiles: ~20 s cold
@pytest.mark.parametrize("kind", ["linear", "layernorm_mlp", "whole_blocks"])
def test_inductor_compiled_layers_train_as_eager(kind):
    # Inductor's generated code for the high-precision norm and activation around the casts and
    # the emulated GEMM (opaque custom ops off CUDA: fp8train::block_cast_cpu). Float32
    # throughout: under bf16 autocast Inductor keeps float32 where eager rounds to bf16 (the
    # norm's and activation's outputs), which moves FP8 roundings. Linear: bit for bit;
    # LayerNormMLP: the fused norm / SiLU in float32 differ in the last bits (measured 1.3e-7 -
    # 2.6e-7 relative); bias gradients are float32 sums over rows in Inductor's order.
    # whole_blocks: Linear, SiLU, Linear on 128 rows, widths of whole blocks, where Inductor's
    # CPU code, given the casts as torch ops, fused SiLU's gradient with its 1 x 128 and
    # 128 x 1 casts and failed an assertion (torch 2.13)
    eager = _layers()[kind]
    module = copy.deepcopy(eager)
    compiled = torch.compile(module, fullgraph=True)
    k = {"linear": 304, "layernorm_mlp": 160, "whole_blocks": 256}[kind]
    with fp8train.autocast(recipe=BlockScaling()):
        module(torch.randn(2, 16, k))
        eager(torch.randn(2, 16, k))
    x = torch.randn(*((2, 64) if kind == "whole_blocks" else (3, 45)), k, generator=torch.Generator().manual_seed(3))
    outs = []
    for fn, layer in ((eager, eager), (compiled, module)):
        xi = x.clone().requires_grad_(True)
        with fp8train.autocast(recipe=BlockScaling()):
            y = fn(xi)
        y.square().mean().backward()
        outs.append({"y": y.detach(), "x.grad": xi.grad, **{n: p.grad for n, p in layer.named_parameters()}})
    for name, want in outs[0].items():
        got = outs[1][name]
        if kind == "linear" and "bias" not in name:
            assert torch.equal(got, want), name
        else:
            assert rel_err(got, want) < 1e-6, name


@pytest.mark.slow
def test_kept_weight_cast_under_compile():
    # is_first_microbatch True casts the weight and keeps it; False reuses it (a changed
    # weight is not re-cast): compiled as eager, one graph per value
    eager = fp8train.Linear(256, 128)
    module = copy.deepcopy(eager)
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True)
    with fp8train.autocast(recipe=BlockScaling()):
        module(torch.randn(4, 256))
        eager(torch.randn(4, 256))
        for first in (True, False, False):
            x = torch.randn(20, 256)
            got, want = compiled(x, is_first_microbatch=first), eager(x, is_first_microbatch=first)
            assert torch.equal(got, want)
            if not first:  # the kept cast, not the weight as it is now
                assert not torch.equal(got, copy.deepcopy(eager)(x, is_first_microbatch=None))
            with torch.no_grad():  # an optimizer step between microbatches: not seen while the cast is kept
                module.weight.mul_(1.5)
                eager.weight.mul_(1.5)


@pytest.mark.parametrize("extension", [pytest.param(True, marks=pytest.mark.slow), False],  # True builds the extension
                         ids=["extension-op", "torch-op"])
def test_cuda_block_gemm_traces_as_one_operator(extension, monkeypatch):
    # torch 2.11's Dynamo cannot trace torch._scaled_mm_v2 (F.scaled_mm's call): a compiled
    # BlockScaling Linear on CUDA broke the graph there (2026-12-02). Traced over fake CUDA
    # tensors (no GPU needed) as under torch.compile (is_compiling: make_fx alone is not
    # Dynamo), the GEMM is one operator with the output's shape and dtype: the extension's
    # (fp8train_lt::block_scaled_mm) where it is loaded, else fp8train::cuda_block_scaled_mm.
    # A wgrad GEMM (dY^T (384, Mp 384) @ X, X^T (512, 384) in row blocks) with its scales laid
    # out already: a CPU-only torch cannot run the layout copies on fake CUDA tensors.
    from fp8train import gemm
    from fp8train.kernels import native
    if extension and native.extension() is None:
        pytest.skip(f"the C++ extension did not build: {native.failure()}")
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    monkeypatch.setattr(native, "gemm_op_loaded", lambda: extension)
    monkeypatch.setattr(native, "BLOCK_GEMM", extension)
    with FakeTensorMode():
        args = (torch.empty(384, 384, dtype=torch.float8_e4m3fn, device="cuda"),
                torch.empty(3, 384, device="cuda").t(),  # (384, 3) with strides (1, 384)
                torch.empty(512, 384, dtype=torch.float8_e4m3fn, device="cuda"),
                torch.empty(3, 512, device="cuda").t())
        graph = make_fx(lambda *t: gemm.block_scaled_mm(*t, gemm.ROW, out_dtype=torch.bfloat16))(*args)
        y = graph(*args)
    targets = [str(node.target) for node in graph.graph.nodes if node.op == "call_function"]
    # the extension's operator takes B (K, N) column-major (bt.t()), torch's bt
    want = ["aten.t.default", "fp8train_lt.block_scaled_mm.default"] if extension else \
        ["fp8train.cuda_block_scaled_mm.default"]
    assert targets == want, targets
    assert y.shape == (384, 512) and y.dtype == torch.bfloat16 and y.is_cuda


def test_compiled_layer_recompiles_under_other_launch_shapes():
    # The casts' launch shapes are read inside custom ops' bodies, which Dynamo does not guard
    # on: the layers read kernels.forms.KEY while traced, so a graph traced under one override
    # (block_kernel.override_shapes: a benchmark's A/B in one process) is not reused under
    # another, and each is reused under its own
    pytest.importorskip("triton")
    from torch._dynamo.testing import CompileCounter

    from fp8train.kernels import forms
    from fp8train.kernels.launcher import LaunchOverride
    torch.manual_seed(0)
    model, recipe, x = torch.nn.Sequential(torch.nn.Linear(256, 256)), BlockScaling(), torch.randn(128, 256)
    fp8train.convert(model, recipe)
    with fp8train.autocast(recipe=recipe):
        model(x)  # the quantizers are made eagerly
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter)
    override = LaunchOverride()

    def frames_after(value=None):
        with fp8train.autocast(recipe=recipe), (override.using(value) if value else contextlib.nullcontext()):
            compiled(x)
        return counter.frame_count

    assert frames_after() == 1 and frames_after() == 1
    assert frames_after("form A") == 2 and frames_after("form A") == 2
    assert forms.KEY == ""  # restored on leaving the override
    assert frames_after() == 2 and frames_after("form B") == 3
