// The KDA recurrence for any head size d <= 128: one block per (sequence, head), thread j owns column j (value
// channel) of the head's state S [d_k, d_v], held in shared memory. Per token, in cpu::kda_recurrent's order:
//   S[c, j] *= exp(g[c]);  u_j = beta (v_j - Σ_c k_c S[c, j]);  S[c, j] += k_c u_j;  o_j = Σ_c q_c S[c, j].
// Columns are independent, so a token needs only two barriers (staging q, k, exp(g) into shared memory).
#include <string>

#include "kernels/cuda/kda/kda_generic.hpp"

namespace deltaserve::kernels::cuda {
namespace {

__global__ void kda_recurrent_kernel(KdaRecurrentParams p) {
  extern __shared__ float shared[];
  const int d = p.head_dim, H = p.num_heads;
  float* S = shared;         // [d, d]
  float* q_s = S + d * d;    // [d]
  float* k_s = q_s + d;      // [d]
  float* decay_s = k_s + d;  // [d]
  const int n = blockIdx.x, h = blockIdx.y, j = threadIdx.x;
  const int32_t slot = p.slots[n];
  if (slot < 0 || slot >= p.num_slots) return;
  const int64_t first = p.cu_seqlens[n], last = p.cu_seqlens[n + 1];
  if (last <= first) return;
  float* state = p.state + (static_cast<int64_t>(slot) * H + h) * d * d;
  for (int i = threadIdx.x; i < d * d; i += blockDim.x) S[i] = state[i];
  for (int64_t t = first; t < last; ++t) {
    const int64_t base = (t * H + h) * d;
    __syncthreads();  // the previous token's reads of q_s/k_s/decay_s are done (and S is loaded)
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
      q_s[c] = p.q[base + c];
      k_s[c] = p.k[base + c];
      decay_s[c] = expf(p.g[base + c]);
    }
    __syncthreads();
    if (j < d) {
      float u = 0.0f;
      for (int c = 0; c < d; ++c) {
        const float s = S[c * d + j] * decay_s[c];
        S[c * d + j] = s;
        u += k_s[c] * s;
      }
      u = p.beta[t * H + h] * (p.v[base + j] - u);
      float o = 0.0f;
      for (int c = 0; c < d; ++c) {
        const float s = S[c * d + j] + k_s[c] * u;
        S[c * d + j] = s;
        o += q_s[c] * s;
      }
      p.o[base + j] = o;
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < d * d; i += blockDim.x) state[i] = S[i];
}

}  // namespace

Status kda_recurrent_varlen(const KdaRecurrentParams& p, cudaStream_t stream) {
  const std::string prefix = "kda_recurrent_varlen: ";
  if (p.num_seqs < 0) return invalid_argument(prefix + "num_seqs must be >= 0, got " + std::to_string(p.num_seqs));
  if (p.num_tokens < 0)
    return invalid_argument(prefix + "num_tokens must be >= 0, got " + std::to_string(p.num_tokens));
  if (p.num_seqs == 0 && p.num_tokens != 0) return invalid_argument(prefix + "num_tokens > 0 with no sequences");
  if (p.num_heads < 1 || p.num_heads > 65535) {
    return invalid_argument(prefix + "num_heads must be in [1, 65535], got " + std::to_string(p.num_heads));
  }
  if (p.head_dim < 1 || p.head_dim > kKdaGenericMaxHeadDim) {
    return invalid_argument(prefix + "head_dim must be in [1, 128], got " + std::to_string(p.head_dim));
  }
  if (p.num_slots < 0) return invalid_argument(prefix + "num_slots must be >= 0");
  if (p.num_tokens == 0) return Status::ok();
  if (p.cu_seqlens == nullptr || p.slots == nullptr) return invalid_argument(prefix + "cu_seqlens or slots is null");
  if (p.q == nullptr || p.k == nullptr || p.v == nullptr || p.g == nullptr || p.beta == nullptr) {
    return invalid_argument(prefix + "q, k, v, g and beta must be non-null");
  }
  if (p.state == nullptr || p.o == nullptr) return invalid_argument(prefix + "state or o is null");
  const int d = p.head_dim;
  const size_t shared_bytes = (static_cast<size_t>(d) * d + 3 * static_cast<size_t>(d)) * sizeof(float);
  // Always the limit for the largest head size, so concurrent launches with other sizes never lower it.
  constexpr int kMaxSharedBytes = (kKdaGenericMaxHeadDim * kKdaGenericMaxHeadDim + 3 * kKdaGenericMaxHeadDim) * 4;
  cudaError_t error =
      cudaFuncSetAttribute(kda_recurrent_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxSharedBytes);
  if (error != cudaSuccess) {
    return internal_error(prefix + "cudaFuncSetAttribute: " + cudaGetErrorName(error));
  }
  const int threads = (d + 31) / 32 * 32;
  kda_recurrent_kernel<<<dim3(static_cast<unsigned>(p.num_seqs), static_cast<unsigned>(p.num_heads)), threads,
                         shared_bytes, stream>>>(p);
  error = cudaGetLastError();
  if (error != cudaSuccess) {
    return internal_error(prefix + "launch: " + cudaGetErrorName(error) + " (" + cudaGetErrorString(error) + ")");
  }
  return Status::ok();
}

}  // namespace deltaserve::kernels::cuda
