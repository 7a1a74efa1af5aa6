// fp8train's FP8 GEMM: cuBLASLt called directly, its algorithm cached per problem.
//
// Why: at::_scaled_mm builds its cuBLASLt descriptors on the heap and asks the heuristic for
// an algorithm on every call. Inside the C++ Linear node that cost 17-29 us of host time per
// GEMM (tools/probe_node_stages.py), a third of the node's. Here each problem's descriptors are
// initialised in place once per thread, kept with the heuristic's answer, and a call only sets
// its pointers.
//
// Bytes: the descriptors, the preference (torch's 1 MiB cuBLASLt workspace limit) and the
// one-result heuristic query are at::cuda::blas::scaled_gemm's, so the heuristic picks the
// kernel torch._scaled_mm runs and the outputs are its bytes (tests/gpu/test_lt_gemm_gpu.py).
// A process that changes torch's limit (CUBLASLT_WORKSPACE_SIZE) may see other kernels here.
//
// block_scaled_mm is the same call with cuBLASLt's block scale modes (1 x 128 vectors, 128 x
// 128 tiles: BlockScaling), where torch's F.scaled_mm also asks the heuristic on every call.
// With set_block_gemm_tuning(true) (opt-in: off until the whole GPU suite has run with it
// on), its first call of a problem for which the heuristic offers several algorithms (the
// wgrads: 6-8 on Hopper, fprop and dgrad one) times them on the call's own operands and keeps
// the fastest where it takes under 0.9x the first answer's time, for the process (tune();
// 2026-12-07, H100: h1024's down wgrad 87.2 -> 59.9 us). Off (the default), every call runs
// the heuristic's first answer, torch's.
//
// No CUDA headers on a CPU-only machine: the entry points come from libcublasLt at run time
// (torch has loaded it) and the few types and values used are declared below as cublasLt.h
// and library_types.h define them (the same in CUDA 12 and 13).
#include "lt_gemm.h"
#include "dl.h"
#include "stage_clocks.h"

#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <mutex>
#include <tuple>
#include <vector>

#include <ATen/ops/_scaled_mm.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

namespace fp8train_native {
namespace {

// ------------------------------------------------------------------------ cuBLASLt's C API
using LtStatus = int;    // cublasStatus_t, 0: success
using LtHandle = void*;  // cublasLtHandle_t
struct LtMatmulDesc { uint64_t data[32]; };  // cublasLtMatmulDescOpaque_t
struct LtLayout { uint64_t data[14]; };      // cublasLtMatrixLayoutOpaque_t
struct LtAlgo { uint64_t data[8]; };         // cublasLtMatmulAlgo_t
struct LtHeuristic {                         // cublasLtMatmulHeuristicResult_t
  LtAlgo algo;
  size_t workspace_size;
  LtStatus state;
  float waves;
  int reserved[4];
};
static_assert(sizeof(LtHeuristic) == 96, "cublasLtMatmulHeuristicResult_t is 96 bytes");

constexpr int kComputeF32 = 68;                                        // CUBLAS_COMPUTE_32F
constexpr int kR32F = 0, kR16F = 2, kR16BF = 14, kR8E4M3 = 28, kR8E5M2 = 29;  // cudaDataType_t
constexpr int kOpN = 0, kOpT = 1;                                      // cublasOperation_t
// cublasLtMatmulDescAttributes_t
constexpr int kTransA = 3, kTransB = 4, kEpilogue = 7, kBiasPointer = 8, kAScalePointer = 17,
              kBScalePointer = 18, kFastAccum = 25, kBiasDataType = 26, kAScaleMode = 31, kBScaleMode = 32;
// cublasLtMatmulMatrixScale_t (cuBLAS >= 12.9): what a scale pointer points to
constexpr int kScaleScalar = 0, kScaleVec128 = 4, kScaleBlk128x128 = 5;
constexpr int kEpilogueBias = 4;      // CUBLASLT_EPILOGUE_BIAS
constexpr int kPrefMaxWorkspace = 1;  // CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES
constexpr uint64_t kWorkspaceLimit = 1024 * 1024;  // torch's default (CUBLASLT_WORKSPACE_SIZE unset)
constexpr int kTuneAnswers = 8;         // the heuristic's answers a block problem's tuning times
constexpr int kTuneRuns = 5;            // timed runs of each (the fastest run counts), after one warm-up
constexpr float kTuneMargin = 0.9f;     // another answer is kept only under this fraction of the first's time

struct Lt {
  LtStatus (*create)(LtHandle*);
  LtStatus (*desc_init)(LtMatmulDesc*, size_t, int, int);
  LtStatus (*desc_set)(LtMatmulDesc*, int, const void*, size_t);
  LtStatus (*layout_init)(LtLayout*, size_t, int, uint64_t, uint64_t, int64_t);
  LtStatus (*pref_create)(void**);
  LtStatus (*pref_set)(void*, int, const void*, size_t);
  LtStatus (*pref_destroy)(void*);
  LtStatus (*heuristic)(LtHandle, LtMatmulDesc*, LtLayout*, LtLayout*, LtLayout*, LtLayout*, void*, int,
                        LtHeuristic*, int*);
  LtStatus (*matmul)(LtHandle, LtMatmulDesc*, const void*, const void*, LtLayout*, const void*, LtLayout*,
                     const void*, const void*, LtLayout*, void*, LtLayout*, const LtAlgo*, void*, size_t, CUstream);
  size_t (*version)();
  const char* (*status_name)(LtStatus);
};

// The loaded library, or nullptr where there is none (then every call is at::_scaled_mm's).
const Lt* lt() {
  static const Lt* loaded = []() -> const Lt* {
    void* lib = open_library({"libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"});
    if (lib == nullptr) return nullptr;
    static Lt l;
    bool found = true;
    auto sym = [&](const char* name) {
      void* p = dlsym(lib, name);
      found = found && p != nullptr;
      return p;
    };
    l.create = reinterpret_cast<decltype(l.create)>(sym("cublasLtCreate"));
    l.desc_init = reinterpret_cast<decltype(l.desc_init)>(sym("cublasLtMatmulDescInit_internal"));
    l.desc_set = reinterpret_cast<decltype(l.desc_set)>(sym("cublasLtMatmulDescSetAttribute"));
    l.layout_init = reinterpret_cast<decltype(l.layout_init)>(sym("cublasLtMatrixLayoutInit_internal"));
    l.pref_create = reinterpret_cast<decltype(l.pref_create)>(sym("cublasLtMatmulPreferenceCreate"));
    l.pref_set = reinterpret_cast<decltype(l.pref_set)>(sym("cublasLtMatmulPreferenceSetAttribute"));
    l.pref_destroy = reinterpret_cast<decltype(l.pref_destroy)>(sym("cublasLtMatmulPreferenceDestroy"));
    l.heuristic = reinterpret_cast<decltype(l.heuristic)>(sym("cublasLtMatmulAlgoGetHeuristic"));
    l.matmul = reinterpret_cast<decltype(l.matmul)>(sym("cublasLtMatmul"));
    l.version = reinterpret_cast<decltype(l.version)>(sym("cublasLtGetVersion"));
    l.status_name = reinterpret_cast<decltype(l.status_name)>(sym("cublasLtGetStatusName"));
    return found ? &l : nullptr;
  }();
  return loaded;
}

void lt_check(LtStatus s, const char* what) {
  TORCH_CHECK(s == 0, "fp8train native: ", what, " failed: ", lt()->status_name(s), " (", s, ")");
}

// One handle per device, made on first use and kept for the process.
LtHandle handle(int device) {
  static std::mutex mu;
  static std::vector<LtHandle> handles;
  std::lock_guard<std::mutex> lock(mu);
  if (handles.size() <= static_cast<size_t>(device)) handles.resize(device + 1, nullptr);
  if (handles[device] == nullptr) lt_check(lt()->create(&handles[device]), "cublasLtCreate");
  return handles[device];
}

// ------------------------------------------------------------------------ problems
// cuBLASLt is column-major: the (M, N) row-major output is D (N, M), D = A^T B with A = b
// (column-major (K, N), transposed) and B = a (row-major (M, K) is column-major (K, M)).
struct Problem {
  int device;
  int64_t m, n, k;        // cuBLAS's: m = N, n = M, k = K
  int64_t lda, ldb, ldd;  // b.stride(1), a.stride(0), out.stride(0)
  int type_a, type_b, type_d;
  bool bias, fast;
  int mode_a = kScaleScalar, mode_b = kScaleScalar;  // cuBLAS's A and B scale modes (block scaling)
  bool operator==(const Problem& o) const {
    return device == o.device && m == o.m && n == o.n && k == o.k && lda == o.lda && ldb == o.ldb &&
           ldd == o.ldd && type_a == o.type_a && type_b == o.type_b && type_d == o.type_d && bias == o.bias &&
           fast == o.fast && mode_a == o.mode_a && mode_b == o.mode_b;
  }
};

struct Descs {
  LtMatmulDesc op;
  LtLayout a, b, d;  // C is D's layout (beta = 0: C is never read)
};

// The descriptors at::cuda::blas::scaled_gemm makes for the problem, initialised in place, with
// the first call's pointers (the heuristic does not read them; each call sets its own: point).
void describe(Descs& s, const Problem& p, const void* scale_a, const void* scale_b, const void* bias) {
  const Lt& l = *lt();
  lt_check(l.desc_init(&s.op, sizeof(s.op), kComputeF32, kR32F), "cublasLtMatmulDescInit");
  auto set = [&](int attr, const void* value, size_t size) {
    lt_check(l.desc_set(&s.op, attr, value, size), "cublasLtMatmulDescSetAttribute");
  };
  const int32_t ta = kOpT, tb = kOpN;
  const int8_t fast = p.fast ? 1 : 0;
  set(kTransA, &ta, sizeof(ta));
  set(kTransB, &tb, sizeof(tb));
  set(kAScalePointer, &scale_a, sizeof(scale_a));
  set(kBScalePointer, &scale_b, sizeof(scale_b));
  set(kFastAccum, &fast, sizeof(fast));
  if (p.mode_a != kScaleScalar || p.mode_b != kScaleScalar) {  // unset for tensorwise: torch's descriptor
    const int32_t mode_a = p.mode_a, mode_b = p.mode_b;
    set(kAScaleMode, &mode_a, sizeof(mode_a));
    set(kBScaleMode, &mode_b, sizeof(mode_b));
  }
  if (p.bias) {
    const int32_t epilogue = kEpilogueBias, bias_type = p.type_d;
    set(kBiasPointer, &bias, sizeof(bias));
    set(kEpilogue, &epilogue, sizeof(epilogue));
    set(kBiasDataType, &bias_type, sizeof(bias_type));
  }
  lt_check(l.layout_init(&s.a, sizeof(s.a), p.type_a, p.k, p.m, p.lda), "cublasLtMatrixLayoutInit");  // (K, N)
  lt_check(l.layout_init(&s.b, sizeof(s.b), p.type_b, p.k, p.n, p.ldb), "cublasLtMatrixLayoutInit");  // (K, M)
  lt_check(l.layout_init(&s.d, sizeof(s.d), p.type_d, p.m, p.n, p.ldd), "cublasLtMatrixLayoutInit");  // (N, M)
}

// A call's pointers into the problem's kept descriptor.
void point(Descs& s, bool bias_on, const void* scale_a, const void* scale_b, const void* bias) {
  const Lt& l = *lt();
  lt_check(l.desc_set(&s.op, kAScalePointer, &scale_a, sizeof(scale_a)), "cublasLtMatmulDescSetAttribute");
  lt_check(l.desc_set(&s.op, kBScalePointer, &scale_b, sizeof(scale_b)), "cublasLtMatmulDescSetAttribute");
  if (bias_on) lt_check(l.desc_set(&s.op, kBiasPointer, &bias, sizeof(bias)), "cublasLtMatmulDescSetAttribute");
}

struct Choice {
  Problem problem;
  Descs descs;  // the problem's descriptors, kept: each call only sets its pointers
  bool found;   // false: no algorithm for it (the calls go to at::_scaled_mm)
  LtAlgo algo;       // the tuned pick (the first answer until tuned, and where there is one answer)
  size_t workspace;
  LtHeuristic first;  // the heuristic's first answer: torch's, what runs with tuning off
  std::vector<LtHeuristic> answers;  // a block problem's answers while its tuning is pending, else empty
};

std::atomic<bool> g_on{true}, g_tune{false};  // tuning: opt-in (a pick rests on timings, see native.py)
std::atomic<int64_t> g_lt_calls{0}, g_fallback_calls{0}, g_choices{0};

// A tuned problem's pick, for every thread (the descriptors are per thread, the pick is not:
// a problem met in forward and in backward runs one algorithm).
struct Tuning {
  Problem problem;
  int answers, pick;
  float first_us, pick_us;
};
std::mutex g_tunings_mu;
std::vector<Tuning> g_tunings;

const Tuning* find_tuning(const Problem& p) {  // under g_tunings_mu
  for (const Tuning& t : g_tunings)
    if (t.problem == p) return &t;
  return nullptr;
}

void take(Choice& c, const LtHeuristic& answer) {
  c.algo = answer.algo;
  c.workspace = answer.workspace_size;
}

// The problem's descriptors and the heuristic's first answer: made once per problem and thread
// (a thread's own list, no lock; a training step has a handful of problems). Variable sequence
// lengths make a problem per token count: past kMaxChoices the list starts over rather than
// grow and slow every lookup.
constexpr size_t kMaxChoices = 256;

Choice& choose(const Problem& p, const void* scale_a, const void* scale_b, const void* bias) {
  thread_local std::vector<Choice> choices;
  if (choices.capacity() == 0) choices.reserve(kMaxChoices);  // never moved: cuBLASLt's descriptors stay put
  for (Choice& c : choices)
    if (c.problem == p) return c;
  if (choices.size() >= kMaxChoices) choices.clear();
  Choice& c = choices.emplace_back();
  c.problem = p;
  describe(c.descs, p, scale_a, scale_b, bias);
  const Lt& l = *lt();
  void* pref = nullptr;
  lt_check(l.pref_create(&pref), "cublasLtMatmulPreferenceCreate");
  const uint64_t limit = kWorkspaceLimit;
  LtStatus st = l.pref_set(pref, kPrefMaxWorkspace, &limit, sizeof(limit));
  // per-tensor problems: the heuristic's first answer only, torch's query; block problems
  // (cuBLASLt's block scale modes) with tuning on: up to kTuneAnswers to time
  const bool tunable = p.mode_a != kScaleScalar || p.mode_b != kScaleScalar;
  std::vector<LtHeuristic> results(tunable ? kTuneAnswers : 1);
  int count = 0;
  Descs& s = c.descs;
  if (st == 0)
    st = l.heuristic(handle(p.device), &s.op, &s.a, &s.b, &s.d, &s.d, pref, static_cast<int>(results.size()),
                     results.data(), &count);
  l.pref_destroy(pref);
  c.found = st == 0 && count > 0;
  c.first = results[0];
  take(c, results[0]);
  if (c.found && count > 1) {
    std::lock_guard<std::mutex> lock(g_tunings_mu);
    const Tuning* t = find_tuning(p);
    if (t != nullptr && t->pick < count) {
      take(c, results[t->pick]);
    } else if (t == nullptr) {
      results.resize(count);
      c.answers = std::move(results);
    }
  }
  g_choices += 1;
  return c;
}

// ------------------------------------------------------------------------ tuning
using CUevent = void*;
struct Events {  // the driver's event timing, from libcuda (loaded by torch)
  int (*create)(CUevent*, unsigned);
  int (*record)(CUevent, CUstream);
  int (*synchronize)(CUevent);
  int (*elapsed)(float*, CUevent, CUevent);
  int (*destroy)(CUevent);
  int (*is_capturing)(CUstream, int*);
};

const Events* events() {
  static const Events* loaded = []() -> const Events* {
    void* lib = open_library({"libcuda.so.1"});
    if (lib == nullptr) return nullptr;
    static Events e;
    bool found = true;
    auto sym = [&](const char* name) {
      void* p = dlsym(lib, name);
      found = found && p != nullptr;
      return p;
    };
    e.create = reinterpret_cast<decltype(e.create)>(sym("cuEventCreate"));
    e.record = reinterpret_cast<decltype(e.record)>(sym("cuEventRecord"));
    e.synchronize = reinterpret_cast<decltype(e.synchronize)>(sym("cuEventSynchronize"));
    e.elapsed = reinterpret_cast<decltype(e.elapsed)>(sym("cuEventElapsedTime"));
    e.destroy = reinterpret_cast<decltype(e.destroy)>(sym("cuEventDestroy_v2"));
    e.is_capturing = reinterpret_cast<decltype(e.is_capturing)>(sym("cuStreamIsCapturing"));
    return found ? &e : nullptr;
  }();
  return loaded;
}

// Time each of c's pending answers on the call's operands (`run` launches one on `stream`)
// and keep the fastest where it takes under kTuneMargin of the first's time; the pick is
// recorded for every thread. Not while `stream` is being captured into a CUDA graph (no
// timing there): the first answer then runs, and a later call tunes.
template <typename Run>
void tune(Choice& c, CUstream stream, Run run) {
  const Events* e = events();
  int capturing = 0;
  if (e == nullptr || e->is_capturing(stream, &capturing) != 0 || capturing != 0) return;
  {
    std::lock_guard<std::mutex> lock(g_tunings_mu);
    const Tuning* t = find_tuning(c.problem);
    if (t != nullptr) {  // another thread tuned it meanwhile
      if (t->pick < static_cast<int>(c.answers.size())) take(c, c.answers[t->pick]);
      c.answers.clear();
      return;
    }
  }
  const int n = static_cast<int>(c.answers.size());
  std::vector<float> best(n, std::numeric_limits<float>::infinity());
  CUevent marks[kTuneRuns + 1];
  for (CUevent& m : marks) TORCH_CHECK(e->create(&m, 0) == 0, "fp8train native: cuEventCreate failed");
  for (int i = 0; i < n; ++i) {
    if (!run(c.answers[i])) continue;  // this answer does not run here: never picked
    for (int r = 0; r < kTuneRuns; ++r) {
      e->record(marks[r], stream);
      run(c.answers[i]);
    }
    e->record(marks[kTuneRuns], stream);
    e->synchronize(marks[kTuneRuns]);
    for (int r = 0; r < kTuneRuns; ++r) {
      float ms = 0;
      if (e->elapsed(&ms, marks[r], marks[r + 1]) == 0) best[i] = std::min(best[i], ms);
    }
  }
  for (CUevent m : marks) e->destroy(m);
  int pick = 0;
  for (int i = 1; i < n; ++i)
    if (best[i] < best[pick]) pick = i;
  if (!(best[pick] < kTuneMargin * best[0])) pick = 0;
  {
    std::lock_guard<std::mutex> lock(g_tunings_mu);
    const Tuning* t = find_tuning(c.problem);
    if (t == nullptr)
      g_tunings.push_back({c.problem, n, pick, best[0] * 1e3f, best[pick] * 1e3f});
    else if (t->pick < n)  // another thread's tuning of it finished first: its pick holds
      pick = t->pick;
  }
  take(c, c.answers[pick]);
  c.answers.clear();
}

int lt_type(c10::ScalarType t) {
  switch (t) {
    case at::kFloat8_e4m3fn: return kR8E4M3;
    case at::kFloat8_e5m2: return kR8E5M2;
    case at::kBFloat16: return kR16BF;
    case at::kHalf: return kR16F;
    case at::kFloat: return kR32F;
    default: return -1;
  }
}

// cuBLASLt's heuristic assumes 256-byte aligned operands unless told otherwise (torch's
// scaled_gemm does not tell it): other pointers, e.g. a row block of a chunked operand, go to
// at::_scaled_mm, as they always went.
bool aligned(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 256 == 0; }

bool one_float(const at::Tensor& s, const at::Device& device) {
  return s.scalar_type() == at::kFloat && s.numel() == 1 && s.device() == device;
}

// The operands the cuBLASLt path takes (torch._scaled_mm's tensorwise case); anything else
// goes to at::_scaled_mm, which runs it or says what is wrong.
bool lt_takes(const at::Tensor& a, const at::Tensor& a_si, const at::Tensor& b, const at::Tensor& b_si,
              c10::ScalarType out_dtype, const at::Tensor& bias, const at::Tensor& out) {
  if (!g_on.load(std::memory_order_relaxed) || !a.is_cuda() || a.dim() != 2 || b.dim() != 2 || lt() == nullptr)
    return false;
  const auto device = a.device();
  const int ta = lt_type(a.scalar_type()), tb = lt_type(b.scalar_type()), td = lt_type(out_dtype);
  if (ta != kR8E4M3 && ta != kR8E5M2) return false;
  if ((tb != kR8E4M3 && tb != kR8E5M2) || (ta == kR8E5M2 && tb == kR8E5M2)) return false;
  if (td != kR16BF && td != kR16F && td != kR32F) return false;
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  if (b.size(0) != K || K % 16 != 0 || N % 16 != 0 || M == 0 || b.device() != device) return false;
  if (a.stride(1) != 1 || a.stride(0) < K || b.stride(0) != 1 || b.stride(1) < K) return false;
  if (!one_float(a_si, device) || !one_float(b_si, device) || !aligned(a) || !aligned(b)) return false;
  if (bias.defined() && (bias.scalar_type() != out_dtype || bias.dim() != 1 || bias.numel() != N ||
                         bias.stride(0) != 1 || bias.device() != device || !aligned(bias)))
    return false;
  if (out.defined() && (out.scalar_type() != out_dtype || out.dim() != 2 || out.size(0) != M ||
                        out.size(1) != N || out.stride(1) != 1 || out.device() != device || !aligned(out)))
    return false;
  return true;
}

// a @ b through cuBLASLt into out (allocated here when undefined); false where the heuristic
// has no algorithm for the problem.
bool lt_matmul(const at::Tensor& a, const at::Tensor& a_si, const at::Tensor& b, const at::Tensor& b_si,
               bool fast_accum, c10::ScalarType out_dtype, const at::Tensor& bias, at::Tensor& out,
               int mode_a = kScaleScalar, int mode_b = kScaleScalar) {
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  const int device = a.get_device();
  // A thread whose first CUDA work this is has no current context, and cuBLASLt needs one
  // (the heuristic's first query in such a thread crashed without it)
  FP8_STAGE_START(t_prep);
  ensure_context(device);
  Problem p{device, N, M, K, b.stride(1), a.stride(0), out.defined() ? out.stride(0) : N,
            lt_type(b.scalar_type()), lt_type(a.scalar_type()), lt_type(out_dtype), bias.defined(), fast_accum,
            mode_a, mode_b};
  FP8_STAGE_STOP(kGemmPrep, t_prep);
  FP8_STAGE_START(t_choose);
  // cuBLAS's A is b, so A's scale is b's
  const void* bias_ptr = bias.defined() ? bias.data_ptr() : nullptr;
  Choice& c = choose(p, b_si.data_ptr(), a_si.data_ptr(), bias_ptr);
  FP8_STAGE_STOP(kGemmChoose, t_choose);
  if (!c.found) return false;
  FP8_STAGE_START(t_describe);
  Descs& s = c.descs;
  point(s, p.bias, b_si.data_ptr(), a_si.data_ptr(), bias_ptr);
  FP8_STAGE_STOP(kGemmDescribe, t_describe);
  FP8_STAGE_START(t_handle);
  LtHandle h = handle(device);
  CUstream stream = current_stream(device);
  FP8_STAGE_STOP(kGemmHandle, t_handle);
  FP8_STAGE_START(t_alloc);
  if (!out.defined()) out = at::empty({M, N}, a.options().dtype(out_dtype));
  const float alpha = 1.0f, beta = 0.0f;
  const bool tuned = g_tune.load(std::memory_order_relaxed);
  if (tuned && !c.answers.empty()) {  // a block problem's first call: its answers timed here, into `out`
    size_t most = 0;
    for (const LtHeuristic& r : c.answers) most = std::max(most, r.workspace_size);
    at::Tensor scratch = at::empty({static_cast<int64_t>(most)}, a.options().dtype(at::kByte));
    tune(c, stream, [&](const LtHeuristic& r) {
      return lt()->matmul(h, &s.op, &alpha, b.data_ptr(), &s.a, a.data_ptr(), &s.b, &beta, nullptr, &s.d,
                          out.data_ptr(), &s.d, &r.algo, r.workspace_size > 0 ? scratch.data_ptr() : nullptr,
                          r.workspace_size, stream) == 0;
    });
  }
  const LtAlgo& algo = tuned ? c.algo : c.first.algo;
  const size_t ws = tuned ? c.workspace : c.first.workspace_size;
  at::Tensor workspace;
  if (ws > 0) workspace = at::empty({static_cast<int64_t>(ws)}, a.options().dtype(at::kByte));
  FP8_STAGE_STOP(kGemmAlloc, t_alloc);
  FP8_STAGE_START(t_matmul);
  lt_check(lt()->matmul(h, &s.op, &alpha, b.data_ptr(), &s.a, a.data_ptr(), &s.b, &beta, nullptr, &s.d,
                        out.data_ptr(), &s.d, &algo, ws > 0 ? workspace.data_ptr() : nullptr, ws, stream),
           "cublasLtMatmul");
  FP8_STAGE_STOP(kGemmMatmul, t_matmul);
  return true;
}

}  // namespace

at::Tensor scaled_mm(const at::Tensor& a, const at::Tensor& a_scale_inv, const at::Tensor& b,
                     const at::Tensor& b_scale_inv, bool fast_accum, c10::ScalarType out_dtype,
                     const at::Tensor& bias, const at::Tensor& out) {
  at::Tensor b16 = !bias.defined() || bias.scalar_type() == out_dtype ? bias : bias.to(out_dtype);
  // cuBLASLt fuses a bias only into bf16/fp16 outputs
  const bool fuse = out_dtype == at::kBFloat16 || out_dtype == at::kHalf;
  const at::Tensor fused = fuse ? b16 : at::Tensor();
  at::Tensor result = out;
  if (lt_takes(a, a_scale_inv, b, b_scale_inv, out_dtype, fused, out) &&
      lt_matmul(a, a_scale_inv, b, b_scale_inv, fast_accum, out_dtype, fused, result)) {
    g_lt_calls += 1;
  } else {
    g_fallback_calls += 1;
    std::optional<at::Tensor> fused_arg = fused.defined() ? std::optional<at::Tensor>(fused) : std::nullopt;
    if (out.defined())
      at::_scaled_mm_out(result, a, b, a_scale_inv, b_scale_inv, fused_arg, {}, out_dtype, fast_accum);
    else
      result = at::_scaled_mm(a, b, a_scale_inv, b_scale_inv, fused_arg, {}, out_dtype, fast_accum);
  }
  if (b16.defined() && !fuse) result.add_(b16);
  return result;
}

at::Tensor block_scaled_mm(const at::Tensor& a_in, const at::Tensor& a_scale, const at::Tensor& b_in,
                           const at::Tensor& b_scale, bool b_tiles, c10::ScalarType out_dtype, const at::Tensor& bias) {
  const char* what = "fp8train native block_scaled_mm: ";
  TORCH_CHECK(a_in.dim() == 2 && b_in.dim() == 2 && b_in.device() == a_in.device(), what,
              "a and b must be 2-D tensors on one device");
  TORCH_CHECK(a_in.scalar_type() == at::kFloat8_e4m3fn && b_in.scalar_type() == at::kFloat8_e4m3fn, what,
              "cuBLASLt's block scaling takes e4m3 x e4m3 operands, got ", a_in.scalar_type(), " x ",
              b_in.scalar_type());
  const int64_t M = a_in.size(0), K = a_in.size(1), N = b_in.size(1), kb = (K + 127) / 128;
  TORCH_CHECK(b_in.size(0) == K && a_in.stride(1) == 1 && b_in.stride(0) == 1 && K % 16 == 0 && N % 16 == 0 &&
                  M % 4 == 0,
              what, "a (M, K) row-major and b (K, N) column-major with K and N multiples of 16 and M of 4, got a ",
              a_in.sizes(), " strides ", a_in.strides(), ", b ", b_in.sizes(), " strides ", b_in.strides());
  const int td = lt_type(out_dtype);
  TORCH_CHECK(td == kR16BF || td == kR16F || td == kR32F, what, "out_dtype must be bf16, fp16 or fp32");
  auto laid_out = [&](const at::Tensor& s, int64_t rows, int64_t cols, int64_t s0, int64_t s1) {
    return s.scalar_type() == at::kFloat && s.device() == a_in.device() && s.dim() == 2 && s.size(0) == rows &&
           s.size(1) == cols && (rows == 1 || s.stride(0) == s0) && (cols == 1 || s.stride(1) == s1);
  };
  // a's 1 x 128 scales (M, Kb) M-major; b's 128 x 128 tiles (round_up(Kb, 4), Nb) Kb-major, or its
  // 1 x 128 scales (N, Kb) N-major: the layouts torch's blockwise scaled_mm checks (gemm.py makes them)
  TORCH_CHECK(laid_out(a_scale, M, kb, 1, M), what, "a_scale must be (M, ceil(K / 128)) = (", M, ", ", kb,
              ") float32 with strides (1, M), got ", a_scale.sizes(), " strides ", a_scale.strides());
  const int64_t kb4 = (kb + 3) / 4 * 4, nb = (N + 127) / 128;
  TORCH_CHECK(b_tiles ? laid_out(b_scale, kb4, nb, 1, kb4) : laid_out(b_scale, N, kb, 1, N), what,
              b_tiles ? "b_scale (tiles) must be (round_up(ceil(K / 128), 4), ceil(N / 128)) float32 with strides "
                        "(1, rows)"
                      : "b_scale must be (N, ceil(K / 128)) float32 with strides (1, N)",
              ", got ", b_scale.sizes(), " strides ", b_scale.strides());
  TORCH_CHECK(!bias.defined() || (bias.dim() == 1 && bias.numel() == N), what, "bias must be an (N,) vector");
  TORCH_CHECK(a_in.is_cuda(), what, "the operands must be CUDA tensors");
  TORCH_CHECK(lt() != nullptr, what, "libcublasLt was not found");
  // cuBLASLt's heuristic assumes 256-byte aligned operands: a view that is not is copied (its
  // strides kept), which fresh casts never need
  const at::Tensor a = aligned(a_in) ? a_in : a_in.clone(), b = aligned(b_in) ? b_in : b_in.clone();
  at::Tensor b16 = !bias.defined() || bias.scalar_type() == out_dtype ? bias : bias.to(out_dtype);
  const bool fuse = out_dtype == at::kBFloat16 || out_dtype == at::kHalf;  // cuBLASLt fuses a bias into these only
  if (b16.defined() && fuse && (b16.stride(0) != 1 || !aligned(b16))) b16 = b16.clone(at::MemoryFormat::Contiguous);
  at::Tensor result;
  // cuBLAS's A is b (its scales b's), its B is a
  const bool ran = lt_matmul(a, a_scale, b, b_scale, false, out_dtype, fuse ? b16 : at::Tensor(), result,
                             b_tiles ? kScaleBlk128x128 : kScaleVec128, kScaleVec128);
  TORCH_CHECK(ran, what, "cuBLASLt has no algorithm for M=", M, " N=", N, " K=", K,
              b_tiles ? " (1x128 x 128x128 blocks)" : " (1x128 x 1x128 blocks)");
  g_lt_calls += 1;
  if (b16.defined() && !fuse) result.add_(b16);
  return result;
}

void set_lt_gemm(bool on) { g_on = on; }

void set_block_gemm_tuning(bool on) { g_tune = on; }

std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, double, double>> block_gemm_tunings() {
  std::lock_guard<std::mutex> lock(g_tunings_mu);
  std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, double, double>> out;
  for (const Tuning& t : g_tunings)  // cuBLAS's (m, n) are the output's (N, M)
    out.emplace_back(t.problem.n, t.problem.m, t.problem.k, t.answers, t.pick, t.first_us, t.pick_us);
  return out;
}

int64_t lt_version() { return lt() == nullptr ? 0 : static_cast<int64_t>(lt()->version()); }

std::tuple<int64_t, int64_t, int64_t> lt_counts() {
  return {g_lt_calls.load(), g_fallback_calls.load(), g_choices.load()};
}

}  // namespace fp8train_native

// ------------------------------------------------------------------- the GEMM as an operator
// For code that torch.compile generates (gemm.py): Inductor calls a registered operator from
// its wrapper through the dispatcher, with no Python in between, where torch._scaled_mm would
// ask cuBLASLt's heuristic on every call. Its shape function (the fake) is registered from
// Python (kernels/native.py). CUDA only: the CPU's GEMM is gemm.emulated_scaled_mm.
// needs_fixed_stride_order, not the default exact strides: under those Inductor made a copy of
// a one-element scale_inv computed in the graph for each GEMM reading it (dY's: two per layer
// in backward); padded operand strides (lda > K) are taken by lt_takes.
TORCH_LIBRARY(fp8train_lt, m) {
  m.def("scaled_mm(Tensor a, Tensor a_scale_inv, Tensor b, Tensor b_scale_inv, bool fast_accum, "
        "ScalarType out_dtype, Tensor? bias) -> Tensor",
        {at::Tag::needs_fixed_stride_order});
  // fixed stride order keeps the scales' layouts (M-major, Kb-major) that it checks
  m.def("block_scaled_mm(Tensor a, Tensor a_scale, Tensor b, Tensor b_scale, bool b_tiles, "
        "ScalarType out_dtype, Tensor? bias) -> Tensor",
        {at::Tag::needs_fixed_stride_order});
}

TORCH_LIBRARY_IMPL(fp8train_lt, CUDA, m) {
  m.impl("scaled_mm", [](const at::Tensor& a, const at::Tensor& a_scale_inv, const at::Tensor& b,
                         const at::Tensor& b_scale_inv, bool fast_accum, c10::ScalarType out_dtype,
                         const std::optional<at::Tensor>& bias) {
    return fp8train_native::scaled_mm(a, a_scale_inv, b, b_scale_inv, fast_accum, out_dtype,
                                      bias.value_or(at::Tensor()));
  });
  m.impl("block_scaled_mm", [](const at::Tensor& a, const at::Tensor& a_scale, const at::Tensor& b,
                               const at::Tensor& b_scale, bool b_tiles, c10::ScalarType out_dtype,
                               const std::optional<at::Tensor>& bias) {
    return fp8train_native::block_scaled_mm(a, a_scale, b, b_scale, b_tiles, out_dtype, bias.value_or(at::Tensor()));
  });
}
