// The MLA attention kernels kept beside the default absorbed pipeline of mla_decode.cu (see mla_attention.cuh):
//   fp32 CUDA-core split attention (MlaAttentionParams::fp32_attention): everything fp32, tiles of 32 rows; the
//     exact reference path the tests hold the tensor-core kernels against, several times slower. It runs between
//     the default absorb and combine kernels.
//   the original tensor-core pipeline (MlaAttentionParams::legacy_tc_attention, DELTASERVE_MLA_TC=legacy): absorb
//     with one CTA per (8 tokens, head), split attention with 64-row tiles double-buffered by cp.async and a
//     page-table lookup plus two int64 divisions per 16-byte vector and thread, combine with one CTA per
//     (token, head). Unchanged since it was the default (but for the combine's optional bf16 store,
//     MlaAttentionParams::out_bf16); a bypass of the default kernels without a rebuild.
// Both write the partials of mla_attention.cuh (MlaAttentionArgs) and read the real context lengths on the device.
#include <algorithm>
#include <cmath>
#include <string>

#include "kernels/cuda/common/launch_status.hpp"
#include "kernels/cuda/mla/mla.hpp"
#include "kernels/cuda/mla/detail/attention.cuh"
#include "kernels/cuda/common/detail/mma_sm80.cuh"

namespace deltaserve::kernels::cuda {
namespace {

using detail::MlaAttentionArgs;
using AttentionArgs = MlaAttentionArgs;

constexpr int kAttnThreads = 512;
constexpr int kAttnWarps = kAttnThreads / 32;
constexpr int kTileRows = 32;      // rows per tile; == warp size (the softmax maps lane -> row)
constexpr int kMaxHeadGroup = 32;  // heads per attention CTA
constexpr int kAccPerThread = 32;  // latent accumulators per thread: head_group * kv_lora <= 512 * 32
constexpr int kAbsorbTokens = 8;   // query tokens per absorb CTA (W_UK reuse)
constexpr int kAbsorbThreads = 256;
constexpr int kCombineThreads = 256;

__device__ __forceinline__ int64_t i64_min(int64_t a, int64_t b) {
  return detail::mla_i64_min(a, b);
}
__device__ __forceinline__ int64_t i64_max(int64_t a, int64_t b) {
  return detail::mla_i64_max(a, b);
}
__device__ __forceinline__ float warp_sum(float x) {
  return detail::mla_warp_sum(x);
}
__device__ __forceinline__ float warp_max(float x) {
  return detail::mla_warp_max(x);
}

struct ReferenceSlice {
  int n;                       // sequence of the token
  int64_t row_begin, row_end;  // context rows of this split
};

// Rows of token t's visible context that split `split` covers (equal slices, the last may be shorter or empty);
// the sequence is the largest n with cu_q[n] <= t (zero-length sequences share their start).
__device__ __forceinline__ ReferenceSlice reference_slice(const AttentionArgs& a, int64_t t, int split) {
  int lo = 0, hi = a.num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (a.cu_q[mid] <= t) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const int n = lo;
  const int64_t q_begin = a.cu_q[n];
  const int64_t q_len = static_cast<int64_t>(a.cu_q[n + 1]) - q_begin;
  const int64_t context = a.context_lens[n];
  int64_t visible = context - q_len + (t - q_begin) + 1;  // rows 0 .. position
  visible = i64_max(0, i64_min(visible, static_cast<int64_t>(a.max_pages_per_seq) * a.page_size));
  const int64_t per_split = (visible + a.splits - 1) / a.splits;
  const int64_t row_begin = i64_min(visible, per_split * split);
  return ReferenceSlice{n, row_begin, i64_min(visible, row_begin + per_split)};
}

// ---- legacy absorb ------------------------------------------------------------------------------------------
// grid (ceil(T / kAbsorbTokens), H), block kAbsorbThreads.
__global__ void __launch_bounds__(kAbsorbThreads)
    mla_absorb_legacy_kernel(const __nv_bfloat16* __restrict__ q, int64_t q_stride,
                             const __nv_bfloat16* __restrict__ kv_b, int64_t num_tokens, int num_heads, int kv_lora,
                             int nope, int rope, int v_head, float scale, float* __restrict__ q_tilde) {
  __shared__ float q_nope[kAbsorbTokens][kMlaMaxNope];
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kAbsorbTokens;
  const int h = blockIdx.y;
  const int count = static_cast<int>(i64_min(kAbsorbTokens, num_tokens - t0));
  const int q_width = nope + rope;
  const int width = kv_lora + rope;
  for (int i = threadIdx.x; i < kAbsorbTokens * nope; i += blockDim.x) {
    const int tt = i / nope, d = i - tt * nope;
    q_nope[tt][d] =
        tt < count ? __bfloat162float(q[(t0 + tt) * q_stride + static_cast<int64_t>(h) * q_width + d]) : 0.0f;
  }
  __syncthreads();
  const __nv_bfloat16* w_uk = kv_b + static_cast<int64_t>(h) * (nope + v_head) * kv_lora;  // [nope, kv_lora]
  for (int c = threadIdx.x; c < kv_lora; c += blockDim.x) {
    float acc[kAbsorbTokens];
#pragma unroll
    for (int tt = 0; tt < kAbsorbTokens; ++tt) acc[tt] = 0.0f;
#pragma unroll 8
    for (int d = 0; d < nope; ++d) {
      const float w = __bfloat162float(w_uk[static_cast<int64_t>(d) * kv_lora + c]);
#pragma unroll
      for (int tt = 0; tt < kAbsorbTokens; ++tt) acc[tt] = fmaf(q_nope[tt][d], w, acc[tt]);
    }
#pragma unroll
    for (int tt = 0; tt < kAbsorbTokens; ++tt) {
      if (tt < count) q_tilde[((t0 + tt) * num_heads + h) * width + c] = acc[tt] * scale;
    }
  }
  for (int i = threadIdx.x; i < count * rope; i += blockDim.x) {
    const int tt = i / rope, j = i - tt * rope;
    const float x = __bfloat162float(q[(t0 + tt) * q_stride + static_cast<int64_t>(h) * q_width + nope + j]);
    q_tilde[((t0 + tt) * num_heads + h) * width + kv_lora + j] = x * scale;
  }
}

// ---- fp32 split attention ------------------------------------------------------------------------------
size_t attention_smem_bytes(int head_group, int width) {
  return sizeof(float) * (static_cast<size_t>(head_group) * width + static_cast<size_t>(kTileRows) * width +
                          static_cast<size_t>(head_group) * kTileRows + 3 * static_cast<size_t>(head_group));
}

// grid (T, splits, ceil(H / head_group)), block kAttnThreads, dynamic smem attention_smem_bytes.
__global__ void __launch_bounds__(kAttnThreads, 1) mla_split_attention_kernel(AttentionArgs a) {
  extern __shared__ float smem[];
  const int width = a.kv_lora + a.rope;
  const int group = a.head_group;
  float* s_q = smem;                         // [group][width]
  float* s_rows = s_q + group * width;       // [kTileRows][width]
  float* s_p = s_rows + kTileRows * width;   // [group][kTileRows]: scores, then probabilities
  float* s_scale = s_p + group * kTileRows;  // [group]
  float* s_m = s_scale + group;              // [group]
  float* s_l = s_m + group;                  // [group]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t t = blockIdx.x;
  const int split = blockIdx.y;
  const int h0 = blockIdx.z * group;
  const int heads = min(group, a.num_heads - h0);

  const ReferenceSlice slice = reference_slice(a, t, split);
  const int n = slice.n;
  const int64_t row_begin = slice.row_begin, row_end = slice.row_end;

  const float* q_src = a.q_tilde + (t * a.num_heads + h0) * width;
  for (int i = tid; i < heads * width; i += kAttnThreads) s_q[i] = q_src[i];
  if (tid < group) {
    s_m[tid] = -INFINITY;
    s_l[tid] = 0.0f;
  }
  const int32_t* table = a.block_tables + static_cast<int64_t>(n) * a.max_pages_per_seq;
  const int vecs_per_row = width / 8;
  const int elements = heads * a.kv_lora;

  float o[kAccPerThread];
#pragma unroll
  for (int k = 0; k < kAccPerThread; ++k) o[k] = 0.0f;

  for (int64_t tile = row_begin; tile < row_end; tile += kTileRows) {
    const int rows = static_cast<int>(i64_min(kTileRows, row_end - tile));
    __syncthreads();  // s_q / s_m ready (first tile); the previous tile's s_rows and s_p are consumed
    for (int v = tid; v < kTileRows * vecs_per_row; v += kAttnThreads) {
      const int r = v / vecs_per_row, cv = v - r * vecs_per_row;
      float4* dst = reinterpret_cast<float4*>(s_rows + r * width + cv * 8);
      float4 lo4 = make_float4(0.f, 0.f, 0.f, 0.f), hi4 = lo4;
      if (r < rows) {
        const int64_t position = tile + r;
        const int32_t page = table[position / a.page_size];
        if (page >= 0 && page < a.num_pages) {
          const int64_t slot = position % a.page_size;
          const __nv_bfloat16* src =
              a.pages + ((static_cast<int64_t>(page) * a.num_layers + a.layer) * a.page_size + slot) * a.row_stride +
              cv * 8;
          const uint4 raw = __ldg(reinterpret_cast<const uint4*>(src));
          const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
          const float2 f0 = __bfloat1622float2(pairs[0]), f1 = __bfloat1622float2(pairs[1]);
          const float2 f2 = __bfloat1622float2(pairs[2]), f3 = __bfloat1622float2(pairs[3]);
          lo4 = make_float4(f0.x, f0.y, f1.x, f1.y);
          hi4 = make_float4(f2.x, f2.y, f3.x, f3.y);
        }
      }
      dst[0] = lo4;
      dst[1] = hi4;
    }
    __syncthreads();
    // Scores (log2 units): one warp per (head, row), lanes split the row.
    for (int pair = warp; pair < heads * kTileRows; pair += kAttnWarps) {
      const int h = pair / kTileRows, r = pair - h * kTileRows;
      float acc = 0.0f;
      if (r < rows) {
        const float* qh = s_q + h * width;
        const float* row = s_rows + r * width;
        for (int c = lane; c < width; c += 32) acc = fmaf(qh[c], row[c], acc);
      }
      acc = warp_sum(acc);
      if (lane == 0) s_p[h * kTileRows + r] = r < rows ? acc : -INFINITY;
    }
    __syncthreads();
    // Online softmax: one warp per head, lane = row.
    for (int h = warp; h < heads; h += kAttnWarps) {
      const float s = s_p[h * kTileRows + lane];
      const float m_old = s_m[h];
      const float m_new = fmaxf(m_old, warp_max(s));  // finite: the tile has >= 1 row
      const float p = lane < rows ? exp2f(s - m_new) : 0.0f;
      const float sum = warp_sum(p);
      s_p[h * kTileRows + lane] = p;
      if (lane == 0) {
        const float rescale = exp2f(m_old - m_new);  // 0 when m_old = -inf
        s_scale[h] = rescale;
        s_m[h] = m_new;
        s_l[h] = s_l[h] * rescale + sum;
      }
    }
    __syncthreads();
    // Latent sum: thread owns elements tid + k * kAttnThreads of the [heads, kv_lora] block.
#pragma unroll
    for (int k = 0; k < kAccPerThread; ++k) {
      const int e = tid + k * kAttnThreads;
      if (e < elements) {
        const int h = e / a.kv_lora, c = e - h * a.kv_lora;
        const float* p = s_p + h * kTileRows;
        const float* col = s_rows + c;
        float acc = o[k] * s_scale[h];
        for (int r = 0; r < rows; ++r) acc = fmaf(p[r], col[r * width], acc);
        o[k] = acc;
      }
    }
  }
  __syncthreads();
  const int64_t part = (t * a.splits + split) * a.num_heads + h0;
  float* out_o = a.partial_o + part * a.kv_lora;
#pragma unroll
  for (int k = 0; k < kAccPerThread; ++k) {
    const int e = tid + k * kAttnThreads;
    if (e < elements) out_o[e] = o[k];
  }
  if (tid < heads) a.partial_ml[part + tid] = make_float2(s_m[tid], s_l[tid]);
}

// ---- legacy split attention on tensor cores ---------------------------------------------------------------
// Same grid, partials and contract as mla_split_attention_kernel, for head groups of up to 32 heads (two m16
// tiles). q̃ is rounded to bf16 in shared memory; rows arrive by cp.async into two buffers of 64 rows (the next
// tile loads while this one computes; rows past the slice or on bad page ids are zero-filled, never read).
//   scores S [heads x 64] = q̃ · rowsᵀ   (mma m16n8k16, fp32 accumulate; warp = (m tile, 16-row pair))
//   online softmax per head in fp32 (warp per head, S and P through shared memory, P rounded to bf16)
//   O [heads x kv_lora] = O · rescale + P · rows[:, :kv_lora]   (warp = up to 4 column pairs of 16, registers)
constexpr int kTcThreads = 256;
constexpr int kTcWarps = kTcThreads / 32;
constexpr int kTcRows = 64;     // rows per tile
constexpr int kTcGroup = 32;    // heads per CTA (2 m tiles)
constexpr int kTcMaxPairs = 4;  // 16-column pairs of the latent per warp: kv_lora <= 16 * 4 * 8 = 512
constexpr int kTcPad = 8;       // bf16 elements of padding per smem row (ldmatrix bank spread)
static_assert(kTcGroup % kTcWarps == 0 && kTcRows % kTcWarps == 0, "heads and rows spread evenly over warps");

struct TcLayout {
  int width16, ld_rows, ld_p;
  size_t q, rows0, rows1, scores, p, stats, total;
};

__host__ __device__ inline size_t tc_align(size_t x) {
  return (x + 127) / 128 * 128;
}

__host__ __device__ inline TcLayout tc_layout(int width) {
  TcLayout l;
  l.width16 = (width + 15) / 16 * 16;
  l.ld_rows = l.width16 + kTcPad;
  l.ld_p = kTcRows + kTcPad;
  size_t off = 0;
  l.q = off;
  off += tc_align(sizeof(__nv_bfloat16) * kTcGroup * l.ld_rows);
  l.rows0 = off;
  off += tc_align(sizeof(__nv_bfloat16) * kTcRows * l.ld_rows);
  l.rows1 = off;
  off += tc_align(sizeof(__nv_bfloat16) * kTcRows * l.ld_rows);
  l.scores = off;
  off += tc_align(sizeof(float) * kTcGroup * kTcRows);
  l.p = off;
  off += tc_align(sizeof(__nv_bfloat16) * kTcGroup * l.ld_p);
  l.stats = off;
  off += tc_align(sizeof(float) * 3 * kTcGroup);
  l.total = off;
  return l;
}

// Issues the cp.async copies of rows [tile, tile + count) of the sequence into `dst` (zero-filled past count).
__device__ __forceinline__ void tc_load_rows(const AttentionArgs& a, const int32_t* table, int64_t tile, int count,
                                             __nv_bfloat16* dst, int ld, int vecs_per_row) {
  for (int v = threadIdx.x; v < kTcRows * vecs_per_row; v += kTcThreads) {
    const int r = v / vecs_per_row, cv = v - r * vecs_per_row;
    const __nv_bfloat16* src = a.pages;
    bool valid = false;
    if (r < count) {
      const int64_t position = tile + r;
      const int32_t page = table[position / a.page_size];
      if (page >= 0 && page < a.num_pages) {
        src = a.pages +
              ((static_cast<int64_t>(page) * a.num_layers + a.layer) * a.page_size + position % a.page_size) *
                  a.row_stride +
              cv * 8;
        valid = true;
      }
    }
    detail::cp_async16_zfill(dst + r * ld + cv * 8, src, valid);
  }
}

__global__ void __launch_bounds__(kTcThreads, 1) mla_split_attention_tc_legacy_kernel(AttentionArgs a) {
  extern __shared__ __align__(128) unsigned char tc_smem[];
  const int width = a.kv_lora + a.rope;
  const TcLayout L = tc_layout(width);
  __nv_bfloat16* s_q = reinterpret_cast<__nv_bfloat16*>(tc_smem + L.q);          // [32][ld_rows]
  __nv_bfloat16* s_rows0 = reinterpret_cast<__nv_bfloat16*>(tc_smem + L.rows0);  // [64][ld_rows], even tiles
  __nv_bfloat16* s_rows1 = reinterpret_cast<__nv_bfloat16*>(tc_smem + L.rows1);  // odd tiles
  float* s_s = reinterpret_cast<float*>(tc_smem + L.scores);                     // [32][64]
  __nv_bfloat16* s_p = reinterpret_cast<__nv_bfloat16*>(tc_smem + L.p);          // [32][ld_p]
  float* s_scale = reinterpret_cast<float*>(tc_smem + L.stats);                  // [32]
  float* s_m = s_scale + kTcGroup;
  float* s_l = s_m + kTcGroup;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, tq = lane & 3;
  const int64_t t = blockIdx.x;
  const int split = blockIdx.y;
  const int h0 = blockIdx.z * kTcGroup;
  const int heads = min(kTcGroup, a.num_heads - h0);
  const int m_tiles = (heads + 15) / 16;

  const ReferenceSlice slice = reference_slice(a, t, split);
  const int n = slice.n;
  const int64_t row_begin = slice.row_begin, row_end = slice.row_end;
  const int32_t* table = a.block_tables + static_cast<int64_t>(n) * a.max_pages_per_seq;
  const int vecs_per_row = width / 8;
  const int num_tiles = static_cast<int>((row_end - row_begin + kTcRows - 1) / kTcRows);

  if (num_tiles > 0) {
    const int count = static_cast<int>(i64_min(kTcRows, row_end - row_begin));
    tc_load_rows(a, table, row_begin, count, s_rows0, L.ld_rows, vecs_per_row);
  }
  detail::cp_async_commit();

  // q̃ (bf16, zero for padding heads and columns), zero column padding of both row buffers, zero P, stats.
  const float* q_src = a.q_tilde + (t * a.num_heads + h0) * width;
  for (int i = tid; i < kTcGroup * L.width16; i += kTcThreads) {
    const int h = i / L.width16, c = i - h * L.width16;
    const float x = (h < heads && c < width) ? q_src[h * width + c] : 0.0f;
    s_q[h * L.ld_rows + c] = __float2bfloat16(x);
  }
  const int pad_cols = L.width16 - width;
  for (int i = tid; i < 2 * kTcRows * pad_cols; i += kTcThreads) {
    const int b = i / (kTcRows * pad_cols), rem = i - b * kTcRows * pad_cols;
    const int r = rem / pad_cols, c = width + rem % pad_cols;
    (b == 0 ? s_rows0 : s_rows1)[r * L.ld_rows + c] = __float2bfloat16(0.0f);
  }
  for (int i = tid; i < kTcGroup * L.ld_p; i += kTcThreads) s_p[i] = __float2bfloat16(0.0f);
  if (tid < kTcGroup) {
    s_m[tid] = -INFINITY;
    s_l[tid] = 0.0f;
    s_scale[tid] = 1.0f;
  }

  const int pairs = (a.kv_lora + 15) / 16;  // 16-column pairs of the latent
  float acc[kTcMaxPairs][2][2][4];          // [pair slot][m tile][n tile of the pair][fragment]
#pragma unroll
  for (int j = 0; j < kTcMaxPairs; ++j)
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][mt][nt][e] = 0.0f;

  for (int it = 0; it < num_tiles; ++it) {
    const int64_t tile = row_begin + static_cast<int64_t>(it) * kTcRows;
    const int rows = static_cast<int>(i64_min(kTcRows, row_end - tile));
    if (it + 1 < num_tiles) {
      const int64_t next = tile + kTcRows;
      const int count = static_cast<int>(i64_min(kTcRows, row_end - next));
      __nv_bfloat16* dst = (it & 1) ? s_rows0 : s_rows1;
      tc_load_rows(a, table, next, count, dst, L.ld_rows, vecs_per_row);

      detail::cp_async_commit();
      detail::cp_async_wait<1>();
    } else {
      detail::cp_async_wait<0>();
    }
    __syncthreads();
    const __nv_bfloat16* rows_buf = (it & 1) ? s_rows1 : s_rows0;

    // Scores: warp -> (m tile warp / 4, rows 16 * (warp % 4) .. + 16).
    if (warp < 4 * m_tiles) {
      const int mt = warp >> 2, n0 = (warp & 3) * 16;
      float c0[4] = {0.f, 0.f, 0.f, 0.f}, c1[4] = {0.f, 0.f, 0.f, 0.f};
      for (int k0 = 0; k0 < L.width16; k0 += 16) {
        uint32_t af[4], bf[4];
        detail::load_a(af, s_q, L.ld_rows, mt * 16, k0);
        detail::load_b_nk(bf, rows_buf, L.ld_rows, n0, k0);
        detail::mma_bf16_16816(c0, af, bf[0], bf[1]);
        detail::mma_bf16_16816(c1, af, bf[2], bf[3]);
      }

      const int m = mt * 16 + g;
      s_s[m * kTcRows + n0 + 2 * tq] = c0[0];
      s_s[m * kTcRows + n0 + 2 * tq + 1] = c0[1];
      s_s[(m + 8) * kTcRows + n0 + 2 * tq] = c0[2];
      s_s[(m + 8) * kTcRows + n0 + 2 * tq + 1] = c0[3];
      s_s[m * kTcRows + n0 + 8 + 2 * tq] = c1[0];
      s_s[m * kTcRows + n0 + 8 + 2 * tq + 1] = c1[1];
      s_s[(m + 8) * kTcRows + n0 + 8 + 2 * tq] = c1[2];
      s_s[(m + 8) * kTcRows + n0 + 8 + 2 * tq + 1] = c1[3];
    }
    __syncthreads();
    // Online softmax: warp per head, lane -> rows lane and lane + 32.
    for (int h = warp; h < heads; h += kTcWarps) {
      const float s0 = lane < rows ? s_s[h * kTcRows + lane] : -INFINITY;
      const float s1 = lane + 32 < rows ? s_s[h * kTcRows + lane + 32] : -INFINITY;
      const float m_old = s_m[h];
      const float m_new = fmaxf(m_old, warp_max(fmaxf(s0, s1)));  // finite: rows >= 1
      const float p0 = lane < rows ? exp2f(s0 - m_new) : 0.0f;
      const float p1 = lane + 32 < rows ? exp2f(s1 - m_new) : 0.0f;
      const __nv_bfloat16 b0 = __float2bfloat16(p0), b1 = __float2bfloat16(p1);
      // The denominator sums the bf16 values the P·V product uses, so the weights stay normalised.
      const float sum = warp_sum(__bfloat162float(b0) + __bfloat162float(b1));
      s_p[h * L.ld_p + lane] = b0;
      s_p[h * L.ld_p + lane + 32] = b1;
      if (lane == 0) {
        const float rescale = exp2f(m_old - m_new);
        s_scale[h] = rescale;
        s_m[h] = m_new;
        s_l[h] = s_l[h] * rescale + sum;
      }
    }

    __syncthreads();
    // O = O * rescale + P · rows.
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      if (mt < m_tiles) {
        const float r_lo = s_scale[mt * 16 + g], r_hi = s_scale[mt * 16 + g + 8];
#pragma unroll
        for (int j = 0; j < kTcMaxPairs; ++j) {
#pragma unroll
          for (int nt = 0; nt < 2; ++nt) {
            acc[j][mt][nt][0] *= r_lo;
            acc[j][mt][nt][1] *= r_lo;
            acc[j][mt][nt][2] *= r_hi;
            acc[j][mt][nt][3] *= r_hi;
          }
        }
      }
    }
    for (int k0 = 0; k0 < kTcRows; k0 += 16) {
      uint32_t af[2][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        if (mt < m_tiles) detail::load_a(af[mt], s_p, L.ld_p, mt * 16, k0);
      }
#pragma unroll
      for (int j = 0; j < kTcMaxPairs; ++j) {
        const int pair = warp + j * kTcWarps;
        if (pair < pairs) {
          uint32_t bf[4];
          detail::load_b_kn(bf, rows_buf, L.ld_rows, pair * 16, k0);
#pragma unroll
          for (int mt = 0; mt < 2; ++mt) {
            if (mt < m_tiles) {
              detail::mma_bf16_16816(acc[j][mt][0], af[mt], bf[0], bf[1]);
              detail::mma_bf16_16816(acc[j][mt][1], af[mt], bf[2], bf[3]);
            }
          }
        }
      }
    }
    __syncthreads();  // rows_buf, s_s and s_p are free for the next tile
  }
  __syncthreads();
  const int64_t part = (t * a.splits + split) * a.num_heads + h0;
  float* out_o = a.partial_o + part * a.kv_lora;
#pragma unroll
  for (int j = 0; j < kTcMaxPairs; ++j) {
    const int pair = warp + j * kTcWarps;
    if (pair >= pairs) continue;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const int col = pair * 16 + nt * 8 + 2 * tq;
        const int h_lo = mt * 16 + g, h_hi = h_lo + 8;
        if (col < a.kv_lora) {  // kv_lora is a multiple of 8, so col + 1 < kv_lora too
          if (h_lo < heads) {
            out_o[h_lo * a.kv_lora + col] = acc[j][mt][nt][0];
            out_o[h_lo * a.kv_lora + col + 1] = acc[j][mt][nt][1];
          }
          if (h_hi < heads) {
            out_o[h_hi * a.kv_lora + col] = acc[j][mt][nt][2];
            out_o[h_hi * a.kv_lora + col + 1] = acc[j][mt][nt][3];
          }
        }
      }
    }
  }
  if (tid < heads) a.partial_ml[part + tid] = make_float2(s_m[tid], s_l[tid]);
}

// ---- legacy combine + W_UV ------------------------------------------------------------------------------------
// grid (T, H), block kCombineThreads.
__global__ void __launch_bounds__(kCombineThreads)
    mla_combine_legacy_kernel(const float* __restrict__ partial_o, const float2* __restrict__ partial_ml,
                              const __nv_bfloat16* __restrict__ kv_b, int num_heads, int kv_lora, int nope, int v_head,
                              int splits, float* __restrict__ out, __nv_bfloat16* __restrict__ out_bf16) {
  __shared__ float s_latent[kMlaMaxKvLora];
  __shared__ float s_weight[kMlaMaxSplits];
  const int64_t t = blockIdx.x;
  const int h = blockIdx.y;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (warp == 0) detail::mla_split_weights(partial_ml, t, h, num_heads, splits, lane, s_weight);
  __syncthreads();
  for (int c = tid; c < kv_lora; c += kCombineThreads) {
    float acc = 0.0f;
    for (int s = 0; s < splits; ++s) {
      const float weight = s_weight[s];
      if (weight != 0.0f) acc = fmaf(weight, partial_o[((t * splits + s) * num_heads + h) * kv_lora + c], acc);
    }
    s_latent[c] = acc;
  }
  __syncthreads();
  const __nv_bfloat16* w_uv = kv_b + (static_cast<int64_t>(h) * (nope + v_head) + nope) * kv_lora;  // [v, kv_lora]
  for (int v = warp; v < v_head; v += kCombineThreads / 32) {
    const __nv_bfloat16* w_row = w_uv + static_cast<int64_t>(v) * kv_lora;
    float acc = 0.0f;
#pragma unroll 4
    for (int c = lane; c < kv_lora; c += 32) acc = fmaf(__bfloat162float(w_row[c]), s_latent[c], acc);
    acc = warp_sum(acc);
    if (lane == 0) {
      const int64_t at = (t * num_heads + h) * v_head + v;
      if (out_bf16 != nullptr) {
        out_bf16[at] = __float2bfloat16(acc);
      } else {
        out[at] = acc;
      }
    }
  }
}

}  // namespace

namespace detail {

int mla_fp32_head_group(int num_heads, int kv_lora) {
  return std::min({num_heads, kMaxHeadGroup, kAttnThreads * kAccPerThread / kv_lora});
}

Status launch_mla_fp32_attention(const MlaAttentionArgs& args, int64_t num_tokens, cudaStream_t stream,
                                 const char* who) {
  const size_t smem = attention_smem_bytes(args.head_group, args.kv_lora + args.rope);
  if (cudaError_t e = cudaFuncSetAttribute(mla_split_attention_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(smem));
      e != cudaSuccess) {
    return Status(StatusCode::kInternal, std::string(who) + ": cudaFuncSetAttribute: " + cudaGetErrorString(e));
  }
  const dim3 grid(static_cast<unsigned>(num_tokens), static_cast<unsigned>(args.splits),
                  static_cast<unsigned>((args.num_heads + args.head_group - 1) / args.head_group));
  mla_split_attention_kernel<<<grid, kAttnThreads, smem, stream>>>(args);
  return launch_status(who);
}

Status launch_mla_legacy(const MlaAttentionParams& p, MlaAttentionArgs args, float* q_tilde, float scale,
                         cudaStream_t stream, const char* who) {
  const dim3 absorb_grid(static_cast<unsigned>((p.num_tokens + kAbsorbTokens - 1) / kAbsorbTokens),
                         static_cast<unsigned>(p.num_heads));
  mla_absorb_legacy_kernel<<<absorb_grid, kAbsorbThreads, 0, stream>>>(p.q, p.q_stride, p.kv_b, p.num_tokens,
                                                                       p.num_heads, p.kv_lora_rank, p.qk_nope,
                                                                       p.qk_rope, p.v_head, scale, q_tilde);
  if (Status s = launch_status(who); !s.is_ok()) return s;

  const size_t smem = tc_layout(p.kv_lora_rank + p.qk_rope).total;
  if (cudaError_t e = cudaFuncSetAttribute(mla_split_attention_tc_legacy_kernel,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
      e != cudaSuccess) {
    return Status(StatusCode::kInternal, std::string(who) + ": cudaFuncSetAttribute: " + cudaGetErrorString(e));
  }
  args.q_tilde = q_tilde;
  args.head_group = std::min(p.num_heads, kTcGroup);
  const dim3 attention_grid(static_cast<unsigned>(p.num_tokens), static_cast<unsigned>(args.splits),
                            static_cast<unsigned>((p.num_heads + kTcGroup - 1) / kTcGroup));
  mla_split_attention_tc_legacy_kernel<<<attention_grid, kTcThreads, smem, stream>>>(args);
  if (Status s = launch_status(who); !s.is_ok()) return s;

  const dim3 combine_grid(static_cast<unsigned>(p.num_tokens), static_cast<unsigned>(p.num_heads));
  mla_combine_legacy_kernel<<<combine_grid, kCombineThreads, 0, stream>>>(args.partial_o, args.partial_ml, p.kv_b,
                                                                          p.num_heads, p.kv_lora_rank, p.qk_nope,
                                                                          p.v_head, args.splits, p.out, p.out_bf16);
  return launch_status(who);
}

}  // namespace detail
}  // namespace deltaserve::kernels::cuda
