// KDA chunked prefill for sm_90a in two launches (see kda.hpp for the contract):
//   1. prep, one CTA per (chunk of 64 tokens, head), fully parallel: the chunk's cumulative log-decay, the
//      intra-chunk matrices Akk (strictly lower, beta-weighted) and Aqk (lower incl. diagonal) on tensor cores, the
//      inverses of the 16x16 diagonal blocks of I + Akk, then w = (I + Akk)^-1 diag(beta) (K ⊙ e^gc) and u = (I +
//      Akk)^-1 diag(beta) V by blocked forward substitution on tensor cores (the UT transform); writes w, u, q ⊙ e^gc,
//      k ⊙ e^(gc_last - gc), Aqk (bf16) and e^gc_last (fp32) to the workspace, in the state pass's shared-memory
//      layout (wgmma operands in 128-byte-swizzled blocks, u split by value slice), so that the state pass loads a
//      chunk with two bulk copies.
//   2. state pass, one CTA of two warpgroups per (64 value columns, head, sequence), sequential over the sequence's
//      chunks on wgmma, with the state slice [128 x 64] fp32 in registers (64 keys a warpgroup): warpgroup 0
//      computes v_new = u - w S while warpgroup 1 computes o = (q e^gc) S, then each updates its half,
//      S = e^gc_last ⊙ S + (k e^(gc_last - gc))^T v_new, and warpgroup 1 adds Aqk v_new to o. The next chunk's
//      factors land by bulk copy (one thread, mbarrier, 2 stages) during the current one. When 2 H CTAs would not
//      all be resident at once (H = 96), the pass per head instead (kda_chunk_state_head_kernel, below): a CTA per
//      (head, sequence), a warpgroup per 64 value columns holding the transposed state, so H CTAs make one wave.
// Sub-tiles of 16 tokens: pair decays are split at the row tile's start r, k_i e^(r - gc_i) and x_t e^(gc_t - r).
// Across tiles both factors are <= 1; inside the diagonal tile the first is <= e^(16 * 5) = e^80 when the
// per-step log-decay is >= -5, so the diagonal tiles are plain matmuls too (dense path). A chunk whose tiles
// span more than 85 in log-decay takes an exact pairwise path for its diagonal tiles instead.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>

#include <cuda_bf16.h>

#include "kernels/cuda/common/detail/bf16_stream.cuh"
#include "kernels/cuda/kda/kda.hpp"
#include "kernels/cuda/common/detail/mma_sm80.cuh"
#include "kernels/cuda/common/detail/sm90_ptx.cuh"

namespace deltaserve::kernels::cuda {
namespace {

using namespace detail;  // NOLINT(google-build-using-namespace)
using bf16 = __nv_bfloat16;

constexpr int kD = kKdaHeadDim;
constexpr int kC = kKdaChunk;
constexpr int kLdD = kD + 8;    // bf16 row stride of [*, 128] smem tiles (conflict-free ldmatrix)
constexpr int kLdC = kC + 8;    // bf16 row stride of [*, 64] smem tiles
constexpr int kLdF = 17;        // fp32 row stride of the [16, 16] diagonal blocks of Akk
constexpr int kLdR = 32 + 8;    // bf16 row stride of a warp's [16, 32] residual tile
constexpr int kKinvRows = 160;  // 16 + 32 + 48 + 64: the B operands of the four row tiles
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kDenseSpan = 85.0f * kLog2e;  // in log2 units (the prep keeps log-decays as log2): e^85 < fp32 max
constexpr int kStateBv = 64;                  // value columns per state-pass CTA
constexpr int kLdU = kStateBv + 8;            // bf16 row stride of a u slice [64][kLdU]
constexpr int kSlices = kD / kStateBv;

// Per (chunk, head) block of the workspace, laid out as the state pass's shared-memory stage. The wgmma operands
// are 128-byte swizzled blocks of [64 rows][64 bf16] (8 KiB, 1024-byte aligned; sw128 below): w, q e^gc and
// k e^(gc_last - gc) as [64 tokens][128 keys] (two blocks: keys 0..63, 64..127), Aqk [64][64] (one block); then
// e^gc_last [128] fp32 (the part every value slice reads), then u as [2 slices][64][kLdU] (plain rows).
constexpr size_t kBlockBytes = size_t{kC} * 64 * 2;
constexpr size_t kOffW = 0;
constexpr size_t kOffQg = kOffW + 2 * kBlockBytes;
constexpr size_t kOffKg = kOffQg + 2 * kBlockBytes;
constexpr size_t kOffAqk = kOffKg + 2 * kBlockBytes;
constexpr size_t kOffDecay = kOffAqk + kBlockBytes;
constexpr size_t kOffU = kOffDecay + size_t{kD} * 4;  // the shared part ends here
constexpr size_t kUSliceBytes = size_t{kC} * kLdU * 2;
constexpr size_t kChunkBytes = kOffU + kSlices * kUSliceBytes;
static_assert(kOffU % 16 == 0 && kUSliceBytes % 16 == 0 && kChunkBytes % 16 == 0, "bulk copies need 16-byte units");

// Element offset of (row r, column c < 64) in a 128-byte-swizzled block of 64-element rows (the layout TMA's
// SWIZZLE_128B writes and sm90::smem_descriptor_sw128 reads: 16-byte chunk c / 8 of row r sits at chunk
// (c / 8) ^ (r % 8)). Rows may run past 64 (the state's [128][64] operand): the pattern repeats every 8 rows.
__host__ __device__ constexpr int sw128(int r, int c) {
  return r * 64 + ((((c >> 3) ^ (r & 7)) << 3) | (c & 7));
}
// The same for a [64][128] operand stored as two blocks of 64 columns.
__host__ __device__ constexpr int sw128_wide(int r, int c) {
  return (c >> 6) * (kC * 64) + sw128(r, c & 63);
}

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
  // The overlapped pass (KdaStatePass::kPerHeadOverlapped): a 1-D grid of (chunk, head) items in chunk-major order,
  // flags[item] set (release) once the item's block is written, `done` counting the finished items; the last to
  // finish waits for the state pass (its primary grid), so this grid completes after it. nullptr: the 2-D grid.
  unsigned int* flags;
  unsigned int* done;
  unsigned int total_items;
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
  const unsigned int* flags;  // the overlapped pass: a chunk's block is read once its flag is set; nullptr: at once
  // The overlapped pass: a CTA whose first chunk is not flagged within wait_ns (the prep is not running beside it:
  // kernels serialised) sets fallback[sequence * H + h] and leaves; the same kernel launched after the prep with
  // rerun set runs exactly those CTAs, without flags.
  unsigned int* fallback;
  unsigned long long wait_ns;
  int rerun;
};

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

// D[64 x 64] (+)= A[64 x 16] · B[16 x 64], bf16 operands in shared memory (128-byte swizzled), fp32 accumulators.
// A is K-major (kTransA = 0: rows of k) or MN-major (1: rows of 64 m-values, one per k); B is MN-major (rows of 64
// n-values, one per k). accumulate == 0: D = A · B. Accumulator layout (warp w of the warpgroup, lane l, register
// i): row 16 w + l / 4 + 8 ((i % 4) / 2), column 8 (i / 4) + 2 (l % 4) + i % 2.
template <int kTransA>
__device__ __forceinline__ void wgmma_m64n64k16(float (&d)[32], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" DS_SM90_REGS32
      "}, %32, %33, p, 1, 1, %35, 1;\n"
      "}\n"
      : DS_SM90_ACC32("+f", d, 0)
      : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(kTransA));
}

// Descriptors of the state pass's operands (all 128-byte swizzled, 1024-byte aligned blocks of 64-element rows).
// K-major A ([64 rows][64 k] blocks): k16 step s of a 128-wide operand is block s / 4, 32 (s % 4) bytes in.
__device__ __forceinline__ uint64_t desc_k_major(uint32_t base, int step) {
  return sm90::smem_descriptor_sw128(base + (step >> 2) * static_cast<uint32_t>(kBlockBytes) + (step & 3) * 32, 16,
                                     1024);
}
// MN-major operand (rows of k, 64 m/n-values each): k16 step s starts 16 rows (2048 bytes) in.
__device__ __forceinline__ uint64_t desc_mn_major(uint32_t base, int step) {
  return sm90::smem_descriptor_sw128(base + step * 2048, static_cast<uint32_t>(kBlockBytes), 1024);
}

constexpr int kStateThreads = 256;
constexpr size_t kStageBytes = kOffU + kUSliceBytes;                 // the chunk's shared part, then this u slice
constexpr size_t kStageStride = (kStageBytes + 1023) / 1024 * 1024;  // stages start 1024-byte aligned
constexpr size_t kStateOperandBytes = size_t{kD} * kStateBv * 2;     // S as bf16, [128 keys][64 values]
constexpr size_t kVnBytes = size_t{kC} * kStateBv * 2;               // v_new as bf16, [64 tokens][64 values]
constexpr size_t kOutBytes = size_t{kC} * kStateBv * 2;  // a chunk's output slice as bf16, [64 tokens][64 values]
constexpr size_t kStateSmem =
    1024 + 2 * kStageStride + kStateOperandBytes + kVnBytes + kOutBytes + 2 * sizeof(uint64_t);

// Two warpgroups per (64 value columns, head, sequence), sequential over the sequence's chunks. Warpgroup wg holds
// keys [64 wg, +64) of the state slice S [128 keys x 64 values] in fp32 registers. A chunk: warpgroup 0 computes
// v_new = u - w S and warpgroup 1 the inter-chunk output (q e^gc) S (wgmma, S read as bf16 from shared memory); then
// each warpgroup updates its half, S = e^gc_last ⊙ S + (k e^(gc_last - gc))^T v_new (wgmma with the accumulators in
// place), and writes it back as bf16, while warpgroup 1 adds Aqk v_new to the output. Both read the chunk's factors
// from a stage that one thread fills by two bulk copies (an mbarrier a stage, two stages: the next chunk lands during
// the current one). Warpgroup 1 stages each chunk's output slice in shared memory and copies it out, 16 bytes a
// thread, during the next chunk's first product.
__global__ void __launch_bounds__(kStateThreads, 1) kda_chunk_state_kernel(StateArgs p) {
  extern __shared__ uint8_t smem_raw[];
  // 1024-byte aligned by an offset from the shared array itself, so that the compiler keeps every access through
  // `smem` a shared-memory one (LDS/STS; through an integer round trip they become generic loads and stores).
  uint8_t* smem = smem_raw + ((1024u - (smem_address(smem_raw) & 1023u)) & 1023u);
  const int H = p.num_heads;
  const int slice = blockIdx.x, h = blockIdx.y, sequence = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wg = warp >> 2, wg_warp = warp & 3;
  const SequenceEntry seq = p.sequences[sequence];
  bf16* s_b = reinterpret_cast<bf16*>(smem + 2 * kStageStride);                                  // sw128 [128][64]
  bf16* vn = reinterpret_cast<bf16*>(smem + 2 * kStageStride + kStateOperandBytes);              // sw128 [64][64]
  bf16* o_s = reinterpret_cast<bf16*>(smem + 2 * kStageStride + kStateOperandBytes + kVnBytes);  // sw128 [64][64]
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + 2 * kStageStride + kStateOperandBytes + kVnBytes + kOutBytes);
  const uint32_t s_b_address = smem_address(s_b), vn_address = smem_address(vn);
  // Warpgroup 1: the staged output slice of the chunk starting at token `first` of the sequence, its first `rows`
  // rows, to global memory: 16 bytes a thread and step, 128 bytes a row, all four loads before the stores.
  auto store_output = [&](int first, int rows) {
    const int row0 = (tid - 128) >> 3, part = tid & 7;
    uint4 value[4];
#pragma unroll
    for (int step = 0; step < 4; ++step) {
      value[step] = *reinterpret_cast<const uint4*>(o_s + sw128(16 * step + row0, part * 8));
    }
#pragma unroll
    for (int step = 0; step < 4; ++step) {
      const int row = 16 * step + row0;
      if (row < rows) {
        const size_t at =
            (static_cast<size_t>(seq.token_begin + first + row) * H + h) * kD + slice * kStateBv + part * 8;
        *reinterpret_cast<uint4*>(p.o + at) = value[step];
      }
    }
  };

  auto stage_base = [&](int stage) { return smem + stage * kStageStride; };
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

  // Accumulator coordinates of this thread (wgmma layout): register i (even; i + 1 is the next column) holds row
  // acc_row(i) and column acc_col(i) of its warpgroup's m64 x n64 tile.
  const int row0 = 16 * wg_warp + (lane >> 2), col0 = 2 * (lane & 3);
  auto acc_row = [&](int i) { return row0 + 8 * ((i % 4) / 2); };
  auto acc_col = [&](int i) { return 8 * (i / 4) + col0; };
  const size_t state_offset = (static_cast<size_t>(sequence) * H + h) * kD * kD + slice * kStateBv;
  // Warpgroup wg holds the state's keys [64 wg, +64) x the slice's 64 values in fp32 registers.
  float s[32];
  auto store_state = [&](float* base) {
#pragma unroll
    for (int i = 0; i < 32; i += 2) {
      const int key = 64 * wg + acc_row(i), col = acc_col(i);
      *reinterpret_cast<float2*>(base + key * kD + col) = make_float2(s[i], s[i + 1]);
    }
  };
  auto state_to_shared = [&] {
#pragma unroll
    for (int i = 0; i < 32; i += 2) {
      const int key = 64 * wg + acc_row(i), col = acc_col(i);
      *reinterpret_cast<uint32_t*>(s_b + sw128(key, col)) = pack_bf16(s[i], s[i + 1]);
    }
    sm90::fence_proxy_async_shared();  // the bf16 state is a wgmma operand next
  };
#pragma unroll
  for (int i = 0; i < 32; i += 2) {
    const int key = 64 * wg + acc_row(i), col = acc_col(i);
    float2 value = make_float2(0.0f, 0.0f);
    if (p.initial_state != nullptr) {
      value = *reinterpret_cast<const float2*>(p.initial_state + state_offset + key * kD + col);
    }
    s[i] = value.x;
    s[i + 1] = value.y;
  }
  state_to_shared();

  if (tid == 0) {
    sm90::mbarrier_init(smem_address(&full[0]), 1);
    sm90::mbarrier_init(smem_address(&full[1]), 1);
    sm90::mbarrier_init_fence();
    fence_proxy_async_global();  // the workspace was written by the prep grid with ordinary stores
    if (seq.num_chunks > 0) load_stage(0, seq.first_chunk);
  }
  __syncthreads();

  for (int ci = 0; ci < seq.num_chunks; ++ci) {
    const int stage = ci & 1;
    // The other stage was released by the barrier at the end of the previous chunk.
    if (tid == 0 && ci + 1 < seq.num_chunks) load_stage(stage ^ 1, seq.first_chunk + ci + 1);
    const uint32_t base = smem_address(stage_base(stage));
    sm90::mbarrier_wait(smem_address(&full[stage]), static_cast<uint32_t>((ci >> 1) & 1));
    const int chunk_first = ci * kC;
    const int tokens = min(kC, seq.length - chunk_first);

    // Phase 1: w S (warpgroup 0) or (q e^gc) S (warpgroup 1), K = 128 keys.
    float acc[32];
    sm90::wgmma_fence();
    const uint32_t a_base = base + static_cast<uint32_t>(wg == 0 ? kOffW : kOffQg);
#pragma unroll
    for (int step = 0; step < kD / 16; ++step) {
      wgmma_m64n64k16<0>(acc, desc_k_major(a_base, step), desc_mn_major(s_b_address, step), step > 0 ? 1 : 0);
    }
    sm90::wgmma_commit_group();
    // The previous chunk's output slice, staged in shared memory, to global memory while the products run. (Stored
    // straight from the accumulators at the end of the chunk, the stores held the accumulator registers that the
    // next chunk's first product overwrites.)
    if (wg == 1 && ci > 0) store_output(chunk_first - kC, kC);
    sm90::wgmma_wait_group<0>();
    sm90::wgmma_fence_registers(acc);
    if (wg == 0) {
      // v_new = u - w S -> shared memory (bf16), the B operand of both products below. All u loads first: they
      // and the v_new stores are both shared memory, and the compiler cannot reorder them across each other.
      const bf16* u = reinterpret_cast<const bf16*>(stage_base(stage) + kOffU);
      __nv_bfloat162 uu[16];
#pragma unroll
      for (int i = 0; i < 32; i += 2) {
        const int row = acc_row(i), col = acc_col(i);
        uu[i / 2] = *reinterpret_cast<const __nv_bfloat162*>(u + row * kLdU + col);
      }
#pragma unroll
      for (int i = 0; i < 32; i += 2) {
        const int row = acc_row(i), col = acc_col(i);
        const float2 uf = __bfloat1622float2(uu[i / 2]);
        *reinterpret_cast<uint32_t*>(vn + sw128(row, col)) = pack_bf16(uf.x - acc[i], uf.y - acc[i + 1]);
      }
      sm90::fence_proxy_async_shared();
    }
    const float* decay = reinterpret_cast<const float*>(stage_base(stage) + kOffDecay);
    const float d0 = decay[64 * wg + acc_row(0)], d1 = decay[64 * wg + acc_row(2)];  // rows of i % 4 < 2, >= 2
    __syncthreads();  // v_new complete; both warpgroups are done reading the bf16 state

    // Both warpgroups: their half of S = e^gc_last ⊙ S + kg^T v_new (A = kg^T, MN-major: kg's rows are tokens;
    // B = v_new; K = 64 tokens). Warpgroup 1 also: o += Aqk v_new (Aqk is zero above its diagonal).
#pragma unroll
    for (int i = 0; i < 32; ++i) s[i] *= (i % 4) < 2 ? d0 : d1;
    const uint32_t kg_base = base + static_cast<uint32_t>(kOffKg) + wg * static_cast<uint32_t>(kBlockBytes);
    auto update = [&] {
      sm90::wgmma_fence();
#pragma unroll
      for (int step = 0; step < kC / 16; ++step) {
        wgmma_m64n64k16<1>(s, desc_mn_major(kg_base, step), desc_mn_major(vn_address, step), 1);
      }
    };
    // Each branch issues, commits and waits for its own wgmma (ptxas serialises wgmma issued on a divergent path
    // after common ones).
    if (wg == 0) {
      update();
      sm90::wgmma_commit_group();
      sm90::wgmma_wait_group<0>();
    } else {
      update();
      const uint32_t aqk_base = base + static_cast<uint32_t>(kOffAqk);
#pragma unroll
      for (int step = 0; step < kC / 16; ++step) {
        wgmma_m64n64k16<0>(acc, desc_k_major(aqk_base, step), desc_mn_major(vn_address, step), 1);
      }
      sm90::wgmma_commit_group();
      sm90::wgmma_wait_group<0>();
    }
    sm90::wgmma_fence_registers(s);
    sm90::wgmma_fence_registers(acc);
    state_to_shared();
    if (p.checkpoint_interval > 0 && tokens == kC && (chunk_first + kC) % p.checkpoint_interval == 0) {
      const int entry = seq.checkpoint_first + (chunk_first + kC) / p.checkpoint_interval - 1;
      store_state(p.checkpoint_states + (static_cast<size_t>(entry) * H + h) * kD * kD + slice * kStateBv);
    }
    if (wg == 1) {
      // Staged in shared memory; the next chunk (or the end) copies the rows out.
#pragma unroll
      for (int i = 0; i < 32; i += 2) {
        *reinterpret_cast<uint32_t*>(o_s + sw128(acc_row(i), acc_col(i))) = pack_bf16(acc[i], acc[i + 1]);
      }
    }
    __syncthreads();  // the new bf16 state is in place; v_new and the stage are free
  }
  if (wg == 1 && seq.num_chunks > 0) {
    const int last_first = (seq.num_chunks - 1) * kC;
    store_output(last_first, seq.length - last_first);
  }
  if (p.final_state != nullptr) store_state(p.final_state + state_offset);
}

// ---- the state pass per head ----------------------------------------------------------------------------------
//
// The same recurrence with the state held transposed, S^T [64 values x 128 keys], by one warpgroup per 64 value
// columns: every product of a chunk then has S^T or v_new^T as its A operand, and wgmma takes A from registers in
// the accumulator layout (the fp32 accumulators of columns 16 j .. 16 j + 15, paired and rounded to bf16, are k16
// step j's A fragment). So a chunk needs no shared-memory round trip of S or v_new and no barrier between the
// warpgroups, and the two warpgroups of a head share one stage of its factors:
//   X = S^T w^T                                         (A = S^T as bf16, B = w K-major, K = 128 keys)
//   v_new^T = u^T - X                                   (u read transposed from the stage)
//   S^T = S^T ⊙ e^gc_last + v_new^T (k e^(gc_last - gc))   (B MN-major over both key blocks, N = 128, K = 64 tokens)
//   o^T = S_old^T (q e^gc)^T + v_new^T Aqk^T            (B = q e^gc, Aqk K-major; S_old: the chunk's first state)
// The operands are the prep's workspace block as it is (the stage layout above, one bulk copy). o^T goes transposed
// into a shared-memory tile and out, 16 bytes a thread, during the next chunk's X.
// Measured against kda_chunk_state_kernel (H200, T = 16k, bench/results/kda_prefill_ab.jsonl): at H = 96 537 against
// 666 us (96 CTAs: one wave instead of 192 CTAs in two), at H = 32 463 against 306 (32 CTAs on 32 SMs); a CTA per
// value slice of this pass was no faster than kda_chunk_state_kernel (311 against 306 us at H = 32), nor was
// leaving the output products running into the next chunk (298 against 296 us, commit 594b380). Two chains on
// one SM take 1.8 times as long a chunk as one.

// D[64 x 64] += A[64 x 16] · B, A in registers (four bf16x2: the m64k16 fragment), B K-major from shared memory.
__device__ __forceinline__ void wgmma_rs_m64n64k16(float (&d)[32], const uint32_t* a, uint64_t desc_b) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" DS_SM90_REGS32
      "}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n"
      "}\n"
      : DS_SM90_ACC32("+f", d, 0)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
}

// D[64 x 64] = A[64 x 16] · B (the first k16 step of a product), A in registers, B K-major. D is output-only
// here: with "+f" the accumulators' undefined old values would be inputs, which ptxas may place in registers of
// a running wgmma and then wait for it.
__device__ __forceinline__ void wgmma_rs_m64n64k16_first(float (&d)[32], const uint32_t* a, uint64_t desc_b) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, 0, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" DS_SM90_REGS32
      "}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n"
      "}\n"
      : DS_SM90_ACC32("=f", d, 0)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
}

// D[64 x 128] += A[64 x 16] · B, A in registers, B MN-major from shared memory (two 64-column blocks, desc_mn_major).
__device__ __forceinline__ void wgmma_rs_m64n128k16_mn(float (&d)[64], const uint32_t* a, uint64_t desc_b) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" DS_SM90_REGS64
      "}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n"
      "}\n"
      : DS_SM90_ACC64("+f", d, 0)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
}

// The pass per head: a CTA of two warpgroups per (head, sequence), warpgroup wg the value columns [64 wg, +64), both
// reading one stage of the chunk's factors (its whole workspace block, one bulk copy).
constexpr int kStateHeadThreads = 256;
constexpr size_t kStateHeadStageStride = (kChunkBytes + 1023) / 1024 * 1024;
constexpr int kStateHeadStages = 2;  // what fits: chunk c + 1 lands while c runs
constexpr int kLdO = kStateBv + 8;   // bf16 row stride of a staged output tile (conflict-free writes)
constexpr size_t kOTileBytes = size_t{kC} * kLdO * 2;
constexpr size_t kStateHeadSmem =
    1024 + kStateHeadStages * kStateHeadStageStride + 4 * kOTileBytes + kStateHeadStages * sizeof(uint64_t);
static_assert(kStateHeadSmem <= 227 * 1024, "the state pass per head must fit one SM's shared memory");

__global__ void __launch_bounds__(kStateHeadThreads, 1) kda_chunk_state_head_kernel(StateArgs p) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024u - (smem_address(smem_raw) & 1023u)) & 1023u);  // as kda_chunk_state_kernel
  const int H = p.num_heads;
  const int h = blockIdx.y, sequence = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = (tid >> 5) & 3, wg = tid >> 7;
  const int slice = wg;
  const int wg_tid = tid & 127;
  const SequenceEntry seq = p.sequences[sequence];
  // Two output tiles [64 tokens][kLdO] per warpgroup (double-buffered: chunk c's tile is copied out after the
  // barrier while chunk c + 1 writes the other one).
  bf16* o_tiles = reinterpret_cast<bf16*>(smem + kStateHeadStages * kStateHeadStageStride) + wg * 2 * (kC * kLdO);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kStateHeadStages * kStateHeadStageStride + 4 * kOTileBytes);
  auto stage_base = [&](int stage) { return smem + stage * kStateHeadStageStride; };
  const size_t cta = static_cast<size_t>(sequence) * H + h;
  if (p.rerun != 0 && p.fallback[cta] == 0) return;  // the overlapped launch did this (head, sequence)
  const unsigned int* flags = p.rerun != 0 ? nullptr : p.flags;
  // Thread 0. False only when the first chunk's flag did not come within wait_ns (nothing issued).
  auto load_stage = [&](int chunk_index) {
    const int stage = chunk_index % kStateHeadStages;
    const size_t item = static_cast<size_t>(seq.first_chunk + chunk_index) * H + h;
    const uint8_t* src = p.data + item * kChunkBytes;
    if (flags != nullptr) {
      const uint64_t deadline = chunk_index == 0 ? sm90::globaltimer_ns() + p.wait_ns : ~uint64_t{0};
      unsigned int ready = 0;
      for (;;) {
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(ready) : "l"(flags + item) : "memory");
        if (ready != 0) break;
        if (sm90::globaltimer_ns() >= deadline) return false;  // once one chunk came, the prep runs: the rest will
        __nanosleep(64);
      }
      fence_proxy_async_global();  // the block was written with ordinary stores; the bulk copy reads it
    }
    const uint32_t bar = smem_address(&full[stage]);
    const uint32_t dst = smem_address(stage_base(stage));
    sm90::mbarrier_arrive_expect_tx(bar, static_cast<uint32_t>(kChunkBytes));
    bulk_copy_to_shared(dst, src, static_cast<uint32_t>(kChunkBytes), bar);  // the whole block, both u slices
    return true;
  };
  const size_t u_offset = kOffU + slice * kUSliceBytes;
  // The staged output tile of the chunk starting at token `first`, its first `rows` rows, to global memory.
  auto store_output = [&](const bf16* tile, int first, int rows) {
    const int row0 = wg_tid >> 3, part = wg_tid & 7;
    uint4 value[4];
#pragma unroll
    for (int step = 0; step < 4; ++step) {
      value[step] = *reinterpret_cast<const uint4*>(tile + (16 * step + row0) * kLdO + part * 8);
    }
#pragma unroll
    for (int step = 0; step < 4; ++step) {
      const int row = 16 * step + row0;
      if (row < rows) {
        const size_t at =
            (static_cast<size_t>(seq.token_begin + first + row) * H + h) * kD + slice * kStateBv + part * 8;
        *reinterpret_cast<uint4*>(p.o + at) = value[step];
      }
    }
  };

  // Accumulator coordinates (wgmma layout): register i holds row acc_row(i) and column acc_col(i) of the m64 tile.
  // Rows are value columns of the slice; columns are keys (S^T) or tokens (X, Y, v_new^T).
  const int row0 = 16 * warp + (lane >> 2), col0 = 2 * (lane & 3);
  auto acc_row = [&](int i) { return row0 + 8 * ((i % 4) / 2); };
  auto acc_col = [&](int i) { return 8 * (i / 4) + col0 + (i & 1); };
  const size_t state_offset = (static_cast<size_t>(sequence) * H + h) * kD * kD + slice * kStateBv;
  float s[64];  // S^T: s[i] = S[key acc_col(i)][value acc_row(i)]
#pragma unroll
  for (int i = 0; i < 64; ++i) {
    s[i] = p.initial_state != nullptr ? p.initial_state[state_offset + acc_col(i) * kD + acc_row(i)] : 0.0f;
  }
  auto store_state = [&](float* base) {
#pragma unroll
    for (int i = 0; i < 64; ++i) base[acc_col(i) * kD + acc_row(i)] = s[i];
  };
  uint32_t sa[32];  // S^T as bf16 A fragments: k16 step j (keys 16 j ..) in sa[4 j .. 4 j + 3]
  auto pack_state = [&] {
#pragma unroll
    for (int i = 0; i < 64; i += 2) sa[i / 2] = pack_bf16(s[i], s[i + 1]);
  };
  pack_state();

  if (flags != nullptr) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");  // the prep beside it
  __shared__ int gave_up;
  if (tid == 0) {
    for (int stage = 0; stage < kStateHeadStages; ++stage) sm90::mbarrier_init(smem_address(&full[stage]), 1);
    sm90::mbarrier_init_fence();
    fence_proxy_async_global();  // the workspace was written by the prep grid with ordinary stores
    bool issued = true;
    for (int c = 0; c < min(kStateHeadStages - 1, seq.num_chunks); ++c) issued = issued && load_stage(c);
    gave_up = issued ? 0 : 1;
  }
  __syncthreads();
  if (gave_up != 0) {  // nothing read or written yet: the rerun after the prep does this (head, sequence)
    if (tid == 0) p.fallback[cta] = 1;
    return;
  }

  for (int ci = 0; ci < seq.num_chunks; ++ci) {
    const int stage = ci % kStateHeadStages;
    // The stage of chunk ci - 1 was released by the barrier at the end of it.
    if (tid == 0 && ci + kStateHeadStages - 1 < seq.num_chunks) load_stage(ci + kStateHeadStages - 1);
    const uint32_t base = smem_address(stage_base(stage));
    sm90::mbarrier_wait(smem_address(&full[stage]), static_cast<uint32_t>((ci / kStateHeadStages) & 1));
    const int chunk_first = ci * kC;
    const int tokens = min(kC, seq.length - chunk_first);

    // X = S^T w^T; meanwhile u^T and the decayed state.
    float x[32];
    sm90::wgmma_fence();
    wgmma_rs_m64n64k16_first(x, &sa[0], desc_k_major(base + static_cast<uint32_t>(kOffW), 0));
#pragma unroll
    for (int j = 1; j < kD / 16; ++j) {
      wgmma_rs_m64n64k16(x, &sa[4 * j], desc_k_major(base + static_cast<uint32_t>(kOffW), j));
    }
    sm90::wgmma_commit_group();
    if (ci > 0) store_output(o_tiles + ((ci - 1) & 1) * (kC * kLdO), chunk_first - kC, kC);
    const uint16_t* u = reinterpret_cast<const uint16_t*>(stage_base(stage) + u_offset);
    uint32_t uv[16];  // u^T (token acc_col(i), value acc_row(i)), two tokens a register
#pragma unroll
    for (int i = 0; i < 32; i += 2) {
      uv[i / 2] = static_cast<uint32_t>(u[acc_col(i) * kLdU + acc_row(i)]) |
                  (static_cast<uint32_t>(u[acc_col(i + 1) * kLdU + acc_row(i)]) << 16);
    }
    const float* decay = reinterpret_cast<const float*>(stage_base(stage) + kOffDecay);
    float2 d[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) d[i] = *reinterpret_cast<const float2*>(decay + 8 * i + col0);
    sm90::wgmma_wait_group<0>();
    sm90::wgmma_fence_registers(x);
    // S^T ⊙ e^gc_last (the keys are columns); v_new^T = u^T - X as bf16 A fragments (k16 step j: tokens 16 j ..).
    // (Touching s while X runs would make ptxas wait for X there anyway.)
#pragma unroll
    for (int i = 0; i < 64; i += 4) {
      s[i] *= d[i / 4].x;
      s[i + 1] *= d[i / 4].y;
      s[i + 2] *= d[i / 4].x;
      s[i + 3] *= d[i / 4].y;
    }
    uint32_t vn[16];
#pragma unroll
    for (int i = 0; i < 32; i += 2) {
      const __nv_bfloat162 u2 = *reinterpret_cast<const __nv_bfloat162*>(&uv[i / 2]);
      vn[i / 2] = pack_bf16(__low2float(u2) - x[i], __high2float(u2) - x[i + 1]);
    }
    // The update S^T += v_new^T (k e^(gc_last - gc)), then the output o^T = S^T (q e^gc)^T + v_new^T Aqk^T with the
    // chunk's first state (sa), one group.
    float y[32];
    sm90::wgmma_fence();
#pragma unroll
    for (int j = 0; j < kC / 16; ++j) {
      wgmma_rs_m64n128k16_mn(s, &vn[4 * j], desc_mn_major(base + static_cast<uint32_t>(kOffKg), j));
    }
    wgmma_rs_m64n64k16_first(y, &sa[0], desc_k_major(base + static_cast<uint32_t>(kOffQg), 0));
#pragma unroll
    for (int j = 1; j < kD / 16; ++j) {
      wgmma_rs_m64n64k16(y, &sa[4 * j], desc_k_major(base + static_cast<uint32_t>(kOffQg), j));
    }
#pragma unroll
    for (int j = 0; j < kC / 16; ++j) {
      wgmma_rs_m64n64k16(y, &vn[4 * j], desc_k_major(base + static_cast<uint32_t>(kOffAqk), j));
    }
    sm90::wgmma_commit_group();
    sm90::wgmma_wait_group<0>();
    sm90::wgmma_fence_registers(s);
    sm90::wgmma_fence_registers(y);
    pack_state();
    if (p.checkpoint_interval > 0 && tokens == kC && (chunk_first + kC) % p.checkpoint_interval == 0) {
      const int entry = seq.checkpoint_first + (chunk_first + kC) / p.checkpoint_interval - 1;
      store_state(p.checkpoint_states + (static_cast<size_t>(entry) * H + h) * kD * kD + slice * kStateBv);
    }
    bf16* tile = o_tiles + (ci & 1) * (kC * kLdO);
#pragma unroll
    for (int i = 0; i < 32; ++i) tile[acc_col(i) * kLdO + acc_row(i)] = __float2bfloat16_rn(y[i]);
    __syncthreads();  // the tile is complete; every product of this stage has finished (it takes a later chunk)
  }
  if (seq.num_chunks > 0) {
    const int last_first = (seq.num_chunks - 1) * kC;
    store_output(o_tiles + ((seq.num_chunks - 1) & 1) * (kC * kLdO), last_first, seq.length - last_first);
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

// The state pass for `requested` (KdaPrefillParams::state_pass): kAuto takes DELTASERVE_KDA_STATE_PASS=
// slice|head|overlap when set; the overlapped pass falls back to kAuto's choice where its CTAs would not all be
// resident beside the prep. Otherwise a CTA per head when the 2 H CTAs a sequence of the pass per slice would not all
// be resident at once (one CTA an SM): measured on the H200 at H = 96 the pass per head takes 537 against 666 us (T =
// 16k), at H = 32 463 against 306 (its 32 CTAs leave most SMs idle).
KdaStatePass choose_state_pass(KdaStatePass requested, int num_heads, int64_t sequences, int64_t items) {
  static const KdaStatePass environment = [] {
    const char* value = std::getenv("DELTASERVE_KDA_STATE_PASS");
    if (value != nullptr && std::strcmp(value, "slice") == 0) return KdaStatePass::kPerSlice;
    if (value != nullptr && std::strcmp(value, "head") == 0) return KdaStatePass::kPerHead;
    if (value != nullptr && std::strcmp(value, "overlap") == 0) return KdaStatePass::kPerHeadOverlapped;
    return KdaStatePass::kAuto;
  }();
  if (requested == KdaStatePass::kAuto) requested = environment;
  if (requested == KdaStatePass::kPerSlice || requested == KdaStatePass::kPerHead) return requested;
  int device = 0, sms = 0;  // of the current device: a process may drive GPUs of different kinds
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return KdaStatePass::kPerSlice;
  }
  // The overlapped pass's state CTAs spin on the prep's flags, so every one of them must be resident beside the
  // prep: at most half the SMs (one CTA an SM), the rest for the prep; its prep grid is 1-D.
  if (requested == KdaStatePass::kPerHeadOverlapped && static_cast<int64_t>(num_heads) * sequences * 2 <= sms &&
      items <= 0x7fffffff) {
    return requested;
  }
  return 2 * num_heads > sms ? KdaStatePass::kPerHead : KdaStatePass::kPerSlice;
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
  const size_t items = static_cast<size_t>(chunks) * static_cast<size_t>(num_heads);
  return align256(static_cast<size_t>(chunks) * sizeof(ChunkEntry)) + align256(sequences * sizeof(SequenceEntry)) +
         items * kChunkBytes +
         align256((items + 1 + sequences * static_cast<size_t>(num_heads)) * sizeof(unsigned int));  // flags
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
  if (p.overlap_wait_us < 0) {
    return invalid_argument("kda_chunk_prefill: overlap_wait_us must be >= 0, got " +
                            std::to_string(p.overlap_wait_us));
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
    e = cudaFuncSetAttribute(kda_chunk_state_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(kStateSmem));
    if (e != cudaSuccess) return e;
    return cudaFuncSetAttribute(kda_chunk_state_head_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                static_cast<int>(kStateHeadSmem));
  }();
  DS_RETURN_IF_ERROR(cuda_status(attributes, "kda_chunk_prefill: shared memory attributes"));

  const size_t items = static_cast<size_t>(chunks) * static_cast<size_t>(p.num_heads);
  const KdaStatePass pass = choose_state_pass(p.state_pass, p.num_heads, sequences, static_cast<int64_t>(items));
  // The overlapped pass's flags [items], done counter, fallback markers [sequences * H].
  auto* flags = reinterpret_cast<unsigned int*>(data + items * kChunkBytes);
  const size_t flag_words = items + 1 + static_cast<size_t>(sequences) * static_cast<size_t>(p.num_heads);
  StateArgs state{p.num_heads,
                  sequence_device,
                  data,
                  p.initial_state,
                  p.final_state,
                  p.checkpoint_interval,
                  p.checkpoint_states,
                  p.o,
                  nullptr,
                  nullptr,
                  0,
                  0};
  const dim3 state_grid(kD / kStateBv, static_cast<unsigned>(p.num_heads), static_cast<unsigned>(sequences));
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
                data,
                nullptr,
                nullptr,
                0};
  if (pass == KdaStatePass::kPerHeadOverlapped && chunks > 0) {
    // State pass first (its CTAs let the prep start at once), then the prep as its programmatic dependent.
    DS_RETURN_IF_ERROR(
        cuda_status(cudaMemsetAsync(flags, 0, flag_words * sizeof(unsigned int), stream), "kda_chunk_prefill: flags"));
    state.flags = flags;
    state.fallback = flags + items + 1;
    state.wait_ns = static_cast<unsigned long long>(p.overlap_wait_us) * 1000ull;
    kda_chunk_state_head_kernel<<<dim3(1, state_grid.y, state_grid.z), kStateHeadThreads, kStateHeadSmem, stream>>>(
        state);
    DS_RETURN_IF_ERROR(cuda_status(cudaGetLastError(), "kda_chunk_prefill: state launch"));
    prep.flags = flags;
    prep.done = flags + items;
    prep.total_items = static_cast<unsigned int>(items);
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(static_cast<unsigned>(items));
    config.blockDim = dim3(kPrepThreads);
    config.dynamicSmemBytes = kPrepSmem;
    config.stream = stream;
    cudaLaunchAttribute attribute{};
    attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute.val.programmaticStreamSerializationAllowed = 1;
    config.attrs = &attribute;
    config.numAttrs = 1;
    DS_RETURN_IF_ERROR(
        cuda_status(cudaLaunchKernelEx(&config, kda_chunk_prep_kernel, prep), "kda_chunk_prefill: prep launch"));
    // After the prep: the (head, sequence) CTAs that gave up waiting, if any (the others return at once).
    state.rerun = 1;
    kda_chunk_state_head_kernel<<<dim3(1, state_grid.y, state_grid.z), kStateHeadThreads, kStateHeadSmem, stream>>>(
        state);
    return cuda_status(cudaGetLastError(), "kda_chunk_prefill: state rerun launch");
  }
  if (chunks > 0) {
    kda_chunk_prep_kernel<<<dim3(static_cast<unsigned>(chunks), static_cast<unsigned>(p.num_heads)), kPrepThreads,
                            kPrepSmem, stream>>>(prep);
    DS_RETURN_IF_ERROR(cuda_status(cudaGetLastError(), "kda_chunk_prefill: prep launch"));
  }
  if (pass != KdaStatePass::kPerSlice) {
    kda_chunk_state_head_kernel<<<dim3(1, state_grid.y, state_grid.z), kStateHeadThreads, kStateHeadSmem, stream>>>(
        state);
  } else {
    kda_chunk_state_kernel<<<state_grid, kStateThreads, kStateSmem, stream>>>(state);
  }
  return cuda_status(cudaGetLastError(), "kda_chunk_prefill: state launch");
}

}  // namespace deltaserve::kernels::cuda
