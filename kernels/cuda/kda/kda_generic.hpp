// The KDA recurrence for any head size (the tensor-core kernels of kda.hpp cover d = 128 only).
// Math: shared/spec/model.md §3; CPU reference: cpu::kda_recurrent (kernels/cpu/kda.hpp), the same fp32 math.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "common/status.hpp"

namespace deltaserve::kernels::cuda {

constexpr int kKdaGenericMaxHeadDim = 128;

// The KDA recurrence (cpu::kda_recurrent, exactly the same math, fp32) for any head size d in [1, 128], over a
// varlen batch whose per-head states live in a slot pool [num_slots, H, d, d] fp32 (updated in place). One CTA
// per (sequence, head) walking its tokens in order (state in shared memory). Used by the engine for head sizes
// the tensor-core kernels (d = 128) do not cover, e.g. the tiny test models (d = 32); speed is secondary.
// Asynchronous, no allocation, no host sync (graph-capturable).
struct KdaRecurrentParams {
  int num_seqs = 0;                     // N >= 0
  int64_t num_tokens = 0;               // T = cu_seqlens[N]
  const int32_t* cu_seqlens = nullptr;  // device [N + 1]
  const int32_t* slots = nullptr;       // device [N]; slot < 0 (or >= num_slots) skips the sequence
  int num_heads = 0, head_dim = 0;
  const float* q = nullptr;     // [T, H, d] (q already scaled)
  const float* k = nullptr;     // [T, H, d]
  const float* v = nullptr;     // [T, H, d]
  const float* g = nullptr;     // [T, H, d] log-decay <= 0
  const float* beta = nullptr;  // [T, H] in (0, 1)
  float* state = nullptr;       // [num_slots, H, d_k, d_v]
  int num_slots = 0;
  float* o = nullptr;  // [T, H, d] fp32; rows of skipped sequences are left untouched
};
[[nodiscard]] Status kda_recurrent_varlen(const KdaRecurrentParams& params, cudaStream_t stream);

}  // namespace deltaserve::kernels::cuda
