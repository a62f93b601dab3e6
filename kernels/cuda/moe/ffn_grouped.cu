// MoE expert FFN, grouped tensor-core path (contract in moe.hpp): two launches per layer, whatever the number of
// experts, with the tile schedule derived on the device from expert_offsets (no host sync, graph-capturable).
// moe_expert_ffn_grouped hands prefill-sized batches to the wgmma kernels (ffn_wgmma.cu); the mma.sync kernels here
// serve the rest and every batch the wgmma kernels decline.
//   1. gate/up + glu: C[r, :] = x_sorted[r, :] · GU_e^T, a CTA computes BM rows x BN / 2 activated columns by
//      multiplying against BN weight rows (the gate rows j and the up rows I + j of its columns, interleaved in
//      shared memory per warp so a thread holds gate and up of the same column), then applies the glu in registers
//      and writes bf16 `activated` (fp32 math, rounded once).
//   2. down: y_sorted[r, :] = activated[r, :] · D_e^T, a CTA computes BM rows x BN output columns in fp32.
// Grid: x = column tile (fastest, so the CTAs sharing one expert's row tile run together and reuse it in L2),
// y = global row tile. Row tiles are numbered expert by expert: expert e owns ceil(n_e / BM) of them; every CTA
// finds its (expert, row tile) with a block-wide scan of the E counts (E <= 1024, ~1 KB of L2 reads). The grid is
// sized for the worst case, ceil(R / BM) + min(E, R) row tiles; CTAs past the last real tile exit after the scan.
// Inner loop: mma.sync m16n8k16 bf16 -> fp32, 8 warps as 2 (rows) x 4 (columns), BK = 32 or 64 k per stage, a
// 3-stage cp.async pipeline; shared rows padded by 8 elements (ldmatrix rows fall in distinct banks).
// Tiles (BM x BN x BK, stages, smem): 32 x 128 x 32 and 64 x 128 x 32 (3, 38 / 45 KB: decode-sized batches,
// weights read once per row tile), 128 x 256 x 64 (3, 162 KB: prefill; one CTA per SM, 64 x 64 per warp, 176 bytes
// of shared-memory traffic per mma against 256 for a 128 x 128 tile; 64-wide k stages halve the block barriers per
// mma and load 128 contiguous bytes per row per cp.async group). Warps skip the m16 row tiles wholly past their
// expert's end.
// Bounds: rows past an expert's end and k past K are zero-filled (not read); columns past N are zero-filled and
// not stored. K and N are multiples of 8 (validated), so every 16-byte chunk is either fully in or fully out.
#include <string>
#include <type_traits>

#include "kernels/cuda/common/detail/activations.cuh"
#include "kernels/cuda/common/detail/mma_sm80.cuh"
#include "kernels/cuda/moe/detail/wgmma.hpp"
#include "kernels/cuda/moe/moe.hpp"

namespace deltaserve::kernels::cuda {
namespace {

using detail::cp_async16_zfill;
using detail::cp_async_commit;
using detail::cp_async_wait;
using detail::load_a;
using detail::load_b_nk;
using detail::mma_bf16_16816;

constexpr int kThreads = 256;
// Shared rows are padded by 8 elements (16 bytes): a row stride of BK + 8 elements is an odd number of 16-byte units
// (5 for BK = 32, 9 for BK = 64), so the 8 row addresses of one ldmatrix fall in distinct bank groups.
__host__ __device__ constexpr int lds_of(int bk) {
  return bk + 8;
}

struct GroupedArgs {
  const __nv_bfloat16* a;    // [R, K] rows grouped by expert
  const __nv_bfloat16* b;    // [E, N_rows, K] weights
  const int32_t* offsets;    // [E + 1]
  __nv_bfloat16* activated;  // gate/up mode out [R, I]
  float* y;                  // down mode out [R, W]
  int E;
  int K;           // reduction length (W for gate/up, I for down)
  int N;           // gate/up: I (activated columns); down: W
  int64_t b_rows;  // weight rows per expert (2I or W)
  int glu_situ;
  float beta, beta_linear;
};

constexpr size_t smem_bytes(int bm, int bn, int bk, int stages) {
  return static_cast<size_t>(stages) * (bm + bn) * lds_of(bk) * sizeof(__nv_bfloat16);
}

// Finds the expert owning global row tile `tile` (tiles of bm rows, numbered expert by expert). Returns false
// (uniformly across the block) if the tile is past the last one.
__device__ bool find_row_tile(const int32_t* offsets, int E, int tile, int bm, int* expert, int* row0, int* row_end) {
  __shared__ int warp_sums[kThreads / 32];
  __shared__ int found[3];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int per = (E + kThreads - 1) / kThreads;
  const int e0 = min(tid * per, E), e1 = min(e0 + per, E);
  int local = 0;
  for (int e = e0; e < e1; ++e) local += (offsets[e + 1] - offsets[e] + bm - 1) / bm;
  int inclusive = local;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int v = __shfl_up_sync(0xffffffffu, inclusive, d);
    if (lane >= d) inclusive += v;
  }
  if (lane == 31) warp_sums[warp] = inclusive;
  if (tid == 0) found[0] = -1;
  __syncthreads();
  int before = inclusive - local;
  for (int w = 0; w < warp; ++w) before += warp_sums[w];
  if (tile >= before && tile < before + local) {
    int t = tile - before;
    for (int e = e0; e < e1; ++e) {
      const int begin = offsets[e], n = offsets[e + 1] - begin;
      const int tiles = (n + bm - 1) / bm;
      if (t < tiles) {
        found[0] = e;
        found[1] = begin + t * bm;
        found[2] = offsets[e + 1];
        break;
      }
      t -= tiles;
    }
  }
  __syncthreads();
  if (found[0] < 0) return false;
  *expert = found[0];
  *row0 = found[1];
  *row_end = found[2];
  return true;
}

// BM rows x BN weight rows per CTA; 8 warps as 2 (rows) x 4 (columns), a warp owns BM / 2 rows x BN / 4 weight
// rows (kNj n8 tiles). kGateUp: the CTA's BN weight rows are the gate and up rows of activated columns
// j0 .. j0 + BN / 2 - 1, warp block wb (shared rows wb * BN / 4 ...) holding BN / 8 columns: first their gate rows,
// then their up rows, so gate (n-tile ni) and up (n-tile ni + kNj / 2) of a column sit in the same thread.
// Otherwise plain rows.
// BK: k elements per pipeline stage (32 or 64; 64 halves the barriers per FLOP and loads 128 contiguous bytes per
// weight row per stage).
template <int BM, int BN, int BK, int STAGES, bool kGateUp>
__global__ void __launch_bounds__(kThreads, BN >= 256 ? 1 : 2) moe_grouped_gemm_kernel(GroupedArgs p) {
  constexpr int kBK = BK;
  constexpr int kLds = lds_of(BK);
  constexpr int kWarpRows = BM / 2;       // 2 warps along rows
  constexpr int kMi = kWarpRows / 16;     // m16 tiles per warp
  constexpr int kWarpN = BN / 4;          // weight rows per warp
  constexpr int kNj = kWarpN / 8;         // n8 tiles per warp
  constexpr int kHalfN = kWarpN / 2;      // gate/up mode: activated columns per warp
  constexpr int kAChunks = BM * kBK / 8;  // 16-byte chunks of one A stage
  constexpr int kBChunks = BN * kBK / 8;
  constexpr int kASlots = (kAChunks + kThreads - 1) / kThreads;
  static_assert(BM % 32 == 0 && kBChunks % kThreads == 0 && kNj % 2 == 0 && BK % 16 == 0, "tile shape");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __nv_bfloat16* smem = reinterpret_cast<__nv_bfloat16*>(smem_raw);

  int expert, row0, row_end;
  if (!find_row_tile(p.offsets, p.E, blockIdx.y, BM, &expert, &row0, &row_end)) return;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp >> 2, wn = warp & 3;
  const int col_tile = blockIdx.x;
  const int n_cols = kGateUp ? BN / 2 : BN;
  const int c0 = col_tile * n_cols;  // first output column (activated column j0, or y column)
  const __nv_bfloat16* b_expert = p.b + static_cast<int64_t>(expert) * p.b_rows * p.K;

  // Per-thread load slots: global source row pointers (or nullptr when out of range) for this CTA's tile.
  // A: chunk i -> row i / 4, k chunk i % 4; B likewise.
  const __nv_bfloat16* a_src[kASlots];
  const __nv_bfloat16* b_src[kBChunks / kThreads];
#pragma unroll
  for (int s = 0; s < kASlots; ++s) {
    const int i = tid + s * kThreads, r = i / (kBK / 8), kc = i % (kBK / 8);
    const int row = row0 + r;
    a_src[s] = i < kAChunks && row < row_end ? p.a + static_cast<int64_t>(row) * p.K + kc * 8 : nullptr;
  }
#pragma unroll
  for (int s = 0; s < kBChunks / kThreads; ++s) {
    const int i = tid + s * kThreads, r = i / (kBK / 8), kc = i % (kBK / 8);
    int64_t wrow;
    bool valid;
    if (kGateUp) {
      const int within = r % kWarpN;
      const int j = c0 + (r / kWarpN) * kHalfN + within % kHalfN;
      valid = j < p.N;
      wrow = within >= kHalfN ? static_cast<int64_t>(p.N) + j : j;
    } else {
      const int n = c0 + r;
      valid = n < p.N;
      wrow = n;
    }
    b_src[s] = valid ? b_expert + wrow * p.K + kc * 8 : nullptr;
  }

  auto load_stage = [&](int stage, int kt) {
    __nv_bfloat16* sa = smem + stage * (BM + BN) * kLds;
    __nv_bfloat16* sb = sa + BM * kLds;
    const int k0 = kt * kBK;
#pragma unroll
    for (int s = 0; s < kASlots; ++s) {
      const int i = tid + s * kThreads, r = i / (kBK / 8), kc = i % (kBK / 8);
      if (kAChunks % kThreads != 0 && i >= kAChunks) break;  // BM = 32: half the threads load A
      const bool valid = a_src[s] != nullptr && k0 + kc * 8 < p.K;
      cp_async16_zfill(sa + r * kLds + kc * 8, valid ? a_src[s] + k0 : p.a, valid);
    }
#pragma unroll
    for (int s = 0; s < kBChunks / kThreads; ++s) {
      const int i = tid + s * kThreads, r = i / (kBK / 8), kc = i % (kBK / 8);
      const bool valid = b_src[s] != nullptr && k0 + kc * 8 < p.K;
      cp_async16_zfill(sb + r * kLds + kc * 8, valid ? b_src[s] + k0 : p.b, valid);
    }
  };

  float acc[kMi][kNj][4];
#pragma unroll
  for (int mi = 0; mi < kMi; ++mi) {
#pragma unroll
    for (int ni = 0; ni < kNj; ++ni) {
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[mi][ni][c] = 0.0f;
    }
  }

  const int k_tiles = (p.K + kBK - 1) / kBK;
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < k_tiles) load_stage(s, s);
    cp_async_commit();
  }
  // m16 tiles of this warp holding at least one of the expert's rows (warp-uniform). Tiles past the expert's end
  // (an expert's last row tile is usually partly empty: ~256 rows per expert in 128-row tiles leave about half
  // the experts a third tile of a few rows) skip their ldmatrix and mma: their accumulators stay zero and their
  // rows are never stored. Full tiles (the common case) run the unguarded loop.
  const int warp_rows = max(0, row_end - row0 - wm * kWarpRows);
  const int active_mi = min(kMi, (warp_rows + 15) / 16);
  auto main_loop = [&](auto guarded_tag) {
    constexpr bool kGuarded = decltype(guarded_tag)::value;
    for (int kt = 0; kt < k_tiles; ++kt) {
      cp_async_wait<STAGES - 2>();
      __syncthreads();  // stage kt landed for every thread; stage (kt - 1) % STAGES is free again
      const int next = kt + STAGES - 1;
      if (next < k_tiles) load_stage(next % STAGES, next);
      cp_async_commit();

      const __nv_bfloat16* sa = smem + (kt % STAGES) * (BM + BN) * kLds;
      const __nv_bfloat16* sb = sa + BM * kLds;
      if (kGuarded && active_mi == 0) continue;  // this warp only keeps the pipeline's barriers
#pragma unroll
      for (int kk = 0; kk < kBK; kk += 16) {
        uint32_t a[kMi][4];
#pragma unroll
        for (int mi = 0; mi < kMi; ++mi) {
          if (!kGuarded || mi < active_mi) load_a(a[mi], sa, kLds, wm * kWarpRows + mi * 16, kk);
        }
        uint32_t b[kNj / 2][4];
#pragma unroll
        for (int nb = 0; nb < kNj / 2; ++nb) load_b_nk(b[nb], sb, kLds, wn * kWarpN + nb * 16, kk);
#pragma unroll
        for (int mi = 0; mi < kMi; ++mi) {
          if (kGuarded && mi >= active_mi) continue;
#pragma unroll
          for (int ni = 0; ni < kNj; ++ni) {
            mma_bf16_16816(acc[mi][ni], a[mi], b[ni >> 1][(ni & 1) * 2], b[ni >> 1][(ni & 1) * 2 + 1]);
          }
        }
      }
    }
  };
  if (active_mi == kMi) {
    main_loop(std::false_type{});
  } else {
    main_loop(std::true_type{});
  }
  cp_async_wait<0>();

  // Epilogue. Accumulator (mi, ni, c): row wm * kWarpRows + mi * 16 + g + (c >= 2 ? 8 : 0),
  // shared column wn * kWarpN + ni * 8 + 2t + (c & 1).
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mi = 0; mi < kMi; ++mi) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = row0 + wm * kWarpRows + mi * 16 + g + half * 8;
      if (row >= row_end) continue;
      if (kGateUp) {
        // n-tiles ni < kNj / 2: gate of columns wn * kHalfN + ni * 8 + 2t (+1); ni + kNj / 2: up of the same.
#pragma unroll
        for (int ni = 0; ni < kNj / 2; ++ni) {
          const int j = c0 + wn * kHalfN + ni * 8 + 2 * t;
          if (j >= p.N) continue;  // N is even, so j + 1 < N too
          float v[2];
#pragma unroll
          for (int q = 0; q < 2; ++q) {
            const float gate = acc[mi][ni][half * 2 + q], up = acc[mi][ni + kNj / 2][half * 2 + q];
            v[q] = p.glu_situ ? situ_glu_f(gate, up, p.beta, p.beta_linear) : swiglu_f(gate, up);
          }
          *reinterpret_cast<__nv_bfloat162*>(p.activated + static_cast<int64_t>(row) * p.N + j) =
              __floats2bfloat162_rn(v[0], v[1]);
        }
      } else {
#pragma unroll
        for (int ni = 0; ni < kNj; ++ni) {
          const int n = c0 + wn * kWarpN + ni * 8 + 2 * t;
          if (n >= p.N) continue;
          *reinterpret_cast<float2*>(p.y + static_cast<int64_t>(row) * p.N + n) =
              make_float2(acc[mi][ni][half * 2], acc[mi][ni][half * 2 + 1]);
        }
      }
    }
  }
}

bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

Status launch_status(const char* what) {
  const cudaError_t error = cudaGetLastError();
  if (error == cudaSuccess) return Status::ok();
  return internal_error(std::string("moe_expert_ffn_grouped ") + what + ": launch: " + cudaGetErrorName(error) + " (" +
                        cudaGetErrorString(error) + ")");
}

template <int BM, int BN, int BK, int STAGES>
Status launch_grouped(const MoeFfnParams& params, cudaStream_t stream) {
  const MoeExpertWeights& w = params.weights;
  const int64_t W = w.width, I = w.intermediate, R = params.rows;
  const int E = w.num_experts;
  const int64_t row_tiles = (R + BM - 1) / BM + (R < E ? R : E);
  if (row_tiles > 65535) {
    return invalid_argument("moe_expert_ffn_grouped: too many rows (" + std::to_string(R) + ") for row tiles of " +
                            std::to_string(BM));
  }
  const GroupedArgs common{nullptr,
                           nullptr,
                           params.expert_offsets,
                           params.activated,
                           params.y_sorted,
                           E,
                           0,
                           0,
                           0,
                           params.glu == GluKind::kSitu ? 1 : 0,
                           params.situ_beta,
                           params.situ_linear_beta};
  constexpr size_t kSmem = smem_bytes(BM, BN, BK, STAGES);
  // Above the default 48 KiB the opt-in is needed; it is a per-function attribute (no stream work), so the
  // launches stay graph-capturable.
  constexpr size_t kDefaultSmem = 48 * 1024;
  if (kSmem > kDefaultSmem) {
    for (const void* f : {reinterpret_cast<const void*>(moe_grouped_gemm_kernel<BM, BN, BK, STAGES, true>),
                          reinterpret_cast<const void*>(moe_grouped_gemm_kernel<BM, BN, BK, STAGES, false>)}) {
      const cudaError_t error =
          cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSmem));
      if (error != cudaSuccess) {
        return internal_error(std::string("moe_expert_ffn_grouped: shared memory attribute: ") +
                              cudaGetErrorString(error));
      }
    }
  }
  GroupedArgs gu = common;
  gu.a = params.x_sorted;
  gu.b = w.gate_up;
  gu.K = static_cast<int>(W);
  gu.N = static_cast<int>(I);
  gu.b_rows = 2 * I;
  const dim3 grid_gu(static_cast<unsigned>((I + BN / 2 - 1) / (BN / 2)), static_cast<unsigned>(row_tiles));
  moe_grouped_gemm_kernel<BM, BN, BK, STAGES, true><<<grid_gu, kThreads, kSmem, stream>>>(gu);
  Status status = launch_status("gate/up");
  if (!status) return status;
  GroupedArgs down = common;
  down.a = params.activated;
  down.b = w.down;
  down.K = static_cast<int>(I);
  down.N = static_cast<int>(W);
  down.b_rows = W;
  const dim3 grid_down(static_cast<unsigned>((W + BN - 1) / BN), static_cast<unsigned>(row_tiles));
  moe_grouped_gemm_kernel<BM, BN, BK, STAGES, false><<<grid_down, kThreads, kSmem, stream>>>(down);
  return launch_status("down");
}

}  // namespace

int moe_grouped_row_tile(int64_t rows, int num_experts) {
  const int64_t e = num_experts;
  if (rows <= kMoeGroupedTinyTileRowsPerExpert * e) return 32;
  return rows <= kMoeGroupedSmallTileRowsPerExpert * e ? 64 : 128;
}

namespace detail {

Status validate_moe_ffn_sizes(const MoeFfnParams& params, const char* who) {
  const MoeExpertWeights& w = params.weights;
  const int64_t W = w.width, I = w.intermediate;
  if (w.num_experts < 1 || w.num_experts > kMoeMaxExperts) {
    return invalid_argument(std::string(who) + ": num_experts must be in [1, 1024] (got " +
                            std::to_string(w.num_experts) + ")");
  }
  if (W < 8 || W % 8 != 0 || I < 8 || I % 8 != 0 || W > (1 << 30) || I > (1 << 30)) {
    return invalid_argument(std::string(who) + ": width and intermediate must be positive multiples of 8 (got " +
                            std::to_string(W) + ", " + std::to_string(I) + ")");
  }
  return Status::ok();
}

Status validate_moe_ffn_glu(const MoeFfnParams& params, const char* who) {
  if (params.glu == GluKind::kSitu && !(params.situ_beta > 0.0f && params.situ_linear_beta > 0.0f)) {
    return invalid_argument(std::string(who) + ": SiTU betas must be positive");
  }
  return Status::ok();
}

Status validate_moe_ffn_buffers(const MoeFfnParams& params, const char* who) {
  const MoeExpertWeights& w = params.weights;
  if (w.gate_up == nullptr || w.down == nullptr || params.x_sorted == nullptr || params.expert_offsets == nullptr ||
      params.activated == nullptr || params.y_sorted == nullptr) {
    return invalid_argument(std::string(who) + ": weights, x_sorted, expert_offsets, activated, y_sorted: non-null");
  }
  if (!aligned16(w.gate_up) || !aligned16(w.down) || !aligned16(params.x_sorted) || !aligned16(params.activated) ||
      (reinterpret_cast<uintptr_t>(params.y_sorted) & 7u) != 0) {
    return invalid_argument(std::string(who) +
                            ": gate_up, down, x_sorted, activated must be 16-byte aligned, y_sorted 8-byte");
  }
  return Status::ok();
}

}  // namespace detail

namespace {

// The launcher checks of moe_expert_ffn_grouped; ok with *nothing_to_do set when R == 0.
Status validate_grouped(const MoeFfnParams& params, const char* who, bool* nothing_to_do) {
  const MoeExpertWeights& w = params.weights;
  const int64_t W = w.width, I = w.intermediate, R = params.rows;
  DS_RETURN_IF_ERROR(detail::validate_moe_ffn_sizes(params, who));
  if (R < 0 || R > 0x7fffffff || R * W > (int64_t{1} << 62) / 4 || R * I > (int64_t{1} << 62) / 4) {
    return invalid_argument(std::string(who) + ": rows out of range");
  }
  DS_RETURN_IF_ERROR(detail::validate_moe_ffn_glu(params, who));
  *nothing_to_do = R == 0;
  if (R == 0) return Status::ok();
  return detail::validate_moe_ffn_buffers(params, who);
}

// The mma.sync kernels at the row tile of moe_grouped_row_tile (validated params, R > 0).
Status run_mma_sync(const MoeFfnParams& params, cudaStream_t stream) {
  switch (moe_grouped_row_tile(params.rows, params.weights.num_experts)) {
    case 32:
      return launch_grouped<32, 128, 32, 3>(params, stream);
    case 64:
      return launch_grouped<64, 128, 32, 3>(params, stream);
    default:
      return launch_grouped<128, 256, 64, 3>(params, stream);
  }
}

}  // namespace

Status moe_expert_ffn_grouped(const MoeFfnParams& params, cudaStream_t stream) {
  bool nothing_to_do = false;
  DS_RETURN_IF_ERROR(validate_grouped(params, "moe_expert_ffn_grouped", &nothing_to_do));
  if (nothing_to_do) return Status::ok();
  if (params.rows > kMoeWgmmaMinRowsPerExpert * params.weights.num_experts) {
    const Status wgmma = moe_expert_ffn_wgmma(params, stream);
    if (wgmma.code() != StatusCode::kInvalidArgument && wgmma.code() != StatusCode::kUnimplemented) return wgmma;
    // Declined before launching anything (not Hopper, TMA coordinates out of range): the mma.sync kernels run.
  }
  return run_mma_sync(params, stream);
}

namespace detail {

Status moe_expert_ffn_grouped_mma_sync(const MoeFfnParams& params, cudaStream_t stream) {
  bool nothing_to_do = false;
  DS_RETURN_IF_ERROR(validate_grouped(params, "moe_expert_ffn_grouped", &nothing_to_do));
  if (nothing_to_do) return Status::ok();
  return run_mma_sync(params, stream);
}

}  // namespace detail

}  // namespace deltaserve::kernels::cuda
