// Fused MoE router (contract in moe.hpp): one CTA per token. The scores live in shared memory; grouped top-k
// masks the losing groups, then k rounds of a block-wide argmax (higher score, then lower index) pick the experts
// in the order cpu::moe_route outputs them. Weights are summed and scaled by one thread in the CPU's order and
// with the CPU's operations, so they match it bit for bit.
#include <cmath>
#include <string>

#include "kernels/cuda/moe.hpp"

namespace deltaserve::kernels::cuda {
namespace {

constexpr float kNegInf = -INFINITY;
constexpr int kNoIndex = 0x7fffffff;
constexpr int kMaxThreads = 256;

// The CPU reference's sigmoid (1 / (1 + e^-x) for x >= 0, e^x / (1 + e^x) otherwise) with e^x computed in double
// and rounded once, which is the correctly rounded float e^x (what glibc's expf returns up to rare halfway cases).
// activations.cuh's sigmoid_f uses __expf (a few ulp off), which could flip near-ties against the CPU's choice.
__device__ __forceinline__ float router_sigmoid(float x) {
  if (x >= 0.0f) return 1.0f / (1.0f + static_cast<float>(exp(static_cast<double>(-x))));
  const float e = static_cast<float>(exp(static_cast<double>(x)));
  return e / (1.0f + e);
}

// (score, index) candidate: a is chosen before b when its score is higher, or equal with a lower index.
__device__ __forceinline__ bool chosen_before(float sa, int ia, float sb, int ib) {
  if (ib == kNoIndex) return ia != kNoIndex;
  if (ia == kNoIndex) return false;
  if (sa != sb) return sa > sb;
  return ia < ib;
}

// Block-wide argmax over scores[0, n) skipping taken[i] != 0; returns the winner's index to every thread.
// NaN never occurs in scores (mapped to -inf), so the order is total.
__device__ int block_argmax(const float* scores, const unsigned char* taken, int n, float* warp_score, int* warp_index,
                            int* winner) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, warps = (blockDim.x + 31) >> 5;
  float best = kNegInf;
  int best_index = kNoIndex;
  for (int i = tid; i < n; i += blockDim.x) {
    if (!taken[i] && chosen_before(scores[i], i, best, best_index)) {
      best = scores[i];
      best_index = i;
    }
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float other = __shfl_xor_sync(0xffffffffu, best, offset);
    const int other_index = __shfl_xor_sync(0xffffffffu, best_index, offset);
    if (chosen_before(other, other_index, best, best_index)) {
      best = other;
      best_index = other_index;
    }
  }
  if (lane == 0) {
    warp_score[warp] = best;
    warp_index[warp] = best_index;
  }
  __syncthreads();
  if (tid == 0) {
    float b = warp_score[0];
    int bi = warp_index[0];
    for (int w = 1; w < warps; ++w) {
      if (chosen_before(warp_score[w], warp_index[w], b, bi)) {
        b = warp_score[w];
        bi = warp_index[w];
      }
    }
    *winner = bi;
  }
  __syncthreads();
  const int result = *winner;
  __syncthreads();  // every thread has read `winner` before the next call overwrites it
  return result;
}

struct RouteArgs {
  int num_experts, top_k, num_groups, top_k_groups;
  bool renormalize;
  float routed_scaling_factor;
  const float* logits;
  const float* bias;
  int32_t* expert_ids;
  float* weights;
};

__global__ void __launch_bounds__(kMaxThreads) moe_route_kernel(RouteArgs p) {
  __shared__ float score_s[kMoeMaxExperts];   // s = sigmoid(logit)
  __shared__ float choice_s[kMoeMaxExperts];  // s + bias; -inf when NaN or masked
  __shared__ unsigned char taken_s[kMoeMaxExperts];
  __shared__ float group_score_s[kMoeMaxExperts];
  __shared__ unsigned char group_taken_s[kMoeMaxExperts];
  __shared__ float warp_score[32];
  __shared__ int warp_index[32];
  __shared__ int winner;
  __shared__ int chosen_s[kMoeMaxTopK];

  const int E = p.num_experts, tid = threadIdx.x;
  const int64_t t = blockIdx.x;
  const float* logits = p.logits + t * E;
  for (int e = tid; e < E; e += blockDim.x) {
    const float s = router_sigmoid(logits[e]);
    const float choice = s + (p.bias != nullptr ? p.bias[e] : 0.0f);
    score_s[e] = s;
    choice_s[e] = isnan(choice) ? kNegInf : choice;
    taken_s[e] = 0;
  }
  __syncthreads();

  if (p.num_groups > 1) {
    const int G = p.num_groups, group_size = E / G;
    for (int g = tid; g < G; g += blockDim.x) {
      float best = kNegInf, second = kNegInf;
      for (int e = g * group_size; e < (g + 1) * group_size; ++e) {
        const float s = choice_s[e];
        if (s > best) {
          second = best;
          best = s;
        } else if (s > second) {
          second = s;
        }
      }
      const float group_score = group_size >= 2 ? best + second : best;
      group_score_s[g] = isnan(group_score) ? kNegInf : group_score;
      group_taken_s[g] = 0;
    }
    __syncthreads();
    for (int i = 0; i < p.top_k_groups; ++i) {
      const int g = block_argmax(group_score_s, group_taken_s, G, warp_score, warp_index, &winner);
      if (tid == 0) group_taken_s[g] = 1;
      __syncthreads();
    }
    for (int e = tid; e < E; e += blockDim.x) {
      if (!group_taken_s[e / group_size]) choice_s[e] = kNegInf;
    }
    __syncthreads();
  }

  for (int j = 0; j < p.top_k; ++j) {
    const int e = block_argmax(choice_s, taken_s, E, warp_score, warp_index, &winner);
    if (tid == 0) {
      taken_s[e] = 1;
      chosen_s[j] = e;
    }
    __syncthreads();
  }

  if (tid == 0) {
    const int k = p.top_k;
    float w[kMoeMaxTopK];
    float sum = 0.0f;
    for (int j = 0; j < k; ++j) {
      w[j] = score_s[chosen_s[j]];
      sum += w[j];
    }
    for (int j = 0; j < k; ++j) {
      if (p.renormalize) w[j] = __fdiv_rn(w[j], __fadd_rn(sum, 1e-20f));
      w[j] = __fmul_rn(w[j], p.routed_scaling_factor);
      p.expert_ids[t * k + j] = chosen_s[j];
      p.weights[t * k + j] = w[j];
    }
  }
}

}  // namespace

Status moe_route(const MoeRoutingConfig& config, const float* logits, const float* correction_bias, int64_t T,
                 int32_t* expert_ids, float* weights, cudaStream_t stream) {
  const int E = config.num_experts, k = config.top_k, G = config.num_groups, KG = config.top_k_groups;
  if (E < 1 || E > kMoeMaxExperts) {
    return invalid_argument("moe_route: num_experts " + std::to_string(E) + " not in [1, 1024]");
  }
  if (k < 1 || k > kMoeMaxTopK || k > E) {
    return invalid_argument("moe_route: top_k " + std::to_string(k) + " not in [1, min(32, num_experts)]");
  }
  if (G < 1 || E % G != 0) {
    return invalid_argument("moe_route: num_groups " + std::to_string(G) + " must be >= 1 and divide num_experts");
  }
  if (KG < 1 || KG > G) return invalid_argument("moe_route: top_k_groups must be in [1, num_groups]");
  if (G > 1 && k > KG * (E / G)) {
    return invalid_argument("moe_route: top_k exceeds the experts of the kept groups");
  }
  if (!std::isfinite(config.routed_scaling_factor)) {
    return invalid_argument("moe_route: routed_scaling_factor must be finite");
  }
  if (T < 0 || T > 0x7fffffff) return invalid_argument("moe_route: T out of range");
  if (T == 0) return Status::ok();
  if (logits == nullptr || expert_ids == nullptr || weights == nullptr) {
    return invalid_argument("moe_route: logits, expert_ids and weights must be non-null");
  }
  RouteArgs args{E,          k,      G, KG, config.renormalize, config.routed_scaling_factor, logits, correction_bias,
                 expert_ids, weights};
  const int threads = E >= kMaxThreads ? kMaxThreads : ((E + 31) / 32) * 32;
  moe_route_kernel<<<static_cast<unsigned>(T), threads, 0, stream>>>(args);
  const cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) {
    return internal_error(std::string("moe_route: launch: ") + cudaGetErrorName(error) + " (" +
                          cudaGetErrorString(error) + ")");
  }
  return Status::ok();
}

}  // namespace deltaserve::kernels::cuda
