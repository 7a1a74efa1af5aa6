"""torch.profiler CPU view of one small-layer fwd+bwd (GPU machine): self CPU time per op and
per thread, for nn.Linear BF16 and fp8train.Linear, so host-time differences can be placed."""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import fp8train

dev = torch.device("cuda")
x = torch.randn(256, 1024, device=dev, dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn(256, 1024, device=dev, dtype=torch.bfloat16)
ref = torch.nn.Linear(1024, 1024, device=dev, dtype=torch.bfloat16)
layer = fp8train.Linear(1024, 1024, device=dev, params_dtype=torch.bfloat16)
recipe = fp8train.DelayedScaling()


def bf16():
    ref(x).backward(dy)


def fp8():
    with fp8train.autocast(recipe=recipe):
        y = layer(x)
    y.backward(dy)


for name, fn in (("bf16", bf16), ("fp8 delayed", fp8)):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
    print(f"\n===== {name} (20 iterations)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=int(sys.argv[1]) if len(sys.argv) > 1 else 25))
