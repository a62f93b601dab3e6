// Block Attention Residuals, CPU reference (token-local, fp32).
#pragma once

#include <cstdint>

namespace deltaserve::kernels::cpu {

// For each of T tokens: given n sources v_i (each [T, dim], token-major),
//   logit_i = Σ_d proj_w[d] · norm_w[d] · v_i[d] · rsqrt(mean(v_i²) + eps)
//   out     = Σ_i softmax(logit)_i · v_i
// With n == 1, out = v_0 exactly. out: [T, dim], must not alias a source. eps >= 0 (0 is fine for nonzero v).
// Reductions, softmax and the weighted sum in fp64, rounded once to fp32; parallel over tokens.
void attn_res_mix(const float* const* sources, int64_t num_sources, const float* norm_weight, const float* proj_weight,
                  float* out, int64_t num_tokens, int64_t dim, float eps);

}  // namespace deltaserve::kernels::cpu
