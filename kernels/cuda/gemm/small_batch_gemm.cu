// Skinny GEMM for decode batches (rows <= 16): y_o = x · W_o^T for up to six weight matrices sharing x
// (bf16, or fp32 for the MoE router).
// Layout: a CTA of 8 warps copies the activation rows (zero-padded to the bucket size M) into shared memory (in
// the input type) once, then its warps walk "row groups" of R consecutive weight rows of one output in a grid-stride
// loop. For a group, lane l reads bytes [16 l, 16 l + 16) of every 512-byte slab of each of the R weight rows with
// 16-byte non-allocating loads, U slabs at a time (R * U loads in flight a lane), multiplies with the matching
// 8 (bf16) or 4 (fp32) activations of each of the M rows (one 16-byte shared load a row) and accumulates R * M fp32
// sums; a warp reduction ends the group and one lane per (row, output) writes. Weight bytes are read exactly once.
// skinny_gemm_kernel (3-16 rows) is that kernel with a plain launch. skinny_gemm_v2_kernel (1-2 rows, the engine's
// decode batches) keeps the layout and adds what a decode step at batch 1 needs:
//   * programmatic dependent launch, the first U slabs of each warp's first group loaded before the wait;
//   * the input RMSNorm fused into the staging of x (every CTA normalises the <= 2 fp32 rows itself, bitwise
//     rms_norm's bf16 rows), so the engine's decode step drops the separate rms_norm launch;
//   * split-K over the warps of a CTA when the row groups leave warps idle (choose_split);
//   * per-output bf16 / fp32 outputs and x column offsets: MLA's kv_a (fp32) and q_proj (bf16) in one launch, KDA's
//     f_b and g_b (the two halves of `low`) in one launch.
#include <algorithm>
#include <string>

#include "kernels/cuda/common/detail/bf16_stream.cuh"
#include "kernels/cuda/common/detail/rms_norm_order.cuh"
#include "kernels/cuda/common/launch_status.hpp"
#include "kernels/cuda/gemm/small_batch.hpp"

namespace deltaserve::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// Kernel arguments: the host params plus, per output, the first row group (prefix sums; group_begin[num_outputs]
// is the total).
struct SkinnyGemmArgs {
  SkinnyGemmParams p;
  int64_t group_begin[kSkinnyGemmMaxOutputs + 1];
};

using detail::load_streaming;

// acc += dot of the 16-byte vectors w and x: 8 bf16 or 4 fp32 values each.
__device__ __forceinline__ float dot16(const uint4& w, const uint4& x, float acc, __nv_bfloat16 /*tag*/) {
  return detail::dot8_bf16(w, x, acc);
}
__device__ __forceinline__ float dot16(const uint4& w, const uint4& x, float acc, float /*tag*/) {
  acc = fmaf(__uint_as_float(w.x), __uint_as_float(x.x), acc);
  acc = fmaf(__uint_as_float(w.y), __uint_as_float(x.y), acc);
  acc = fmaf(__uint_as_float(w.z), __uint_as_float(x.z), acc);
  acc = fmaf(__uint_as_float(w.w), __uint_as_float(x.w), acc);
  return acc;
}

__device__ __forceinline__ __nv_bfloat16 zero_of(__nv_bfloat16 /*tag*/) {
  return __float2bfloat16_rn(0.0f);
}
__device__ __forceinline__ float zero_of(float /*tag*/) {
  return 0.0f;
}

// The activation rows to shared memory as [M, cols] (rows >= p.rows zero), 16-byte copies when x's rows allow them;
// every thread of the CTA takes part, the caller synchronises.
template <class TIn, int M>
__device__ __forceinline__ void stage_rows(const SkinnyGemmParams& p, TIn* x_shared, int64_t cols) {
  constexpr int kVector = 16 / sizeof(TIn);
  const TIn* x = static_cast<const TIn*>(p.x);
  const bool x_vector = (p.x_stride % kVector == 0) && (reinterpret_cast<uintptr_t>(p.x) % 16 == 0);
  if (x_vector) {
    const int64_t chunks_per_row = cols / kVector;
    for (int64_t i = threadIdx.x; i < M * chunks_per_row; i += blockDim.x) {
      const int64_t m = i / chunks_per_row, c = i - m * chunks_per_row;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (m < p.rows) v = *reinterpret_cast<const uint4*>(x + m * p.x_stride + c * kVector);
      *reinterpret_cast<uint4*>(x_shared + m * cols + c * kVector) = v;
    }
  } else {
    for (int64_t i = threadIdx.x; i < M * cols; i += blockDim.x) {
      const int64_t m = i / cols, k = i - m * cols;
      x_shared[i] = m < p.rows ? x[m * p.x_stride + k] : zero_of(TIn{});
    }
  }
}

// TIn: element of x and weights. M: activation rows (bucket; rows >= params.rows are zero). R: weight rows a warp
// group. U: slabs in flight.
template <class TIn, int M, int R, int U, bool kBf16Out, bool kAccumulate>
__global__ void __launch_bounds__(kThreads) skinny_gemm_kernel(const __grid_constant__ SkinnyGemmArgs args) {
  constexpr int kVector = 16 / sizeof(TIn);  // elements a 16-byte load
  constexpr int kSlab = 32 * kVector;        // k elements one warp covers with one 16-byte load a lane
  extern __shared__ __align__(16) unsigned char shared_raw[];
  TIn* x_shared = reinterpret_cast<TIn*>(shared_raw);  // [M, in]
  const SkinnyGemmParams& p = args.p;
  const int64_t in = p.in;

  stage_rows<TIn, M>(p, x_shared, in);
  __syncthreads();

  const int lane = threadIdx.x & 31;
  const int64_t total_groups = args.group_begin[p.num_outputs];
  for (int64_t group = int64_t{blockIdx.x} * kWarps + (threadIdx.x >> 5); group < total_groups;
       group += int64_t{gridDim.x} * kWarps) {
    int o = 0;
    while (group >= args.group_begin[o + 1]) ++o;
    const SkinnyGemmOutput& out = p.outputs[o];
    const int64_t row0 = (group - args.group_begin[o]) * R;
    const TIn* w_rows[R];
#pragma unroll
    for (int r = 0; r < R; ++r)
      w_rows[r] = static_cast<const TIn*>(out.weight) + min(row0 + r, out.n - 1) * in;  // clamp: read, discard

    float acc[R][M];
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int m = 0; m < M; ++m) acc[r][m] = 0.0f;
    }
    for (int64_t k0 = int64_t{lane} * kVector; k0 < in; k0 += int64_t{kSlab} * U) {
      uint4 w[U][R];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t k = k0 + int64_t{u} * kSlab;
#pragma unroll
        for (int r = 0; r < R; ++r) w[u][r] = k < in ? load_streaming(w_rows[r] + k) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t k = k0 + int64_t{u} * kSlab;
        if (k < in) {
#pragma unroll
          for (int m = 0; m < M; ++m) {
            const uint4 xv = *reinterpret_cast<const uint4*>(x_shared + m * in + k);
#pragma unroll
            for (int r = 0; r < R; ++r) acc[r][m] = dot16(w[u][r], xv, acc[r][m], TIn{});
          }
        }
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int m = 0; m < M; ++m) {
        float v = acc[r][m];
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
        const int64_t n = row0 + r;
        if (lane == ((r * M + m) & 31) && m < p.rows && n < out.n) {
          if constexpr (kBf16Out) {
            static_cast<__nv_bfloat16*>(out.y)[m * out.y_stride + n] = __float2bfloat16_rn(v);
          } else if constexpr (kAccumulate) {
            static_cast<float*>(out.y)[m * out.y_stride + n] += v;
          } else {
            static_cast<float*>(out.y)[m * out.y_stride + n] = v;
          }
        }
      }
    }
  }
}

int64_t bucket_rows(int64_t rows) {
  if (rows <= 1) return 1;
  if (rows <= 2) return 2;
  if (rows <= 4) return 4;
  if (rows <= 8) return 8;
  return 16;
}

// Of the current device (a process may drive several); a plain attribute query.
int sm_count() {
  int device = 0, value = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&value, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || value < 1) {
    (void)cudaGetLastError();
    return 132;  // H200; only the grid size depends on it
  }
  return value;
}

// CTAs of `kernel` (kThreads, `shared_bytes` of dynamic shared memory) resident on the GPU at once, at least one
// per SM; opts the kernel into more than the default 48 KB of shared memory first when it needs it (per call: the
// attribute is per device; a host-side call, legal during graph capture).
template <class Kernel>
Status resident_ctas(Kernel kernel, size_t shared_bytes, int64_t* ctas) {
  if (shared_bytes > 48 * 1024) {
    const cudaError_t error = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                   static_cast<int>(kSkinnyGemmMaxSharedBytes));
    if (error != cudaSuccess) {
      return internal_error(std::string("skinny_gemm: cudaFuncSetAttribute: ") + cudaGetErrorName(error));
    }
  }
  int per_sm = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, shared_bytes) != cudaSuccess ||
      per_sm < 1) {
    (void)cudaGetLastError();
    per_sm = 1;
  }
  *ctas = int64_t{per_sm} * sm_count();
  return Status::ok();
}

// Row groups of R weight rows per output: group_begin[o] is output o's first, group_begin[num_outputs] the total
// (returned).
int64_t plan_row_groups(const SkinnyGemmParams& p, int R, int64_t* group_begin) {
  int64_t groups = 0;
  for (int o = 0; o < p.num_outputs; ++o) {
    group_begin[o] = groups;
    groups += (p.outputs[o].n + R - 1) / R;
  }
  group_begin[p.num_outputs] = groups;
  return groups;
}

template <class TIn, int M, int R, int U, bool kBf16Out, bool kAccumulate>
Status launch(const SkinnyGemmArgs& args, cudaStream_t stream) {
  auto kernel = skinny_gemm_kernel<TIn, M, R, U, kBf16Out, kAccumulate>;
  const size_t shared_bytes = size_t{M} * static_cast<size_t>(args.p.in) * sizeof(TIn);
  int64_t resident = 0;
  DS_RETURN_IF_ERROR(resident_ctas(kernel, shared_bytes, &resident));
  const int64_t total_groups = args.group_begin[args.p.num_outputs];
  const int64_t needed = (total_groups + kWarps - 1) / kWarps;
  const int64_t grid = std::min<int64_t>(needed, resident);
  kernel<<<static_cast<unsigned>(grid), kThreads, shared_bytes, stream>>>(args);
  return launch_status("skinny_gemm");
}

// Weight rows per warp group (R) and slabs in flight (U), R * U 16-byte loads a lane in flight. R = 2 for few
// activation rows keeps the groups small (12.5k rows of the fused KDA projection make ~6.3k groups for ~2-4k
// resident warps: little tail imbalance); shared-memory traffic is M / R times the weight bytes, so the larger
// buckets take R = 4 (M = 16: 4x, half the shared bandwidth) and U shrinks to hold the R * M accumulators.
template <class TIn, int M, bool kBf16Out, bool kAccumulate>
Status launch_bucket(SkinnyGemmArgs& args, cudaStream_t stream) {
  constexpr int R = M <= 4 ? 2 : 4;
  constexpr int U = M <= 4 ? 4 : (M == 8 ? 2 : 1);
  if (plan_row_groups(args.p, R, args.group_begin) == 0) return Status::ok();
  return launch<TIn, M, R, U, kBf16Out, kAccumulate>(args, stream);
}

// fp32 input (the router) only ever needs plain fp32 output: fewer instantiations.
template <int M>
Status launch_rows(SkinnyGemmArgs& args, cudaStream_t stream) {
  if (args.p.input == SkinnyGemmInput::kFp32) return launch_bucket<float, M, false, false>(args, stream);
  if (args.p.y_bf16) return launch_bucket<__nv_bfloat16, M, true, false>(args, stream);
  if (args.p.accumulate) return launch_bucket<__nv_bfloat16, M, false, true>(args, stream);
  return launch_bucket<__nv_bfloat16, M, false, false>(args, stream);
}

// ---- v2 ---------------------------------------------------------------------------------------------------------

// Kernel arguments of v2: the host params, the row-group prefix sums, the staged x columns and the split.
struct SkinnyGemmArgsV2 {
  SkinnyGemmParams p;
  int64_t group_begin[kSkinnyGemmMaxOutputs + 1];
  int64_t x_cols;                      // columns of each staged x row: max over outputs of x_offset + in
  int split;                           // warps per row group (1, 2, 4 or 8; divides kWarps)
  bool y_bf16[kSkinnyGemmMaxOutputs];  // per output (params.y_bf16 || output.y_bf16)
};

// Programmatic dependent launch (sm_90): wait for the grid before this one on the stream (complete, writes
// visible) / let the next grid become resident. Both are no-ops for a grid launched without the attribute.
__device__ __forceinline__ void wait_for_previous_grid() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}
__device__ __forceinline__ void allow_next_grid() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// Barrier of the `split` warps that share a row group (ids 1..8; 0 is __syncthreads').
__device__ __forceinline__ void team_barrier(int team, int split) {
  asm volatile("bar.sync %0, %1;" ::"r"(team + 1), "r"(split * 32) : "memory");
}

// The output row group `group` belongs to.
__device__ __forceinline__ int output_of(const SkinnyGemmArgsV2& args, int64_t group) {
  int o = 0;
  while (group >= args.group_begin[o + 1]) ++o;
  return o;
}

// One chunk (U slabs from k0) of the R weight rows from row0 of `weight` (rows past n_last clamped to it: read,
// discarded): zero past `in` (the products are skipped there).
template <class TIn, int R, int U>
__device__ __forceinline__ void load_chunk(uint4 (&w)[U][R], const TIn* weight, int64_t row0, int64_t n_last,
                                           int64_t k0, int64_t in) {
  constexpr int kSlab = 32 * (16 / static_cast<int>(sizeof(TIn)));
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int64_t k = k0 + int64_t{u} * kSlab;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      w[u][r] = k < in ? load_streaming(weight + min(row0 + r, n_last) * in + k) : make_uint4(0, 0, 0, 0);
    }
  }
}

// Stages x (rows >= params.rows zero) as TIn [M, x_cols] in shared memory; with kNorm, the bf16 RMSNorm of the
// fp32 rows over `in` columns in rms_norm_dual's order (rms_norm_order.cuh); value = (x * inverse_rms) * weight,
// rounded to nearest bf16.
template <class TIn, int M, bool kNorm>
__device__ __forceinline__ void stage_x(const SkinnyGemmArgsV2& args, TIn* x_shared) {
  const SkinnyGemmParams& p = args.p;
  const int64_t cols = args.x_cols;
  if constexpr (kNorm) {
    static_assert(kThreads == detail::kRmsOrderThreads, "the norm's reduction order is that of 256 threads");
    __shared__ float warp_sums[M][kWarps];
    const float* x = static_cast<const float*>(p.x);
    const int64_t in = p.in;
    detail::rms_square_partials(x, p.x_stride, in, static_cast<int>(p.rows < M ? p.rows : M),
                                static_cast<int>(threadIdx.x), &warp_sums[0][0]);
    __syncthreads();
#pragma unroll
    for (int m = 0; m < M; ++m) {
      TIn* shared_row = x_shared + m * cols;
      if (m >= p.rows) {
        for (int64_t c = threadIdx.x; c < in; c += kThreads) shared_row[c] = zero_of(TIn{});
        continue;
      }
      const float inverse_rms = detail::rms_inverse(warp_sums[m], in, p.norm_eps);
      const float* x_row = x + m * p.x_stride;
      for (int64_t c = threadIdx.x; c < in; c += kThreads) {
        shared_row[c] =
            __float2bfloat16_rn(x_row[c] * inverse_rms * (p.norm_weight != nullptr ? p.norm_weight[c] : 1.0f));
      }
    }
  } else {
    stage_rows<TIn, M>(p, x_shared, cols);
  }
}

// v2: v1's warp-per-row-group streaming with
//   * programmatic dependent launch: each warp issues the first U slabs of its first row group (weights never
//     depend on an earlier kernel) before griddepcontrol.wait; x is read and every output written only after it,
//     and the next grid may become resident right after it (it waits for this grid in turn);
//   * kNorm: the fp32 rows normalised while staged (stage_x);
//   * split-K: `split` consecutive warps of a CTA (a team, `split` = 1 is v1's layout) take the same row group,
//     warp s of the team the U-slab chunks s, s + split, ...; the team adds its partial sums through shared memory
//     in warp order (deterministic) and its first warp writes each output once (one += when accumulating).
//     The partial sums are double-buffered by group parity: one team barrier per group;
//   * per-output bf16 / fp32 outputs and x column offsets.
template <class TIn, int M, int R, int U, bool kNorm>
__global__ void __launch_bounds__(kThreads) skinny_gemm_v2_kernel(const __grid_constant__ SkinnyGemmArgsV2 args) {
  constexpr int kVector = 16 / sizeof(TIn);
  constexpr int kSlab = 32 * kVector;
  constexpr int kChunk = kSlab * U;
  extern __shared__ __align__(16) unsigned char shared_raw[];
  __shared__ float partial_sums[2][kWarps][R * M];
  TIn* x_shared = reinterpret_cast<TIn*>(shared_raw);  // [M, x_cols]
  const SkinnyGemmParams& p = args.p;
  const int64_t in = p.in, cols = args.x_cols;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int split = args.split, teams = kWarps / split;
  const int team = warp / split, part = warp - team * split;
  const int64_t total_groups = args.group_begin[p.num_outputs];
  const int64_t group_step = int64_t{gridDim.x} * teams;
  const int64_t k_first = int64_t{part} * kChunk + int64_t{lane} * kVector, k_step = int64_t{split} * kChunk;

  int64_t group = int64_t{blockIdx.x} * teams + team;
  uint4 w[U][R];
  int o = 0;
  int64_t row0 = 0;
  if (group < total_groups) {
    o = output_of(args, group);
    row0 = (group - args.group_begin[o]) * R;
    load_chunk<TIn, R, U>(w, static_cast<const TIn*>(p.outputs[o].weight), row0, p.outputs[o].n - 1, k_first, in);
  }
  wait_for_previous_grid();
  allow_next_grid();
  stage_x<TIn, M, kNorm>(args, x_shared);
  __syncthreads();

  bool preloaded = true;
  int parity = 0;
  for (; group < total_groups; group += group_step) {
    if (!preloaded) {
      o = output_of(args, group);
      row0 = (group - args.group_begin[o]) * R;
    }
    const SkinnyGemmOutput& out = p.outputs[o];
    const TIn* weight = static_cast<const TIn*>(out.weight);
    const TIn* x_out = x_shared + out.x_offset;
    float acc[R][M];
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int m = 0; m < M; ++m) acc[r][m] = 0.0f;
    }
    for (int64_t k0 = k_first; k0 < in; k0 += k_step) {
      if (!preloaded) load_chunk<TIn, R, U>(w, weight, row0, out.n - 1, k0, in);
      preloaded = false;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t k = k0 + int64_t{u} * kSlab;
        if (k < in) {
#pragma unroll
          for (int m = 0; m < M; ++m) {
            const uint4 xv = *reinterpret_cast<const uint4*>(x_out + m * cols + k);
#pragma unroll
            for (int r = 0; r < R; ++r) acc[r][m] = dot16(w[u][r], xv, acc[r][m], TIn{});
          }
        }
      }
    }
    preloaded = false;  // also when this warp's part of k was empty
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int m = 0; m < M; ++m) {
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) acc[r][m] += __shfl_xor_sync(0xffffffffu, acc[r][m], offset);
      }
    }
    if (split > 1) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int m = 0; m < M; ++m) {
          if (lane == ((r * M + m) & 31)) partial_sums[parity][warp][r * M + m] = acc[r][m];
        }
      }
      team_barrier(team, split);
      if (part == 0) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
#pragma unroll
          for (int m = 0; m < M; ++m) {
            if (lane == ((r * M + m) & 31)) {
              float sum = partial_sums[parity][warp][r * M + m];
              for (int s = 1; s < split; ++s) sum += partial_sums[parity][warp + s][r * M + m];
              acc[r][m] = sum;
            }
          }
        }
      }
      parity ^= 1;
    }
    if (part != 0) continue;
    const bool bf16_out = args.y_bf16[o];
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int m = 0; m < M; ++m) {
        const int64_t n = row0 + r;
        if (lane == ((r * M + m) & 31) && m < p.rows && n < out.n) {
          const float v = acc[r][m];
          if (bf16_out) {
            static_cast<__nv_bfloat16*>(out.y)[m * out.y_stride + n] = __float2bfloat16_rn(v);
          } else if (p.accumulate) {
            static_cast<float*>(out.y)[m * out.y_stride + n] += v;
          } else {
            static_cast<float*>(out.y)[m * out.y_stride + n] = v;
          }
        }
      }
    }
  }
}

// Warps per row group: the split with the fewest full-group times per warp, ceil(groups * split / resident warps)
// / split (waves of groups, the last one partial), among those the work splits into (at most `chunks` U-slab
// chunks per row); ties keep the smaller split (no shared-memory reduction). o_proj (2304 rows, in 4096: 1152
// groups, 4 chunks) on ~4k resident warps takes 4; the fused KDA projection (6.3k groups, 3 chunks) 2 when 1.5
// waves of unsplit groups would leave half of the last wave idle, 1 when one wave holds them.
int choose_split(int64_t groups, int64_t resident_warps, int64_t chunks) {
  int best = 1;
  double best_cost = static_cast<double>((groups + resident_warps - 1) / resident_warps);
  for (int split = 2; split <= kWarps && split <= chunks; split *= 2) {
    const int64_t tasks = groups * split;
    const double cost = static_cast<double>((tasks + resident_warps - 1) / resident_warps) / split;
    if (cost < best_cost) best = split, best_cost = cost;
  }
  return best;
}

template <class TIn, int M, int R, int U, bool kNorm>
Status launch_v2(SkinnyGemmArgsV2& args, cudaStream_t stream) {
  constexpr int kChunk = 32 * (16 / static_cast<int>(sizeof(TIn))) * U;
  const int64_t groups = plan_row_groups(args.p, R, args.group_begin);
  if (groups == 0) return Status::ok();
  auto kernel = skinny_gemm_v2_kernel<TIn, M, R, U, kNorm>;
  const size_t shared_bytes = size_t{M} * static_cast<size_t>(args.x_cols) * sizeof(TIn);
  int64_t resident = 0;
  DS_RETURN_IF_ERROR(resident_ctas(kernel, shared_bytes, &resident));
  args.split = choose_split(groups, resident * kWarps, (args.p.in + kChunk - 1) / kChunk);
  const int64_t teams = kWarps / args.split;
  const int64_t grid = std::min<int64_t>((groups + teams - 1) / teams, resident);
  return launch_kernel_ex(true, kernel, dim3(static_cast<unsigned>(grid)), dim3(kThreads), shared_bytes, stream,
                          "skinny_gemm", args);
}

// Weight rows per group and slabs in flight as skinny_gemm_kernel's at <= 4 rows (R = 2, U = 4); kOneRow (kV2R1)
// takes R = 1 with U = 9 for bf16 input: twice the row groups (a finer tail: the fused KDA projection's 12.5k rows
// are 1.5 waves of R = 2 groups) with the 9 slabs of a 2304-wide row in flight. fp32 input (the router) keeps
// R = 2, U = 4.
template <int M, bool kOneRow>
Status launch_rows_v2(SkinnyGemmArgsV2& args, cudaStream_t stream) {
  static_assert(M <= 2, "the v2 kernels serve 1-2 rows");
  constexpr int R = 2;
  constexpr int U = 4;
  if (args.p.input == SkinnyGemmInput::kFp32) return launch_v2<float, M, R, U, false>(args, stream);
  if constexpr (kOneRow) {
    if (args.p.norm_x) return launch_v2<__nv_bfloat16, M, 1, 9, true>(args, stream);
    return launch_v2<__nv_bfloat16, M, 1, 9, false>(args, stream);
  } else {
    if (args.p.norm_x) return launch_v2<__nv_bfloat16, M, R, U, true>(args, stream);
    return launch_v2<__nv_bfloat16, M, R, U, false>(args, stream);
  }
}

// 1-2 rows: kV2 (1 row) or kV2R1 (1 or 2 rows; skinny_gemm_kernel_for).
Status skinny_gemm_v2(const SkinnyGemmParams& params, SkinnyGemmKernel kernel, cudaStream_t stream) {
  SkinnyGemmArgsV2 args{};
  args.p = params;
  args.x_cols = params.in;
  for (int o = 0; o < params.num_outputs; ++o) {
    const SkinnyGemmOutput& out = params.outputs[o];
    args.y_bf16[o] = params.y_bf16 || out.y_bf16;
    if (out.n > 0) args.x_cols = std::max(args.x_cols, out.x_offset + params.in);
  }
  if (bucket_rows(params.rows) == 2) return launch_rows_v2<2, true>(args, stream);
  if (kernel == SkinnyGemmKernel::kV2R1) return launch_rows_v2<1, true>(args, stream);
  return launch_rows_v2<1, false>(args, stream);
}

int64_t element_bytes(SkinnyGemmInput input) {
  return input == SkinnyGemmInput::kFp32 ? 4 : 2;
}

}  // namespace

SkinnyGemmKernel skinny_gemm_kernel_for(int64_t rows, int64_t in) {
  if (rows > 2) return SkinnyGemmKernel::kV1;
  if (rows == 2 || (in > 1024 && in <= 2304)) return SkinnyGemmKernel::kV2R1;
  return SkinnyGemmKernel::kV2;
}

bool skinny_gemm_supported(const SkinnyGemmParams& p) {
  if (p.input != SkinnyGemmInput::kBf16 && p.input != SkinnyGemmInput::kFp32) return false;
  const bool v1 = skinny_gemm_kernel_for(p.rows, p.in) == SkinnyGemmKernel::kV1;
  const int64_t bytes = element_bytes(p.input);
  const int64_t vector = 16 / bytes;
  if (p.rows < 0 || p.rows > kSkinnyGemmMaxRows || p.in <= 0 || p.in % vector != 0 || p.x_stride < p.in) {
    return false;
  }
  if (p.input == SkinnyGemmInput::kFp32 && (p.y_bf16 || p.accumulate || p.norm_x)) return false;
  if (p.num_outputs < 1 || p.num_outputs > kSkinnyGemmMaxOutputs) return false;
  if (p.y_bf16 && p.accumulate) return false;
  // The fused norm: the v2 kernels (1-2 rows) only.
  if (p.norm_x && v1) return false;
  int64_t x_cols = p.in;
  for (int o = 0; o < p.num_outputs; ++o) {
    const SkinnyGemmOutput& out = p.outputs[o];
    if (out.n < 0 || (out.n > 0 && out.y_stride < out.n)) return false;
    if (reinterpret_cast<uintptr_t>(out.weight) % 16 != 0) return false;
    if (out.y_bf16 && (p.accumulate || p.input == SkinnyGemmInput::kFp32)) return false;
    if (out.x_offset < 0 || out.x_offset % vector != 0 || (out.x_offset != 0 && p.norm_x)) return false;
    if (v1 && ((out.y_bf16 && !p.y_bf16) || out.x_offset != 0)) return false;
    if (out.n > 0) x_cols = std::max(x_cols, out.x_offset + p.in);
  }
  if (p.x_stride < x_cols) return false;
  if (bucket_rows(p.rows) * x_cols * bytes > kSkinnyGemmMaxSharedBytes) return false;
  return true;
}

Status skinny_gemm(const SkinnyGemmParams& params, cudaStream_t stream) {
  if (!skinny_gemm_supported(params)) {
    return invalid_argument(
        "skinny_gemm: unsupported shape: rows " + std::to_string(params.rows) + " in " + std::to_string(params.in) +
        " x_stride " + std::to_string(params.x_stride) + " outputs " + std::to_string(params.num_outputs) +
        " (rows <= " + std::to_string(kSkinnyGemmMaxRows) +
        ", in % 8 == 0 (bf16) or in % 4 == 0 (fp32), 16-byte aligned weights, y_stride >= n, no bf16 "
        "accumulate, fp32 input only with plain fp32 output, x_stride >= x_offset + in; norm_x, x_offset and "
        "per-output bf16 at 1-2 rows only, norm_x without x_offset)");
  }
  if (params.rows == 0) return Status::ok();
  if (params.x == nullptr) return invalid_argument("skinny_gemm: null x");
  for (int o = 0; o < params.num_outputs; ++o) {
    if (params.outputs[o].n > 0 && (params.outputs[o].weight == nullptr || params.outputs[o].y == nullptr)) {
      return invalid_argument("skinny_gemm: null weight or y of output " + std::to_string(o));
    }
  }
  if (params.norm_x && !(params.norm_eps >= 0.0f)) {
    return invalid_argument("skinny_gemm: norm_eps must be >= 0");
  }
  // Outputs with n == 0 get no groups (their pointers are never touched).
  const SkinnyGemmKernel kernel = skinny_gemm_kernel_for(params.rows, params.in);
  if (kernel != SkinnyGemmKernel::kV1) return skinny_gemm_v2(params, kernel, stream);
  SkinnyGemmArgs args{};
  args.p = params;
  switch (bucket_rows(params.rows)) {  // 3-16 rows
    case 4:
      return launch_rows<4>(args, stream);
    case 8:
      return launch_rows<8>(args, stream);
    default:
      return launch_rows<16>(args, stream);
  }
}

}  // namespace deltaserve::kernels::cuda
