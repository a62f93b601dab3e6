// Multi-head Latent Attention with NoPE, CPU reference (fp32).
// The per-token cache row is [kv_lora_rank normed latent ‖ qk_rope k_rot] (576 values for Kimi),
// stored with a row stride so paged or contiguous caches can be read the same way.
#pragma once

#include <cstdint>

namespace deltaserve::kernels::cpu {

struct MlaDims {
  int64_t num_heads;
  int64_t kv_lora_rank;  // latent width, 512 for Kimi
  int64_t qk_nope;       // per-head no-position part of q/k, 128
  int64_t qk_rope;       // per-head "rope" part (never rotated with NoPE), 64
  int64_t v_head;        // per-head value width, 128
  float softmax_scale;   // (qk_nope + qk_rope)^-0.5
};

// Attention of T query tokens over a cache of `context_len` rows.
//   q:        [T, H, qk_nope + qk_rope]
//   cache:    row j at cache + j * cache_stride: [kv_lora_rank latent ‖ qk_rope k_rot], j < context_len
//   kv_b:     [H * (qk_nope + v_head), kv_lora_rank]: per head qk_nope rows of W_UK then v_head rows of W_UV
//   Query t sits at absolute position first_position + t and sees rows 0..first_position + t (causal);
//   requires first_position + T <= context_len.
//   out:      [T, H, v_head]
// Reads only the first kv_lora_rank + qk_rope values of rows 0..first_position + T - 1 (padding and later rows
// may hold anything). Softmax subtracts the max (sum in fp64); dot products in fp32. Parallel over heads
// (naive) or tokens × heads (absorbed); results do not depend on the thread count.
// Naive form: materialise k_nope = W_UK c and v = W_UV c per head and row, then softmax attention.
void mla_attention_naive(const MlaDims& dims, const float* q, int64_t num_tokens, int64_t first_position,
                         const float* cache, int64_t cache_stride, int64_t context_len, const float* kv_b, float* out);

// Absorbed form (the decode path): q̃_h = [W_UK_h^T q_nope_h ‖ q_rot_h], scores against cache rows directly,
// o_h = W_UV_h (Σ_j p_j c_j). Same contract and result as the naive form up to fp32 rounding.
void mla_attention_absorbed(const MlaDims& dims, const float* q, int64_t num_tokens, int64_t first_position,
                            const float* cache, int64_t cache_stride, int64_t context_len, const float* kv_b,
                            float* out);

}  // namespace deltaserve::kernels::cpu
