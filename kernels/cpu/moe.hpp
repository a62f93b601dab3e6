// Mixture-of-Experts routing, CPU reference.
#pragma once

#include <cstdint>

namespace deltaserve::kernels::cpu {

struct MoeRouting {
  int64_t num_experts;
  int64_t top_k;
  int64_t num_expert_groups = 1;  // grouped top-k (DeepSeek-V3 style) when > 1
  int64_t top_k_groups = 1;
  bool renormalize = true;
  float routed_scaling_factor = 1.0f;
};

// For one token: s = sigmoid(logits); choose the top_k experts by (s + correction_bias) (bias may be nullptr);
// weights = s of the chosen (the bias is NOT part of the weights); if renormalize: w /= (sum(w) + 1e-20);
// then w *= routed_scaling_factor. With groups: a group's score is the sum of its two best (s + bias),
// only experts of the best top_k_groups groups compete (num_experts % groups == 0; a group of one expert
// scores that expert; requires top_k <= top_k_groups · group size).
// Ties break toward the lower expert index (groups too); a NaN choice score ranks as -inf. Outputs are ordered by
// descending choice score.
//   logits: [num_experts] fp32; expert_ids: [top_k] out; weights: [top_k] out.
void moe_route(const MoeRouting& routing, const float* logits, const float* correction_bias, int32_t* expert_ids,
               float* weights);

}  // namespace deltaserve::kernels::cpu
