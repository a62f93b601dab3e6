// Block Attention Residuals mix, CPU reference: per token, a softmax over sources of a learned
// linear score of each RMS-normalised source, applied to the un-normalised sources.
#include "kernels/cpu/attn_res.hpp"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/cpu/thread_pool.hpp"

namespace deltaserve::kernels::cpu {
namespace {

// Tokens per parallel_for range: one token is O(num_sources * dim) work, a few µs at Kimi widths.
constexpr int64_t kTokensPerRange = 16;

}  // namespace

void attn_res_mix(const float* const* sources, int64_t num_sources, const float* norm_weight, const float* proj_weight,
                  float* out, int64_t num_tokens, int64_t dim, float eps) {
  assert(num_sources >= 1 && num_tokens >= 0 && dim >= 1);
  if (num_sources == 1) {
    // softmax over one logit is 1 whatever the logit is (even non-finite): the source, bit for bit.
    std::memcpy(out, sources[0], static_cast<size_t>(num_tokens * dim) * sizeof(float));
    return;
  }
  // Σ_d proj_w[d] · norm_w[d] folded into one vector; the logit is then Σ_d gate[d] · v[d] · rsqrt(mean(v²) + eps).
  std::vector<float> gate(static_cast<size_t>(dim));
  for (int64_t d = 0; d < dim; ++d) gate[d] = proj_weight[d] * norm_weight[d];

  parallel_for(0, num_tokens, kTokensPerRange, [&](int64_t token_begin, int64_t token_end) {
    std::vector<double> logits(static_cast<size_t>(num_sources));
    std::vector<double> mixed(static_cast<size_t>(dim));
    for (int64_t t = token_begin; t < token_end; ++t) {
      // Reductions in fp64, so the reference is accurate to fp32 rounding of the final values.
      double max_logit = -std::numeric_limits<double>::infinity();
      for (int64_t i = 0; i < num_sources; ++i) {
        const float* v = sources[i] + t * dim;
        double sum_squares = 0.0;
        double gated = 0.0;
        for (int64_t d = 0; d < dim; ++d) {
          sum_squares += double(v[d]) * v[d];
          gated += double(gate[d]) * v[d];
        }
        logits[i] = gated / std::sqrt(sum_squares / double(dim) + double(eps));
        max_logit = std::max(max_logit, logits[i]);
      }
      double denominator = 0.0;
      for (double& logit : logits) denominator += (logit = std::exp(logit - max_logit));
      std::fill(mixed.begin(), mixed.end(), 0.0);
      for (int64_t i = 0; i < num_sources; ++i) {
        const double weight = logits[i] / denominator;
        const float* v = sources[i] + t * dim;
        for (int64_t d = 0; d < dim; ++d) mixed[d] += weight * v[d];
      }
      float* o = out + t * dim;
      for (int64_t d = 0; d < dim; ++d) o[d] = static_cast<float>(mixed[d]);
    }
  });
}

}  // namespace deltaserve::kernels::cpu
