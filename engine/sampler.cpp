#include "engine/sampler.hpp"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstdio>
#include <limits>
#include <numeric>
#include <string>

namespace deltaserve::engine {
namespace {

constexpr float kMaxTemperature = 2.0f;
constexpr int32_t kMaxTopLogprobs = 20;
// The nucleus search sorts ranges up to this size instead of partitioning them further.
constexpr int64_t kNucleusSortBelow = 64;

std::string format_float(float x) {
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "%g", static_cast<double>(x));
  return buffer;
}

uint64_t rotate_left(uint64_t x, int k) {
  return (x << k) | (x >> (64 - k));
}

}  // namespace

Status validate(const SamplingParams& params) {
  // Written as !(in range) so that NaN is rejected too.
  if (!(params.temperature >= 0.0f && params.temperature <= kMaxTemperature)) {
    return invalid_argument("temperature must be in [0, 2], got " + format_float(params.temperature));
  }
  if (!(params.top_p > 0.0f && params.top_p <= 1.0f)) {
    return invalid_argument("top_p must be in (0, 1], got " + format_float(params.top_p));
  }
  if (params.top_k < 0) {
    return invalid_argument("top_k must be >= 0 (0 = off), got " + std::to_string(params.top_k));
  }
  if (params.top_logprobs < 0 || params.top_logprobs > kMaxTopLogprobs) {
    return invalid_argument("top_logprobs must be in [0, 20], got " + std::to_string(params.top_logprobs));
  }
  return Status::ok();
}

uint64_t splitmix64_next(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

Xoshiro256StarStar::Xoshiro256StarStar(uint64_t seed) {
  // splitmix64 never yields four zero outputs in a row, so the state is valid for every seed.
  for (uint64_t& word : state_) word = splitmix64_next(seed);
}

Xoshiro256StarStar Xoshiro256StarStar::from_state(const std::array<uint64_t, 4>& state) {
  assert((state[0] | state[1] | state[2] | state[3]) != 0);
  Xoshiro256StarStar rng;
  rng.state_ = state;
  return rng;
}

uint64_t Xoshiro256StarStar::next() {
  const uint64_t result = rotate_left(state_[1] * 5, 7) * 9;
  const uint64_t t = state_[1] << 17;
  state_[2] ^= state_[0];
  state_[3] ^= state_[1];
  state_[1] ^= state_[2];
  state_[0] ^= state_[3];
  state_[2] ^= t;
  state_[3] = rotate_left(state_[3], 45);
  return result;
}

double Xoshiro256StarStar::next_unit() {
  return static_cast<double>(next() >> 11) * 0x1.0p-53;
}

Status validate_request(const SampleRequest& request) {
  DS_RETURN_IF_ERROR(validate(request.params));
  if (!(request.draw >= 0.0 && request.draw < 1.0)) {
    char buffer[48];
    std::snprintf(buffer, sizeof(buffer), "%.17g", request.draw);
    return invalid_argument(std::string("draw must be in [0, 1), got ") + buffer);
  }
  return Status::ok();
}

Sampler::Sampler(const SamplingParams& params) : params_(params), rng_(params.seed) {
  assert(validate(params).is_ok());
}

Sampler::Sampler(const SamplingParams& params, int64_t draws_taken) : Sampler(params) {
  assert(draws_taken >= 0);
  for (int64_t i = 0; i < draws_taken; ++i) (void)rng_.next();
}

SampledToken Sampler::sample(std::span<const float> logits) {
  return rule_.apply(SampleRequest{params_, next_draw(), /*logprobs=*/true}, logits);  // one draw: see the class
}

double Sampler::peek_draw() const {
  Xoshiro256StarStar copy = rng_;
  return copy.next_unit();
}

void sample_rows(std::span<const std::vector<float>> logits, std::span<const SampleRequest> rows,
                 std::vector<SampledToken>& out) {
  assert(logits.size() == rows.size());
  thread_local SamplingRule rule;  // its vocab-sized scratch is kept across steps, as a Sampler keeps its own
  out.clear();
  out.reserve(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) out.push_back(rule.apply(rows[i], logits[i]));
}

int64_t SamplingRule::select_nucleus(int64_t count, double needed_mass) {
  const float* values = values_.data();
  const auto better = [values](int32_t a, int32_t b) { return values[a] != values[b] ? values[a] > values[b] : a < b; };
  // Quickselect on mass over order_[lo, hi): own pivot and partition rules (no std::nth_element, whose
  // result is implementation-defined), so the kept set and its order are the same on every platform.
  int64_t lo = 0;
  int64_t hi = count;
  double needed = needed_mass;  // still needed from order_[lo, hi)
  while (hi - lo > kNucleusSortBelow) {
    // Median of three as the pivot, moved to hi - 1.
    const int64_t mid = lo + (hi - lo) / 2;
    if (better(order_[mid], order_[lo])) std::swap(order_[mid], order_[lo]);
    if (better(order_[hi - 1], order_[lo])) std::swap(order_[hi - 1], order_[lo]);
    if (better(order_[hi - 1], order_[mid])) std::swap(order_[hi - 1], order_[mid]);
    std::swap(order_[mid], order_[hi - 1]);
    const int32_t pivot = order_[hi - 1];
    int64_t split = lo;  // order_[lo, split) better than the pivot
    double better_mass = 0.0;
    for (int64_t i = lo; i < hi - 1; ++i) {
      if (better(order_[i], pivot)) {
        better_mass += weights_[order_[i]];
        std::swap(order_[i], order_[split++]);
      }
    }
    std::swap(order_[split], order_[hi - 1]);
    if (better_mass >= needed) {
      hi = split;
    } else if (better_mass + weights_[pivot] >= needed) {
      sorted_ = 0;
      return split + 1;
    } else {
      needed -= better_mass + weights_[pivot];
      lo = split + 1;
    }
  }
  std::sort(order_.begin() + lo, order_.begin() + hi, better);
  sorted_ = 0;
  double cumulative = 0.0;
  for (int64_t i = lo; i < hi; ++i) {
    cumulative += weights_[order_[i]];
    if (cumulative >= needed) return i + 1;
  }
  return hi;  // rounding: the whole range
}

void SamplingRule::sort_prefix(int64_t count) {
  if (count <= sorted_) return;
  // Elements past sorted_ are all not better than those before it, so sorting a further slice of the
  // suffix extends the sorted prefix.
  const float* values = values_.data();
  const auto better = [values](int32_t a, int32_t b) { return values[a] != values[b] ? values[a] > values[b] : a < b; };
  const auto rest = static_cast<int64_t>(order_.size()) - sorted_;
  if (count - sorted_ > rest / 4) {
    // A large share of the rest: a full sort beats a heap-based partial sort.
    std::sort(order_.begin() + sorted_, order_.end(), better);
    sorted_ = static_cast<int64_t>(order_.size());
  } else {
    std::partial_sort(order_.begin() + sorted_, order_.begin() + count, order_.end(), better);
    sorted_ = count;
  }
}

SampledToken SamplingRule::apply(const SampleRequest& request, std::span<const float> logits) {
  assert(!logits.empty() && logits.size() <= static_cast<size_t>(std::numeric_limits<int32_t>::max()));
  assert(validate_request(request).is_ok());
  const auto vocab = static_cast<int32_t>(logits.size());
  const SamplingParams& params = request.params;
  const double random_unit = request.draw;

  values_.resize(logits.size());
  float max_value = -std::numeric_limits<float>::infinity();
  int32_t argmax = 0;
  for (int32_t i = 0; i < vocab; ++i) {
    float v = logits[i];
    if (std::isnan(v)) v = -std::numeric_limits<float>::infinity();
    if (v == std::numeric_limits<float>::infinity()) v = std::numeric_limits<float>::max();
    values_[i] = v;
    if (v > max_value) {
      max_value = v;
      argmax = i;
    }
  }
  if (max_value == -std::numeric_limits<float>::infinity()) {
    std::fill(values_.begin(), values_.end(), 0.0f);
    max_value = 0.0f;
  }
  double raw_sum = 0.0;  // Σ exp(value - max), index order
  for (int32_t i = 0; i < vocab; ++i) raw_sum += std::exp(double(values_[i]) - max_value);
  // logprob(v) = (v - max) - log Σ e^(v - max): the max is subtracted first, so +inf logits (= FLT_MAX) that tie
  // still share the mass (FLT_MAX + log 2 would round back to FLT_MAX in fp64).
  const double log_sum = std::log(raw_sum);
  auto logprob = [&](int32_t id) { return static_cast<float>((double(values_[id]) - max_value) - log_sum); };

  order_.resize(logits.size());
  std::iota(order_.begin(), order_.end(), 0);
  sorted_ = 0;

  int32_t token = argmax;
  const int64_t top_k = params.top_k > 0 ? std::min<int64_t>(params.top_k, vocab) : vocab;
  if (params.temperature > 0.0f && top_k > 1) {
    const double inverse_temperature = 1.0 / static_cast<double>(params.temperature);
    weights_.resize(logits.size());
    double total = 0.0;  // whole vocabulary, index order
    for (int32_t i = 0; i < vocab; ++i)
      total += (weights_[i] = std::exp((double(values_[i]) - max_value) * inverse_temperature));

    // Candidates: the whole vocabulary in index order (no filter), else the nucleus of the top-k set, sorted.
    const int32_t* candidates = nullptr;
    int64_t num_candidates = vocab;
    double candidate_mass = total;
    if (top_k < vocab || params.top_p < 1.0f) {
      double top_k_mass = total;
      if (top_k < vocab) {
        sort_prefix(top_k);
        top_k_mass = 0.0;
        for (int64_t i = 0; i < top_k; ++i) top_k_mass += weights_[order_[i]];
      }
      // Nucleus: the smallest prefix, in (value desc, id asc) order, with mass >= top_p · mass (>= 1 token).
      const int64_t kept = params.top_p < 1.0f ? select_nucleus(top_k, top_k_mass * params.top_p) : top_k;
      double kept_mass = top_k_mass;
      if (kept < top_k) {
        kept_mass = 0.0;
        for (int64_t i = 0; i < kept; ++i) kept_mass += weights_[order_[i]];
      }
      candidates = order_.data();
      num_candidates = kept;
      candidate_mass = kept_mass;
    }
    // Inverse CDF over the candidates; zero-weight (masked) tokens are skipped. The argmax (weight 1)
    // is the fallback when rounding puts the target at the very top of the range.
    const double target = random_unit * candidate_mass;
    double cumulative = 0.0;
    for (int64_t i = 0; i < num_candidates; ++i) {
      const int32_t candidate = candidates != nullptr ? candidates[i] : static_cast<int32_t>(i);
      const double w = weights_[candidate];
      if (w <= 0.0) continue;
      cumulative += w;
      if (cumulative > target) {
        token = candidate;
        break;
      }
    }
  }

  if (!request.logprobs) return SampledToken{token, 0.0f, {}};
  SampledToken result{token, logprob(token), {}};
  const int64_t num_top = std::min<int64_t>(params.top_logprobs, vocab);
  if (num_top > 0) {
    sort_prefix(num_top);
    result.top.reserve(static_cast<size_t>(num_top));
    for (int64_t i = 0; i < num_top; ++i) {
      result.top.push_back({order_[i], logprob(order_[i])});
    }
  }
  return result;
}

}  // namespace deltaserve::engine
