// fp8train's Linear as one C++ autograd node: the casts (Triton binaries compiled and loaded
// by Python, launched here through the CUDA driver) and the three FP8 GEMMs (lt_gemm.cpp)
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

#include <algorithm>
#include <array>
#include <tuple>
#include <memory>
#include <vector>

// Per-operator ATen headers and torch's pybind casters only, not <torch/extension.h>: the
// build is in the first call's (and CI's) time.
#include <ATen/core/Tensor.h>
#include <ATen/ops/_unsafe_view.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/sum.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/csrc/utils/pybind.h>
#include <pybind11/stl.h>

#include "dl.h"
#include "high_mlp.h"
#include "lt_gemm.h"
#include "node_ptr.h"
#include "stage_clocks.h"

namespace fp8train_native {

using torch::autograd::Node;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

// ------------------------------------------------------------------------ CUDA driver
using CUresult = int;
using CUfunction = void*;
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
  CUresult (*memset_d32)(uint64_t, unsigned, size_t, CUstream);
  CUresult (*launch_cooperative)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                 CUstream, void**);
};

const Driver& driver() {
  static const Driver d = [] {
    void* lib = open_library({"libcuda.so.1"});  // loaded by torch already
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
    d.memset_d32 = reinterpret_cast<decltype(d.memset_d32)>(sym("cuMemsetD32Async"));
    d.launch_cooperative = reinterpret_cast<decltype(d.launch_cooperative)>(sym("cuLaunchCooperativeKernel"));
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

// t = 0 on `stream` (t on the current device, whose context is current): a driver memset where
// t is contiguous with a whole number of 4-byte words (the amax scratch), else ATen's zero_.
// Same bytes; the memset skips the dispatcher and an ATen fill launch (~3 us of host each).
void zero(const at::Tensor& t, CUstream stream) {
  const size_t bytes = t.nbytes();
  if (t.is_cuda() && t.is_contiguous() && bytes % 4 == 0 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 4 == 0) {
    if (bytes > 0) check(driver().memset_d32(reinterpret_cast<uint64_t>(t.data_ptr()), 0, bytes / 4, stream),
                         "cuMemsetD32Async");
  } else {
    t.zero_();
  }
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
  int max_hole = -1;       // the largest index in holes: each user checks it against its table
  bool cooperative = false;  // every program resident at once (a kernel with a grid-wide barrier)
};

void run(const Launch& l, const uint64_t* pointers, CUstream stream) {
  std::array<uint64_t, kMaxParams> slots;
  std::array<void*, kMaxParams> params;
  for (size_t i = 0; i < l.values.size(); ++i) {
    slots[i] = l.holes[i] < 0 ? l.values[i] : pointers[l.holes[i]];
    params[i] = &slots[i];
  }
  if (l.cooperative) {
    check(driver().launch_cooperative(l.function, l.grid, 1, 1, l.block, 1, 1, l.shared, stream, params.data()),
          "cuLaunchCooperativeKernel");
    return;
  }
  check(driver().launch(l.function, l.grid, 1, 1, l.block, 1, 1, l.shared, stream, params.data(), nullptr),
        "cuLaunchKernel");
}

// One quantizer's cast of one input shape: what kernels.PreparedCast launches, as data.
// The call's pointers, in hole order: x, data, data_t, scale_inv, scale_inv_t (block scaling:
// the transposed copy's own scales).
enum Hole { kX = 0, kData = 1, kDataT = 2, kScaleInv = 3, kScaleInvT = 4, kHoles = 5 };

struct CastPlan {
  int device = 0;
  c10::ScalarType x_dtype = c10::ScalarType::BFloat16;  // the binaries were compiled for it
  c10::ScalarType fp8_dtype = c10::ScalarType::Float8_e4m3fn;
  std::vector<int64_t> data_shape;    // x's 2-D shape (M, N)
  std::vector<int64_t> data_t_shape;  // (N, Mp) of the transposed copy; empty: none
  std::vector<Launch> launches;
  at::Tensor partial;                 // (row tiles, N) float32 dbias partial sums, or undefined
  std::optional<Launch> dbias_sum;    // with partial: its column sums into the call's dbias (hole 0)
  c10::ScalarType dbias_dtype = at::kFloat;  // the dbias the colsum launch writes (compiled for it)
  std::vector<at::Tensor> keep;       // every fixed buffer the launches point into
  // BlockScaling (1 x 128 blocks, block_quantizer.py): scale_inv (M, Kb) column-major (the
  // block GEMM's layout), scale_inv_t (Mb, K) with the transposed copy; block_dbias: dbias is
  // x's float32 column sums (the Python cast's torch op), in dbias_dtype
  bool block = false, block_dbias = false;
  // block with tiles: a weight's 128 x 128 tiles (block_kernel.weight_tiles_into), only ever
  // re-cast into its workspace (recast): payload, transposed copy (N, Mp), and both tile-scale
  // grids in buffers padded to 4 columns, given as the GEMM's views of them (gemm.tile_scales)
  bool tiles = false;
};

struct CastOut {
  at::Tensor data, data_t, scale_inv, scale_inv_t, dbias;
};

// A cast's outputs that live equally long share one allocation: one caching-allocator call
// where there were up to three (~2.5 us of host each on the GPU machine, tools/
// probe_node_stages.py). Each part is a plain tensor over a slice of the buffer's storage,
// made without the dispatcher; parts start at 256-byte offsets (the cuBLASLt path's operand
// alignment, and the allocator's blocks are 512-byte aligned).
constexpr int64_t kPartAlign = 256;

int64_t part_bytes(c10::IntArrayRef sizes, c10::ScalarType dtype) {
  int64_t n = static_cast<int64_t>(c10::elementSize(dtype));
  for (int64_t s : sizes) n *= s;
  return (n + kPartAlign - 1) / kPartAlign * kPartAlign;
}

at::Tensor part(const at::Tensor& buf, int64_t offset, c10::ScalarType dtype, c10::IntArrayRef sizes) {
  at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(buf.storage()),
                                                          c10::DispatchKeySet(c10::DispatchKey::CUDA),
                                                          c10::scalarTypeToTypeMeta(dtype));
  t.unsafeGetTensorImpl()->set_sizes_contiguous(sizes);
  t.unsafeGetTensorImpl()->set_storage_offset(offset / static_cast<int64_t>(c10::elementSize(dtype)));
  return t;
}

struct PartSpec {
  c10::ScalarType dtype;
  std::vector<int64_t> sizes;
  bool wanted = true;
};

// One allocation on `like`'s device holding each wanted part, in order, at 256-byte offsets;
// the parts not wanted come back undefined.
std::vector<at::Tensor> one_allocation(const at::TensorOptions& like, std::initializer_list<PartSpec> specs) {
  int64_t total = 0;
  for (const PartSpec& s : specs)
    if (s.wanted) total += part_bytes(s.sizes, s.dtype);
  at::Tensor buf = at::empty({total}, like.dtype(at::kByte));
  std::vector<at::Tensor> out;
  int64_t offset = 0;
  for (const PartSpec& s : specs) {
    if (!s.wanted) {
      out.emplace_back();
      continue;
    }
    out.push_back(part(buf, offset, s.dtype, s.sizes));
    offset += part_bytes(s.sizes, s.dtype);
  }
  return out;
}

// How a cast's outputs are allocated. kSaved: scale_inv shares the transposed copy's buffer
// (or the payload's, without one): a forward input cast, whose payload is dropped after the
// fprop GEMM while its transposed copy is saved for wgrad. kTogether: payload, transposed copy
// and scale_inv in one buffer: a grad-output cast, all used and dropped in the same backward.
enum class Outputs { kSaved, kTogether };

// x: contiguous, of the plan's shape and dtype, 16-byte aligned (the binaries were
// specialised on that); the current device is the plan's.
CastOut block_cast(const CastPlan& p, const at::Tensor& x, CUstream stream, Outputs outputs);

CastOut cast(const CastPlan& p, const at::Tensor& x, CUstream stream, Outputs outputs = Outputs::kSaved) {
  TORCH_CHECK(x.sizes() == c10::IntArrayRef(p.data_shape) && x.scalar_type() == p.x_dtype && x.is_contiguous() &&
                  reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0,
              "fp8train native: cast plan for shape ", c10::IntArrayRef(p.data_shape), " got a tensor of shape ",
              x.sizes(), " ", x.scalar_type(), " (contiguous ", x.is_contiguous(), ", plan dtype ", p.x_dtype, ")");
  if (p.block) return block_cast(p, x, stream, outputs);
  FP8_STAGE_START(t_alloc);
  CastOut out;
  const bool transposed = !p.data_t_shape.empty();
  if (outputs == Outputs::kTogether || !transposed) {
    auto parts = one_allocation(x.options(), {{at::kFloat, {1}}, {p.fp8_dtype, p.data_shape},
                                              {p.fp8_dtype, p.data_t_shape, transposed}});
    out.scale_inv = parts[0], out.data = parts[1], out.data_t = parts[2];
  } else {
    out.data = at::empty(p.data_shape, x.options().dtype(p.fp8_dtype));
    auto parts = one_allocation(x.options(), {{at::kFloat, {1}}, {p.fp8_dtype, p.data_t_shape}});
    out.scale_inv = parts[0], out.data_t = parts[1];
  }
  FP8_STAGE_STOP(kCastAlloc, t_alloc);
  FP8_STAGE_START(t_launch);
  uint64_t pointers[kHoles] = {
      reinterpret_cast<uint64_t>(x.data_ptr()), reinterpret_cast<uint64_t>(out.data.data_ptr()),
      out.data_t.defined() ? reinterpret_cast<uint64_t>(out.data_t.data_ptr()) : 0,
      reinterpret_cast<uint64_t>(out.scale_inv.data_ptr())};
  ensure_context(p.device);
  for (const auto& l : p.launches) run(l, pointers, stream);
  FP8_STAGE_STOP(kCastLaunch, t_launch);
  FP8_STAGE_START(t_dbias);
  if (p.partial.defined()) {  // as kernels.PreparedCast: float32 column sums, one colsum launch
    out.dbias = at::empty({p.data_shape[1]}, x.options().dtype(p.dbias_dtype));
    const uint64_t dbias = reinterpret_cast<uint64_t>(out.dbias.data_ptr());
    run(*p.dbias_sum, &dbias, stream);
  }
  FP8_STAGE_STOP(kCastDbias, t_dbias);
  return out;
}

// A block-scaled cast (p.block): payload (M, K) and scale_inv (M, Kb) column-major, with the
// transposed copy (K, Mp) and its scale_inv_t (Mb, K) where the plan writes one; one launch
// (block_kernel.block_cast_both_into's, or the 1 x 128 cast's). Allocated as cast's: kSaved
// keeps the fprop's payload and scales apart from the transposed copy saved for wgrad.
CastOut block_cast(const CastPlan& p, const at::Tensor& x, CUstream stream, Outputs outputs) {
  TORCH_CHECK(!p.tiles, "fp8train native: a weight tile plan only re-casts into a workspace (recast_with)");
  FP8_STAGE_START(t_alloc);
  const int64_t m = p.data_shape[0], k = p.data_shape[1], kb = (k + 127) / 128;
  const bool transposed = !p.data_t_shape.empty();
  const std::vector<int64_t> scales_t_shape = {transposed ? p.data_t_shape[1] / 128 : 0, k};
  CastOut out;
  at::Tensor scales;  // (Kb, M): scale_inv's storage, seen transposed
  if (outputs == Outputs::kTogether || !transposed) {
    auto parts = one_allocation(x.options(), {{at::kFloat, {kb, m}}, {p.fp8_dtype, p.data_shape},
                                              {p.fp8_dtype, p.data_t_shape, transposed},
                                              {at::kFloat, scales_t_shape, transposed}});
    scales = parts[0], out.data = parts[1], out.data_t = parts[2], out.scale_inv_t = parts[3];
  } else {
    auto fprop = one_allocation(x.options(), {{at::kFloat, {kb, m}}, {p.fp8_dtype, p.data_shape}});
    auto saved = one_allocation(x.options(), {{p.fp8_dtype, p.data_t_shape}, {at::kFloat, scales_t_shape}});
    scales = fprop[0], out.data = fprop[1], out.data_t = saved[0], out.scale_inv_t = saved[1];
  }
  out.scale_inv = scales.t();
  FP8_STAGE_STOP(kCastAlloc, t_alloc);
  FP8_STAGE_START(t_launch);
  auto ptr = [](const at::Tensor& t) { return t.defined() ? reinterpret_cast<uint64_t>(t.data_ptr()) : uint64_t{0}; };
  uint64_t pointers[kHoles] = {ptr(x), ptr(out.data), ptr(out.data_t), ptr(scales), ptr(out.scale_inv_t)};
  ensure_context(p.device);
  for (const auto& l : p.launches) run(l, pointers, stream);
  FP8_STAGE_STOP(kCastLaunch, t_launch);
  if (p.block_dbias) {
    out.dbias = at::sum(x, {0}, false, at::kFloat);
    if (p.dbias_dtype != at::kFloat) out.dbias = out.dbias.to(p.dbias_dtype);
  }
  return out;
}

// Why a weight and its workspace do not fit the re-cast plan `p` (below), or nullptr where they
// fit. data_t: the transposed copy, (K, Np) or a view of its first N columns, given exactly
// when the plan writes one. The binaries were specialised on 16-byte aligned pointers.
const char* tile_scales_refusal(const CastPlan& p, const at::Tensor& w, const at::Tensor& scale_inv,
                                const std::optional<at::Tensor>& scale_inv_t);

const char* recast_refusal(const CastPlan& p, const at::Tensor& w, const at::Tensor& data,
                           const std::optional<at::Tensor>& data_t, const at::Tensor& scale_inv,
                           const std::optional<at::Tensor>& scale_inv_t) {
  auto aligned = [](const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; };
  auto on_device = [&p](const at::Tensor& t) { return t.is_cuda() && t.get_device() == p.device; };
  const c10::IntArrayRef shape(p.data_shape);
  if (p.partial.defined() || p.block_dbias) return "the plan computes dbias";
  if (p.block && !p.tiles) return "a plan of 1 x 128 blocks (inputs and gradients; weights re-cast in tiles)";
  if (!on_device(w) || w.sizes() != shape || w.scalar_type() != p.x_dtype)
    return "the weight is not of the plan's shape, dtype and device";
  if (!w.is_contiguous() || !aligned(w)) return "the weight is not contiguous and 16-byte aligned";
  if (!on_device(data) || data.sizes() != shape || data.scalar_type() != p.fp8_dtype || !data.is_contiguous() ||
      !aligned(data))
    return "the payload buffer does not fit the plan";
  if (p.tiles) {
    if (const char* why = tile_scales_refusal(p, w, scale_inv, scale_inv_t)) return why;
  } else if (scale_inv_t.has_value()) {
    return "a scale_inv_t buffer for a per-tensor plan";
  } else if (!on_device(scale_inv) || scale_inv.numel() != 1 || scale_inv.scalar_type() != at::kFloat ||
             !aligned(scale_inv)) {
    return "the scale_inv buffer is not one aligned float32 on the plan's device";
  }
  const bool transposed = !p.data_t_shape.empty();
  if (data_t.has_value() != transposed)
    return transposed ? "no transposed buffer for a plan that writes one" : "a transposed buffer for a plan that writes none";
  if (transposed) {
    const at::Tensor& t = *data_t;
    const int64_t rows = p.data_t_shape[0], pitch = p.data_t_shape[1];
    if (!on_device(t) || t.scalar_type() != p.fp8_dtype || t.dim() != 2 || t.size(0) != rows || t.stride(0) != pitch ||
        t.stride(1) != 1 || !aligned(t) ||
        static_cast<int64_t>(t.storage().nbytes()) < t.storage_offset() + rows * pitch)
      return "the transposed buffer does not have the plan's rows and row pitch";
  }
  return nullptr;
}

// A tile plan's scale buffers as the block GEMM reads them (gemm.tile_scales): W's (Mb, Kb)
// tile scales as a (round_up(Kb, 4), Mb) view with strides (1, round_up(Kb, 4)) of a buffer
// that holds the padding, and with a transposed copy W^T's (Kb, Mb) likewise.
const char* tile_scales_refusal(const CastPlan& p, const at::Tensor& w, const at::Tensor& scale_inv,
                                const std::optional<at::Tensor>& scale_inv_t) {
  auto laid_out = [&p](const at::Tensor& s, int64_t blocks, int64_t cols) {
    const int64_t padded = (blocks + 3) / 4 * 4;
    return s.is_cuda() && s.get_device() == p.device && s.scalar_type() == at::kFloat && s.dim() == 2 &&
           s.size(0) == padded && s.size(1) == cols && s.stride(0) == 1 && s.stride(1) == padded &&
           reinterpret_cast<uintptr_t>(s.data_ptr()) % 16 == 0 &&
           static_cast<int64_t>(s.storage().nbytes()) >= (s.storage_offset() + padded * cols) * 4;
  };
  const int64_t mb = (w.size(0) + 127) / 128, kb = (w.size(1) + 127) / 128;
  if (!laid_out(scale_inv, kb, mb)) return "the tile scales are not the block GEMM's padded view of their buffer";
  if (scale_inv_t.has_value() != !p.data_t_shape.empty())
    return p.data_t_shape.empty() ? "transposed tile scales for a plan that writes no transposed copy"
                                  : "no transposed tile scales for a plan that writes a transposed copy";
  if (scale_inv_t.has_value() && !laid_out(*scale_inv_t, mb, kb))
    return "the transposed tile scales are not the block GEMM's padded view of their buffer";
  return nullptr;
}

// A weight's steady-state re-cast into its FP8 workspace (WeightWorkspace.for_native): the
// weight quantizer's cast plan, as for an input (Quantizer.native_plan), run into the
// workspace's own buffers instead of fresh ones: its scratch zeroed first (current scaling's
// amax), then its launches (current scaling: the amax pass, then the cast).
void recast(const CastPlan& p, const at::Tensor& w, const at::Tensor& data, const std::optional<at::Tensor>& data_t,
            const at::Tensor& scale_inv, const std::optional<at::Tensor>& scale_inv_t) {
  const char* why = recast_refusal(p, w, data, data_t, scale_inv, scale_inv_t);
  TORCH_CHECK(why == nullptr, "fp8train native: a weight re-cast plan for ", c10::IntArrayRef(p.data_shape), " ",
              p.x_dtype, " on cuda:", p.device, " got a weight ", w.sizes(), " ", w.scalar_type(), ": ", why);
  const bool transposed = !p.data_t_shape.empty();
  uint64_t pointers[kHoles] = {
      reinterpret_cast<uint64_t>(w.data_ptr()), reinterpret_cast<uint64_t>(data.data_ptr()),
      transposed ? reinterpret_cast<uint64_t>(data_t->data_ptr()) : 0, reinterpret_cast<uint64_t>(scale_inv.data_ptr()),
      scale_inv_t.has_value() ? reinterpret_cast<uint64_t>(scale_inv_t->data_ptr()) : 0};
  c10::DeviceGuard guard(c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(p.device)));
  ensure_context(p.device);
  CUstream stream = current_stream(p.device);
  for (const auto& l : p.launches) run(l, pointers, stream);
}

// ------------------------------------------------------------------------ the Linear node
struct LinearBackward : public Node {
  std::shared_ptr<CastPlan> grad_plan;  // dY (M, N): transposed copy when dW is needed, dbias when db is
  // X's transposed copy (K, Mp) and 1/scale, when dW is needed: saved as autograd saves, so that
  // saved-tensor hooks see them (activation checkpointing frees them until its recomputation)
  SavedVariable x_t, x_scale_inv;
  at::Tensor w_t, w_scale_inv;          // W's transposed copy (K, N) and 1/scale, when dX is needed (the workspace's)
  // block scaling: x_scale_inv is X^T's (K, Mb) 1 x 128 scales with strides (1, K), w_scale_inv
  // W^T's tiles laid out for block_scaled_mm ((round_up(Nb, 4), Kb), strides (1, rows))
  bool block = false;
  std::vector<int64_t> in_shape;
  c10::ScalarType act_dtype = at::kBFloat16, weight_dtype = at::kFloat;
  bool need_dgrad = false, need_wgrad = false, need_dbias = false;
  bool fast_dgrad = false, fast_wgrad = false;

  std::string name() const override { return "fp8train::LinearBackward"; }

  void release_variables() override {
    x_t.reset_data();
    x_scale_inv.reset_data();
    w_t.reset();
    w_scale_inv.reset();
  }

  variable_list apply(variable_list&& grads) override {
    variable_list out(3);
    at::Tensor dy = grads[0];
    if (!dy.defined()) return out;  // no gradient flowed into Y: all zero
    TORCH_CHECK(grad_plan != nullptr && (!need_dgrad || w_t.defined()),
                "fp8train.Linear: backward through the graph a second time; the saved FP8 tensors were freed "
                "(use retain_graph=True)");
    // unpacked first: a checkpointed forward's recomputation runs here, before this backward's launches
    const at::Tensor xt = need_wgrad ? x_t.unpack() : at::Tensor();
    at::Tensor x_si = need_wgrad ? x_scale_inv.unpack() : at::Tensor();
    // a hook may hand back a copy with other strides (save_on_cpu(pin_memory=True) packs into a
    // contiguous buffer): X^T's 1 x 128 scales go back to the (1, K) strides the GEMM takes
    if (block && x_si.defined() && x_si.size(0) > 1 && x_si.stride(0) != 1) x_si = x_si.t().contiguous().t();
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
    CastOut g = cast(*grad_plan, dy, stream, Outputs::kTogether);
    FP8_STAGE_STOP(kBwdCast, t_cast);
    if (need_dgrad) {
      FP8_STAGE_START(t_dgrad);
      // dX (M, K) = dY (M, N) @ W: W's transposed copy (K, N) row-major, seen column-major
      at::Tensor dx = block ? block_scaled_mm(g.data, g.scale_inv, w_t.t(), w_scale_inv, true, act_dtype)
                            : scaled_mm(g.data, g.scale_inv, w_t.t(), w_scale_inv, fast_dgrad, act_dtype);
      out[0] = in_shape.size() == 2 ? dx : dx.view(in_shape);
      FP8_STAGE_STOP(kBwdDgrad, t_dgrad);
    }
    if (need_wgrad) {
      FP8_STAGE_START(t_wgrad);
      // dW (N, K) = dY^T @ X from the padded transposed copies dY^T (N, Mp) and X^T (K, Mp)
      out[1] = block ? block_scaled_mm(g.data_t, g.scale_inv_t.t(), xt.t(), x_si, false, weight_dtype)
                     : scaled_mm(g.data_t, g.scale_inv, xt.t(), x_si, fast_wgrad, weight_dtype);
      FP8_STAGE_STOP(kBwdWgrad, t_wgrad);
    }
    if (need_dbias) out[2] = g.dbias;  // in the plan's dbias dtype, the bias's: the engine casts nothing
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
// cast plan, see recast) when given, else it holds what Python cast or kept. The grad plan is used
// only when anything needs a gradient. x_data, x_data_t, x_scale_inv: x already cast (sibling
// layers that read one tensor share its cast, Quantizer.cast_shared): x_data (M, K) fp8 and
// its scale_inv, x_data_t (K, Mp) when need_wgrad; then x_plan is not used (may be None).
// Block scaling (the plans' `block`, or a pre-cast x_scale_inv of two dims): the GEMMs are
// block_scaled_mm's, w_scale_inv is W's tile scales laid out for it (gemm.tile_scales) and
// w_t_scale_inv W^T's; a pre-cast x brings x_scale_inv_t, its transposed copy's (Mb, K) scales.
at::Tensor linear_forward(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                          const at::Tensor& w_data, const at::Tensor& w_scale_inv, const std::optional<at::Tensor>& w_t,
                          const std::shared_ptr<CastPlan>& x_plan, const std::shared_ptr<CastPlan>& grad_plan,
                          bool fast_fprop, bool fast_dgrad, bool fast_wgrad, int64_t act_code, bool need_wgrad,
                          const CastPlan* w_cast, const std::optional<at::Tensor>& x_data,
                          const std::optional<at::Tensor>& x_data_t, const std::optional<at::Tensor>& x_scale_inv,
                          const std::optional<at::Tensor>& x_scale_inv_t,
                          const std::optional<at::Tensor>& w_t_scale_inv) {
  FP8_STAGE_START(t_all);
  const c10::ScalarType act_dtype = float_dtype(act_code);
  const at::Tensor b = bias.has_value() ? *bias : at::Tensor();
  const bool grad = torch::autograd::GradMode::is_enabled();
  const bool need_dgrad = grad && x.requires_grad();
  need_wgrad = need_wgrad && grad && weight.requires_grad();
  const bool need_dbias = grad && b.defined() && b.requires_grad();
  const bool pre_cast = x_data.has_value();
  TORCH_CHECK(pre_cast || (x_plan != nullptr && x_plan->device == x.get_device()),
              "fp8train native: no cast plan for this input");
  TORCH_CHECK(!pre_cast || (x_scale_inv.has_value() && x_data->dim() == 2 && x.dim() > 0 &&
                            x_data->size(1) == x.size(-1) && x_data->numel() == x.numel()),
              "fp8train native: the pre-cast input does not fit x (want data (M, K) and its scale_inv)");
  const bool block = pre_cast ? x_scale_inv->dim() == 2 : x_plan->block;
  TORCH_CHECK(grad_plan == nullptr || grad_plan->block == block,
              "fp8train native: the input and grad-output casts must both be block scaled, or neither");
  TORCH_CHECK(!block || !pre_cast || !x_data_t.has_value() || x_scale_inv_t.has_value(),
              "fp8train native: a block-scaled pre-cast input's transposed copy needs its scale_inv_t");
  TORCH_CHECK(w_cast == nullptr || w_cast->tiles == block,
              "fp8train native: a block-scaled layer's weight re-cast plan is a tile plan, and only its");
  at::Tensor y, x_t, x_si;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    FP8_STAGE_START(t_wcast);
    if (w_cast != nullptr) recast(*w_cast, weight, w_data, w_t, w_scale_inv, block ? w_t_scale_inv : std::nullopt);
    FP8_STAGE_STOP(kFwdWeightCast, t_wcast);
    CastOut xc;
    if (pre_cast) {
      xc.data = *x_data;
      xc.scale_inv = *x_scale_inv;
      if (x_data_t.has_value()) xc.data_t = *x_data_t;
      if (x_scale_inv_t.has_value()) xc.scale_inv_t = *x_scale_inv_t;
    } else {
      FP8_STAGE_START(t_rows);
      at::Tensor x2 = x.dim() == 2 ? x : x.reshape({-1, x.size(-1)});
      if (!x2.is_contiguous()) x2 = x2.contiguous();
      if (reinterpret_cast<uintptr_t>(x2.data_ptr()) % 16 != 0) x2 = x2.clone();  // the plan's binary wants 16 B
      FP8_STAGE_STOP(kFwdInput, t_rows);
      FP8_STAGE_START(t_cast);
      xc = cast(*x_plan, x2, current_stream(x_plan->device));
      FP8_STAGE_STOP(kFwdInputCast, t_cast);
    }
    FP8_STAGE_START(t_gemm);
    y = block ? block_scaled_mm(xc.data, xc.scale_inv, w_data.t(), w_scale_inv, true, act_dtype, b)
              : scaled_mm(xc.data, xc.scale_inv, w_data.t(), w_scale_inv, fast_fprop, act_dtype, b);  // (M, N)
    FP8_STAGE_STOP(kFwdGemm, t_gemm);
    if (x.dim() != 2) {
      std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
      shape.push_back(y.size(1));
      y = at::_unsafe_view(y, shape);  // not a view: in-place ops on the output stay legal (modules/base.py)
    }
    x_t = xc.data_t;
    x_si = block ? (xc.scale_inv_t.defined() ? xc.scale_inv_t.t() : at::Tensor()) : xc.scale_inv;
  }
  if (!(need_dgrad || need_wgrad || need_dbias)) return y;
  FP8_STAGE_START(t_node);
  TORCH_CHECK(grad_plan != nullptr, "fp8train native: no grad-output cast plan");
  TORCH_CHECK(!need_wgrad || x_t.defined(), "fp8train native: the input plan wrote no transposed copy");
  TORCH_CHECK(!need_dgrad || w_t.has_value(), "fp8train native: no transposed weight for dgrad");
  auto node = make_node<LinearBackward>(kNodePtr);
  node->set_next_edges(torch::autograd::collect_next_edges(x, weight, b));
  node->grad_plan = grad_plan;
  if (need_wgrad) {
    node->x_t = SavedVariable(x_t, false);
    node->x_scale_inv = SavedVariable(x_si, false);
  }
  if (need_dgrad) {
    TORCH_CHECK(!block || w_t_scale_inv.has_value(), "fp8train native: no scales for the transposed weight's tiles");
    node->w_t = *w_t;
    node->w_scale_inv = block ? *w_t_scale_inv : w_scale_inv;
  }
  node->block = block;
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
  TORCH_CHECK(l.max_hole < kHoles, "fp8train native: a cast launch with hole ", l.max_hole);
  for (size_t i = 0; i < l.holes.size(); ++i)
    TORCH_CHECK(l.holes[i] < 0 || pointers[l.holes[i]] != 0, "fp8train native: launch without its tensor ",
                l.holes[i]);
  c10::DeviceGuard guard(c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device)));
  ensure_context(device);  // (free after the first call on a thread)
  run(l, pointers, current_stream(device));
}

// ------------------------------------------------------------------------ launch groups
// A recorded sequence of launches (kernels/replay.py: e.g. the norm kernel and the byte
// transpose after it) replayed with a new call's tensors. Pointer table: the call's tensors
// in the caller's order (None: a null pointer), then one float32 scratch buffer per
// scratch_shapes entry, allocated here per call (zeroed where the recorded one was). The
// caching allocator may hand a freed scratch to a later allocation as soon as this returns:
// safe, since every use of it is already queued on the current stream.
struct Group {
  int device = 0;
  int64_t holes = 0;
  std::vector<Launch> launches;
  std::vector<std::vector<int64_t>> scratch_shapes;
  std::vector<bool> scratch_zeroed;
  std::vector<bool> aligned;  // per call tensor: the binaries were specialised on a 16-byte aligned address
  std::vector<at::Tensor> keep;  // the fixed buffers the launches point into
};

void run_group(const Group& g, const std::vector<std::optional<at::Tensor>>& tensors) {
  TORCH_CHECK(static_cast<int64_t>(tensors.size()) == g.holes, "fp8train native: a launch group of ", g.holes,
              " tensors got ", tensors.size());
  std::vector<uint64_t> pointers(g.holes + g.scratch_shapes.size(), 0);
  for (int64_t i = 0; i < g.holes; ++i) {
    if (!tensors[i].has_value()) continue;
    const at::Tensor& t = *tensors[i];
    TORCH_CHECK(t.is_cuda() && t.get_device() == g.device, "fp8train native: launch group tensor ", i,
                " is not on cuda:", g.device);
    pointers[i] = reinterpret_cast<uint64_t>(t.data_ptr());
    TORCH_CHECK(!g.aligned[i] || pointers[i] % 16 == 0, "fp8train native: launch group tensor ", i,
                " is not 16-byte aligned, as the recorded one was");
  }
  c10::DeviceGuard guard(c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(g.device)));
  std::vector<at::Tensor> scratch;
  scratch.reserve(g.scratch_shapes.size());
  ensure_context(g.device);
  CUstream stream = current_stream(g.device);
  auto f32 = at::TensorOptions().dtype(at::kFloat).device(at::kCUDA, g.device);
  for (size_t k = 0; k < g.scratch_shapes.size(); ++k) {
    scratch.push_back(at::empty(g.scratch_shapes[k], f32));
    if (g.scratch_zeroed[k]) zero(scratch.back(), stream);
    pointers[g.holes + k] = reinterpret_cast<uint64_t>(scratch.back().data_ptr());
  }
  for (const Launch& l : g.launches) {
    for (size_t i = 0; i < l.holes.size(); ++i)
      TORCH_CHECK(l.holes[i] < 0 || pointers[l.holes[i]] != 0, "fp8train native: a launch group launch without "
                  "its tensor ", l.holes[i]);
    run(l, pointers.data(), stream);
  }
}

// ------------------------------------------------------------------------ the LayerNormMLP node
// modules/layernorm_mlp.py `_LayerNormMLPFn` for one input shape with delayed scaling: the
// norm and activation steps are the launch groups the Python path recorded and used
// (kernels/replay.py), the dY cast is the grad quantizer's cast plan, the GEMMs are
// gemm.scaled_mm's. The groups' tensor orders are the Python calls' (modules/norm.py,
// modules/activation.py):
//   norm forward        x2, weight, bias, mean, rstd, out, out_t, scale_inv, y
//   activation forward  h, out, out_t, scale_inv
//   activation backward da, h, out, out_t, scale_inv, dbias
//   norm backward       dy, x2, weight, mean, rstd, dx, dweight, dbias
// The node must give the Python node's bytes (tests/gpu/test_mlp_node_gpu.py).
struct MlpPlan {
  int device = 0;
  int64_t rows = 0, hidden = 0, act_cols = 0, fc1_cols = 0, padded = 0;  // M, K, F (act out), F1 (fc1 out), Mp
  bool layer = true, grad = true;
  std::array<bool, 7> needs{};  // x, ln weight, ln bias, fc1 weight, fc1 bias, fc2 weight, fc2 bias
  c10::ScalarType act_dtype = at::kBFloat16, x_fp8 = at::kFloat8_e4m3fn, a_fp8 = at::kFloat8_e4m3fn,
                  dh_fp8 = at::kFloat8_e5m2, db1_dtype = at::kFloat;
  bool fast_fprop = true, fast_dgrad = false, fast_wgrad = false;
  std::shared_ptr<Group> norm_fwd, act_fwd, act_bwd, norm_bwd;  // the backward ones: only with grad
  std::shared_ptr<CastPlan> dy_plan;                              // dY (M, K): transposed copy, dbias if fc2's
};

std::optional<at::Tensor> opt(const at::Tensor& t) { return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt; }

at::Tensor rows_of(const at::Tensor& t, int64_t cols) {
  at::Tensor r = t.dim() == 2 ? t : t.reshape({-1, cols});
  if (!r.is_contiguous()) r = r.contiguous();
  if (reinterpret_cast<uintptr_t>(r.data_ptr()) % 16 != 0) r = r.clone();  // the binaries want 16 B
  return r;
}

struct LayerNormMLPBackward : public Node {
  std::shared_ptr<MlpPlan> plan;
  // x2 may be the caller's x and the norm parameters are the module's: saved as the Python
  // Function saves them, so that an in-place change before the backward is an error
  torch::autograd::SavedVariable x2_saved, ln_w_saved, ln_b_saved;
  // the activations, saved alike so that saved-tensor hooks see them (activation checkpointing)
  SavedVariable mean, rstd, x_t, x_si, h, a_t, a_si;
  at::Tensor w1_t, w1_si, w2_t, w2_si;  // the weights' FP8 workspaces
  std::vector<int64_t> in_shape;
  c10::ScalarType w1_dtype = at::kFloat, w2_dtype = at::kFloat;

  std::string name() const override { return "fp8train::LayerNormMLPBackward"; }

  void release_variables() override {
    x2_saved.reset_data();
    ln_w_saved.reset_data();
    ln_b_saved.reset_data();
    for (SavedVariable* v : {&mean, &rstd, &x_t, &x_si, &h, &a_t, &a_si}) v->reset_data();
    for (at::Tensor* t : {&w1_t, &w1_si, &w2_t, &w2_si}) t->reset();
  }

  variable_list apply(variable_list&& grads) override {
    variable_list out(7);
    at::Tensor dy = grads[0];
    if (!dy.defined()) return out;
    TORCH_CHECK(w2_t.defined(), "fp8train.LayerNormMLP: backward through the graph a second time; the saved FP8 "
                "tensors were freed (use retain_graph=True)");
    const MlpPlan& p = *plan;
    // unpacked first: a checkpointed forward's recomputation runs here, before this backward's launches
    const at::Tensor x2 = x2_saved.unpack(), ln_w = ln_w_saved.unpack(), ln_b = ln_b_saved.unpack();
    const at::Tensor mean = this->mean.unpack(), rstd = this->rstd.unpack(), x_t = this->x_t.unpack();
    const at::Tensor x_si = this->x_si.unpack(), h = this->h.unpack(), a_t = this->a_t.unpack();
    const at::Tensor a_si = this->a_si.unpack();
    at::AutoDispatchBelowADInplaceOrView guard;
    if (dy.scalar_type() != p.act_dtype) dy = dy.to(p.act_dtype);
    dy = rows_of(dy, p.hidden);
    CUstream stream = current_stream(p.device);
    CastOut g = cast(*p.dy_plan, dy, stream, Outputs::kTogether);  // (M, K), (K, Mp); db2 in fc2's bias dtype
    at::Tensor da = scaled_mm(g.data, g.scale_inv, w2_t.t(), w2_si, p.fast_dgrad, p.act_dtype);  // (M, F)
    if (p.needs[5]) out[5] = scaled_mm(g.data_t, g.scale_inv, a_t.t(), a_si, p.fast_wgrad, w2_dtype);
    if (p.needs[6]) out[6] = g.dbias;
    // dH's payload, transposed copy and scale_inv are all used and dropped in this backward
    auto dh_parts = one_allocation(da.options(), {{p.dh_fp8, {p.rows, p.fc1_cols}}, {p.dh_fp8, {p.fc1_cols, p.padded}},
                                                  {at::kFloat, {1}}});
    const at::Tensor &dh = dh_parts[0], &dh_t = dh_parts[1], &dh_si = dh_parts[2];
    at::Tensor db1 = p.needs[4] ? at::empty({p.fc1_cols}, da.options().dtype(p.db1_dtype)) : at::Tensor();
    run_group(*p.act_bwd, {da, h, dh, dh_t, dh_si, opt(db1)});
    if (p.needs[3]) out[3] = scaled_mm(dh_t, dh_si, x_t.t(), x_si, p.fast_wgrad, w1_dtype);
    if (p.needs[4]) out[4] = db1;
    if (p.needs[0] || p.needs[1] || p.needs[2]) {
      at::Tensor d_ln = scaled_mm(dh, dh_si, w1_t.t(), w1_si, p.fast_dgrad, p.act_dtype);  // (M, K)
      at::Tensor dx = at::empty_like(x2);
      at::Tensor dlnw = at::empty_like(ln_w);
      at::Tensor dlnb = ln_b.defined() ? at::empty_like(ln_b) : at::Tensor();
      run_group(*p.norm_bwd, {d_ln, x2, ln_w, opt(mean), rstd, dx, dlnw, opt(dlnb)});
      if (p.needs[0]) out[0] = in_shape.size() == 2 ? dx : dx.view(in_shape);
      out[1] = dlnw;
      out[2] = dlnb;
    }
    return out;
  }
};

// The forward; w*_data / w*_si: the FP8 weight workspaces, w*_t their transposed copies (None
// where no dgrad needs them). w*_cast: the weight's re-cast plan into its workspace
// (WeightWorkspace.for_native, see recast), run first; nullptr where the workspace holds what Python cast
// or kept.
at::Tensor mlp_forward(const std::shared_ptr<MlpPlan>& plan, const at::Tensor& x, const at::Tensor& ln_w,
                       const std::optional<at::Tensor>& ln_b, const at::Tensor& w1, const std::optional<at::Tensor>& b1,
                       const at::Tensor& w2, const std::optional<at::Tensor>& b2, const at::Tensor& w1_data,
                       const at::Tensor& w1_si, const std::optional<at::Tensor>& w1_t, const at::Tensor& w2_data,
                       const at::Tensor& w2_si, const std::optional<at::Tensor>& w2_t, const CastPlan* w1_cast,
                       const CastPlan* w2_cast) {
  TORCH_CHECK(plan != nullptr, "fp8train native: mlp_forward without a plan");
  const MlpPlan& p = *plan;
  TORCH_CHECK(x.is_cuda() && x.get_device() == p.device && x.size(-1) == p.hidden && x.numel() == p.rows * p.hidden,
              "fp8train native: LayerNormMLP plan for ", p.rows, " x ", p.hidden, " rows on cuda:", p.device,
              " got ", x.sizes());
  const at::Tensor lnb = ln_b.has_value() ? *ln_b : at::Tensor();
  const at::Tensor bias1 = b1.has_value() ? *b1 : at::Tensor();
  const at::Tensor bias2 = b2.has_value() ? *b2 : at::Tensor();
  at::Tensor x2, mean, rstd, xq, x_t, x_si, h, aq, a_t, a_si, y;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    if (w1_cast != nullptr) recast(*w1_cast, w1, w1_data, w1_t, w1_si, std::nullopt);
    if (w2_cast != nullptr) recast(*w2_cast, w2, w2_data, w2_t, w2_si, std::nullopt);
    x2 = rows_of(x, p.hidden);
    // what the backward keeps in one allocation each (x's and a's scale_inv, transposed
    // copies, the norm's statistics); the payloads, dropped after their GEMM, apart
    auto x_parts = one_allocation(x.options(), {{at::kFloat, {1}}, {at::kFloat, {p.rows}}, {at::kFloat, {p.rows}, p.layer},
                                                {p.x_fp8, {p.hidden, p.padded}, p.grad}});
    x_si = x_parts[0], rstd = x_parts[1], mean = x_parts[2], x_t = x_parts[3];
    xq = at::empty({p.rows, p.hidden}, x.options().dtype(p.x_fp8));
    run_group(*p.norm_fwd, {x2, ln_w, opt(lnb), opt(mean), rstd, xq, opt(x_t), x_si, std::nullopt});
    h = scaled_mm(xq, x_si, w1_data.t(), w1_si, p.fast_fprop, p.act_dtype, bias1);  // (M, F1)
    auto a_parts = one_allocation(x.options(), {{at::kFloat, {1}}, {p.a_fp8, {p.act_cols, p.padded}, p.grad}});
    a_si = a_parts[0], a_t = a_parts[1];
    aq = at::empty({p.rows, p.act_cols}, x.options().dtype(p.a_fp8));
    run_group(*p.act_fwd, {h, aq, opt(a_t), a_si});
    y = scaled_mm(aq, a_si, w2_data.t(), w2_si, p.fast_fprop, p.act_dtype, bias2);  // (M, K)
    if (x.dim() != 2) y = at::_unsafe_view(y, x.sizes());  // not a view (see linear_forward)
  }
  const bool any_need = std::any_of(p.needs.begin(), p.needs.end(), [](bool b) { return b; });
  if (!p.grad || !any_need || !torch::autograd::GradMode::is_enabled()) return y;
  TORCH_CHECK(p.act_bwd && p.dy_plan && (p.norm_bwd || !(p.needs[0] || p.needs[1] || p.needs[2])),
              "fp8train native: a LayerNormMLP plan without its backward");
  TORCH_CHECK(w2_t.has_value() && (w1_t.has_value() || !(p.needs[0] || p.needs[1] || p.needs[2])),
              "fp8train native: no transposed FP8 weight for dgrad");
  auto node = make_node<LayerNormMLPBackward>(kNodePtr);
  node->set_next_edges(torch::autograd::collect_next_edges(x, ln_w, lnb, w1, bias1, w2, bias2));
  node->plan = plan;
  node->x2_saved = torch::autograd::SavedVariable(x2, false);
  node->ln_w_saved = torch::autograd::SavedVariable(ln_w, false);
  if (lnb.defined()) node->ln_b_saved = torch::autograd::SavedVariable(lnb, false);
  node->mean = SavedVariable(mean, false);
  node->rstd = SavedVariable(rstd, false);
  node->x_t = SavedVariable(x_t, false);
  node->x_si = SavedVariable(x_si, false);
  node->h = SavedVariable(h, false);
  node->a_t = SavedVariable(a_t, false);
  node->a_si = SavedVariable(a_si, false);
  if (w1_t.has_value()) node->w1_t = *w1_t;
  node->w1_si = w1_si;
  node->w2_t = *w2_t;
  node->w2_si = w2_si;
  node->in_shape.assign(x.sizes().begin(), x.sizes().end());
  node->w1_dtype = w1.scalar_type();
  node->w2_dtype = w2.scalar_type();
  torch::autograd::set_history(y, NodePtr(node));
  return y;
}

// Standalone cast through a plan (tests compare it byte for byte with the Python launch):
// (data, data_t or None, scale_inv, dbias or None, scale_inv_t or None); together: the grad-output
// cast's one buffer.
std::vector<std::optional<at::Tensor>> cast_with(const std::shared_ptr<CastPlan>& plan, const at::Tensor& x,
                                                 bool together) {
  TORCH_CHECK(plan != nullptr && x.is_cuda() && x.get_device() == plan->device,
              "fp8train native: cast_with needs a plan and a tensor on its device, got ", x.device());
  c10::DeviceGuard device(x.device());
  CastOut o = cast(*plan, x, current_stream(plan->device), together ? Outputs::kTogether : Outputs::kSaved);
  auto opt = [](const at::Tensor& t) { return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt; };
  return {o.data, opt(o.data_t), o.scale_inv, opt(o.dbias), opt(o.scale_inv_t)};
}

}  // namespace fp8train_native

namespace py = pybind11;
using namespace fp8train_native;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_high_mlp(m);
  py::class_<Launch>(m, "Launch")
      .def(py::init([](uint64_t function, unsigned grid, unsigned block, unsigned shared,
                       std::vector<uint64_t> values, std::vector<int> holes, bool cooperative) {
        TORCH_CHECK(values.size() == holes.size() && values.size() <= kMaxParams,
                    "fp8train native: a launch takes at most ", kMaxParams, " parameters, one hole entry each");
        Launch l;
        for (int h : holes) {
          TORCH_CHECK(h >= -1, "fp8train native: bad hole ", h);
          l.max_hole = std::max(l.max_hole, h);
        }
        l.function = reinterpret_cast<CUfunction>(function);
        l.grid = grid;
        l.block = block;
        l.shared = shared;
        l.values = std::move(values);
        l.holes = std::move(holes);
        l.cooperative = cooperative;
        return l;
      }), py::arg("function"), py::arg("grid"), py::arg("block"), py::arg("shared"), py::arg("values"),
          py::arg("holes"), py::arg("cooperative") = false);
  py::class_<CastPlan, std::shared_ptr<CastPlan>>(m, "CastPlan")
      .def(py::init([](int device, int64_t x_code, bool e5m2, std::vector<int64_t> data_shape,
                       std::vector<int64_t> data_t_shape,
                       std::vector<Launch> launches,
                       std::optional<at::Tensor> partial, std::optional<Launch> dbias_sum, int64_t dbias_code,
                       std::vector<at::Tensor> keep, bool block, bool block_dbias, bool tiles) {
        TORCH_CHECK(partial.has_value() == dbias_sum.has_value() && (!dbias_sum || dbias_sum->max_hole == 0),
                    "fp8train native: a cast plan with dbias needs its partial sums and their colsum launch "
                    "(one hole: the call's dbias)");
        auto p = std::make_shared<CastPlan>();
        p->device = device;
        p->x_dtype = float_dtype(x_code);
        p->fp8_dtype = e5m2 ? c10::ScalarType::Float8_e5m2 : c10::ScalarType::Float8_e4m3fn;
        p->data_shape = std::move(data_shape);
        p->data_t_shape = std::move(data_t_shape);
        for (const Launch& l : launches)  // scale_inv_t: a block-scaled cast's own
          TORCH_CHECK(l.max_hole < (block ? kHoles : kScaleInvT), "fp8train native: a cast plan launch with hole ",
                      l.max_hole);
        p->launches = std::move(launches);
        if (partial.has_value()) p->partial = *partial;
        p->dbias_sum = std::move(dbias_sum);
        p->dbias_dtype = float_dtype(dbias_code);
        p->keep = std::move(keep);
        TORCH_CHECK(!block_dbias || (block && !partial.has_value()),
                    "fp8train native: block_dbias is a block-scaled plan's own column sum");
        TORCH_CHECK(!block || (p->launches.size() == 1 &&
                               (p->data_t_shape.empty() || p->data_t_shape[1] % (tiles ? 16 : 128) == 0)),
                    "fp8train native: a block-scaled cast plan is one launch and a transposed "
                    "copy padded to whole blocks (tiles: to 16 rows)");
        TORCH_CHECK(!tiles || (block && !block_dbias), "fp8train native: a tile plan is a block-scaled plan "
                    "without dbias");
        p->block = block;
        p->block_dbias = block_dbias;
        p->tiles = tiles;
        return p;
      }), py::arg("device"), py::arg("x_code"), py::arg("e5m2"), py::arg("data_shape"), py::arg("data_t_shape"),
      py::arg("launches"), py::arg("partial"), py::arg("dbias_sum"), py::arg("dbias_code"),
      py::arg("keep"), py::arg("block") = false, py::arg("block_dbias") = false, py::arg("tiles") = false);
  py::class_<Group, std::shared_ptr<Group>>(m, "Group")
      .def(py::init([](int device, int64_t holes, std::vector<Launch> launches,
                       std::vector<std::vector<int64_t>> scratch_shapes, std::vector<bool> scratch_zeroed,
                       std::vector<bool> aligned, std::vector<at::Tensor> keep) {
        TORCH_CHECK(holes >= 0 && static_cast<int64_t>(aligned.size()) == holes &&
                        scratch_zeroed.size() == scratch_shapes.size(),
                    "fp8train native: a launch group needs one alignment flag per tensor and one zeroing flag per "
                    "scratch buffer");
        const int64_t table = holes + static_cast<int64_t>(scratch_shapes.size());
        for (const Launch& l : launches)
          TORCH_CHECK(l.max_hole < table, "fp8train native: a launch group launch with hole ", l.max_hole,
                      " of a table of ", table);
        auto g = std::make_shared<Group>();
        g->device = device;
        g->holes = holes;
        g->launches = std::move(launches);
        g->scratch_shapes = std::move(scratch_shapes);
        g->scratch_zeroed = std::move(scratch_zeroed);
        g->aligned = std::move(aligned);
        g->keep = std::move(keep);
        return g;
      }));
  m.def("run_group", &run_group);
  py::class_<MlpPlan, std::shared_ptr<MlpPlan>>(m, "MlpPlan")
      .def(py::init([](int device, std::vector<int64_t> dims, bool layer, bool grad, std::vector<bool> needs,
                       std::vector<int64_t> dtype_codes, std::vector<bool> fast, std::shared_ptr<Group> norm_fwd,
                       std::shared_ptr<Group> act_fwd, std::shared_ptr<Group> act_bwd,
                       std::shared_ptr<Group> norm_bwd, std::shared_ptr<CastPlan> dy_plan) {
        TORCH_CHECK(dims.size() == 5 && needs.size() == 7 && dtype_codes.size() == 5 && fast.size() == 3,
                    "fp8train native: MlpPlan(device, [M, K, F, F1, Mp], layer, grad, needs[7], "
                    "[act, x fp8, a fp8, dh fp8, db1] dtype codes, [fprop, dgrad, wgrad] fast accumulation, groups...)");
        TORCH_CHECK(norm_fwd && act_fwd, "fp8train native: MlpPlan needs the forward groups");
        TORCH_CHECK(norm_fwd->holes == 9 && act_fwd->holes == 4 && (!act_bwd || act_bwd->holes == 6) &&
                        (!norm_bwd || norm_bwd->holes == 8),
                    "fp8train native: MlpPlan groups of the wrong kind (tensor counts)");
        auto p = std::make_shared<MlpPlan>();
        p->device = device;
        p->rows = dims[0];
        p->hidden = dims[1];
        p->act_cols = dims[2];
        p->fc1_cols = dims[3];
        p->padded = dims[4];
        p->layer = layer;
        p->grad = grad;
        for (size_t i = 0; i < 7; ++i) p->needs[i] = needs[i];
        auto fp8 = [](int64_t code) { return code == 5 ? at::kFloat8_e5m2 : at::kFloat8_e4m3fn; };
        p->act_dtype = float_dtype(dtype_codes[0]);
        p->x_fp8 = fp8(dtype_codes[1]);
        p->a_fp8 = fp8(dtype_codes[2]);
        p->dh_fp8 = fp8(dtype_codes[3]);
        p->db1_dtype = float_dtype(dtype_codes[4]);
        p->fast_fprop = fast[0];
        p->fast_dgrad = fast[1];
        p->fast_wgrad = fast[2];
        p->norm_fwd = std::move(norm_fwd);
        p->act_fwd = std::move(act_fwd);
        p->act_bwd = std::move(act_bwd);
        p->norm_bwd = std::move(norm_bwd);
        p->dy_plan = std::move(dy_plan);
        return p;
      }));
  m.def("mlp_forward", &mlp_forward);
  m.def("linear_forward", &linear_forward, py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("w_data"),
        py::arg("w_scale_inv"), py::arg("w_t"), py::arg("x_plan"), py::arg("grad_plan"), py::arg("fast_fprop"),
        py::arg("fast_dgrad"), py::arg("fast_wgrad"), py::arg("act_code"), py::arg("need_wgrad"), py::arg("w_cast"),
        py::arg("x_data") = py::none(), py::arg("x_data_t") = py::none(), py::arg("x_scale_inv") = py::none(),
        py::arg("x_scale_inv_t") = py::none(), py::arg("w_t_scale_inv") = py::none());
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
  m.def("cast_with", &cast_with, py::arg("plan"), py::arg("x"), py::arg("together") = false);
  m.def("recast_with", &recast, py::arg("plan"), py::arg("w"), py::arg("data"), py::arg("data_t"),
        py::arg("scale_inv"), py::arg("scale_inv_t") = py::none());
  m.def("recast_refusal", &recast_refusal, py::arg("plan"), py::arg("w"), py::arg("data"), py::arg("data_t"),
        py::arg("scale_inv"), py::arg("scale_inv_t") = py::none());
  m.def("scaled_mm", [](const at::Tensor& a, const at::Tensor& a_scale_inv, const at::Tensor& b,
                        const at::Tensor& b_scale_inv, bool fast_accum, int64_t out_code,
                        std::optional<at::Tensor> bias, std::optional<at::Tensor> out) {
    return scaled_mm(a, a_scale_inv, b, b_scale_inv, fast_accum, float_dtype(out_code), bias.value_or(at::Tensor()),
                     out.value_or(at::Tensor()));
  });
  m.def("block_scaled_mm", [](const at::Tensor& a, const at::Tensor& a_scale, const at::Tensor& b,
                              const at::Tensor& b_scale, bool b_tiles, int64_t out_code,
                              std::optional<at::Tensor> bias) {
    return block_scaled_mm(a, a_scale, b, b_scale, b_tiles, float_dtype(out_code), bias.value_or(at::Tensor()));
  });
  m.def("set_lt_gemm", &set_lt_gemm);
  m.def("set_block_gemm_tuning", &set_block_gemm_tuning);
  m.def("block_gemm_tunings", &block_gemm_tunings);
  m.def("lt_version", &lt_version);
  m.def("lt_counts", &lt_counts);
  m.def("launch", &launch);
}
