// The absorbed MLA attention's step 3 (decode.cu's file comment): the context splits' partials merged with
// log-sum-exp weights into fp32 latent rows, then out = o_lat · W_UVᵀ on tensor cores. Two kernels by batch size:
//   up to kMlaSplitKCombineMaxTokens tokens: a cluster of up to 8 CTAs per (16 tokens, head), each merging 64 latent
//     columns and multiplying them by its slice of W_UV, the slices' products added in a fixed order over distributed
//     shared memory: small batches spread W_UV and the partials over many CTAs (256 at Kimi-48B dims and T = 1);
//   past that: one CTA per (32 tokens, head), which reads W_UV once per 32 tokens.
// Both write bf16 instead of fp32 when MlaAttentionParams::out_bf16 is set (the rounding of the same fp32 value).
#include <string>

#include <cooperative_groups.h>

#include "kernels/cuda/common/detail/mma_sm80.cuh"
#include "kernels/cuda/common/launch_status.hpp"
#include "kernels/cuda/mla/detail/attention.cuh"
#include "kernels/cuda/mla/mla.hpp"

namespace deltaserve::kernels::cuda {
namespace {

namespace cg = cooperative_groups;
using detail::MlaAttentionArgs;

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

// ---- split-K combine + W_UV at small batches -------------------------------------------------------------------
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

// grid (slices, H, ceil(T / kSkTokens)) in clusters of (slices, 1, 1), block kSkThreads; kv_b 16-byte aligned.
// Writes out_bf16 when it is set, else out. kVRounds: 16-row W_UV blocks per warp (1 up to v_head 128).
// Built for latency at small batches, where it runs right after the attention:
// - every partial of the CTA's columns and every (max, sum) pair of the head is loaded right after the wait, in one
//   round of loads;
// - every warp computes the split weights itself from the pairs (mla_split_weights' reductions) and takes its
//   lanes' weights by shuffles: no shared-memory weights and no block barrier before the merge;
// - at most 80 registers (2 tokens' loads in flight, W_UV rows held only where v_head needs them), so three CTAs
//   fit an SM, and one fits beside a warpgroup-MMA attention CTA of 8 or 16 heads (the register file is split
//   among four schedulers, so more registers would leave none beside it).
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

  cluster.sync();  // every slice's s_prod written and visible to the cluster
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
}

// The split-K combine in clusters of ceil(kv_lora / kSkCols) CTAs along x, with PDL.
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
  config.numAttrs = 2;
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

}  // namespace

namespace detail {

Status launch_mla_combine(const MlaAttentionParams& p, const MlaAttentionArgs& args, int64_t num_tokens,
                          cudaStream_t stream, const char* who) {
  if (num_tokens <= kMlaSplitKCombineMaxTokens) return launch_split_k_combine(p, args, num_tokens, stream, who);
  const size_t combine_smem = combine_smem_bytes();
  if (Status s = mla_set_smem(reinterpret_cast<const void*>(mla_combine_kernel), combine_smem, who); !s.is_ok()) {
    return s;
  }
  const dim3 combine_grid(static_cast<unsigned>((num_tokens + kCombineTokens - 1) / kCombineTokens),
                          static_cast<unsigned>(p.num_heads));
  return mla_launch_with_pdl(mla_combine_kernel, combine_grid, kCombineThreads, combine_smem, stream, who,
                             static_cast<const float*>(args.partial_o), static_cast<const float2*>(args.partial_ml),
                             p.kv_b, num_tokens, p.num_heads, p.kv_lora_rank, p.qk_nope, p.v_head, args.splits, p.out,
                             p.out_bf16);
}

}  // namespace detail
}  // namespace deltaserve::kernels::cuda
