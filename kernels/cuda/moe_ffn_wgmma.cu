// MoE expert FFN on Hopper tensor cores (contract: moe_wgmma.hpp): TMA loads into an mbarrier stage ring, warpgroup
// MMA (wgmma.mma_async, bf16 in, fp32 accumulators in registers), epilogue from registers. Two schedules
// (MoeWgmmaSchedule) of the same math; both compute every output element as the same fp32 sum over k, k16 step by
// k16 step in increasing k.
//   1. gate/up + glu: a tile is 128 rows of x_sorted (one expert's row tile) x C weight rows: the gate rows
//      j0 .. j0 + C/2 - 1 and the up rows I + j0 .. I + j0 + C/2 - 1 (two TMA boxes of C/2 rows per stage, stacked
//      in shared memory), so accumulator columns c < C/2 hold gate(j0 + c) and c + C/2 up(j0 + c) in the same
//      thread; the epilogue writes bf16(glu(gate, up)) for activated columns j0 .. j0 + C/2 - 1 (fp32 math, rounded
//      once).
//   2. down: 128 rows of `activated` x C rows of down[e] (two boxes of C/2), y_sorted written in fp32.
// CTA: 3 warpgroups, one CTA per SM. Warpgroup 0 is the producer (one thread issues the TMA loads; the warpgroup
// gives its registers to the others with setmaxnreg), warpgroups 1 and 2 consume (128 fp32 accumulators per
// thread) and release a stage (one mbarrier arrival per warp) once their wgmma reading it retired. A stage holds
// k 64 (one 128-byte swizzle row per tile row) of A (128 x 64, 16 KiB) and B (C x 64).
//   cooperative (the default): C = 256, stages of 48 KiB x 4. Both consumer warpgroups work on every tile, each on
//     its 64 x 256 half (wgmma m64n256k16), so while they run the epilogue no wgmma is issued: the tensor cores
//     idle for the store of each tile (a down tile, 16 k-steps of MMA, writes 128 KiB of fp32).
//   pingpong (DELTASERVE_MOE_WGMMA=pingpong): C = 128, stages of 32 KiB x 6. Each consumer warpgroup owns whole
//     128 x 128 tiles (two wgmma m64n128k16 per k16 step into acc[0] (rows 0-63) and acc[1] (rows 64-127), sharing
//     the B operand; a whole 128 x 256 tile would need 256 accumulators per thread), and the CTA's tiles alternate
//     between them: warpgroup 1 takes the CTA's tiles 0, 2, 4, ..., warpgroup 2 tiles 1, 3, .... The producer loads
//     the CTA's tiles in that order into one ring, so the CTA's tile j occupies ring fills j k_tiles ..
//     (j + 1) k_tiles - 1 and each warpgroup skips the other's fills. Two named barriers (turns) order the
//     mainloops: a warpgroup issues its tile's wgmma only on its turn and passes the turn on as soon as the last one
//     is issued, before it waits for them and runs its epilogue, so one warpgroup's store runs under the other's
//     MMA (a down tile: ~5 us of MMA at the measured peak against ~2 us for its 64 KiB of fp32 at one SM's share of
//     HBM bandwidth) and the tensor cores see one long stream of wgmma. The turn goes only to a tile that exists
//     (the CTA's tile 0, then the one after each finished mainloop), so every wait has exactly one arrival and none
//     is left pending at exit. Costs against cooperative: B is loaded once per 128 x 128 instead of once per
//     128 x 256 outputs (32 instead of 24 KiB of L2-to-SM traffic per 2 MFLOP; 64 x 256 tiles per warpgroup would
//     need 40), and each wgmma reads A and B from shared memory for a 64 x 128 block (96 of the SM's 128 bytes per
//     clock at the full MMA rate, against 80 for m64n256).
// Schedule: persistent CTAs (grid = SMs) walk tiles t = blockIdx.x, + gridDim.x, ...; tile t is global row tile
// g = t / n_tiles (row tiles numbered expert by expert as in moe_ffn_grouped.cu) and column tile t % n_tiles. Each
// CTA scans the E counts once into shared memory (offsets and row-tile prefix) and finds a tile's expert by binary
// search. Why persistent rather than one CTA per tile: the producer runs ahead into the next tile while the
// consumers store the previous one, and the per-CTA setup (barrier init, schedule scan, descriptor prefetch) is paid
// once per SM instead of once per ~5-25 us tile; neighbouring t (the column tiles of one row tile, then the row
// tiles of one expert) run at about the same time on different SMs (pingpong: the 2 x gridDim.x tiles in flight
// span the same ~15 row tiles as cooperative's gridDim.x wider ones), so each weight box is fetched from HBM about
// once per expert and each A row tile once per column sweep.
// Rows: a tile's A box starts at the expert's row tile start; rows past the expert's end (the next expert's rows,
// NaN padding, or TMA zero fill past R) are computed but never stored. Rows 64-127 of a tile that all lie past the
// end get no wgmma (cooperative: that consumer warpgroup only passes the stages on; pingpong: the owner issues only
// the rows 0-63 half), so a nearly empty last row tile costs half a tile.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include <cudaTypedefs.h>

#include "kernels/cuda/activations.cuh"
#include "kernels/cuda/mma_sm80.cuh"
#include "kernels/cuda/moe_wgmma.hpp"
#include "kernels/cuda/sm90_attention.cuh"
#include "kernels/cuda/sm90_ptx.cuh"

namespace deltaserve::kernels::cuda {
namespace {

using detail::smem_address;

constexpr int kRowTile = 128;                       // rows per tile (the A box)
constexpr int kWarpgroupRows = 64;                  // rows of one wgmma (its M)
constexpr int kKTile = 64;                          // k per stage: 128 bytes of bf16, the swizzle row
constexpr uint32_t kRowBytes = kKTile * 2;          // 128
constexpr uint32_t kABytes = kRowTile * kRowBytes;  // 16 KiB
constexpr int kThreads = 384;                       // producer warpgroup + 2 consumer warpgroups
constexpr int kAccumulators = 128;                  // fp32 per consumer thread: a 64 x 256 or 128 x 128 tile
// Register split after setmaxnreg: 128 x 40 + 256 x 232 = 64512 of the SM's 65536 (the kernel is launched with
// 168 per thread, the __launch_bounds__ limit of 384 threads).
constexpr int kProducerRegisters = 40;
constexpr int kConsumerRegisters = 232;
// Named barriers (0 is __syncthreads), pingpong only: kTurnBarrier + c is consumer c's turn to issue wgmma (consumer
// c = 0, 1 is warpgroup c + 1), completed by consumer c's 128 threads (bar.sync) and the other's (bar.arrive).
constexpr int kTurnBarrier = 1;
constexpr int kConsumerThreads = 256;

// Tile shape and stage ring of a schedule (the file comment).
template <MoeWgmmaSchedule kSchedule>
struct Config {
  static constexpr bool kPingPong = kSchedule == MoeWgmmaSchedule::kPingPong;
  static constexpr int kColTile = kPingPong ? 128 : 256;  // weight rows per tile (the tile's columns)
  static constexpr int kBoxRows = kColTile / 2;           // rows per B box (two per stage)
  static constexpr int kStages = kPingPong ? 6 : 4;       // a seventh / fifth stage would not fit in 227 KiB
  static constexpr uint32_t kBBytes = kColTile * kRowBytes;
  static constexpr uint32_t kStageBytes = kABytes + kBBytes;
  static constexpr uint32_t kStageReleases = kPingPong ? 4 : 8;  // empty-barrier arrivals: the consuming warps
  // Dynamic shared memory: 1024 bytes to align the tiles (128-byte swizzle atoms span 1024 bytes), the stages, the
  // full/empty barriers, then the schedule: offsets [E + 1] and row-tile prefix [E + 1].
  static constexpr size_t kSmemBytes = 1024 + size_t{kStages} * kStageBytes + 2 * kStages * sizeof(uint64_t) +
                                       2 * (size_t{kMoeMaxExperts} + 1) * sizeof(int32_t);
  static_assert(kStageBytes % 1024 == 0 && kABytes % 1024 == 0 && kBBytes / 2 % 1024 == 0,
                "tiles must stay 1024-byte aligned");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory per block");
  static_assert(kAccumulators * 128 == kRowTile * kColTile / (kPingPong ? 1 : 2), "accumulators per thread");
};

enum class Mode { kGateUpSwiGlu, kGateUpSitu, kDown };

struct WgmmaArgs {
  const int32_t* offsets;    // [E + 1]
  __nv_bfloat16* activated;  // gate/up modes: out [R, I]
  float* y;                  // down mode: out [R, W]
  int E;
  int k_tiles;  // ceil(K / 64), K = W (gate/up) or I (down)
  int n_tiles;  // column tiles: ceil(I / (C / 2)) (gate/up) or ceil(W / C) (down)
  int N;        // output columns: I or W
  int b_rows;   // weight rows per expert: 2I or W
  float beta, beta_linear;
};

struct Tile {
  int expert, row0, row_end, col_tile;
};

// Position in the stage ring: the stage and the parity of its current fill.
template <int kStages>
struct Ring {
  int stage = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void next() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1u;
    }
  }
  // Moves on by n >= 0 fills (the positions repeat every 2 kStages fills).
  __device__ __forceinline__ void skip(int n) {
    stage += n % (2 * kStages);
    while (stage >= kStages) {
      stage -= kStages;
      phase ^= 1u;
    }
  }
};

// Fills s_offsets[0..E] and s_prefix[0..E] (row tiles of the experts before e; s_prefix[E] = all row tiles) with a
// block-wide scan; the caller synchronises before reading them. Negative counts (corrupt offsets) count as empty.
__device__ void build_schedule(const int32_t* offsets, int E, int* s_offsets, int* s_prefix) {
  __shared__ int warp_sums[kThreads / 32];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int per = (E + kThreads - 1) / kThreads;
  const int e0 = min(tid * per, E), e1 = min(e0 + per, E);
  int local = 0;
  for (int e = e0; e < e1; ++e) {
    const int begin = offsets[e], count = offsets[e + 1] - begin;
    s_offsets[e] = begin;
    local += (max(count, 0) + kRowTile - 1) / kRowTile;
  }
  if (tid == 0) s_offsets[E] = offsets[E];
  int inclusive = local;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int v = __shfl_up_sync(0xffffffffu, inclusive, d);
    if (lane >= d) inclusive += v;
  }
  if (lane == 31) warp_sums[warp] = inclusive;
  __syncthreads();  // warp sums and s_offsets complete
  int before = inclusive - local;
  for (int w = 0; w < warp; ++w) before += warp_sums[w];
  for (int e = e0; e < e1; ++e) {
    s_prefix[e] = before;
    before += (max(s_offsets[e + 1] - s_offsets[e], 0) + kRowTile - 1) / kRowTile;
  }
  if (e0 < E && e1 == E) s_prefix[E] = before;
}

// Tile t of the schedule (t < s_prefix[E] * n_tiles): binary search for the expert e with
// s_prefix[e] <= g < s_prefix[e + 1] (experts without rows have s_prefix[e] == s_prefix[e + 1] and are never found).
__device__ __forceinline__ Tile decode_tile(int t, int n_tiles, int E, const int* s_offsets, const int* s_prefix) {
  const int g = t / n_tiles;
  int lo = 0, hi = E;  // invariant: s_prefix[lo] <= g < s_prefix[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (s_prefix[mid] <= g) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return {lo, s_offsets[lo] + (g - s_prefix[lo]) * kRowTile, s_offsets[lo + 1], t - g * n_tiles};
}

// Stores a warpgroup's 64 x kCols accumulator block (register i of lane l in warp w: row 16 w + l / 4 +
// 8 ((i % 4) / 2), column 8 (i / 4) + 2 (l % 4) + i % 2; sm90_ptx.cuh) whose first row is row0; rows >= row_end
// and columns >= N are not stored. kDown: block column c is y column col0 + c. Gate/up: block columns c < kCols / 2
// are gate(col0 + c) and c + kCols / 2 up(col0 + c), and activated column col0 + c gets bf16(glu(gate, up)).
template <Mode kMode, int kCols>
__device__ __forceinline__ void store_block(const float (&acc)[kCols / 2], const WgmmaArgs& p, int row0, int row_end,
                                            int col0) {
  const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  const int row_base = row0 + 16 * warp + (lane >> 2);
  const int col_base = col0 + 2 * (lane & 3);
  if constexpr (kMode == Mode::kDown) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row_base + 8 * h;
      if (row >= row_end) continue;
      float* out = p.y + static_cast<int64_t>(row) * p.N;
#pragma unroll
      for (int block = 0; block < kCols / 8; ++block) {
        const int col = col_base + 8 * block;
        // N is a multiple of 8, so col < N implies col + 1 < N.
        if (col < p.N) {
          *reinterpret_cast<float2*>(out + col) = make_float2(acc[4 * block + 2 * h], acc[4 * block + 2 * h + 1]);
        }
      }
    }
  } else {
    constexpr int kUp = kCols / 2 / 8 * 4;  // register block b (gate) pairs with block b + kCols / 16 (up)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row_base + 8 * h;
      if (row >= row_end) continue;
      __nv_bfloat16* out = p.activated + static_cast<int64_t>(row) * p.N;
#pragma unroll
      for (int block = 0; block < kCols / 2 / 8; ++block) {
        const int col = col_base + 8 * block;
        if (col >= p.N) continue;
        float v[2];
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          const int i = 4 * block + 2 * h + q;
          v[q] = kMode == Mode::kGateUpSitu ? situ_glu_f(acc[i], acc[i + kUp], p.beta, p.beta_linear)
                                            : swiglu_f(acc[i], acc[i + kUp]);
        }
        *reinterpret_cast<__nv_bfloat162*>(out + col) = __floats2bfloat162_rn(v[0], v[1]);
      }
    }
  }
}

// The column of the tile's first output: y column (down) or activated column (gate/up).
template <Mode kMode, int kColTile>
__device__ __forceinline__ int output_col0(const Tile& tile) {
  return kMode == Mode::kDown ? tile.col_tile * kColTile : tile.col_tile * (kColTile / 2);
}

// Cooperative consumer warpgroup `consumer`: rows 64 consumer .. + 63 of each of the CTA's tiles, one m64n256k16
// per k16 step.
template <Mode kMode>
__device__ __forceinline__ void consume_cooperative(const WgmmaArgs& p, int consumer, int total, uint32_t tiles,
                                                    uint32_t full_bars, uint32_t empty_bars, const int* s_offsets,
                                                    const int* s_prefix) {
  using C = Config<MoeWgmmaSchedule::kCooperative>;
  const int lane = threadIdx.x & 31;
  float acc[kAccumulators];
#pragma unroll
  for (int i = 0; i < kAccumulators; ++i) acc[i] = 0.0f;
  Ring<C::kStages> ring;
  for (int t = blockIdx.x; t < total; t += gridDim.x) {
    const Tile tile = decode_tile(t, p.n_tiles, p.E, s_offsets, s_prefix);
    if (tile.row0 + consumer * kWarpgroupRows >= tile.row_end) {
      // All 64 rows past the expert's end: no wgmma, no stores. The stages are still waited for (full) before they
      // are released, so these arrivals always complete the phase the producer is waiting on, never a later one.
      for (int kt = 0; kt < p.k_tiles; ++kt) {
        sm90::mbarrier_wait(full_bars + 8 * ring.stage, ring.phase);
        if (lane == 0) sm90::mbarrier_arrive(empty_bars + 8 * ring.stage);
        ring.next();
      }
      continue;
    }
    int previous = 0;
    for (int kt = 0; kt < p.k_tiles; ++kt) {
      sm90::mbarrier_wait(full_bars + 8 * ring.stage, ring.phase);
      const uint32_t a_base = tiles + ring.stage * C::kStageBytes + consumer * kWarpgroupRows * kRowBytes;
      const uint32_t b_base = tiles + ring.stage * C::kStageBytes + kABytes;
      sm90::wgmma_fence_registers(acc);
      sm90::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kKTile / 16; ++kk) {
        // k16 step kk: 32 bytes into each 128-byte swizzled row. The first step of a tile overwrites the
        // accumulators (scale-d 0).
        sm90::wgmma_m64n256k16_bf16(acc, sm90::smem_desc_k_major_sw128(a_base + 32 * kk),
                                    sm90::smem_desc_k_major_sw128(b_base + 32 * kk), (kt | kk) != 0 ? 1u : 0u);
      }
      sm90::wgmma_commit_group();
      if (kt > 0) {
        // The previous stage's wgmma group has retired: its shared memory may be refilled.
        sm90::wgmma_wait_group<1>();
        if (lane == 0) sm90::mbarrier_arrive(empty_bars + 8 * previous);
      }
      sm90::wgmma_fence_registers(acc);
      previous = ring.stage;
      ring.next();
    }
    sm90::wgmma_wait_group<0>();
    sm90::wgmma_fence_registers(acc);
    if (lane == 0) sm90::mbarrier_arrive(empty_bars + 8 * previous);
    store_block<kMode, C::kColTile>(acc, p, tile.row0 + consumer * kWarpgroupRows, tile.row_end,
                                    output_col0<kMode, C::kColTile>(tile));
  }
}

// Pingpong mainloop of one 128 x 128 tile: k_tiles stages from `ring` on, kHalves m64n128k16 per k16 step (2: rows
// 0-63 into acc[0] and 64-127 into acc[1]; 1: rows 0-63 only). Releases every stage but the last, whose wgmma may
// still run on return; returns that stage.
template <int kHalves>
__device__ __forceinline__ int pingpong_mainloop(float (&acc)[2][kAccumulators / 2], int k_tiles, uint32_t tiles,
                                                 uint32_t full_bars, uint32_t empty_bars,
                                                 Ring<Config<MoeWgmmaSchedule::kPingPong>::kStages>& ring) {
  using C = Config<MoeWgmmaSchedule::kPingPong>;
  const int lane = threadIdx.x & 31;
  int previous = 0;
  for (int kt = 0; kt < k_tiles; ++kt) {
    sm90::mbarrier_wait(full_bars + 8 * ring.stage, ring.phase);
    const uint32_t a_base = tiles + ring.stage * C::kStageBytes, b_base = a_base + kABytes;
    sm90::wgmma_fence_registers(acc[0]);
    sm90::wgmma_fence_registers(acc[1]);
    sm90::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kKTile / 16; ++kk) {
      // As in consume_cooperative; both halves read the same 128 B rows (the tile's weight columns).
      const uint64_t b = sm90::smem_desc_k_major_sw128(b_base + 32 * kk);
      const int accumulate = (kt | kk) != 0 ? 1 : 0;
      sm90::wgmma_m64n128k16_ss(acc[0], sm90::smem_desc_k_major_sw128(a_base + 32 * kk), b, accumulate);
      if constexpr (kHalves == 2) {
        sm90::wgmma_m64n128k16_ss(acc[1], sm90::smem_desc_k_major_sw128(a_base + kWarpgroupRows * kRowBytes + 32 * kk),
                                  b, accumulate);
      }
    }
    sm90::wgmma_commit_group();
    if (kt > 0) {
      sm90::wgmma_wait_group<1>();
      if (lane == 0) sm90::mbarrier_arrive(empty_bars + 8 * previous);
    }
    sm90::wgmma_fence_registers(acc[0]);
    sm90::wgmma_fence_registers(acc[1]);
    previous = ring.stage;
    ring.next();
  }
  return previous;
}

// Pingpong consumer `consumer` (warpgroup consumer + 1): the CTA's tiles consumer, consumer + 2, ... (file comment).
template <Mode kMode>
__device__ __forceinline__ void consume_pingpong(const WgmmaArgs& p, int consumer, int total, uint32_t tiles,
                                                 uint32_t full_bars, uint32_t empty_bars, const int* s_offsets,
                                                 const int* s_prefix) {
  using C = Config<MoeWgmmaSchedule::kPingPong>;
  const int lane = threadIdx.x & 31;
  float acc[2][kAccumulators / 2];
#pragma unroll
  for (int i = 0; i < kAccumulators / 2; ++i) acc[0][i] = acc[1][i] = 0.0f;
  const int grid = static_cast<int>(gridDim.x);
  Ring<C::kStages> ring;
  ring.skip(consumer * p.k_tiles);
  // The CTA's tile 0 goes first: consumer 1 gives consumer 0 the turn if that tile exists.
  if (consumer == 1 && static_cast<int>(blockIdx.x) < total) {
    sm90::named_barrier_arrive(kTurnBarrier, kConsumerThreads);
  }
  for (int t = static_cast<int>(blockIdx.x) + consumer * grid; t < total; t += 2 * grid) {
    const Tile tile = decode_tile(t, p.n_tiles, p.E, s_offsets, s_prefix);
    const bool upper = tile.row0 + kWarpgroupRows < tile.row_end;  // rows 64-127 hold some of the expert's rows
    sm90::named_barrier_sync(kTurnBarrier + consumer, kConsumerThreads);
    const int last = upper ? pingpong_mainloop<2>(acc, p.k_tiles, tiles, full_bars, empty_bars, ring)
                           : pingpong_mainloop<1>(acc, p.k_tiles, tiles, full_bars, empty_bars, ring);
    // All of this tile's wgmma are issued: the other warpgroup's next tile (the CTA's next) may issue its own.
    if (t + grid < total) {
      sm90::named_barrier_arrive(kTurnBarrier + 1 - consumer, kConsumerThreads);
    }
    sm90::wgmma_wait_group<0>();
    sm90::wgmma_fence_registers(acc[0]);
    sm90::wgmma_fence_registers(acc[1]);
    if (lane == 0) sm90::mbarrier_arrive(empty_bars + 8 * last);
    const int col0 = output_col0<kMode, C::kColTile>(tile);
    store_block<kMode, C::kColTile>(acc[0], p, tile.row0, tile.row_end, col0);
    if (upper) store_block<kMode, C::kColTile>(acc[1], p, tile.row0 + kWarpgroupRows, tile.row_end, col0);
    ring.skip(p.k_tiles);  // the other warpgroup's tile
  }
}

template <Mode kMode, MoeWgmmaSchedule kSchedule>
__global__ void __launch_bounds__(kThreads, 1)
    moe_wgmma_kernel(const __grid_constant__ CUtensorMap a_map, const __grid_constant__ CUtensorMap b_map,
                     const WgmmaArgs p) {
  using C = Config<kSchedule>;
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = smem_address(smem_raw);
  const uint32_t tiles = (raw + 1023u) & ~1023u;  // stage s: A at tiles + s * kStageBytes, B kABytes later
  unsigned char* smem = smem_raw + (tiles - raw);
  const uint32_t full_bars = tiles + C::kStages * C::kStageBytes;  // 8 bytes each
  const uint32_t empty_bars = full_bars + C::kStages * 8;
  int* s_offsets = reinterpret_cast<int*>(smem + C::kStages * C::kStageBytes + 2 * C::kStages * 8);
  int* s_prefix = s_offsets + p.E + 1;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  if (tid == 0) {
    for (int s = 0; s < C::kStages; ++s) {
      sm90::mbarrier_init(full_bars + 8 * s, 1);  // the producer's arrive.expect_tx
      sm90::mbarrier_init(empty_bars + 8 * s, C::kStageReleases);
    }
    sm90::mbarrier_init_fence();
    sm90::tma_prefetch_descriptor(&a_map);
    sm90::tma_prefetch_descriptor(&b_map);
  }
  build_schedule(p.offsets, p.E, s_offsets, s_prefix);
  __syncthreads();
  const int total = s_prefix[p.E] * p.n_tiles;
  const int warpgroup = warp >> 2;

  if (warpgroup == 0) {
    sm90::warpgroup_release_registers<kProducerRegisters>();
    if (warp != 0 || lane != 0) return;
    // The CTA's tiles in order (pingpong: alternately for consumer warpgroups 1 and 2), k_tiles stages each.
    Ring<C::kStages> ring;
    for (int t = blockIdx.x; t < total; t += gridDim.x) {
      const Tile tile = decode_tile(t, p.n_tiles, p.E, s_offsets, s_prefix);
      int b_row0, b_row1;
      if constexpr (kMode == Mode::kDown) {
        b_row0 = tile.expert * p.b_rows + tile.col_tile * C::kColTile;
        b_row1 = b_row0 + C::kBoxRows;
      } else {
        b_row0 = tile.expert * p.b_rows + tile.col_tile * C::kBoxRows;  // gate rows j0 ..
        b_row1 = b_row0 + p.N;                                          // up rows I + j0 ..
      }
      for (int kt = 0; kt < p.k_tiles; ++kt) {
        sm90::mbarrier_wait(empty_bars + 8 * ring.stage, ring.phase ^ 1u);
        const uint32_t full = full_bars + 8 * ring.stage;
        const uint32_t a_dst = tiles + ring.stage * C::kStageBytes, b_dst = a_dst + kABytes;
        sm90::mbarrier_arrive_expect_tx(full, C::kStageBytes);
        sm90::tma_load_2d(a_dst, &a_map, full, kt * kKTile, tile.row0);
        sm90::tma_load_2d(b_dst, &b_map, full, kt * kKTile, b_row0);
        sm90::tma_load_2d(b_dst + C::kBoxRows * kRowBytes, &b_map, full, kt * kKTile, b_row1);
        ring.next();
      }
    }
    return;
  }

  sm90::warpgroup_claim_registers<kConsumerRegisters>();
  if constexpr (C::kPingPong) {
    consume_pingpong<kMode>(p, warpgroup - 1, total, tiles, full_bars, empty_bars, s_offsets, s_prefix);
  } else {
    consume_cooperative<kMode>(p, warpgroup - 1, total, tiles, full_bars, empty_bars, s_offsets, s_prefix);
  }
}

PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  // Through the runtime's driver entry point, so that the library does not link libcuda.
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* function = nullptr;
    cudaDriverEntryPointQueryResult query = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &function, 12000, cudaEnableDefault, &query) !=
            cudaSuccess ||
        query != cudaDriverEntryPointSuccess) {
      return static_cast<PFN_cuTensorMapEncodeTiled_v12000>(nullptr);
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(function);
  }();
  return encode;
}

// Row-major bf16 [rows, inner] read as boxes of 64 (k) x box_rows rows, 128-byte swizzle, zero fill out of range.
Status encode_map(PFN_cuTensorMapEncodeTiled_v12000 encode, CUtensorMap* map, const __nv_bfloat16* base, int64_t inner,
                  int64_t rows, int box_rows, const char* what) {
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(inner), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(inner) * sizeof(__nv_bfloat16)};
  const cuuint32_t box[2] = {kKTile, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult result =
      encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<__nv_bfloat16*>(base), dims, strides, box,
             element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (result != CUDA_SUCCESS) {
    return invalid_argument(std::string("moe_expert_ffn_wgmma: cuTensorMapEncodeTiled(") + what + ", " +
                            std::to_string(rows) + " x " + std::to_string(inner) + ") failed: CUresult " +
                            std::to_string(static_cast<int>(result)));
  }
  return Status::ok();
}

template <Mode kMode, MoeWgmmaSchedule kSchedule>
Status launch(const CUtensorMap& a_map, const CUtensorMap& b_map, const WgmmaArgs& args, int grid, cudaStream_t stream,
              const char* what) {
  constexpr size_t kSmemBytes = Config<kSchedule>::kSmemBytes;
  // Above 48 KiB the opt-in is needed; a per-function attribute (no stream work), so capture is unaffected.
  cudaError_t error = cudaFuncSetAttribute(moe_wgmma_kernel<kMode, kSchedule>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSmemBytes));
  if (error != cudaSuccess) {
    return internal_error(std::string("moe_expert_ffn_wgmma: shared memory attribute: ") + cudaGetErrorString(error));
  }
  moe_wgmma_kernel<kMode, kSchedule><<<grid, kThreads, kSmemBytes, stream>>>(a_map, b_map, args);
  error = cudaGetLastError();
  if (error == cudaSuccess) return Status::ok();
  return internal_error(std::string("moe_expert_ffn_wgmma ") + what + ": launch: " + cudaGetErrorName(error) + " (" +
                        cudaGetErrorString(error) + ")");
}

template <Mode kMode>
Status launch(MoeWgmmaSchedule schedule, const CUtensorMap& a_map, const CUtensorMap& b_map, const WgmmaArgs& args,
              int grid, cudaStream_t stream, const char* what) {
  return schedule == MoeWgmmaSchedule::kPingPong
             ? launch<kMode, MoeWgmmaSchedule::kPingPong>(a_map, b_map, args, grid, stream, what)
             : launch<kMode, MoeWgmmaSchedule::kCooperative>(a_map, b_map, args, grid, stream, what);
}

}  // namespace

MoeWgmmaSchedule moe_wgmma_schedule() {
  static const MoeWgmmaSchedule schedule = [] {
    const char* value = std::getenv("DELTASERVE_MOE_WGMMA");
    if (value == nullptr || value[0] == '\0') return MoeWgmmaSchedule::kCooperative;
    const std::string v(value);
    if (v == "pingpong") return MoeWgmmaSchedule::kPingPong;
    if (v != "cooperative") {
      std::fprintf(stderr, "DELTASERVE_MOE_WGMMA=%s not recognised (cooperative | pingpong): cooperative\n", value);
    }
    return MoeWgmmaSchedule::kCooperative;
  }();
  return schedule;
}

const char* moe_wgmma_schedule_name(MoeWgmmaSchedule schedule) {
  switch (schedule) {
    case MoeWgmmaSchedule::kCooperative:
      return "cooperative";
    case MoeWgmmaSchedule::kPingPong:
      return "pingpong";
  }
  return "unknown";
}

Status moe_expert_ffn_wgmma(const MoeFfnParams& params, cudaStream_t stream, MoeWgmmaStage stage,
                            MoeWgmmaSchedule schedule) {
  const MoeExpertWeights& w = params.weights;
  const int64_t W = w.width, I = w.intermediate, R = params.rows;
  const int E = w.num_experts;
  if (schedule != MoeWgmmaSchedule::kCooperative && schedule != MoeWgmmaSchedule::kPingPong) {
    return invalid_argument("moe_expert_ffn_wgmma: unknown schedule " + std::to_string(static_cast<int>(schedule)));
  }
  DS_RETURN_IF_ERROR(detail::validate_moe_ffn_sizes(params, "moe_expert_ffn_wgmma"));
  if (E * 2 * I >= (int64_t{1} << 31) || E * W >= (int64_t{1} << 31)) {
    return invalid_argument("moe_expert_ffn_wgmma: E * 2I and E * width must stay below 2^31 (TMA coordinates)");
  }
  const bool ping_pong = schedule == MoeWgmmaSchedule::kPingPong;
  const int col_tile =
      ping_pong ? Config<MoeWgmmaSchedule::kPingPong>::kColTile : Config<MoeWgmmaSchedule::kCooperative>::kColTile;
  const int64_t gate_up_tiles = (I + col_tile / 2 - 1) / (col_tile / 2), down_tiles = (W + col_tile - 1) / col_tile;
  const int64_t max_row_tiles = (R + kRowTile - 1) / kRowTile + (R < E ? R : E);
  // Tile indices and t + 2 gridDim.x stay below 2^31.
  if (R < 0 || R > 0x7fffffff ||
      max_row_tiles * (gate_up_tiles > down_tiles ? gate_up_tiles : down_tiles) > (int64_t{1} << 30)) {
    return invalid_argument("moe_expert_ffn_wgmma: rows out of range (" + std::to_string(R) + ")");
  }
  DS_RETURN_IF_ERROR(detail::validate_moe_ffn_glu(params, "moe_expert_ffn_wgmma"));
  if (R == 0) return Status::ok();
  DS_RETURN_IF_ERROR(detail::validate_moe_ffn_buffers(params, "moe_expert_ffn_wgmma"));
  int device = 0, major = 0, minor = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    return unimplemented("moe_expert_ffn_wgmma: cannot query the current device");
  }
  if (major != 9) {
    return unimplemented("moe_expert_ffn_wgmma: needs a compute capability 9.x GPU (got " + std::to_string(major) +
                         "." + std::to_string(minor) + ")");
  }
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr) return unimplemented("moe_expert_ffn_wgmma: the driver has no cuTensorMapEncodeTiled");

  WgmmaArgs args{params.expert_offsets, params.activated,       params.y_sorted, E, 0, 0, 0, 0,
                 params.situ_beta,      params.situ_linear_beta};
  CUtensorMap gate_up_a, gate_up_b, down_a, down_b;
  const bool run_gate_up = stage != MoeWgmmaStage::kDown, run_down = stage != MoeWgmmaStage::kGateUp;
  const int b_box_rows = col_tile / 2;
  if (run_gate_up) {
    Status status = encode_map(encode, &gate_up_a, params.x_sorted, W, R, kRowTile, "x_sorted");
    if (status) status = encode_map(encode, &gate_up_b, w.gate_up, W, E * 2 * I, b_box_rows, "gate_up");
    if (!status) return status;
  }
  if (run_down) {
    Status status = encode_map(encode, &down_a, params.activated, I, R, kRowTile, "activated");
    if (status) status = encode_map(encode, &down_b, w.down, I, E * W, b_box_rows, "down");
    if (!status) return status;
  }
  if (run_gate_up) {
    WgmmaArgs gu = args;
    gu.k_tiles = static_cast<int>((W + kKTile - 1) / kKTile);
    gu.n_tiles = static_cast<int>(gate_up_tiles);
    gu.N = static_cast<int>(I);
    gu.b_rows = static_cast<int>(2 * I);
    const int grid = static_cast<int>(std::min<int64_t>(sms, max_row_tiles * gate_up_tiles));
    const Status status =
        params.glu == GluKind::kSitu
            ? launch<Mode::kGateUpSitu>(schedule, gate_up_a, gate_up_b, gu, grid, stream, "gate/up")
            : launch<Mode::kGateUpSwiGlu>(schedule, gate_up_a, gate_up_b, gu, grid, stream, "gate/up");
    if (!status) return status;
  }
  if (run_down) {
    WgmmaArgs down = args;
    down.k_tiles = static_cast<int>((I + kKTile - 1) / kKTile);
    down.n_tiles = static_cast<int>(down_tiles);
    down.N = static_cast<int>(W);
    down.b_rows = static_cast<int>(W);
    const int grid = static_cast<int>(std::min<int64_t>(sms, max_row_tiles * down_tiles));
    return launch<Mode::kDown>(schedule, down_a, down_b, down, grid, stream, "down");
  }
  return Status::ok();
}

}  // namespace deltaserve::kernels::cuda
