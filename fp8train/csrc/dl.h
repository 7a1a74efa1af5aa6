// Shared libraries the extension calls into without linking them (no CUDA toolkit needed to
// build): libcuda (linear_node.cpp) and libcublasLt (lt_gemm.cpp).
#pragma once

#include <dlfcn.h>

#include <initializer_list>

namespace fp8train_native {

// The first of `names` the process has loaded already (torch's own copy), else the first that
// loads; nullptr if none does.
inline void* open_library(std::initializer_list<const char*> names) {
  for (const char* name : names)
    if (void* lib = dlopen(name, RTLD_NOW | RTLD_NOLOAD)) return lib;
  for (const char* name : names)
    if (void* lib = dlopen(name, RTLD_NOW)) return lib;
  return nullptr;
}

}  // namespace fp8train_native
