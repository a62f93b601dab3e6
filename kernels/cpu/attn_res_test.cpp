#include "kernels/cpu/attn_res.hpp"

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include <gtest/gtest.h>

namespace deltaserve::kernels::cpu {
namespace {

using Sources = std::vector<std::vector<float>>;  // [num_sources][num_tokens * dim]

std::vector<float> mix(const Sources& sources, const std::vector<float>& norm_weight,
                       const std::vector<float>& proj_weight, int64_t num_tokens, int64_t dim, float eps) {
  std::vector<const float*> pointers;
  for (const auto& s : sources) pointers.push_back(s.data());
  std::vector<float> out(static_cast<size_t>(num_tokens * dim), std::numeric_limits<float>::quiet_NaN());
  attn_res_mix(pointers.data(), static_cast<int64_t>(pointers.size()), norm_weight.data(), proj_weight.data(),
               out.data(), num_tokens, dim, eps);
  return out;
}

// model.md §2, written out literally in fp64.
std::vector<double> direct_formula(const Sources& sources, const std::vector<float>& norm_weight,
                                   const std::vector<float>& proj_weight, int64_t num_tokens, int64_t dim, float eps) {
  std::vector<double> out(static_cast<size_t>(num_tokens * dim), 0.0);
  for (int64_t t = 0; t < num_tokens; ++t) {
    std::vector<double> logits;
    for (const auto& s : sources) {
      double mean_square = 0.0;
      for (int64_t d = 0; d < dim; ++d) mean_square += double(s[t * dim + d]) * s[t * dim + d] / dim;
      const double rsqrt = 1.0 / std::sqrt(mean_square + eps);
      double logit = 0.0;
      for (int64_t d = 0; d < dim; ++d) logit += double(proj_weight[d]) * norm_weight[d] * s[t * dim + d] * rsqrt;
      logits.push_back(logit);
    }
    double sum = 0.0;
    for (double logit : logits) sum += std::exp(logit);
    for (size_t i = 0; i < sources.size(); ++i) {
      for (int64_t d = 0; d < dim; ++d) out[t * dim + d] += std::exp(logits[i]) / sum * sources[i][t * dim + d];
    }
  }
  return out;
}

std::vector<float> random_vector(std::mt19937& rng, int64_t n, float stddev, float mean = 0.0f) {
  std::normal_distribution<float> normal(mean, stddev);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = normal(rng);
  return v;
}

TEST(AttnResMix, MatchesDirectFormulaInDouble) {
  std::mt19937 rng(21);
  const int64_t num_tokens = 37;  // > one parallel range
  const int64_t dim = 96;
  for (int64_t num_sources : {2, 3, 9}) {
    Sources sources;
    for (int64_t i = 0; i < num_sources; ++i) sources.push_back(random_vector(rng, num_tokens * dim, 1.0f + i));
    const std::vector<float> norm_weight = random_vector(rng, dim, 0.2f, 1.0f);
    const std::vector<float> proj_weight = random_vector(rng, dim, 0.3f);
    const std::vector<float> out = mix(sources, norm_weight, proj_weight, num_tokens, dim, 1e-6f);
    const std::vector<double> expected = direct_formula(sources, norm_weight, proj_weight, num_tokens, dim, 1e-6f);
    for (size_t i = 0; i < out.size(); ++i) {
      ASSERT_NEAR(out[i], expected[i], 1e-6 * (1.0 + std::abs(expected[i]))) << "sources " << num_sources << " i " << i;
    }
  }
}

TEST(AttnResMix, OneSourceIsExactlyThatSource) {
  std::mt19937 rng(22);
  const int64_t num_tokens = 5;
  const int64_t dim = 16;
  Sources sources = {random_vector(rng, num_tokens * dim, 3.0f)};
  sources[0][3] = 1e-30f;  // values a multiply-by-weight round trip could perturb
  sources[0][7] = -0.0f;
  sources[0][9] = 3.4e38f;
  const std::vector<float> out =
      mix(sources, random_vector(rng, dim, 1.0f), random_vector(rng, dim, 1.0f), num_tokens, dim, 1e-6f);
  EXPECT_EQ(std::memcmp(out.data(), sources[0].data(), out.size() * sizeof(float)), 0);
}

TEST(AttnResMix, InvariantToConstantLogitShift) {
  // Sources with four ±1 entries on dims [0, 6) (|v|² = 4 exactly); u = (4, 4) on dims {6, 7} is orthogonal to
  // all of them. With eps = 0, rms(v + u) / rms(v) = sqrt(36 / 4) = 3 exactly, so adding u to every source and
  // tripling proj_weight shifts every logit by the same gate·u / rms(v) (> 1000, far past exp overflow even
  // in fp64) and changes nothing else: the mix must be the old mix + u.
  const int64_t dim = 8;
  const int64_t support = 6;
  const float eps = 0.0f;
  const Sources sources = {
      {1, 1, 1, 1, 0, 0, 0, 0}, {1, -1, 0, 0, 1, 1, 0, 0}, {0, 0, -1, 1, 1, -1, 0, 0}, {-1, 0, 1, -1, 0, 1, 0, 0}};
  std::mt19937 rng(23);
  const std::vector<float> norm_weight = random_vector(rng, dim, 0.1f, 1.0f);
  std::vector<float> proj_weight = random_vector(rng, dim, 1.0f);
  proj_weight[6] = 100.0f;
  proj_weight[7] = 100.0f;
  const std::vector<float> base = mix(sources, norm_weight, proj_weight, 1, dim, eps);

  const float u = 4.0f;
  Sources shifted = sources;
  for (auto& v : shifted) v[6] = v[7] = u;
  std::vector<float> shifted_proj = proj_weight;
  for (float& w : shifted_proj) w *= 3.0f;
  const double shift =
      (double(proj_weight[6]) * norm_weight[6] + double(proj_weight[7]) * norm_weight[7]) * u / std::sqrt(4.0 / dim);
  ASSERT_GT(shift, 1000.0);

  const std::vector<float> out = mix(shifted, norm_weight, shifted_proj, 1, dim, eps);
  for (int64_t d = 0; d < support; ++d) EXPECT_NEAR(out[d], base[d], 1e-6) << d;
  EXPECT_NEAR(out[6], u, 1e-6);
  EXPECT_NEAR(out[7], u, 1e-6);
  // The unshifted weights are not degenerate (several sources contribute).
  int nonzero = 0;
  for (int64_t d = 0; d < support; ++d) nonzero += std::abs(base[d]) > 1e-3f;
  EXPECT_GE(nonzero, 3);
}

TEST(AttnResMix, DominantSourceWinsAndStaysFinite) {
  // Logits in the thousands: the source with the largest logit gets weight 1, nothing overflows.
  const int64_t dim = 4;
  const Sources sources = {{1, 0, 0, 0}, {0, 1, 0, 0}, {0, 0, 2, 0}};
  const std::vector<float> norm_weight = {1, 1, 1, 1};
  const std::vector<float> proj_weight = {1000, 2000, 3000, 0};
  const std::vector<float> out = mix(sources, norm_weight, proj_weight, 1, dim, 1e-6f);
  EXPECT_EQ(out, (std::vector<float>{0, 0, 2, 0}));
}

TEST(AttnResMix, ZeroSourceDoesNotProduceNaN) {
  // The running prefix is 0 right after a block is sealed: rsqrt(0 + eps) is finite, its logit is 0.
  const int64_t dim = 4;
  const Sources sources = {{1, 2, 3, 4}, {0, 0, 0, 0}};
  const std::vector<float> out = mix(sources, {1, 1, 1, 1}, {0.5f, -0.5f, 0.25f, 0}, 1, dim, 1e-6f);
  const std::vector<double> expected = direct_formula(sources, {1, 1, 1, 1}, {0.5f, -0.5f, 0.25f, 0}, 1, dim, 1e-6f);
  for (int64_t d = 0; d < dim; ++d) EXPECT_NEAR(out[d], expected[d], 1e-6);
}

}  // namespace
}  // namespace deltaserve::kernels::cpu
