// Token sampling from one row of logits: greedy, temperature, top-k, top-p (nucleus), with the
// OpenAI-style logprobs of the raw distribution. Deterministic: the same params (seed included) and
// the same logits give the same tokens on every platform (own RNG, fixed summation orders, fp64 exp).
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <vector>

#include "common/status.hpp"
#include "engine/request_types.hpp"

namespace deltaserve::engine {

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

// One row for a backend to sample (Backend::forward_sample): the request's params and the draw its Sampler takes
// for this step (Sampler::peek_draw / next_draw), so that the choice is the one Sampler::sample makes.
struct SampleRequest {
  SamplingParams params;  // must pass validate()
  double draw = 0.0;      // uniform in [0, 1)
  bool logprobs = false;  // report logprob and params.top_logprobs alternatives; false: logprob 0, no alternatives
};

// Checks the params (as validate above) and that the draw lies in [0, 1).
[[nodiscard]] Status validate_request(const SampleRequest& request);

// The sampling rule (see Sampler below) for one row given its draw. Sampler::sample is this after taking its draw;
// callers that hold the draws of several requests (Backend::forward_sample's CPU default) use it directly, so the
// rule exists once. Holds only per-call scratch, kept across calls to avoid vocab-sized allocations per token.
// Not thread-safe; cheap to construct.
class SamplingRule {
 public:
  // request must pass validate_request(); logits as in the Sampler comment.
  SampledToken apply(const SampleRequest& request, std::span<const float> logits);

 private:
  // Makes order_[0, count) the `count` best tokens by (value desc, id asc), sorted; count <= vocab.
  void sort_prefix(int64_t count);
  // Reorders order_[0, count) (the candidates, weights_ set) so that order_[0, n) is the nucleus, the fewest
  // best tokens whose weights sum to >= needed_mass, and returns n (>= 1; count if never reached). The
  // nucleus is left in a deterministic but unsorted order; the sorted prefix is invalidated.
  int64_t select_nucleus(int64_t count, double needed_mass);

  std::vector<float> values_;    // [vocab] logits after the NaN / ±inf rules below (all 0 when all masked)
  std::vector<double> weights_;  // [vocab] exp((value - max) / temperature), only when drawing
  std::vector<int32_t> order_;   // token ids; [0, sorted_) sorted best first, the rest not better than those
  int64_t sorted_ = 0;
};

// The rule over a batch: out[i] = SamplingRule::apply(rows[i], logits[i]) (logits[i]: [vocab]).
void sample_rows(std::span<const std::vector<float>> logits, std::span<const SampleRequest> rows,
                 std::vector<SampledToken>& out);

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
//
// Sampling elsewhere (a backend on the device): give it peek_draw() with the params, and call next_draw() once
// the result is in, so that the stream advances exactly as sample() would have advanced it.
//
// Position: the stream is a function of (seed, draw index) alone, so a sampler can start anywhere in it. A request
// resumed after k tokens (its earlier tokens sampled elsewhere, e.g. by a decode worker that was lost) continues with
// Sampler(params, k) and draws exactly what the uninterrupted sampler would have drawn from its (k+1)-th call on.
class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);  // params must pass validate()
  // The sampler of `params` after `draws_taken` (>= 0) calls of sample() / next_draw(). Skips that many RNG steps
  // (a few nanoseconds each).
  Sampler(const SamplingParams& params, int64_t draws_taken);

  // Takes one draw and applies the rule with logprobs (logprob and params.top_logprobs alternatives).
  SampledToken sample(std::span<const float> logits);
  // The draw the next sample() or next_draw() takes, without taking it.
  double peek_draw() const;
  // Takes the next draw without sampling (what sample() does first).
  double next_draw() { return rng_.next_unit(); }

  const SamplingParams& params() const { return params_; }

 private:
  SamplingParams params_;
  Xoshiro256StarStar rng_;
  SamplingRule rule_;
};

}  // namespace deltaserve::engine
