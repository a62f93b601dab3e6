// MoE routing CPU reference (sigmoid scores, bias-corrected selection, optional grouped top-k).
#include "kernels/cpu/moe.hpp"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

namespace deltaserve::kernels::cpu {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kRenormalizeEpsilon = 1e-20f;

// Same formula as basic_ops' sigmoid, kept local so routing depends on nothing else.
float sigmoid_f32(float x) {
  if (x >= 0.0f) return 1.0f / (1.0f + std::exp(-x));
  const float e = std::exp(x);
  return e / (1.0f + e);
}

// Strict total order for "a is chosen before b": higher score first, then the lower index.
// Scores never hold NaN here (mapped to -inf by the caller), so this is a strict weak order.
struct ChosenBefore {
  const float* scores;
  bool operator()(int32_t a, int32_t b) const {
    if (scores[a] != scores[b]) return scores[a] > scores[b];
    return a < b;
  }
};

}  // namespace

void moe_route(const MoeRouting& routing, const float* logits, const float* correction_bias, int32_t* expert_ids,
               float* weights) {
  const int64_t num_experts = routing.num_experts;
  const int64_t top_k = routing.top_k;
  const int64_t num_groups = routing.num_expert_groups;
  assert(num_experts > 0 && top_k > 0 && top_k <= num_experts);
  assert(num_groups >= 1 && num_experts % num_groups == 0);
  assert(routing.top_k_groups >= 1 && routing.top_k_groups <= num_groups);
  assert(num_groups == 1 || top_k <= routing.top_k_groups * (num_experts / num_groups));

  std::vector<float> scores(static_cast<size_t>(num_experts));         // s = sigmoid(logit)
  std::vector<float> choice_scores(static_cast<size_t>(num_experts));  // s + bias; -inf when not competing
  for (int64_t e = 0; e < num_experts; ++e) {
    scores[e] = sigmoid_f32(logits[e]);
    const float choice = scores[e] + (correction_bias != nullptr ? correction_bias[e] : 0.0f);
    choice_scores[e] = std::isnan(choice) ? kNegInf : choice;
  }

  if (num_groups > 1) {
    // Group score = sum of its two best choice scores (its one score when a group has one expert).
    const int64_t group_size = num_experts / num_groups;
    std::vector<float> group_scores(static_cast<size_t>(num_groups));
    for (int64_t g = 0; g < num_groups; ++g) {
      float best = kNegInf;
      float second = kNegInf;
      for (int64_t e = g * group_size; e < (g + 1) * group_size; ++e) {
        const float s = choice_scores[e];
        if (s > best) {
          second = best;
          best = s;
        } else if (s > second) {
          second = s;
        }
      }
      const float group_score = group_size >= 2 ? best + second : best;
      group_scores[g] = std::isnan(group_score) ? kNegInf : group_score;
    }
    std::vector<int32_t> group_order(static_cast<size_t>(num_groups));
    std::iota(group_order.begin(), group_order.end(), 0);
    std::partial_sort(group_order.begin(), group_order.begin() + routing.top_k_groups, group_order.end(),
                      ChosenBefore{group_scores.data()});
    std::vector<bool> group_kept(static_cast<size_t>(num_groups), false);
    for (int64_t i = 0; i < routing.top_k_groups; ++i) group_kept[group_order[i]] = true;
    for (int64_t e = 0; e < num_experts; ++e) {
      if (!group_kept[e / group_size]) choice_scores[e] = kNegInf;
    }
  }

  std::vector<int32_t> order(static_cast<size_t>(num_experts));
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + top_k, order.end(), ChosenBefore{choice_scores.data()});

  // Outputs in choice order. A NaN or -inf choice score ranks with the masked experts (by index);
  // finite inputs never reach that case because top_k <= the experts of the kept groups.
  float sum = 0.0f;
  for (int64_t i = 0; i < top_k; ++i) {
    expert_ids[i] = order[i];
    weights[i] = scores[order[i]];
    sum += weights[i];
  }
  for (int64_t i = 0; i < top_k; ++i) {
    if (routing.renormalize) weights[i] /= sum + kRenormalizeEpsilon;
    weights[i] *= routing.routed_scaling_factor;
  }
}

}  // namespace deltaserve::kernels::cpu
