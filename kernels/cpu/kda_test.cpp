#include "kernels/cpu/kda.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace deltaserve::kernels::cpu {
namespace {

// Uniform floats in [low, high) from a fixed-seed generator (24 random bits, platform independent).
std::vector<float> random_floats(std::mt19937& generator, size_t n, float low, float high) {
  std::vector<float> values(n);
  for (float& value : values) value = low + (high - low) * static_cast<float>(generator() >> 8) * 0x1p-24f;
  return values;
}

double reference_sigmoid(double x) {
  return 1.0 / (1.0 + std::exp(-x));
}
double reference_silu(double x) {
  return x * reference_sigmoid(x);
}
double reference_softplus(double x) {
  return x > 30.0 ? x : std::log1p(std::exp(x));
}

// max |actual - expected| / max |expected| over all elements; infinity when actual has a NaN or Inf
// (outputs are NaN-poisoned before the call, so an unwritten element fails too).
template <typename Expected>
double max_relative_error(const std::vector<float>& actual, const std::vector<Expected>& expected) {
  double max_difference = 0.0;
  double max_magnitude = 0.0;
  for (size_t i = 0; i < actual.size(); ++i) {
    if (!std::isfinite(actual[i])) return std::numeric_limits<double>::infinity();
    max_difference = std::max(max_difference, std::fabs(double{actual[i]} - double(expected[i])));
    max_magnitude = std::max(max_magnitude, std::fabs(double(expected[i])));
  }
  return max_magnitude == 0.0 ? max_difference : max_difference / max_magnitude;
}

// ---- short convolution ----------------------------------------------------------------------------

TEST(KdaTest, ShortConvMatchesFormula) {
  std::mt19937 generator(11);
  const int64_t channels = 13;
  for (int kernel : {1, 2, 4}) {
    for (int64_t tokens : {1, 2, 9}) {
      const int64_t tail_length = kernel - 1;
      const std::vector<float> x = random_floats(generator, static_cast<size_t>(tokens * channels), -2.0f, 2.0f);
      const std::vector<float> weight = random_floats(generator, static_cast<size_t>(channels * kernel), -1.0f, 1.0f);
      const std::vector<float> initial_tail =
          random_floats(generator, static_cast<size_t>(channels * tail_length), -2.0f, 2.0f);
      std::vector<float> tail = initial_tail;
      std::vector<float> y(x.size());
      short_conv_silu(x.data(), weight.data(), tail.data(), y.data(), tokens, channels, kernel);
      for (int64_t t = 0; t < tokens; ++t) {
        for (int64_t c = 0; c < channels; ++c) {
          // Tap j reads the input j - (K - 1) tokens away from t; before token 0 it reads the tail.
          double sum = 0.0;
          for (int64_t j = 0; j < kernel; ++j) {
            const int64_t source = t + j - tail_length;
            const double input =
                source >= 0 ? x[source * channels + c] : initial_tail[c * tail_length + (source + tail_length)];
            sum += weight[c * kernel + j] * input;
          }
          EXPECT_NEAR(y[t * channels + c], reference_silu(sum), 1e-5) << "K " << kernel << " T " << tokens;
        }
      }
      // The new tail is the last K-1 inputs of tail ‖ x.
      for (int64_t c = 0; c < channels; ++c) {
        for (int64_t j = 0; j < tail_length; ++j) {
          const int64_t source = tokens - tail_length + j;
          const float expected =
              source >= 0 ? x[source * channels + c] : initial_tail[c * tail_length + (source + tail_length)];
          EXPECT_EQ(tail[c * tail_length + j], expected);
        }
      }
    }
  }
}

TEST(KdaTest, ShortConvSplitAcrossCallsEqualsOneCall) {
  std::mt19937 generator(12);
  const int64_t channels = 40;
  const int kernel = 4;
  const int64_t tokens = 23;
  const std::vector<float> x = random_floats(generator, static_cast<size_t>(tokens * channels), -2.0f, 2.0f);
  const std::vector<float> weight = random_floats(generator, static_cast<size_t>(channels * kernel), -1.0f, 1.0f);
  std::vector<float> whole_tail(static_cast<size_t>(channels * (kernel - 1)), 0.0f);
  std::vector<float> whole(x.size());
  short_conv_silu(x.data(), weight.data(), whole_tail.data(), whole.data(), tokens, channels, kernel);
  // Splits include pieces shorter than the tail (1 and 2 tokens) and an empty piece.
  for (std::vector<int64_t> cuts : std::vector<std::vector<int64_t>>{{0}, {1}, {2, 3}, {11}, {5, 5, 22}, {23}}) {
    std::vector<float> tail(whole_tail.size(), 0.0f);
    std::vector<float> pieces(x.size(), -1.0f);
    int64_t start = 0;
    cuts.push_back(tokens);
    for (int64_t cut : cuts) {
      short_conv_silu(x.data() + start * channels, weight.data(), tail.data(), pieces.data() + start * channels,
                      cut - start, channels, kernel);
      start = cut;
    }
    EXPECT_EQ(pieces, whole);
    EXPECT_EQ(tail, whole_tail);
  }
}

// ---- L2 normalisation, gate, output norm ----------------------------------------------------------

TEST(KdaTest, L2NormalizeHeadsMatchesReference) {
  std::mt19937 generator(13);
  const int64_t tokens = 5;
  const int64_t heads = 3;
  const int64_t dim = 32;
  std::vector<float> x = random_floats(generator, static_cast<size_t>(tokens * heads * dim), -3.0f, 3.0f);
  std::fill(x.begin(), x.begin() + dim, 0.0f);  // an all-zero head stays finite (eps)
  const std::vector<float> original = x;
  const float scale = 1.0f / std::sqrt(static_cast<float>(dim));
  l2_normalize_heads(x.data(), tokens, heads, dim, 1e-6f, scale);
  for (int64_t row = 0; row < tokens * heads; ++row) {
    double sum_squares = 0.0;
    for (int64_t d = 0; d < dim; ++d) sum_squares += double{original[row * dim + d]} * original[row * dim + d];
    for (int64_t d = 0; d < dim; ++d) {
      const double expected = original[row * dim + d] * scale / std::sqrt(sum_squares + 1e-6);
      EXPECT_NEAR(x[row * dim + d], expected, 1e-6);
    }
  }
}

TEST(KdaTest, GateMatchesFormulaAndStaysInRange) {
  std::mt19937 generator(14);
  const int64_t tokens = 7;
  const int64_t heads = 3;
  const int64_t dim = 16;
  // Wide raw range so that softplus and sigmoid saturate at both ends.
  const std::vector<float> raw = random_floats(generator, static_cast<size_t>(tokens * heads * dim), -60.0f, 60.0f);
  const std::vector<float> a_log = random_floats(generator, static_cast<size_t>(heads), -2.0f, 2.0f);
  const std::vector<float> dt_bias = random_floats(generator, static_cast<size_t>(heads * dim), -1.0f, 1.0f);
  std::vector<float> unbounded(raw.size());
  std::vector<float> bounded(raw.size());
  const float lower_bound = -5.0f;
  kda_gate(raw.data(), a_log.data(), dt_bias.data(), unbounded.data(), tokens, heads, dim, std::nullopt);
  kda_gate(raw.data(), a_log.data(), dt_bias.data(), bounded.data(), tokens, heads, dim, lower_bound);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t d = 0; d < dim; ++d) {
        const size_t i = static_cast<size_t>((t * heads + h) * dim + d);
        const double pre_activation = double{raw[i]} + dt_bias[h * dim + d];
        const double a = std::exp(double{a_log[h]});
        const double expected_unbounded = -a * reference_softplus(pre_activation);
        const double expected_bounded = lower_bound * reference_sigmoid(a * pre_activation);
        EXPECT_NEAR(unbounded[i], expected_unbounded, 2e-6 * (1.0 + std::fabs(expected_unbounded)));
        EXPECT_NEAR(bounded[i], expected_bounded, 2e-6 * (1.0 + std::fabs(expected_bounded)));
        EXPECT_LE(unbounded[i], 0.0f);
        EXPECT_TRUE(std::isfinite(unbounded[i]));
        EXPECT_GE(bounded[i], lower_bound);
        EXPECT_LE(bounded[i], 0.0f);
      }
    }
  }
}

TEST(KdaTest, GatedOutputNormMatchesReferenceAndAllowsAliasing) {
  std::mt19937 generator(15);
  const int64_t tokens = 4;
  const int64_t heads = 3;
  const int64_t dim = 24;
  const float eps = 1e-5f;
  const size_t n = static_cast<size_t>(tokens * heads * dim);
  const std::vector<float> o = random_floats(generator, n, -2.0f, 2.0f);
  const std::vector<float> gate = random_floats(generator, n, -8.0f, 8.0f);
  const std::vector<float> weight = random_floats(generator, static_cast<size_t>(dim), 0.5f, 1.5f);
  std::vector<float> out(n);
  kda_gated_output_norm(o.data(), gate.data(), weight.data(), out.data(), tokens, heads, dim, eps);
  for (int64_t row = 0; row < tokens * heads; ++row) {
    double mean_square = 0.0;
    for (int64_t d = 0; d < dim; ++d) mean_square += double{o[row * dim + d]} * o[row * dim + d];
    mean_square /= static_cast<double>(dim);
    for (int64_t d = 0; d < dim; ++d) {
      const double expected =
          o[row * dim + d] / std::sqrt(mean_square + eps) * weight[d] * reference_sigmoid(gate[row * dim + d]);
      EXPECT_NEAR(out[row * dim + d], expected, 1e-5 * (1.0 + std::fabs(expected)));
    }
  }
  std::vector<float> in_place = o;
  kda_gated_output_norm(in_place.data(), gate.data(), weight.data(), in_place.data(), tokens, heads, dim, eps);
  EXPECT_EQ(in_place, out);
}

// ---- recurrence and chunked form ------------------------------------------------------------------

// Random inputs of one KDA layer, shaped like the real ones: unit-norm k, q scaled by d_k^-0.5,
// g from either gate form, beta in (0, 1), and a nonzero initial state.
struct KdaCase {
  int64_t tokens, heads, d_k, d_v;
  std::vector<float> q, k, v, g, beta, initial_state;

  KdaInputs inputs(int64_t first_token = 0, std::optional<int64_t> count = std::nullopt) const {
    const int64_t token_count = count.value_or(tokens - first_token);
    return KdaInputs{q.data() + first_token * heads * d_k,
                     k.data() + first_token * heads * d_k,
                     v.data() + first_token * heads * d_v,
                     g.data() + first_token * heads * d_k,
                     beta.data() + first_token * heads,
                     token_count,
                     heads,
                     d_k,
                     d_v};
  }
  size_t output_size() const { return static_cast<size_t>(tokens * heads * d_v); }
};

void normalize_rows(std::vector<float>& x, int64_t dim, double scale) {
  for (size_t row = 0; row * dim < x.size(); ++row) {
    double sum_squares = 0.0;
    for (int64_t d = 0; d < dim; ++d) sum_squares += double{x[row * dim + d]} * x[row * dim + d];
    for (int64_t d = 0; d < dim; ++d)
      x[row * dim + d] = static_cast<float>(x[row * dim + d] * scale / std::sqrt(sum_squares));
  }
}

// decay_scale multiplies the unbounded log-decay (large values reach exp(-gc) overflow territory).
KdaCase make_case(uint32_t seed, int64_t tokens, int64_t heads, int64_t d_k, int64_t d_v,
                  std::optional<float> lower_bound, float decay_scale = 1.0f) {
  std::mt19937 generator(seed);
  KdaCase c{tokens, heads, d_k, d_v, {}, {}, {}, {}, {}, {}};
  const size_t key_size = static_cast<size_t>(tokens * heads * d_k);
  c.q = random_floats(generator, key_size, -1.0f, 1.0f);
  c.k = random_floats(generator, key_size, -1.0f, 1.0f);
  normalize_rows(c.q, d_k, 1.0 / std::sqrt(static_cast<double>(d_k)));
  normalize_rows(c.k, d_k, 1.0);
  c.v = random_floats(generator, static_cast<size_t>(tokens * heads * d_v), -1.0f, 1.0f);
  const std::vector<float> raw = random_floats(generator, key_size, -4.0f, 2.0f);
  c.g.resize(key_size);
  for (size_t i = 0; i < key_size; ++i) {
    c.g[i] = lower_bound.has_value() ? static_cast<float>(*lower_bound * reference_sigmoid(raw[i]))
                                     : static_cast<float>(-decay_scale * reference_softplus(raw[i]) * 0.5);
  }
  c.beta = random_floats(generator, static_cast<size_t>(tokens * heads), 0.05f, 0.95f);
  c.initial_state = random_floats(generator, static_cast<size_t>(heads * d_k * d_v), -0.5f, 0.5f);
  return c;
}

// The recurrence written out in fp64, independent of the library: returns o, updates state.
std::vector<double> reference_recurrence(const KdaCase& c, std::vector<double>& state) {
  std::vector<double> o(c.output_size(), 0.0);
  for (int64_t h = 0; h < c.heads; ++h) {
    double* s = state.data() + h * c.d_k * c.d_v;
    for (int64_t t = 0; t < c.tokens; ++t) {
      const int64_t key = (t * c.heads + h) * c.d_k;
      const int64_t value = (t * c.heads + h) * c.d_v;
      for (int64_t i = 0; i < c.d_k; ++i) {
        for (int64_t j = 0; j < c.d_v; ++j) s[i * c.d_v + j] *= std::exp(double{c.g[key + i]});
      }
      for (int64_t j = 0; j < c.d_v; ++j) {
        double projection = 0.0;  // (S^T k)_j
        for (int64_t i = 0; i < c.d_k; ++i) projection += s[i * c.d_v + j] * c.k[key + i];
        const double update = c.beta[t * c.heads + h] * (c.v[value + j] - projection);
        for (int64_t i = 0; i < c.d_k; ++i) s[i * c.d_v + j] += c.k[key + i] * update;
        double out = 0.0;
        for (int64_t i = 0; i < c.d_k; ++i) out += s[i * c.d_v + j] * c.q[key + i];
        o[value + j] = out;
      }
    }
  }
  return o;
}

TEST(KdaTest, RecurrentMatchesFp64Reference) {
  for (std::optional<float> lower_bound : {std::optional<float>{}, std::optional<float>{-5.0f}}) {
    const KdaCase c = make_case(21, 37, 3, 32, 24, lower_bound);
    std::vector<double> expected_state(c.initial_state.begin(), c.initial_state.end());
    const std::vector<double> expected = reference_recurrence(c, expected_state);
    std::vector<float> state = c.initial_state;
    std::vector<float> o(c.output_size(), std::nanf(""));
    kda_recurrent(c.inputs(), state.data(), o.data());
    EXPECT_LT(max_relative_error(o, expected), 1e-5);
    EXPECT_LT(max_relative_error(state, expected_state), 1e-5);
  }
}

struct ChunkedCase {
  int64_t tokens;
  int64_t chunk_size;
  std::optional<float> lower_bound;
};

class KdaChunkedTest : public ::testing::TestWithParam<ChunkedCase> {};

TEST_P(KdaChunkedTest, MatchesRecurrent) {
  const ChunkedCase param = GetParam();
  const KdaCase c = make_case(31 + static_cast<uint32_t>(param.tokens), param.tokens, 3, 32, 24, param.lower_bound);
  std::vector<float> recurrent_state = c.initial_state;
  std::vector<float> recurrent_o(c.output_size());
  kda_recurrent(c.inputs(), recurrent_state.data(), recurrent_o.data());
  std::vector<float> chunked_state = c.initial_state;
  std::vector<float> chunked_o(c.output_size(), std::nanf(""));
  kda_chunked(c.inputs(), chunked_state.data(), chunked_o.data(), param.chunk_size);

  const double o_error = max_relative_error(chunked_o, recurrent_o);
  const double state_error = max_relative_error(chunked_state, recurrent_state);
  std::printf("  T %3lld chunk %2lld bound %s: max rel error o %.2e state %.2e\n", static_cast<long long>(param.tokens),
              static_cast<long long>(param.chunk_size), param.lower_bound ? "-5" : "no", o_error, state_error);
  EXPECT_LT(o_error, 1e-5);
  EXPECT_LT(state_error, 1e-5);
  if (param.tokens == 0) {
    EXPECT_EQ(chunked_state, c.initial_state);
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, KdaChunkedTest,
                         ::testing::Values(ChunkedCase{0, 16, std::nullopt}, ChunkedCase{1, 16, std::nullopt},
                                           ChunkedCase{1, 64, -5.0f}, ChunkedCase{15, 16, -5.0f},
                                           ChunkedCase{16, 16, std::nullopt}, ChunkedCase{17, 16, -5.0f},
                                           ChunkedCase{64, 64, std::nullopt}, ChunkedCase{64, 64, -5.0f},
                                           ChunkedCase{100, 16, std::nullopt}, ChunkedCase{100, 64, -5.0f},
                                           ChunkedCase{130, 64, std::nullopt}, ChunkedCase{130, 16, -5.0f}),
                         [](const ::testing::TestParamInfo<ChunkedCase>& info) {
                           // Appended piece by piece: GCC 12 warns (-Wrestrict, a false positive) on "literal" +
                           // std::string at -O3.
                           std::string name = "T";
                           name += std::to_string(info.param.tokens);
                           name += "_chunk";
                           name += std::to_string(info.param.chunk_size);
                           name += info.param.lower_bound ? "_bound" : "_nobound";
                           return name;
                         });

TEST(KdaTest, ChunkedMatchesRecurrentAtModelHeadSize) {
  const KdaCase c = make_case(41, 150, 2, 128, 128, -5.0f);
  std::vector<float> recurrent_state = c.initial_state;
  std::vector<float> recurrent_o(c.output_size());
  kda_recurrent(c.inputs(), recurrent_state.data(), recurrent_o.data());
  std::vector<float> chunked_state = c.initial_state;
  std::vector<float> chunked_o(c.output_size(), std::nanf(""));
  kda_chunked(c.inputs(), chunked_state.data(), chunked_o.data(), 64);
  const double o_error = max_relative_error(chunked_o, recurrent_o);
  const double state_error = max_relative_error(chunked_state, recurrent_state);
  std::printf("  d 128 T 150 chunk 64: max rel error o %.2e state %.2e\n", o_error, state_error);
  EXPECT_LT(o_error, 1e-5);
  EXPECT_LT(state_error, 1e-5);
}

TEST(KdaTest, ChunkedStaysFiniteUnderStrongDecay) {
  // Per-token log-decay down to about -25 without a bound: exp(-cumulative) of a chunk overflows fp32,
  // so only a form that never forms it stays finite.
  const KdaCase c = make_case(51, 70, 2, 16, 16, std::nullopt, 20.0f);
  std::vector<float> recurrent_state = c.initial_state;
  std::vector<float> recurrent_o(c.output_size());
  kda_recurrent(c.inputs(), recurrent_state.data(), recurrent_o.data());
  std::vector<float> chunked_state = c.initial_state;
  std::vector<float> chunked_o(c.output_size(), std::nanf(""));
  kda_chunked(c.inputs(), chunked_state.data(), chunked_o.data(), 64);
  for (float value : chunked_o) ASSERT_TRUE(std::isfinite(value));
  const double o_error = max_relative_error(chunked_o, recurrent_o);
  std::printf("  strong decay T 70 chunk 64: max rel error o %.2e\n", o_error);
  EXPECT_LT(o_error, 1e-5);
  EXPECT_LT(max_relative_error(chunked_state, recurrent_state), 1e-5);
}

TEST(KdaTest, ChainedCallsEqualOneCall) {
  const KdaCase c = make_case(61, 90, 2, 32, 24, -5.0f);
  std::vector<float> whole_state = c.initial_state;
  std::vector<float> whole_o(c.output_size());
  kda_recurrent(c.inputs(), whole_state.data(), whole_o.data());

  const std::vector<int64_t> cuts = {0, 1, 20, 20, 57, 90};  // includes an empty and a one-token piece
  for (bool chunked : {false, true}) {
    std::vector<float> state = c.initial_state;
    std::vector<float> o(c.output_size(), std::nanf(""));
    for (size_t piece = 0; piece + 1 < cuts.size(); ++piece) {
      const KdaInputs inputs = c.inputs(cuts[piece], cuts[piece + 1] - cuts[piece]);
      float* o_piece = o.data() + cuts[piece] * c.heads * c.d_v;
      if (chunked) {
        kda_chunked(inputs, state.data(), o_piece, 16);
      } else {
        kda_recurrent(inputs, state.data(), o_piece);
      }
    }
    if (chunked) {
      const double o_error = max_relative_error(o, whole_o);
      std::printf("  chained chunked vs one recurrent call: max rel error o %.2e\n", o_error);
      EXPECT_LT(o_error, 1e-5);
      EXPECT_LT(max_relative_error(state, whole_state), 1e-5);
    } else {
      // Token by token, the cut points change nothing.
      EXPECT_EQ(o, whole_o);
      EXPECT_EQ(state, whole_state);
    }
  }
}

}  // namespace
}  // namespace deltaserve::kernels::cpu
