#include "engine/sampler.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace deltaserve::engine {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

std::vector<float> random_logits(int64_t vocab, uint32_t seed, float stddev = 2.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, stddev);
  std::vector<float> logits(static_cast<size_t>(vocab));
  for (float& x : logits) x = normal(rng);
  return logits;
}

int32_t argmax(const std::vector<float>& logits) {
  int32_t best = 0;
  for (int32_t i = 1; i < static_cast<int32_t>(logits.size()); ++i) {
    if (logits[i] > logits[best]) best = i;
  }
  return best;
}

// log-softmax computed independently, in long double.
std::vector<double> log_softmax(const std::vector<float>& logits, double temperature = 1.0) {
  long double max_value = -INFINITY;
  for (float x : logits) max_value = std::max<long double>(max_value, x / temperature);
  long double sum = 0.0L;
  for (float x : logits) sum += std::exp(x / temperature - max_value);
  std::vector<double> out;
  for (float x : logits) out.push_back(static_cast<double>(x / temperature - max_value - std::log(sum)));
  return out;
}

std::vector<int32_t> draw(const SamplingParams& params, const std::vector<float>& logits, int count) {
  Sampler sampler(params);
  std::vector<int32_t> tokens;
  for (int i = 0; i < count; ++i) tokens.push_back(sampler.sample(logits).token);
  return tokens;
}

// Pearson chi-square of observed counts against expected probabilities (cells with p = 0 must be empty).
double chi_square(const std::vector<int>& counts, const std::vector<double>& probabilities, int draws) {
  double statistic = 0.0;
  for (size_t i = 0; i < counts.size(); ++i) {
    if (probabilities[i] == 0.0) {
      EXPECT_EQ(counts[i], 0) << "token " << i << " has probability 0";
      continue;
    }
    const double expected = probabilities[i] * draws;
    statistic += (counts[i] - expected) * (counts[i] - expected) / expected;
  }
  return statistic;
}

TEST(Sampler, GreedyPicksArgmaxTiesToLowestId) {
  const std::vector<float> logits = {0.5f, 3.0f, -1.0f, 3.0f, 2.9f};
  Sampler sampler(SamplingParams{.temperature = 0.0f});
  for (int i = 0; i < 5; ++i) EXPECT_EQ(sampler.sample(logits).token, 1);
  const std::vector<float> random = random_logits(1000, 1);
  EXPECT_EQ(sampler.sample(random).token, argmax(random));
}

TEST(Sampler, TopKOneIsGreedyAtAnyTemperature) {
  const std::vector<float> logits = random_logits(500, 2);
  for (float temperature : {0.1f, 1.0f, 2.0f}) {
    for (int32_t token : draw({.temperature = temperature, .top_k = 1, .seed = 7}, logits, 50)) {
      EXPECT_EQ(token, argmax(logits)) << "temperature " << temperature;
    }
  }
}

TEST(Sampler, TinyTopPIsGreedy) {
  const std::vector<float> logits = random_logits(500, 3, 0.5f);  // flat: the argmax has small mass
  for (int32_t token : draw({.temperature = 1.5f, .top_p = 1e-6f, .seed = 8}, logits, 50)) {
    EXPECT_EQ(token, argmax(logits));
  }
}

TEST(Sampler, SameSeedSameSequenceDifferentSeedsDiffer) {
  const std::vector<float> logits = random_logits(100, 4, 0.5f);
  for (SamplingParams params : {SamplingParams{.seed = 1}, SamplingParams{.top_p = 0.9f, .top_k = 50, .seed = 1}}) {
    const std::vector<int32_t> first = draw(params, logits, 200);
    EXPECT_EQ(first, draw(params, logits, 200));
    params.seed = 2;
    EXPECT_NE(first, draw(params, logits, 200));
  }
}

TEST(Sampler, GoldenSequenceIsPlatformIndependent) {
  // Locks the RNG, the draw and the summation orders: any change here changes users' seeded outputs.
  const std::vector<float> logits = {0.1f, -0.4f, 1.3f, 0.0f, 0.7f, -2.0f, 0.9f, 0.25f};
  EXPECT_EQ(draw({.temperature = 0.8f, .seed = 1234}, logits, 16),
            (std::vector<int32_t>{0, 6, 4, 6, 1, 6, 2, 2, 4, 4, 3, 2, 2, 4, 2, 6}));
  EXPECT_EQ(draw({.temperature = 1.2f, .top_p = 0.7f, .top_k = 5, .seed = 99}, logits, 16),
            (std::vector<int32_t>{2, 6, 2, 4, 4, 2, 2, 2, 4, 6, 4, 2, 2, 2, 2, 6}));
}

TEST(Sampler, RandomGeneratorsMatchPublishedValues) {
  uint64_t state = 0;
  EXPECT_EQ(splitmix64_next(state), 0xe220a8397b1dcdafULL);
  EXPECT_EQ(splitmix64_next(state), 0x6e789e6aa1b965f4ULL);
  EXPECT_EQ(splitmix64_next(state), 0x06c45d188009454fULL);
  Xoshiro256StarStar rng = Xoshiro256StarStar::from_state({1, 2, 3, 4});
  EXPECT_EQ(rng.next(), 11520ULL);
  EXPECT_EQ(rng.next(), 0ULL);
  EXPECT_EQ(rng.next(), 1509978240ULL);
  EXPECT_EQ(rng.next(), 1215971899390074240ULL);
}

TEST(Sampler, EmpiricalFrequenciesMatchSoftmax) {
  const std::vector<float> logits = {1.0f, 0.2f, -0.5f, 2.0f, 0.0f, -1.5f, 1.4f, 0.6f};
  const double temperature = 0.8;
  const int draws = 20000;
  std::vector<int> counts(logits.size(), 0);
  for (int32_t token : draw({.temperature = 0.8f, .seed = 42}, logits, draws)) ++counts[token];
  std::vector<double> probabilities;
  for (double lp : log_softmax(logits, temperature)) probabilities.push_back(std::exp(lp));
  // 7 degrees of freedom: P(chi² > 35) ≈ 1e-5; the seed is fixed, so this is deterministic anyway.
  EXPECT_LT(chi_square(counts, probabilities, draws), 35.0);
}

TEST(Sampler, TopKThenTopPFrequenciesMatchRenormalisedNucleus) {
  // Probabilities at T = 1 ∝ {8, 4, 2, 1, 1, 0.5, 0.25}. top_k = 5 keeps {0, 1, 2, 3, 4} (3 and 4 tie,
  // both kept), mass 16; top_p = 0.8 needs 12.8: 8, 12, 14 → keeps {0, 1, 2}, renormalised to 8/14, 4/14, 2/14.
  std::vector<float> logits;
  for (double p : {8.0, 4.0, 2.0, 1.0, 1.0, 0.5, 0.25}) logits.push_back(static_cast<float>(std::log(p)));
  const int draws = 20000;
  std::vector<int> counts(logits.size(), 0);
  for (int32_t token : draw({.top_p = 0.8f, .top_k = 5, .seed = 5}, logits, draws)) ++counts[token];
  const std::vector<double> expected = {8.0 / 14, 4.0 / 14, 2.0 / 14, 0, 0, 0, 0};
  EXPECT_LT(chi_square(counts, expected, draws), 20.0);  // 2 degrees of freedom: P(> 20) ≈ 5e-5

  // top_p = 0.9 needs 14.4: keeps {0, 1, 2, 3}; the tie between 3 and 4 goes to the lower id.
  std::set<int32_t> seen;
  for (int32_t token : draw({.top_p = 0.9f, .top_k = 5, .seed = 6}, logits, 2000)) seen.insert(token);
  EXPECT_EQ(seen, (std::set<int32_t>{0, 1, 2, 3}));
}

TEST(Sampler, TopPWithoutTopKOverLargeVocabulary) {
  // Nucleus larger than one sort chunk: every kept token is among the best by logit, none outside.
  std::vector<float> logits = random_logits(5000, 9, 0.3f);
  std::vector<float> sorted = logits;
  std::sort(sorted.rbegin(), sorted.rend());
  Sampler sampler({.top_p = 0.5f, .seed = 10});
  std::vector<double> probabilities;
  for (double lp : log_softmax(logits)) probabilities.push_back(std::exp(lp));
  // Threshold logit: the nucleus is the prefix of `sorted` reaching mass 0.5.
  std::vector<double> sorted_probabilities = probabilities;
  std::sort(sorted_probabilities.rbegin(), sorted_probabilities.rend());
  double mass = 0.0;
  size_t nucleus = 0;
  while (mass < 0.5) mass += sorted_probabilities[nucleus++];
  ASSERT_GT(nucleus, 256u);
  for (int i = 0; i < 200; ++i) EXPECT_GE(logits[sampler.sample(logits).token], sorted[nucleus - 1]);
}

TEST(Sampler, PartitionedNucleusFrequenciesMatchRenormalisedNucleus) {
  // A nucleus of well over 64 tokens goes through the quickselect path; its kept set and frequencies
  // must match the sorted definition computed here.
  const std::vector<float> logits = random_logits(400, 12, 0.7f);
  const double temperature = 1.3;
  const float top_p = 0.6f;
  std::vector<double> probabilities;
  for (double lp : log_softmax(logits, temperature)) probabilities.push_back(std::exp(lp));
  std::vector<int32_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
  std::vector<double> expected(logits.size(), 0.0);
  double mass = 0.0;
  size_t kept = 0;
  while (mass < top_p) mass += probabilities[order[kept++]];
  ASSERT_GT(kept, 100u);
  for (size_t i = 0; i < kept; ++i) expected[order[i]] = probabilities[order[i]] / mass;

  const int draws = 20000;
  std::vector<int> counts(logits.size(), 0);
  for (int32_t token : draw({.temperature = 1.3f, .top_p = top_p, .seed = 13}, logits, draws)) ++counts[token];
  // kept - 1 degrees of freedom (> 100): mean ≈ kept, sd ≈ sqrt(2 kept); the bound is ~6 sd above.
  EXPECT_LT(chi_square(counts, expected, draws), kept + 6.0 * std::sqrt(2.0 * kept));
}

TEST(Sampler, LogprobsAreRawLogSoftmax) {
  const std::vector<float> logits = random_logits(1000, 11);
  const std::vector<double> expected = log_softmax(logits);
  // Temperature and filters change the draw, never the reported logprobs.
  Sampler sampler({.temperature = 0.5f, .top_p = 0.9f, .top_k = 40, .seed = 3, .top_logprobs = 5});
  for (int i = 0; i < 20; ++i) {
    const SampledToken sampled = sampler.sample(logits);
    EXPECT_NEAR(sampled.logprob, expected[sampled.token], 1e-5);
    ASSERT_EQ(sampled.top.size(), 5u);
    std::vector<int32_t> order(logits.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
    for (size_t k = 0; k < 5; ++k) {
      EXPECT_EQ(sampled.top[k].token, order[k]);
      EXPECT_NEAR(sampled.top[k].logprob, expected[order[k]], 1e-5);
    }
  }
}

TEST(Sampler, TopLogprobsTiesAndSmallVocabulary) {
  const std::vector<float> logits = {1.0f, 2.0f, 2.0f};
  Sampler sampler({.temperature = 0.0f, .top_logprobs = 20});
  const SampledToken sampled = sampler.sample(logits);
  EXPECT_EQ(sampled.token, 1);
  ASSERT_EQ(sampled.top.size(), 3u);  // capped at the vocabulary
  EXPECT_EQ(sampled.top[0].token, 1);
  EXPECT_EQ(sampled.top[1].token, 2);
  EXPECT_EQ(sampled.top[2].token, 0);
  EXPECT_FLOAT_EQ(sampled.top[0].logprob, sampled.top[1].logprob);
}

TEST(Sampler, MaskedAndNaNTokensAreNeverSampled) {
  std::vector<float> logits = {kNegInf, 0.0f, std::numeric_limits<float>::quiet_NaN(), 0.0f, kNegInf};
  for (SamplingParams params : {SamplingParams{.temperature = 2.0f}, SamplingParams{.top_p = 0.99f, .top_k = 4}}) {
    for (int32_t token : draw(params, logits, 500)) EXPECT_TRUE(token == 1 || token == 3) << token;
  }
  Sampler sampler({});
  EXPECT_NEAR(sampler.sample(logits).logprob, std::log(0.5), 1e-6);
  // Every token masked: taken as uniform, not a crash or NaN.
  const std::vector<float> all_masked(4, kNegInf);
  const SampledToken sampled = sampler.sample(all_masked);
  EXPECT_GE(sampled.token, 0);
  EXPECT_LT(sampled.token, 4);
  EXPECT_NEAR(sampled.logprob, -std::log(4.0), 1e-6);
}

TEST(Sampler, PositiveInfinityTiesShareTheMass) {
  // +inf counts as FLT_MAX: two of them tie, each with half the mass (not logprob 0 from FLT_MAX + log 2 == FLT_MAX).
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> logits = {1.0f, inf, -2.0f, inf};
  Sampler sampler({.temperature = 0.0f, .top_logprobs = 2});
  const SampledToken sampled = sampler.sample(logits);
  EXPECT_EQ(sampled.token, 1);
  EXPECT_NEAR(sampled.logprob, std::log(0.5), 1e-6);
  ASSERT_EQ(sampled.top.size(), 2u);
  EXPECT_EQ(sampled.top[1].token, 3);
  EXPECT_NEAR(sampled.top[1].logprob, std::log(0.5), 1e-6);
}

TEST(Sampler, SingleTokenVocabulary) {
  const std::vector<float> logits = {-3.0f};
  for (int32_t token : draw({.top_p = 0.3f, .seed = 1}, logits, 10)) EXPECT_EQ(token, 0);
  EXPECT_EQ(Sampler({}).sample(logits).logprob, 0.0f);
}

TEST(Sampler, EveryCallTakesExactlyTheDrawPeekShows) {
  const std::vector<float> logits = random_logits(300, 12);
  for (SamplingParams params : {SamplingParams{.temperature = 0.0f, .seed = 5}, SamplingParams{.seed = 5},
                                SamplingParams{.top_p = 0.5f, .top_k = 10, .seed = 5}}) {
    Xoshiro256StarStar stream(5);
    Sampler sampler(params);
    for (int i = 0; i < 6; ++i) {
      const double expected = stream.next_unit();
      EXPECT_EQ(sampler.peek_draw(), expected);
      EXPECT_EQ(sampler.peek_draw(), expected) << "peeking takes nothing";
      if (i % 2 == 0) {
        (void)sampler.sample(logits);
      } else {
        EXPECT_EQ(sampler.next_draw(), expected);
      }
    }
  }
}

// A sampler started at draw k (a resumed request) continues the stream of one that already took k draws.
TEST(Sampler, StartedAtADrawContinuesTheStream) {
  const std::vector<float> logits = random_logits(300, 13);
  const SamplingParams params{.temperature = 0.9f, .top_p = 0.8f, .seed = 77};
  Sampler whole(params);
  std::vector<int32_t> tokens;
  for (int i = 0; i < 12; ++i) tokens.push_back(whole.sample(logits).token);
  for (int64_t k : {0, 1, 5, 11}) {
    Sampler resumed(params, k);
    for (int64_t i = k; i < 12; ++i) EXPECT_EQ(resumed.sample(logits).token, tokens[static_cast<size_t>(i)]) << k;
  }
}

// The rule given a Sampler's draw is what that Sampler returns, bit for bit (sample() is the rule after its draw);
// without logprobs the token is the same and nothing else is reported.
TEST(SamplingRule, GivenTheDrawEqualsSampler) {
  const std::vector<float> logits = random_logits(2000, 13, 1.0f);
  const std::vector<SamplingParams> cases = {
      {.temperature = 0.0f, .top_logprobs = 3},
      {.temperature = 0.9f, .seed = 1},
      {.temperature = 1.2f, .top_k = 40, .seed = 2, .top_logprobs = 20},
      {.temperature = 0.7f, .top_p = 0.9f, .seed = 3, .top_logprobs = 1},  // nucleus over > 64 candidates
      {.temperature = 1.0f, .top_p = 0.6f, .top_k = 30, .seed = 4},
      {.temperature = 1.5f, .top_k = 1, .seed = 6, .top_logprobs = 5},
  };
  SamplingRule rule;  // one rule across rows, as a batch uses it
  for (const SamplingParams& params : cases) {
    Sampler sampler(params), drawer(params);
    for (int step = 0; step < 8; ++step) {
      const double draw = drawer.next_draw();
      const SampledToken expected = sampler.sample(logits);
      const SampledToken got = rule.apply({params, draw, /*logprobs=*/true}, logits);
      EXPECT_EQ(got.token, expected.token) << "seed " << params.seed << " step " << step;
      EXPECT_EQ(got.logprob, expected.logprob);
      ASSERT_EQ(got.top.size(), expected.top.size());
      for (size_t k = 0; k < got.top.size(); ++k) {
        EXPECT_EQ(got.top[k].token, expected.top[k].token);
        EXPECT_EQ(got.top[k].logprob, expected.top[k].logprob);
      }
      const SampledToken bare = rule.apply({params, draw, /*logprobs=*/false}, logits);
      EXPECT_EQ(bare.token, expected.token);
      EXPECT_EQ(bare.logprob, 0.0f);
      EXPECT_TRUE(bare.top.empty());
    }
  }
}

TEST(SamplingRule, SampleRowsAppliesTheRulePerRow) {
  const std::vector<std::vector<float>> logits = {random_logits(50, 14), random_logits(50, 15), random_logits(50, 16)};
  const std::vector<SampleRequest> rows = {{{.temperature = 0.0f}, 0.5, true},
                                           {{.temperature = 1.0f, .top_logprobs = 2}, 0.25, true},
                                           {{.temperature = 1.0f, .top_k = 5}, 0.75, false}};
  std::vector<SampledToken> out = {{1, 1.0f, {}}};  // replaced, not appended to
  sample_rows(logits, rows, out);
  ASSERT_EQ(out.size(), 3u);
  for (size_t i = 0; i < rows.size(); ++i) {
    SamplingRule rule;
    const SampledToken expected = rule.apply(rows[i], logits[i]);
    EXPECT_EQ(out[i].token, expected.token) << i;
    EXPECT_EQ(out[i].logprob, expected.logprob) << i;
    EXPECT_EQ(out[i].top.size(), expected.top.size()) << i;
  }
  EXPECT_EQ(out[0].token, argmax(logits[0]));
}

TEST(SampleRequestValidate, ChecksParamsAndDraw) {
  EXPECT_TRUE(validate_request({{}, 0.0, false}).is_ok());
  EXPECT_TRUE(validate_request({{}, std::nextafter(1.0, 0.0), true}).is_ok());
  for (double draw : {-1e-300, 1.0, 2.0, std::numeric_limits<double>::quiet_NaN()}) {
    const Status status = validate_request({{}, draw, false});
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << draw;
    EXPECT_NE(status.message().find("draw"), std::string::npos) << status.message();
  }
  const Status status = validate_request({{.top_p = 0.0f}, 0.5, false});
  EXPECT_NE(status.message().find("top_p"), std::string::npos) << status.message();
}

TEST(SamplingParamsValidate, AcceptsBoundaries) {
  EXPECT_TRUE(validate({}).is_ok());
  EXPECT_TRUE(validate({.temperature = 0.0f}).is_ok());
  EXPECT_TRUE(validate({.temperature = 2.0f, .top_p = 1.0f, .top_k = 1000000, .top_logprobs = 20}).is_ok());
}

TEST(SamplingParamsValidate, RejectsEachFieldByName) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<std::pair<SamplingParams, std::string>> cases = {
      {{.temperature = -0.1f}, "temperature"},
      {{.temperature = 2.01f}, "temperature"},
      {{.temperature = nan}, "temperature"},
      {{.top_p = 0.0f}, "top_p"},
      {{.top_p = 1.5f}, "top_p"},
      {{.top_p = nan}, "top_p"},
      {{.top_k = -1}, "top_k"},
      {{.top_logprobs = -1}, "top_logprobs"},
      {{.top_logprobs = 21}, "top_logprobs"},
  };
  for (const auto& [params, field] : cases) {
    const Status status = validate(params);
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << field;
    EXPECT_NE(status.message().find(field), std::string::npos) << status.message();
  }
}

}  // namespace
}  // namespace deltaserve::engine
