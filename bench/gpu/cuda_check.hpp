// Error checks of the standalone GPU benchmarks (bench/gpu/*_bench.cu): a failed CUDA call or a failed Status prints
// where and why and ends the process with status 1.
#pragma once

#include <cstdio>
#include <cstdlib>

#include <cuda_runtime.h>

#define CHECK_CUDA(expr)                                                                         \
  do {                                                                                           \
    const cudaError_t e_ = (expr);                                                               \
    if (e_ != cudaSuccess) {                                                                     \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e_)); \
      std::exit(1);                                                                              \
    }                                                                                            \
  } while (0)

// expr: a deltaserve::Status (common/status.hpp).
#define CHECK_STATUS(expr)                                                            \
  do {                                                                                \
    const auto s_ = (expr);                                                           \
    if (!s_.is_ok()) {                                                                \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, s_.to_string().c_str()); \
      std::exit(1);                                                                   \
    }                                                                                 \
  } while (0)
