// Making an autograd node the way this torch holds it: by std::shared_ptr up to torch 2.12,
// by c10::intrusive_ptr from 2.13 on (an Edge's `function`). Use: make_node<T>(kNodePtr).
#pragma once

#include <memory>

#include <torch/csrc/autograd/function.h>

namespace fp8train_native {

using NodePtr = decltype(std::declval<torch::autograd::Edge>().function);
constexpr NodePtr* kNodePtr = nullptr;  // selects the make_node overload of this torch

template <typename T>
std::shared_ptr<T> make_node(std::shared_ptr<torch::autograd::Node>*) {
  return std::make_shared<T>();
}

template <typename T>
c10::intrusive_ptr<T> make_node(c10::intrusive_ptr<torch::autograd::Node>*) {
  return c10::make_intrusive<T>();
}

}  // namespace fp8train_native
