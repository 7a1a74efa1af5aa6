// The extension's FP8 GEMM (lt_gemm.cpp) and what it shares with linear_node.cpp.
#pragma once

#include <cstdint>
#include <tuple>
#include <vector>

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

// (a * its 1 x 128 scales) @ (b * its 128 x 128 tile or 1 x 128 scales) [+ bias] through
// cuBLASLt's block scaling (cuBLAS >= 12.9, Hopper), the algorithm cached as scaled_mm's: a (M,
// K) row-major e4m3 with M a multiple of 4, a_scale (M, Kb) with strides (1, M); b (K, N)
// column-major e4m3; b_tiles: b_scale (round_up(Kb, 4), Nb) with strides (1, rows), else
// (N, Kb) with strides (1, N) (Kb = ceil(K / 128), Nb = ceil(N / 128)). These are the scale
// inverses (dequantizing factors). Always FP32 promotion. Errors name what does not fit,
// including a problem cuBLASLt has no algorithm for; the set_lt_gemm switch does not apply.
at::Tensor block_scaled_mm(const at::Tensor& a, const at::Tensor& a_scale, const at::Tensor& b,
                           const at::Tensor& b_scale, bool b_tiles, c10::ScalarType out_dtype,
                           const at::Tensor& bias = at::Tensor());

// The cuBLASLt path on or off for the process (off: every call is at::_scaled_mm's).
void set_lt_gemm(bool on);
// Whether block_scaled_mm's calls from now on run each problem's tuned algorithm, timing the
// heuristic's answers on a problem's first such call (on by default), or the heuristic's first
// answer, torch's (off); and the problems tuned so far: (M, N, K, answers timed, the pick's
// index, the first answer's and the pick's fastest run in us).
void set_block_gemm_tuning(bool on);
std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, double, double>> block_gemm_tunings();
// Whether libcublasLt was found (the path can run at all), and its version (0 if not found).
int64_t lt_version();
// Calls so far through cuBLASLt and through at::_scaled_mm, and algorithms cached (all threads).
std::tuple<int64_t, int64_t, int64_t> lt_counts();

}  // namespace fp8train_native
