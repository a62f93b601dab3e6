#include "kernels/cpu/moe.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include <gtest/gtest.h>

namespace deltaserve::kernels::cpu {
namespace {

// logit whose sigmoid is exactly p (up to fp32 rounding): sigmoid(log(p / (1 - p))) = p.
float logit_of(double p) {
  return static_cast<float>(std::log(p / (1.0 - p)));
}

struct Routed {
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

Routed route(const MoeRouting& routing, const std::vector<double>& probabilities, const std::vector<float>& bias = {}) {
  std::vector<float> logits;
  for (double p : probabilities) logits.push_back(logit_of(p));
  Routed r{std::vector<int32_t>(routing.top_k, -1), std::vector<float>(routing.top_k, -1.0f)};
  moe_route(routing, logits.data(), bias.empty() ? nullptr : bias.data(), r.ids.data(), r.weights.data());
  return r;
}

void expect_weights(const std::vector<float>& actual, const std::vector<double>& expected) {
  ASSERT_EQ(actual.size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) EXPECT_NEAR(actual[i], expected[i], 1e-6 * std::abs(expected[i]) + 1e-7);
}

TEST(MoeRoute, TopKBySigmoidRenormalized) {
  const MoeRouting routing{.num_experts = 4, .top_k = 2};
  const Routed r = route(routing, {0.2, 0.9, 0.5, 0.75});
  EXPECT_EQ(r.ids, (std::vector<int32_t>{1, 3}));
  expect_weights(r.weights, {0.9 / 1.65, 0.75 / 1.65});
}

TEST(MoeRoute, BiasChangesSelectionNotWeights) {
  // s = [0.2, 0.9, 0.5, 0.75]; s + bias = [0.2, 0.9, 1.0, 0.75]: expert 2 enters and ranks first,
  // but its weight comes from s = 0.5 alone.
  const MoeRouting routing{.num_experts = 4, .top_k = 2, .routed_scaling_factor = 2.446f};
  const Routed r = route(routing, {0.2, 0.9, 0.5, 0.75}, {0.0f, 0.0f, 0.5f, 0.0f});
  EXPECT_EQ(r.ids, (std::vector<int32_t>{2, 1}));
  expect_weights(r.weights, {0.5 / 1.4 * 2.446, 0.9 / 1.4 * 2.446});
}

TEST(MoeRoute, NoRenormalizeKeepsSigmoidTimesScaling) {
  const MoeRouting routing{.num_experts = 4, .top_k = 2, .renormalize = false, .routed_scaling_factor = 2.446f};
  const Routed r = route(routing, {0.2, 0.9, 0.5, 0.75}, {0.0f, 0.0f, 0.5f, 0.0f});
  EXPECT_EQ(r.ids, (std::vector<int32_t>{2, 1}));
  expect_weights(r.weights, {0.5 * 2.446, 0.9 * 2.446});
}

TEST(MoeRoute, TiesGoToLowerIndex) {
  const MoeRouting routing{.num_experts = 5, .top_k = 3};
  const Routed r = route(routing, {0.3, 0.7, 0.3, 0.7, 0.3});
  EXPECT_EQ(r.ids, (std::vector<int32_t>{1, 3, 0}));
  expect_weights(r.weights, {0.7 / 1.7, 0.7 / 1.7, 0.3 / 1.7});
}

TEST(MoeRoute, GroupedTopKUsesSumOfTwoBestPerGroup) {
  // Groups of 2: g0 [0.9, 0.1] = 1.0, g1 [0.6, 0.5] = 1.1, g2 [0.8, 0.25] = 1.05, g3 [0.2, 0.2] = 0.4.
  // Best two groups: g1, g2. Expert 0 has the best single score but its group loses.
  const MoeRouting routing{.num_experts = 8, .top_k = 3, .num_expert_groups = 4, .top_k_groups = 2};
  const std::vector<double> s = {0.9, 0.1, 0.6, 0.5, 0.8, 0.25, 0.2, 0.2};
  const Routed r = route(routing, s);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{4, 2, 3}));
  expect_weights(r.weights, {0.8 / 1.9, 0.6 / 1.9, 0.5 / 1.9});

  // Without groups the same scores pick expert 0 first.
  const Routed flat = route(MoeRouting{.num_experts = 8, .top_k = 3}, s);
  EXPECT_EQ(flat.ids, (std::vector<int32_t>{0, 4, 2}));
}

TEST(MoeRoute, GroupScoresIncludeBias) {
  // bias +1 on expert 7: g3 = 0.2 + 1.2 = 1.4 now beats g1 = 1.1; weights still from s.
  const MoeRouting routing{.num_experts = 8, .top_k = 3, .num_expert_groups = 4, .top_k_groups = 2};
  const std::vector<float> bias = {0, 0, 0, 0, 0, 0, 0, 1.0f};
  const Routed r = route(routing, {0.9, 0.1, 0.6, 0.5, 0.8, 0.25, 0.2, 0.2}, bias);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{7, 2, 3}));
  expect_weights(r.weights, {0.2 / 1.3, 0.6 / 1.3, 0.5 / 1.3});
}

// Brute-force reference: full sort of all experts, in fp64.
Routed reference_route(const MoeRouting& routing, const std::vector<float>& logits, const std::vector<float>& bias) {
  const int64_t n = routing.num_experts;
  std::vector<double> s(n), choice(n);
  for (int64_t e = 0; e < n; ++e) {
    s[e] = 1.0 / (1.0 + std::exp(-double(logits[e])));
    choice[e] = s[e] + bias[e];
  }
  const int64_t group_size = n / routing.num_expert_groups;
  std::vector<double> group_score(routing.num_expert_groups);
  for (int64_t g = 0; g < routing.num_expert_groups; ++g) {
    std::vector<double> members(choice.begin() + g * group_size, choice.begin() + (g + 1) * group_size);
    std::sort(members.rbegin(), members.rend());
    group_score[g] = members[0] + members[1];
  }
  std::vector<int32_t> groups(routing.num_expert_groups);
  std::iota(groups.begin(), groups.end(), 0);
  std::stable_sort(groups.begin(), groups.end(), [&](int32_t a, int32_t b) { return group_score[a] > group_score[b]; });
  std::vector<int32_t> candidates;
  for (int64_t e = 0; e < n; ++e) {
    if (std::find(groups.begin(), groups.begin() + routing.top_k_groups, e / group_size) !=
        groups.begin() + routing.top_k_groups) {
      candidates.push_back(static_cast<int32_t>(e));
    }
  }
  std::stable_sort(candidates.begin(), candidates.end(), [&](int32_t a, int32_t b) { return choice[a] > choice[b]; });
  Routed r;
  double sum = 0.0;
  for (int64_t i = 0; i < routing.top_k; ++i) sum += s[candidates[i]];
  for (int64_t i = 0; i < routing.top_k; ++i) {
    r.ids.push_back(candidates[i]);
    r.weights.push_back(static_cast<float>(s[candidates[i]] / sum * routing.routed_scaling_factor));
  }
  return r;
}

TEST(MoeRoute, KimiShapesMatchBruteForce) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  const MoeRouting configs[] = {
      {.num_experts = 256, .top_k = 8, .routed_scaling_factor = 2.446f},
      {.num_experts = 256, .top_k = 8, .num_expert_groups = 8, .top_k_groups = 4, .routed_scaling_factor = 2.5f},
      {.num_experts = 896, .top_k = 16, .routed_scaling_factor = 2.0f},
  };
  for (const MoeRouting& routing : configs) {
    for (int trial = 0; trial < 20; ++trial) {
      std::vector<float> logits(routing.num_experts), bias(routing.num_experts);
      for (float& x : logits) x = normal(rng);
      for (float& x : bias) x = 0.1f * normal(rng);
      const Routed expected = reference_route(routing, logits, bias);
      Routed actual{std::vector<int32_t>(routing.top_k), std::vector<float>(routing.top_k)};
      moe_route(routing, logits.data(), bias.data(), actual.ids.data(), actual.weights.data());
      EXPECT_EQ(actual.ids, expected.ids) << "experts " << routing.num_experts << " trial " << trial;
      for (int64_t i = 0; i < routing.top_k; ++i) EXPECT_NEAR(actual.weights[i], expected.weights[i], 2e-6);
    }
  }
}

}  // namespace
}  // namespace deltaserve::kernels::cpu
