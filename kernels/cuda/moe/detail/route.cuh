// Device side of the MoE router (contract in moe.hpp, reference cpu::moe_route), shared by moe_route (one warp per
// token) and the small-batch decode layer (small_batch.cu), so the expert selection exists once.
// One warp routes one token: the choice scores live in the warp's slice of shared memory; each lane keeps the best
// untaken entry of its own experts (e = lane + 32 i), so a selection round is two warp reductions (redux.sync: the
// best score key, then the lowest index holding it) plus a rescan by the winner's lane only. Grouped top-k
// first picks groups the same way, then masks the experts of the losing groups. The weights are summed in the CPU's
// order with the CPU's operations, so ids and weights match cpu::moe_route bit for bit on the same fp32 logits.
#pragma once

#include <cmath>
#include <cstdint>

#include <cuda_runtime.h>

#include "kernels/cuda/moe/moe.hpp"

namespace deltaserve::kernels::cuda::moe_route_device {

constexpr int kNoIndex = 0x7fffffff;

// The CPU reference's sigmoid (1 / (1 + e^-x) for x >= 0, e^x / (1 + e^x) otherwise) with e^x computed in double
// and rounded once, which is the correctly rounded float e^x (what glibc's expf returns up to rare halfway cases).
// activations.cuh's sigmoid_f uses __expf (a few ulp off), which could flip near-ties against the CPU's choice.
__device__ __forceinline__ float router_sigmoid(float x) {
  if (x >= 0.0f) return 1.0f / (1.0f + static_cast<float>(exp(static_cast<double>(-x))));
  const float e = static_cast<float>(exp(static_cast<double>(x)));
  return e / (1.0f + e);
}

// (score, index) candidate: a is chosen before b when its score is higher, or equal with a lower index. Scores are
// never NaN here (NaN maps to -inf), so this is a total order on valid candidates; kNoIndex loses to everything.
__device__ __forceinline__ bool chosen_before(float sa, int ia, float sb, int ib) {
  if (ib == kNoIndex) return ia != kNoIndex;
  if (ia == kNoIndex) return false;
  if (sa != sb) return sa > sb;
  return ia < ib;
}

// Unsigned key ordered like the scores: higher key = higher score (no NaN here; -0 and +0 share the key of +0,
// as they compare equal). 0 is below every score's key (that of -inf is 0x007fffff) and marks "no candidate".
__device__ __forceinline__ unsigned score_key(float score) {
  const unsigned bits = __float_as_uint(score == 0.0f ? 0.0f : score);
  return (bits & 0x80000000u) != 0 ? ~bits : (bits | 0x80000000u);
}

// The warp's winner (higher score, then lower index) among the lanes' candidates, returned to every lane: the best
// key by one warp max reduction, then the lowest index among the lanes holding it by one min reduction.
__device__ __forceinline__ int warp_argmax(float score, int index) {
  const unsigned key = index == kNoIndex ? 0u : score_key(score);
  const unsigned best = __reduce_max_sync(0xffffffffu, key);
  return static_cast<int>(
      __reduce_min_sync(0xffffffffu, key == best ? static_cast<unsigned>(index) : static_cast<unsigned>(kNoIndex)));
}

// The calling lane's best entry of values[lane + 32 i] (i < ceil((n - lane) / 32)) whose bit i of `taken` is clear.
__device__ __forceinline__ void lane_best(const float* values, int n, uint32_t taken, float& best, int& best_index) {
  best = -INFINITY;
  best_index = kNoIndex;
  const int lane = threadIdx.x & 31;
  for (int i = 0, e = lane; e < n; ++i, e += 32) {
    if (((taken >> i) & 1u) == 0 && chosen_before(values[e], e, best, best_index)) {
      best = values[e];
      best_index = e;
    }
  }
}

struct RouteConfig {
  int num_experts, top_k, num_groups, top_k_groups;
  bool renormalize;
  float routed_scaling_factor;
};

// Floats of shared memory one routing warp needs: the choice scores [E] and, with groups, the group scores [G].
__host__ __device__ constexpr int route_scratch_floats(int num_experts, int num_groups) {
  return num_experts + (num_groups > 1 ? num_groups : 0);
}

// Routes one token with the whole (converged) warp. logits: [E] fp32 (global or shared memory); bias: [E] or nullptr;
// scratch: route_scratch_floats(E, G) floats of shared memory private to this warp. Writes ids[0, k) and
// weights[0, k) (lane j writes choice j). Requires the validated config of moe_route (E <= 1024, k <= 32).
__device__ __forceinline__ void route_token(const RouteConfig& c, const float* logits, const float* bias,
                                            float* scratch, int32_t* ids, float* weights) {
  const int E = c.num_experts, lane = threadIdx.x & 31;
  float* choice = scratch;  // s + bias; -inf when NaN or masked
  for (int e = lane; e < E; e += 32) {
    const float s = router_sigmoid(logits[e]);
    const float score = s + (bias != nullptr ? bias[e] : 0.0f);
    choice[e] = isnan(score) ? -INFINITY : score;
  }
  __syncwarp();

  if (c.num_groups > 1) {
    const int G = c.num_groups, group_size = E / G;
    float* group_score = scratch + E;
    for (int g = lane; g < G; g += 32) {
      float best = -INFINITY, second = -INFINITY;
      for (int e = g * group_size; e < (g + 1) * group_size; ++e) {
        const float s = choice[e];
        if (s > best) {
          second = best;
          best = s;
        } else if (s > second) {
          second = s;
        }
      }
      const float score = group_size >= 2 ? best + second : best;
      group_score[g] = isnan(score) ? -INFINITY : score;
    }
    __syncwarp();
    uint32_t kept = 0;  // bit i: group lane + 32 i is kept
    float best;
    int best_index;
    lane_best(group_score, G, kept, best, best_index);
    for (int i = 0; i < c.top_k_groups; ++i) {
      const int g = warp_argmax(best, best_index);
      if ((g & 31) == lane) {
        kept |= 1u << (g >> 5);
        lane_best(group_score, G, kept, best, best_index);
      }
    }
    // Mask the experts of the groups not kept; the kept bit of group g lives in lane g % 32.
    for (int base = 0; base < E; base += 32) {
      const int e = base + lane;
      const int g = (e < E ? e : E - 1) / group_size;
      const uint32_t owner_kept = __shfl_sync(0xffffffffu, kept, g & 31);
      if (e < E && ((owner_kept >> (g >> 5)) & 1u) == 0) choice[e] = -INFINITY;
    }
    __syncwarp();
  }

  uint32_t taken = 0;  // bit i: expert lane + 32 i is chosen
  float best;
  int best_index;
  lane_best(choice, E, taken, best, best_index);
  int my_choice = 0;  // lane j: the j-th choice
  for (int j = 0; j < c.top_k; ++j) {
    const int e = warp_argmax(best, best_index);
    if (lane == j) my_choice = e;
    if ((e & 31) == lane) {
      taken |= 1u << (e >> 5);
      lane_best(choice, E, taken, best, best_index);
    }
  }

  // Weights: s of the chosen experts, summed in choice order (every lane runs the same additions).
  const float s = lane < c.top_k ? router_sigmoid(logits[my_choice]) : 0.0f;
  float sum = 0.0f;
  for (int j = 0; j < c.top_k; ++j) sum += __shfl_sync(0xffffffffu, s, j);
  if (lane < c.top_k) {
    float w = s;
    if (c.renormalize) w = __fdiv_rn(w, __fadd_rn(sum, 1e-20f));
    w = __fmul_rn(w, c.routed_scaling_factor);
    ids[lane] = my_choice;
    weights[lane] = w;
  }
  __syncwarp();  // the scratch may be reused by the next token of this warp
}

}  // namespace deltaserve::kernels::cuda::moe_route_device
