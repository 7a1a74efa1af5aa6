"""Probe (one GPU): the host time of one small FP8 GEMM call, torch._scaled_mm against a
Triton FP8 GEMM launched through fp8train's DirectKernel, with BF16 torch.mm as the yardstick.

The eager FP8 Linear's host time misses its target (<= 1.5x nn.Linear) mostly through
torch._scaled_mm (~80 us a call on the GPU machine against ~25 us for a BF16 cuBLAS call).
If a Triton FP8 GEMM issued through DirectKernel costs ~10 us and computes the same
product, small layers could take that path. Prints, for M x K @ K x N (default 256 x 1024
@ 1024 x 1024): host us per call (the mean over many calls issued without a sync), device
us per call (triton.testing.do_bench), and the Triton result's relative error against
_scaled_mm's (float32 output).

    PYTHONPATH=. python3 tools/probe_small_gemm.py [--m 256 --k 1024 --n 1024]
"""
import argparse
import time

import torch
import triton
import triton.language as tl

from fp8train.kernels.launcher import DirectKernel


@triton.jit
def _fp8_gemm_kernel(a_ptr, b_ptr, c_ptr, a_scale_ptr, b_scale_ptr, M, N, K, stride_am, stride_ak, stride_bk,
                     stride_bn, stride_cm, stride_cn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
    # C (M, N) = (A (M, K) @ B (K, N)) * a_scale * b_scale; 1-D grid over the C tiles (row-major)
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    pm, pn = pid // tiles_n, pid % tiles_n
    rm = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptr + rm[:, None] * stride_am + (k0 + rk)[None, :] * stride_ak,
                    mask=(rm[:, None] < M) & ((k0 + rk)[None, :] < K), other=0.0)
        b = tl.load(b_ptr + (k0 + rk)[:, None] * stride_bk + rn[None, :] * stride_bn,
                    mask=((k0 + rk)[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc)
    acc = acc * (tl.load(a_scale_ptr) * tl.load(b_scale_ptr))
    tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def host_us(fn, iters=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    host = (time.perf_counter() - t0) / iters * 1e6
    torch.cuda.synchronize()
    return host


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", type=int, default=256)
    p.add_argument("--k", type=int, default=1024)
    p.add_argument("--n", type=int, default=1024)
    args = p.parse_args()
    m, k, n = args.m, args.k, args.n
    dev = torch.device("cuda")
    a = torch.randn(m, k, device=dev).to(torch.float8_e4m3fn)
    w = torch.randn(n, k, device=dev).to(torch.float8_e4m3fn)
    sa, sb = torch.tensor(0.5, device=dev), torch.tensor(0.25, device=dev)
    a16, w16 = a.to(torch.bfloat16), w.to(torch.bfloat16)
    out32 = torch.empty(m, n, device=dev)
    out16 = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
    bm, bn, bk = 64, 64, 128
    kernel = DirectKernel(_fp8_gemm_kernel, num_warps=4, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    grid = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    b = w.t()  # (K, N) column-major view, as fp8train.gemm.fprop passes it

    def triton_gemm(out):
        kernel(grid, a, b, out, sa, sb, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
               out.stride(0), out.stride(1))

    def triton_gemm_jit(out):
        _fp8_gemm_kernel[(grid,)](a, b, out, sa, sb, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                                  out.stride(0), out.stride(1), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=4)

    ref = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.float32)
    triton_gemm(out32)
    torch.cuda.synchronize()
    err = ((out32 - ref).norm() / ref.norm()).item()
    rows = [
        ("torch.mm bf16 (yardstick)", lambda: torch.mm(a16, w16.t())),
        ("torch._scaled_mm fp8 -> bf16", lambda: torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)),
        ("torch._scaled_mm fp8 -> bf16, out=", lambda: torch._scaled_mm(a, b, scale_a=sa, scale_b=sb,
                                                                         out_dtype=torch.bfloat16, out=out16)),
        ("Triton fp8 GEMM, DirectKernel", lambda: triton_gemm(out16)),
        ("Triton fp8 GEMM, kernel[grid]", lambda: triton_gemm_jit(out16)),
    ]
    print(f"FP8 GEMM {m} x {k} @ {k} x {n} -- {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {triton.__version__}")
    print(f"Triton vs _scaled_mm (float32 out): relative error {err:.2e}")
    print(f"{'call':<40} {'host us':>8} {'device us':>10}")
    for name, fn in rows:
        dev_us = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
        print(f"{name:<40} {host_us(fn):>8.1f} {dev_us:>10.1f}")


if __name__ == "__main__":
    main()
