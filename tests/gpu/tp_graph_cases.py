"""GPU-only cases for tests/gpu/test_tp_nccl_gpu.py (torchrun, NCCL): tensor-parallel
LayerNormMLP training steps replayed from CUDA graphs (fp8train.make_graphed_callables with
the amax all-reduce captured) against the same steps run eagerly.

Both modules start from the same weights and one eager step each; then STEPS steps on fresh
inputs. Replays run the kernels eager steps run, on the same bytes, so outputs, input and
parameter gradients and the scaling state must agree to float rounding of the GEMMs (cuBLAS
may pick another algorithm under capture): asserted within 1e-3 relative (Frobenius), and
scales bitwise equal on every rank.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import fp8train
from fp8train.distributed import delayed_quantizers

H, F, SEQ, BATCH, STEPS = 256, 1024, 64, 2, 4
BF16 = torch.bfloat16


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _same_everywhere(t) -> bool:
    flat = t.detach().reshape(-1).float().clone()
    parts = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, flat)
    return all(torch.equal(flat, p) for p in parts)


def case_graphed_matches_eager(ctx, overlap, activation):
    group = dist.group.WORLD
    recipe = fp8train.DelayedScaling(amax_history_len=8)

    def make():
        torch.manual_seed(ctx.seed)
        return fp8train.LayerNormMLP(H, F, activation=activation, params_dtype=BF16, device=ctx.device,
                                     tp_group=group, sequence_parallel=True, tp_overlap=overlap)

    eager, graphed = make(), make()
    g = torch.Generator().manual_seed(ctx.seed + 1)
    inputs = [(torch.randn(SEQ, BATCH, H, generator=g) * (1 + s)).to(ctx.device, BF16) for s in range(STEPS + 1)]
    grads = [torch.randn(SEQ, BATCH, H, generator=g).to(ctx.device, BF16) for _ in range(STEPS + 1)]
    rows = SEQ // ctx.world

    def mine(t):
        return t[ctx.rank * rows:(ctx.rank + 1) * rows].contiguous()

    def eager_step(module, x, dy):
        x = x.clone().requires_grad_(True)
        with fp8train.autocast(recipe=recipe, amax_reduction=group):
            y = module(x)
        y.backward(dy)
        return y.detach(), x.grad

    for module in (eager, graphed):
        eager_step(module, mine(inputs[0]), mine(grads[0]))
        module.zero_grad(set_to_none=True)
    static_x = mine(inputs[0]).clone().requires_grad_(True)
    fp8train.make_graphed_callables(graphed, (static_x,), recipe=recipe, amax_reduction=group)
    for s in range(1, STEPS + 1):
        x, dy = mine(inputs[s]), mine(grads[s])
        y0, dx0 = eager_step(eager, x, dy)
        xg = x.clone().requires_grad_(True)
        y1 = graphed(xg)
        y1.backward(dy)
        for what, a, b in (("y", y1, y0), ("dx", xg.grad, dx0)):
            assert _rel(a, b) < 1e-3, f"step {s}: {what} rel err {_rel(a, b):.2e}"
    for (name, p0), (_, p1) in zip(eager.named_parameters(), graphed.named_parameters()):
        assert _rel(p1.grad, p0.grad) < 1e-3, f"{name}.grad (summed over {STEPS} steps): rel err {_rel(p1.grad, p0.grad):.2e}"
    for q0, q1 in zip(delayed_quantizers(eager), delayed_quantizers(graphed)):
        assert torch.equal(q0.scale, q1.scale), f"{q0.role.name}: graphed scale {q1.scale} vs eager {q0.scale}"
        assert _same_everywhere(q1.scale), f"{q1.role.name}: graphed scales differ across ranks"
    torch.cuda.synchronize()


CASES = [(f"graphed_matches_eager-{'overlap' if o else 'plain'}-{a}", case_graphed_matches_eager,
          {"overlap": o, "activation": a}, (2, 4)) for o in (False, True) for a in ("gelu_tanh", "swiglu")]
