"""Stacked siblings on CUDA (modules/stacked.py; CPU side: tests/test_stacked_siblings.py): a
tie's Linears (q/k/v, gate/up) under BlockScaling run as one GEMM each way, compiled through
Inductor and (the eager switch on) eagerly through the C++ node, and train as the layers apart do.

Tolerances: the stacked and separate GEMMs are different cuBLASLt calls (another N, and one
dgrad summing every member's dX inside the GEMM in float32), so bf16 outputs round differently
where the float32 sums differ in the last bits, and an FP8 rounding after them may flip. Each
step's output, input gradient and parameter gradients stay within 1e-2 relative (Frobenius) of
the separate layers'; a wrong slice, a missing bias or member gradient is off by order 1."""
from __future__ import annotations

import pytest
import torch

import fp8train
from fp8train.kernels import native
from fp8train.modules import stacked
from tests.helpers import assert_bitwise, sgd_steps
from tests.test_stacked_siblings import Block

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
STACKED = fp8train.BlockScaling(stack_siblings=True)
APART = fp8train.BlockScaling(stack_siblings=False)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _models(params_dtype, bias=False):
    out = []
    for _ in range(2):
        torch.manual_seed(0)
        out.append(Block(d=256, kv=128, f=512, bias=bias).to(CUDA, params_dtype))
    return out


def _inputs(params_dtype, n=4):
    g = torch.Generator(device=CUDA).manual_seed(1)
    return [torch.randn(4, 128, 256, device=CUDA, generator=g).to(params_dtype) for _ in range(n)]


def _assert_close(got, want, tol=1e-2):
    for i, ((y, dx, grads), (y_ref, dx_ref, grads_ref)) in enumerate(zip(got, want)):
        if i == 0:  # the ties form during the first step: nothing stacked yet
            assert_bitwise(y, y_ref, "step 0: y")
            continue
        assert _rel(y, y_ref) < tol, (i, "y", _rel(y, y_ref))
        assert _rel(dx, dx_ref) < tol, (i, "x.grad", _rel(dx, dx_ref))
        for name in grads_ref:
            assert _rel(grads[name], grads_ref[name]) < tol, (i, name, _rel(grads[name], grads_ref[name]))


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("params_dtype", [torch.float32, torch.bfloat16], ids=["fp32-autocast-bf16", "bf16"])
def test_eager_stacked_siblings_run_the_cpp_node_and_train_as_apart(params_dtype, bias, monkeypatch):
    """Eager stacking (the switch on: stacked.EAGER) through the C++ node."""
    assert native.ENABLED and native.extension() is not None, native.failure()
    monkeypatch.setattr(stacked, "EAGER", True)
    stacked, apart = _models(params_dtype, bias)
    xs = _inputs(params_dtype)
    want = sgd_steps(apart, APART, xs, params_dtype)
    got = sgd_steps(stacked, STACKED, xs, params_dtype)
    for model in (stacked, apart):
        paths = fp8train.inspect.execution_paths(model)
        assert set(paths.values()) == {"C++ node"}, paths
    _assert_close(got, want)
    # k and v took column slices of q's output, gate's and up's one output
    outs = {}
    for name in ("q", "k", "v", "gate", "up"):
        getattr(stacked, name).register_forward_hook(lambda m, a, y, name=name: outs.__setitem__(name, y))
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=params_dtype == torch.float32), \
            fp8train.autocast(recipe=STACKED):
        stacked(xs[0])
    assert outs["k"].data_ptr() == outs["q"].data_ptr() + 256 * outs["q"].element_size()
    assert outs["v"].data_ptr() == outs["k"].data_ptr() + 128 * outs["q"].element_size()
    assert outs["up"].data_ptr() == outs["gate"].data_ptr() + 512 * outs["gate"].element_size()
    assert stacked.q.input_quantizer._stack_memo is None and stacked.gate.input_quantizer._stack_memo is None


def test_compiled_stacked_siblings_train_as_eager():
    """torch.compile (Inductor) after one eager step: one graph, no recompile over three steps,
    each step within tolerance of the eager model's (eager calls run apart: the switch off)."""
    compiled_model, eager = _models(torch.float32)
    xs = _inputs(torch.float32)
    want = sgd_steps(eager, STACKED, xs, torch.float32)
    head = sgd_steps(compiled_model, STACKED, xs[:1], torch.float32)
    torch._dynamo.reset()
    frames = []
    compiled = torch.compile(compiled_model, backend=lambda gm, ex: frames.append(gm) or
                             torch._inductor.compile_fx.compile_fx(gm, ex))
    got = head + sgd_steps(compiled, STACKED, xs[1:], torch.float32)
    assert len(frames) == 1, f"{len(frames)} graphs: a graph break or recompile"
    _assert_close(got, want)
