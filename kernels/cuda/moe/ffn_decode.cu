// MoE expert FFN, decode path (contract in moe.hpp): few rows per expert, so the cost is reading the active
// experts' weights once. Two launches, each a grid of (expert slot, tile of output columns) CTAs of 8 warps:
//   1. gate/up: a warp owns 2 intermediate columns j, streams gate row j and up row I + j (16-byte loads, 4 per
//      lane per step) against the expert's x rows held in shared memory, reduces, and writes
//      activated[r, j] = bf16(glu(gate, up)) (fp32 math, rounded once);
//   2. down: a warp owns 4 output columns d, streams down rows d against the activated rows in shared memory and
//      writes y_sorted[r, d] in fp32.
// Slot s of the grid is the s-th expert with rows (found by a block-wide scan of expert_offsets, in shared memory),
// so there are min(E, R) slots and a CTA whose slot has no expert exits after that scan. Rows of an expert are
// processed in tiles of up to 4, with the tile's row count rounded up to 1, 2 or 4 at compile time so a decode
// step with one or two rows per expert does no wasted FMAs. Bytes per active expert: 2 I W (gate/up) + I W
// (down), times 2 bytes, once per tile of 4 rows. Two CTAs of 8 warps per SM (<= 128 registers, no spills).
// Batches of more than kMoeDecodeGemvRowsPerExpert rows per expert go to moe_expert_ffn_grouped (tensor cores,
// weights read once per row tile of 32 to 128 rows).
#include <string>

#include "kernels/cuda/common/detail/activations.cuh"
#include "kernels/cuda/moe/moe.hpp"

namespace deltaserve::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kRowTile = 4;
constexpr int kGateUpColsPerWarp = 2;  // intermediate columns per warp (2 weight rows each)
constexpr int kDownColsPerWarp = 4;    // output columns per warp (1 weight row each)
constexpr int kGateUpColsPerCta = kWarps * kGateUpColsPerWarp;
constexpr int kDownColsPerCta = kWarps * kDownColsPerWarp;
constexpr int64_t kMaxSmemBytes = 227 * 1024;

struct FfnArgs {
  const __nv_bfloat16* gate_up;
  const __nv_bfloat16* down;
  const __nv_bfloat16* x_sorted;
  const int32_t* offsets;
  __nv_bfloat16* activated;
  float* y_sorted;
  int E;
  int width, inter;  // W, I (multiples of 8)
  int glu_situ;
  float beta, beta_linear;
};

// Finds the slot-th expert (in id order) whose row range is non-empty. Returns false (uniformly) if none.
__device__ bool find_active_expert(const int32_t* offsets, int E, int slot, int* expert, int* begin, int* end) {
  __shared__ int warp_counts[kWarps];
  __shared__ int found;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (tid == 0) found = -1;
  int before = 0;  // active experts in earlier chunks
  for (int base = 0; base < E; base += kThreads) {
    const int e = base + tid;
    const bool active = e < E && offsets[e + 1] > offsets[e];
    const unsigned ballot = __ballot_sync(0xffffffffu, active);
    if (lane == 0) warp_counts[warp] = __popc(ballot);
    __syncthreads();
    int rank = before + __popc(ballot & ((1u << lane) - 1u));
    int chunk_total = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      if (w < warp) rank += warp_counts[w];
      chunk_total += warp_counts[w];
    }
    if (active && rank == slot) found = e;
    __syncthreads();
    if (found >= 0) break;  // uniform: every thread reads it after the barrier
    before += chunk_total;
    if (before > slot) break;  // cannot happen (the slot would have been found); kept as a guard
    __syncthreads();           // warp_counts is rewritten in the next chunk
  }
  const int e = found;
  if (e < 0) return false;
  *expert = e;
  *begin = offsets[e];
  *end = offsets[e + 1];
  return true;
}

__device__ __forceinline__ void bf16x8_to_float(const uint4& v, float (&f)[8]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 p = __bfloat1622float2(h[i]);
    f[2 * i] = p.x;
    f[2 * i + 1] = p.y;
  }
}

// acc[c][r] += dot(weight row c, x row r) over this lane's 16-byte chunks (lane, lane + 32, ...).
// wrows[c]: the NC weight rows (chunks of 8 bf16); xs: R rows of `chunks` chunks in shared memory.
template <int R, int NC>
__device__ __forceinline__ void warp_dot_rows(const uint4* const (&wrows)[NC], const uint4* xs, int chunks,
                                              float (&acc)[NC][R]) {
  const int lane = threadIdx.x & 31;
#pragma unroll 2
  for (int ch = lane; ch < chunks; ch += 32) {
    uint4 wv[NC];
#pragma unroll
    for (int c = 0; c < NC; ++c) wv[c] = __ldg(wrows[c] + ch);
    float wf[NC][8];
#pragma unroll
    for (int c = 0; c < NC; ++c) bf16x8_to_float(wv[c], wf[c]);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float xf[8];
      bf16x8_to_float(xs[r * chunks + ch], xf);
#pragma unroll
      for (int c = 0; c < NC; ++c) {
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[c][r] = fmaf(wf[c][i], xf[i], acc[c][r]);
      }
    }
  }
#pragma unroll
  for (int c = 0; c < NC; ++c) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) acc[c][r] += __shfl_xor_sync(0xffffffffu, acc[c][r], offset);
    }
  }
}

// Copies rows [r0, r0 + nr) of src (row length `chunks` 16-byte chunks) to shared memory and zeroes rows
// [nr, R_fill) so the compile-time row count of the dot loop reads defined values.
__device__ __forceinline__ void load_rows(const __nv_bfloat16* src, int64_t r0, int nr, int r_fill, int chunks,
                                          uint4* xs) {
  const uint4* s = reinterpret_cast<const uint4*>(src) + r0 * chunks;
  for (int i = threadIdx.x; i < r_fill * chunks; i += kThreads) {
    xs[i] = i < nr * chunks ? __ldg(s + i) : make_uint4(0u, 0u, 0u, 0u);
  }
}

__device__ __forceinline__ float glu(const FfnArgs& p, float gate, float up) {
  return p.glu_situ ? situ_glu_f(gate, up, p.beta, p.beta_linear) : swiglu_f(gate, up);
}

template <int R>
__device__ __forceinline__ void gate_up_tile(const FfnArgs& p, const __nv_bfloat16* w, int64_t r0, int nr,
                                             const uint4* xs) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int chunks = p.width / 8;
  const int j0 = blockIdx.y * kGateUpColsPerCta + warp * kGateUpColsPerWarp;
  // NC = 2 columns x (gate, up) = 4 weight rows; out-of-range columns read the last valid one (results dropped).
  const uint4* wrows[2 * kGateUpColsPerWarp];
#pragma unroll
  for (int c = 0; c < kGateUpColsPerWarp; ++c) {
    const int j = min(j0 + c, p.inter - 1);
    wrows[2 * c] = reinterpret_cast<const uint4*>(w + static_cast<int64_t>(j) * p.width);
    wrows[2 * c + 1] = reinterpret_cast<const uint4*>(w + static_cast<int64_t>(p.inter + j) * p.width);
  }
  float acc[2 * kGateUpColsPerWarp][R] = {};
  warp_dot_rows<R, 2 * kGateUpColsPerWarp>(wrows, xs, chunks, acc);
#pragma unroll
  for (int c = 0; c < kGateUpColsPerWarp; ++c) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (lane == (c * R + r) % 32 && r < nr && j0 + c < p.inter) {
        p.activated[(r0 + r) * p.inter + j0 + c] = __float2bfloat16(glu(p, acc[2 * c][r], acc[2 * c + 1][r]));
      }
    }
  }
}

template <int R>
__device__ __forceinline__ void down_tile(const FfnArgs& p, const __nv_bfloat16* w, int64_t r0, int nr,
                                          const uint4* as) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int chunks = p.inter / 8;
  const int d0 = blockIdx.y * kDownColsPerCta + warp * kDownColsPerWarp;
  const uint4* wrows[kDownColsPerWarp];
#pragma unroll
  for (int c = 0; c < kDownColsPerWarp; ++c) {
    const int d = min(d0 + c, p.width - 1);
    wrows[c] = reinterpret_cast<const uint4*>(w + static_cast<int64_t>(d) * p.inter);
  }
  float acc[kDownColsPerWarp][R] = {};
  warp_dot_rows<R, kDownColsPerWarp>(wrows, as, chunks, acc);
#pragma unroll
  for (int c = 0; c < kDownColsPerWarp; ++c) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (lane == (c * R + r) % 32 && r < nr && d0 + c < p.width) {
        p.y_sorted[(r0 + r) * p.width + d0 + c] = acc[c][r];
      }
    }
  }
}

__global__ void __launch_bounds__(kThreads, 2) moe_gate_up_kernel(FfnArgs p) {
  extern __shared__ uint4 xs[];  // [kRowTile, W / 8]
  int e, begin, end;
  if (!find_active_expert(p.offsets, p.E, blockIdx.x, &e, &begin, &end)) return;
  const __nv_bfloat16* w = p.gate_up + static_cast<int64_t>(e) * 2 * p.inter * p.width;
  const int chunks = p.width / 8;
  for (int64_t r0 = begin; r0 < end; r0 += kRowTile) {
    const int nr = static_cast<int>(min(static_cast<int64_t>(kRowTile), end - r0));
    const int rt = nr <= 1 ? 1 : (nr <= 2 ? 2 : 4);
    __syncthreads();  // the previous tile is done with xs
    load_rows(p.x_sorted, r0, nr, rt, chunks, xs);
    __syncthreads();
    switch (rt) {
      case 1:
        gate_up_tile<1>(p, w, r0, nr, xs);
        break;
      case 2:
        gate_up_tile<2>(p, w, r0, nr, xs);
        break;
      default:
        gate_up_tile<4>(p, w, r0, nr, xs);
        break;
    }
  }
}

__global__ void __launch_bounds__(kThreads, 2) moe_down_kernel(FfnArgs p) {
  extern __shared__ uint4 as[];  // [kRowTile, I / 8]
  int e, begin, end;
  if (!find_active_expert(p.offsets, p.E, blockIdx.x, &e, &begin, &end)) return;
  const __nv_bfloat16* w = p.down + static_cast<int64_t>(e) * p.width * p.inter;
  const int chunks = p.inter / 8;
  for (int64_t r0 = begin; r0 < end; r0 += kRowTile) {
    const int nr = static_cast<int>(min(static_cast<int64_t>(kRowTile), end - r0));
    const int rt = nr <= 1 ? 1 : (nr <= 2 ? 2 : 4);
    __syncthreads();
    load_rows(p.activated, r0, nr, rt, chunks, as);
    __syncthreads();
    switch (rt) {
      case 1:
        down_tile<1>(p, w, r0, nr, as);
        break;
      case 2:
        down_tile<2>(p, w, r0, nr, as);
        break;
      default:
        down_tile<4>(p, w, r0, nr, as);
        break;
    }
  }
}

bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

Status launch_status(const char* what) {
  const cudaError_t error = cudaGetLastError();
  if (error == cudaSuccess) return Status::ok();
  return internal_error(std::string(what) + ": launch: " + cudaGetErrorName(error) + " (" + cudaGetErrorString(error) +
                        ")");
}

}  // namespace

Status moe_expert_ffn_decode(const MoeFfnParams& params, cudaStream_t stream) {
  const MoeExpertWeights& w = params.weights;
  const int64_t W = w.width, I = w.intermediate, R = params.rows;
  if (w.num_experts < 1) return invalid_argument("moe_expert_ffn_decode: num_experts must be >= 1");
  if (W < 8 || W % 8 != 0 || I < 8 || I % 8 != 0) {
    return invalid_argument("moe_expert_ffn_decode: width and intermediate must be positive multiples of 8 (got " +
                            std::to_string(W) + ", " + std::to_string(I) + ")");
  }
  if (kRowTile * W * 2 > kMaxSmemBytes || kRowTile * I * 2 > kMaxSmemBytes) {
    return invalid_argument("moe_expert_ffn_decode: width and intermediate must be <= 29056");
  }
  if (R < 0 || R > 0x7fffffff) return invalid_argument("moe_expert_ffn_decode: rows out of range");
  if (params.glu == GluKind::kSitu && !(params.situ_beta > 0.0f && params.situ_linear_beta > 0.0f)) {
    return invalid_argument("moe_expert_ffn_decode: SiTU betas must be positive");
  }
  if (R == 0) return Status::ok();
  if (w.gate_up == nullptr || w.down == nullptr || params.x_sorted == nullptr || params.expert_offsets == nullptr ||
      params.activated == nullptr || params.y_sorted == nullptr) {
    return invalid_argument("moe_expert_ffn_decode: weights, x_sorted, expert_offsets, activated, y_sorted: non-null");
  }
  if (!aligned16(w.gate_up) || !aligned16(w.down) || !aligned16(params.x_sorted) || !aligned16(params.activated)) {
    return invalid_argument("moe_expert_ffn_decode: gate_up, down, x_sorted and activated must be 16-byte aligned");
  }
  if (R > kMoeDecodeGemvRowsPerExpert * w.num_experts) {
    const Status grouped = moe_expert_ffn_grouped(params, stream);
    if (grouped.code() != StatusCode::kInvalidArgument) return grouped;
    // The grouped path's own constraints were not met: the GEMV kernels below handle any R.
  }
  const int64_t gate_up_tiles = (I + kGateUpColsPerCta - 1) / kGateUpColsPerCta;
  const int64_t down_tiles = (W + kDownColsPerCta - 1) / kDownColsPerCta;
  if (gate_up_tiles > 65535 || down_tiles > 65535) return invalid_argument("moe_expert_ffn_decode: too wide");

  FfnArgs args{w.gate_up,           w.down,
               params.x_sorted,     params.expert_offsets,
               params.activated,    params.y_sorted,
               w.num_experts,       static_cast<int>(W),
               static_cast<int>(I), params.glu == GluKind::kSitu ? 1 : 0,
               params.situ_beta,    params.situ_linear_beta};
  const unsigned slots = static_cast<unsigned>(R < w.num_experts ? R : w.num_experts);
  const size_t smem1 = static_cast<size_t>(kRowTile * W * 2), smem2 = static_cast<size_t>(kRowTile * I * 2);
  // Only widths above 6144 need more than the default 48 KiB; the attribute call is then made on every launch
  // (it is per device). The served shapes never need it, so their launches stay plain graph-capturable kernels.
  constexpr size_t kDefaultSmem = 48 * 1024;
  cudaError_t error = cudaSuccess;
  if (smem1 > kDefaultSmem) {
    error =
        cudaFuncSetAttribute(moe_gate_up_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem1));
  }
  if (error == cudaSuccess && smem2 > kDefaultSmem) {
    error = cudaFuncSetAttribute(moe_down_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem2));
  }
  if (error != cudaSuccess) {
    return internal_error(std::string("moe_expert_ffn_decode: shared memory attribute: ") + cudaGetErrorString(error));
  }
  moe_gate_up_kernel<<<dim3(slots, static_cast<unsigned>(gate_up_tiles)), kThreads, smem1, stream>>>(args);
  Status status = launch_status("moe_expert_ffn_decode gate/up");
  if (!status) return status;
  moe_down_kernel<<<dim3(slots, static_cast<unsigned>(down_tiles)), kThreads, smem2, stream>>>(args);
  return launch_status("moe_expert_ffn_decode down");
}

}  // namespace deltaserve::kernels::cuda
