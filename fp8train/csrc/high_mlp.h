// LayerNormMLP's high-precision path as one C++ autograd node (high_mlp.cpp).
#pragma once

#include <torch/csrc/utils/pybind.h>

namespace fp8train_native {

// Adds high_mlp_forward to the extension module.
void register_high_mlp(pybind11::module& m);

}  // namespace fp8train_native
