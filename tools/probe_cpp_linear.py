"""Probe: would a C++ autograd node bring an FP8 Linear's eager host time under 1.5x nn.Linear's?

The eager fp8train.Linear spends its host time in Python around the launches, the launches
themselves and the autograd engine (docs/benchmarks.md: 2.2-3.5x nn.Linear on the GPU
machine; 1.22x on the CPU with every kernel stubbed out, so our Python is not most of it).
This builds (torch.utils.cpp_extension.load_inline, C++ only) a minimal FP8 Linear whose
forward and backward are one C++ autograd Function: per-tensor casts as ATen ops (mul,
clamp, to fp8: three launches per cast where fp8train's fused Triton kernel takes one, so
it launches more than a C++ port of fp8train would), the three GEMMs through at::_scaled_mm
with fp8train's layouts, scales fixed; and the same node with each cast as one launch and the
transposed copies as bare allocations, as many launches as fp8train's fused kernels make
(its values are meaningless: a timing stand-in for a C++ port that launches the Triton
kernels itself). It then times fwd+bwd host time (as
benchmarks/linear.py's host_time: 1024 x 1024 layer, 256 tokens, medians of interleaved
rounds) of nn.Linear, fp8train.Linear (delayed) and this node. No numerics are claimed;
it checks only that the node's output is close to nn.Linear's.

    PYTHONPATH=. python3 tools/probe_cpp_linear.py [--device cuda]
"""
import argparse
import time

import torch
from torch.utils.cpp_extension import load_inline

import fp8train

CPP = r"""
#include <torch/extension.h>

using torch::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

namespace {

// mode 0: a real per-tensor cast in ATen ops (three launches). mode 1: one launch, as
// fp8train's fused cast kernel (which also writes the transposed copy and scale_inv in that
// launch), so its values are meaningless: launch-count stand-ins for timing only.
Tensor cast(const Tensor& t, const Tensor& scale, c10::ScalarType dtype, double fp8_max, int64_t mode) {
  if (mode == 1) return t.to(dtype);
  return (t * scale).clamp(-fp8_max, fp8_max).to(dtype);
}

// The transposed copy (K, M) of a row-major (M, K) fp8 tensor: a copy kernel in mode 0; in
// mode 1 an uninitialised buffer, standing in for the one the fused cast wrote.
Tensor transposed(const Tensor& t, int64_t mode) {
  if (mode == 1) return at::empty({t.size(1), t.size(0)}, t.options());
  return t.t().contiguous();
}

struct Fp8LinearFn : public torch::autograd::Function<Fp8LinearFn> {
  // x (M, K), w (N, K); scales () float32: input, weight, grad-output
  static Tensor forward(AutogradContext* ctx, Tensor x, Tensor w, Tensor sx, Tensor sw, Tensor sg,
                        Tensor sx_inv, Tensor sw_inv, Tensor sg_inv, int64_t mode) {
    auto e4m3 = c10::ScalarType::Float8_e4m3fn;
    Tensor x8 = cast(x, sx, e4m3, 448.0, mode);
    Tensor w8 = cast(w, sw, e4m3, 448.0, mode);
    // fprop: x8 (M, K) row-major @ w8^T, w8 (N, K) row-major is (K, N) column-major
    Tensor y = at::_scaled_mm(x8, w8.t(), sx_inv, sw_inv, {}, {}, x.scalar_type(), true);
    ctx->save_for_backward({x8, w8, sx_inv, sw_inv, sg, sg_inv});
    ctx->saved_data["dtype"] = static_cast<int64_t>(x.scalar_type());
    ctx->saved_data["mode"] = mode;
    return y;
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    auto saved = ctx->get_saved_variables();
    Tensor x8 = saved[0], w8 = saved[1], sx_inv = saved[2], sw_inv = saved[3], sg = saved[4], sg_inv = saved[5];
    auto dtype = static_cast<c10::ScalarType>(ctx->saved_data["dtype"].toInt());
    int64_t mode = ctx->saved_data["mode"].toInt();
    Tensor g8 = cast(grads[0], sg, c10::ScalarType::Float8_e5m2, 57344.0, mode);
    // dgrad: g8 (M, N) row-major @ w8 (N, K), which must be column-major: its transposed copy
    Tensor w8_t = transposed(w8, mode);  // (K, N) row-major = (N, K) column-major
    Tensor dx = at::_scaled_mm(g8, w8_t.t(), sg_inv, sw_inv, {}, {}, dtype, false);
    // wgrad: g8^T (N, M) row-major @ x8 (M, K) column-major: both transposed copies
    Tensor g8_t = transposed(g8, mode);
    Tensor x8_t = transposed(x8, mode);
    Tensor dw = at::_scaled_mm(g8_t, x8_t.t(), sg_inv, sx_inv, {}, {}, dtype, false);
    return {dx, dw, Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

}  // namespace

// scales () float32 (input, weight, grad-output) and their inverses, as fp8train's
// quantizers hold them; mode as for `cast`
Tensor fp8_linear(Tensor x, Tensor w, Tensor sx, Tensor sw, Tensor sg, Tensor sx_inv, Tensor sw_inv,
                  Tensor sg_inv, int64_t mode) {
  return Fp8LinearFn::apply(x, w, sx, sw, sg, sx_inv, sw_inv, sg_inv, mode);
}
"""


def host_us(fns: dict, iters: int = 300, rounds: int = 7, sync=lambda: None) -> dict:
    """Median over rounds of the host time per call; each round times every fn in turn."""
    for fn in fns.values():
        for _ in range(20):
            fn()
    samples = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            sync()
            t = time.perf_counter()
            for _ in range(iters):
                fn()
            samples[name].append((time.perf_counter() - t) / iters * 1e6)
            sync()
    return {name: sorted(v)[len(v) // 2] for name, v in samples.items()}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=256)
    args = p.parse_args()
    dev = torch.device(args.device)
    t0 = time.perf_counter()
    ext = load_inline("fp8train_probe_cpp_linear", cpp_sources=CPP, functions=["fp8_linear"],
                      extra_cflags=["-O2"], verbose=False)
    print(f"built the C++ extension in {time.perf_counter() - t0:.1f} s")

    x = torch.randn(args.tokens, args.dim, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(args.tokens, args.dim, device=dev, dtype=torch.bfloat16)
    ref = torch.nn.Linear(args.dim, args.dim, bias=False, device=dev, dtype=torch.bfloat16)
    ours = fp8train.Linear(args.dim, args.dim, bias=False, params_dtype=torch.bfloat16, device=dev)
    w = ref.weight.detach().clone().requires_grad_(True)
    scales = [torch.tensor(s, device=dev) for s in (64.0, 4096.0, 2.0 ** 16)]
    scales += [s.reciprocal() for s in scales]
    recipe = fp8train.DelayedScaling()

    y_cpp = ext.fp8_linear(x, w, *scales, 0)
    err = ((y_cpp.float() - ref(x).float()).norm() / ref(x).float().norm()).item()
    print(f"C++ node output vs nn.Linear: relative error {err:.3g} (sanity only: fixed scales)")

    def run_ref():
        ref(x).backward(dy)

    def run_ours():
        with fp8train.autocast(recipe=recipe):
            y = ours(x)
        y.backward(dy)

    def run_cpp():
        ext.fp8_linear(x, w, *scales, 0).backward(dy)

    def run_cpp_fused_launches():
        ext.fp8_linear(x, w, *scales, 1).backward(dy)

    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    med = host_us({"nn.Linear bf16": run_ref, "fp8train.Linear delayed": run_ours, "C++ node (ATen casts)": run_cpp,
                   "C++ node (fused launches)": run_cpp_fused_launches}, sync=sync)
    base = med["nn.Linear bf16"]
    print(f"\nhost time per fwd+bwd, {args.dim} x {args.dim}, {args.tokens} tokens, {dev} "
          f"(torch {torch.__version__}; median of 7 interleaved rounds)")
    for name, us in med.items():
        print(f"  {name:<26} {us:8.1f} us {us / base:6.2f}x")


if __name__ == "__main__":
    main()
