// MLA attention over a paged cache in the absorbed form (model.md §4), shared by mla_decode and mla_prefill.
//
// Three kernels on the stream, each launched with programmatic dependent launch (PDL): a kernel's CTAs may start
// while the previous kernel finishes, do the work that needs only what existed before this call (weights, page
// tables, cache rows), then wait for the previous grid (griddepcontrol.wait) before reading its output.
//   1. absorb:    q̃[t, h] = [W_UK_hᵀ q_nope (kv_lora) ‖ q_rot (rope)] · scale · log2(e), fp32 in the workspace.
//                 One CTA per (64 tokens, head, 64 latent columns): 256 CTAs at Kimi-48B dims for any T <= 64 (the
//                 4 MB of W_UK spread over every SM, 16 KB per CTA by cp.async before the wait); mma.sync bf16
//                 with fp32 accumulate (the products of bf16 values are exact, so this is the fp32 result up to
//                 summation order).
//   2. attention: one CTA per (query token, context split, group of 8, 16 or 32 heads). It streams its slice of the
//                 token's visible rows through a ring of 4 tiles of 32 rows (cp.async, 3 tiles in flight while one
//                 is computed; each warp looks up the page of one row per lane, a tile ahead, and shares the row
//                 addresses by shuffles). Each tile is read once per head group: once for 32 heads, and at small
//                 batches the groups shrink so that about one wave of CTAs streams the cache (Kimi-48B ctx 4096:
//                 T = 1 runs 32 splits x 4 groups of 8 heads, T = 2 32 x 2 x 16, T >= 4 32-head groups).
//                   scores:  S = q̃ · rowsᵀ on tensor cores; q̃ (rounded to bf16) stays in registers, the warps split
//                            the 576 columns (4 warps per 16 heads with 2 m tiles, 8 with one) and add their
//                            partial scores through shared memory in a fixed order;
//                   softmax: online, base 2, fp32, lane = row, each warp its heads; P rounded to bf16;
//                   P·rows:  O [heads x kv_lora] = O · rescale + P · rows[:, :kv_lora], each warp 64 columns.
//                 The slice's (max, sum, unnormalised latent sum Σ p_j c_j) go to the workspace. At small batches the
//                 CTAs of token 0 also prefetch W_UV into L2 for step 3.
//   3. combine:   per (32 tokens, head) the splits are merged exactly (log-sum-exp weights, normalised) into fp32
//                 latent rows, then out = o_lat · W_UVᵀ on tensor cores with the latent split into two bf16 terms
//                 (hi + lo, about 16 mantissa bits: the fp32 result up to summation order). W_UV fragments are read
//                 into registers before the wait.
//   3'. (v2, at most kMlaSplitKCombineMaxTokens tokens) split-K combine: per (16 tokens, head) a cluster of up to 8
//                 CTAs, each merging 64 latent columns and multiplying them by its 64-column slice of W_UV, the
//                 slices' products added in a fixed order over distributed shared memory (see the kernel). Kimi-48B,
//                 batch 1: 256 CTAs of 24 KB instead of 32 of 192 KB (H200 Nsight, v1 combine: 14.0 us for 7.1 MB);
//                 its partials load in one round after the wait, and three of its CTAs fit an SM.
// MlaDecodeKernel selects the generation (MlaAttentionParams::decode_kernel, else
// DELTASERVE_MLA_DECODE_KERNEL=v1|v2|v3, default v3): v1 runs steps 1, 2, 3; v2 runs 1, 2 and 3' up to 16 tokens, 3
// past that; v3 is v2 with step 2 on warpgroup MMA and TMA where it applies (mla_decode_wgmma.cu; decode only; H200,
// Kimi-48B dims, MlaDecodeGpu.Timing 2026-12-02: 0.85-0.87 of the byte limit at B >= 64 and context 32k against
// v2's 0.35-0.36, 43 against 66 us at B = 1). Both combines write bf16
// instead of fp32 when MlaAttentionParams::out_bf16 is set (the rounding of the same fp32 value).
// MlaAttentionParams::fp32_attention replaces step 2 by the fp32 CUDA-core kernel; legacy_tc_attention (or
// DELTASERVE_MLA_TC=legacy) runs the original three kernels instead (both in mla_decode_reference.cu).
// DELTASERVE_MLA_PDL=0 launches without the PDL attribute (griddepcontrol.wait then returns at once: plain stream
// order).
// The split count is fixed on the host from (num_tokens, max_context); each CTA reads the real context length
// on the device and may find its slice empty, so a graph captured with a bound stays valid as lengths grow.
// Prefill runs the same kernels with one CTA per query token: every token re-reads its visible rows (from L2 when
// a chunk's tokens run together) and spends 2 H (kv_lora + rope + kv_lora) FLOPs per visible row (absorbed form,
// about 3.4x the naive form's 2 H (qk_nope + qk_rope + v_head)).
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include <cooperative_groups.h>

#include "kernels/cuda/common/detail/device_timeline.cuh"
#include "kernels/cuda/common/launch_status.hpp"
#include "kernels/cuda/mla/mla.hpp"
#include "kernels/cuda/mla/detail/attention.cuh"
#include "kernels/cuda/mla/detail/decode_attention.cuh"
#include "kernels/cuda/common/detail/mma_sm80.cuh"
#include "kernels/cuda/common/tensor_map.hpp"

namespace deltaserve::kernels::cuda {
namespace {

namespace cg = cooperative_groups;
using detail::attn_layout;
using detail::kAttnThreads;
using detail::mla_split_attention_mma_kernel;
using detail::MlaAttentionArgs;

constexpr int kSms = 132;                   // H200
constexpr int kFullWaveCtas = 119;          // about 90% of one wave: enough attention CTAs (one fits an SM)
constexpr int kMinSplitRows = 128;          // rows per context split at least (4 tiles), by default
constexpr int kLegacyTargetCtas = 2 * 132;  // the legacy split heuristic (DELTASERVE_MLA_TC=legacy)
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

// ---- 1. absorb ----------------------------------------------------------------------------------------------
// q̃[t0 .. t0 + 64, h, c0 .. c0 + 64] = q_nope[t, h] · W_UK_h[:, c0 .. c0 + 64] on tensor cores: A = q_nope tile
// [64 tokens][nope padded to 16] bf16, B = the W_UK slice [nope][64] bf16, both in shared memory; warp w computes
// tokens 16 w .. 16 w + 16 (skipped past the batch). CTAs with blockIdx.z == 0 also copy the scaled q_rot.
constexpr int kAbsorbThreads = 128;
constexpr int kAbsorbTokens = 64;  // 4 warps x one m16 tile
constexpr int kAbsorbCols = 64;    // latent columns per CTA: 4 n pairs of 16
constexpr int kAbsorbLdW = kAbsorbCols + 8;

size_t absorb_smem_bytes(int nope) {
  const size_t k16 = static_cast<size_t>((nope + 15) / 16 * 16);
  return sizeof(__nv_bfloat16) * (k16 * kAbsorbLdW + kAbsorbTokens * (k16 + 8));
}

// grid (ceil(T / 64), H, ceil(kv_lora / 64)), block kAbsorbThreads, dynamic smem absorb_smem_bytes(nope).
__global__ void __launch_bounds__(kAbsorbThreads)
    mla_absorb_kernel(const __nv_bfloat16* __restrict__ q, int64_t q_stride, const __nv_bfloat16* __restrict__ kv_b,
                      int64_t num_tokens, int num_heads, int kv_lora, int nope, int rope, int v_head, float scale,
                      float* __restrict__ q_tilde) {
  extern __shared__ __align__(16) unsigned char absorb_smem[];
  const int k16 = (nope + 15) / 16 * 16, ld_q = k16 + 8;
  __nv_bfloat16* s_w = reinterpret_cast<__nv_bfloat16*>(absorb_smem);  // [k16][kAbsorbLdW]
  __nv_bfloat16* s_q = s_w + k16 * kAbsorbLdW;                         // [kAbsorbTokens][ld_q]
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kAbsorbTokens;
  const int h = blockIdx.y, c0 = blockIdx.z * kAbsorbCols;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int q_width = nope + rope, width = kv_lora + rope;

  // The weights do not depend on the previous kernel: copy them before waiting for it. Rows past nope and
  // columns past kv_lora are zero-filled (16-byte vectors: kv_lora is a multiple of 8).
  const __nv_bfloat16* w_uk = kv_b + static_cast<int64_t>(h) * (nope + v_head) * kv_lora;  // [nope, kv_lora]
  for (int v = tid; v < k16 * (kAbsorbCols / 8); v += kAbsorbThreads) {
    const int d = v / (kAbsorbCols / 8), cv = v % (kAbsorbCols / 8), c = c0 + cv * 8;
    const bool valid = d < nope && c < kv_lora;
    detail::cp_async16_zfill(s_w + d * kAbsorbLdW + cv * 8, valid ? w_uk + static_cast<int64_t>(d) * kv_lora + c : w_uk,
                             valid);
  }
  detail::cp_async_commit();
  detail::mla_wait_for_previous_grid();
  detail::mla_allow_next_grid();

  const int count = static_cast<int>(min(static_cast<int64_t>(kAbsorbTokens), num_tokens - t0));
  const int rows16 = (count + 15) / 16 * 16;
  const __nv_bfloat16 zero = __float2bfloat16(0.0f);
  for (int i = tid; i < rows16 * k16; i += kAbsorbThreads) {
    const int tt = i / k16, d = i - tt * k16;
    s_q[tt * ld_q + d] =
        tt < count && d < nope ? q[(t0 + tt) * q_stride + static_cast<int64_t>(h) * q_width + d] : zero;
  }
  if (blockIdx.z == 0) {
    for (int i = tid; i < count * rope; i += kAbsorbThreads) {
      const int tt = i / rope, j = i - tt * rope;
      const float x = __bfloat162float(q[(t0 + tt) * q_stride + static_cast<int64_t>(h) * q_width + nope + j]);
      q_tilde[((t0 + tt) * num_heads + h) * width + kv_lora + j] = x * scale;
    }
  }
  detail::cp_async_wait<0>();
  __syncthreads();
  if (warp * 16 >= count) return;

  float acc[kAbsorbCols / 16][2][4];
#pragma unroll
  for (int j = 0; j < kAbsorbCols / 16; ++j)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[j][nt][e] = 0.0f;
  for (int k0 = 0; k0 < k16; k0 += 16) {
    uint32_t af[4];
    detail::load_a(af, s_q, ld_q, warp * 16, k0);
#pragma unroll
    for (int j = 0; j < kAbsorbCols / 16; ++j) {
      uint32_t bf[4];
      detail::load_b_kn(bf, s_w, kAbsorbLdW, j * 16, k0);
      detail::mma_bf16_16816(acc[j][0], af, bf[0], bf[1]);
      detail::mma_bf16_16816(acc[j][1], af, bf[2], bf[3]);
    }
  }
  const int g = lane >> 2, tq = lane & 3;
#pragma unroll
  for (int j = 0; j < kAbsorbCols / 16; ++j) {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const int col = c0 + j * 16 + nt * 8 + 2 * tq;  // even, and kv_lora is a multiple of 8: col + 1 < kv_lora too
      if (col >= kv_lora) continue;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int tt = warp * 16 + g + 8 * half;
        if (tt < count) {
          *reinterpret_cast<float2*>(&q_tilde[((t0 + tt) * num_heads + h) * width + col]) =
              make_float2(acc[j][nt][2 * half] * scale, acc[j][nt][2 * half + 1] * scale);
        }
      }
    }
  }
}

// ---- 3. combine + W_UV ----------------------------------------------------------------------------------------
// Per (32 tokens, head): split weights (warp per token), merged latent rows o_lat [32][kv_lora] fp32 in shared
// memory (rows past the batch and columns past kv_lora zero), then out[t, h, :] = o_lat[t] · W_UV_hᵀ by mma.sync:
// M = tokens, N = v, K = kv_lora. Warp w takes W_UV rows 16 (w % 8) .. + 16 (and + 128 per further round when
// v_head > 128) over half of K (w / 8); the two halves add through shared memory in a fixed order.
// The k order inside an mma is free as long as A and B agree: lane (g, t) holds W_UV[v][c .. c + 8) for
// c = 32 b + 8 t as one 16-byte load (b0 = columns c, c + 1 and b1 = c + 2, c + 3 in the first k step of block b,
// c + 4 .. c + 7 in the second), and reads the latent at the same columns (one float4 per row and k step).
// The fp32 latent x enters as two bf16 terms, hi = bf16(x) and lo = bf16(x - hi): x - hi - lo is about 2^-16 x.
constexpr int kCombineThreads = 512;
constexpr int kCombineWarps = kCombineThreads / 32;
constexpr int kCombineTokens = 32;                  // two m tiles
constexpr int kCombineLd = kMlaMaxKvLora + 4;       // floats per latent row: fragment float4 loads without conflicts
constexpr int kCombineVBlocks = kCombineWarps / 2;  // 16-row W_UV blocks per round
constexpr int kCombineBlocksPerHalf = kMlaMaxKvLora / 32 / 2;  // 32-column blocks of K per warp

size_t combine_smem_bytes() {
  return sizeof(float) * (static_cast<size_t>(kCombineTokens) * kCombineLd + kCombineTokens * kMlaMaxSplits +
                          16 * kCombineVBlocks * 32);
}

__device__ __forceinline__ void split_bf16(float x, float y, uint32_t& hi, uint32_t& lo) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
  const float2 hf = __bfloat1622float2(h);
  const __nv_bfloat162 l = __floats2bfloat162_rn(x - hf.x, y - hf.y);
  hi = *reinterpret_cast<const uint32_t*>(&h);
  lo = *reinterpret_cast<const uint32_t*>(&l);
}

// grid (ceil(T / kCombineTokens), H), block kCombineThreads, dynamic smem combine_smem_bytes(); kv_b 16-byte aligned.
__global__ void __launch_bounds__(kCombineThreads, 1)
    mla_combine_kernel(const float* __restrict__ partial_o, const float2* __restrict__ partial_ml,
                       const __nv_bfloat16* __restrict__ kv_b, int64_t num_tokens, int num_heads, int kv_lora, int nope,
                       int v_head, int splits, float* __restrict__ out, __nv_bfloat16* __restrict__ out_bf16) {
  extern __shared__ __align__(16) float combine_smem[];
  float* s_lat = combine_smem;                               // [kCombineTokens][kCombineLd]
  float* s_weight = s_lat + kCombineTokens * kCombineLd;     // [kCombineTokens][kMlaMaxSplits]
  float* s_red = s_weight + kCombineTokens * kMlaMaxSplits;  // [16 values][kCombineVBlocks][32 lanes]
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kCombineTokens;
  const int tokens = static_cast<int>(min(static_cast<int64_t>(kCombineTokens), num_tokens - t0));
  const int rows16 = (tokens + 15) / 16 * 16, m_tiles = rows16 / 16;
  const int h = blockIdx.y;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, tq = lane & 3;
  const int vb = warp % kCombineVBlocks, k_half = warp / kCombineVBlocks;
  const int blocks = (kv_lora + 31) / 32, first_half = (blocks + 1) / 2;
  const int b_begin = k_half == 0 ? 0 : first_half, b_count = k_half == 0 ? first_half : blocks - first_half;
  const int v_blocks = (v_head + 15) / 16, rounds = (v_blocks + kCombineVBlocks - 1) / kCombineVBlocks;
  const __nv_bfloat16* w_uv = kv_b + (static_cast<int64_t>(h) * (nope + v_head) + nope) * kv_lora;  // [v, kv_lora]

  uint4 wa[kCombineBlocksPerHalf], wb[kCombineBlocksPerHalf];  // rows v0 + g and v0 + 8 + g of the warp's block
  auto load_w = [&](int round) {
    const int v0 = (vb + kCombineVBlocks * round) * 16, ra = v0 + g, rb = v0 + 8 + g;
#pragma unroll
    for (int b = 0; b < kCombineBlocksPerHalf; ++b) {
      const int c = (b_begin + b) * 32 + 8 * tq;
      const bool in = b < b_count && c < kv_lora;
      const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
      wa[b] = in && ra < v_head ? __ldg(reinterpret_cast<const uint4*>(w_uv + static_cast<int64_t>(ra) * kv_lora + c))
                                : zero;
      wb[b] = in && rb < v_head ? __ldg(reinterpret_cast<const uint4*>(w_uv + static_cast<int64_t>(rb) * kv_lora + c))
                                : zero;
    }
  };
  load_w(0);  // weights: before waiting for the attention
  detail::mla_wait_for_previous_grid();
  detail::mla_allow_next_grid();

  for (int tt = warp; tt < tokens; tt += kCombineWarps) {  // split weights of token t0 + tt
    detail::mla_split_weights(partial_ml, t0 + tt, h, num_heads, splits, lane, s_weight + tt * kMlaMaxSplits);
  }
  __syncthreads();

  // Merged latent rows: Σ_s weight_s · partial_o[t, s, h, :], zero-weight (empty) splits not read. The loads of a
  // thread are independent (one round trip per 8 of them).
  const int64_t split_stride = static_cast<int64_t>(num_heads) * kv_lora;
  const float4 zero4 = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  auto fma4 = [](float w, const float4& x, float4& acc) {
    acc.x = fmaf(w, x.x, acc.x);
    acc.y = fmaf(w, x.y, acc.y);
    acc.z = fmaf(w, x.z, acc.z);
    acc.w = fmaf(w, x.w, acc.w);
  };
  if (tokens <= 4) {
    // Few tokens (each with many splits): 4 adjacent lanes share a column quad and take every 4th split.
    const int quad = tid >> 2, part = tid & 3;
    const bool col_in = 4 * quad < kv_lora;
    for (int tt = 0; tt < rows16; ++tt) {
      float4 acc = zero4;
      if (tt < tokens && col_in) {
        const float* src = partial_o + ((t0 + tt) * splits * num_heads + h) * kv_lora + 4 * quad;
        for (int s0 = part; s0 < splits; s0 += 32) {
          float w[8];
          float4 x[8];
#pragma unroll
          for (int u = 0; u < 8; ++u) {
            const int s = s0 + 4 * u;
            w[u] = s < splits ? s_weight[tt * kMlaMaxSplits + s] : 0.0f;
            x[u] = w[u] != 0.0f ? __ldg(reinterpret_cast<const float4*>(src + s * split_stride)) : zero4;
          }
#pragma unroll
          for (int u = 0; u < 8; ++u) fma4(w[u], x[u], acc);
        }
      }
#pragma unroll
      for (int offset = 1; offset < 4; offset <<= 1) {
        acc.x += __shfl_xor_sync(0xffffffffu, acc.x, offset);
        acc.y += __shfl_xor_sync(0xffffffffu, acc.y, offset);
        acc.z += __shfl_xor_sync(0xffffffffu, acc.z, offset);
        acc.w += __shfl_xor_sync(0xffffffffu, acc.w, offset);
      }
      if (part == 0) *reinterpret_cast<float4*>(&s_lat[tt * kCombineLd + 4 * quad]) = acc;
    }
  } else {
    // More tokens (few splits each): thread (column quad, r) takes tokens r, r + 4, ..., two tokens and two splits a
    // step (4 loads: more spill past the 128 registers of 512 threads).
    const int quad = tid % (kCombineThreads / 4), r = tid / (kCombineThreads / 4);
    const bool col_in = 4 * quad < kv_lora;
    for (int tt0 = r; tt0 < rows16; tt0 += 8) {
      float4 acc[2] = {zero4, zero4};
      for (int s0 = 0; s0 < splits; s0 += 2) {
        float w[2][2];
        float4 x[2][2];
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const int tt = tt0 + 4 * u;
          const float* src = partial_o + ((t0 + tt) * splits * num_heads + h) * kv_lora + 4 * quad;
#pragma unroll
          for (int v = 0; v < 2; ++v) {
            const int s = s0 + v;
            w[u][v] = tt < tokens && s < splits && col_in ? s_weight[tt * kMlaMaxSplits + s] : 0.0f;
            x[u][v] = w[u][v] != 0.0f ? __ldg(reinterpret_cast<const float4*>(src + s * split_stride)) : zero4;
          }
        }
#pragma unroll
        for (int u = 0; u < 2; ++u)
#pragma unroll
          for (int v = 0; v < 2; ++v) fma4(w[u][v], x[u][v], acc[u]);
      }
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int tt = tt0 + 4 * u;
        if (tt < rows16) *reinterpret_cast<float4*>(&s_lat[tt * kCombineLd + 4 * quad]) = acc[u];
      }
    }
  }
  __syncthreads();

  for (int round = 0; round < rounds; ++round) {
    if (round > 0) load_w(round);
    const int v_block = vb + kCombineVBlocks * round;
    const bool active = v_block < v_blocks;
    float acc[2][2][4];  // [m tile][n tile][fragment]
#pragma unroll
    for (int m2 = 0; m2 < 2; ++m2)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[m2][nt][e] = 0.0f;
    if (active) {
#pragma unroll
      for (int b = 0; b < kCombineBlocksPerHalf; ++b) {
        if (b >= b_count) continue;
#pragma unroll
        for (int s = 0; s < 2; ++s) {
          const int col = (b_begin + b) * 32 + 8 * tq + 4 * s;
          const uint32_t a0 = s == 0 ? wa[b].x : wa[b].z, a1 = s == 0 ? wa[b].y : wa[b].w;
          const uint32_t b0 = s == 0 ? wb[b].x : wb[b].z, b1 = s == 0 ? wb[b].y : wb[b].w;
#pragma unroll
          for (int m2 = 0; m2 < 2; ++m2) {
            if (m2 >= m_tiles) continue;
            const float4 x_lo = *reinterpret_cast<const float4*>(&s_lat[(m2 * 16 + g) * kCombineLd + col]);
            const float4 x_hi = *reinterpret_cast<const float4*>(&s_lat[(m2 * 16 + g + 8) * kCombineLd + col]);
            uint32_t hi[4], lo[4];
            split_bf16(x_lo.x, x_lo.y, hi[0], lo[0]);
            split_bf16(x_hi.x, x_hi.y, hi[1], lo[1]);
            split_bf16(x_lo.z, x_lo.w, hi[2], lo[2]);
            split_bf16(x_hi.z, x_hi.w, hi[3], lo[3]);
            detail::mma_bf16_16816(acc[m2][0], hi, a0, a1);
            detail::mma_bf16_16816(acc[m2][0], lo, a0, a1);
            detail::mma_bf16_16816(acc[m2][1], hi, b0, b1);
            detail::mma_bf16_16816(acc[m2][1], lo, b0, b1);
          }
        }
      }
    }
    if (active && k_half == 1) {
#pragma unroll
      for (int i = 0; i < 16; ++i) s_red[(i * kCombineVBlocks + vb) * 32 + lane] = acc[i / 8][(i / 4) % 2][i % 4];
    }
    __syncthreads();
    if (active && k_half == 0) {
#pragma unroll
      for (int i = 0; i < 16; ++i) acc[i / 8][(i / 4) % 2][i % 4] += s_red[(i * kCombineVBlocks + vb) * 32 + lane];
#pragma unroll
      for (int m2 = 0; m2 < 2; ++m2) {
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const int v = v_block * 16 + nt * 8 + 2 * tq;
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int tt = m2 * 16 + g + 8 * half;
            if (tt >= tokens) continue;
            const int64_t at = ((t0 + tt) * num_heads + h) * v_head;
            if (out_bf16 != nullptr) {
              if (v < v_head) out_bf16[at + v] = __float2bfloat16(acc[m2][nt][2 * half]);
              if (v + 1 < v_head) out_bf16[at + v + 1] = __float2bfloat16(acc[m2][nt][2 * half + 1]);
            } else {
              if (v < v_head) out[at + v] = acc[m2][nt][2 * half];
              if (v + 1 < v_head) out[at + v + 1] = acc[m2][nt][2 * half + 1];
            }
          }
        }
      }
    }
    __syncthreads();  // s_red is reused by the next round
  }
}

// ---- 3'. split-K combine + W_UV at small batches (v2) ------------------------------------------------------------
// Per (16 tokens, head) one cluster of slices = ceil(kv_lora / 64) CTAs (8 at kv_lora 512). CTA r owns latent
// columns 64 r .. 64 r + 64: it merges the splits for those columns only (Σ_s weight_s · partial_o[t, s, h, cols],
// weights as above) and multiplies them by W_UV_h[:, cols] on tensor cores (the fragment layout and hi/lo split of
// the combine above; M = tokens, N = v, K = its 64 columns) into a [16][v_head] fp32 partial product in its shared
// memory. After a cluster barrier, CTA r adds the slices' products in the order 0, 1, ..., slices - 1 (read over
// distributed shared memory) for its share of the outputs and writes them; a second barrier keeps every CTA's
// shared memory alive until the others have read it. No atomics: the same result every run.
// Kimi-48B, T = 1: 256 CTAs with 16 KB of W_UV and 8 KB of partials each, instead of 32 CTAs with 128 KB + 64 KB
// (the 4 MB of W_UV pulled by every SM rather than a quarter of them). Used up to kMlaSplitKCombineMaxTokens tokens;
// past that the combine above reads W_UV once per 32 tokens, where this kernel would read it once per 16.
constexpr int kSkThreads = 256;
constexpr int kSkWarps = kSkThreads / 32;
constexpr int kSkTokens = 16;                            // one m16 tile per cluster
constexpr int kSkCols = 64;                              // latent columns per CTA: two 32-column blocks
constexpr int kSkMaxSlices = kMlaMaxKvLora / kSkCols;    // 8: the portable cluster size
constexpr int kSkLd = kSkCols + 4;                       // floats per latent row: float4 fragment loads conflict-free
constexpr int kSkLdProd = kMlaMaxVHead + 8;              // floats per partial-product row
constexpr int kSkParts = 16;                             // split partitions of the merge: the lanes of a half warp
constexpr int kSkSplitSlots = kMlaMaxSplits / kSkParts;  // splits per partition at most
constexpr int kSkVRounds = (kMlaMaxVHead / 16 + kSkWarps - 1) / kSkWarps;  // 16-row W_UV blocks per warp at most
static_assert(kSkParts * (kSkCols / 4) == kSkThreads, "merge: one (column quad, partition) per thread");
static_assert(kSkMaxSlices <= 8, "portable cluster size");

// Optional timeline (compile with -DDELTASERVE_MLA_V3_TRACE, as mla_decode_wgmma.cu; bench/gpu/mla_v3_trace_bench.cu
// reads it): %globaltimer stamps per CTA of this kernel (blockIdx flattened) at event 0 the start, 1 past the wait,
// 3 latent columns merged, 4 the slice's product written, 5 past the first cluster barrier, 6 the end (2 is unused:
// the split weights were a phase of their own before); event 7 holds the SM id + 1.
#ifdef DELTASERVE_MLA_V3_TRACE
constexpr int kSkTraceCtas = 1024, kSkTraceEvents = 8;
__device__ unsigned long long g_sk_trace[kSkTraceCtas][kSkTraceEvents];
__device__ __forceinline__ void sk_trace_stamp(int event) {
  if (threadIdx.x != 0) return;
  detail::timeline_stamp(g_sk_trace, event);
  const unsigned cta = detail::timeline_cta();
  if (event == 0 && cta < kSkTraceCtas) {
    unsigned sm;
    asm volatile("mov.u32 %0, %%smid;\n" : "=r"(sm));
    g_sk_trace[cta][7] = sm + 1ull;
  }
}
#else
__device__ __forceinline__ void sk_trace_stamp(int) {}
#endif

// grid (slices, H, ceil(T / kSkTokens)) in clusters of (slices, 1, 1), block kSkThreads; kv_b 16-byte aligned.
// Writes out_bf16 when it is set, else out. kVRounds: 16-row W_UV blocks per warp (1 up to v_head 128).
// Latency at small batches (mla_v3_trace_bench's timeline, H200; the previous version of this kernel ended 11.8 us
// after the attention at B = 1, 4k, and 12.0 at 32k; this one 6.5 and 7.8 us):
// - every partial of the CTA's columns and every (max, sum) pair of the head is loaded right after the wait, in one
//   round of loads (the previous version loaded the pairs, stored the weights in shared memory, then the partials);
// - every warp computes the split weights itself from the pairs (mla_split_weights' reductions) and takes its
//   lanes' weights by shuffles: no shared-memory weights and no block barrier before the merge;
// - at most 80 registers (2 tokens' loads in flight, W_UV rows held only where v_head needs them), so three CTAs
//   fit an SM and one beside a v3 attention CTA of 8 or 16 heads. With 120 registers two fitted an SM and, the
//   register file being split among four schedulers, none beside v3 at 16 heads; at batch 1 a quarter of the 256
//   CTAs waited for the first ones to end.
constexpr int kSkTokenStep = 2;  // tokens whose partial loads are in flight together
constexpr int kSkMinBlocks = 3;  // CTAs an SM holds (v_head <= 128; 2 past it, without spills)

template <int kVRounds>
__global__ void __launch_bounds__(kSkThreads, kVRounds == 1 ? kSkMinBlocks : 2)
    mla_combine_split_k_kernel(const float* __restrict__ partial_o, const float2* __restrict__ partial_ml,
                               const __nv_bfloat16* __restrict__ kv_b, int64_t num_tokens, int num_heads, int kv_lora,
                               int nope, int v_head, int splits, float* __restrict__ out,
                               __nv_bfloat16* __restrict__ out_bf16) {
  __shared__ __align__(16) float s_lat[kSkTokens * kSkLd];
  __shared__ __align__(16) float s_prod[kSkTokens * kSkLdProd];
  cg::cluster_group cluster = cg::this_cluster();
  const int slice = static_cast<int>(cluster.block_rank()), slices = static_cast<int>(cluster.num_blocks());
  const int h = blockIdx.y;
  const int64_t t0 = static_cast<int64_t>(blockIdx.z) * kSkTokens;
  const int tokens = static_cast<int>(min(static_cast<int64_t>(kSkTokens), num_tokens - t0));
  const int c0 = slice * kSkCols;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, tq = lane & 3;
  const int v_blocks = (v_head + 15) / 16;
  const __nv_bfloat16* w_uv = kv_b + (static_cast<int64_t>(h) * (nope + v_head) + nope) * kv_lora;  // [v, kv_lora]
  sk_trace_stamp(0);

  // W_UV fragments, before the wait: v block warp + kSkWarps * round, rows v0 + g (wa) and v0 + 8 + g (wb),
  // columns c0 + 32 b + 8 tq .. + 8 (zero past v_head and kv_lora; kv_lora is a multiple of 8).
  uint4 wa[kVRounds][2], wb[kVRounds][2];
#pragma unroll
  for (int round = 0; round < kVRounds; ++round) {
    const int v0 = (warp + kSkWarps * round) * 16, ra = v0 + g, rb = v0 + 8 + g;
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      const int c = c0 + 32 * b + 8 * tq;
      const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
      wa[round][b] = c < kv_lora && ra < v_head
                         ? __ldg(reinterpret_cast<const uint4*>(w_uv + static_cast<int64_t>(ra) * kv_lora + c))
                         : zero;
      wb[round][b] = c < kv_lora && rb < v_head
                         ? __ldg(reinterpret_cast<const uint4*>(w_uv + static_cast<int64_t>(rb) * kv_lora + c))
                         : zero;
    }
  }
  for (int i = tokens * kSkLd + tid; i < kSkTokens * kSkLd; i += kSkThreads) s_lat[i] = 0.0f;  // rows past the batch
  detail::mla_wait_for_previous_grid();
  detail::mla_allow_next_grid();
  sk_trace_stamp(1);

  // Thread (quad, part) merges splits part, part + 16, ... of column quad `quad`; lane l holds the (max, sum) pairs
  // of splits l and l + 32, so split part + 16 k sits in lane part + 16 (k & 1), pair k >> 1.
  const int part = lane % kSkParts, quad = warp * (32 / kSkParts) + lane / kSkParts;
  const int col = c0 + 4 * quad;
  const bool col_in = col < kv_lora;
  const int64_t split_stride = static_cast<int64_t>(num_heads) * kv_lora;
  const float4 zero4 = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  for (int tt0 = 0; tt0 < tokens; tt0 += kSkTokenStep) {
    float2 ml[kSkTokenStep][2];
    float4 x[kSkTokenStep][kSkSplitSlots];
#pragma unroll
    for (int u = 0; u < kSkTokenStep; ++u) {
      const int64_t t = t0 + tt0 + u;
      const bool token_in = tt0 + u < tokens;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int s = lane + 32 * i;
        ml[u][i] = token_in && s < splits ? partial_ml[(t * splits + s) * num_heads + h] : make_float2(0.0f, 0.0f);
      }
#pragma unroll
      for (int k = 0; k < kSkSplitSlots; ++k) {
        const int s = part + kSkParts * k;
        x[u][k] = token_in && s < splits && col_in
                      ? __ldg(reinterpret_cast<const float4*>(partial_o + (t * splits + s) * split_stride +
                                                              static_cast<int64_t>(h) * kv_lora + col))
                      : zero4;
      }
    }
#pragma unroll
    for (int u = 0; u < kSkTokenStep; ++u) {
      // The weights of mla_split_weights (empty splits weigh 0; all 0 when every split is empty).
      const float2 pair = detail::mla_split_weight_pair(ml[u][0], ml[u][1]);
      const float w0 = pair.x, w1 = pair.y;
      float4 acc = zero4;
#pragma unroll
      for (int k = 0; k < kSkSplitSlots; ++k) {
        const int source = part + kSkParts * (k & 1);
        const float lo = __shfl_sync(0xffffffffu, w0, source), hi = __shfl_sync(0xffffffffu, w1, source);
        const float wk = (k >> 1) != 0 ? hi : lo;
        // A zero weight (an empty split, or one past `splits`) adds nothing, whatever its partial holds.
        if (wk != 0.0f) {
          acc.x = fmaf(wk, x[u][k].x, acc.x);
          acc.y = fmaf(wk, x[u][k].y, acc.y);
          acc.z = fmaf(wk, x[u][k].z, acc.z);
          acc.w = fmaf(wk, x[u][k].w, acc.w);
        }
      }
#pragma unroll
      for (int offset = 1; offset < kSkParts; offset <<= 1) {
        acc.x += __shfl_xor_sync(0xffffffffu, acc.x, offset);
        acc.y += __shfl_xor_sync(0xffffffffu, acc.y, offset);
        acc.z += __shfl_xor_sync(0xffffffffu, acc.z, offset);
        acc.w += __shfl_xor_sync(0xffffffffu, acc.w, offset);
      }
      if (part == 0 && tt0 + u < tokens) *reinterpret_cast<float4*>(&s_lat[(tt0 + u) * kSkLd + 4 * quad]) = acc;
    }
  }
  __syncthreads();
  sk_trace_stamp(3);

  // This slice's product o_lat[:, cols] · W_UV[:, cols]ᵀ into s_prod (rows past the batch hold zeros' products).
#pragma unroll
  for (int round = 0; round < kVRounds; ++round) {
    const int vb = warp + kSkWarps * round;
    if (vb >= v_blocks) break;
    float acc[2][4] = {};
#pragma unroll
    for (int b = 0; b < 2; ++b) {
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        const int c = 32 * b + 8 * tq + 4 * s;
        const uint32_t a0 = s == 0 ? wa[round][b].x : wa[round][b].z, a1 = s == 0 ? wa[round][b].y : wa[round][b].w;
        const uint32_t b0 = s == 0 ? wb[round][b].x : wb[round][b].z, b1 = s == 0 ? wb[round][b].y : wb[round][b].w;
        const float4 x_lo = *reinterpret_cast<const float4*>(&s_lat[g * kSkLd + c]);
        const float4 x_hi = *reinterpret_cast<const float4*>(&s_lat[(g + 8) * kSkLd + c]);
        uint32_t hi[4], lo[4];
        split_bf16(x_lo.x, x_lo.y, hi[0], lo[0]);
        split_bf16(x_hi.x, x_hi.y, hi[1], lo[1]);
        split_bf16(x_lo.z, x_lo.w, hi[2], lo[2]);
        split_bf16(x_hi.z, x_hi.w, hi[3], lo[3]);
        detail::mma_bf16_16816(acc[0], hi, a0, a1);
        detail::mma_bf16_16816(acc[0], lo, a0, a1);
        detail::mma_bf16_16816(acc[1], hi, b0, b1);
        detail::mma_bf16_16816(acc[1], lo, b0, b1);
      }
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const int v = vb * 16 + nt * 8 + 2 * tq;
      *reinterpret_cast<float2*>(&s_prod[g * kSkLdProd + v]) = make_float2(acc[nt][0], acc[nt][1]);
      *reinterpret_cast<float2*>(&s_prod[(g + 8) * kSkLdProd + v]) = make_float2(acc[nt][2], acc[nt][3]);
    }
  }

  sk_trace_stamp(4);
  cluster.sync();  // every slice's s_prod written and visible to the cluster
  sk_trace_stamp(5);
  for (int e = slice * kSkThreads + tid; e < tokens * v_head; e += slices * kSkThreads) {
    const int tt = e / v_head, v = e - tt * v_head;
    float sum = 0.0f;
#pragma unroll
    for (int r = 0; r < kSkMaxSlices; ++r) {
      if (r < slices) sum += cluster.map_shared_rank(s_prod, r)[tt * kSkLdProd + v];
    }
    const int64_t at = ((t0 + tt) * num_heads + h) * v_head + v;
    if (out_bf16 != nullptr) {
      out_bf16[at] = __float2bfloat16(sum);
    } else {
      out[at] = sum;
    }
  }
  cluster.sync();  // the other slices have read this CTA's s_prod
  sk_trace_stamp(6);
}

// ---- launch ---------------------------------------------------------------------------------------------------
// DELTASERVE_MLA_TC=legacy: the original kernels and split heuristic (a bypass without a rebuild).
bool legacy_tc_from_env() {
  static const bool legacy = [] {
    const char* e = std::getenv("DELTASERVE_MLA_TC");
    return e != nullptr && std::string(e) == "legacy";
  }();
  return legacy;
}

// Rows per context split at least: kMinSplitRows, or DELTASERVE_MLA_MIN_SPLIT_ROWS = 32, 64, 128 or 256 (read once
// per process; other values are ignored). Fewer rows per split shorten each attention CTA's chain of tiles at small
// batches (Kimi-48B, T = 1, ctx 4096: 64 splits of 2 tiles with 16-head groups instead of 32 splits of 4 tiles with
// 8-head groups, every row read by 2 CTAs instead of 4) for twice the latent partials (4 MB instead of 2 MB, written
// and read back by the combine). Not measured yet: a knob for the H200 A/B run; both kernel generations follow it.
int min_split_rows() {
  static const int rows = [] {
    const char* e = std::getenv("DELTASERVE_MLA_MIN_SPLIT_ROWS");
    if (e == nullptr) return kMinSplitRows;
    const std::string value = e;
    for (int allowed : {32, 64, 128, 256}) {
      if (value == std::to_string(allowed)) return allowed;
    }
    return kMinSplitRows;
  }();
  return rows;
}

bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

// Launched with programmatic dependent launch unless DELTASERVE_MLA_PDL=0.
template <typename... Params, typename... Args>
Status launch_with_pdl(void (*kernel)(Params...), dim3 grid, int threads, size_t smem, cudaStream_t stream,
                       const char* who, Args... args) {
  return launch_kernel_ex(detail::mla_pdl_from_env(), kernel, grid, dim3(static_cast<unsigned>(threads)), smem, stream,
                          who, args...);
}

// The split-K combine in clusters of ceil(kv_lora / kSkCols) CTAs along x, with PDL unless DELTASERVE_MLA_PDL=0.
Status launch_split_k_combine(const MlaAttentionParams& p, const MlaAttentionArgs& args, int64_t num_tokens,
                              cudaStream_t stream, const char* who) {
  const unsigned slices = static_cast<unsigned>((p.kv_lora_rank + kSkCols - 1) / kSkCols);
  cudaLaunchAttribute attributes[2] = {};
  attributes[0].id = cudaLaunchAttributeClusterDimension;
  attributes[0].val.clusterDim.x = slices;
  attributes[0].val.clusterDim.y = 1;
  attributes[0].val.clusterDim.z = 1;
  attributes[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attributes[1].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim =
      dim3(slices, static_cast<unsigned>(p.num_heads), static_cast<unsigned>((num_tokens + kSkTokens - 1) / kSkTokens));
  config.blockDim = dim3(kSkThreads);
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  config.attrs = attributes;
  config.numAttrs = detail::mla_pdl_from_env() ? 2 : 1;
  void (*kernel)(const float*, const float2*, const __nv_bfloat16*, int64_t, int, int, int, int, int, float*,
                 __nv_bfloat16*) =
      p.v_head <= 16 * kSkWarps ? mla_combine_split_k_kernel<1> : mla_combine_split_k_kernel<kSkVRounds>;
  if (const cudaError_t error = cudaLaunchKernelEx(
          &config, kernel, static_cast<const float*>(args.partial_o), static_cast<const float2*>(args.partial_ml),
          p.kv_b, num_tokens, p.num_heads, p.kv_lora_rank, p.qk_nope, p.v_head, args.splits, p.out, p.out_bf16);
      error != cudaSuccess) {
    (void)cudaGetLastError();
    return internal_error(std::string(who) + ": split-K combine launch: " + cudaGetErrorName(error) + " (" +
                          cudaGetErrorString(error) + ")");
  }
  return launch_status(who);
}

Status set_smem(const void* kernel, size_t bytes, const char* who) {
  if (cudaError_t e =
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
      e != cudaSuccess) {
    return Status(StatusCode::kInternal, std::string(who) + ": cudaFuncSetAttribute: " + cudaGetErrorString(e));
  }
  return Status::ok();
}

}  // namespace

int mla_num_splits(int64_t num_tokens, int max_context) {
  if (num_tokens <= 0 || max_context <= 0) return 1;
  if (legacy_tc_from_env()) {
    // The original heuristic: >= 256 rows per split, about two waves of CTAs.
    if (max_context <= 512) return 1;
    const int64_t by_length = (static_cast<int64_t>(max_context) + 255) / 256;
    const int64_t by_occupancy = (kLegacyTargetCtas + num_tokens - 1) / num_tokens;
    return static_cast<int>(std::clamp<int64_t>(std::min(by_length, by_occupancy), 1, kMlaMaxSplits));
  }
  // >= min_split_rows() rows per split, and about one wave of (token, split) CTAs (one attention CTA fits an SM; the
  // head groups of mla_decode_head_group fill the wave further at one or two tokens). The split count is a host
  // choice shared with the workspace size, so the per-call legacy_tc_attention flag does not change it.
  const int64_t by_length = (static_cast<int64_t>(max_context) + min_split_rows() - 1) / min_split_rows();
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
    // Past kLegacyTargetCtas tokens splits stay 1 (both heuristics) and the size grows with t: jump to the end.
    t = (t > kLegacyTargetCtas) ? std::max(t + 1, max_tokens) : t + 1;
  }
  return bytes;
}

namespace detail {

MlaDecodeKernel mla_resolve_decode_kernel(MlaDecodeKernel requested) {
  if (requested != MlaDecodeKernel::kDefault) return requested;
  static const MlaDecodeKernel from_env = [] {
    const char* e = std::getenv("DELTASERVE_MLA_DECODE_KERNEL");
    const std::string value = e != nullptr ? e : "";
    return value == "v1" ? MlaDecodeKernel::kV1 : value == "v2" ? MlaDecodeKernel::kV2 : MlaDecodeKernel::kV3;
  }();
  return from_env;
}

bool mla_pdl_from_env() {
  static const bool pdl = [] {
    const char* e = std::getenv("DELTASERVE_MLA_PDL");
    return e == nullptr || std::string(e) != "0";
  }();
  return pdl;
}

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
  if (p.decode_kernel != MlaDecodeKernel::kDefault && p.decode_kernel != MlaDecodeKernel::kV1 &&
      p.decode_kernel != MlaDecodeKernel::kV2 && p.decode_kernel != MlaDecodeKernel::kV3) {
    return invalid_argument(w + ": unknown decode_kernel " + std::to_string(static_cast<int>(p.decode_kernel)));
  }
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
  if (p.legacy_tc_attention || legacy_tc_from_env()) return launch_mla_legacy(p, args, q_tilde, scale, stream, who);

  const int64_t T = p.num_tokens;
  const MlaDecodeKernel generation = mla_resolve_decode_kernel(p.decode_kernel);
  const size_t absorb_smem = absorb_smem_bytes(p.qk_nope);
  if (Status s = set_smem(reinterpret_cast<const void*>(mla_absorb_kernel), absorb_smem, who); !s.is_ok()) return s;
  const dim3 absorb_grid(static_cast<unsigned>((T + kAbsorbTokens - 1) / kAbsorbTokens),
                         static_cast<unsigned>(p.num_heads),
                         static_cast<unsigned>((p.kv_lora_rank + kAbsorbCols - 1) / kAbsorbCols));
  if (Status s =
          launch_with_pdl(mla_absorb_kernel, absorb_grid, kAbsorbThreads, absorb_smem, stream, who, p.q, p.q_stride,
                          p.kv_b, T, p.num_heads, p.kv_lora_rank, p.qk_nope, p.qk_rope, p.v_head, scale, q_tilde);
      !s.is_ok()) {
    return s;
  }

  if (p.fp32_attention) {
    args.head_group = mla_fp32_head_group(p.num_heads, p.kv_lora_rank);
    if (Status s = launch_mla_fp32_attention(args, T, stream, who); !s.is_ok()) return s;
  } else {
    args.head_group = mla_decode_head_group(T, p.num_heads, p.max_context);
    const detail::WUvPrefetch w_uv{T <= 16 ? p.kv_b : nullptr, p.qk_nope, p.v_head};
    if (decode && generation == MlaDecodeKernel::kV3 && mla_wgmma_decode_supported(args) && current_device_is_sm90()) {
      if (Status s = launch_mla_wgmma_decode(args, w_uv, T, mla_pdl_from_env(), stream, who); !s.is_ok()) return s;
    } else {
      const size_t smem = attn_layout(p.kv_lora_rank + p.qk_rope).total;
      const bool two_m_tiles = args.head_group > 16;
      void (*kernel)(MlaAttentionArgs, detail::WUvPrefetch) =
          two_m_tiles ? mla_split_attention_mma_kernel<2> : mla_split_attention_mma_kernel<1>;
      if (Status s = set_smem(reinterpret_cast<const void*>(kernel), smem, who); !s.is_ok()) return s;
      const dim3 grid(static_cast<unsigned>(T), static_cast<unsigned>(splits),
                      static_cast<unsigned>((p.num_heads + args.head_group - 1) / args.head_group));
      if (Status s = launch_with_pdl(kernel, grid, kAttnThreads, smem, stream, who, args, w_uv); !s.is_ok()) return s;
    }
  }

  if (generation != MlaDecodeKernel::kV1 && T <= kMlaSplitKCombineMaxTokens) {
    return launch_split_k_combine(p, args, T, stream, who);
  }
  const size_t combine_smem = combine_smem_bytes();
  if (Status s = set_smem(reinterpret_cast<const void*>(mla_combine_kernel), combine_smem, who); !s.is_ok()) return s;
  const dim3 combine_grid(static_cast<unsigned>((T + kCombineTokens - 1) / kCombineTokens),
                          static_cast<unsigned>(p.num_heads));
  return launch_with_pdl(mla_combine_kernel, combine_grid, kCombineThreads, combine_smem, stream, who,
                         static_cast<const float*>(args.partial_o), static_cast<const float2*>(args.partial_ml), p.kv_b,
                         T, p.num_heads, p.kv_lora_rank, p.qk_nope, p.v_head, splits, p.out, p.out_bf16);
}

#ifdef DELTASERVE_MLA_V3_TRACE
// The split-K combine's timeline of the last launches (bench/gpu/mla_v3_trace_bench.cu), cleared after reading.
std::vector<unsigned long long> mla_combine_trace_take() {
  return timeline_take(g_sk_trace);
}
#endif
}  // namespace detail

Status mla_decode(const MlaAttentionParams& params, cudaStream_t stream) {
  return detail::mla_attention_launch(params, /*decode=*/true, "mla_decode", stream);
}

}  // namespace deltaserve::kernels::cuda
