// Internal to the MLA kernels: the absorbed attention launch behind mla_decode and mla_prefill (mla_decode.cu), the
// arguments its attention kernels share, and the kernels kept beside the default ones (mla_decode_reference.cu).
#pragma once

#include <cmath>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "common/status.hpp"
#include "kernels/cuda/mla/mla.hpp"

namespace deltaserve::kernels::cuda::detail {

// Validates `params` (decode: also num_tokens <= num_seqs) and enqueues absorb -> split attention -> combine.
// `who` names the public launcher in error messages.
Status mla_attention_launch(const MlaAttentionParams& params, bool decode, const char* who, cudaStream_t stream);

// Shared check of a page pool (`who`: launcher name for messages).
Status validate_mla_pool(const MlaPagePool& pool, int layer, const char* who);

// kV1 or kV2: `requested`, or for kDefault the environment variable DELTASERVE_MLA_DECODE_KERNEL (read once per
// process): "v1" -> kV1, unset or anything else -> kV2.
MlaDecodeKernel mla_resolve_decode_kernel(MlaDecodeKernel requested);
// false when DELTASERVE_MLA_PDL=0 (read once per process): the kernels then launch without the PDL attribute.
bool mla_pdl_from_env();

// What every split-attention kernel reads: one CTA per (query token, context split, group of head_group heads).
struct MlaAttentionArgs {
  const __nv_bfloat16* pages;
  int64_t num_pages;
  int num_layers, page_size, layer;
  int64_t row_stride;
  int num_heads, kv_lora, rope, head_group, splits, num_seqs;
  const int32_t* cu_q;
  const int32_t* context_lens;
  const int32_t* block_tables;
  int max_pages_per_seq;
  const float* q_tilde;  // [T, H, kv_lora + rope], pre-scaled by scale * log2(e)
  float* partial_o;      // [T, splits, H, kv_lora]: unnormalised Σ p_j c_j of the split's rows
  float2* partial_ml;    // [T, splits, H]: (running max in log2 units, sum of exp2); (-inf, 0) for an empty split
};

__device__ __forceinline__ int64_t mla_i64_min(int64_t a, int64_t b) {
  return a < b ? a : b;
}
__device__ __forceinline__ int64_t mla_i64_max(int64_t a, int64_t b) {
  return a > b ? a : b;
}

__device__ __forceinline__ float mla_warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

__device__ __forceinline__ float mla_warp_max(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

// Combine weights of the context splits of (token t, head h), one warp (lane holds splits lane and lane + 32, up
// to kMlaMaxSplits = 64): softmax over the splits' (running max, sum) partials in base 2; weight[s] for s < splits,
// 0 for empty splits (sum 0) and all 0 when every split is empty.
// The same weights from the lane's two (max, sum) pairs already loaded (splits lane and lane + 32; a pair with sum
// <= 0, e.g. (0, 0) for a split past `splits`, is empty): returns the weights of those two splits. Warp-collective.
__device__ __forceinline__ float2 mla_split_weight_pair(float2 ml0, float2 ml1) {
  const float2 ml[2] = {ml0, ml1};
  float m[2], l[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const bool filled = ml[i].y > 0.0f;
    m[i] = filled ? ml[i].x : -INFINITY;
    l[i] = filled ? ml[i].y : 0.0f;
  }
  const float m_max = mla_warp_max(fmaxf(m[0], m[1]));
  float w[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) w[i] = l[i] > 0.0f ? exp2f(m[i] - m_max) : 0.0f;
  const float total = mla_warp_sum(w[0] * l[0] + w[1] * l[1]);
  const float inv = total > 0.0f ? 1.0f / total : 0.0f;
  return make_float2(w[0] * inv, w[1] * inv);
}
__device__ __forceinline__ void mla_split_weights(const float2* partial_ml, int64_t t, int h, int num_heads, int splits,
                                                  int lane, float* weight) {
  float2 ml[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int s = lane + 32 * i;
    ml[i] = s < splits ? partial_ml[(t * splits + s) * num_heads + h] : make_float2(0.0f, 0.0f);
  }
  const float2 w = mla_split_weight_pair(ml[0], ml[1]);
  if (lane < splits) weight[lane] = w.x;
  if (lane + 32 < splits) weight[lane + 32] = w.y;
}

// Programmatic dependent launch: wait for the previous grid on the stream (its writes visible), and let the next
// one start launching. Each kernel here allows the next only after its own wait, so a kernel that starts early
// still runs after everything before the previous one: reads before the wait see all earlier work of the stream
// except the previous kernel's.
__device__ __forceinline__ void mla_wait_for_previous_grid() {
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
}
__device__ __forceinline__ void mla_allow_next_grid() {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}

// The fp32 CUDA-core attention kernel (MlaAttentionParams::fp32_attention): grid (T, splits, ceil(H / group)) with
// group = mla_fp32_head_group(H, kv_lora); writes the same partials as the default kernel.
int mla_fp32_head_group(int num_heads, int kv_lora);
Status launch_mla_fp32_attention(const MlaAttentionArgs& args, int64_t num_tokens, cudaStream_t stream,
                                 const char* who);

// The original absorbed pipeline (MlaAttentionParams::legacy_tc_attention, DELTASERVE_MLA_TC=legacy): absorb with
// one CTA per (8 tokens, head), the tensor-core attention with per-thread page lookups, the combine with one CTA per
// (token, head). `args` carries the partials' workspace sections and args.splits (head_group and q_tilde are set
// here); q_tilde: the workspace section for q̃; scale = softmax_scale * log2(e).
Status launch_mla_legacy(const MlaAttentionParams& params, MlaAttentionArgs args, float* q_tilde, float scale,
                         cudaStream_t stream, const char* who);

}  // namespace deltaserve::kernels::cuda::detail
