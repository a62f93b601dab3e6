// Device-side random initialisation of weights (for shapes whose checkpoints do not exist, e.g. the 48B and K3
// shapes): the distributions of engine/make_model.cpp, drawn from a counter-based generator so every element is
// a pure function of (seed, index). Not bit-identical to make-model's host stream (which is sequential).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "common/status.hpp"

namespace deltaserve::engine::cuda {

enum class RandomLaw {
  kNormal,         // mean + stddev · N(0, 1)
  kLog1p15Uniform  // log(1 + 15 · U[0, 1))  (A_log: decay rates 1..16)
};

// dst[i] for i < n, fp32 or bf16 (as_bf16), from (seed, i). Asynchronous on `stream`.
[[nodiscard]] Status random_fill(void* dst, bool as_bf16, int64_t n, uint64_t seed, RandomLaw law, float mean,
                                 float stddev, cudaStream_t stream);

}  // namespace deltaserve::engine::cuda
