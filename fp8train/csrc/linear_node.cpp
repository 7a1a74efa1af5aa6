// fp8train's Linear as one C++ autograd node: the casts (Triton binaries compiled and loaded
// by Python, launched here through the CUDA driver) and the three FP8 GEMMs (at::_scaled_mm)
// with no Python between them, forward or backward.
//
// Why: an eager FP8 Linear's host time was 2.2-3.5x nn.Linear's, most of it the Python
// autograd Function (the engine's callback into Python, ctx bookkeeping) and the Python
// around each launch (docs/design.md, "Known limits"). The Python `_LinearFn` stays the
// reference: this node must give the same bytes (tests/gpu/test_native_gpu.py).
//
// Built by torch.utils.cpp_extension.load (fp8train/kernels/native.py) without CUDA headers:
// the driver entry points come from libcuda at run time and the current stream from c10's
// device-guard interface, so the file compiles on a CPU-only machine too.
#include <dlfcn.h>

#include <array>
#include <chrono>
#include <tuple>
#include <memory>
#include <vector>

// Per-operator ATen headers and torch's pybind casters only, not <torch/extension.h>: the
// build is in the first call's (and CI's) time.
#include <ATen/core/Tensor.h>
#include <ATen/ops/_scaled_mm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/sum.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/utils/pybind.h>
#include <pybind11/stl.h>

namespace fp8train_native {

using torch::autograd::Node;
using torch::autograd::variable_list;

// ------------------------------------------------------------------------ stage clocks
// A build with -DFP8TRAIN_STAGE_CLOCKS (tools/probe_node_stages.py makes one, under another
// module name) adds each marked stage's host nanoseconds to a per-stage total, read back by
// stage_clocks(); the library's build compiles the marks to nothing.
enum Stage {
  kFwd, kFwdWeightCast, kFwdInput, kFwdInputCast, kFwdGemm, kFwdNode,
  kBwd, kBwdPrep, kBwdCast, kBwdDgrad, kBwdWgrad,
  kCastAlloc, kCastLaunch, kCastDbias, kStages
};
#ifdef FP8TRAIN_STAGE_CLOCKS
const char* const kStageNames[kStages] = {
    "forward (all)", "forward: weight re-cast launch", "forward: input as rows", "forward: input cast",
    "forward: fprop GEMM", "forward: node and edges",
    "backward (apply, all)", "backward: dY as rows", "backward: dY cast", "backward: dgrad GEMM",
    "backward: wgrad GEMM",
    "cast: allocations", "cast: launches", "cast: dbias column sums"};
std::array<int64_t, kStages> g_stage_ns{}, g_stage_calls{};
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

// ------------------------------------------------------------------------ CUDA driver
using CUresult = int;
using CUfunction = void*;
using CUstream = void*;
using CUcontext = void*;
using CUdevice = int;

struct Driver {
  CUresult (*launch)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                     void**, void**);
  CUresult (*ctx_get_current)(CUcontext*);
  CUresult (*ctx_set_current)(CUcontext);
  CUresult (*device_get)(CUdevice*, int);
  CUresult (*primary_ctx_retain)(CUcontext*, CUdevice);
  CUresult (*error_string)(CUresult, const char**);
};

const Driver& driver() {
  static const Driver d = [] {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);  // loaded by torch already
    if (lib == nullptr) lib = dlopen("libcuda.so.1", RTLD_NOW);
    TORCH_CHECK(lib != nullptr, "fp8train native: cannot load libcuda.so.1");
    auto sym = [lib](const char* name) {
      void* p = dlsym(lib, name);
      TORCH_CHECK(p != nullptr, "fp8train native: libcuda.so.1 has no ", name);
      return p;
    };
    Driver d;
    d.launch = reinterpret_cast<decltype(d.launch)>(sym("cuLaunchKernel"));
    d.ctx_get_current = reinterpret_cast<decltype(d.ctx_get_current)>(sym("cuCtxGetCurrent"));
    d.ctx_set_current = reinterpret_cast<decltype(d.ctx_set_current)>(sym("cuCtxSetCurrent"));
    d.device_get = reinterpret_cast<decltype(d.device_get)>(sym("cuDeviceGet"));
    d.primary_ctx_retain = reinterpret_cast<decltype(d.primary_ctx_retain)>(sym("cuDevicePrimaryCtxRetain"));
    d.error_string = reinterpret_cast<decltype(d.error_string)>(sym("cuGetErrorString"));
    return d;
  }();
  return d;
}

void check(CUresult r, const char* what) {
  if (r == 0) return;
  const char* msg = nullptr;
  driver().error_string(r, &msg);
  TORCH_CHECK(false, "fp8train native: ", what, " failed: ", msg ? msg : "unknown CUDA error", " (", r, ")");
}

// The binaries were loaded into the device's primary context (Triton, from Python). A thread
// that has made no CUDA runtime call yet has no current context: make the primary one current.
void ensure_context(int device) {
  CUcontext ctx = nullptr;
  check(driver().ctx_get_current(&ctx), "cuCtxGetCurrent");
  if (ctx != nullptr) return;
  CUdevice dev = 0;
  check(driver().device_get(&dev, device), "cuDeviceGet");
  check(driver().primary_ctx_retain(&ctx, dev), "cuDevicePrimaryCtxRetain");
  check(driver().ctx_set_current(ctx), "cuCtxSetCurrent");
}

CUstream current_stream(int device) {
  const auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  return impl->getStream(c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device))).native_handle();
}

// ------------------------------------------------------------------------ launches
// One compiled Triton kernel with a fixed grid and arguments. Each kernel parameter has an
// 8-byte slot, read by the driver at the parameter's own size (little-endian: an i32 or an
// f32 sits in the low 4 bytes). A slot is either fixed (a scalar, or the address of a buffer
// the plan keeps alive) or a hole, filled per call with one of the call's pointers.
constexpr size_t kMaxParams = 32;

struct Launch {
  CUfunction function = nullptr;
  unsigned grid = 0, block = 0, shared = 0;
  std::vector<uint64_t> values;
  std::vector<int> holes;  // per slot: -1 fixed, else an index into the call's pointers
};

void run(const Launch& l, const uint64_t* pointers, CUstream stream) {
  std::array<uint64_t, kMaxParams> slots;
  std::array<void*, kMaxParams> params;
  for (size_t i = 0; i < l.values.size(); ++i) {
    slots[i] = l.holes[i] < 0 ? l.values[i] : pointers[l.holes[i]];
    params[i] = &slots[i];
  }
  check(driver().launch(l.function, l.grid, 1, 1, l.block, 1, 1, l.shared, stream, params.data(), nullptr),
        "cuLaunchKernel");
}

// One quantizer's cast of one input shape: what kernels.PreparedCast launches, as data.
// The call's pointers, in hole order: x, data, data_t, scale_inv.
enum Hole { kX = 0, kData = 1, kDataT = 2, kScaleInv = 3, kHoles = 4 };

struct CastPlan {
  int device = 0;
  c10::ScalarType x_dtype = c10::ScalarType::BFloat16;  // the binaries were compiled for it
  c10::ScalarType fp8_dtype = c10::ScalarType::Float8_e4m3fn;
  std::vector<int64_t> data_shape;    // x's 2-D shape (M, N)
  std::vector<int64_t> data_t_shape;  // (N, Mp) of the transposed copy; empty: none
  std::vector<at::Tensor> zero_first;  // scratch zeroed before the launches (current scaling's amax)
  std::vector<Launch> launches;
  at::Tensor partial;                 // (row tiles, N) float32 dbias partial sums, or undefined
  std::vector<at::Tensor> keep;       // every fixed buffer the launches point into
};

struct CastOut {
  at::Tensor data, data_t, scale_inv, dbias;
};

// x: contiguous, of the plan's shape and dtype, 16-byte aligned (the binaries were
// specialised on that); the current device is the plan's.
CastOut cast(const CastPlan& p, const at::Tensor& x, CUstream stream) {
  TORCH_CHECK(x.sizes() == c10::IntArrayRef(p.data_shape) && x.scalar_type() == p.x_dtype && x.is_contiguous() &&
                  reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0,
              "fp8train native: cast plan for shape ", c10::IntArrayRef(p.data_shape), " got a tensor of shape ",
              x.sizes(), " ", x.scalar_type(), " (contiguous ", x.is_contiguous(), ", plan dtype ", p.x_dtype, ")");
  FP8_STAGE_START(t_alloc);
  auto fp8 = x.options().dtype(p.fp8_dtype);
  CastOut out;
  out.data = at::empty(p.data_shape, fp8);
  if (!p.data_t_shape.empty()) out.data_t = at::empty(p.data_t_shape, fp8);
  out.scale_inv = at::empty({1}, x.options().dtype(at::kFloat));
  FP8_STAGE_STOP(kCastAlloc, t_alloc);
  FP8_STAGE_START(t_launch);
  uint64_t pointers[kHoles] = {
      reinterpret_cast<uint64_t>(x.data_ptr()), reinterpret_cast<uint64_t>(out.data.data_ptr()),
      out.data_t.defined() ? reinterpret_cast<uint64_t>(out.data_t.data_ptr()) : 0,
      reinterpret_cast<uint64_t>(out.scale_inv.data_ptr())};
  for (const auto& t : p.zero_first) t.zero_();
  ensure_context(p.device);
  for (const auto& l : p.launches) run(l, pointers, stream);
  FP8_STAGE_STOP(kCastLaunch, t_launch);
  FP8_STAGE_START(t_dbias);
  if (p.partial.defined()) out.dbias = at::sum(p.partial, 0);  // as kernels.PreparedCast: float32 column sums
  FP8_STAGE_STOP(kCastDbias, t_dbias);
  return out;
}

// gemm.scaled_mm: (a * a_scale_inv) @ (b * b_scale_inv) [+ bias]; a row-major, b column-major.
at::Tensor scaled_mm(const at::Tensor& a, const at::Tensor& a_scale_inv, const at::Tensor& b,
                     const at::Tensor& b_scale_inv, bool fast_accum, c10::ScalarType out_dtype,
                     const at::Tensor& bias = at::Tensor()) {
  if (!bias.defined()) return at::_scaled_mm(a, b, a_scale_inv, b_scale_inv, {}, {}, out_dtype, fast_accum);
  at::Tensor b16 = bias.scalar_type() == out_dtype ? bias : bias.to(out_dtype);
  // cuBLASLt fuses a bias only into bf16/fp16 outputs
  bool fuse = out_dtype == at::kBFloat16 || out_dtype == at::kHalf;
  at::Tensor out = at::_scaled_mm(a, b, a_scale_inv, b_scale_inv, fuse ? std::optional<at::Tensor>(b16) : std::nullopt,
                                  {}, out_dtype, fast_accum);
  if (!fuse) out.add_(b16);
  return out;
}

// ------------------------------------------------------------------------ the Linear node
// Autograd holds nodes by std::shared_ptr up to torch 2.12 and by c10::intrusive_ptr from
// 2.13 on (an Edge's `function`): make a node the way this torch holds it.
using NodePtr = decltype(std::declval<torch::autograd::Edge>().function);

template <typename T>
std::shared_ptr<T> make_node(std::shared_ptr<Node>*) {
  return std::make_shared<T>();
}

template <typename T>
c10::intrusive_ptr<T> make_node(c10::intrusive_ptr<Node>*) {
  return c10::make_intrusive<T>();
}

struct LinearBackward : public Node {
  std::shared_ptr<CastPlan> grad_plan;  // dY (M, N): transposed copy when dW is needed, dbias when db is
  at::Tensor x_t, x_scale_inv;          // X's transposed copy (K, Mp) and 1/scale, when dW is needed
  at::Tensor w_t, w_scale_inv;          // W's transposed copy (K, N) and 1/scale, when dX is needed
  std::vector<int64_t> in_shape;
  c10::ScalarType act_dtype = at::kBFloat16, weight_dtype = at::kFloat;
  bool need_dgrad = false, need_wgrad = false, need_dbias = false;
  bool fast_dgrad = false, fast_wgrad = false;

  std::string name() const override { return "fp8train::LinearBackward"; }

  void release_variables() override {
    x_t.reset();
    x_scale_inv.reset();
    w_t.reset();
    w_scale_inv.reset();
  }

  variable_list apply(variable_list&& grads) override {
    variable_list out(3);
    at::Tensor dy = grads[0];
    if (!dy.defined()) return out;  // no gradient flowed into Y: all zero
    TORCH_CHECK(grad_plan != nullptr && (!need_wgrad || x_t.defined()) && (!need_dgrad || w_t.defined()),
                "fp8train.Linear: backward through the graph a second time; the saved FP8 tensors were freed "
                "(use retain_graph=True)");
    FP8_STAGE_START(t_all);
    at::AutoDispatchBelowADInplaceOrView guard;
    FP8_STAGE_START(t_prep);
    const int64_t n = dy.size(-1);
    if (dy.dim() != 2) dy = dy.reshape({-1, n});
    if (dy.scalar_type() != act_dtype) dy = dy.to(act_dtype);
    if (!dy.is_contiguous()) dy = dy.contiguous();
    if (reinterpret_cast<uintptr_t>(dy.data_ptr()) % 16 != 0) dy = dy.clone();  // the plan's binary wants 16 B
    FP8_STAGE_STOP(kBwdPrep, t_prep);
    FP8_STAGE_START(t_cast);
    CUstream stream = current_stream(grad_plan->device);
    CastOut g = cast(*grad_plan, dy, stream);
    FP8_STAGE_STOP(kBwdCast, t_cast);
    if (need_dgrad) {
      FP8_STAGE_START(t_dgrad);
      // dX (M, K) = dY (M, N) @ W: W's transposed copy (K, N) row-major, seen column-major
      at::Tensor dx = scaled_mm(g.data, g.scale_inv, w_t.t(), w_scale_inv, fast_dgrad, act_dtype);
      out[0] = in_shape.size() == 2 ? dx : dx.view(in_shape);
      FP8_STAGE_STOP(kBwdDgrad, t_dgrad);
    }
    if (need_wgrad) {
      FP8_STAGE_START(t_wgrad);
      // dW (N, K) = dY^T @ X from the padded transposed copies dY^T (N, Mp) and X^T (K, Mp)
      out[1] = scaled_mm(g.data_t, g.scale_inv, x_t.t(), x_scale_inv, fast_wgrad, weight_dtype);
      FP8_STAGE_STOP(kBwdWgrad, t_wgrad);
    }
    if (need_dbias) out[2] = g.dbias;  // float32; the engine casts it to the bias dtype
    FP8_STAGE_STOP(kBwd, t_all);
    return out;
  }
};

c10::ScalarType float_dtype(int64_t code) {
  switch (code) {
    case 0: return at::kFloat;
    case 1: return at::kBFloat16;
    case 2: return at::kHalf;
    default: TORCH_CHECK(false, "fp8train native: bad dtype code ", code);
  }
}

void launch(const Launch& l, int device, const std::optional<at::Tensor>& x, const std::optional<at::Tensor>& data,
            const std::optional<at::Tensor>& data_t, const std::optional<at::Tensor>& scale_inv);

// The forward of fp8train.Linear's FP8 path (modules/linear.py `_LinearFn.forward`) for a
// plain input tensor. The weight's FP8 workspace (w_data, w_scale_inv, w_t: its transposed
// copy, needed when x requires grad) is re-cast first by `w_cast` (the weight quantizer's
// prepared launch) when given, else it holds what Python cast or kept. The grad plan is used
// only when anything needs a gradient.
at::Tensor linear_forward(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                          const at::Tensor& w_data, const at::Tensor& w_scale_inv, const std::optional<at::Tensor>& w_t,
                          const std::shared_ptr<CastPlan>& x_plan, const std::shared_ptr<CastPlan>& grad_plan,
                          bool fast_fprop, bool fast_dgrad, bool fast_wgrad, int64_t act_code, bool need_wgrad,
                          const Launch* w_cast) {
  FP8_STAGE_START(t_all);
  const c10::ScalarType act_dtype = float_dtype(act_code);
  const at::Tensor b = bias.has_value() ? *bias : at::Tensor();
  const bool grad = torch::autograd::GradMode::is_enabled();
  const bool need_dgrad = grad && x.requires_grad();
  need_wgrad = need_wgrad && grad && weight.requires_grad();
  const bool need_dbias = grad && b.defined() && b.requires_grad();
  TORCH_CHECK(x_plan != nullptr && x_plan->device == x.get_device(), "fp8train native: no cast plan for this input");
  at::Tensor y, x_t, x_scale_inv;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    FP8_STAGE_START(t_wcast);
    if (w_cast != nullptr) launch(*w_cast, x_plan->device, weight, w_data, w_t, w_scale_inv);
    FP8_STAGE_STOP(kFwdWeightCast, t_wcast);
    FP8_STAGE_START(t_rows);
    at::Tensor x2 = x.dim() == 2 ? x : x.reshape({-1, x.size(-1)});
    if (!x2.is_contiguous()) x2 = x2.contiguous();
    if (reinterpret_cast<uintptr_t>(x2.data_ptr()) % 16 != 0) x2 = x2.clone();  // the plan's binary wants 16 B
    FP8_STAGE_STOP(kFwdInput, t_rows);
    FP8_STAGE_START(t_cast);
    CastOut xc = cast(*x_plan, x2, current_stream(x_plan->device));
    FP8_STAGE_STOP(kFwdInputCast, t_cast);
    FP8_STAGE_START(t_gemm);
    y = scaled_mm(xc.data, xc.scale_inv, w_data.t(), w_scale_inv, fast_fprop, act_dtype, b);  // (M, N)
    FP8_STAGE_STOP(kFwdGemm, t_gemm);
    if (x.dim() != 2) {
      std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
      shape.push_back(y.size(1));
      y = y.view(shape);
    }
    x_t = xc.data_t;
    x_scale_inv = xc.scale_inv;
  }
  if (!(need_dgrad || need_wgrad || need_dbias)) return y;
  FP8_STAGE_START(t_node);
  TORCH_CHECK(grad_plan != nullptr, "fp8train native: no grad-output cast plan");
  TORCH_CHECK(!need_wgrad || x_t.defined(), "fp8train native: the input plan wrote no transposed copy");
  TORCH_CHECK(!need_dgrad || w_t.has_value(), "fp8train native: no transposed weight for dgrad");
  auto node = make_node<LinearBackward>(static_cast<NodePtr*>(nullptr));
  node->set_next_edges(torch::autograd::collect_next_edges(x, weight, b));
  node->grad_plan = grad_plan;
  if (need_wgrad) {
    node->x_t = x_t;
    node->x_scale_inv = x_scale_inv;
  }
  if (need_dgrad) {
    node->w_t = *w_t;
    node->w_scale_inv = w_scale_inv;
  }
  node->in_shape.assign(x.sizes().begin(), x.sizes().end());
  node->act_dtype = act_dtype;
  node->weight_dtype = weight.scalar_type();
  node->need_dgrad = need_dgrad;
  node->need_wgrad = need_wgrad;
  node->need_dbias = need_dbias;
  node->fast_dgrad = fast_dgrad;
  node->fast_wgrad = fast_wgrad;
  torch::autograd::set_history(y, NodePtr(node));
  FP8_STAGE_STOP(kFwdNode, t_node);
  FP8_STAGE_STOP(kFwd, t_all);
  return y;
}

// One launch with the caller's tensors in its holes (x, data, data_t, scale_inv; None: a null
// pointer), on `device` (made current for the launch if it is not): kernels.PreparedCast and
// the delayed-scaling update launch this way.
void launch(const Launch& l, int device, const std::optional<at::Tensor>& x, const std::optional<at::Tensor>& data,
            const std::optional<at::Tensor>& data_t, const std::optional<at::Tensor>& scale_inv) {
  auto ptr = [](const std::optional<at::Tensor>& t) {
    return t.has_value() ? reinterpret_cast<uint64_t>(t->data_ptr()) : uint64_t{0};
  };
  uint64_t pointers[kHoles] = {ptr(x), ptr(data), ptr(data_t), ptr(scale_inv)};
  for (size_t i = 0; i < l.holes.size(); ++i)
    TORCH_CHECK(l.holes[i] < 0 || pointers[l.holes[i]] != 0, "fp8train native: launch without its tensor ",
                l.holes[i]);
  c10::DeviceGuard guard(c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device)));
  ensure_context(device);  // (free after the first call on a thread)
  run(l, pointers, current_stream(device));
}

// Standalone cast through a plan (tests compare it byte for byte with the Python launch):
// (data, data_t or None, scale_inv, dbias or None).
std::vector<std::optional<at::Tensor>> cast_with(const std::shared_ptr<CastPlan>& plan, const at::Tensor& x) {
  c10::DeviceGuard device(x.device());
  CastOut o = cast(*plan, x, current_stream(plan->device));
  auto opt = [](const at::Tensor& t) { return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt; };
  return {o.data, opt(o.data_t), o.scale_inv, opt(o.dbias)};
}

}  // namespace fp8train_native

namespace py = pybind11;
using namespace fp8train_native;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Launch>(m, "Launch")
      .def(py::init([](uint64_t function, unsigned grid, unsigned block, unsigned shared,
                       std::vector<uint64_t> values, std::vector<int> holes) {
        TORCH_CHECK(values.size() == holes.size() && values.size() <= kMaxParams,
                    "fp8train native: a launch takes at most ", kMaxParams, " parameters, one hole entry each");
        for (int h : holes) TORCH_CHECK(h >= -1 && h < kHoles, "fp8train native: bad hole ", h);
        Launch l;
        l.function = reinterpret_cast<CUfunction>(function);
        l.grid = grid;
        l.block = block;
        l.shared = shared;
        l.values = std::move(values);
        l.holes = std::move(holes);
        return l;
      }));
  py::class_<CastPlan, std::shared_ptr<CastPlan>>(m, "CastPlan")
      .def(py::init([](int device, int64_t x_code, bool e5m2, std::vector<int64_t> data_shape,
                       std::vector<int64_t> data_t_shape,
                       std::vector<at::Tensor> zero_first, std::vector<Launch> launches,
                       std::optional<at::Tensor> partial, std::vector<at::Tensor> keep) {
        auto p = std::make_shared<CastPlan>();
        p->device = device;
        p->x_dtype = float_dtype(x_code);
        p->fp8_dtype = e5m2 ? c10::ScalarType::Float8_e5m2 : c10::ScalarType::Float8_e4m3fn;
        p->data_shape = std::move(data_shape);
        p->data_t_shape = std::move(data_t_shape);
        p->zero_first = std::move(zero_first);
        p->launches = std::move(launches);
        if (partial.has_value()) p->partial = *partial;
        p->keep = std::move(keep);
        return p;
      }));
  m.def("linear_forward", &linear_forward);
#ifdef FP8TRAIN_STAGE_CLOCKS
  m.def("stage_clocks", [] {
    std::vector<std::tuple<std::string, int64_t, int64_t>> out;
    for (int s = 0; s < kStages; ++s) out.emplace_back(kStageNames[s], g_stage_ns[s], g_stage_calls[s]);
    return out;
  });
  m.def("reset_stage_clocks", [] {
    g_stage_ns.fill(0);
    g_stage_calls.fill(0);
  });
#endif
  m.def("cast_with", &cast_with);
  m.def("launch", &launch);
}
