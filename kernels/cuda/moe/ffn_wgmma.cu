// MoE expert FFN on Hopper tensor cores (contract: detail/wgmma.hpp): TMA loads into a 4-stage mbarrier pipeline,
// wgmma.mma_async m64n256k16 (bf16 in, fp32 accumulators in registers), epilogue from registers.
//   1. gate/up + glu: a CTA tile is 128 rows of x_sorted (one expert's row tile) x 256 weight rows: the gate rows
//      j0 .. j0 + 127 and the up rows I + j0 .. I + j0 + 127 (two TMA boxes of 128 rows per stage, stacked in
//      shared memory), so accumulator columns c < 128 hold gate(j0 + c) and c + 128 up(j0 + c) in the same thread;
//      the epilogue writes bf16(glu(gate, up)) for activated columns j0 .. j0 + 127 (fp32 math, rounded once).
//   2. down: 128 rows of `activated` x 256 rows of down[e] (two boxes of 128), y_sorted written in fp32.
// CTA: 3 warpgroups. Warpgroup 0 is the producer (one thread issues the TMA loads; the warpgroup gives its
// registers to the others with setmaxnreg), warpgroups 1 and 2 each run the 64 x 256 half of the tile (128 fp32
// accumulators per thread) and release a stage (one mbarrier arrival per warp) once their wgmma reading it retired.
// Stage: k 64 = one 128-byte swizzle row per tile row; A 128 x 64 (16 KiB) + B 256 x 64 (32 KiB), 4 stages =
// 192 KiB, one CTA per SM.
// Schedule: persistent CTAs (grid = SMs) walk tiles t = blockIdx.x, + gridDim.x, ...; tile t is global row tile
// g = t / n_tiles (row tiles numbered expert by expert as in ffn_grouped.cu) and column tile t % n_tiles. Each
// CTA scans the E counts once into shared memory (offsets and row-tile prefix) and finds a tile's expert by binary
// search. Why persistent rather than one CTA per tile: the producer runs ahead into the next tile while the
// consumers store the previous one (the epilogue of a down tile writes 128 KiB), and the per-CTA setup (barrier
// init, schedule scan, descriptor prefetch) is paid once per SM instead of once per tile; neighbouring t
// (the column tiles of one row tile, then the row tiles of one expert) run at about the same time on different SMs,
// so each weight box is fetched from HBM about once per expert and each A row tile once per column sweep.
// Rows: a tile's A box starts at the expert's row tile start; rows past the expert's end (the next expert's rows,
// NaN padding, or TMA zero fill past R) are computed but never stored. A consumer warpgroup whose 64 rows all lie
// past the end skips its wgmma (it only passes the stages on), so a nearly empty last row tile costs half a tile.
#include <algorithm>
#include <cstdint>
#include <string>

#include <cudaTypedefs.h>

#include "kernels/cuda/common/detail/activations.cuh"
#include "kernels/cuda/common/detail/mma_sm80.cuh"
#include "kernels/cuda/common/detail/sm90_ptx.cuh"
#include "kernels/cuda/common/tensor_map.hpp"
#include "kernels/cuda/moe/detail/wgmma.hpp"

namespace deltaserve::kernels::cuda {
namespace {

using detail::smem_address;

constexpr int kRowTile = 128;                       // rows per CTA tile: 2 consumer warpgroups x 64
constexpr int kWarpgroupRows = 64;                  // rows of one consumer warpgroup (the wgmma M)
constexpr int kColTile = 256;                       // weight rows per CTA tile (the wgmma N)
constexpr int kBoxRows = 128;                       // rows per TMA box (A: the row tile; B: half the column tile)
constexpr int kKTile = 64;                          // k per stage: 128 bytes of bf16, the swizzle row
constexpr int kStages = 4;                          // 4 x 48 KiB; a fifth stage would not fit in 227 KiB
constexpr uint32_t kRowBytes = kKTile * 2;          // 128
constexpr uint32_t kABytes = kRowTile * kRowBytes;  // 16 KiB
constexpr uint32_t kBBytes = kColTile * kRowBytes;  // 32 KiB
constexpr uint32_t kStageBytes = kABytes + kBBytes;
constexpr int kThreads = 384;  // producer warpgroup + 2 consumer warpgroups
constexpr int kConsumerWarps = 8;
constexpr int kAccumulators = kColTile / 2;  // fp32 per thread of a 64 x 256 wgmma
// Register split after setmaxnreg: 128 x 40 + 256 x 232 = 64512 of the SM's 65536 (the kernel is launched with
// 168 per thread, the __launch_bounds__ limit of 384 threads).
constexpr int kProducerRegisters = 40;
constexpr int kConsumerRegisters = 232;
// Dynamic shared memory: 1024 bytes to align the tiles (128-byte swizzle atoms span 1024 bytes), the stages, the
// full/empty barriers, then the schedule: offsets [E + 1] and row-tile prefix [E + 1].
constexpr size_t kSmemBytes = 1024 + size_t{kStages} * kStageBytes + 2 * kStages * sizeof(uint64_t) +
                              2 * (size_t{kMoeMaxExperts} + 1) * sizeof(int32_t);
static_assert(kStageBytes % 1024 == 0 && kABytes % 1024 == 0, "tiles must stay 1024-byte aligned");
static_assert(kSmemBytes <= 227 * 1024, "shared memory per block");

enum class Mode { kGateUpSwiGlu, kGateUpSitu, kDown };

struct WgmmaArgs {
  const int32_t* offsets;    // [E + 1]
  __nv_bfloat16* activated;  // gate/up modes: out [R, I]
  float* y;                  // down mode: out [R, W]
  int E;
  int k_tiles;  // ceil(K / 64), K = W (gate/up) or I (down)
  int n_tiles;  // column tiles: ceil(I / 128) (gate/up) or ceil(W / 256) (down)
  int N;        // output columns: I or W
  int b_rows;   // weight rows per expert: 2I or W
  float beta, beta_linear;
};

struct Tile {
  int expert, row0, row_end, col_tile;
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

template <Mode kMode>
__device__ __forceinline__ void store_tile(const float (&acc)[kAccumulators], const WgmmaArgs& p, const Tile& tile,
                                           int consumer) {
  // Accumulator i of this thread: row 16 * warp + lane / 4 + 8 * ((i % 4) / 2), column 8 * (i / 4) + 2 * (lane % 4)
  // + i % 2 of the warpgroup's 64 x 256 block (sm90_ptx.cuh).
  const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  const int row_base = tile.row0 + consumer * kWarpgroupRows + 16 * warp + (lane >> 2);
  if constexpr (kMode == Mode::kDown) {
    const int col_base = tile.col_tile * kColTile + 2 * (lane & 3);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row_base + 8 * h;
      if (row >= tile.row_end) continue;
      float* out = p.y + static_cast<int64_t>(row) * p.N;
#pragma unroll
      for (int block = 0; block < kColTile / 8; ++block) {
        const int col = col_base + 8 * block;
        // N is a multiple of 8, so col < N implies col + 1 < N.
        if (col < p.N) {
          *reinterpret_cast<float2*>(out + col) = make_float2(acc[4 * block + 2 * h], acc[4 * block + 2 * h + 1]);
        }
      }
    }
  } else {
    // Columns c < 128 are gate(j0 + c), c + 128 are up(j0 + c): register block b pairs with block b + 16.
    constexpr int kUp = kColTile / 2 / 8 * 4;
    const int col_base = tile.col_tile * (kColTile / 2) + 2 * (lane & 3);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row_base + 8 * h;
      if (row >= tile.row_end) continue;
      __nv_bfloat16* out = p.activated + static_cast<int64_t>(row) * p.N;
#pragma unroll
      for (int block = 0; block < kColTile / 2 / 8; ++block) {
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

template <Mode kMode>
__global__ void __launch_bounds__(kThreads, 1)
    moe_wgmma_kernel(const __grid_constant__ CUtensorMap a_map, const __grid_constant__ CUtensorMap b_map,
                     const WgmmaArgs p) {
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = smem_address(smem_raw);
  const uint32_t tiles = (raw + 1023u) & ~1023u;  // stage s: A at tiles + s * kStageBytes, B kABytes later
  unsigned char* smem = smem_raw + (tiles - raw);
  const uint32_t full_bars = tiles + kStages * kStageBytes;  // 8 bytes each
  const uint32_t empty_bars = full_bars + kStages * 8;
  int* s_offsets = reinterpret_cast<int*>(smem + kStages * kStageBytes + 2 * kStages * 8);
  int* s_prefix = s_offsets + p.E + 1;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      sm90::mbarrier_init(full_bars + 8 * s, 1);                // the producer's arrive.expect_tx
      sm90::mbarrier_init(empty_bars + 8 * s, kConsumerWarps);  // one arrival per consumer warp
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
    int stage = 0;
    uint32_t phase = 0;
    for (int t = blockIdx.x; t < total; t += gridDim.x) {
      const Tile tile = decode_tile(t, p.n_tiles, p.E, s_offsets, s_prefix);
      int b_row0, b_row1;
      if constexpr (kMode == Mode::kDown) {
        b_row0 = tile.expert * p.b_rows + tile.col_tile * kColTile;
        b_row1 = b_row0 + kBoxRows;
      } else {
        b_row0 = tile.expert * p.b_rows + tile.col_tile * (kColTile / 2);  // gate rows j0 ..
        b_row1 = b_row0 + p.N;                                             // up rows I + j0 ..
      }
      for (int kt = 0; kt < p.k_tiles; ++kt) {
        sm90::mbarrier_wait(empty_bars + 8 * stage, phase ^ 1u);
        const uint32_t full = full_bars + 8 * stage;
        const uint32_t a_dst = tiles + stage * kStageBytes, b_dst = a_dst + kABytes;
        sm90::mbarrier_arrive_expect_tx(full, kStageBytes);
        sm90::tma_load_2d(a_dst, &a_map, full, kt * kKTile, tile.row0);
        sm90::tma_load_2d(b_dst, &b_map, full, kt * kKTile, b_row0);
        sm90::tma_load_2d(b_dst + kBoxRows * kRowBytes, &b_map, full, kt * kKTile, b_row1);
        if (++stage == kStages) {
          stage = 0;
          phase ^= 1u;
        }
      }
    }
    return;
  }

  sm90::warpgroup_claim_registers<kConsumerRegisters>();
  const int consumer = warpgroup - 1;  // rows 64 * consumer .. + 63 of each tile
  float acc[kAccumulators];
#pragma unroll
  for (int i = 0; i < kAccumulators; ++i) acc[i] = 0.0f;
  int stage = 0;
  uint32_t phase = 0;
  for (int t = blockIdx.x; t < total; t += gridDim.x) {
    const Tile tile = decode_tile(t, p.n_tiles, p.E, s_offsets, s_prefix);
    if (tile.row0 + consumer * kWarpgroupRows >= tile.row_end) {
      // All 64 rows past the expert's end: no wgmma, no stores. The stages are still waited for (full) before they
      // are released, so these arrivals always complete the phase the producer is waiting on, never a later one.
      for (int kt = 0; kt < p.k_tiles; ++kt) {
        sm90::mbarrier_wait(full_bars + 8 * stage, phase);
        if (lane == 0) sm90::mbarrier_arrive(empty_bars + 8 * stage);
        if (++stage == kStages) {
          stage = 0;
          phase ^= 1u;
        }
      }
      continue;
    }
    int previous = 0;
    for (int kt = 0; kt < p.k_tiles; ++kt) {
      sm90::mbarrier_wait(full_bars + 8 * stage, phase);
      const uint32_t a_base = tiles + stage * kStageBytes + consumer * kWarpgroupRows * kRowBytes;
      const uint32_t b_base = tiles + stage * kStageBytes + kABytes;
#pragma unroll
      for (int i = 0; i < kAccumulators; ++i) sm90::wgmma_fence_register(acc[i]);
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
#pragma unroll
      for (int i = 0; i < kAccumulators; ++i) sm90::wgmma_fence_register(acc[i]);
      previous = stage;
      if (++stage == kStages) {
        stage = 0;
        phase ^= 1u;
      }
    }
    sm90::wgmma_wait_group<0>();
#pragma unroll
    for (int i = 0; i < kAccumulators; ++i) sm90::wgmma_fence_register(acc[i]);
    if (lane == 0) sm90::mbarrier_arrive(empty_bars + 8 * previous);
    store_tile<kMode>(acc, p, tile, consumer);
  }
}

// Row-major bf16 [rows, inner] read as boxes of 64 (k) x 128 rows, 128-byte swizzle, zero fill out of range.
Status encode_map(PFN_cuTensorMapEncodeTiled_v12000 encode, CUtensorMap* map, const __nv_bfloat16* base, int64_t inner,
                  int64_t rows, const char* what) {
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(inner), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(inner) * sizeof(__nv_bfloat16)};
  const cuuint32_t box[2] = {kKTile, kBoxRows};
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

template <Mode kMode>
Status launch(const CUtensorMap& a_map, const CUtensorMap& b_map, const WgmmaArgs& args, int grid, cudaStream_t stream,
              const char* what) {
  // Above 48 KiB the opt-in is needed; a per-function attribute (no stream work), so capture is unaffected.
  cudaError_t error = cudaFuncSetAttribute(moe_wgmma_kernel<kMode>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(kSmemBytes));
  if (error != cudaSuccess) {
    return internal_error(std::string("moe_expert_ffn_wgmma: shared memory attribute: ") + cudaGetErrorString(error));
  }
  moe_wgmma_kernel<kMode><<<grid, kThreads, kSmemBytes, stream>>>(a_map, b_map, args);
  error = cudaGetLastError();
  if (error == cudaSuccess) return Status::ok();
  return internal_error(std::string("moe_expert_ffn_wgmma ") + what + ": launch: " + cudaGetErrorName(error) + " (" +
                        cudaGetErrorString(error) + ")");
}

}  // namespace

Status moe_expert_ffn_wgmma(const MoeFfnParams& params, cudaStream_t stream, MoeWgmmaStage stage) {
  const MoeExpertWeights& w = params.weights;
  const int64_t W = w.width, I = w.intermediate, R = params.rows;
  const int E = w.num_experts;
  DS_RETURN_IF_ERROR(detail::validate_moe_ffn_sizes(params, "moe_expert_ffn_wgmma"));
  if (E * 2 * I >= (int64_t{1} << 31) || E * W >= (int64_t{1} << 31)) {
    return invalid_argument("moe_expert_ffn_wgmma: E * 2I and E * width must stay below 2^31 (TMA coordinates)");
  }
  const int64_t gate_up_tiles = (I + kColTile / 2 - 1) / (kColTile / 2), down_tiles = (W + kColTile - 1) / kColTile;
  const int64_t max_row_tiles = (R + kRowTile - 1) / kRowTile + (R < E ? R : E);
  if (R < 0 || R > 0x7fffffff ||
      max_row_tiles * (gate_up_tiles > down_tiles ? gate_up_tiles : down_tiles) > 0x7fffffff) {
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
  const PFN_cuTensorMapEncodeTiled_v12000 encode = detail::tensor_map_encoder();
  if (encode == nullptr) return unimplemented("moe_expert_ffn_wgmma: the driver has no cuTensorMapEncodeTiled");

  WgmmaArgs args{params.expert_offsets, params.activated,       params.y_sorted, E, 0, 0, 0, 0,
                 params.situ_beta,      params.situ_linear_beta};
  CUtensorMap gate_up_a, gate_up_b, down_a, down_b;
  const bool run_gate_up = stage != MoeWgmmaStage::kDown, run_down = stage != MoeWgmmaStage::kGateUp;
  if (run_gate_up) {
    Status status = encode_map(encode, &gate_up_a, params.x_sorted, W, R, "x_sorted");
    if (status) status = encode_map(encode, &gate_up_b, w.gate_up, W, E * 2 * I, "gate_up");
    if (!status) return status;
  }
  if (run_down) {
    Status status = encode_map(encode, &down_a, params.activated, I, R, "activated");
    if (status) status = encode_map(encode, &down_b, w.down, I, E * W, "down");
    if (!status) return status;
  }
  if (run_gate_up) {
    WgmmaArgs gu = args;
    gu.k_tiles = static_cast<int>((W + kKTile - 1) / kKTile);
    gu.n_tiles = static_cast<int>(gate_up_tiles);
    gu.N = static_cast<int>(I);
    gu.b_rows = static_cast<int>(2 * I);
    const int grid = static_cast<int>(std::min<int64_t>(sms, max_row_tiles * gate_up_tiles));
    const Status status = params.glu == GluKind::kSitu
                              ? launch<Mode::kGateUpSitu>(gate_up_a, gate_up_b, gu, grid, stream, "gate/up")
                              : launch<Mode::kGateUpSwiGlu>(gate_up_a, gate_up_b, gu, grid, stream, "gate/up");
    if (!status) return status;
  }
  if (run_down) {
    WgmmaArgs down = args;
    down.k_tiles = static_cast<int>((I + kKTile - 1) / kKTile);
    down.n_tiles = static_cast<int>(down_tiles);
    down.N = static_cast<int>(W);
    down.b_rows = static_cast<int>(W);
    const int grid = static_cast<int>(std::min<int64_t>(sms, max_row_tiles * down_tiles));
    return launch<Mode::kDown>(down_a, down_b, down, grid, stream, "down");
  }
  return Status::ok();
}

}  // namespace deltaserve::kernels::cuda
