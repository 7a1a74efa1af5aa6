// Stage clocks: a build with -DFP8TRAIN_STAGE_CLOCKS (tools/probe_node_stages.py makes one,
// under another module name) adds each marked stage's host nanoseconds to a per-stage total,
// read back by the module's stage_clocks(); the library's build compiles the marks to nothing.
// Shared by linear_node.cpp (the node's stages) and lt_gemm.cpp (the GEMM's own).
#pragma once

#include <array>
#include <chrono>
#include <cstdint>

namespace fp8train_native {

enum Stage {
  kFwd, kFwdWeightCast, kFwdInput, kFwdInputCast, kFwdGemm, kFwdNode,
  kBwd, kBwdPrep, kBwdCast, kBwdDgrad, kBwdWgrad,
  kCastAlloc, kCastLaunch, kCastDbias,
  kGemmPrep, kGemmChoose, kGemmDescribe, kGemmAlloc, kGemmHandle, kGemmMatmul, kStages
};

#ifdef FP8TRAIN_STAGE_CLOCKS
inline const char* const kStageNames[kStages] = {
    "forward (all)", "forward: weight re-cast launch", "forward: input as rows", "forward: input cast",
    "forward: fprop GEMM", "forward: node and edges",
    "backward (apply, all)", "backward: dY as rows", "backward: dY cast", "backward: dgrad GEMM",
    "backward: wgrad GEMM",
    "cast: allocations", "cast: launches", "cast: dbias column sums",
    "gemm: context, problem", "gemm: cached descriptors, algorithm", "gemm: call's pointers", "gemm: output allocation",
    "gemm: handle lookup", "gemm: cublasLtMatmul"};
inline std::array<int64_t, kStages> g_stage_ns{}, g_stage_calls{};
using StageTime = std::chrono::steady_clock::time_point;
inline StageTime stage_now() { return std::chrono::steady_clock::now(); }
inline void stage_add(Stage s, StageTime t0) {
  g_stage_ns[s] += std::chrono::duration_cast<std::chrono::nanoseconds>(stage_now() - t0).count();
  g_stage_calls[s] += 1;
}
#define FP8_STAGE_START(var) const auto var = stage_now()
#define FP8_STAGE_STOP(stage, var) stage_add(stage, var)
#else
#define FP8_STAGE_START(var) (void)0
#define FP8_STAGE_STOP(stage, var) (void)0
#endif

}  // namespace fp8train_native
