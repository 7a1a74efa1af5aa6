"""Why does the host-time ratio of one FP8 Linear fwd+bwd move with the process's history?
(GPU machine.) benchmarks/linear.py's host_time in a fresh process, then again after what
benchmarks/small.py runs before its own host_time: a torch.profiler session over an FP8
step, and a graphed FP8 MLP built, run and freed. Each state prints the ratios and what
could change the path: Triton launch hooks (they send every launch back through Triton and
the Linear through its Python node), the live delayed-scaling quantizers and their update
groups, and which autograd node the layer's output got.

    PYTHONPATH=.:benchmarks python3 tools/probe_host_state.py
"""
import gc
import sys

import torch

sys.path.insert(0, "benchmarks")
import fp8train  # noqa: E402
from fp8train.kernels import native  # noqa: E402
from fp8train.quantizer import _REGISTRY  # noqa: E402
from linear import host_time  # noqa: E402
from mlp import fp8_mlp, kernel_breakdown, make_step  # noqa: E402

dev = torch.device("cuda")


def state(label):
    layer = fp8train.Linear(1024, 1024, device=dev, params_dtype=torch.bfloat16)
    x = torch.randn(256, 1024, device=dev, dtype=torch.bfloat16, requires_grad=True)
    for _ in range(3):
        with fp8train.autocast():
            y = layer(x)
        y.sum().backward()
    rows = {r["kind"]: r for r in host_time(dev)}
    print(f"\n[{label}] hooks installed: {native.hooks_installed()}; node: {y.grad_fn.name()}; live delayed "
          f"quantizers: {len(_REGISTRY.live())}; update launches per step: {len(_REGISTRY.batches())}; "
          f"gc objects: {len(gc.get_objects())}")
    for kind, r in rows.items():
        print(f"  {kind:<26} {r['host_us']:8.1f} us {r['ratio_to_nn_linear']:6.2f}x")


state("fresh process")
h, tokens = 1024, 4096
x = torch.randn(tokens, h, device=dev, dtype=torch.bfloat16)
target = torch.randn(tokens, h, device=dev)
model = fp8_mlp(h, 4 * h, torch.bfloat16, dev)
step = make_step(model, x, target, fp8train.DelayedScaling())
step()
kernel_breakdown(step)
state("after a torch.profiler session over an FP8 step")
fp8train.make_graphed_callables(model, (x.detach().clone(),), recipe=fp8train.DelayedScaling())
step = make_step(model, x, target)
for _ in range(20):
    step()
del step, model
gc.collect()
torch.cuda.empty_cache()
state("after a graphed FP8 MLP, freed")
