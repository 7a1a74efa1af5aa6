// The extension's FP8 GEMM (lt_gemm.cpp) and what it shares with linear_node.cpp.
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

namespace fp8train_native {

using CUstream = void*;

// The current CUDA stream of `device` (linear_node.cpp: c10's device-guard interface).
CUstream current_stream(int device);
// Make the device's primary context current in a thread that has none yet (linear_node.cpp).
void ensure_context(int device);

// (a * a_scale_inv) @ (b * b_scale_inv) [+ bias], torch._scaled_mm's contract: a (M, K)
// row-major, b (K, N) column-major, float32 one-element *inverse* scales, an output of
// out_dtype (bf16, fp16 or fp32). A bias is fused into bf16/fp16 outputs and added after the
// GEMM into fp32 ones. `out`, when defined, is an (M, N) row-major destination (a row block of
// a larger output). Through cuBLASLt with a cached algorithm where the operands allow it,
// else at::_scaled_mm (which also reports bad operands).
at::Tensor scaled_mm(const at::Tensor& a, const at::Tensor& a_scale_inv, const at::Tensor& b,
                     const at::Tensor& b_scale_inv, bool fast_accum, c10::ScalarType out_dtype,
                     const at::Tensor& bias = at::Tensor(), const at::Tensor& out = at::Tensor());

// The cuBLASLt path on or off for the process (off: every call is at::_scaled_mm's).
void set_lt_gemm(bool on);
// Whether libcublasLt was found (the path can run at all), and its version (0 if not found).
int64_t lt_version();
// Calls so far through cuBLASLt and through at::_scaled_mm, and algorithms cached (all threads).
std::tuple<int64_t, int64_t, int64_t> lt_counts();

}  // namespace fp8train_native
