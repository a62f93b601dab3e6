// Internal to the MLA kernels: the absorbed attention launch behind mla_decode and mla_prefill (decode.cu), the
// launches of its steps in the other files (decode_absorb.cu, decode_combine.cu, decode_reference.cu), the arguments
// its attention kernels share and the device helpers they have in common.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "common/status.hpp"
#include "kernels/cuda/common/launch_status.hpp"
#include "kernels/cuda/mla/mla.hpp"

namespace deltaserve::kernels::cuda::detail {

// Validates `params` (decode: also num_tokens <= num_seqs) and enqueues absorb -> split attention -> combine.
// `who` names the public launcher in error messages.
Status mla_attention_launch(const MlaAttentionParams& params, bool decode, const char* who, cudaStream_t stream);

// Shared check of a page pool (`who`: launcher name for messages).
Status validate_mla_pool(const MlaPagePool& pool, int layer, const char* who);

// Raises `kernel`'s dynamic shared memory limit to `bytes` (`who`: launcher name for messages).
inline Status mla_set_smem(const void* kernel, size_t bytes, const char* who) {
  if (cudaError_t e =
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
      e != cudaSuccess) {
    return Status(StatusCode::kInternal, std::string(who) + ": cudaFuncSetAttribute: " + cudaGetErrorString(e));
  }
  return Status::ok();
}

// Every MLA kernel launches with programmatic dependent launch (see mla_wait_for_previous_grid).
template <typename... Params, typename... Args>
Status mla_launch_with_pdl(void (*kernel)(Params...), dim3 grid, int threads, size_t smem, cudaStream_t stream,
                           const char* who, Args... args) {
  return launch_kernel_ex(true, kernel, grid, dim3(static_cast<unsigned>(threads)), smem, stream, who, args...);
}

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

// Step 1 (decode_absorb.cu): q̃ of params.num_tokens tokens into `q_tilde` (the workspace section,
// [T, H, kv_lora + rope] fp32); scale = softmax_scale * log2(e).
Status launch_mla_absorb(const MlaAttentionParams& params, float* q_tilde, float scale, cudaStream_t stream,
                         const char* who);

// Step 2 on CUDA cores (decode_reference.cu; MlaAttentionParams::fp32_attention): grid (T, splits, ceil(H / group))
// with group = mla_fp32_head_group(H, kv_lora); writes the same partials as the tensor-core kernels.
int mla_fp32_head_group(int num_heads, int kv_lora);
Status launch_mla_fp32_attention(const MlaAttentionArgs& args, int64_t num_tokens, cudaStream_t stream,
                                 const char* who);

// Step 3 (decode_combine.cu): merges args.splits partials per (token, head) from args.partial_o / partial_ml and
// writes params.out (or params.out_bf16); the split-K cluster combine up to kMlaSplitKCombineMaxTokens tokens.
Status launch_mla_combine(const MlaAttentionParams& params, const MlaAttentionArgs& args, int64_t num_tokens,
                          cudaStream_t stream, const char* who);

}  // namespace deltaserve::kernels::cuda::detail
