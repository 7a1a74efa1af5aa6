// LayerNormMLP's high-precision path (auto precision's "high" choice, dims FP8 cannot take)
// as one C++ autograd node: LayerNorm -> fc1 -> activation -> fc2 in the activation dtype;
// and LayerNormLinear's, the same node stopped after fc1 (activation kNone).
//
// Why: where auto precision keeps a layer out of FP8, the step is small enough to be bound
// by the host, and the torch composition costs a Python call per op forward and an autograd
// node per op backward (NativeLayerNorm, two Addmm, two T, the activation's). Here the
// forward is one call and the backward one node.
//
// The bytes are the torch composition's (tests/test_high_mlp.py, tests/gpu/): the same ATen
// ops with the operands autograd gives them (torch/csrc/autograd/FunctionsManual.cpp):
//   F.linear on 2-D (or contiguous 3-D) rows with a bias is addmm(b, x, W^T), without one mm;
//   mm_mat1_backward: dX = dY.mm(W)          (X row-major)
//   mm_mat2_backward: dW = dY^T.mm(X)        (W^T column-major: grad.t().mm(mat1).t(), then T's .t())
//   the bias's gradient: sum_to(dY, b's shape), as the engine reduces a broadcast input's;
//   gelu_backward(dA, H), threshold_backward(dA, A, 0) for relu (from its result), and for
//   swiglu the chunk / silu / mul nodes' own formulas, joined by split's cat.
#include <array>
#include <tuple>
#include <vector>

#include <ATen/ExpandUtils.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/gelu_backward.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/native_layer_norm.h>
#include <ATen/ops/native_layer_norm_backward.h>
#include <ATen/ops/relu.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/silu_backward.h>
#include <ATen/ops/threshold_backward.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/csrc/utils/pybind.h>

#include "high_mlp.h"
#include "node_ptr.h"

namespace fp8train_native {

using torch::autograd::Node;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

namespace {

// Activation codes (modules/high_mlp_native.py ACTIVATION_CODES).
// kNone: no activation and no fc2 (LayerNormLinear: y = fc1's output).
enum Activation : int64_t { kNone = -1, kGelu = 0, kGeluTanh = 1, kRelu = 2, kSwiglu = 3 };

// F.linear's forward on rows x2: addmm with a bias, mm without
at::Tensor linear(const at::Tensor& x2, const at::Tensor& w, const at::Tensor& b) {
  return b.defined() ? at::addmm(b, x2, w.t()) : at::mm(x2, w.t());
}

// Inputs, in the order of the node's next edges.
enum Input { kX = 0, kLnW, kLnB, kW1, kB1, kW2, kB2, kInputs };

struct HighBackward : public Node {
  // The caller's x (as rows) and the parameters, saved as autograd saves them: an in-place
  // change before the backward is the usual version-counter error
  SavedVariable x2_saved, ln_w_saved, ln_b_saved, w1_saved, w2_saved;
  // the norm's statistics and output, fc1's output, silu(gate), fc2's input: saved alike, so
  // that saved-tensor hooks see them (activation checkpointing)
  SavedVariable mean_saved, rstd_saved, ln_saved, h_saved, s_saved, a_saved;
  std::vector<int64_t> in_shape, b1_shape, b2_shape;
  int64_t activation = kGeluTanh;
  double eps = 1e-5;

  std::string name() const override { return "fp8train::HighBackward"; }

  void release_variables() override {
    for (SavedVariable* v : {&x2_saved, &ln_w_saved, &ln_b_saved, &w1_saved, &w2_saved}) v->reset_data();
    for (SavedVariable* v : {&mean_saved, &rstd_saved, &ln_saved, &h_saved, &s_saved, &a_saved}) v->reset_data();
  }

  variable_list apply(variable_list&& grads) override {
    variable_list out(kInputs);
    at::Tensor dy = grads[0];
    if (!dy.defined()) return out;
    TORCH_CHECK(!torch::autograd::GradMode::is_enabled(),
                "fp8train: double backward (create_graph=True) through the high-precision node (LayerNormMLP, "
                "LayerNormLinear) is not supported; run the layer outside fp8train.autocast for the torch composition");
    // unpack raises torch's "backward through the graph a second time" once they were freed
    const at::Tensor x2 = x2_saved.unpack(), ln_w = ln_w_saved.unpack(), ln_b = ln_b_saved.unpack();
    const at::Tensor w1 = w1_saved.unpack(), w2 = w2_saved.unpack();
    const at::Tensor mean = mean_saved.unpack(), rstd = rstd_saved.unpack(), ln = ln_saved.unpack();
    const at::Tensor h = h_saved.unpack(), s = s_saved.unpack(), a = a_saved.unpack();
    const int64_t hidden = x2.size(1);
    at::Tensor dy2 = dy.dim() == 2 ? dy : dy.reshape({-1, dy.size(-1)});  // ViewBackward's reshape
    if (activation != kNone) {  // fc2
      if (task_should_compute_output(kW2)) out[kW2] = dy2.t().mm(a);
      if (task_should_compute_output(kB2)) out[kB2] = at::sum_to(dy2, b2_shape);
    }
    const std::array<bool, 3> mask = {task_should_compute_output(kX), task_should_compute_output(kLnW),
                                      task_should_compute_output(kLnB)};
    const bool need_w1 = task_should_compute_output(kW1), need_b1 = task_should_compute_output(kB1);
    if (!(need_w1 || need_b1 || mask[0] || mask[1] || mask[2])) return out;
    at::Tensor da = activation == kNone ? at::Tensor() : dy2.mm(w2);  // (M, F)
    // the activation
    at::Tensor dh;
    switch (activation) {
      case kNone: dh = dy2; break;
      case kGelu: dh = at::gelu_backward(da, h, "none"); break;
      case kGeluTanh: dh = at::gelu_backward(da, h, "tanh"); break;
      case kRelu: dh = at::threshold_backward(da, a, 0); break;
      default: {  // swiglu: a = silu(gate) * up, [gate, up] = h.chunk(2, -1)
        auto parts = h.chunk(2, -1);
        at::Tensor d_gate = at::silu_backward(at::mul(da, parts[1]), parts[0]);
        at::Tensor d_up = at::mul(da, s);
        dh = at::cat({d_gate, d_up}, -1);
      }
    }
    // fc1
    if (need_w1) out[kW1] = dh.t().mm(ln);
    if (need_b1) out[kB1] = at::sum_to(dh, b1_shape);
    if (!(mask[0] || mask[1] || mask[2])) return out;
    at::Tensor d_ln = dh.mm(w1);  // (M, K)
    auto norm = at::native_layer_norm_backward(d_ln, x2, {hidden}, mean, rstd, ln_w, ln_b, mask);
    if (mask[0]) out[kX] = in_shape.size() == 2 ? std::get<0>(norm) : std::get<0>(norm).view(in_shape);
    if (mask[1]) out[kLnW] = std::get<1>(norm);
    if (mask[2]) out[kLnB] = std::get<2>(norm);
    return out;
  }
};

// y = fc2(act(fc1(LayerNorm(x)))), or fc1(LayerNorm(x)) for kNone (w2, b2 undefined): x (..., K)
// of 2 or 3 dims in the parameters' dtype, with torch.autocast off (modules/high_node.py
// checks both, and the rest).
at::Tensor high_forward(const at::Tensor& x, const at::Tensor& ln_w, const at::Tensor& lnb, const at::Tensor& w1,
                        const at::Tensor& bias1, const at::Tensor& w2, const at::Tensor& bias2, double eps,
                        int64_t activation) {
  TORCH_CHECK(x.dim() == 2 || x.dim() == 3, "fp8train native: the high-precision node takes 2-D or 3-D input, got ",
              x.dim(), "-D");
  TORCH_CHECK(activation >= kNone && activation <= kSwiglu, "fp8train native: bad activation code ", activation);
  const int64_t hidden = x.size(-1);
  at::Tensor x2, ln, mean, rstd, h, s, a, y;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    x2 = x.dim() == 2 ? x : x.reshape({-1, hidden});
    std::tie(ln, mean, rstd) = at::native_layer_norm(x2, {hidden}, ln_w, lnb, eps);
    h = linear(ln, w1, bias1);
    switch (activation) {
      case kNone: break;
      case kGelu: a = at::gelu(h, "none"); break;
      case kGeluTanh: a = at::gelu(h, "tanh"); break;
      case kRelu: a = at::relu(h); break;
      default: {
        auto parts = h.chunk(2, -1);
        s = at::silu(parts[0]);
        a = at::mul(s, parts[1]);
      }
    }
    y = activation == kNone ? h : linear(a, w2, bias2);
    if (x.dim() != 2) {
      std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
      shape.push_back(y.size(1));
      y = y.view(shape);
    }
  }
  auto needs = [](const at::Tensor& t) { return t.defined() && t.requires_grad(); };
  const bool any_need = needs(x) || needs(ln_w) || needs(lnb) || needs(w1) || needs(bias1) || needs(w2) ||
                        needs(bias2);
  if (!any_need || !torch::autograd::GradMode::is_enabled()) return y;
  auto node = make_node<HighBackward>(kNodePtr);
  node->set_next_edges(torch::autograd::collect_next_edges(x, ln_w, lnb, w1, bias1, w2, bias2));
  node->x2_saved = SavedVariable(x2, false);
  node->ln_w_saved = SavedVariable(ln_w, false);
  if (lnb.defined()) node->ln_b_saved = SavedVariable(lnb, false);
  node->w1_saved = SavedVariable(w1, false);
  if (w2.defined()) node->w2_saved = SavedVariable(w2, false);
  node->mean_saved = SavedVariable(mean, false);
  node->rstd_saved = SavedVariable(rstd, false);
  node->ln_saved = SavedVariable(ln, false);
  node->h_saved = SavedVariable(h, false);
  node->s_saved = SavedVariable(s, false);
  node->a_saved = SavedVariable(a, false);
  node->in_shape.assign(x.sizes().begin(), x.sizes().end());
  if (bias1.defined()) node->b1_shape.assign(bias1.sizes().begin(), bias1.sizes().end());
  if (bias2.defined()) node->b2_shape.assign(bias2.sizes().begin(), bias2.sizes().end());
  node->activation = activation;
  node->eps = eps;
  torch::autograd::set_history(y, NodePtr(node));
  return y;
}

at::Tensor value_or_undefined(const std::optional<at::Tensor>& t) { return t.has_value() ? *t : at::Tensor(); }

at::Tensor high_mlp_forward(const at::Tensor& x, const at::Tensor& ln_w, const std::optional<at::Tensor>& ln_b,
                            const at::Tensor& w1, const std::optional<at::Tensor>& b1, const at::Tensor& w2,
                            const std::optional<at::Tensor>& b2, double eps, int64_t activation) {
  TORCH_CHECK(activation != kNone, "fp8train native: bad activation code ", activation);
  return high_forward(x, ln_w, value_or_undefined(ln_b), w1, value_or_undefined(b1), w2, value_or_undefined(b2), eps,
                      activation);
}

at::Tensor high_ln_linear_forward(const at::Tensor& x, const at::Tensor& ln_w, const std::optional<at::Tensor>& ln_b,
                                  const at::Tensor& w, const std::optional<at::Tensor>& b, double eps) {
  return high_forward(x, ln_w, value_or_undefined(ln_b), w, value_or_undefined(b), at::Tensor(), at::Tensor(), eps,
                      kNone);
}

}  // namespace

void register_high_mlp(pybind11::module& m) {
  m.def("high_mlp_forward", &high_mlp_forward, pybind11::arg("x"), pybind11::arg("ln_weight"),
        pybind11::arg("ln_bias"), pybind11::arg("w1"), pybind11::arg("b1"), pybind11::arg("w2"), pybind11::arg("b2"),
        pybind11::arg("eps"), pybind11::arg("activation"));
  m.def("high_ln_linear_forward", &high_ln_linear_forward, pybind11::arg("x"), pybind11::arg("ln_weight"),
        pybind11::arg("ln_bias"), pybind11::arg("weight"), pybind11::arg("bias"), pybind11::arg("eps"));
}

}  // namespace fp8train_native
