// Device helpers and host-side validation shared by the decode-step kernels (kda_decode.cu, kda_spec_decode.cu).
#pragma once

#include <cmath>
#include <string>
#include <utility>

#include <cuda_bf16.h>

#include "kernels/cuda/kda.hpp"
#include "kernels/cuda/launch_status.hpp"

namespace deltaserve::kernels::cuda::detail {

using bf16 = __nv_bfloat16;

constexpr int kD = kKdaHeadDim;
constexpr int kThreads = 512;
constexpr int kRowGroups = kThreads / 32;  // 16 groups of 8 state rows
constexpr float kL2Eps = 1e-6f;

struct DecodeArgs {
  int num_heads;
  int conv_kernel;
  int num_slots;
  const int32_t* slots;
  const bf16* q_in;
  const bf16* k_in;
  const bf16* v_in;
  const bf16* gate_raw;
  const bf16* beta_raw;
  const bf16* out_gate;
  const float* q_conv_weight;
  const float* k_conv_weight;
  const float* v_conv_weight;
  const float* a_log;
  const float* dt_bias;
  int bounded;
  float lower_bound;
  const float* o_norm_weight;
  float rms_eps;
  float* conv_state;
  float* state;
  bf16* out;
};

__device__ __forceinline__ float silu(float x) {
  return x / (1.0f + __expf(-x));
}
__device__ __forceinline__ float sigmoid(float x) {
  return 1.0f / (1.0f + __expf(-x));
}

// Causal depthwise conv of one channel: taps weight[0..K-1] over (tail[0..K-2], x); new tail in `tail`.
__device__ __forceinline__ float conv_step(const float* weight, float (&tail)[3], float x, int kernel) {
  float sum = weight[kernel - 1] * x;
#pragma unroll
  for (int j = 0; j < 3; ++j) {
    if (j < kernel - 1) sum += weight[j] * tail[j];
  }
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    if (j + 1 < kernel - 1) tail[j] = tail[j + 1];
  }
#pragma unroll
  for (int j = 0; j < 3; ++j) {
    if (j == kernel - 2) tail[j] = x;
  }
  return silu(sum);
}

inline bool aligned16(const void* pointer) {
  return (reinterpret_cast<uintptr_t>(pointer) & 15u) == 0;
}

inline Status check_pointer(const void* pointer, const char* name, const char* who) {
  if (pointer == nullptr) return invalid_argument(std::string(who) + ": " + name + " is null");
  if (!aligned16(pointer)) return invalid_argument(std::string(who) + ": " + name + " is not 16-byte aligned");
  return Status::ok();
}

// Everything of KdaDecodeParams that can be checked on the host (no device reads, so capture-safe).
inline Status validate_decode_params(const KdaDecodeParams& p, const char* who) {
  const std::string w(who);
  if (p.batch < 0 || p.batch > 65535) return invalid_argument(w + ": batch must be in [0, 65535]");
  if (p.num_heads <= 0 || p.num_heads > 65535) return invalid_argument(w + ": num_heads must be in [1, 65535]");
  if (p.head_dim != kD) return unimplemented(w + ": head_dim must be 128, got " + std::to_string(p.head_dim));
  if (p.conv_kernel < 1 || p.conv_kernel > 4) {
    return unimplemented(w + ": conv_kernel must be in [1, 4], got " + std::to_string(p.conv_kernel));
  }
  if (p.num_slots <= 0) return invalid_argument(w + ": num_slots must be >= 1");
  if (!(p.rms_eps > 0.0f && std::isfinite(p.rms_eps))) return invalid_argument(w + ": rms_eps must be > 0");
  if (p.lower_bound && !(std::isfinite(*p.lower_bound) && *p.lower_bound < 0.0f)) {
    return invalid_argument(w + ": lower_bound must be finite and < 0");
  }
  if (p.batch == 0) return Status::ok();
  const std::pair<const void*, const char*> pointers[] = {
      {p.slots, "slots"},
      {p.q_in, "q_in"},
      {p.k_in, "k_in"},
      {p.v_in, "v_in"},
      {p.gate_raw, "gate_raw"},
      {p.beta_raw, "beta_raw"},
      {p.out_gate, "out_gate"},
      {p.q_conv_weight, "q_conv_weight"},
      {p.k_conv_weight, "k_conv_weight"},
      {p.v_conv_weight, "v_conv_weight"},
      {p.a_log, "a_log"},
      {p.dt_bias, "dt_bias"},
      {p.o_norm_weight, "o_norm_weight"},
      {p.state, "state"},
      {p.out, "out"},
  };
  for (const auto& [pointer, name] : pointers) DS_RETURN_IF_ERROR(check_pointer(pointer, name, who));
  if (p.conv_kernel > 1) DS_RETURN_IF_ERROR(check_pointer(p.conv_state, "conv_state", who));  // K = 1: no tails
  return Status::ok();
}

inline DecodeArgs make_decode_args(const KdaDecodeParams& p) {
  return DecodeArgs{p.num_heads,
                    p.conv_kernel,
                    p.num_slots,
                    p.slots,
                    p.q_in,
                    p.k_in,
                    p.v_in,
                    p.gate_raw,
                    p.beta_raw,
                    p.out_gate,
                    p.q_conv_weight,
                    p.k_conv_weight,
                    p.v_conv_weight,
                    p.a_log,
                    p.dt_bias,
                    p.lower_bound ? 1 : 0,
                    p.lower_bound.value_or(0.0f),
                    p.o_norm_weight,
                    p.rms_eps,
                    p.conv_state,
                    p.state,
                    p.out};
}

}  // namespace deltaserve::kernels::cuda::detail
