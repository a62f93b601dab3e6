#include "kernels/cpu/mla.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include <gtest/gtest.h>

namespace deltaserve::kernels::cpu {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// One attention problem with NaN poison everywhere the op must not read: the padding after each
// cache row, the rows after the last visible one (first_position + T - 1 .. context_len and beyond).
struct MlaCase {
  MlaDims dims;
  int64_t num_tokens;
  int64_t first_position;
  int64_t context_len;
  int64_t cache_stride;
  std::vector<float> q;      // [T, H, nope + rope]
  std::vector<float> cache;  // [context_len + 2 poisoned rows, cache_stride]
  std::vector<float> kv_b;   // [H * (nope + v), rank]
};

MlaDims make_dims(int64_t heads, int64_t rank, int64_t nope, int64_t rope, int64_t v_head) {
  return MlaDims{heads, rank, nope, rope, v_head, 1.0f / std::sqrt(static_cast<float>(nope + rope))};
}

MlaCase make_case(const MlaDims& dims, int64_t num_tokens, int64_t first_position, int64_t context_len,
                  int64_t row_padding, uint32_t seed) {
  MlaCase c{dims, num_tokens, first_position, context_len, dims.kv_lora_rank + dims.qk_rope + row_padding, {}, {}, {}};
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t q_width = dims.qk_nope + dims.qk_rope;
  c.q.resize(static_cast<size_t>(num_tokens * dims.num_heads * q_width));
  for (float& x : c.q) x = normal(rng);
  const int64_t total_rows = context_len + 2;
  c.cache.assign(static_cast<size_t>(total_rows * c.cache_stride), kNaN);
  const int64_t visible = first_position + num_tokens;
  for (int64_t j = 0; j < visible; ++j) {
    for (int64_t i = 0; i < dims.kv_lora_rank + dims.qk_rope; ++i) c.cache[j * c.cache_stride + i] = normal(rng);
  }
  // kv_b scaled so that W_UK c has O(1) entries: scores then spread over a useful range.
  const float w_scale = 1.0f / std::sqrt(static_cast<float>(dims.kv_lora_rank));
  c.kv_b.resize(static_cast<size_t>(dims.num_heads * (dims.qk_nope + dims.v_head) * dims.kv_lora_rank));
  for (float& x : c.kv_b) x = normal(rng) * w_scale * 2.0f;
  return c;
}

// Straightforward fp64 reference: per head materialise K = [W_UK c ‖ k_rot] and V = W_UV c.
std::vector<double> reference(const MlaCase& c) {
  const MlaDims& d = c.dims;
  const int64_t q_width = d.qk_nope + d.qk_rope;
  std::vector<double> out(static_cast<size_t>(c.num_tokens * d.num_heads * d.v_head), 0.0);
  for (int64_t h = 0; h < d.num_heads; ++h) {
    const float* w_uk = c.kv_b.data() + h * (d.qk_nope + d.v_head) * d.kv_lora_rank;
    const float* w_uv = w_uk + d.qk_nope * d.kv_lora_rank;
    const int64_t visible = c.first_position + c.num_tokens;
    std::vector<std::vector<double>> keys(visible, std::vector<double>(q_width));
    std::vector<std::vector<double>> values(visible, std::vector<double>(d.v_head));
    for (int64_t j = 0; j < visible; ++j) {
      const float* row = c.cache.data() + j * c.cache_stride;
      for (int64_t r = 0; r < d.qk_nope; ++r) {
        double acc = 0.0;
        for (int64_t i = 0; i < d.kv_lora_rank; ++i) acc += double(w_uk[r * d.kv_lora_rank + i]) * row[i];
        keys[j][r] = acc;
      }
      for (int64_t r = 0; r < d.qk_rope; ++r) keys[j][d.qk_nope + r] = row[d.kv_lora_rank + r];
      for (int64_t r = 0; r < d.v_head; ++r) {
        double acc = 0.0;
        for (int64_t i = 0; i < d.kv_lora_rank; ++i) acc += double(w_uv[r * d.kv_lora_rank + i]) * row[i];
        values[j][r] = acc;
      }
    }
    for (int64_t t = 0; t < c.num_tokens; ++t) {
      const float* qh = c.q.data() + (t * d.num_heads + h) * q_width;
      const int64_t seen = c.first_position + t + 1;
      std::vector<double> scores(seen);
      for (int64_t j = 0; j < seen; ++j) {
        double s = 0.0;
        for (int64_t i = 0; i < q_width; ++i) s += double(qh[i]) * keys[j][i];
        scores[j] = s * d.softmax_scale;
      }
      const double max_score = *std::max_element(scores.begin(), scores.end());
      double sum = 0.0;
      for (double& s : scores) sum += (s = std::exp(s - max_score));
      double* o = out.data() + (t * d.num_heads + h) * d.v_head;
      for (int64_t j = 0; j < seen; ++j) {
        for (int64_t r = 0; r < d.v_head; ++r) o[r] += scores[j] / sum * values[j][r];
      }
    }
  }
  return out;
}

enum class Form { kNaive, kAbsorbed };

std::vector<float> run(const MlaCase& c, Form form) {
  std::vector<float> out(static_cast<size_t>(c.num_tokens * c.dims.num_heads * c.dims.v_head), kNaN);
  auto* fn = form == Form::kNaive ? &mla_attention_naive : &mla_attention_absorbed;
  fn(c.dims, c.q.data(), c.num_tokens, c.first_position, c.cache.data(), c.cache_stride, c.context_len, c.kv_b.data(),
     out.data());
  return out;
}

template <class A, class B>
double max_abs_diff(const std::vector<A>& a, const std::vector<B>& b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double diff = std::abs(double(a[i]) - double(b[i]));
    if (!(diff <= worst)) worst = diff;  // NaN propagates as a failure
  }
  return worst;
}

// Checks both forms against the fp64 reference and each other; returns max |naive - absorbed|.
double check_case(const MlaCase& c, double tolerance) {
  const std::vector<double> expected = reference(c);
  const std::vector<float> naive = run(c, Form::kNaive);
  const std::vector<float> absorbed = run(c, Form::kAbsorbed);
  const double naive_vs_absorbed = max_abs_diff(naive, absorbed);
  EXPECT_LE(max_abs_diff(naive, expected), tolerance);
  EXPECT_LE(max_abs_diff(absorbed, expected), tolerance);
  EXPECT_LE(naive_vs_absorbed, tolerance);
  return naive_vs_absorbed;
}

TEST(MlaAttention, DecodeLastPosition) {
  const MlaCase c = make_case(make_dims(4, 32, 16, 8, 12), 1, 36, 37, 0, 1);
  const double diff = check_case(c, 2e-5);
  RecordProperty("max_abs_naive_vs_absorbed", std::to_string(diff));
}

TEST(MlaAttention, PrefillWithOffsetAndPaddedStride) {
  // first_position > 0, several tokens, rows padded by 7 NaN values, unseen rows NaN.
  const MlaCase c = make_case(make_dims(3, 24, 8, 4, 10), 5, 9, 20, 7, 2);
  check_case(c, 2e-5);
}

TEST(MlaAttention, SingleRowContext) {
  // context_len 1: softmax over one row is exactly 1, so out = W_UV c_0.
  const MlaCase c = make_case(make_dims(2, 16, 8, 4, 8), 1, 0, 1, 3, 3);
  check_case(c, 1e-5);
}

TEST(MlaAttention, KimiDimsDecodeAndPrefill) {
  const MlaDims dims = make_dims(4, 512, 128, 64, 128);
  const MlaCase decode = make_case(dims, 1, 47, 48, 64, 4);
  const double decode_diff = check_case(decode, 1e-4);
  const MlaCase prefill = make_case(dims, 6, 10, 24, 0, 5);
  const double prefill_diff = check_case(prefill, 1e-4);
  RecordProperty("max_abs_naive_vs_absorbed_decode", std::to_string(decode_diff));
  RecordProperty("max_abs_naive_vs_absorbed_prefill", std::to_string(prefill_diff));
}

TEST(MlaAttention, PrefillEqualsTokenByTokenDecode) {
  // Causality: query t of a prefill sees exactly what a decode at position first_position + t sees.
  const MlaCase prefill = make_case(make_dims(2, 16, 8, 4, 6), 4, 3, 7, 2, 6);
  for (Form form : {Form::kNaive, Form::kAbsorbed}) {
    const std::vector<float> all = run(prefill, form);
    for (int64_t t = 0; t < prefill.num_tokens; ++t) {
      MlaCase step = prefill;
      const int64_t q_size = prefill.dims.num_heads * (prefill.dims.qk_nope + prefill.dims.qk_rope);
      step.q.assign(prefill.q.begin() + t * q_size, prefill.q.begin() + (t + 1) * q_size);
      step.num_tokens = 1;
      step.first_position = prefill.first_position + t;
      step.context_len = step.first_position + 1;
      const std::vector<float> one = run(step, form);
      const int64_t out_size = prefill.dims.num_heads * prefill.dims.v_head;
      for (int64_t i = 0; i < out_size; ++i) EXPECT_EQ(one[i], all[t * out_size + i]) << "t=" << t << " i=" << i;
    }
  }
}

TEST(MlaAttention, LargeScoresStayFinite) {
  // Scores in the hundreds: an unshifted exp would overflow.
  MlaCase c = make_case(make_dims(2, 16, 8, 4, 6), 3, 5, 8, 1, 7);
  for (float& x : c.q) x *= 60.0f;
  check_case(c, 1e-3);
  for (float x : run(c, Form::kAbsorbed)) EXPECT_TRUE(std::isfinite(x));
}

TEST(MlaAttention, ZeroTokensWritesNothing) {
  const MlaCase c = make_case(make_dims(2, 16, 8, 4, 6), 0, 4, 4, 0, 8);
  float sentinel = 42.0f;
  mla_attention_naive(c.dims, c.q.data(), 0, 4, c.cache.data(), c.cache_stride, 4, c.kv_b.data(), &sentinel);
  mla_attention_absorbed(c.dims, c.q.data(), 0, 4, c.cache.data(), c.cache_stride, 4, c.kv_b.data(), &sentinel);
  EXPECT_EQ(sentinel, 42.0f);
}

}  // namespace
}  // namespace deltaserve::kernels::cpu
