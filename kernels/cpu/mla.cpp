// MLA (NoPE) CPU reference: naive (materialised K/V) and absorbed (latent-space) forms.
#include "kernels/cpu/mla.hpp"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/cpu/thread_pool.hpp"

namespace deltaserve::kernels::cpu {
namespace {

float dot_f32(const float* a, const float* b, int64_t n) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

void check_contract(const MlaDims& dims, int64_t num_tokens, int64_t first_position, int64_t cache_stride,
                    int64_t context_len) {
  assert(dims.num_heads > 0 && dims.kv_lora_rank > 0 && dims.qk_nope > 0 && dims.qk_rope >= 0 && dims.v_head > 0);
  assert(num_tokens >= 0 && first_position >= 0);
  assert(first_position + num_tokens <= context_len);
  assert(cache_stride >= dims.kv_lora_rank + dims.qk_rope);
  (void)dims, (void)num_tokens, (void)first_position, (void)cache_stride, (void)context_len;
}

// In place: scores[0..n) -> exp(scores - max); returns 1 / Σ exp (sum in fp64). n >= 1.
float exp_shifted_inplace(float* scores, int64_t n) {
  float max_score = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) max_score = std::max(max_score, scores[j]);
  double sum = 0.0;
  for (int64_t j = 0; j < n; ++j) {
    scores[j] = std::exp(scores[j] - max_score);
    sum += scores[j];
  }
  return static_cast<float>(1.0 / sum);
}

}  // namespace

void mla_attention_naive(const MlaDims& dims, const float* q, int64_t num_tokens, int64_t first_position,
                         const float* cache, int64_t cache_stride, int64_t context_len, const float* kv_b, float* out) {
  check_contract(dims, num_tokens, first_position, cache_stride, context_len);
  if (num_tokens == 0) return;
  const int64_t rank = dims.kv_lora_rank;
  const int64_t nope = dims.qk_nope;
  const int64_t rope = dims.qk_rope;
  const int64_t v_head = dims.v_head;
  const int64_t q_width = nope + rope;
  const int64_t num_heads = dims.num_heads;
  // Rows any query of this call can see: 0 .. first_position + num_tokens - 1.
  const int64_t visible = first_position + num_tokens;

  parallel_for(0, num_heads, 1, [&](int64_t head_begin, int64_t head_end) {
    std::vector<float> k_nope(static_cast<size_t>(visible * nope));    // [visible, qk_nope]
    std::vector<float> values(static_cast<size_t>(visible * v_head));  // [visible, v_head]
    std::vector<float> scores(static_cast<size_t>(visible));
    for (int64_t h = head_begin; h < head_end; ++h) {
      const float* w_uk = kv_b + h * (nope + v_head) * rank;  // [qk_nope, rank]
      const float* w_uv = w_uk + nope * rank;                 // [v_head, rank]
      for (int64_t j = 0; j < visible; ++j) {
        const float* latent = cache + j * cache_stride;
        for (int64_t r = 0; r < nope; ++r) k_nope[j * nope + r] = dot_f32(w_uk + r * rank, latent, rank);
        for (int64_t r = 0; r < v_head; ++r) values[j * v_head + r] = dot_f32(w_uv + r * rank, latent, rank);
      }
      for (int64_t t = 0; t < num_tokens; ++t) {
        const float* q_head = q + (t * num_heads + h) * q_width;
        const int64_t seen = first_position + t + 1;
        for (int64_t j = 0; j < seen; ++j) {
          const float* k_rot = cache + j * cache_stride + rank;
          scores[j] =
              (dot_f32(q_head, &k_nope[j * nope], nope) + dot_f32(q_head + nope, k_rot, rope)) * dims.softmax_scale;
        }
        const float inv_sum = exp_shifted_inplace(scores.data(), seen);
        float* o = out + (t * num_heads + h) * v_head;
        std::fill(o, o + v_head, 0.0f);
        for (int64_t j = 0; j < seen; ++j) {
          const float p = scores[j] * inv_sum;
          for (int64_t r = 0; r < v_head; ++r) o[r] += p * values[j * v_head + r];
        }
      }
    }
  });
}

void mla_attention_absorbed(const MlaDims& dims, const float* q, int64_t num_tokens, int64_t first_position,
                            const float* cache, int64_t cache_stride, int64_t context_len, const float* kv_b,
                            float* out) {
  check_contract(dims, num_tokens, first_position, cache_stride, context_len);
  if (num_tokens == 0) return;
  const int64_t rank = dims.kv_lora_rank;
  const int64_t nope = dims.qk_nope;
  const int64_t rope = dims.qk_rope;
  const int64_t v_head = dims.v_head;
  const int64_t q_width = nope + rope;
  const int64_t num_heads = dims.num_heads;
  const int64_t visible = first_position + num_tokens;

  // One item per (token, head): decode (T = 1) spreads over heads, prefill over both.
  parallel_for(0, num_tokens * num_heads, 1, [&](int64_t item_begin, int64_t item_end) {
    std::vector<float> q_absorbed(static_cast<size_t>(rank + rope));  // [W_UK_h^T q_nope ‖ q_rot] · scale
    std::vector<float> latent_sum(static_cast<size_t>(rank));         // Σ_j p_j c_j
    std::vector<float> scores(static_cast<size_t>(visible));
    for (int64_t item = item_begin; item < item_end; ++item) {
      const int64_t t = item / num_heads;
      const int64_t h = item % num_heads;
      const float* q_head = q + item * q_width;
      const float* w_uk = kv_b + h * (nope + v_head) * rank;  // [qk_nope, rank]
      const float* w_uv = w_uk + nope * rank;                 // [v_head, rank]

      std::fill(q_absorbed.begin(), q_absorbed.end(), 0.0f);
      for (int64_t r = 0; r < nope; ++r) {
        const float q_r = q_head[r];
        const float* w_row = w_uk + r * rank;
        for (int64_t c = 0; c < rank; ++c) q_absorbed[c] += q_r * w_row[c];
      }
      for (int64_t c = 0; c < rank; ++c) q_absorbed[c] *= dims.softmax_scale;
      for (int64_t c = 0; c < rope; ++c) q_absorbed[rank + c] = q_head[nope + c] * dims.softmax_scale;

      const int64_t seen = first_position + t + 1;
      for (int64_t j = 0; j < seen; ++j) scores[j] = dot_f32(q_absorbed.data(), cache + j * cache_stride, rank + rope);
      const float inv_sum = exp_shifted_inplace(scores.data(), seen);

      std::fill(latent_sum.begin(), latent_sum.end(), 0.0f);
      for (int64_t j = 0; j < seen; ++j) {
        const float p = scores[j] * inv_sum;
        const float* latent = cache + j * cache_stride;
        for (int64_t c = 0; c < rank; ++c) latent_sum[c] += p * latent[c];
      }
      float* o = out + item * v_head;
      for (int64_t r = 0; r < v_head; ++r) o[r] = dot_f32(w_uv + r * rank, latent_sum.data(), rank);
    }
  });
}

}  // namespace deltaserve::kernels::cpu
