// Body of the mma.sync split-attention kernel that decode.cu launches (see its file comment, step 2) and the helpers
// the warpgroup-MMA kernel of decode_wgmma.cu shares with it (the slice of a split, the W_UV prefetch).
#pragma once

#include <cstdint>

#include <cuda_bf16.h>

#include "common/status.hpp"
#include "kernels/cuda/common/detail/mma_sm80.cuh"
#include "kernels/cuda/mla/detail/attention.cuh"
#include "kernels/cuda/mla/mla.hpp"

namespace deltaserve::kernels::cuda::detail {

// ---- 2. split attention on tensor cores ----------------------------------------------------------------------
constexpr int kAttnThreads = 256;
constexpr int kAttnWarps = kAttnThreads / 32;
constexpr int kAttnRows = 32;   // rows per tile; == warp size (the softmax maps lane -> row)
constexpr int kAttnStages = 4;  // ring of tiles: kAttnStages - 1 loading while one is computed
constexpr int kAttnMaxGroup = 32;
constexpr int kAttnScoreRows = 128;      // partial-score rows: (k splits) x (heads) = 4 x 32 = 8 x 16
constexpr int kAttnLdS = kAttnRows + 8;  // floats per partial-score row (float2 stores without bank conflicts)
constexpr int kAttnLdP = kAttnRows + 8;  // bf16 per P row (ldmatrix rows on distinct banks)
constexpr int kAttnPairsPerWarp = kMlaMaxKvLora / 16 / kAttnWarps;  // 16-column pairs of the latent per warp
constexpr int kAttnKSteps = (kMlaMaxKvLora + kMlaMaxRope) / 16;     // k steps of the scores at most
static_assert(kAttnRows % kAttnWarps == 0, "rows spread evenly over the warps' loads");

struct AttnLayout {
  int width16, ld_rows;
  size_t rows, scores, p, scale, total;
};

__host__ __device__ inline size_t align128(size_t x) {
  return (x + 127) / 128 * 128;
}

__host__ __device__ inline AttnLayout attn_layout(int width) {
  AttnLayout l;
  l.width16 = (width + 15) / 16 * 16;
  l.ld_rows = l.width16 + 8;  // +16 bytes: ldmatrix rows on distinct banks
  size_t off = 0;
  l.rows = off;
  off += align128(sizeof(__nv_bfloat16) * kAttnStages * kAttnRows * l.ld_rows);
  l.scores = off;
  off += align128(sizeof(float) * kAttnScoreRows * kAttnLdS);
  l.p = off;
  off += align128(sizeof(__nv_bfloat16) * kAttnMaxGroup * kAttnLdP);
  l.scale = off;
  off += align128(sizeof(float) * kAttnMaxGroup);
  l.total = off;
  return l;
}

// The sequence of token t: the largest n with cu_q[n] <= t (zero-length sequences share their start), found by
// the whole warp with 32 probes a round (two rounds for 1024 sequences).
__device__ __forceinline__ int find_sequence(const int32_t* cu_q, int num_seqs, int64_t t) {
  const int lane = threadIdx.x & 31;
  int lo = 0, hi = num_seqs - 1;  // cu_q[lo] <= t; the answer lies in [lo, hi]
  while (lo < hi) {
    const int step = (hi - lo + 32) / 32;
    const int probe = min(hi, lo + lane * step);
    const unsigned below = __ballot_sync(0xffffffffu, cu_q[probe] <= t);  // bit 0 set: cu_q[lo] <= t
    const int last = 31 - __clz(static_cast<int>(below));
    lo = min(hi, lo + last * step);
    hi = min(hi, lo + step - 1);
  }
  return lo;
}

struct Slice {
  int n;                       // sequence
  int64_t row_begin, row_end;  // context rows of this split
};

// Rows of token t's visible context that split `split` covers: equal slices, whole tiles of `tile_rows` each (the
// last split may be shorter or empty).
__device__ __forceinline__ Slice attention_slice(const MlaAttentionArgs& a, int64_t t, int split,
                                                 int tile_rows = kAttnRows) {
  Slice s;
  s.n = find_sequence(a.cu_q, a.num_seqs, t);
  const int64_t q_begin = a.cu_q[s.n];
  const int64_t q_len = static_cast<int64_t>(a.cu_q[s.n + 1]) - q_begin;
  const int64_t context = a.context_lens[s.n];
  int64_t visible = context - q_len + (t - q_begin) + 1;  // rows 0 .. position
  visible = mla_i64_max(0, mla_i64_min(visible, static_cast<int64_t>(a.max_pages_per_seq) * a.page_size));
  int64_t per_split = (visible + a.splits - 1) / a.splits;
  per_split = (per_split + tile_rows - 1) / tile_rows * tile_rows;
  s.row_begin = mla_i64_min(visible, per_split * split);
  s.row_end = mla_i64_min(visible, s.row_begin + per_split);
  return s;
}

// Page id of row `lane` of tile `tile` of the slice; -1 past the slice.
__device__ __forceinline__ int32_t tile_page(const MlaAttentionArgs& a, const int32_t* table, const Slice& s, int tile,
                                             int lane) {
  const int64_t position = s.row_begin + static_cast<int64_t>(tile) * kAttnRows + lane;
  if (position >= s.row_end) return -1;
  return __ldg(table + static_cast<int>(position) / a.page_size);  // positions < context_lens[n] <= INT32_MAX
}

// Element offset in the pool of row `lane` of tile `tile` on page `page`; -1 for no row (past the slice, or a page
// id outside the pool: never dereferenced, the row reads as zeros).
__device__ __forceinline__ int64_t row_offset(const MlaAttentionArgs& a, const Slice& s, int tile, int lane,
                                              int32_t page) {
  if (page < 0 || page >= a.num_pages) return -1;
  const int position = static_cast<int>(s.row_begin + static_cast<int64_t>(tile) * kAttnRows + lane);
  return ((static_cast<int64_t>(page) * a.num_layers + a.layer) * a.page_size + position % a.page_size) * a.row_stride;
}

// cp.async of one tile: warp w copies rows w, w + 8, ...; the row's offset comes from the lane that looked it up.
__device__ __forceinline__ void issue_tile(const MlaAttentionArgs& a, int64_t lane_offset, __nv_bfloat16* dst, int ld,
                                           int vecs_per_row) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int i = 0; i < kAttnRows / kAttnWarps; ++i) {
    const int r = warp + i * kAttnWarps;
    const int64_t offset = __shfl_sync(0xffffffffu, lane_offset, r);
    for (int cv = lane; cv < vecs_per_row; cv += 32) {
      cp_async16_zfill(dst + r * ld + cv * 8, offset >= 0 ? a.pages + offset + cv * 8 : a.pages, offset >= 0);
    }
  }
}

// At small batches the CTAs of token 0 prefetch W_UV (the rows of kv_b after each head's W_UK) into L2 for the
// combine that follows (its 4 MB at Kimi-48B dims would otherwise be read from HBM after the attention).
struct WUvPrefetch {
  const __nv_bfloat16* kv_b;  // nullptr: no prefetch
  int nope, v_head;
};

// The split attention on warpgroup MMA and TMA (decode_wgmma.cu): whether it covers these arguments
// (args.head_group as mla_decode_head_group chose it), and its launch with programmatic dependent launch (same grid,
// workspace and partials as mla_split_attention_mma_kernel). Hopper only.
bool mla_wgmma_decode_supported(const MlaAttentionArgs& args);
Status launch_mla_wgmma_decode(const MlaAttentionArgs& args, const WUvPrefetch& w_uv, int64_t num_tokens,
                               cudaStream_t stream, const char* who);

// Hints W_UV of heads [h0, h0 + heads) into L2, this split's share of its 128-byte lines.
__device__ __forceinline__ void prefetch_w_uv(const MlaAttentionArgs& a, const WUvPrefetch& w, int h0, int heads,
                                              int split) {
  const int64_t lines_per_head = (static_cast<int64_t>(w.v_head) * a.kv_lora * 2 + 127) / 128;
  const int64_t lines = lines_per_head * heads;
  for (int64_t i = static_cast<int64_t>(split) * kAttnThreads + threadIdx.x; i < lines;
       i += static_cast<int64_t>(a.splits) * kAttnThreads) {
    const int h = h0 + static_cast<int>(i / lines_per_head);
    const char* w_uv =
        reinterpret_cast<const char*>(w.kv_b + (static_cast<int64_t>(h) * (w.nope + w.v_head) + w.nope) * a.kv_lora);
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(w_uv + (i % lines_per_head) * 128));
  }
}

// grid (T, splits, ceil(H / head_group)), block kAttnThreads, dynamic smem attn_layout(width).total;
// head_group <= 16 * kMTiles. Warp w: scores of m tile w / kKSplit over k steps share w % kKSplit; softmax of heads
// w, w + 8, ...; P·rows of latent column pairs w, w + 8, ...
template <int kMTiles>
__global__ void __launch_bounds__(kAttnThreads, 1)
    mla_split_attention_mma_kernel(MlaAttentionArgs a, WUvPrefetch w_uv) {
  constexpr int kGroup = 16 * kMTiles;
  constexpr int kKSplit = kAttnWarps / kMTiles;
  constexpr int kMaxKSteps = (kAttnKSteps + kKSplit - 1) / kKSplit;
  constexpr int kHeadsPerWarp = kGroup / kAttnWarps;
  static_assert(kKSplit * kGroup == kAttnScoreRows && kGroup <= kAttnMaxGroup, "partial-score layout");
  extern __shared__ __align__(128) unsigned char attn_smem[];
  const int width = a.kv_lora + a.rope;
  const AttnLayout L = attn_layout(width);
  __nv_bfloat16* s_rows = reinterpret_cast<__nv_bfloat16*>(attn_smem + L.rows);  // [stage][kAttnRows][ld_rows]
  float* s_part = reinterpret_cast<float*>(attn_smem + L.scores);                // [kKSplit][kGroup][kAttnLdS]
  __nv_bfloat16* s_p = reinterpret_cast<__nv_bfloat16*>(attn_smem + L.p);        // [kGroup][kAttnLdP]
  float* s_scale = reinterpret_cast<float*>(attn_smem + L.scale);                // [kGroup]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, tq = lane & 3;
  const int64_t t = blockIdx.x;
  const int split = blockIdx.y;
  const int h0 = blockIdx.z * a.head_group;
  const int heads = min(a.head_group, a.num_heads - h0);
  const int m_tiles = (heads + 15) / 16;
  const int stage_elements = kAttnRows * L.ld_rows;
  const int vecs_per_row = width / 8;

  // Before the wait: sequence, slice, page ids and the first kAttnStages - 1 tiles (none of it is the absorb's).
  const Slice slice = attention_slice(a, t, split);
  const int32_t* table = a.block_tables + static_cast<int64_t>(slice.n) * a.max_pages_per_seq;
  const int num_tiles = static_cast<int>((slice.row_end - slice.row_begin + kAttnRows - 1) / kAttnRows);
  int32_t first_pages[kAttnStages];
#pragma unroll
  for (int j = 0; j < kAttnStages; ++j) first_pages[j] = tile_page(a, table, slice, j, lane);
#pragma unroll
  for (int j = 0; j < kAttnStages - 1; ++j) {
    if (j < num_tiles) {
      issue_tile(a, row_offset(a, slice, j, lane, first_pages[j]), s_rows + j * stage_elements, L.ld_rows,
                 vecs_per_row);
    }
    cp_async_commit();
  }
  int32_t next_page = first_pages[kAttnStages - 1];  // row `lane` of the next tile to load
  // Column padding of every stage (never loaded) and P rows of padding heads are zeros; scales start at 1.
  const int pad_cols = L.width16 - width;
  for (int i = tid; i < kAttnStages * kAttnRows * pad_cols; i += kAttnThreads) {
    s_rows[(i / pad_cols) * L.ld_rows + width + i % pad_cols] = __float2bfloat16(0.0f);
  }
  for (int i = tid; i < kGroup * kAttnLdP; i += kAttnThreads) s_p[i] = __float2bfloat16(0.0f);
  if (tid < kGroup) s_scale[tid] = 1.0f;
  if (w_uv.kv_b != nullptr && t == 0) prefetch_w_uv(a, w_uv, h0, heads, split);
  mla_wait_for_previous_grid();
  mla_allow_next_grid();

  // q̃ fragments of this warp's m tile and k steps, rounded to bf16, kept in registers for every tile.
  const int mt = warp / kKSplit, kq = warp % kKSplit;
  const int k_steps = L.width16 / 16;
  const int steps_per_warp = (k_steps + kKSplit - 1) / kKSplit;
  const int ks_begin = kq * steps_per_warp;
  const int ks_count = max(0, min(steps_per_warp, k_steps - ks_begin));
  uint32_t qf[kMaxKSteps][4];
  {
    const float* q_src = a.q_tilde + (t * a.num_heads + h0) * width;
    const int h_lo = mt * 16 + g, h_hi = h_lo + 8;
    auto q_pair = [&](bool in, int h, int col) {  // col even; width is a multiple of 8
      float2 x = make_float2(0.0f, 0.0f);
      if (in && h < heads && col < width) x = *reinterpret_cast<const float2*>(q_src + h * width + col);
      return pack_bf16(x.x, x.y);
    };
#pragma unroll
    for (int s = 0; s < kMaxKSteps; ++s) {
      const bool in = s < ks_count;
      const int col = (ks_begin + s) * 16 + 2 * tq;
      qf[s][0] = q_pair(in, h_lo, col);
      qf[s][1] = q_pair(in, h_hi, col);
      qf[s][2] = q_pair(in, h_lo, col + 8);
      qf[s][3] = q_pair(in, h_hi, col + 8);
    }
  }

  float m_run[kHeadsPerWarp], l_run[kHeadsPerWarp];  // the warp's heads warp + 8 i (same in every lane)
#pragma unroll
  for (int i = 0; i < kHeadsPerWarp; ++i) {
    m_run[i] = -INFINITY;
    l_run[i] = 0.0f;
  }
  const int pairs = (a.kv_lora + 15) / 16;
  float acc[kAttnPairsPerWarp][kMTiles][2][4];  // [pair slot][m tile][n tile of the pair][fragment]
#pragma unroll
  for (int j = 0; j < kAttnPairsPerWarp; ++j)
#pragma unroll
    for (int m2 = 0; m2 < kMTiles; ++m2)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][m2][nt][e] = 0.0f;

  for (int it = 0; it < num_tiles; ++it) {
    cp_async_wait<kAttnStages - 2>();
    // Tile `it` is in; every warp is past the previous tile's P·rows (its stage, P and scales are free) and the
    // previous softmax (partial scores free).
    __syncthreads();
    {
      const int load = it + kAttnStages - 1;
      if (load < num_tiles) {
        issue_tile(a, row_offset(a, slice, load, lane, next_page), s_rows + (load % kAttnStages) * stage_elements,
                   L.ld_rows, vecs_per_row);
      }
      cp_async_commit();
      next_page = tile_page(a, table, slice, load + 1, lane);  // used next iteration: its latency hides here
    }
    const __nv_bfloat16* rows = s_rows + (it % kAttnStages) * stage_elements;
    const int rows_valid = static_cast<int>(
        mla_i64_min(kAttnRows, slice.row_end - slice.row_begin - static_cast<int64_t>(it) * kAttnRows));

    // Partial scores of m tile mt over this warp's k steps: 4 n tiles of 8 rows, 4 independent mma chains.
    if (mt < m_tiles) {
      float sc[4][4];
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) sc[nt][e] = 0.0f;
#pragma unroll
      for (int s = 0; s < kMaxKSteps; ++s) {
        if (s < ks_count) {
          const int k0 = (ks_begin + s) * 16;
          uint32_t b0[4], b1[4];
          load_b_nk(b0, rows, L.ld_rows, 0, k0);
          load_b_nk(b1, rows, L.ld_rows, 16, k0);
          mma_bf16_16816(sc[0], qf[s], b0[0], b0[1]);
          mma_bf16_16816(sc[1], qf[s], b0[2], b0[3]);
          mma_bf16_16816(sc[2], qf[s], b1[0], b1[1]);
          mma_bf16_16816(sc[3], qf[s], b1[2], b1[3]);
        }
      }
      float* dst = s_part + (kq * kGroup + mt * 16 + g) * kAttnLdS + 2 * tq;
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        *reinterpret_cast<float2*>(dst + nt * 8) = make_float2(sc[nt][0], sc[nt][1]);
        *reinterpret_cast<float2*>(dst + 8 * kAttnLdS + nt * 8) = make_float2(sc[nt][2], sc[nt][3]);
      }
    }
    __syncthreads();

    // Online softmax of the warp's heads at once (their shuffle reductions interleave); lane = row.
    {
      float sv[kHeadsPerWarp], mx[kHeadsPerWarp], psum[kHeadsPerWarp], rescale[kHeadsPerWarp];
#pragma unroll
      for (int i = 0; i < kHeadsPerWarp; ++i) {
        const int h = warp + i * kAttnWarps;
        float x = 0.0f;
#pragma unroll
        for (int q = 0; q < kKSplit; ++q) x += s_part[(q * kGroup + h) * kAttnLdS + lane];
        sv[i] = h < heads && lane < rows_valid ? x : -INFINITY;
        mx[i] = sv[i];
      }
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) {
#pragma unroll
        for (int i = 0; i < kHeadsPerWarp; ++i) mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], offset));
      }
#pragma unroll
      for (int i = 0; i < kHeadsPerWarp; ++i) {
        const int h = warp + i * kAttnWarps;
        psum[i] = 0.0f;
        rescale[i] = 1.0f;
        if (h < heads) {
          const float m_new = fmaxf(m_run[i], mx[i]);  // finite: the tile has >= 1 row
          const float p = lane < rows_valid ? exp2f(sv[i] - m_new) : 0.0f;
          const __nv_bfloat16 pb = __float2bfloat16(p);
          // The denominator sums the bf16 values the P·rows product uses, so the weights stay normalised.
          psum[i] = __bfloat162float(pb);
          s_p[h * kAttnLdP + lane] = pb;
          rescale[i] = exp2f(m_run[i] - m_new);  // 0 while m_run = -inf
          m_run[i] = m_new;
        }
      }
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) {
#pragma unroll
        for (int i = 0; i < kHeadsPerWarp; ++i) psum[i] += __shfl_xor_sync(0xffffffffu, psum[i], offset);
      }
#pragma unroll
      for (int i = 0; i < kHeadsPerWarp; ++i) {
        const int h = warp + i * kAttnWarps;
        if (h < heads) {
          l_run[i] = l_run[i] * rescale[i] + psum[i];
          if (lane == 0) s_scale[h] = rescale[i];
        }
      }
    }
    __syncthreads();

    // O = O * rescale + P · rows.
#pragma unroll
    for (int m2 = 0; m2 < kMTiles; ++m2) {
      if (m2 < m_tiles) {
        const float r_lo = s_scale[m2 * 16 + g], r_hi = s_scale[m2 * 16 + g + 8];
#pragma unroll
        for (int j = 0; j < kAttnPairsPerWarp; ++j) {
#pragma unroll
          for (int nt = 0; nt < 2; ++nt) {
            acc[j][m2][nt][0] *= r_lo;
            acc[j][m2][nt][1] *= r_lo;
            acc[j][m2][nt][2] *= r_hi;
            acc[j][m2][nt][3] *= r_hi;
          }
        }
      }
    }
#pragma unroll
    for (int k0 = 0; k0 < kAttnRows; k0 += 16) {
      uint32_t af[kMTiles][4];
#pragma unroll
      for (int m2 = 0; m2 < kMTiles; ++m2) {
        if (m2 < m_tiles) load_a(af[m2], s_p, kAttnLdP, m2 * 16, k0);
      }
#pragma unroll
      for (int j = 0; j < kAttnPairsPerWarp; ++j) {
        const int pair = warp + j * kAttnWarps;
        if (pair < pairs) {
          uint32_t bf[4];
          load_b_kn(bf, rows, L.ld_rows, pair * 16, k0);
#pragma unroll
          for (int m2 = 0; m2 < kMTiles; ++m2) {
            if (m2 < m_tiles) {
              mma_bf16_16816(acc[j][m2][0], af[m2], bf[0], bf[1]);
              mma_bf16_16816(acc[j][m2][1], af[m2], bf[2], bf[3]);
            }
          }
        }
      }
    }
  }

  const int64_t part = (t * a.splits + split) * a.num_heads + h0;
  float* out_o = a.partial_o + part * a.kv_lora;
#pragma unroll
  for (int j = 0; j < kAttnPairsPerWarp; ++j) {
    const int pair = warp + j * kAttnWarps;
    if (pair >= pairs) continue;
#pragma unroll
    for (int m2 = 0; m2 < kMTiles; ++m2) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const int col = pair * 16 + nt * 8 + 2 * tq;
        const int h_lo = m2 * 16 + g, h_hi = h_lo + 8;
        if (col < a.kv_lora) {  // kv_lora is a multiple of 8, so col + 1 < kv_lora too
          if (h_lo < heads) {
            *reinterpret_cast<float2*>(&out_o[h_lo * a.kv_lora + col]) =
                make_float2(acc[j][m2][nt][0], acc[j][m2][nt][1]);
          }
          if (h_hi < heads) {
            *reinterpret_cast<float2*>(&out_o[h_hi * a.kv_lora + col]) =
                make_float2(acc[j][m2][nt][2], acc[j][m2][nt][3]);
          }
        }
      }
    }
  }
  if (lane == 0) {
#pragma unroll
    for (int i = 0; i < kHeadsPerWarp; ++i) {
      const int h = warp + i * kAttnWarps;
      if (h < heads) a.partial_ml[part + h] = make_float2(m_run[i], l_run[i]);
    }
  }
}

}  // namespace deltaserve::kernels::cuda::detail
