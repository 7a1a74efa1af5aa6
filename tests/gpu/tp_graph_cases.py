"""GPU-only cases for tests/gpu/test_tp_nccl_gpu.py (torchrun, NCCL): tensor-parallel
LayerNormMLP training steps replayed from CUDA graphs (fp8train.make_graphed_callables with
the amax all-reduce captured) against the same steps run eagerly.

The eager run goes first and is freed before the graphed one is built: with both alive,
each one's step would also update the other's delayed-scaling state (the update covers
every live quantizer), so the two runs would not see the same histories. Both start from
the same weights and one eager step; then STEPS steps on fresh inputs. Replays run the
kernels eager steps run, on the same bytes, so outputs, input and parameter gradients and
the scales must agree to float rounding of the GEMMs (cuBLAS may pick another algorithm
under capture): within 1e-3 relative (Frobenius). Every rank computes every error and the
group takes the maximum before anything is asserted, so a failure on one rank fails all of
them together instead of leaving the others waiting in a collective.
"""
from __future__ import annotations

import gc

import torch
import torch.distributed as dist

import fp8train
from fp8train.distributed import delayed_quantizers

H, F, SEQ, BATCH, STEPS = 256, 1024, 64, 2, 4
BF16 = torch.bfloat16
TOL = 1e-3


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _group_max(values: dict, device) -> dict:
    """Each value's maximum over the ranks (one all-reduce)."""
    t = torch.tensor(list(values.values()), dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(zip(values, t.tolist()))


def case_graphed_matches_eager(ctx, overlap, activation):
    group = dist.group.WORLD
    recipe = fp8train.DelayedScaling(amax_history_len=8)
    g = torch.Generator().manual_seed(ctx.seed + 1)
    rows = SEQ // ctx.world

    def mine(t):  # this rank's rows (SP splits the leading dim)
        return t[ctx.rank * rows:(ctx.rank + 1) * rows].contiguous()

    inputs = [mine((torch.randn(SEQ, BATCH, H, generator=g) * (1 + s)).to(ctx.device, BF16))
              for s in range(STEPS + 1)]
    grads = [mine(torch.randn(SEQ, BATCH, H, generator=g).to(ctx.device, BF16)) for _ in range(STEPS + 1)]

    def make():
        torch.manual_seed(ctx.seed)
        return fp8train.LayerNormMLP(H, F, activation=activation, params_dtype=BF16, device=ctx.device,
                                     tp_group=group, sequence_parallel=True, tp_overlap=overlap)

    def eager_step(module, x, dy):
        x = x.clone().requires_grad_(True)
        with fp8train.autocast(recipe=recipe, amax_reduction=group):
            y = module(x)
        y.backward(dy)
        return y.detach(), x.grad

    def run(graphed: bool):
        module = make()
        eager_step(module, inputs[0], grads[0])
        module.zero_grad(set_to_none=True)
        if graphed:
            fp8train.make_graphed_callables(module, (inputs[0].clone().requires_grad_(True),), recipe=recipe,
                                            amax_reduction=group)
        outs = []
        for s in range(1, STEPS + 1):
            if graphed:
                x = inputs[s].clone().requires_grad_(True)
                y = module(x)
                y.backward(grads[s])
                outs.append((y.detach().clone(), x.grad.clone()))
            else:
                outs.append(eager_step(module, inputs[s], grads[s]))
        state = ({n: p.grad.clone() for n, p in module.named_parameters()},
                 [q.scale.clone() for q in delayed_quantizers(module)])
        torch.cuda.synchronize()
        return outs, state

    eager_outs, (eager_grads, eager_scales) = run(graphed=False)
    gc.collect()  # the eager module's quantizers leave the registry before the graphed run
    graph_outs, (graph_grads, graph_scales) = run(graphed=True)
    # The graphed module (reference cycles: its forward closes over the graphs) and with it
    # the graphs holding captured NCCL collectives must be gone before the process group is
    # destroyed: a GPU run whose graphs were still alive hung in the teardown after passing.
    gc.collect()
    torch.cuda.synchronize()

    errors = {}
    for s, ((y1, dx1), (y0, dx0)) in enumerate(zip(graph_outs, eager_outs), start=1):
        errors[f"step {s} y"] = _rel(y1, y0)
        errors[f"step {s} dx"] = _rel(dx1, dx0)
    for name, grad in graph_grads.items():
        errors[f"{name}.grad (sum of {STEPS} steps)"] = _rel(grad, eager_grads[name])
    for i, (s1, s0) in enumerate(zip(graph_scales, eager_scales)):
        errors[f"scale {i}"] = _rel(s1, s0)
    scales = torch.stack(graph_scales).double()
    low, high = scales.clone(), scales.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    errors["graphed scales' spread over the ranks"] = (high - low).abs().max().item()  # must be 0
    worst = _group_max(errors, ctx.device)
    bad = {k: v for k, v in worst.items() if not v < TOL}
    assert not bad, f"graphed vs eager, relative errors above {TOL} (max over ranks): {bad}"
    return {"max_rel_err": max(worst.values())}


CASES = [(f"graphed_matches_eager-{'overlap' if o else 'plain'}-{a}", case_graphed_matches_eager,
          {"overlap": o, "activation": a}, (2, 4)) for o in (False, True) for a in ("gelu_tanh", "swiglu")]
