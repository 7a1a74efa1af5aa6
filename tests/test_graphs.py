"""fp8train.make_graphed_callables where no GPU is: a clear error, and the gradient-alias
guard of the graphed forward against a stand-in for torch's graphed autograd nodes (the
graphs themselves are tested on the GPU, tests/gpu/test_graphs_gpu.py).

The stand-in keeps what matters about CUDA graphs sharing one memory pool: backward hands
out detached views of static gradient buffers, and every forward replay may overwrite any
static buffer of the pool with its temporaries (here: NaN)."""
import pytest
import torch
from torch import nn

import fp8train
from fp8train.graphs import _graphed_forward, _GradAliasGuard


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_needs_cuda():
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        fp8train.make_graphed_callables(fp8train.Linear(16, 16), (torch.randn(2, 16),))


class _Replay(torch.autograd.Function):
    """y = x @ w^T + b as a graphed node: forward scribbles over the whole pool, backward
    writes this node's static gradient buffers and returns views of them."""

    @staticmethod
    def forward(ctx, x, w, b, mine, pool):
        for buf in pool:
            buf.fill_(float("nan"))  # a forward replay's temporaries
        ctx.save_for_backward(x, w)
        ctx.mine = mine
        return x @ w.t() + b

    @staticmethod
    def backward(ctx, gy):
        x, w = ctx.saved_tensors
        gx, gw, gb = ctx.mine
        gx.copy_(gy @ w)
        gw.copy_(gy.t() @ x)
        gb.copy_(gy.sum(0))
        return gx.detach(), gw.detach(), gb.detach(), None, None


def _stand_in(n_layers: int, guard_at: str):
    """n_layers Linear(5, 5) graphed in one call (one pool); the guard runs before each
    forward ("forward", as graphs.py does), before each backward ("backward", the variant a
    GPU test caught), or not at all ("none")."""
    torch.manual_seed(0)
    layers = [nn.Linear(5, 5, dtype=torch.float64) for _ in range(n_layers)]
    mine = [tuple(torch.empty(s, dtype=torch.float64) for s in ((7, 5), (5, 5), (5,))) for _ in layers]
    pool = [b for bufs in mine for b in bufs]
    guard = _GradAliasGuard([p for layer in layers for p in layer.parameters()])

    def region(i):
        return lambda x: _Replay.apply(x, layers[i].weight, layers[i].bias, mine[i], pool)

    def call(i):
        if guard_at == "forward":
            return _graphed_forward(region(i), None, guard)
        if guard_at == "none":
            return region(i)

        def guard_before_backward(x):
            y = region(i)(x)
            y.register_hook(lambda g: (guard.before_replay(), g)[1])
            return y
        return guard_before_backward
    calls = [call(i) for i in range(n_layers)]

    def model(x):
        for c in calls:
            x = c(x)
        return x
    return layers, model, guard


def _microbatches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(7, 5, generator=g, dtype=torch.float64), torch.randn(7, 5, generator=g, dtype=torch.float64))
            for _ in range(n)]


def _train(layers, model, steps, microbatches, set_to_none):
    eager = [nn.Linear(5, 5, dtype=torch.float64) for _ in layers]
    for e, layer in zip(eager, layers):
        e.load_state_dict(layer.state_dict())
    worst = 0.0
    for step in range(steps):
        for x, dy in _microbatches(microbatches, seed=step):
            model(x.requires_grad_(True)).backward(dy)
            y = x.detach()
            for e in eager:
                y = e(y)
            y.backward(dy)
        for layer, e in zip(layers, eager):
            for p, q in zip(layer.parameters(), e.parameters()):
                worst = max(worst, ((p.grad - q.grad).abs().max() / q.grad.abs().max()).nan_to_num(float("inf")).item())
            layer.zero_grad(set_to_none=set_to_none)
            e.zero_grad(set_to_none=set_to_none)
    return worst


@pytest.mark.parametrize("n_layers", [1, 2])
@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("microbatches", [1, 4])
def test_gradients_match_eager_accumulation(n_layers, set_to_none, microbatches):
    layers, model, _ = _stand_in(n_layers, "forward")
    assert _train(layers, model, steps=3, microbatches=microbatches, set_to_none=set_to_none) < 1e-12


@pytest.mark.parametrize("guard_at", ["none", "backward"])
def test_the_stand_in_catches_a_missing_or_late_copy(guard_at):
    """Without the copy, or with the copy deferred to the next backward, accumulated
    gradients are wrong: the next forward replay has already overwritten the static buffers."""
    layers, model, _ = _stand_in(2, guard_at)
    assert not _train(layers, model, steps=2, microbatches=4, set_to_none=True) < 1e-6


def test_one_microbatch_per_step_copies_nothing():
    layers, model, guard = _stand_in(2, "forward")
    for x, dy in _microbatches(3):
        model(x.requires_grad_(True)).backward(dy)
        for layer in layers:
            assert layer.weight.grad.data_ptr() in guard.static  # adopted as it came: no copy
            layer.zero_grad(set_to_none=True)
    assert len(guard.static) == 4 and not guard._learning  # learned, then the hooks went
