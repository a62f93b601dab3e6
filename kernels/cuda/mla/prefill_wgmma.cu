// MLA prefill, naive form, step 3 on Hopper: flash attention of 128 queries of one head per CTA with warpgroup MMA
// (wgmma) and TMA. The same attention as prefill.cu's mma.sync kernel: same inputs (the
// decompressed K_nope / V block and the gathered rows' k_rot in the workspace, the queries), the same online-softmax
// state carried across key blocks (unnormalised O in `out`, the (max, sum) pair per (token, head)), the same causal
// rule (query i of a sequence sits at position context - q_len + i and sees keys at positions <= it).
//
// CTA: 3 warpgroups (384 threads), one CTA per SM (~209 KB shared memory), grid ordered like the mma.sync kernel's
// (last, heaviest query tiles of every head first).
//   producer (warpgroup 2; one thread works, the warpgroup gives its registers to the consumers): TMA loads of 128-key
//   tiles into a 2-stage ring, K and V each with a "full" and an
//     "empty" mbarrier per stage, issued in the order K0, K1, V0, K2, V1, ... (the consumers need tile j's K one
//     step before its V). K tile = [K_nope: 2 boxes of 64 columns of the kv workspace | k_rot: 1 box of the gathered
//     rows], V tile = 2 boxes; each box 128 rows x 128 bytes with the 128-byte swizzle; rows past the block are
//     zero-filled by TMA (the tensor maps end at the block's last row), so NaN-poisoned workspace never enters.
//   2 consumer warpgroups (warps 0-3 and 4-7), 64 query rows each; Q [128, 192] written to shared memory once.
//     S = Q Kᵀ: 12 wgmma m64n128k16 per tile (A = Q, B = K tile, both K-major in shared memory), fp32 S in
//       registers; online softmax in registers, base 2 (scale folded into one FFMA before ex2); row max / sum over
//       the 4 threads holding a row (2 shuffles each).
//     O += P V: P rounded to bf16 in registers is the A operand as it lies (accumulator layout = A-fragment
//       layout), B = V tile [keys, 128], MN-major for this product (transpose flag): 8 wgmma m64n128k16; fp32 O.
//     Intra-warpgroup pipelining (as in FlashAttention-3): tile j's scores are issued before P V of tile j-1, so
//       the softmax of tile j overlaps the tensor cores' P V. The two warpgroups also take turns issuing their MMAs
//       (named barriers, "ping-pong"), so one's softmax overlaps the other's MMAs.
// Key tiles are walked from the last one the CTA needs (the causal diagonal) down to the first; tiles wholly past
// the CTA's last query are never loaded; only tiles that reach past the block or past a warpgroup's first row's
// position are masked (-inf). Both warpgroups walk the same tiles (the ping-pong turns need equal counts), so the
// first one may run one all-masked diagonal tile (exact: it leaves the state unchanged).
//
// Registers per consumer thread: O 64 + S 64 + P 32 (+ state and addresses), more than the 168 that 384 threads get
// at launch: the producer warpgroup drops to kProducerRegisters and the consumers rise to kConsumerRegisters
// (setmaxnreg; 40 + 2 x 232 = 504 of each SM sub-partition's 512 per lane).
// FLOPs per tile per warpgroup: 2 * 64 * 128 * (192 + 128) = 5.2 M on the tensor cores, 64 ex2 per thread.
#include <cmath>
#include <string>

#include <cuda.h>
#include <cudaTypedefs.h>

#include "kernels/cuda/common/detail/mma_sm80.cuh"
#include "kernels/cuda/common/launch_status.hpp"
#include "kernels/cuda/common/tensor_map.hpp"
#include "kernels/cuda/mla/detail/prefill_wgmma.hpp"
#include "kernels/cuda/mla/detail/sm90_attention.cuh"

namespace deltaserve::kernels::cuda::detail {
namespace {

constexpr int kNope = 128, kRope = 64, kVHead = 128;
constexpr int kQk = kNope + kRope;
constexpr int kQTile = 128;  // queries per CTA (2 warpgroups x 64 rows)
constexpr int kKTile = 128;  // keys per pipeline stage
constexpr int kStages = 2;
constexpr int kConsumerWarps = 8;
constexpr int kThreads = (kConsumerWarps + 4) * 32;  // + the producer warpgroup
constexpr int kProducerRegisters = 40;
constexpr int kConsumerRegisters = 232;
constexpr int kChunkCols = 64;                   // bf16 columns of one 128-byte swizzled box / tile chunk
constexpr int kKChunks = kQk / kChunkCols;       // 3: K_nope 0..63, K_nope 64..127, k_rot
constexpr int kNopeChunks = kNope / kChunkCols;  // 2 (the rest come from the rows' k_rot)
constexpr int kVChunks = kVHead / kChunkCols;    // 2
constexpr uint32_t kRowBytes = 128;
constexpr uint32_t kQChunkBytes = kQTile * kRowBytes;  // 16 KB
constexpr uint32_t kKChunkBytes = kKTile * kRowBytes;  // 16 KB (one TMA box)
constexpr uint32_t kQBytes = kKChunks * kQChunkBytes;  // 48 KB
constexpr uint32_t kKBytes = kKChunks * kKChunkBytes;  // 48 KB per stage
constexpr uint32_t kVBytes = kVChunks * kKChunkBytes;  // 32 KB per stage
constexpr uint32_t kKOffset = kQBytes;
constexpr uint32_t kVOffset = kKOffset + kStages * kKBytes;
constexpr uint32_t kBarrierOffset = kVOffset + kStages * kVBytes;
constexpr uint32_t kGaveUpOffset = kBarrierOffset + 4 * kStages * sizeof(uint64_t);  // int: a wait timed out
constexpr size_t kSmemBytes = kGaveUpOffset + 16 + 1024;                             // + 1024: base alignment
// Named barriers (0 is __syncthreads): kTurnBarrier + w: warpgroup w's turn to issue MMAs (ping-pong);
// kQBarrier + w: warpgroup w's Q rows written.
constexpr int kTurnBarrier = 1;
constexpr int kQBarrier = 3;
static_assert(kQTile == 2 * 64 && kConsumerWarps == 8, "two consumer warpgroups of 64 query rows");
static_assert(kSmemBytes <= 227 * 1024, "shared memory of one CTA per SM");

__global__ void __launch_bounds__(kThreads, 1)
    mla_wgmma_prefill_kernel(const __grid_constant__ CUtensorMap kv_map, const __grid_constant__ CUtensorMap rows_map,
                             const MlaWgmmaBlock a) {
  extern __shared__ unsigned char smem_raw[];
  // 1024-byte aligned base: the 128-byte swizzle repeats every 1024 bytes and both TMA (writing) and wgmma (reading)
  // apply it to the shared-memory address bits, so every tile chunk starts on that boundary.
  unsigned char* smem = smem_raw + ((1024u - (smem_address(smem_raw) & 1023u)) & 1023u);
  const uint32_t smem_base = smem_address(smem);
  uint64_t* full_k = reinterpret_cast<uint64_t*>(smem + kBarrierOffset);  // [kStages]: K tile landed
  uint64_t* full_v = full_k + kStages;                                    // [kStages]: V tile landed
  uint64_t* empty_k = full_v + kStages;  // [kStages]: every consumer warp is done with the K tile
  uint64_t* empty_v = empty_k + kStages;
  volatile int* gave_up = reinterpret_cast<volatile int*>(smem + kGaveUpOffset);  // see sm90::mbarrier_wait

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int64_t tiles = (a.q_len + kQTile - 1) / kQTile;
  const int h = static_cast<int>(blockIdx.x % static_cast<unsigned>(a.num_heads));
  const int64_t tile = tiles - 1 - static_cast<int64_t>(blockIdx.x / static_cast<unsigned>(a.num_heads));
  const int64_t i0 = tile * kQTile;
  if (tile < 0 || a.q_len - i0 <= 0) return;  // CTA-uniform
  const int q_count = static_cast<int>(a.q_len - i0 < kQTile ? a.q_len - i0 : kQTile);
  const int64_t first_position = a.context - a.q_len + i0;  // position of the tile's query 0
  // Keys of this block the tile needs: up to its last query's position.
  const int64_t last_needed = first_position + q_count - 1 - a.block_begin;  // block-local index
  const int64_t needed = last_needed + 1 < a.block_rows ? last_needed + 1 : a.block_rows;
  const int num_tiles = needed > 0 ? static_cast<int>((needed + kKTile - 1) / kKTile) : 0;

  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      sm90::mbarrier_init(&full_k[s], 1);  // the producer's arrive.expect_tx (+ the TMA bytes)
      sm90::mbarrier_init(&full_v[s], 1);
      sm90::mbarrier_init(&empty_k[s], kConsumerWarps);  // one arrival per consumer warp
      sm90::mbarrier_init(&empty_v[s], kConsumerWarps);
    }
    sm90::fence_mbarrier_init();
    *gave_up = 0;
  }
  __syncthreads();  // the last CTA-wide barrier: the producer warpgroup leaves early

  // ---- producer ----
  if (warp >= kConsumerWarps) {
    sm90::warpgroup_registers_decrease<kProducerRegisters>();
    if (warp == kConsumerWarps && lane == 0 && num_tiles > 0) {
      sm90::tma_prefetch_descriptor(&kv_map);
      sm90::tma_prefetch_descriptor(&rows_map);
      const int head_column = h * (a.nope + a.v_head);
      // Step j holds key tile num_tiles - 1 - j in stage j % kStages (that stage's use j / kStages).
      auto load_k = [&](int j) {
        const int stage = j % kStages;
        sm90::mbarrier_wait(&empty_k[stage], ((j / kStages) & 1) ^ 1, gave_up);
        sm90::mbarrier_arrive_expect_tx(&full_k[stage], kKBytes);
        const int key0 = (num_tiles - 1 - j) * kKTile;
        unsigned char* dst = smem + kKOffset + stage * kKBytes;
#pragma unroll
        for (int c = 0; c < kNopeChunks; ++c) {
          sm90::tma_load_2d(dst + c * kKChunkBytes, &kv_map, &full_k[stage], head_column + c * kChunkCols, key0);
        }
        sm90::tma_load_2d(dst + kNopeChunks * kKChunkBytes, &rows_map, &full_k[stage], a.kv_lora, key0);
      };
      auto load_v = [&](int j) {
        const int stage = j % kStages;
        sm90::mbarrier_wait(&empty_v[stage], ((j / kStages) & 1) ^ 1, gave_up);
        sm90::mbarrier_arrive_expect_tx(&full_v[stage], kVBytes);
        const int key0 = (num_tiles - 1 - j) * kKTile;
        unsigned char* dst = smem + kVOffset + stage * kVBytes;
#pragma unroll
        for (int c = 0; c < kVChunks; ++c) {
          sm90::tma_load_2d(dst + c * kKChunkBytes, &kv_map, &full_v[stage], head_column + a.nope + c * kChunkCols,
                            key0);
        }
      };
      load_k(0);
      for (int j = 1; j < num_tiles; ++j) {
        load_k(j);
        load_v(j - 1);
      }
      load_v(num_tiles - 1);
    }
    return;
  }

  // ---- consumers ----
  sm90::warpgroup_registers_increase<kConsumerRegisters>();
  const int wg = warp >> 2;  // consumer warpgroup: CTA query rows 64 wg .. 64 wg + 63
  const int g = lane >> 2, t = lane & 3;
  const int row0 = wg * 64 + (warp & 3) * 16 + g;  // CTA row of accumulator elements 4i, 4i+1 (row0 + 8: 4i+2, 4i+3)

  // This warpgroup's Q rows -> shared memory in the swizzled layout TMA would write (zeros past the queries).
  {
    const __nv_bfloat16* q_head = a.q + static_cast<int64_t>(h) * kQk;
    constexpr int kUnits = kQk / 8;  // 16-byte units of a row
    for (int e = tid & 127; e < 64 * kUnits; e += 128) {
      const int r = wg * 64 + e / kUnits, u = e % kUnits;
      uint4 x = make_uint4(0u, 0u, 0u, 0u);
      if (r < q_count) x = __ldg(reinterpret_cast<const uint4*>(q_head + (a.q_begin + i0 + r) * a.q_stride + u * 8));
      *reinterpret_cast<uint4*>(smem + (u / 8) * kQChunkBytes + r * kRowBytes + (((u % 8) ^ (r & 7)) << 4)) = x;
    }
    sm90::fence_proxy_async_shared();  // generic-proxy writes -> wgmma's (async proxy) reads
    sm90::named_barrier_sync(kQBarrier + wg, 128);
  }

  // Running state of rows row0 and row0 + 8: O (accumulator layout), max (log2 units), this thread's partial sum.
  float o[64];
  float m_run[2], l_run[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + 8 * r;
    const bool carried = !a.first && row < q_count;
    const int64_t token = a.q_begin + i0 + row;
    m_run[r] = -INFINITY;
    l_run[r] = 0.0f;
    if (carried) {
      const float2 ml = a.ml[token * a.num_heads + h];
      m_run[r] = ml.x;
      l_run[r] = t == 0 ? ml.y : 0.0f;
    }
    const float* src = a.out + (token * a.num_heads + h) * kVHead;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const float2 v = carried ? *reinterpret_cast<const float2*>(src + 8 * i + 2 * t) : make_float2(0.0f, 0.0f);
      o[4 * i + 2 * r] = v.x;
      o[4 * i + 2 * r + 1] = v.y;
    }
  }

  const uint32_t q_base = smem_base + wg * 64 * kRowBytes;
  // S = Q Kᵀ over the 3 chunks x 4 k-steps of 16 (a k-step is 32 bytes into the swizzled 128-byte rows).
  auto issue_scores = [&](float(&s)[64], int stage) {
    const uint32_t k_base = smem_base + kKOffset + stage * kKBytes;
#pragma unroll
    for (int c = 0; c < kKChunks; ++c) {
#pragma unroll
      for (int k = 0; k < kChunkCols / 16; ++k) {
        const uint64_t a_desc = sm90::smem_descriptor_sw128(q_base + c * kQChunkBytes + k * 32, 16, 1024);
        const uint64_t b_desc = sm90::smem_descriptor_sw128(k_base + c * kKChunkBytes + k * 32, 16, 1024);
        sm90::wgmma_m64n128k16_ss(s, a_desc, b_desc, (c | k) != 0 ? 1 : 0);
      }
    }
  };
  // O += P V over the tile's 8 k-steps of 16 keys (16 rows of 128 bytes each; the second 64 V columns lie one box,
  // kKChunkBytes, further: the descriptor's leading byte offset).
  auto issue_pv = [&](const uint32_t(&p)[32], int stage) {
    const uint32_t v_base = smem_base + kVOffset + stage * kVBytes;
#pragma unroll
    for (int k = 0; k < kKTile / 16; ++k) {
      const uint64_t b_desc = sm90::smem_descriptor_sw128(v_base + k * 16 * kRowBytes, kKChunkBytes, 1024);
      sm90::wgmma_m64n128k16_rs_b_mn_major(o, p[4 * k], p[4 * k + 1], p[4 * k + 2], p[4 * k + 3], b_desc, 1);
    }
  };
  // Masks key tile kt's scores (block-local tile index) and folds them into the running max / sum: s becomes P
  // (fp32), correction[r] the factor the O of row half r needs.
  auto softmax = [&](float(&s)[64], int kt, float(&correction)[2]) {
    const int64_t key0 = static_cast<int64_t>(kt) * kKTile;
    // Warpgroup-uniform: keys past the block, or past the position of the warpgroup's first row.
    if (key0 + kKTile > a.block_rows || a.block_begin + key0 + kKTile - 1 > first_position + wg * 64) {
#pragma unroll
      for (int i = 0; i < 16; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int64_t local = key0 + 8 * i + 2 * t + (e & 1);
          const int64_t position = first_position + row0 + 8 * (e >> 1);
          if (local >= a.block_rows || a.block_begin + local > position) s[4 * i + e] = -INFINITY;
        }
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx0 = -INFINITY, mx1 = -INFINITY;  // two chains for latency
#pragma unroll
      for (int i = 0; i < 16; i += 2) {
        mx0 = fmaxf(mx0, fmaxf(s[4 * i + 2 * r], s[4 * i + 2 * r + 1]));
        mx1 = fmaxf(mx1, fmaxf(s[4 * i + 4 + 2 * r], s[4 * i + 4 + 2 * r + 1]));
      }
      float mx = fmaxf(mx0, mx1);
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m_run[r], mx * a.scale_log2);
      const float m_use = m_new == -INFINITY ? 0.0f : m_new;  // a row with nothing visible yet: all p = 0
      correction[r] = sm90::exp2_approx(m_run[r] - m_use);
      m_run[r] = m_new;
      float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const float p0 = sm90::exp2_approx(fmaf(s[4 * i + 2 * r], a.scale_log2, -m_use));
        const float p1 = sm90::exp2_approx(fmaf(s[4 * i + 2 * r + 1], a.scale_log2, -m_use));
        s[4 * i + 2 * r] = p0;
        s[4 * i + 2 * r + 1] = p1;
        sum0 += p0;
        sum1 += p1;
      }
      l_run[r] = l_run[r] * correction[r] + (sum0 + sum1);
    }
  };
  auto rescale = [&](const float(&correction)[2]) {
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      o[4 * i] *= correction[0];
      o[4 * i + 1] *= correction[0];
      o[4 * i + 2] *= correction[1];
      o[4 * i + 3] *= correction[1];
    }
  };
  auto pack = [&](const float(&s)[64], uint32_t(&p)[32]) {
#pragma unroll
    for (int j = 0; j < 32; ++j) p[j] = pack_bf16(s[2 * j], s[2 * j + 1]);
  };
  // One arrival per warp once its wgmma reads of the stage are complete (after its wgmma_wait).
  auto release = [&](uint64_t* barrier) {
    if (lane == 0) sm90::mbarrier_arrive(barrier);
  };

  const int my_turn = kTurnBarrier + wg, other_turn = kTurnBarrier + (wg ^ 1);
  float s[64];
  uint32_t p[32];
  float correction[2];
#pragma unroll
  for (int i = 0; i < 64; ++i) s[i] = 0.0f;
  if (num_tiles > 0) {
    // Ping-pong turns: warpgroup w syncs on its barrier before issuing MMAs and arrives on the other's
    // after. Warpgroup 1 opens with an arrival (0 goes first) and skips the arrival of its last turn (the final
    // P V), so both barriers see as many arrivals as syncs; every conditional sits outside wgmma-in-flight code.
    if (wg == 1) sm90::named_barrier_arrive(kTurnBarrier, 2 * 128);
    // Step 0 (the last key tile): scores only.
    sm90::mbarrier_wait(&full_k[0], 0, gave_up);
    sm90::named_barrier_sync(my_turn, 2 * 128);
    sm90::wgmma_fence_registers(s);
    sm90::wgmma_fence();
    issue_scores(s, 0);
    sm90::wgmma_commit_group();
    sm90::named_barrier_arrive(other_turn, 2 * 128);
    sm90::wgmma_wait_group<0>();
    sm90::wgmma_fence_registers(s);
    release(&empty_k[0]);
    softmax(s, num_tiles - 1, correction);
    rescale(correction);
    pack(s, p);
    // Step j: scores of tile num_tiles - 1 - j, then P V of the previous step's tile (both tiles landed first: a
    // wait between the two issues would make the compiler fence the registers again).
    for (int j = 1; j < num_tiles; ++j) {
      const int stage = j % kStages, previous = (j - 1) % kStages;
      sm90::mbarrier_wait(&full_k[stage], (j / kStages) & 1, gave_up);
      sm90::mbarrier_wait(&full_v[previous], ((j - 1) / kStages) & 1, gave_up);
      sm90::named_barrier_sync(my_turn, 2 * 128);
      sm90::wgmma_fence_registers(s);
      sm90::wgmma_fence_registers(o);
      sm90::wgmma_fence_registers(p);
      sm90::wgmma_fence();
      issue_scores(s, stage);
      sm90::wgmma_commit_group();
      issue_pv(p, previous);
      sm90::wgmma_commit_group();
      sm90::named_barrier_arrive(other_turn, 2 * 128);
      sm90::wgmma_wait_group<1>();  // the scores (P V may still run)
      sm90::wgmma_fence_registers(s);
      release(&empty_k[stage]);
      softmax(s, num_tiles - 1 - j, correction);
      sm90::wgmma_wait_group<0>();  // P V: O and P are free again
      sm90::wgmma_fence_registers(o);
      sm90::wgmma_fence_registers(p);
      release(&empty_v[previous]);
      rescale(correction);
      pack(s, p);
    }
    // P V of the last step's tile.
    const int last = (num_tiles - 1) % kStages;
    sm90::mbarrier_wait(&full_v[last], ((num_tiles - 1) / kStages) & 1, gave_up);
    sm90::named_barrier_sync(my_turn, 2 * 128);
    sm90::wgmma_fence_registers(o);
    sm90::wgmma_fence_registers(p);
    sm90::wgmma_fence();
    issue_pv(p, last);
    sm90::wgmma_commit_group();
    sm90::wgmma_wait_group<0>();
    sm90::wgmma_fence_registers(o);
    if (wg == 0) sm90::named_barrier_arrive(other_turn, 2 * 128);
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = l_run[r];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const int row = row0 + 8 * r;
    if (row >= q_count) continue;
    const int64_t token = a.q_begin + i0 + row;
    float* dst = a.out + (token * a.num_heads + h) * kVHead;
    const float inv = a.last ? (l > 0.0f ? 1.0f / l : 0.0f) : 1.0f;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      *reinterpret_cast<float2*>(dst + 8 * i + 2 * t) = make_float2(o[4 * i + 2 * r] * inv, o[4 * i + 2 * r + 1] * inv);
    }
    if (!a.last && t == 0) a.ml[token * a.num_heads + h] = make_float2(m_run[r], l);
  }
}

// A 2-D bf16 tensor of `rows` rows x `columns` columns (row pitch columns * 2 bytes) read in boxes of kKTile rows x
// 64 columns, 128-byte swizzled; elements past the tensor read as zeros.
bool encode_rows_map(PFN_cuTensorMapEncodeTiled_v12000 encode, CUtensorMap* map, const void* base, uint64_t columns,
                     uint64_t rows) {
  const cuuint64_t dims[2] = {columns, rows};
  const cuuint64_t strides[1] = {columns * sizeof(__nv_bfloat16)};
  const cuuint32_t box[2] = {kChunkCols, kKTile};
  const cuuint32_t element_strides[2] = {1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base), dims, strides, box, element_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace

bool mla_wgmma_prefill_supported(int nope, int rope, int v_head, const void* q, int64_t q_stride) {
  return nope == kNope && rope == kRope && v_head == kVHead && (reinterpret_cast<uintptr_t>(q) & 15u) == 0 &&
         q_stride % 8 == 0;
}

bool mla_wgmma_prefill_ready() {
  if (tensor_map_encoder() == nullptr || !current_device_is_sm90()) return false;
  if (cudaFuncSetAttribute(mla_wgmma_prefill_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(kSmemBytes)) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return true;
}

Status mla_wgmma_prefill_launch(const MlaWgmmaBlock& block, cudaStream_t stream) {
  const std::string who = "mla_prefill (naive, wgmma)";
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr) return internal_error(who + ": no tensor-map encoder (mla_wgmma_prefill_ready is false)");
  if (block.block_rows <= 0 || block.q_len <= 0) return Status::ok();
  CUtensorMap kv_map, rows_map;
  const uint64_t kv_columns = static_cast<uint64_t>(block.num_heads) * (block.nope + block.v_head);
  const uint64_t row_columns = static_cast<uint64_t>(block.kv_lora) + block.rope;
  const uint64_t rows = static_cast<uint64_t>(block.block_rows);
  if (!encode_rows_map(encode, &kv_map, block.kv, kv_columns, rows) ||
      !encode_rows_map(encode, &rows_map, block.rows, row_columns, rows)) {
    return internal_error(who + ": cuTensorMapEncodeTiled failed (" + std::to_string(rows) + " rows of " +
                          std::to_string(kv_columns) + " / " + std::to_string(row_columns) + " columns)");
  }
  const int64_t ctas = (block.q_len + kQTile - 1) / kQTile * block.num_heads;
  mla_wgmma_prefill_kernel<<<static_cast<unsigned>(ctas), kThreads, kSmemBytes, stream>>>(kv_map, rows_map, block);
  return launch_status(who.c_str());
}

}  // namespace deltaserve::kernels::cuda::detail
