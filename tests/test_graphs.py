"""fp8train.make_graphed_callables where no GPU is: a clear error, and the gradient-alias
guard of the graphed forward against a stand-in for torch's graphed autograd node (the
graphs themselves are tested on the GPU, tests/gpu/test_graphs_gpu.py)."""
import pytest
import torch
from torch import nn

import fp8train
from fp8train.graphs import _graphed_forward, _GradAliasGuard


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_needs_cuda():
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        fp8train.make_graphed_callables(fp8train.Linear(16, 16), (torch.randn(2, 16),))


class _StaticGrads(torch.autograd.Function):
    """What torch.cuda.make_graphed_callables' node does: backward writes every gradient into
    the same static buffers (the replay) and returns detached views of them."""

    @staticmethod
    def forward(ctx, x, w, b, bufs):
        ctx.save_for_backward(x, w)
        ctx.bufs = bufs
        return x @ w.t() + b

    @staticmethod
    def backward(ctx, gy):
        x, w = ctx.saved_tensors
        gx, gw, gb = ctx.bufs
        gx.copy_(gy @ w)
        gw.copy_(gy.t() @ x)
        gb.copy_(gy.sum(0))
        return gx.detach(), gw.detach(), gb.detach(), None


def _stand_in(guarded: bool):
    torch.manual_seed(0)
    layer = nn.Linear(5, 3, dtype=torch.float64)
    bufs = (torch.empty(7, 5, dtype=torch.float64), torch.empty(3, 5, dtype=torch.float64),
            torch.empty(3, dtype=torch.float64))

    def region(x):
        return _StaticGrads.apply(x, layer.weight, layer.bias, bufs)
    guard = _GradAliasGuard(layer.parameters())
    forward = _graphed_forward(region, None, guard) if guarded else region
    return layer, forward, guard


def _microbatches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(7, 5, generator=g, dtype=torch.float64, requires_grad=True),
             torch.randn(7, 3, generator=g, dtype=torch.float64)) for _ in range(n)]


@pytest.mark.parametrize("zero_grad_to_none", [True, False])
def test_microbatches_accumulate_to_the_eager_sum(zero_grad_to_none):
    layer, forward, guard = _stand_in(guarded=True)
    eager = nn.Linear(5, 3, dtype=torch.float64)
    eager.load_state_dict(layer.state_dict())
    for step in range(3):
        for x, dy in _microbatches(4 + step):
            forward(x).backward(dy)
            eager(x.detach()).backward(dy)
        for p, q in zip(layer.parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12)
        layer.zero_grad(set_to_none=zero_grad_to_none)
        eager.zero_grad(set_to_none=zero_grad_to_none)
    assert len(guard.static) == 2


def test_without_the_guard_microbatches_do_not_add_up():
    """The stand-in reproduces the bug the guard exists for (so the test above can fail)."""
    layer, forward, _ = _stand_in(guarded=False)
    batches = _microbatches(4)
    for x, dy in batches:
        forward(x).backward(dy)
    last = batches[-1][1].t() @ batches[-1][0].detach()
    torch.testing.assert_close(layer.weight.grad, 2 * last)


def test_one_microbatch_per_step_copies_nothing():
    layer, forward, guard = _stand_in(guarded=True)
    for x, dy in _microbatches(3):
        forward(x).backward(dy)
        assert layer.weight.grad.data_ptr() in guard.static  # adopted in place: no copy made
        torch.testing.assert_close(layer.weight.grad, dy.t() @ x.detach())
        layer.zero_grad(set_to_none=True)
