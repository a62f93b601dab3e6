// KDA chunked prefill for sm_90a in two launches (see kda.hpp for the contract):
//   1. prep, one CTA per (chunk of 64 tokens, head), fully parallel: the chunk's cumulative log-decay, the
//      intra-chunk matrices Akk (strictly lower, beta-weighted) and Aqk (lower incl. diagonal) on tensor cores, the
//      inverses of the 16x16 diagonal blocks of I + Akk, then w = (I + Akk)^-1 diag(beta) (K ⊙ e^gc) and u = (I +
//      Akk)^-1 diag(beta) V by blocked forward substitution on tensor cores (the UT transform); writes w, u, q ⊙ e^gc,
//      k ⊙ e^(gc_last - gc), Aqk (bf16) and e^gc_last (fp32) to the workspace, in the state pass's shared-memory
//      layout (padded rows, u split by value slice), so that the state pass loads a chunk with two bulk copies.
//   2. state pass, one CTA of 16 warps per (32 value columns, head, sequence), sequential over the sequence's
//      chunks with the state slice [128 x 32] fp32 in registers (a 16x16 tile a warp): v_new = u - w S (warps
//      0..7) while o = (q e^gc) S (warps 8..15); then o += Aqk v_new and S = e^gc_last ⊙ S + (k e^(gc_last - gc))^T
//      v_new. The next chunk's factors land by bulk copy (one thread, mbarrier, 2 stages) during the current one.
// Sub-tiles of 16 tokens: pair decays are split at the row tile's start r, k_i e^(r - gc_i) and x_t e^(gc_t - r).
// Across tiles both factors are <= 1; inside the diagonal tile the first is <= e^(16 * 5) = e^80 when the
// per-step log-decay is >= -5, so the diagonal tiles are plain matmuls too (dense path). A chunk whose tiles
// span more than 85 in log-decay takes an exact pairwise path for its diagonal tiles instead.
#include <algorithm>
#include <cmath>
#include <string>

#include <cuda_bf16.h>

#include "kernels/cuda/bf16_stream.cuh"
#include "kernels/cuda/kda.hpp"
#include "kernels/cuda/mma_sm80.cuh"
#include "kernels/cuda/sm90_ptx.cuh"

namespace deltaserve::kernels::cuda {
namespace {

using namespace detail;  // NOLINT(google-build-using-namespace)
using bf16 = __nv_bfloat16;

constexpr int kD = kKdaHeadDim;
constexpr int kC = kKdaChunk;
constexpr int kLdD = kD + 8;    // bf16 row stride of [*, 128] smem tiles (conflict-free ldmatrix)
constexpr int kLdC = kC + 8;    // bf16 row stride of [*, 64] smem tiles
constexpr int kLdF = kC + 1;    // fp32 row stride of [64, 64] smem matrices
constexpr int kLdR = 32 + 8;    // bf16 row stride of a warp's [16, 32] residual tile
constexpr int kKinvRows = 160;  // 16 + 32 + 48 + 64: the B operands of the four row tiles
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kDenseSpan = 85.0f * kLog2e;  // in log2 units (the prep keeps log-decays as log2): e^85 < fp32 max
constexpr int kStateBv = 32;                  // value columns per state-pass CTA
constexpr int kLdV = kStateBv + 8;            // bf16 row stride of [*, 32] tiles (a value slice)
constexpr int kSlices = kD / kStateBv;

// Per (chunk, head) block of the workspace, laid out as the state pass's shared-memory stage: w, q e^gc,
// k e^(gc_last - gc) as [64][kLdD], Aqk [64][kLdC], e^gc_last [128] fp32 (the part every value slice reads), then
// u as [4 slices][64][kLdV]. The padding columns are never read.
constexpr size_t kOffW = 0;
constexpr size_t kOffQg = kOffW + size_t{kC} * kLdD * 2;
constexpr size_t kOffKg = kOffQg + size_t{kC} * kLdD * 2;
constexpr size_t kOffAqk = kOffKg + size_t{kC} * kLdD * 2;
constexpr size_t kOffDecay = kOffAqk + size_t{kC} * kLdC * 2;
constexpr size_t kOffU = kOffDecay + size_t{kD} * 4;  // the shared part ends here
constexpr size_t kUSliceBytes = size_t{kC} * kLdV * 2;
constexpr size_t kChunkBytes = kOffU + kSlices * kUSliceBytes;
static_assert(kOffU % 16 == 0 && kUSliceBytes % 16 == 0 && kChunkBytes % 16 == 0, "bulk copies need 16-byte units");

struct ChunkEntry {
  int32_t token_begin;  // first token (global row) of the chunk
  int32_t tokens;       // 1..64
  int32_t sequence;
  int32_t unused;
};
struct SequenceEntry {
  int32_t first_chunk;
  int32_t num_chunks;
  int32_t token_begin;
  int32_t length;
  int32_t checkpoint_first;
  int32_t unused[3];
};

enum GateMode : int { kGatePrecomputed = 0, kGateSoftplus = 1, kGateBounded = 2 };

struct PrepArgs {
  const bf16* q;
  const bf16* k;
  const bf16* v;
  const float* g;
  const float* beta;
  float q_scale;
  int gate_mode;
  const float* a_log;
  const float* dt_bias;
  float lower_bound;
  int num_heads;
  const ChunkEntry* chunks;
  uint8_t* data;
};

struct StateArgs {
  int num_heads;
  const SequenceEntry* sequences;
  const uint8_t* data;
  const float* initial_state;
  float* final_state;
  int checkpoint_interval;
  float* checkpoint_states;
  bf16* o;
};

constexpr int kPrepThreads = 256;  // thread (c, half): key channel c, tokens [32 half, 32 half + 32)
constexpr size_t kPrepSmem =
    size_t{kC} * kLdD * 2 * 2 + size_t{kKinvRows} * kLdD * 2 + size_t{kC} * kLdF * 4 + kC * 4 + 4 * kD * 4;

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
  bf16* qd = reinterpret_cast<bf16*>(smem);                        // [64][kLdD] q e^(gc - r) (scaled)
  bf16* kd = qd + kC * kLdD;                                       // [64][kLdD] k e^(gc - r)
  bf16* kinv = kd + kC * kLdD;                                     // [160][kLdD] per row tile a: k_i e^(r_a - gc_i)
  float* akk = reinterpret_cast<float*>(kinv + kKinvRows * kLdD);  // [64][kLdF]
  float* beta_s = akk + kC * kLdF;                                 // [64]
  float* ends = beta_s + kC;  // [4][128] gc at the end of each 16-token tile (ends[a - 1] = r_a)
  // Aliases once their owners are dead: substitution residuals over qd, T_aa / Akk bf16 over kd,
  // beta K e^gc and beta V over kinv, the exact path's gc over kinv.
  bf16* m_b = kd;  // [64][kLdC]: T_aa on the diagonal blocks, Akk below
  bf16* r_b = qd;  // [8 warps][16][kLdR] residuals of the substitution
  bf16* bk = kinv;
  bf16* bv = kinv + kC * kLdD;

  const int H = p.num_heads;
  const int h = blockIdx.y;
  const ChunkEntry chunk = p.chunks[blockIdx.x];
  const int n = chunk.tokens;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int group = lane >> 2, quad = lane & 3;
  uint8_t* out = p.data + (static_cast<size_t>(blockIdx.x) * H + h) * kChunkBytes;
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
  for (int i = tid; i < kC * 32; i += kPrepThreads) {
    const int r = i >> 5, s = (i & 31) * 4;
    cp_async16_zfill(g_tile + r * kD + s, p.g + chunk_offset + (r < n ? r * row_stride + s : 0), r < n);
  }
  for (int i = tid; i < kC * 16; i += kPrepThreads) {
    const int r = i >> 4, s = (i & 15) * 8;
    const size_t offset = chunk_offset + (r < n ? r * row_stride + s : 0);
    cp_async16_zfill(qd + r * kLdD + s, p.q + offset, r < n);
    cp_async16_zfill(kd + r * kLdD + s, p.k + offset, r < n);
  }
  cp_async_commit();
  if (tid < kC) beta_s[tid] = tid < n ? p.beta[static_cast<size_t>(chunk.token_begin + tid) * H + h] : 0.0f;

  const int c = tid & (kD - 1), half = tid >> 7, t0 = half * 32;
  float a = 1.0f, bias = 0.0f;
  if (p.gate_mode != kGatePrecomputed) {
    a = __expf(p.a_log[h]);
    bias = p.dt_bias[h * kD + c];
  }
  cp_async_wait<0>();
  __syncthreads();
  // Cumulative log-decay (log2 units) and k of this thread's 32 tokens in registers; the second half adds the first's
  // total.
  float gc[32], kr[32];
  float running = 0.0f;
#pragma unroll
  for (int j = 0; j < 32; ++j) {
    const int t = t0 + j;
    const float g = t < n ? gate_value(g_tile[t * kD + c], p.gate_mode, a, bias, p.lower_bound) * kLog2e : 0.0f;
    running += g;
    gc[j] = running;
    kr[j] = __bfloat162float(kd[t * kLdD + c]);
  }
  if (half == 0) {
    ends[0 * kD + c] = gc[15];
    ends[1 * kD + c] = gc[31];
  }
  __syncthreads();
  const float r_first = half == 0 ? 0.0f : ends[1 * kD + c];  // reference of this thread's first tile
  if (half == 1) {
#pragma unroll
    for (int j = 0; j < 32; ++j) gc[j] += r_first;
    ends[2 * kD + c] = gc[15];
    ends[3 * kD + c] = gc[31];
  }
  // Dense diagonal tiles when every 16-token tile (with its reference) spans at most kDenseSpan.
  bool ok = true;
#pragma unroll
  for (int tile = 0; tile < 2; ++tile) {
    const float r = tile == 0 ? r_first : gc[15];
    float lo = r, hi = r;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      lo = fminf(lo, gc[tile * 16 + i]);
      hi = fmaxf(hi, gc[tile * 16 + i]);
    }
    ok = ok && (hi - lo) <= kDenseSpan;
  }
  const bool dense = __syncthreads_and(ok) != 0;

  const float gc_last = ends[3 * kD + c];
#pragma unroll
  for (int j = 0; j < 32; ++j) {
    const int t = t0 + j;
    const float r = j < 16 ? r_first : gc[15];
    const float qv = __bfloat162float(qd[t * kLdD + c]) * p.q_scale;
    const float e = exp2_ftz(gc[j] - r);
    qd[t * kLdD + c] = __float2bfloat16(qv * e);
    kd[t * kLdD + c] = __float2bfloat16(kr[j] * e);
    qg_out[t * kLdD + c] = __float2bfloat16(qv * exp2_ftz(gc[j]));
    kg_out[t * kLdD + c] = __float2bfloat16(kr[j] * exp2_ftz(gc_last - gc[j]));
  }
  if (half == 0) decay_out[c] = exp2_ftz(gc_last);

  if (!dense) {
    // Exact pairwise decays inside the diagonal tiles, e^(gc_t - gc_i) <= 1 for i <= t, in fp32. gc goes over kinv
    // (g_tile is dead); q and k are reread unscaled from global memory (L1/L2: the chunk was just staged). Warp w
    // takes tile w / 2 and its rows of parity w % 2; lane l holds channels 4 l .. 4 l + 3, so every load is a
    // contiguous row segment. A row's keys go eight at a time: eight independent loads and products, then one
    // transposed warp reduction for the eight sums.
    float* gcs = reinterpret_cast<float*>(kinv);
#pragma unroll
    for (int j = 0; j < 32; ++j) gcs[(t0 + j) * kD + c] = gc[j];
    __syncthreads();
    const int tile0 = (warp >> 1) * 16;
    const bf16* k_rows = p.k + chunk_offset + 4 * lane;
    const bf16* q_rows = p.q + chunk_offset + 4 * lane;
    const int lane_key = 4 * ((lane >> 4) & 1) + 2 * ((lane >> 3) & 1) + ((lane >> 2) & 1);  // warp_sum8's j
    for (int t = tile0 + (warp & 1); t < tile0 + 16; t += 2) {
      // Entries right of the diagonal (and every entry of a row past the sequence) are zero.
      if (lane < 16 && (tile0 + lane > t || t >= n)) {
        akk[t * kLdF + tile0 + lane] = 0.0f;
        aqk_out[t * kLdC + tile0 + lane] = __float2bfloat16(0.0f);
      }
      if (t >= n) continue;
      const float4 kt = load_bf16x4(k_rows + t * row_stride), qt = load_bf16x4(q_rows + t * row_stride);
      const float4 gt = *reinterpret_cast<const float4*>(gcs + t * kD + 4 * lane);
      for (int i0 = tile0; i0 <= t; i0 += 8) {
        float sk[8], sq[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          // Keys past t load row t (in the sequence; unconditional loads can all be issued up front) and count zero
          // without spending exponentials (the branch is uniform over the warp).
          const int i = min(i0 + j, t);
          const float4 ki = load_bf16x4(k_rows + i * row_stride);
          const float4 gi = *reinterpret_cast<const float4*>(gcs + i * kD + 4 * lane);
          sk[j] = 0.0f;
          sq[j] = 0.0f;
          if (i0 + j <= t) {
            const float e0 = ki.x * exp2_ftz(gt.x - gi.x), e1 = ki.y * exp2_ftz(gt.y - gi.y);
            const float e2 = ki.z * exp2_ftz(gt.z - gi.z), e3 = ki.w * exp2_ftz(gt.w - gi.w);
            sk[j] = kt.x * e0 + kt.y * e1 + kt.z * e2 + kt.w * e3;
            sq[j] = qt.x * e0 + qt.y * e1 + qt.z * e2 + qt.w * e3;
          }
        }
        const float key_sum = warp_sum8(sk, lane), query_sum = warp_sum8(sq, lane);
        const int i = i0 + lane_key;
        if ((lane & 3) == 0 && i <= t) {
          akk[t * kLdF + i] = i < t ? beta_s[t] * key_sum : 0.0f;
          aqk_out[t * kLdC + i] = __float2bfloat16(query_sum * p.q_scale);
        }
      }
    }
    __syncthreads();
  }

  // B operands of each row tile: k_i e^(r_a - gc_i) for i before the tile (and inside it when dense).
#pragma unroll
  for (int tile = 0; tile < 4; ++tile) {
    const float r = tile == 0 ? 0.0f : ends[(tile - 1) * kD + c];
    const int limit = 16 * tile + (dense ? 16 : 0);
    bf16* rows = kinv + (8 * tile * (tile + 1)) * kLdD;
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      if (t0 + j < limit) rows[(t0 + j) * kLdD + c] = __float2bfloat16(kr[j] * exp2_ftz(r - gc[j]));
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
        for (int e = 0; e < 4; ++e) {
          const int row = m0 + group + (e >> 1) * 8, col = n0 + j * 8 + quad * 2 + (e & 1);
          akk[row * kLdF + col] = col < row ? beta_s[row] * ck[j][e] : 0.0f;
          aqk_out[row * kLdC + col] = __float2bfloat16(col <= row ? cq[j][e] : 0.0f);
        }
      }
    }
    // Columns after the tile: zero.
    if (warp < 4) {
      const int first_zero = 16 * (row_tile + 1), width = kC - first_zero;
      for (int index = lane; index < 16 * width; index += 32) {
        const int row = m0 + index / width, col = first_zero + index % width;
        akk[row * kLdF + col] = 0.0f;
        aqk_out[row * kLdC + col] = __float2bfloat16(0.0f);
      }
    }
  }
  __syncthreads();

  // Stage v into the beta-V area (kinv is dead now); it lands while the diagonal blocks are inverted.
  for (int i = tid; i < kC * 16; i += kPrepThreads) {
    const int r = i >> 4, s = (i & 15) * 8;
    cp_async16_zfill(bv + r * kLdD + s, p.v + chunk_offset + (r < n ? r * row_stride + s : 0), r < n);
  }
  cp_async_commit();

  // m_b (bf16): diagonal blocks hold T_aa = (I + Akk_aa)^-1 (forward substitution in fp32, warps 0..3,
  // lane = column), blocks below the diagonal hold Akk (warps 4..7).
  if (warp < 4) {
    if (lane < 16) {
      const int m0 = warp * 16;
      float x[16];
#pragma unroll
      for (int t = 0; t < 16; ++t) {
        float s = t == lane ? 1.0f : 0.0f;
#pragma unroll
        for (int i = 0; i < t; ++i) s -= akk[(m0 + t) * kLdF + m0 + i] * x[i];
        x[t] = s;
      }
#pragma unroll
      for (int t = 0; t < 16; ++t) m_b[(m0 + t) * kLdC + m0 + lane] = __float2bfloat16(x[t]);
    }
  } else {
    for (int index = tid - 128; index < kC * kC; index += 128) {
      const int row = index / kC, col = index % kC;
      if (col < (row / 16) * 16) m_b[row * kLdC + col] = __float2bfloat16(akk[row * kLdF + col]);
    }
  }
  cp_async_wait<0>();
  __syncthreads();
#pragma unroll
  for (int j = 0; j < 32; ++j) {
    const int t = t0 + j;
    const float vv = __bfloat162float(bv[t * kLdD + c]);
    bk[t * kLdD + c] = __float2bfloat16(beta_s[t] * kr[j] * exp2_ftz(gc[j]));
    bv[t * kLdD + c] = __float2bfloat16(beta_s[t] * vv);
  }
  __syncthreads();

  // Blocked forward substitution of (I + Akk) [w | u] = [bk | bv], in place, each warp on its own 32 columns
  // (warps 0..3: w, 4..7: u), so only warp-level ordering is needed:
  //   W_a = T_aa (X_a - sum_{c < a} Akk_ac W_c).
  {
    bf16* x = warp < 4 ? bk : bv;
    const int col0 = (warp & 3) * 32;
    // w rows are [64][kLdD]; the u warp's 32 columns are exactly value slice warp % 4, [64][kLdV].
    bf16* out_rows = warp < 4 ? w_out + col0 : u_out + (warp & 3) * (kC * kLdV);
    const int out_ld = warp < 4 ? kLdD : kLdV;
    bf16* residual = r_b + warp * 16 * kLdR;  // [16][kLdR] X_a - sum, bf16
    for (int a0 = 0; a0 < kC; a0 += 16) {
      float acc[4][4] = {};
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
          const uint32_t packed = pack_bf16(wa[nt][2 * half_row], wa[nt][2 * half_row + 1]);
          *reinterpret_cast<uint32_t*>(x + row * kLdD + col0 + col) = packed;
          *reinterpret_cast<uint32_t*>(out_rows + row * out_ld + col) = packed;
        }
      }
      __syncwarp();
    }
  }
}

constexpr int kStateThreads = 512;
constexpr size_t kStageBytes = kOffU + kUSliceBytes;  // the chunk's shared part, then this CTA's u slice
constexpr size_t kStateSmem = 2 * kStageBytes + size_t{kD} * kLdV * 2 + size_t{kC} * kLdV * 2 + 2 * sizeof(uint64_t);

// 16 warps. Warp w owns state rows [16 (w % 8), +16) x columns [16 (w / 8), +16) of the slice's 32. For the
// chunk's token rows [64 x 32] = 4 x 2 tiles of 16x16: warps 0..7 compute v_new's tile w, warps 8..15 o's tile w - 8
// (row tile i % 4, column tile i / 4).
__global__ void __launch_bounds__(kStateThreads, 1) kda_chunk_state_kernel(StateArgs p) {
  extern __shared__ __align__(16) uint8_t smem[];
  const int H = p.num_heads;
  const int slice = blockIdx.x, h = blockIdx.y, sequence = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int group = lane >> 2, quad = lane & 3;
  const SequenceEntry seq = p.sequences[sequence];
  bf16* s_b = reinterpret_cast<bf16*>(smem + 2 * kStageBytes);   // [128][kLdV] state as bf16
  bf16* vn = s_b + kD * kLdV;                                    // [64][kLdV] v_new
  uint64_t* full = reinterpret_cast<uint64_t*>(vn + kC * kLdV);  // [2] stage barriers

  auto stage_base = [&](int stage) { return smem + stage * kStageBytes; };
  auto stage_w = [&](int stage) { return reinterpret_cast<const bf16*>(stage_base(stage) + kOffW); };
  auto stage_qg = [&](int stage) { return reinterpret_cast<const bf16*>(stage_base(stage) + kOffQg); };
  auto stage_kg = [&](int stage) { return reinterpret_cast<const bf16*>(stage_base(stage) + kOffKg); };
  auto stage_aqk = [&](int stage) { return reinterpret_cast<const bf16*>(stage_base(stage) + kOffAqk); };
  auto stage_decay = [&](int stage) { return reinterpret_cast<const float*>(stage_base(stage) + kOffDecay); };
  auto stage_u = [&](int stage) { return reinterpret_cast<const bf16*>(stage_base(stage) + kOffU); };

  // Thread 0 only: the chunk's factors into `stage` by two bulk copies (the shared part, this slice's u).
  auto load_stage = [&](int stage, int chunk) {
    const uint8_t* src = p.data + (static_cast<size_t>(chunk) * H + h) * kChunkBytes;
    const uint32_t bar = smem_address(&full[stage]);
    const uint32_t dst = smem_address(stage_base(stage));
    sm90::mbarrier_arrive_expect_tx(bar, static_cast<uint32_t>(kStageBytes));
    bulk_copy_to_shared(dst, src, static_cast<uint32_t>(kOffU), bar);
    bulk_copy_to_shared(dst + static_cast<uint32_t>(kOffU), src + kOffU + slice * kUSliceBytes,
                        static_cast<uint32_t>(kUSliceBytes), bar);
  };

  // State rows [16 (warp % 8), +16), slice columns [16 (warp / 8), +16): fragments s[n-tile][c0..c3].
  float s[2][4];
  const size_t state_offset = (static_cast<size_t>(sequence) * H + h) * kD * kD + slice * kStateBv;
  const int state_row = (warp & 7) * 16 + group, state_col = (warp >> 3) * 16;
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = state_row + half * 8, col = state_col + nt * 8 + quad * 2;
      float2 value = make_float2(0.0f, 0.0f);
      if (p.initial_state != nullptr) {
        value = *reinterpret_cast<const float2*>(p.initial_state + state_offset + row * kD + col);
      }
      s[nt][2 * half] = value.x;
      s[nt][2 * half + 1] = value.y;
    }
  }
  auto store_state = [&](float* base) {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = state_row + half * 8, col = state_col + nt * 8 + quad * 2;
        *reinterpret_cast<float2*>(base + row * kD + col) = make_float2(s[nt][2 * half], s[nt][2 * half + 1]);
      }
    }
  };

  if (tid == 0) {
    sm90::mbarrier_init(smem_address(&full[0]), 1);
    sm90::mbarrier_init(smem_address(&full[1]), 1);
    sm90::mbarrier_init_fence();
    fence_proxy_async_global();  // the workspace was written by the prep grid with ordinary stores
    if (seq.num_chunks > 0) load_stage(0, seq.first_chunk);
  }
  __syncthreads();

  const bool v_warp = warp < 8;
  const int m0 = (warp & 3) * 16, n0 = ((warp >> 2) & 1) * 16;  // this warp's token-row tile (v_new or o)
  for (int ci = 0; ci < seq.num_chunks; ++ci) {
    const int stage = ci & 1;
    // The other stage was released by the barrier at the end of the previous chunk.
    if (tid == 0 && ci + 1 < seq.num_chunks) load_stage(stage ^ 1, seq.first_chunk + ci + 1);
      // State to bf16 for the matmuls.
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const int col = state_col + nt * 8 + quad * 2;
      *reinterpret_cast<uint32_t*>(s_b + state_row * kLdV + col) = pack_bf16(s[nt][0], s[nt][1]);
      *reinterpret_cast<uint32_t*>(s_b + (state_row + 8) * kLdV + col) = pack_bf16(s[nt][2], s[nt][3]);
    }
    sm90::mbarrier_wait(smem_address(&full[stage]), static_cast<uint32_t>((ci >> 1) & 1));
    __syncthreads();

    const bf16* aqk = stage_aqk(stage);
    const bf16* kg = stage_kg(stage);
    const float* decay = stage_decay(stage);
    // v_new = u - w S (warps 0..7) or o = (q e^gc) S (warps 8..15), one 16x16 tile each.
    float acc[2][4] = {};
    {
      const bf16* a_rows = v_warp ? stage_w(stage) : stage_qg(stage);
#pragma unroll
      for (int k0 = 0; k0 < kD; k0 += 16) {
        uint32_t am[4], b[4];
        load_a(am, a_rows, kLdD, m0, k0);
        load_b_kn(b, s_b, kLdV, n0, k0);
        mma_bf16_16816(acc[0], am, b[0], b[1]);
        mma_bf16_16816(acc[1], am, b[2], b[3]);
      }
    }
    if (v_warp) {
      const bf16* u = stage_u(stage);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int row = m0 + group + half * 8, col = n0 + nt * 8 + quad * 2;
          const float2 uu = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(u + row * kLdV + col));
          *reinterpret_cast<uint32_t*>(vn + row * kLdV + col) =
              pack_bf16(uu.x - acc[nt][2 * half], uu.y - acc[nt][2 * half + 1]);
        }
      }
    }
    __syncthreads();
    const int chunk_first = ci * kC;
    const int tokens = min(kC, seq.length - chunk_first);
    if (!v_warp) {
      // o += Aqk v_new (causal: k-steps up to this warp's row tile).
      for (int k0 = 0; k0 <= m0; k0 += 16) {
        uint32_t aa[4], b[4];
        load_a(aa, aqk, kLdC, m0, k0);
        load_b_kn(b, vn, kLdV, n0, k0);
        mma_bf16_16816(acc[0], aa, b[0], b[1]);
        mma_bf16_16816(acc[1], aa, b[2], b[3]);
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int row = m0 + group + half * 8, col = slice * kStateBv + n0 + nt * 8 + quad * 2;
          if (row < tokens) {
            const size_t index = (static_cast<size_t>(seq.token_begin + chunk_first + row) * H + h) * kD + col;
            *reinterpret_cast<uint32_t*>(p.o + index) = pack_bf16(acc[nt][2 * half], acc[nt][2 * half + 1]);
          }
        }
      }
    }
    // S = e^gc_last ⊙ S + kg^T v_new.
    const float d0 = decay[state_row], d1 = decay[state_row + 8];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      s[nt][0] *= d0;
      s[nt][1] *= d0;
      s[nt][2] *= d1;
      s[nt][3] *= d1;
    }
#pragma unroll
    for (int k0 = 0; k0 < kC; k0 += 16) {
      uint32_t ak[4], b[4];
      load_a_trans(ak, kg, kLdD, (warp & 7) * 16, k0);
      load_b_kn(b, vn, kLdV, state_col, k0);
      mma_bf16_16816(s[0], ak, b[0], b[1]);
      mma_bf16_16816(s[1], ak, b[2], b[3]);
    }
    if (p.checkpoint_interval > 0 && tokens == kC && (chunk_first + kC) % p.checkpoint_interval == 0) {
      const int entry = seq.checkpoint_first + (chunk_first + kC) / p.checkpoint_interval - 1;
      store_state(p.checkpoint_states + (static_cast<size_t>(entry) * H + h) * kD * kD + slice * kStateBv);
    }
    __syncthreads();
  }
  if (p.final_state != nullptr) store_state(p.final_state + state_offset);
}

bool aligned16(const void* pointer) {
  return (reinterpret_cast<uintptr_t>(pointer) & 15u) == 0;
}

Status check_device_pointer(const void* pointer, const char* name, bool required) {
  if (pointer == nullptr) {
    if (required) return invalid_argument(std::string(name) + " is null");
    return Status::ok();
  }
  if (!aligned16(pointer)) return invalid_argument(std::string(name) + " is not 16-byte aligned");
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, pointer) != cudaSuccess) {
    (void)cudaGetLastError();
    return invalid_argument(std::string(name) + " is not a CUDA pointer");
  }
  if (attributes.type != cudaMemoryTypeDevice && attributes.type != cudaMemoryTypeManaged) {
    return invalid_argument(std::string(name) + " is not device memory");
  }
  return Status::ok();
}

Status check_cu_seqlens(const std::vector<int32_t>& cu) {
  if (cu.size() < 2) return invalid_argument("cu_seqlens needs N + 1 >= 2 entries");
  if (cu[0] != 0) return invalid_argument("cu_seqlens[0] must be 0");
  for (size_t i = 1; i < cu.size(); ++i) {
    if (cu[i] < cu[i - 1]) {
      return invalid_argument("cu_seqlens must be non-decreasing (entry " + std::to_string(i) + ")");
    }
  }
  return Status::ok();
}

int64_t chunk_count(const std::vector<int32_t>& cu) {
  int64_t chunks = 0;
  for (size_t i = 1; i < cu.size(); ++i) chunks += (cu[i] - cu[i - 1] + kC - 1) / kC;
  return chunks;
}

size_t align256(size_t bytes) {
  return (bytes + 255) / 256 * 256;
}

Status cuda_status(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return Status::ok();
  return internal_error(std::string(what) + ": " + cudaGetErrorName(error) + " (" + cudaGetErrorString(error) + ")");
}

}  // namespace

size_t kda_prefill_workspace_bytes(const std::vector<int32_t>& cu_seqlens, int num_heads) {
  if (!check_cu_seqlens(cu_seqlens).is_ok() || num_heads <= 0) return 0;
  const int64_t chunks = chunk_count(cu_seqlens);
  const size_t sequences = cu_seqlens.size() - 1;
  return align256(static_cast<size_t>(chunks) * sizeof(ChunkEntry)) + align256(sequences * sizeof(SequenceEntry)) +
         static_cast<size_t>(chunks) * static_cast<size_t>(num_heads) * kChunkBytes;
}

int64_t kda_prefill_checkpoint_count(const std::vector<int32_t>& cu_seqlens, int checkpoint_interval) {
  if (checkpoint_interval <= 0 || !check_cu_seqlens(cu_seqlens).is_ok()) return 0;
  int64_t count = 0;
  for (size_t i = 1; i < cu_seqlens.size(); ++i) count += (cu_seqlens[i] - cu_seqlens[i - 1]) / checkpoint_interval;
  return count;
}

Status kda_chunk_prefill(const KdaPrefillParams& p, cudaStream_t stream) {
  if (p.num_heads <= 0) return invalid_argument("kda_chunk_prefill: num_heads must be >= 1");
  if (p.head_dim != kD)
    return unimplemented("kda_chunk_prefill: head_dim must be 128, got " + std::to_string(p.head_dim));
  DS_RETURN_IF_ERROR_CTX(check_cu_seqlens(p.cu_seqlens), "kda_chunk_prefill");
  const int64_t total_tokens = p.cu_seqlens.back();
  const int64_t sequences = static_cast<int64_t>(p.cu_seqlens.size()) - 1;
  if (sequences > 65535) return out_of_range("kda_chunk_prefill: at most 65535 sequences per call");
  if (!(std::isfinite(p.q_scale) && p.q_scale > 0.0f))
    return invalid_argument("kda_chunk_prefill: q_scale must be > 0");
  const bool tokens = total_tokens > 0;
  DS_RETURN_IF_ERROR_CTX(check_device_pointer(p.q, "q", tokens), "kda_chunk_prefill");
  DS_RETURN_IF_ERROR_CTX(check_device_pointer(p.k, "k", tokens), "kda_chunk_prefill");
  DS_RETURN_IF_ERROR_CTX(check_device_pointer(p.v, "v", tokens), "kda_chunk_prefill");
  DS_RETURN_IF_ERROR_CTX(check_device_pointer(p.g, "g", tokens), "kda_chunk_prefill");
  DS_RETURN_IF_ERROR_CTX(check_device_pointer(p.beta, "beta", tokens), "kda_chunk_prefill");
  DS_RETURN_IF_ERROR_CTX(check_device_pointer(p.o, "o", tokens), "kda_chunk_prefill");
  DS_RETURN_IF_ERROR_CTX(check_device_pointer(p.initial_state, "initial_state", false), "kda_chunk_prefill");
  DS_RETURN_IF_ERROR_CTX(check_device_pointer(p.final_state, "final_state", false), "kda_chunk_prefill");
  if (p.gate_raw) {
    DS_RETURN_IF_ERROR_CTX(check_device_pointer(p.a_log, "a_log", true), "kda_chunk_prefill: gate_raw");
    DS_RETURN_IF_ERROR_CTX(check_device_pointer(p.dt_bias, "dt_bias", true), "kda_chunk_prefill: gate_raw");
    if (p.lower_bound && !(std::isfinite(*p.lower_bound) && *p.lower_bound < 0.0f)) {
      return invalid_argument("kda_chunk_prefill: lower_bound must be finite and < 0");
    }
  } else if (p.lower_bound) {
    return invalid_argument("kda_chunk_prefill: lower_bound applies to the fused (raw) gate only");
  }
  if (p.checkpoint_interval < 0 || p.checkpoint_interval % kC != 0) {
    return invalid_argument("kda_chunk_prefill: checkpoint_interval must be 0 or a positive multiple of 64, got " +
                            std::to_string(p.checkpoint_interval));
  }
  const int64_t checkpoints = kda_prefill_checkpoint_count(p.cu_seqlens, p.checkpoint_interval);
  DS_RETURN_IF_ERROR_CTX(check_device_pointer(p.checkpoint_states, "checkpoint_states", checkpoints > 0),
                         "kda_chunk_prefill");
  const size_t needed = kda_prefill_workspace_bytes(p.cu_seqlens, p.num_heads);
  DS_RETURN_IF_ERROR_CTX(check_device_pointer(p.workspace, "workspace", true), "kda_chunk_prefill");
  if (p.workspace_bytes < needed) {
    return invalid_argument("kda_chunk_prefill: workspace has " + std::to_string(p.workspace_bytes) + " bytes, needs " +
                            std::to_string(needed));
  }
  const int64_t chunks = chunk_count(p.cu_seqlens);
  if (chunks > 0x7fffffff / 2) return out_of_range("kda_chunk_prefill: too many chunks");
  if (!tokens && p.final_state == nullptr) return Status::ok();

  // Tables.
  std::vector<ChunkEntry> chunk_table;
  chunk_table.reserve(static_cast<size_t>(chunks));
  std::vector<SequenceEntry> sequence_table(static_cast<size_t>(sequences));
  int32_t checkpoint_first = 0;
  for (int64_t s = 0; s < sequences; ++s) {
    const int32_t begin = p.cu_seqlens[s], length = p.cu_seqlens[s + 1] - begin;
    SequenceEntry& entry = sequence_table[static_cast<size_t>(s)];
    entry = {};
    entry.first_chunk = static_cast<int32_t>(chunk_table.size());
    entry.num_chunks = (length + kC - 1) / kC;
    entry.token_begin = begin;
    entry.length = length;
    entry.checkpoint_first = checkpoint_first;
    if (p.checkpoint_interval > 0) checkpoint_first += length / p.checkpoint_interval;
    for (int32_t first = 0; first < length; first += kC) {
      chunk_table.push_back({begin + first, std::min(kC, length - first), static_cast<int32_t>(s), 0});
    }
  }
  auto* base = static_cast<uint8_t*>(p.workspace);
  auto* chunk_device = reinterpret_cast<ChunkEntry*>(base);
  auto* sequence_device = reinterpret_cast<SequenceEntry*>(base + align256(chunk_table.size() * sizeof(ChunkEntry)));
  uint8_t* data = reinterpret_cast<uint8_t*>(sequence_device) + align256(sequence_table.size() * sizeof(SequenceEntry));
  if (!chunk_table.empty()) {
    DS_RETURN_IF_ERROR(
        cuda_status(cudaMemcpyAsync(chunk_device, chunk_table.data(), chunk_table.size() * sizeof(ChunkEntry),
                                    cudaMemcpyHostToDevice, stream),
                    "kda_chunk_prefill: chunk table copy"));
  }
  DS_RETURN_IF_ERROR(
      cuda_status(cudaMemcpyAsync(sequence_device, sequence_table.data(), sequence_table.size() * sizeof(SequenceEntry),
                                  cudaMemcpyHostToDevice, stream),
                  "kda_chunk_prefill: sequence table copy"));

  static const cudaError_t attributes = [] {
    cudaError_t e = cudaFuncSetAttribute(kda_chunk_prep_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(kPrepSmem));
    if (e != cudaSuccess) return e;
    return cudaFuncSetAttribute(kda_chunk_state_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                static_cast<int>(kStateSmem));
  }();
  DS_RETURN_IF_ERROR(cuda_status(attributes, "kda_chunk_prefill: shared memory attributes"));

  if (chunks > 0) {
    PrepArgs prep{p.q,
                  p.k,
                  p.v,
                  p.g,
                  p.beta,
                  p.q_scale,
                  !p.gate_raw ? kGatePrecomputed : (p.lower_bound ? kGateBounded : kGateSoftplus),
                  p.a_log,
                  p.dt_bias,
                  p.lower_bound.value_or(0.0f),
                  p.num_heads,
                  chunk_device,
                  data};
    kda_chunk_prep_kernel<<<dim3(static_cast<unsigned>(chunks), static_cast<unsigned>(p.num_heads)), kPrepThreads,
                            kPrepSmem, stream>>>(prep);
    DS_RETURN_IF_ERROR(cuda_status(cudaGetLastError(), "kda_chunk_prefill: prep launch"));
  }
  StateArgs state{p.num_heads,           sequence_device,     data, p.initial_state, p.final_state,
                  p.checkpoint_interval, p.checkpoint_states, p.o};
  kda_chunk_state_kernel<<<dim3(kD / kStateBv, static_cast<unsigned>(p.num_heads), static_cast<unsigned>(sequences)),
                           kStateThreads, kStateSmem, stream>>>(state);
  return cuda_status(cudaGetLastError(), "kda_chunk_prefill: state launch");
}

}  // namespace deltaserve::kernels::cuda
