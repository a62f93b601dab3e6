// The chunked prefill's prep (contract in kda.hpp; layout of what it writes in detail/chunk_prefill.cuh): one CTA
// per (chunk of 64 tokens, head), fully parallel. It computes the chunk's cumulative log-decay, the intra-chunk
// matrices Akk (strictly lower, beta-weighted) and Aqk (lower incl. diagonal) on tensor cores, the inverses of the
// 16x16 diagonal blocks of I + Akk, then w = (I + Akk)^-1 diag(beta) (K ⊙ e^gc) and u = (I + Akk)^-1 diag(beta) V by
// blocked forward substitution on tensor cores (the UT transform); it writes w, u, q ⊙ e^gc, k ⊙ e^(gc_last - gc),
// Aqk (bf16) and e^gc_last (fp32) to the workspace, in the state pass's shared-memory layout (wgmma operands in
// 128-byte-swizzled blocks, u split by value slice), so that the state pass loads a chunk with bulk copies.
// Sub-tiles of 16 tokens: pair decays are split at the row tile's start r, k_i e^(r - gc_i) and x_t e^(gc_t - r).
// Across tiles both factors are <= 1; inside the diagonal tile the first is <= e^(16 * 5) = e^80 when the
// per-step log-decay is >= -5, so the diagonal tiles are plain matmuls too (dense path). A chunk whose tiles
// span more than 85 in log-decay takes an exact pairwise path for its diagonal tiles instead.
#include <cstddef>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kernels/cuda/common/detail/bf16_stream.cuh"
#include "kernels/cuda/common/detail/mma_sm80.cuh"
#include "kernels/cuda/kda/detail/chunk_prefill.cuh"

namespace deltaserve::kernels::cuda::kda_prefill {
namespace {

using namespace detail;  // NOLINT(google-build-using-namespace)

constexpr int kLdD = kD + 8;    // bf16 row stride of [*, 128] smem tiles (conflict-free ldmatrix)
constexpr int kLdC = kC + 8;    // bf16 row stride of [*, 64] smem tiles
constexpr int kLdF = 17;        // fp32 row stride of the [16, 16] diagonal blocks of Akk
constexpr int kLdR = 32 + 8;    // bf16 row stride of a warp's [16, 32] residual tile
constexpr int kKinvRows = 160;  // 16 + 32 + 48 + 64: the B operands of the four row tiles
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kDenseSpan = 85.0f * kLog2e;  // in log2 units (the prep keeps log-decays as log2): e^85 < fp32 max

constexpr int kPrepThreads = 256;  // thread (pair, tile): key channels 2 pair, 2 pair + 1, tokens of one 16-tile
constexpr size_t kPrepSmem = size_t{kC} * kLdD * 2 * 2 + size_t{kKinvRows} * kLdD * 2 + size_t{kC} * kLdC * 2 +
                             4 * 16 * kLdF * 4 + kC * 4 + 4 * kD * 4 + size_t{kC} * kLdD * 2;
static_assert(2 * (kPrepSmem + 1024) <= 228 * 1024, "two prep CTAs share an SM");
// Akk's diagonal block entry (t, i), both in t's 16-token tile, in the compact fp32 array.
__host__ __device__ constexpr int diag_index(int t, int i) {
  return (t >> 4) * 16 * kLdF + (t & 15) * kLdF + (i & 15);
}

// Four bf16 of a row (8-byte aligned) as floats (exact conversions).
__device__ __forceinline__ float4 load_bf16x4(const bf16* src) {
  const uint2 raw = *reinterpret_cast<const uint2*>(src);
  return make_float4(bf16_low(raw.x), bf16_high(raw.x), bf16_low(raw.y), bf16_high(raw.y));
}

// Sums v[j] over the warp's 32 lanes for all eight j at once (a transposed butterfly: 9 shuffles instead of 40).
// Returns the sum of v[j] for j = 4 bit4(lane) + 2 bit3(lane) + bit2(lane).
__device__ __forceinline__ float warp_sum8(const float (&v)[8], int lane) {
  const bool b4 = (lane & 16) != 0, b3 = (lane & 8) != 0, b2 = (lane & 4) != 0;
  float a[4], c[2];
#pragma unroll
  for (int j = 0; j < 4; ++j) a[j] = (b4 ? v[j + 4] : v[j]) + __shfl_xor_sync(0xffffffffu, b4 ? v[j] : v[j + 4], 16);
#pragma unroll
  for (int j = 0; j < 2; ++j) c[j] = (b3 ? a[j + 2] : a[j]) + __shfl_xor_sync(0xffffffffu, b3 ? a[j] : a[j + 2], 8);
  float x = (b2 ? c[1] : c[0]) + __shfl_xor_sync(0xffffffffu, b2 ? c[0] : c[1], 4);
  x += __shfl_xor_sync(0xffffffffu, x, 2);
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x;
}

// 2^x with denormal results flushed to zero: one MUFU.EX2 (the non-ftz form adds a range fix-up around it). The
// prep kernel keeps its cumulative log-decays in log2 units, so every decay factor is one subtraction and this.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float gate_value(float raw, int mode, float a, float bias, float lower_bound) {
  if (mode == kGatePrecomputed) return raw;
  const float x = raw + bias;
  if (mode == kGateBounded) return lower_bound / (1.0f + __expf(-a * x));
  const float softplus = x > 20.0f ? x : log1pf(__expf(x));
  return -a * softplus;
}

__global__ void __launch_bounds__(kPrepThreads, 2) kda_chunk_prep_kernel(PrepArgs p) {
  extern __shared__ __align__(16) uint8_t smem[];
  bf16* qd = reinterpret_cast<bf16*>(smem);  // [64][kLdD] q e^(gc - r) (scaled)
  bf16* kd = qd + kC * kLdD;                 // [64][kLdD] k e^(gc - r)
  bf16* kinv = kd + kC * kLdD;               // [160][kLdD] per row tile a: k_i e^(r_a - gc_i)
  // [64][kLdC] bf16: T_aa on the diagonal blocks, Akk below them (the Akk products write it directly)
  bf16* m_b = kinv + kKinvRows * kLdD;
  float* akd = reinterpret_cast<float*>(m_b + kC * kLdC);    // [4][16][kLdF]: Akk's diagonal blocks in fp32
  float* beta_s = akd + 4 * 16 * kLdF;                       // [64]
  float* tile_totals = beta_s + kC;                          // [4][128] each 16-token tile's total log-decay
  bf16* bv = reinterpret_cast<bf16*>(tile_totals + 4 * kD);  // [64][kLdD] v, then beta v in place
  // Aliases once their owners are dead: substitution residuals over qd, beta K e^gc over kinv, the exact path's gc
  // over kinv.
  bf16* r_b = qd;  // [8 warps][16][kLdR] residuals of the substitution
  bf16* bk = kinv;

  const int H = p.num_heads;
  const unsigned int item = p.flags != nullptr ? blockIdx.x : blockIdx.x * H + blockIdx.y;  // chunk index * H + h
  const int h = static_cast<int>(item % H), chunk_index = static_cast<int>(item / H);
  const ChunkEntry chunk = p.chunks[chunk_index];
  const int n = chunk.tokens;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int group = lane >> 2, quad = lane & 3;
  uint8_t* out = p.data + static_cast<size_t>(item) * kChunkBytes;
  bf16* w_out = reinterpret_cast<bf16*>(out + kOffW);
  bf16* u_out = reinterpret_cast<bf16*>(out + kOffU);
  bf16* qg_out = reinterpret_cast<bf16*>(out + kOffQg);
  bf16* kg_out = reinterpret_cast<bf16*>(out + kOffKg);
  bf16* aqk_out = reinterpret_cast<bf16*>(out + kOffAqk);
  float* decay_out = reinterpret_cast<float*>(out + kOffDecay);

  // Stage the chunk's g (fp32, over kinv), q (over qd) and k (over kd) with every load in flight at once; rows past
  // the sequence are zero-filled without being read. Thread (c, half) later rewrites its elements of qd/kd in place.
  const size_t row_stride = static_cast<size_t>(H) * kD;
  const size_t chunk_offset = static_cast<size_t>(chunk.token_begin) * row_stride + static_cast<size_t>(h) * kD;
  float* g_tile = reinterpret_cast<float*>(kinv);
  {
    // g: 32 threads a row (16 bytes each), rows tid / 32 + 8 i; q, k, v: 16 threads a row, rows tid / 16 + 16 i.
    // Rows past the sequence are zero-filled from the chunk's first row (never read). Source offsets advance by a
    // precomputed row step.
    const int gr = tid >> 5, gs = (tid & 31) * 4;
    const size_t g_first = chunk_offset + gs, g_step = 8 * row_stride;
    size_t g_offset = g_first + gr * row_stride;
#pragma unroll
    for (int i = 0; i < 8; ++i, g_offset += g_step) {
      const int r = gr + 8 * i;
      cp_async16_zfill(g_tile + r * kD + gs, p.g + (r < n ? g_offset : g_first), r < n);
    }
    const int xr = tid >> 4, xs = (tid & 15) * 8;
    const size_t x_first = chunk_offset + xs, x_step = 16 * row_stride;
    size_t x_offset = x_first + xr * row_stride;
#pragma unroll
    for (int i = 0; i < 4; ++i, x_offset += x_step) {
      const int r = xr + 16 * i;
      const size_t offset = r < n ? x_offset : x_first;
      cp_async16_zfill(qd + r * kLdD + xs, p.q + offset, r < n);
      cp_async16_zfill(kd + r * kLdD + xs, p.k + offset, r < n);
      cp_async16_zfill(bv + r * kLdD + xs, p.v + offset, r < n);
    }
  }
  cp_async_commit();
  if (tid < kC) beta_s[tid] = tid < n ? p.beta[static_cast<size_t>(chunk.token_begin + tid) * H + h] : 0.0f;

  // Thread (pair, tile): key channels c0 = 2 pair and c0 + 1, tokens [16 tile, 16 tile + 16). A warp covers 64
  // channels of one tile's rows, so every element-wise store below moves two channels at once (one bf16x2).
  const int pair = tid & 63, tile = tid >> 6, c0 = 2 * pair, t0 = 16 * tile;
  float a = 1.0f;
  float2 bias = make_float2(0.0f, 0.0f);
  if (p.gate_mode != kGatePrecomputed) {
    a = __expf(p.a_log[h]);
    bias = make_float2(p.dt_bias[h * kD + c0], p.dt_bias[h * kD + c0 + 1]);
  }
  cp_async_wait<0>();
  __syncthreads();
  // Log-decay (log2 units) cumulated inside this thread's tile, and k, in registers; the tile totals go to
  // `tile_totals`.
  float2 gc[16], kr[16];
  float2 running = make_float2(0.0f, 0.0f);
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const int t = t0 + j;
    const float2 raw = *reinterpret_cast<const float2*>(g_tile + t * kD + c0);
    running.x += t < n ? gate_value(raw.x, p.gate_mode, a, bias.x, p.lower_bound) * kLog2e : 0.0f;
    running.y += t < n ? gate_value(raw.y, p.gate_mode, a, bias.y, p.lower_bound) * kLog2e : 0.0f;
    gc[j] = running;
    kr[j] = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(kd + t * kLdD + c0));
  }
  *reinterpret_cast<float2*>(tile_totals + tile * kD + c0) = running;
  __syncthreads();
  // ref[b]: cumulative log-decay at the start of tile b (the sum of the earlier tiles' totals, added in the same
  // order by every thread, so the two sides of a split pair decay use the same float); gc_last: the chunk's total.
  float2 ref[4];
  ref[0] = make_float2(0.0f, 0.0f);
#pragma unroll
  for (int b = 1; b < 4; ++b) {
    const float2 total = *reinterpret_cast<const float2*>(tile_totals + (b - 1) * kD + c0);
    ref[b] = make_float2(ref[b - 1].x + total.x, ref[b - 1].y + total.y);
  }
  float2 gc_last;
  {
    const float2 total = *reinterpret_cast<const float2*>(tile_totals + 3 * kD + c0);
    gc_last = make_float2(ref[3].x + total.x, ref[3].y + total.y);
  }
  float2 r_own = ref[0];  // this tile's reference (static register indexing)
#pragma unroll
  for (int b = 1; b < 4; ++b) r_own = tile == b ? ref[b] : r_own;
  // Dense diagonal tiles when every 16-token tile (with its reference) spans at most kDenseSpan.
  float2 lo = r_own, hi = r_own;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    gc[j] = make_float2(gc[j].x + r_own.x, gc[j].y + r_own.y);
    lo = make_float2(fminf(lo.x, gc[j].x), fminf(lo.y, gc[j].y));
    hi = make_float2(fmaxf(hi.x, gc[j].x), fmaxf(hi.y, gc[j].y));
  }
  const bool ok = hi.x - lo.x <= kDenseSpan && hi.y - lo.y <= kDenseSpan;
  const bool dense = __syncthreads_and(ok) != 0;

#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const int t = t0 + j;
    const float2 q2 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(qd + t * kLdD + c0));
    const float2 qv = make_float2(q2.x * p.q_scale, q2.y * p.q_scale);
    const float2 e = make_float2(exp2_ftz(gc[j].x - r_own.x), exp2_ftz(gc[j].y - r_own.y));
    *reinterpret_cast<uint32_t*>(qd + t * kLdD + c0) = pack_bf16(qv.x * e.x, qv.y * e.y);
    *reinterpret_cast<uint32_t*>(kd + t * kLdD + c0) = pack_bf16(kr[j].x * e.x, kr[j].y * e.y);
    *reinterpret_cast<uint32_t*>(qg_out + sw128_wide(t, c0)) =
        pack_bf16(qv.x * exp2_ftz(gc[j].x), qv.y * exp2_ftz(gc[j].y));
    *reinterpret_cast<uint32_t*>(kg_out + sw128_wide(t, c0)) =
        pack_bf16(kr[j].x * exp2_ftz(gc_last.x - gc[j].x), kr[j].y * exp2_ftz(gc_last.y - gc[j].y));
  }
  if (tile == 0) {
    *reinterpret_cast<float2*>(decay_out + c0) = make_float2(exp2_ftz(gc_last.x), exp2_ftz(gc_last.y));
  }

  if (!dense) {
    // Exact pairwise decays inside the diagonal tiles, E(t, i) = e^(gc_t - gc_i) <= 1 for i <= t, in fp32, built
    // row by row as E(t, i) = E(t - 1, i) e^(gc_t - gc_(t-1)): one exponential per channel and row instead of one per
    // pair. gc goes over kinv (g_tile is dead); q and k are reread unscaled from global memory (L1/L2: the chunk was
    // just staged). Warp w takes tile w / 2 and its eight keys of parity w % 2, i_j = tile0 + 2 j + w % 2, through
    // all 16 rows; lane l holds channels 4 l .. 4 l + 3, so every load is a contiguous row segment. A row's eight
    // sums go through one transposed warp reduction.
    float* gcs = reinterpret_cast<float*>(kinv);
#pragma unroll
    for (int j = 0; j < 16; ++j) *reinterpret_cast<float2*>(gcs + (t0 + j) * kD + c0) = gc[j];
    __syncthreads();
    const int tile0 = (warp >> 1) * 16, parity = warp & 1;
    const bf16* k_rows = p.k + chunk_offset + 4 * lane;
    const bf16* q_rows = p.q + chunk_offset + 4 * lane;
    const int lane_key = 4 * ((lane >> 4) & 1) + 2 * ((lane >> 3) & 1) + ((lane >> 2) & 1);  // warp_sum8's j
    float4 decay[8];  // E(t, i_j) for this lane's channels; zero until row i_j
#pragma unroll
    for (int j = 0; j < 8; ++j) decay[j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    float4 g_prev = *reinterpret_cast<const float4*>(gcs + tile0 * kD + 4 * lane);
    for (int t = tile0; t < tile0 + 16; ++t) {
      const bool live = t < n;  // rows past the sequence are zero and never read
      const float4 gt = *reinterpret_cast<const float4*>(gcs + t * kD + 4 * lane);
      const float4 step = make_float4(exp2_ftz(gt.x - g_prev.x), exp2_ftz(gt.y - g_prev.y), exp2_ftz(gt.z - g_prev.z),
                                      exp2_ftz(gt.w - g_prev.w));
      g_prev = gt;
      float4 kt = make_float4(0.0f, 0.0f, 0.0f, 0.0f), qt = kt;
      if (live) {
        kt = load_bf16x4(k_rows + t * row_stride);
        qt = load_bf16x4(q_rows + t * row_stride);
      }
      float sk[8], sq[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int i = tile0 + 2 * j + parity;  // uniform over the warp
        sk[j] = 0.0f;
        sq[j] = 0.0f;
        if (i < t) {
          decay[j] = make_float4(decay[j].x * step.x, decay[j].y * step.y, decay[j].z * step.z, decay[j].w * step.w);
        } else if (i == t) {
          decay[j] = make_float4(1.0f, 1.0f, 1.0f, 1.0f);
        }
        if (live && i <= t) {
          const float4 ki = load_bf16x4(k_rows + i * row_stride);
          const float e0 = ki.x * decay[j].x, e1 = ki.y * decay[j].y, e2 = ki.z * decay[j].z, e3 = ki.w * decay[j].w;
          sk[j] = kt.x * e0 + kt.y * e1 + kt.z * e2 + kt.w * e3;
          sq[j] = qt.x * e0 + qt.y * e1 + qt.z * e2 + qt.w * e3;
        }
      }
      const float key_sum = warp_sum8(sk, lane), query_sum = warp_sum8(sq, lane);
      if ((lane & 3) == 0) {
        // Every entry of the tile once: right of the diagonal (and rows past the sequence) zero.
        const int i = tile0 + 2 * lane_key + parity;
        akd[diag_index(t, i)] = live && i < t ? beta_s[t] * key_sum : 0.0f;
        aqk_out[sw128(t, i)] = __float2bfloat16(live && i <= t ? query_sum * p.q_scale : 0.0f);
      }
    }
    // This thread's gc and k again (from gcs and from global memory): not holding them through the loop above
    // leaves it the registers for the eight running decays.
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const int t = t0 + j;
      gc[j] = *reinterpret_cast<const float2*>(gcs + t * kD + c0);
      kr[j] =
          t < n ? __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p.k + chunk_offset + t * row_stride + c0))
                : make_float2(0.0f, 0.0f);
    }
    __syncthreads();  // gcs is read; the B operands below overwrite it
  }

  // B operands of each row tile b: k_i e^(ref_b - gc_i) for i before the tile (and inside it when dense). This
  // thread's tile contributes its 16 rows to every row tile from its own (dense) or the next one on.
#pragma unroll
  for (int b = 0; b < 4; ++b) {
    if (b > tile || (dense && b == tile)) {
      bf16* rows = kinv + (8 * b * (b + 1) + t0) * kLdD + c0;
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        *reinterpret_cast<uint32_t*>(rows + j * kLdD) =
            pack_bf16(kr[j].x * exp2_ftz(ref[b].x - gc[j].x), kr[j].y * exp2_ftz(ref[b].y - gc[j].y));
      }
    }
  }
  __syncthreads();

  // Akk and Aqk rows of tile warp % 4; the two warps of a tile take alternate column pairs.
  {
    const int row_tile = warp & 3, m0 = row_tile * 16;
    const int columns = dense ? 16 * (row_tile + 1) : 16 * row_tile;
    const bf16* b_rows = kinv + (8 * row_tile * (row_tile + 1)) * kLdD;
    for (int n0 = (warp >> 2) * 16; n0 < columns; n0 += 32) {
      float ck[2][4] = {}, cq[2][4] = {};
#pragma unroll
      for (int k0 = 0; k0 < kD; k0 += 16) {
        uint32_t ak[4], aq[4], b[4];
        load_a(ak, kd, kLdD, m0, k0);
        load_a(aq, qd, kLdD, m0, k0);
        load_b_nk(b, b_rows, kLdD, n0, k0);
        mma_bf16_16816(ck[0], ak, b[0], b[1]);
        mma_bf16_16816(ck[1], ak, b[2], b[3]);
        mma_bf16_16816(cq[0], aq, b[0], b[1]);
        mma_bf16_16816(cq[1], aq, b[2], b[3]);
      }
#pragma unroll
      for (int j = 0; j < 2; ++j) {
#pragma unroll
        for (int half_row = 0; half_row < 2; ++half_row) {
          const int row = m0 + group + half_row * 8, col = n0 + j * 8 + quad * 2;
          const float b = beta_s[row];
          if (n0 == m0) {
            akd[diag_index(row, col)] = col < row ? b * ck[j][2 * half_row] : 0.0f;
            akd[diag_index(row, col + 1)] = col + 1 < row ? b * ck[j][2 * half_row + 1] : 0.0f;
          } else {
            *reinterpret_cast<uint32_t*>(m_b + row * kLdC + col) =
                pack_bf16(b * ck[j][2 * half_row], b * ck[j][2 * half_row + 1]);
          }
          *reinterpret_cast<uint32_t*>(aqk_out + sw128(row, col)) =
              pack_bf16(col <= row ? cq[j][2 * half_row] : 0.0f, col + 1 <= row ? cq[j][2 * half_row + 1] : 0.0f);
        }
      }
    }
    // Aqk's columns after the tile: zero (m_b's are never read).
    if (warp < 4) {
      const int first_zero = 16 * (row_tile + 1), width = kC - first_zero;
      for (int index = lane; index < 16 * width; index += 32) {
        const int row = m0 + index / width, col = first_zero + index % width;
        aqk_out[sw128(row, col)] = __float2bfloat16(0.0f);
      }
    }
  }
  __syncthreads();

  // m_b's diagonal blocks: T_aa = (I + Akk_aa)^-1 by forward substitution in fp32 (warps 0..3, lane = column).
  if (warp < 4 && lane < 16) {
    const float* block = akd + warp * 16 * kLdF;
    float x[16];
#pragma unroll
    for (int t = 0; t < 16; ++t) {
      float s = t == lane ? 1.0f : 0.0f;
#pragma unroll
      for (int i = 0; i < t; ++i) s -= block[t * kLdF + i] * x[i];
      x[t] = s;
    }
#pragma unroll
    for (int t = 0; t < 16; ++t) m_b[(warp * 16 + t) * kLdC + warp * 16 + lane] = __float2bfloat16(x[t]);
  }
  // beta k e^gc over the dead B operands, beta v in place (v landed with q and k), beside the inversions.
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const int t = t0 + j;
    const float b = beta_s[t];
    const float2 vv = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(bv + t * kLdD + c0));
    *reinterpret_cast<uint32_t*>(bk + t * kLdD + c0) =
        pack_bf16(b * kr[j].x * exp2_ftz(gc[j].x), b * kr[j].y * exp2_ftz(gc[j].y));
    *reinterpret_cast<uint32_t*>(bv + t * kLdD + c0) = pack_bf16(b * vv.x, b * vv.y);
  }
  __syncthreads();

  // Blocked forward substitution of (I + Akk) [w | u] = [bk | bv], in place, each warp on its own 32 columns
  // (warps 0..3: w, 4..7: u), so only warp-level ordering is needed:
  //   W_a = T_aa (X_a - sum_{c < a} Akk_ac W_c).
  {
    bf16* x = warp < 4 ? bk : bv;
    const int col0 = (warp & 3) * 32;
    bf16* residual = r_b + warp * 16 * kLdR;  // [16][kLdR] X_a - sum, bf16
#pragma unroll
    for (int a0 = 0; a0 < kC; a0 += 16) {
      float acc[4][4] = {};
#pragma unroll
      for (int k0 = 0; k0 < a0; k0 += 16) {
        uint32_t am[4];
        load_a(am, m_b, kLdC, a0, k0);
#pragma unroll
        for (int np = 0; np < 2; ++np) {
          uint32_t b[4];
          load_b_kn(b, x, kLdD, col0 + np * 16, k0);
          mma_bf16_16816(acc[2 * np], am, b[0], b[1]);
          mma_bf16_16816(acc[2 * np + 1], am, b[2], b[3]);
        }
      }
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
        for (int half_row = 0; half_row < 2; ++half_row) {
          const int row = group + half_row * 8, col = nt * 8 + quad * 2;
          const float2 xv =
              __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(x + (a0 + row) * kLdD + col0 + col));
          *reinterpret_cast<uint32_t*>(residual + row * kLdR + col) =
              pack_bf16(xv.x - acc[nt][2 * half_row], xv.y - acc[nt][2 * half_row + 1]);
        }
      }
      __syncwarp();
      float wa[4][4] = {};
      uint32_t at[4];
      load_a(at, m_b, kLdC, a0, a0);
#pragma unroll
      for (int np = 0; np < 2; ++np) {
        uint32_t b[4];
        load_b_kn(b, residual, kLdR, np * 16, 0);
        mma_bf16_16816(wa[2 * np], at, b[0], b[1]);
        mma_bf16_16816(wa[2 * np + 1], at, b[2], b[3]);
      }
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
        for (int half_row = 0; half_row < 2; ++half_row) {
          const int row = a0 + group + half_row * 8, col = nt * 8 + quad * 2;
          *reinterpret_cast<uint32_t*>(x + row * kLdD + col0 + col) =
              pack_bf16(wa[nt][2 * half_row], wa[nt][2 * half_row + 1]);
        }
      }
      __syncwarp();
    }
  }
  __syncthreads();
  // w to its two swizzled blocks, u split by value slice: 16 bytes a thread and step, a warp's stores covering whole
  // rows.
  // Thread: rows r0 + 16 k, columns [c, c + 8); r % 8 is the same for all four rows, so are the swizzled offsets.
  {
    const int r0 = tid >> 4, c = (tid & 15) * 8;
    bf16* w_dst = w_out + sw128_wide(r0, c);
    bf16* u_dst = u_out + (c >> 6) * (kC * kLdU) + r0 * kLdU + (c & 63);
    const bf16* w_src = bk + r0 * kLdD + c;
    const bf16* u_src = bv + r0 * kLdD + c;
    uint4 w_rows[4], u_rows[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      w_rows[k] = *reinterpret_cast<const uint4*>(w_src + 16 * k * kLdD);
      u_rows[k] = *reinterpret_cast<const uint4*>(u_src + 16 * k * kLdD);
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      *reinterpret_cast<uint4*>(w_dst + 16 * k * 64) = w_rows[k];
      *reinterpret_cast<uint4*>(u_dst + 16 * k * kLdU) = u_rows[k];
    }
  }
  if (p.flags != nullptr) {
    __threadfence();  // every thread's stores of the block, before the flag
    __syncthreads();
    if (tid == 0) {
      asm volatile("st.release.gpu.global.u32 [%0], %1;\n" ::"l"(p.flags + item), "r"(1u) : "memory");
      if (atomicAdd(p.done, 1u) + 1 == p.total_items) {
        // The last item: the state pass needs nothing more, so this CTA can hold on until it completes (its grid is
        // this one's primary). The next kernel in the stream then sees both grids done.
        asm volatile("griddepcontrol.wait;\n" ::: "memory");
      }
    }
  }
}

}  // namespace

cudaError_t launch_chunk_prep(const PrepArgs& args, int64_t chunks, cudaStream_t stream) {
  static const cudaError_t attribute = cudaFuncSetAttribute(
      kda_chunk_prep_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kPrepSmem));
  if (attribute != cudaSuccess) return attribute;
  if (args.flags == nullptr) {
    kda_chunk_prep_kernel<<<dim3(static_cast<unsigned>(chunks), static_cast<unsigned>(args.num_heads)), kPrepThreads,
                            kPrepSmem, stream>>>(args);
    return cudaGetLastError();
  }
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(args.total_items);
  config.blockDim = dim3(kPrepThreads);
  config.dynamicSmemBytes = kPrepSmem;
  config.stream = stream;
  cudaLaunchAttribute attribute_pdl{};
  attribute_pdl.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute_pdl.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute_pdl;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kda_chunk_prep_kernel, args);
}

}  // namespace deltaserve::kernels::cuda::kda_prefill
