// Fused KDA decode step for sm_90a (contract in kda.hpp). One cluster of 4 CTAs per (batch row, head); CTA r of
// the cluster owns value columns [32 r, 32 r + 32) of the head's state. Every CTA computes the short conv, L2
// norm and gate of the head's 128 q/k channels (cheap, and it avoids a second launch); the old conv tails are
// read by all four before any is overwritten (cluster barrier). The RMS of o spans the four CTAs and is summed
// through distributed shared memory. State traffic: each CTA reads and writes its 128 x 32 fp32 slice once.
#include <cmath>
#include <string>

#include <cooperative_groups.h>
#include <cuda_bf16.h>

#include "kernels/cuda/kda.hpp"

namespace deltaserve::kernels::cuda {
namespace {

namespace cg = cooperative_groups;
using bf16 = __nv_bfloat16;

constexpr int kD = kKdaHeadDim;
constexpr int kSplit = 4;
constexpr int kBv = kD / kSplit;  // 32 value columns per CTA
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

__device__ __forceinline__ float block_sum_128(float value, float* scratch) {
  for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffffu, value, offset);
  const int warp = threadIdx.x >> 5;
  __syncthreads();
  if ((threadIdx.x & 31) == 0) scratch[warp] = value;
  __syncthreads();
  return scratch[0] + scratch[1] + scratch[2] + scratch[3];
}

__global__ void __cluster_dims__(kSplit, 1, 1) __launch_bounds__(128, 8) kda_decode_kernel(DecodeArgs p) {
  __shared__ float q_s[kD], k_s[kD], decay_s[kD], v_s[kBv];
  __shared__ float reduce_ks[4][kBv], reduce_o[4][kBv], scratch[4];
  __shared__ float sum_squares_s;
  cg::cluster_group cluster = cg::this_cluster();
  const int split = static_cast<int>(cluster.block_rank());
  const int h = blockIdx.y, b = blockIdx.z;
  const int H = p.num_heads, C = H * kD, K = p.conv_kernel;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int slot = p.slots[b];
  const size_t out_row = static_cast<size_t>(b) * C + h * kD + split * kBv;
  if (slot < 0 || slot >= p.num_slots) {  // uniform over the cluster (same row)
    if (tid < kBv) p.out[out_row + tid] = __float2bfloat16(0.0f);
    return;
  }

  // State slice first, so its loads overlap the conv and norms: thread owns columns 4 cg .. 4 cg + 3 of rows
  // 8 rg .. 8 rg + 7.
  const int cgi = tid & 7, rg = tid >> 3;
  float* state = p.state + ((static_cast<size_t>(slot) * H + h) * kD) * kD + split * kBv + cgi * 4;
  float4 s[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) s[i] = __ldcs(reinterpret_cast<const float4*>(state + (rg * 8 + i) * kD));

  // Short conv + SiLU for q and k channel `tid`, and v channel split * 32 + tid.
  const int channel = h * kD + tid;
  const size_t tail_stride = static_cast<size_t>(K - 1);
  float* tails = p.conv_state + static_cast<size_t>(slot) * 3 * C * tail_stride;
  float tail_q[3] = {}, tail_k[3] = {}, tail_v[3] = {};
#pragma unroll
  for (int j = 0; j < 3; ++j) {
    if (j < K - 1) {
      tail_q[j] = tails[(0 * static_cast<size_t>(C) + channel) * tail_stride + j];
      tail_k[j] = tails[(1 * static_cast<size_t>(C) + channel) * tail_stride + j];
    }
  }
  const size_t row = static_cast<size_t>(b) * C;
  float qv =
      conv_step(p.q_conv_weight + static_cast<size_t>(channel) * K, tail_q, __bfloat162float(p.q_in[row + channel]), K);
  float kv =
      conv_step(p.k_conv_weight + static_cast<size_t>(channel) * K, tail_k, __bfloat162float(p.k_in[row + channel]), K);
  const int v_channel = h * kD + split * kBv + tid;
  if (tid < kBv) {
#pragma unroll
    for (int j = 0; j < 3; ++j) {
      if (j < K - 1) tail_v[j] = tails[(2 * static_cast<size_t>(C) + v_channel) * tail_stride + j];
    }
    v_s[tid] = conv_step(p.v_conv_weight + static_cast<size_t>(v_channel) * K, tail_v,
                         __bfloat162float(p.v_in[row + v_channel]), K);
  }
  // L2 norm per head (q also scaled by d^-0.5), gate and beta.
  const float q_sum = block_sum_128(qv * qv, scratch);
  const float k_sum = block_sum_128(kv * kv, scratch);
  qv *= rsqrtf(static_cast<float>(kD)) * rsqrtf(q_sum + kL2Eps);
  kv *= rsqrtf(k_sum + kL2Eps);
  const float x = __bfloat162float(p.gate_raw[row + channel]) + p.dt_bias[channel];
  const float a = __expf(p.a_log[h]);
  const float g = p.bounded ? p.lower_bound * sigmoid(a * x) : -a * (x > 20.0f ? x : log1pf(__expf(x)));
  q_s[tid] = qv;
  k_s[tid] = kv;
  decay_s[tid] = __expf(g);
  const float beta = sigmoid(__bfloat162float(p.beta_raw[static_cast<size_t>(b) * H + h]));

  cluster.sync();  // every CTA has read the old tails (and this CTA's smem is written)
  if (split == 0) {
#pragma unroll
    for (int j = 0; j < 3; ++j) {
      if (j < K - 1) {
        tails[(0 * static_cast<size_t>(C) + channel) * tail_stride + j] = tail_q[j];
        tails[(1 * static_cast<size_t>(C) + channel) * tail_stride + j] = tail_k[j];
      }
    }
  }
  if (tid < kBv) {
#pragma unroll
    for (int j = 0; j < 3; ++j) {
      if (j < K - 1) tails[(2 * static_cast<size_t>(C) + v_channel) * tail_stride + j] = tail_v[j];
    }
  }

  // Recurrent update of the slice (its loads were issued first).
  float ks[4] = {};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int r = rg * 8 + i;
    const float d = decay_s[r], kr = k_s[r];
    s[i].x *= d;
    s[i].y *= d;
    s[i].z *= d;
    s[i].w *= d;
    ks[0] += kr * s[i].x;
    ks[1] += kr * s[i].y;
    ks[2] += kr * s[i].z;
    ks[3] += kr * s[i].w;
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    ks[j] += __shfl_xor_sync(0xffffffffu, ks[j], 8);
    ks[j] += __shfl_xor_sync(0xffffffffu, ks[j], 16);
  }
  if (lane < 8) {
#pragma unroll
    for (int j = 0; j < 4; ++j) reduce_ks[warp][cgi * 4 + j] = ks[j];
  }
  __syncthreads();
  float u[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int col = cgi * 4 + j;
    const float sk = reduce_ks[0][col] + reduce_ks[1][col] + reduce_ks[2][col] + reduce_ks[3][col];
    u[j] = beta * (v_s[col] - sk);
  }
  float o[4] = {};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int r = rg * 8 + i;
    const float kr = k_s[r], qr = q_s[r];
    s[i].x += kr * u[0];
    s[i].y += kr * u[1];
    s[i].z += kr * u[2];
    s[i].w += kr * u[3];
    o[0] += qr * s[i].x;
    o[1] += qr * s[i].y;
    o[2] += qr * s[i].z;
    o[3] += qr * s[i].w;
    __stcs(reinterpret_cast<float4*>(state + r * kD), s[i]);
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    o[j] += __shfl_xor_sync(0xffffffffu, o[j], 8);
    o[j] += __shfl_xor_sync(0xffffffffu, o[j], 16);
  }
  if (lane < 8) {
#pragma unroll
    for (int j = 0; j < 4; ++j) reduce_o[warp][cgi * 4 + j] = o[j];
  }
  __syncthreads();
  float o_col = 0.0f;
  if (warp == 0) {
    o_col = reduce_o[0][lane] + reduce_o[1][lane] + reduce_o[2][lane] + reduce_o[3][lane];
    float squares = o_col * o_col;
    for (int offset = 16; offset > 0; offset >>= 1) squares += __shfl_xor_sync(0xffffffffu, squares, offset);
    if (lane == 0) sum_squares_s = squares;
  }
  cluster.sync();  // partial sums of squares visible cluster-wide
  if (warp == 0) {
    float total = 0.0f;
#pragma unroll
    for (int r = 0; r < kSplit; ++r) total += *cluster.map_shared_rank(&sum_squares_s, r);
    const int col = split * kBv + lane;
    const float inverse_rms = rsqrtf(total / static_cast<float>(kD) + p.rms_eps);
    const float gate = sigmoid(__bfloat162float(p.out_gate[row + h * kD + col]));
    p.out[out_row + lane] = __float2bfloat16(o_col * inverse_rms * p.o_norm_weight[col] * gate);
  }
  cluster.sync();  // peers finished reading this CTA's shared memory
}

bool aligned16(const void* pointer) {
  return (reinterpret_cast<uintptr_t>(pointer) & 15u) == 0;
}

Status check_pointer(const void* pointer, const char* name) {
  if (pointer == nullptr) return invalid_argument(std::string("kda_decode_step: ") + name + " is null");
  if (!aligned16(pointer)) return invalid_argument(std::string("kda_decode_step: ") + name + " is not 16-byte aligned");
  return Status::ok();
}

}  // namespace

Status kda_decode_step(const KdaDecodeParams& p, cudaStream_t stream) {
  if (p.batch < 0 || p.batch > 65535) return invalid_argument("kda_decode_step: batch must be in [0, 65535]");
  if (p.num_heads <= 0 || p.num_heads > 65535) return invalid_argument("kda_decode_step: num_heads must be >= 1");
  if (p.head_dim != kD)
    return unimplemented("kda_decode_step: head_dim must be 128, got " + std::to_string(p.head_dim));
  if (p.conv_kernel < 1 || p.conv_kernel > 4) {
    return unimplemented("kda_decode_step: conv_kernel must be in [1, 4], got " + std::to_string(p.conv_kernel));
  }
  if (p.num_slots <= 0) return invalid_argument("kda_decode_step: num_slots must be >= 1");
  if (!(p.rms_eps > 0.0f && std::isfinite(p.rms_eps))) return invalid_argument("kda_decode_step: rms_eps must be > 0");
  if (p.lower_bound && !(std::isfinite(*p.lower_bound) && *p.lower_bound < 0.0f)) {
    return invalid_argument("kda_decode_step: lower_bound must be finite and < 0");
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
  for (const auto& [pointer, name] : pointers) DS_RETURN_IF_ERROR(check_pointer(pointer, name));
  if (p.conv_kernel > 1) DS_RETURN_IF_ERROR(check_pointer(p.conv_state, "conv_state"));  // K = 1 keeps no tails
  DecodeArgs args{p.num_heads,
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
  kda_decode_kernel<<<dim3(kSplit, static_cast<unsigned>(p.num_heads), static_cast<unsigned>(p.batch)), 128, 0,
                      stream>>>(args);
  const cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) {
    return internal_error(std::string("kda_decode_step: launch: ") + cudaGetErrorName(error) + " (" +
                          cudaGetErrorString(error) + ")");
  }
  return Status::ok();
}

}  // namespace deltaserve::kernels::cuda
