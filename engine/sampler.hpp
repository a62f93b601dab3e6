// Token sampling from one row of logits: greedy, temperature, top-k, top-p (nucleus), with the
// OpenAI-style logprobs of the raw distribution. Deterministic: the same params (seed included) and
// the same logits give the same tokens on every platform (own RNG, fixed summation orders, fp64 exp).
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <vector>

#include "common/status.hpp"

namespace deltaserve::engine {

struct SamplingParams {
  float temperature = 1.0f;  // [0, 2]; 0 = greedy
  float top_p = 1.0f;        // (0, 1]; 1 = off
  int32_t top_k = 0;         // >= 0; 0 = off; larger than the vocabulary = off
  uint64_t seed = 0;         // used as is; the API layer picks one when the request has none
  int32_t top_logprobs = 0;  // alternatives to report, [0, 20]
};

struct TokenLogprob {
  int32_t token;
  float logprob;  // natural log
};

struct SampledToken {
  int32_t token;
  float logprob;                  // log-softmax of the raw logits (temperature 1, no top-k/top-p), as OpenAI reports
  std::vector<TokenLogprob> top;  // top_logprobs best by raw logprob, descending, ties toward the lower id
};

// Checks every field's range; the message names the offending field. Untrusted (request) input.
[[nodiscard]] Status validate(const SamplingParams& params);

// splitmix64: advances `state` and returns the next output. Used to seed Xoshiro256StarStar.
uint64_t splitmix64_next(uint64_t& state);

// xoshiro256** 1.0 (Blackman & Vigna), exactly as published: portable, 256-bit state.
class Xoshiro256StarStar {
 public:
  // State = four consecutive splitmix64 outputs starting from `seed`.
  explicit Xoshiro256StarStar(uint64_t seed);
  // For known-answer tests; must not be all zero.
  static Xoshiro256StarStar from_state(const std::array<uint64_t, 4>& state);

  uint64_t next();
  // Uniform in [0, 1): the top 53 bits of next() times 2^-53.
  double next_unit();

 private:
  Xoshiro256StarStar() = default;
  std::array<uint64_t, 4> state_{};
};

// One sampler per sequence; it owns the RNG stream, so the k-th call of a sequence always uses the k-th
// random value (every call draws exactly one, greedy included), and a sequence can be replayed from
// (params, logits). Not thread-safe; cheap to construct.
//
// Logits: [vocab] fp32, vocab >= 1. -inf masks a token (never chosen unless every token is masked, then the
// distribution is taken as uniform); NaN is treated as -inf, +inf as the largest finite float.
// Non-greedy: z = logits / temperature; keep the top_k highest (ties toward the lower id); keep the smallest
// prefix of those, by descending probability, whose cumulative renormalised probability reaches top_p
// (at least one token); draw from the kept tokens renormalised. Greedy (temperature 0 or top_k 1): the
// argmax, ties toward the lowest id. All exp/log and sums in fp64.
class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);  // params must pass validate()

  SampledToken sample(std::span<const float> logits);

  const SamplingParams& params() const { return params_; }

 private:
  // Makes order_[0, count) the `count` best tokens by (value desc, id asc), sorted; count <= vocab.
  void sort_prefix(int64_t count);
  // Reorders order_[0, count) (the candidates, weights_ set) so that order_[0, n) is the nucleus, the fewest
  // best tokens whose weights sum to >= needed_mass, and returns n (>= 1; count if never reached). The
  // nucleus is left in a deterministic but unsorted order; the sorted prefix is invalidated.
  int64_t select_nucleus(int64_t count, double needed_mass);

  SamplingParams params_;
  Xoshiro256StarStar rng_;
  // Per-call scratch, kept across calls to avoid vocab-sized allocations per token.
  std::vector<float> values_;    // [vocab] logits after the NaN / ±inf rules above (all 0 when all masked)
  std::vector<double> weights_;  // [vocab] exp((value - max) / temperature), only when drawing
  std::vector<int32_t> order_;   // token ids; [0, sorted_) sorted best first, the rest not better than those
  int64_t sorted_ = 0;
};

}  // namespace deltaserve::engine
