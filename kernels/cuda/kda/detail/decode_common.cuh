// Device helpers and host-side validation shared by the decode-step kernels (decode.cu, spec_decode.cu).
#pragma once

#include <cmath>
#include <string>
#include <utility>

#include <cuda_bf16.h>

#include "kernels/cuda/common/launch_status.hpp"
#include "kernels/cuda/kda/kda.hpp"

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
  const bf16* gate_low;  // fused low-rank gates (KdaDecodeParams::gate_low), or null
  int64_t gate_low_stride;
  const bf16* f_b;
  const bf16* g_b;
  const float* q_conv_weight;
  const float* k_conv_weight;
  const float* v_conv_weight;
  const float* a_log;
  const float* dt_bias;
  int bounded;
  float lower_bound;
  const float* o_norm_weight;
  float rms_eps;
  bf16* conv_state;
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

// Decay e^g of channel `channel` of head h from its raw gate logit: g = -e^{a_log} softplus(gate + dt_bias), or
// lower_bound * sigmoid(e^{a_log} (gate + dt_bias)) when bounded.
// decay_of_values takes the channel's dt_bias and the head's a_log already loaded.
__device__ __forceinline__ float decay_of_values(const DecodeArgs& p, float gate, float dt_bias, float a_log) {
  const float x = gate + dt_bias;
  const float a = __expf(a_log);
  const float g = p.bounded ? p.lower_bound * sigmoid(a * x) : -a * (x > 20.0f ? x : log1pf(__expf(x)));
  return __expf(g);
}
__device__ __forceinline__ float gate_decay_of(const DecodeArgs& p, float gate, int channel, int h) {
  return decay_of_values(p, gate, p.dt_bias[channel], p.a_log[h]);
}
// The same from gate_raw of the row starting at `row`.
__device__ __forceinline__ float gate_decay(const DecodeArgs& p, size_t row, int channel, int h) {
  return gate_decay_of(p, __bfloat162float(p.gate_raw[row + channel]), channel, h);
}

// The rest of the per-(row, head) step for 512 threads = 16 row groups (warps) x 32 column groups of 4, with
// shared partial[kRowGroups][kD] sums (the speculative decode kernels).

// L2-normalises q (and scales it by d^-1/2) and k in x_s[0..1]: warps 0..3 sum q^2, warps 4..7 k^2 into
// sums[0..7]. All threads call it (one block barrier inside); x_s is updated on return without a barrier.
__device__ __forceinline__ void normalize_qk(float (&x_s)[3][kD], float* sums, int warp, int lane, int c) {
  if (warp < 8) {
    const float value = x_s[warp >> 2][c];
    float square = value * value;
    for (int offset = 16; offset > 0; offset >>= 1) square += __shfl_xor_sync(0xffffffffu, square, offset);
    if (lane == 0) sums[warp] = square;
  }
  __syncthreads();
  if (warp < 8) {
    const int base = (warp >> 2) * 4;
    const float total = sums[base] + sums[base + 1] + sums[base + 2] + sums[base + 3];
    const float scale = warp < 4 ? rsqrtf(static_cast<float>(kD)) : 1.0f;
    x_s[warp >> 2][c] *= scale * rsqrtf(total + kL2Eps);
  }
}

// S = Diag(decay) S on this thread's rows 8 rg .. 8 rg + 7 and their partial S^T k (also used by the decode step).
__device__ __forceinline__ float4 decay_rows_partial_sk(float4 (&s)[8], const float* decay, const float* k, int rg) {
  float4 ks = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int r = rg * 8 + i;
    const float d = decay[r], kr = k[r];
    s[i].x *= d;
    s[i].y *= d;
    s[i].z *= d;
    s[i].w *= d;
    ks.x += kr * s[i].x;
    ks.y += kr * s[i].y;
    ks.z += kr * s[i].z;
    ks.w += kr * s[i].w;
  }
  return ks;
}

// u = beta (v - S^T k), one column per thread of threads 0..127, from the row groups' partial S^T k.
__device__ __forceinline__ void delta_u(float* u_s, const float (&partial)[kRowGroups][kD], const float* v, float beta,
                                        int tid) {
  if (tid < kD) {
    float sk = 0.0f;
#pragma unroll
    for (int r = 0; r < kRowGroups; ++r) sk += partial[r][tid];
    u_s[tid] = beta * (v[tid] - sk);
  }
}

// S += k u^T on this thread's rows and their partial S^T q; kStoreState: each updated row goes to `state` (row
// r at state + r * kD, streaming) right away (also used by the decode step).
template <bool kStoreState>
__device__ __forceinline__ float4 update_rows_partial_o(float4 (&s)[8], float4 u, const float* k, const float* q,
                                                        int rg, float* state) {
  float4 o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int r = rg * 8 + i;
    const float kr = k[r], qr = q[r];
    s[i].x += kr * u.x;
    s[i].y += kr * u.y;
    s[i].z += kr * u.z;
    s[i].w += kr * u.w;
    o.x += qr * s[i].x;
    o.y += qr * s[i].y;
    o.z += qr * s[i].z;
    o.w += qr * s[i].w;
    if constexpr (kStoreState) __stcs(reinterpret_cast<float4*>(state + r * kD), s[i]);
  }
  return o;
}

// Gated RMSNorm of o (column sums of the row groups' partials; warps 0..3, one column per thread, squares in
// sums[8..11]) into out[row + h * kD + column]. All threads call it (one block barrier inside).
__device__ __forceinline__ void gated_rms_norm_out(const DecodeArgs& p, const float (&partial)[kRowGroups][kD],
                                                   float* sums, size_t row, int h, int tid, int lane, int warp) {
  float o_col = 0.0f;
  if (tid < kD) {
#pragma unroll
    for (int r = 0; r < kRowGroups; ++r) o_col += partial[r][tid];
    float square = o_col * o_col;
    for (int offset = 16; offset > 0; offset >>= 1) square += __shfl_xor_sync(0xffffffffu, square, offset);
    if (lane == 0) sums[8 + warp] = square;
  }
  __syncthreads();
  if (tid < kD) {
    const float total = sums[8] + sums[9] + sums[10] + sums[11];
    const float inverse_rms = rsqrtf(total / static_cast<float>(kD) + p.rms_eps);
    const float gate = sigmoid(__bfloat162float(p.out_gate[row + h * kD + tid]));
    p.out[row + h * kD + tid] = __float2bfloat16(o_col * inverse_rms * p.o_norm_weight[tid] * gate);
  }
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
  if (p.gate_low != nullptr) {
    const int64_t needed = p.g_b != nullptr ? 2 * kD : kD;
    if (p.gate_low_stride < needed || p.gate_low_stride % 8 != 0) {
      return invalid_argument(w + ": gate_low_stride must be a multiple of 8 and >= " + std::to_string(needed) +
                              ", got " + std::to_string(p.gate_low_stride));
    }
  } else if (p.f_b != nullptr || p.g_b != nullptr) {
    return invalid_argument(w + ": f_b / g_b are only read with gate_low");
  }
  if (p.batch == 0) return Status::ok();
  if (p.gate_low != nullptr) {
    DS_RETURN_IF_ERROR(check_pointer(p.gate_low, "gate_low", who));
    DS_RETURN_IF_ERROR(check_pointer(p.f_b, "f_b", who));
    if (p.g_b != nullptr) DS_RETURN_IF_ERROR(check_pointer(p.g_b, "g_b", who));
  } else {
    DS_RETURN_IF_ERROR(check_pointer(p.gate_raw, "gate_raw", who));
  }
  if (p.gate_low == nullptr || p.g_b == nullptr) DS_RETURN_IF_ERROR(check_pointer(p.out_gate, "out_gate", who));
  const std::pair<const void*, const char*> pointers[] = {
      {p.slots, "slots"},
      {p.q_in, "q_in"},
      {p.k_in, "k_in"},
      {p.v_in, "v_in"},
      {p.beta_raw, "beta_raw"},
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
                    p.gate_low,
                    p.gate_low_stride,
                    p.f_b,
                    p.g_b,
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
