// MLA attention over a paged cache in the absorbed form (model.md §4), shared by mla_decode and mla_prefill: the
// split and head-group choices, the workspace, the validation and the launch sequence.
//
// Three kernels on the stream, each launched with programmatic dependent launch (PDL): a kernel's CTAs may start
// while the previous kernel finishes, do the work that needs only what existed before this call (weights, page
// tables, cache rows), then wait for the previous grid (griddepcontrol.wait) before reading its output.
//   1. absorb (decode_absorb.cu): q̃[t, h] = [W_UK_hᵀ q_nope (kv_lora) ‖ q_rot (rope)] · scale · log2(e), fp32 in the
//                 workspace, on tensor cores.
//   2. attention: one CTA per (query token, context split, group of 8, 16 or 32 heads) streams its slice of the
//                 token's visible rows once per head group (at small batches the groups shrink so that about one
//                 wave of CTAs streams the cache: Kimi-48B ctx 4096: T = 1 runs 32 splits x 4 groups of 8 heads,
//                 T = 2 32 x 2 x 16, T >= 4 32-head groups) and writes the slice's (max, sum, unnormalised latent sum
//                 Σ p_j c_j) to the workspace. Two kernels with the same partials:
//                   mla_decode at kv_lora 512 + rope 64 (Kimi Linear, K3) on Hopper: warpgroup MMA with 64-row tiles
//                   copied by TMA straight from the pages (decode_wgmma.cu), which keeps the cache reads near the
//                   memory bandwidth at large batches and long contexts;
//                   everything else (other head dims, mla_prefill's absorbed form): mma.sync with 32-row tiles by
//                   cp.async (detail/decode_attention.cuh): a ring of 4 tiles, 3 in flight while one is computed;
//                   scores S = q̃ · rowsᵀ with q̃ (rounded to bf16) in registers, the warps splitting the 576 columns
//                   and adding their partial scores through shared memory in a fixed order; online softmax in base 2,
//                   fp32, lane = row, P rounded to bf16; O = O · rescale + P · rows[:, :kv_lora].
//                 At small batches the CTAs of token 0 also prefetch W_UV into L2 for step 3.
//   3. combine (decode_combine.cu): the splits merged exactly (log-sum-exp weights, normalised) into fp32 latent rows,
//                 then out = o_lat · W_UVᵀ on tensor cores with the latent split into two bf16 terms (hi + lo, about
//                 16 mantissa bits: the fp32 result up to summation order); a cluster of CTAs per (16 tokens, head)
//                 up to kMlaSplitKCombineMaxTokens tokens, one CTA per (32 tokens, head) past it. bf16 output when
//                 MlaAttentionParams::out_bf16 is set (the rounding of the same fp32 value).
// MlaAttentionParams::fp32_attention replaces step 2 by the fp32 CUDA-core kernel (decode_reference.cu), the
// reference the tests hold the tensor-core kernels against.
// The split count is fixed on the host from (num_tokens, max_context); each CTA reads the real context length
// on the device and may find its slice empty, so a graph captured with a bound stays valid as lengths grow.
// Prefill runs the same kernels with one CTA per query token: every token re-reads its visible rows (from L2 when
// a chunk's tokens run together) and spends 2 H (kv_lora + rope + kv_lora) FLOPs per visible row (absorbed form,
// about 3.4x the naive form's 2 H (qk_nope + qk_rope + v_head)).
#include <algorithm>
#include <cmath>
#include <string>

#include "kernels/cuda/common/launch_status.hpp"
#include "kernels/cuda/common/tensor_map.hpp"
#include "kernels/cuda/mla/detail/attention.cuh"
#include "kernels/cuda/mla/detail/decode_attention.cuh"
#include "kernels/cuda/mla/mla.hpp"

namespace deltaserve::kernels::cuda {
namespace {

using detail::attn_layout;
using detail::kAttnThreads;
using detail::mla_split_attention_mma_kernel;
using detail::MlaAttentionArgs;

constexpr int kSms = 132;           // H200
constexpr int kFullWaveCtas = 119;  // about 90% of one wave: enough attention CTAs (one fits an SM)
constexpr int kMinSplitRows = 128;  // rows per context split at least
constexpr float kLog2e = 1.4426950408889634f;

size_t align256(size_t bytes) {
  return (bytes + 255) / 256 * 256;
}

struct WorkspaceLayout {
  size_t q_tilde = 0, partial_o = 0, partial_ml = 0, total = 0;
};

WorkspaceLayout workspace_layout(int num_heads, int kv_lora_rank, int qk_rope, int64_t num_tokens, int splits) {
  WorkspaceLayout layout;
  const size_t t = static_cast<size_t>(num_tokens), h = static_cast<size_t>(num_heads);
  const size_t s = static_cast<size_t>(splits);
  const size_t q_bytes = align256(t * h * static_cast<size_t>(kv_lora_rank + qk_rope) * sizeof(float));
  const size_t o_bytes = align256(t * s * h * static_cast<size_t>(kv_lora_rank) * sizeof(float));
  const size_t ml_bytes = align256(t * s * h * sizeof(float2));
  layout.q_tilde = 0;
  layout.partial_o = q_bytes;
  layout.partial_ml = q_bytes + o_bytes;
  layout.total = q_bytes + o_bytes + ml_bytes;
  return layout;
}

bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

}  // namespace

int mla_num_splits(int64_t num_tokens, int max_context) {
  if (num_tokens <= 0 || max_context <= 0) return 1;
  // >= kMinSplitRows rows per split, and about one wave of (token, split) CTAs (one attention CTA fits an SM; the
  // head groups of mla_decode_head_group fill the wave further at one or two tokens).
  const int64_t by_length = (static_cast<int64_t>(max_context) + kMinSplitRows - 1) / kMinSplitRows;
  const int64_t by_occupancy = std::max<int64_t>(1, kSms / num_tokens);
  return static_cast<int>(std::clamp<int64_t>(std::min(by_length, by_occupancy), 1, kMlaMaxSplits));
}

int mla_decode_head_group(int64_t num_tokens, int num_heads, int max_context) {
  if (num_heads <= 0) return 0;
  const int64_t splits = mla_num_splits(num_tokens, max_context);
  for (int group : {32, 16}) {
    if (std::max<int64_t>(num_tokens, 1) * splits * ((num_heads + group - 1) / group) >= kFullWaveCtas) {
      return std::min(group, num_heads);
    }
  }
  return std::min(8, num_heads);
}

size_t mla_attention_workspace_bytes(int num_heads, int kv_lora_rank, int qk_rope, int64_t max_tokens,
                                     int max_context) {
  if (num_heads <= 0 || kv_lora_rank <= 0 || qk_rope < 0 || max_tokens < 0 || max_context < 0) return 0;
  size_t bytes = workspace_layout(num_heads, kv_lora_rank, qk_rope, 0, 1).total;
  // The split count falls as the token count grows; any batch of t <= max_tokens tokens must fit.
  int64_t t = 1;
  while (t <= max_tokens) {
    const int splits = mla_num_splits(t, max_context);
    bytes = std::max(bytes, workspace_layout(num_heads, kv_lora_rank, qk_rope, t, splits).total);
    // Past kSms tokens splits stay 1 and the size grows with t: jump to the end.
    t = (t > kSms) ? std::max(t + 1, max_tokens) : t + 1;
  }
  return bytes;
}

namespace detail {

Status validate_mla_pool(const MlaPagePool& pool, int layer, const char* who) {
  const std::string w = who;
  if (pool.pages == nullptr) return invalid_argument(w + ": pool.pages is null");
  if (!aligned16(pool.pages)) return invalid_argument(w + ": pool.pages is not 16-byte aligned");
  if (pool.num_pages <= 0) return invalid_argument(w + ": pool.num_pages must be positive");
  if (pool.num_layers <= 0) return invalid_argument(w + ": pool.num_layers must be positive");
  if (layer < 0 || layer >= pool.num_layers) {
    return invalid_argument(w + ": layer " + std::to_string(layer) + " outside [0, " + std::to_string(pool.num_layers) +
                            ")");
  }
  if (pool.page_size < 16 || pool.page_size > kMlaMaxPageSize || pool.page_size % 16 != 0) {
    return invalid_argument(w + ": pool.page_size " + std::to_string(pool.page_size) +
                            " must be a multiple of 16 in [16, 256]");
  }
  if (pool.width <= 0) return invalid_argument(w + ": pool.width must be positive");
  if (pool.row_stride < pool.width || pool.row_stride % 8 != 0) {
    return invalid_argument(w + ": pool.row_stride " + std::to_string(pool.row_stride) +
                            " must be >= width and a multiple of 8");
  }
  return Status::ok();
}

Status mla_attention_launch(const MlaAttentionParams& p, bool decode, const char* who, cudaStream_t stream) {
  const std::string w = who;
  if (p.num_heads < 1 || p.num_heads > kMlaMaxHeads) return invalid_argument(w + ": num_heads must be in [1, 128]");
  if (p.kv_lora_rank < 8 || p.kv_lora_rank > kMlaMaxKvLora || p.kv_lora_rank % 8 != 0) {
    return invalid_argument(w + ": kv_lora_rank " + std::to_string(p.kv_lora_rank) +
                            " must be a multiple of 8 in [8, 512]");
  }
  if (p.qk_rope < 0 || p.qk_rope > kMlaMaxRope || p.qk_rope % 8 != 0) {
    return invalid_argument(w + ": qk_rope " + std::to_string(p.qk_rope) + " must be a multiple of 8 in [0, 64]");
  }
  if (p.qk_nope < 1 || p.qk_nope > kMlaMaxNope) return invalid_argument(w + ": qk_nope must be in [1, 192]");
  if (p.v_head < 1 || p.v_head > kMlaMaxVHead) return invalid_argument(w + ": v_head must be in [1, 256]");
  if (!std::isfinite(p.softmax_scale) || p.softmax_scale <= 0.0f) {
    return invalid_argument(w + ": softmax_scale must be finite and positive");
  }
  if (Status s = validate_mla_pool(p.pool, p.layer, who); !s.is_ok()) return s;
  if (p.pool.width != p.kv_lora_rank + p.qk_rope) {
    return invalid_argument(w + ": pool.width " + std::to_string(p.pool.width) + " != kv_lora_rank + qk_rope");
  }
  if (p.num_seqs < 0) return invalid_argument(w + ": num_seqs is negative");
  if (p.num_tokens < 0) return invalid_argument(w + ": num_tokens is negative");
  if (p.num_tokens > 0 && p.num_seqs == 0) return invalid_argument(w + ": num_tokens > 0 with no sequences");
  if (p.num_tokens > INT32_MAX) return invalid_argument(w + ": num_tokens exceeds int32");
  if (decode && p.num_tokens > p.num_seqs) {
    return invalid_argument(w + ": a decode batch has at most one query token per sequence (num_tokens " +
                            std::to_string(p.num_tokens) + " > num_seqs " + std::to_string(p.num_seqs) + ")");
  }
  if (p.max_pages_per_seq < 1) return invalid_argument(w + ": max_pages_per_seq must be positive");
  if (p.max_context < 0 ||
      static_cast<int64_t>(p.max_context) > static_cast<int64_t>(p.max_pages_per_seq) * p.pool.page_size) {
    return invalid_argument(w + ": max_context " + std::to_string(p.max_context) +
                            " must be in [0, max_pages_per_seq * page_size]");
  }
  if (p.num_tokens > 0 && p.max_context < 1) return invalid_argument(w + ": query tokens need max_context >= 1");
  if (p.q_stride < static_cast<int64_t>(p.num_heads) * (p.qk_nope + p.qk_rope)) {
    return invalid_argument(w + ": q_stride " + std::to_string(p.q_stride) + " < H * (qk_nope + qk_rope)");
  }
  if (!decode && p.out_bf16 != nullptr) return invalid_argument(w + ": out_bf16 is for mla_decode only");
  if (p.num_tokens == 0) return Status::ok();
  if (p.cu_q == nullptr || p.context_lens == nullptr || p.block_tables == nullptr || p.q == nullptr ||
      p.kv_b == nullptr || (p.out == nullptr && p.out_bf16 == nullptr) || p.workspace == nullptr) {
    return invalid_argument(w +
                            ": a device pointer (cu_q, context_lens, block_tables, q, kv_b, out or out_bf16, "
                            "workspace) is null");
  }
  if (!aligned16(p.workspace)) return invalid_argument(w + ": workspace is not 16-byte aligned");
  if (!aligned16(p.kv_b)) return invalid_argument(w + ": kv_b is not 16-byte aligned");
  const int splits = mla_num_splits(p.num_tokens, p.max_context);
  const WorkspaceLayout layout = workspace_layout(p.num_heads, p.kv_lora_rank, p.qk_rope, p.num_tokens, splits);
  if (p.workspace_bytes < layout.total) {
    return invalid_argument(w + ": workspace_bytes " + std::to_string(p.workspace_bytes) + " < required " +
                            std::to_string(layout.total));
  }

  char* base = static_cast<char*>(p.workspace);
  float* q_tilde = reinterpret_cast<float*>(base + layout.q_tilde);
  const float scale = p.softmax_scale * kLog2e;
  MlaAttentionArgs args{};
  args.pages = p.pool.pages;
  args.num_pages = p.pool.num_pages;
  args.num_layers = p.pool.num_layers;
  args.page_size = p.pool.page_size;
  args.layer = p.layer;
  args.row_stride = p.pool.row_stride;
  args.num_heads = p.num_heads;
  args.kv_lora = p.kv_lora_rank;
  args.rope = p.qk_rope;
  args.splits = splits;
  args.num_seqs = p.num_seqs;
  args.cu_q = p.cu_q;
  args.context_lens = p.context_lens;
  args.block_tables = p.block_tables;
  args.max_pages_per_seq = p.max_pages_per_seq;
  args.q_tilde = q_tilde;
  args.partial_o = reinterpret_cast<float*>(base + layout.partial_o);
  args.partial_ml = reinterpret_cast<float2*>(base + layout.partial_ml);

  const int64_t T = p.num_tokens;
  if (Status s = launch_mla_absorb(p, q_tilde, scale, stream, who); !s.is_ok()) return s;

  if (p.fp32_attention) {
    args.head_group = mla_fp32_head_group(p.num_heads, p.kv_lora_rank);
    if (Status s = launch_mla_fp32_attention(args, T, stream, who); !s.is_ok()) return s;
  } else {
    args.head_group = mla_decode_head_group(T, p.num_heads, p.max_context);
    const detail::WUvPrefetch w_uv{T <= 16 ? p.kv_b : nullptr, p.qk_nope, p.v_head};
    if (decode && mla_wgmma_decode_supported(args) && current_device_is_sm90()) {
      if (Status s = launch_mla_wgmma_decode(args, w_uv, T, stream, who); !s.is_ok()) return s;
    } else {
      const size_t smem = attn_layout(p.kv_lora_rank + p.qk_rope).total;
      const bool two_m_tiles = args.head_group > 16;
      void (*kernel)(MlaAttentionArgs, detail::WUvPrefetch) =
          two_m_tiles ? mla_split_attention_mma_kernel<2> : mla_split_attention_mma_kernel<1>;
      if (Status s = mla_set_smem(reinterpret_cast<const void*>(kernel), smem, who); !s.is_ok()) return s;
      const dim3 grid(static_cast<unsigned>(T), static_cast<unsigned>(splits),
                      static_cast<unsigned>((p.num_heads + args.head_group - 1) / args.head_group));
      if (Status s = mla_launch_with_pdl(kernel, grid, kAttnThreads, smem, stream, who, args, w_uv); !s.is_ok()) {
        return s;
      }
    }
  }

  return launch_mla_combine(p, args, T, stream, who);
}

}  // namespace detail

Status mla_decode(const MlaAttentionParams& params, cudaStream_t stream) {
  return detail::mla_attention_launch(params, /*decode=*/true, "mla_decode", stream);
}

}  // namespace deltaserve::kernels::cuda
