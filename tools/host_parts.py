"""Host cost of the pieces of an FP8 Linear step (GPU machine), each timed alone: us per call."""
import time

import torch

import fp8train
from fp8train import kernels

dev = torch.device("cuda")


def host_us(fn, n=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return us


a16 = torch.randn(256, 1024, device=dev, dtype=torch.bfloat16)
w16 = torch.randn(1024, 1024, device=dev, dtype=torch.bfloat16)
a8, w8 = a16.to(torch.float8_e4m3fn), w16.to(torch.float8_e4m3fn)
one = torch.ones((), device=dev)
out8 = torch.empty_like(a8)
out_t8 = torch.empty(1024, 256, device=dev, dtype=torch.float8_e4m3fn)
si, amax = torch.empty((), device=dev), torch.zeros((), device=dev)
q = fp8train.DelayedScalingQuantizer(fp8train.TensorRole.INPUT, torch.float8_e4m3fn, 1024, device=dev)
q.quantize(a16)
rows = [
    ("torch.mm bf16 256x1024x1024", lambda: torch.mm(a16, w16.t())),
    ("torch._scaled_mm fp8 same shape", lambda: torch._scaled_mm(a8, w8.t(), one, one, out_dtype=torch.bfloat16)),
    ("torch._scaled_mm fp8, fast accum", lambda: torch._scaled_mm(a8, w8.t(), one, one, out_dtype=torch.bfloat16,
                                                                    use_fast_accum=True)),
    ("kernels.cast_amax (Triton launch)", lambda: kernels.cast_amax(a16, out8, one, si, amax_out=amax)),
    ("kernels.cast_transpose_amax", lambda: kernels.cast_transpose_amax(a16, out8, out_t8, one, si, amax_out=amax)),
    ("torch.empty (256, 1024) fp8", lambda: torch.empty(256, 1024, device=dev, dtype=torch.float8_e4m3fn)),
    ("Float8Tensor(...) wrapper", lambda: fp8train.Float8Tensor(out8, si, torch.bfloat16)),
    ("quantizer.quantize(x, transpose=True)", lambda: q.quantize(a16, transpose=True)),
    ("update_delayed_scales()", fp8train.update_delayed_scales),
    ("a16 + 1 (one torch launch)", lambda: a16 + 1),
]
for name, fn in rows:
    print(f"{name:<42} {host_us(fn):8.1f} us")
