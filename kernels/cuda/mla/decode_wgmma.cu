// The absorbed MLA decode's split attention on Hopper warpgroup MMA and TMA (step 2 of decode.cu's file comment,
// between the same absorb and combine kernels, with the same workspace formats as the mma.sync kernel).
//
// One CTA per (query token, context split, group of N = 8, 16 or 32 heads), as the mma.sync kernel, but the products
// are transposed so that the small head count sits on wgmma's N side and nothing is padded:
//   scores  S^T [64 rows x N heads]     = rows [64 x width] · q̃^T          (A: the cache tile, K-major)
//   output  O^T [kv_lora x N heads]    += rows[:, :kv_lora]^T · P^T        (A: the same tile read M-major)
// Roles: a producer warp streams 64-row tiles of the token's slice into a ring of 2 stages by TMA (128-byte swizzled
// boxes of 64 columns x 64 or 16 rows straight from the page pool: one box row group never crosses a page), before
// the wait for the absorb; its nine lanes issue one column block each, and it reads the next tile's page ids while
// waiting for that tile's stage. Both warpgroups load q̃ into shared memory after the wait (every load of a thread
// issued before the first conversion); warpgroup 0 computes S^T, the online softmax (base 2, the per-head maximum
// across its four warps through shared memory), writes P^T (bf16) and the per-head rescale into the stage and hands it
// to warpgroup 1, which rescales its O^T accumulators (kv_lora / 64 blocks of m64) and adds the tile's product, then
// releases the stage to the producer. Warpgroup 0 runs one tile ahead of warpgroup 1. Rows outside the slice or on a
// page id outside the pool are masked out of the softmax and, before warpgroup 1 reads them, zeroed in the stage (their
// TMA box is not issued, or holds rows of the page past the slice). Partials: the same (max, sum) and unnormalised
// latent sums as the mma.sync kernel, for the same combine kernels. Supported: kv_lora 512 and rope 64 (Kimi Linear and
// K3; every loop then has a fixed trip count, which keeps the warpgroup MMAs pipelined), a pool of < 2^31 rows.
// Elsewhere (the tiny test models) mla_decode runs the mma.sync kernel.
#include <algorithm>
#include <string>

#include <cuda.h>
#include <cudaTypedefs.h>

#include "kernels/cuda/common/detail/mma_sm80.cuh"
#include "kernels/cuda/common/launch_status.hpp"
#include "kernels/cuda/common/tensor_map.hpp"
#include "kernels/cuda/mla/detail/attention.cuh"
#include "kernels/cuda/mla/detail/decode_attention.cuh"
#include "kernels/cuda/mla/detail/sm90_attention.cuh"

namespace deltaserve::kernels::cuda::detail {
namespace {

constexpr int kTileRows = 64;
constexpr int kStages = 2;
constexpr int kConsumerThreads = 256;            // warpgroup 0 (scores, softmax), warpgroup 1 (output)
constexpr int kThreads = kConsumerThreads + 32;  // + the producer warp
constexpr int kKvLora = 512, kRope = 64;
constexpr int kWidth = kKvLora + kRope;
constexpr int kMaxColumnBlocks = kWidth / 64;                    // 9
constexpr int kMaxLatentBlocks = kKvLora / 64;                   // 8
constexpr uint32_t kBlockBytes = kTileRows * 128;                // [64 rows][64 bf16], swizzled
constexpr uint32_t kTileBytes = kMaxColumnBlocks * kBlockBytes;  // 73728
constexpr int kBarScorer = 1;                                    // named barriers; id 0 is __syncthreads
constexpr int kBarTileReady = 2;                                 // + stage
constexpr int kBarQReady = 4;                                    // q̃ in shared memory

constexpr uint32_t align_up(uint32_t x, uint32_t a) {
  return (x + a - 1) / a * a;
}

// Shared memory of a CTA with N heads (offsets from the 1024-byte aligned base).
template <int N>
struct Layout {
  static constexpr uint32_t kTiles = 0;                                     // [stage][block][64][64] bf16
  static constexpr uint32_t kQ = kTiles + kStages * kTileBytes;             // [block][N][64] bf16: q̃
  static constexpr uint32_t kP = kQ + kMaxColumnBlocks * N * 128;           // [stage][N][64] bf16: P^T
  static constexpr uint32_t kScale = kP + kStages * N * 128;                // [stage][N] fp32 rescale
  static constexpr uint32_t kMask = align_up(kScale + kStages * N * 4, 8);  // [stage] valid-row bits
  static constexpr uint32_t kWarpMax = kMask + kStages * 8;                 // [2][4][N] fp32
  static constexpr uint32_t kWarpSum = kWarpMax + 2 * 4 * N * 4;            // [4][N] fp32
  static constexpr uint32_t kBarriers = align_up(kWarpSum + 4 * N * 4, 8);  // full[stage], empty[stage]
  static constexpr uint32_t kGaveUp = kBarriers + 2 * kStages * 8;          // see sm90::mbarrier_wait
  static constexpr uint32_t kBytes = kGaveUp + 16 + 1024;                   // + the alignment slack
};
static_assert(Layout<32>::kBytes <= 227 * 1024, "one CTA an SM");

// wgmma m64nNk16 for N = 8, 16, 32: bf16 operands in shared memory (B K-major), fp32 accumulators (N / 2 a thread, the
// layout of sm90_attention.cuh). kTransA = 0: A K-major (rows of 64 k); 1: A M-major (rows of 64 m-values, one per k).
template <int N, int kTransA>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  static_assert(N == 8 || N == 16 || N == 32, "m64n8, m64n16 or m64n32");
  if constexpr (N == 8) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %6, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %1, %2, %3}, %4, %5, p, 1, 1, %7, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(kTransA));
  } else if constexpr (N == 16) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1, "
        "%11, 0;\n}\n"
        : DS_SM90_ACC8("+f", d, 0)
        : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(kTransA));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {" DS_SM90_REGS16 "}, %16, %17, p, 1, 1, %19, 0;\n}\n"
        : DS_SM90_ACC16("+f", d, 0)
        : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(kTransA));
  }
}

// Byte offset of element (row r, column c < 64) in a 128-byte-swizzled block of 64-element rows.
__device__ __forceinline__ uint32_t swizzled(int r, int c) {
  return static_cast<uint32_t>(r * 128 + ((((c >> 3) ^ (r & 7)) << 4) | ((c & 7) << 1)));
}

struct DecodeWgmmaArgs {
  MlaAttentionArgs a;
  WUvPrefetch w_uv;
  int box_rows;  // rows of a TMA box: 64 when pages hold whole tiles, else 16
};

// What the producer issues for one tile: the pool row of each box row group (-1: none), the valid-row bits, the bytes.
struct TilePlan {
  int32_t outer[kTileRows / 16];
  uint64_t mask;
  uint32_t bytes;
};

// grid (T, splits, ceil(H / N)), block kThreads, dynamic smem Layout<N>::kBytes.
template <int N>
__global__ void __launch_bounds__(kThreads, 1)
    mla_split_attention_wgmma_kernel(const __grid_constant__ CUtensorMap rows_map, const DecodeWgmmaArgs args) {
  constexpr int kRegs = N / 2;  // accumulator registers of one m64nN product
  constexpr int kCols = N / 4;  // distinct head columns a thread holds
  using L = Layout<N>;
  const MlaAttentionArgs& a = args.a;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024u - (smem_address(smem_raw) & 1023u)) & 1023u);
  const uint32_t base = smem_address(smem);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + L::kBarriers);
  uint64_t* empty = full + kStages;
  volatile int* gave_up = reinterpret_cast<volatile int*>(smem + L::kGaveUp);
  uint64_t* row_mask = reinterpret_cast<uint64_t*>(smem + L::kMask);

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int64_t t = blockIdx.x;
  const int split = blockIdx.y;
  const int h0 = blockIdx.z * N;
  const int heads = min(N, a.num_heads - h0);
  constexpr int width = kWidth, column_blocks = kMaxColumnBlocks;

  const Slice slice = attention_slice(a, t, split, kTileRows);  // warp-collective
  const int num_tiles = static_cast<int>((slice.row_end - slice.row_begin + kTileRows - 1) / kTileRows);
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      sm90::mbarrier_init(full + s, 1);
      sm90::mbarrier_init(empty + s, 1);
    }
    *gave_up = 0;
    sm90::mbarrier_init_fence();
  }
  __syncthreads();

  if (warp == kConsumerThreads / 32) {
    // Producer: the cache rows and page tables exist before this grid (the absorb before it waited for the row
    // writes), so the tiles stream before the wait for the absorb. Every lane plans (the same values); lane cb
    // issues column block cb of each box row group, which shortens the time from a stage's release to its refill
    // against one lane issuing all nine.
    if (lane == 0) sm90::tma_prefetch_descriptor(&rows_map);
    const int32_t* table = a.block_tables + static_cast<int64_t>(slice.n) * a.max_pages_per_seq;
    const int groups = kTileRows / args.box_rows;
    const uint32_t group_bytes = static_cast<uint32_t>(column_blocks * args.box_rows * 128);
    auto plan = [&](int j) {
      TilePlan p;
      p.mask = 0;
      p.bytes = 0;
      const int64_t tile_begin = slice.row_begin + static_cast<int64_t>(j) * kTileRows;
#pragma unroll
      for (int g = 0; g < kTileRows / 16; ++g) {  // unrolled: the plan stays in registers
        const int64_t p0 = tile_begin + static_cast<int64_t>(g) * args.box_rows;
        p.outer[g] = -1;
        if (g >= groups || p0 >= slice.row_end) continue;
        const int32_t page = __ldg(table + static_cast<int>(p0) / a.page_size);
        if (page < 0 || page >= a.num_pages) continue;
        p.outer[g] = static_cast<int32_t>((static_cast<int64_t>(page) * a.num_layers + a.layer) * a.page_size +
                                          static_cast<int>(p0) % a.page_size);
        const int rows_in = static_cast<int>(mla_i64_min(args.box_rows, slice.row_end - p0));
        const uint64_t bits = rows_in == 64 ? ~uint64_t{0} : ((uint64_t{1} << rows_in) - 1);
        p.mask |= bits << (g * args.box_rows);
        p.bytes += group_bytes;
      }
      return p;
    };
    TilePlan cur{};
    if (num_tiles > 0) cur = plan(0);
    for (int j = 0; j < num_tiles; ++j) {
      const int s = j % kStages;
      if (j >= kStages) {
        sm90::mbarrier_wait(empty + s, ((j / kStages) - 1) & 1, gave_up);
      }
      if (lane == 0) {
        row_mask[s] = cur.mask;
        sm90::mbarrier_arrive_expect_tx(full + s, cur.bytes);
      }
      __syncwarp();
      unsigned char* tile = smem + L::kTiles + s * kTileBytes;
#pragma unroll
      for (int g = 0; g < kTileRows / 16; ++g) {
        if (cur.outer[g] < 0) continue;
        if (lane < column_blocks) {
          sm90::tma_load_2d(tile + lane * kBlockBytes + g * args.box_rows * 128, &rows_map, full + s, lane * 64,
                            cur.outer[g]);
        }
      }
      __syncwarp();
      // The next tile's page-table reads, after this tile's copies are issued, overlap the wait for its stage.
      if (j + 1 < num_tiles) cur = plan(j + 1);
    }
    return;
  }

  mla_wait_for_previous_grid();
  mla_allow_next_grid();
  if (args.w_uv.kv_b != nullptr && t == 0) prefetch_w_uv(a, args.w_uv, h0, heads, split);
  const int wg_warp = warp & 3, g = lane >> 2, tq = lane & 3;
  const int64_t part = (t * a.splits + split) * a.num_heads + h0;
  const float* q_src = a.q_tilde + (t * a.num_heads + h0) * width;
  constexpr int kQVecs = width / 8;  // 8-value chunks of a q̃ row
  {
    // q̃ (N x width fp32 from the absorb) into shared memory as bf16 by all 256 consumer threads, every load of a
    // thread issued before the first conversion; warpgroup 0 waits for it, warpgroup 1 goes on to its first tile.
    constexpr int kPerThread = (N * kQVecs + kConsumerThreads - 1) / kConsumerThreads;
    float4 lo[kPerThread], hi[kPerThread];
#pragma unroll
    for (int k = 0; k < kPerThread; ++k) {
      const int i = tid + k * kConsumerThreads, n = i / kQVecs, c8 = i % kQVecs;
      lo[k] = hi[k] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      if (i < N * kQVecs && n < heads) {
        lo[k] = *reinterpret_cast<const float4*>(q_src + n * width + c8 * 8);
        hi[k] = *reinterpret_cast<const float4*>(q_src + n * width + c8 * 8 + 4);
      }
    }
#pragma unroll
    for (int k = 0; k < kPerThread; ++k) {
      const int i = tid + k * kConsumerThreads, n = i / kQVecs, c8 = i % kQVecs;
      if (i < N * kQVecs) {
        *reinterpret_cast<uint4*>(smem + L::kQ + (c8 >> 3) * N * 128 + swizzled(n, (c8 & 7) * 8)) =
            make_uint4(pack_bf16(lo[k].x, lo[k].y), pack_bf16(lo[k].z, lo[k].w), pack_bf16(hi[k].x, hi[k].y),
                       pack_bf16(hi[k].z, hi[k].w));
      }
    }
    sm90::fence_proxy_async_shared();
    if (warp < 4) {
      sm90::named_barrier_sync(kBarQReady, kConsumerThreads);
    } else {
      sm90::named_barrier_arrive(kBarQReady, kConsumerThreads);
    }
  }

  if (warp < 4) {
    // ---- warpgroup 0: scores and softmax of every tile.
    const int r0 = 16 * wg_warp + g, r1 = r0 + 8;  // the thread's two tile rows
    float m_run[kCols], l_part[kCols];
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      m_run[c] = -INFINITY;
      l_part[c] = 0.0f;
    }
    for (int j = 0; j < num_tiles; ++j) {
      const int s = j % kStages;
      sm90::mbarrier_wait(full + s, (j / kStages) & 1, gave_up);
      const uint64_t mask = row_mask[s];
      const uint32_t tile = base + L::kTiles + s * kTileBytes;
      float sc[kRegs];
      sm90::wgmma_fence();
#pragma unroll
      for (int step = 0; step < column_blocks * 4; ++step) {
        const uint32_t k_off = (step >> 2) * kBlockBytes + (step & 3) * 32;
        const uint32_t q_off = (step >> 2) * N * 128 + (step & 3) * 32;
        wgmma_ss<N, 0>(sc, sm90::smem_descriptor_sw128(tile + k_off, 16, 1024),
                       sm90::smem_descriptor_sw128(base + L::kQ + q_off, 16, 1024), step > 0 ? 1 : 0);
      }
      sm90::wgmma_commit_group();
      sm90::wgmma_wait_group<0>();
      sm90::wgmma_fence_registers(sc);

      // Register 4i + e holds row (e < 2 ? r0 : r1), head column 8i + 2tq + e % 2; column slot c = 2i + e % 2.
      const bool v0 = ((mask >> r0) & 1) != 0, v1 = ((mask >> r1) & 1) != 0;
      float mx[kCols];
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        const int lo = (c >> 1) * 4 + (c & 1);
        sc[lo] = v0 ? sc[lo] : -INFINITY;
        sc[lo + 2] = v1 ? sc[lo + 2] : -INFINITY;
        mx[c] = fmaxf(sc[lo], sc[lo + 2]);
      }
#pragma unroll
      for (int offset = 4; offset < 32; offset <<= 1) {
#pragma unroll
        for (int c = 0; c < kCols; ++c) mx[c] = fmaxf(mx[c], __shfl_xor_sync(0xffffffffu, mx[c], offset));
      }
      float* warp_max = reinterpret_cast<float*>(smem + L::kWarpMax) + (j & 1) * 4 * N;
      if (g == 0) {
#pragma unroll
        for (int c = 0; c < kCols; ++c) warp_max[wg_warp * N + 8 * (c >> 1) + 2 * tq + (c & 1)] = mx[c];
      }
      sm90::named_barrier_sync(kBarScorer, 128);
      float* scale = reinterpret_cast<float*>(smem + L::kScale) + s * N;
      unsigned char* p_tile = smem + L::kP + s * N * 128;
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        const int col = 8 * (c >> 1) + 2 * tq + (c & 1);
        float tile_max = warp_max[col];
#pragma unroll
        for (int w = 1; w < 4; ++w) tile_max = fmaxf(tile_max, warp_max[w * N + col]);
        const float m_new = fmaxf(m_run[c], tile_max);
        const float m_use = m_new == -INFINITY ? 0.0f : m_new;  // a tile with no valid row adds nothing
        const float rescale = exp2f(m_run[c] - m_use);
        m_run[c] = m_new;
        const int lo = (c >> 1) * 4 + (c & 1);
        const __nv_bfloat16 p0 = __float2bfloat16(exp2f(sc[lo] - m_use));
        const __nv_bfloat16 p1 = __float2bfloat16(exp2f(sc[lo + 2] - m_use));
        // The sums take the bf16 values the product uses, so the weights stay normalised.
        l_part[c] = l_part[c] * rescale + (__bfloat162float(p0) + __bfloat162float(p1));
        *reinterpret_cast<__nv_bfloat16*>(p_tile + swizzled(col, r0)) = p0;
        *reinterpret_cast<__nv_bfloat16*>(p_tile + swizzled(col, r1)) = p1;
        if (wg_warp == 0 && g == 0) scale[col] = rescale;
      }
      if (mask != ~uint64_t{0}) {
        // Rows outside the slice hold stale or unloaded data: zero them for warpgroup 1's product (0 * NaN).
        unsigned char* tile_bytes = smem + L::kTiles + s * kTileBytes;
        for (int i = tid; i < kMaxLatentBlocks * kTileRows * 8; i += 128) {
          const int row = (i >> 3) % kTileRows;
          if (((mask >> row) & 1) == 0) {
            *reinterpret_cast<uint4*>(tile_bytes + (i >> 9) * kBlockBytes + row * 128 + (i & 7) * 16) =
                make_uint4(0, 0, 0, 0);
          }
        }
      }
      sm90::fence_proxy_async_shared();
      sm90::named_barrier_arrive(kBarTileReady + s, kConsumerThreads);
    }
    // Row sums across the warpgroup: lanes of one column, then the four warps.
#pragma unroll
    for (int offset = 4; offset < 32; offset <<= 1) {
#pragma unroll
      for (int c = 0; c < kCols; ++c) l_part[c] += __shfl_xor_sync(0xffffffffu, l_part[c], offset);
    }
    float* warp_sum = reinterpret_cast<float*>(smem + L::kWarpSum);
    if (g == 0) {
#pragma unroll
      for (int c = 0; c < kCols; ++c) warp_sum[wg_warp * N + 8 * (c >> 1) + 2 * tq + (c & 1)] = l_part[c];
    }
    sm90::named_barrier_sync(kBarScorer, 128);
    if (wg_warp == 0 && g == 0) {
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        const int col = 8 * (c >> 1) + 2 * tq + (c & 1);
        const float l = warp_sum[col] + warp_sum[N + col] + warp_sum[2 * N + col] + warp_sum[3 * N + col];
        if (col < heads) a.partial_ml[part + col] = make_float2(m_run[c], l);
      }
    }
    return;
  }

  // ---- warpgroup 1: O^T (+)= rows^T P^T, kv_lora / 64 blocks of 64 latent columns.
  float o[kMaxLatentBlocks][kRegs];
#pragma unroll
  for (int b = 0; b < kMaxLatentBlocks; ++b)
#pragma unroll
    for (int i = 0; i < kRegs; ++i) o[b][i] = 0.0f;
  for (int j = 0; j < num_tiles; ++j) {
    const int s = j % kStages;
    sm90::named_barrier_sync(kBarTileReady + s, kConsumerThreads);
    const float* scale = reinterpret_cast<const float*>(smem + L::kScale) + s * N;
#pragma unroll
    for (int i = 0; i < kRegs; ++i) {
      const float f = scale[8 * (i >> 2) + 2 * tq + (i & 1)];
#pragma unroll
      for (int b = 0; b < kMaxLatentBlocks; ++b) o[b][i] *= f;
    }
    const uint32_t tile = base + L::kTiles + s * kTileBytes;
    const uint32_t p_tile = base + L::kP + s * N * 128;
    sm90::wgmma_fence();
#pragma unroll
    for (int b = 0; b < kMaxLatentBlocks; ++b) {
#pragma unroll
      for (int step = 0; step < kTileRows / 16; ++step) {
        wgmma_ss<N, 1>(o[b], sm90::smem_descriptor_sw128(tile + b * kBlockBytes + step * 2048, kBlockBytes, 1024),
                       sm90::smem_descriptor_sw128(p_tile + step * 32, 16, 1024), 1);
      }
    }
    sm90::wgmma_commit_group();
    sm90::wgmma_wait_group<0>();
#pragma unroll
    for (int b = 0; b < kMaxLatentBlocks; ++b) sm90::wgmma_fence_registers(o[b]);
    if (tid == 128) sm90::mbarrier_arrive(empty + s);
  }
  float* out_o = a.partial_o + part * a.kv_lora;
#pragma unroll
  for (int b = 0; b < kMaxLatentBlocks; ++b) {
#pragma unroll
    for (int i = 0; i < kRegs; ++i) {
      const int col = 8 * (i >> 2) + 2 * tq + (i & 1);
      const int row = 64 * b + 16 * wg_warp + g + 8 * ((i >> 1) & 1);
      if (col < heads) out_o[col * a.kv_lora + row] = o[b][i];
    }
  }
}

}  // namespace

// The pool's 16-byte aligned pages and rows, which TMA needs, are validate_mla_pool's checks already.
bool mla_wgmma_decode_supported(const MlaAttentionArgs& args) {
  const int64_t pool_rows = args.num_pages * args.num_layers * static_cast<int64_t>(args.page_size);
  return args.kv_lora == kKvLora && args.rope == kRope && args.head_group >= 1 && args.head_group <= 32 &&
         pool_rows <= INT32_MAX;
}

Status launch_mla_wgmma_decode(const MlaAttentionArgs& args, const WUvPrefetch& w_uv, int64_t num_tokens,
                               cudaStream_t stream, const char* who) {
  const std::string w = std::string(who) + " (wgmma attention)";
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr) return internal_error(w + ": no tensor-map encoder");
  DecodeWgmmaArgs kernel_args{args, w_uv, args.page_size % kTileRows == 0 ? kTileRows : 16};
  CUtensorMap map;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(args.kv_lora + args.rope),
                              static_cast<cuuint64_t>(args.num_pages * args.num_layers * args.page_size)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(args.row_stride) * sizeof(__nv_bfloat16)};
  const cuuint32_t box[2] = {64, static_cast<cuuint32_t>(kernel_args.box_rows)};
  const cuuint32_t element_strides[2] = {1, 1};
  if (encode(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<__nv_bfloat16*>(args.pages), dims, strides, box,
             element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS) {
    return internal_error(w + ": cuTensorMapEncodeTiled failed for the page pool");
  }
  const int group = args.head_group <= 8 ? 8 : args.head_group <= 16 ? 16 : 32;
  kernel_args.a.head_group = group;
  void (*kernel)(const CUtensorMap, const DecodeWgmmaArgs) = group == 8    ? mla_split_attention_wgmma_kernel<8>
                                                             : group == 16 ? mla_split_attention_wgmma_kernel<16>
                                                                           : mla_split_attention_wgmma_kernel<32>;
  const size_t smem = group == 8 ? Layout<8>::kBytes : group == 16 ? Layout<16>::kBytes : Layout<32>::kBytes;
  if (const cudaError_t e =
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
      e != cudaSuccess) {
    (void)cudaGetLastError();
    return internal_error(w + ": cudaFuncSetAttribute: " + cudaGetErrorString(e));
  }
  const dim3 grid(static_cast<unsigned>(num_tokens), static_cast<unsigned>(args.splits),
                  static_cast<unsigned>((args.num_heads + group - 1) / group));
  return launch_kernel_ex(true, kernel, grid, dim3(kThreads), smem, stream, w.c_str(), map, kernel_args);
}

}  // namespace deltaserve::kernels::cuda::detail
