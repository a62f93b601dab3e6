// Skinny GEMM for decode batches (rows <= 16): y_o = x · W_o^T for up to six weight matrices sharing x
// (bf16, or fp32 for the MoE router).
// Layout: a CTA of 8 warps copies the activation rows (zero-padded to the bucket size M) into shared memory (in
// the input type) once, then its warps walk "row groups" of R consecutive weight rows of one output in a grid-stride
// loop. For a group, lane l reads bytes [16 l, 16 l + 16) of every 512-byte slab of each of the R weight rows with
// 16-byte non-allocating loads, U slabs at a time (R * U loads in flight a lane), multiplies with the matching
// 8 (bf16) or 4 (fp32) activations of each of the M rows (one 16-byte shared load a row) and accumulates R * M fp32
// sums; a warp reduction ends the group and one lane per (row, output) writes. Weight bytes are read exactly once.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

#include "kernels/cuda/bf16_stream.cuh"
#include "kernels/cuda/launch_status.hpp"
#include "kernels/cuda/small_batch.hpp"

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

// TIn: element of x and weights. M: activation rows (bucket; rows >= params.rows are zero). R: weight rows a warp
// group. U: slabs in flight.
template <class TIn, int M, int R, int U, bool kBf16Out, bool kAccumulate>
__global__ void __launch_bounds__(kThreads) skinny_gemm_kernel(const __grid_constant__ SkinnyGemmArgs args) {
  constexpr int kVector = 16 / sizeof(TIn);  // elements a 16-byte load
  constexpr int kSlab = 32 * kVector;        // k elements one warp covers with one 16-byte load a lane
  extern __shared__ __align__(16) unsigned char shared_raw[];
  TIn* x_shared = reinterpret_cast<TIn*>(shared_raw);  // [M, in]
  const SkinnyGemmParams& p = args.p;
  const TIn* x = static_cast<const TIn*>(p.x);
  const int64_t in = p.in;

  // Activations to shared memory (16-byte copies when x's rows allow them).
  const bool x_vector = (p.x_stride % kVector == 0) && (reinterpret_cast<uintptr_t>(p.x) % 16 == 0);
  if (x_vector) {
    const int64_t chunks_per_row = in / kVector;
    for (int64_t i = threadIdx.x; i < M * chunks_per_row; i += kThreads) {
      const int64_t m = i / chunks_per_row, c = i - m * chunks_per_row;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (m < p.rows) v = *reinterpret_cast<const uint4*>(x + m * p.x_stride + c * kVector);
      *reinterpret_cast<uint4*>(x_shared + m * in + c * kVector) = v;
    }
  } else {
    for (int64_t i = threadIdx.x; i < M * in; i += kThreads) {
      const int64_t m = i / in, k = i - m * in;
      x_shared[i] = m < p.rows ? x[m * p.x_stride + k] : zero_of(TIn{});
    }
  }
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

template <class TIn, int M, int R, int U, bool kBf16Out, bool kAccumulate>
Status launch(const SkinnyGemmArgs& args, cudaStream_t stream) {
  auto kernel = skinny_gemm_kernel<TIn, M, R, U, kBf16Out, kAccumulate>;
  const size_t shared_bytes = size_t{M} * static_cast<size_t>(args.p.in) * sizeof(TIn);
  // Per call (the attribute is per device): a host-side call, legal during graph capture.
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
  const int64_t total_groups = args.group_begin[args.p.num_outputs];
  const int64_t needed = (total_groups + kWarps - 1) / kWarps;
  const int64_t grid = std::min<int64_t>(needed, int64_t{per_sm} * sm_count());
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
  int64_t groups = 0;
  for (int o = 0; o < args.p.num_outputs; ++o) {
    args.group_begin[o] = groups;
    groups += (args.p.outputs[o].n + R - 1) / R;
  }
  args.group_begin[args.p.num_outputs] = groups;
  if (groups == 0) return Status::ok();
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

int64_t element_bytes(SkinnyGemmInput input) {
  return input == SkinnyGemmInput::kFp32 ? 4 : 2;
}

}  // namespace

bool skinny_gemm_supported(const SkinnyGemmParams& p) {
  if (p.input != SkinnyGemmInput::kBf16 && p.input != SkinnyGemmInput::kFp32) return false;
  const int64_t bytes = element_bytes(p.input);
  if (p.rows < 0 || p.rows > kSkinnyGemmMaxRows || p.in <= 0 || p.in % (16 / bytes) != 0 || p.x_stride < p.in) {
    return false;
  }
  if (p.input == SkinnyGemmInput::kFp32 && (p.y_bf16 || p.accumulate)) return false;
  if (p.num_outputs < 1 || p.num_outputs > kSkinnyGemmMaxOutputs) return false;
  if (p.y_bf16 && p.accumulate) return false;
  if (bucket_rows(p.rows) * p.in * bytes > kSkinnyGemmMaxSharedBytes) {
    return false;
  }
  for (int o = 0; o < p.num_outputs; ++o) {
    const SkinnyGemmOutput& out = p.outputs[o];
    if (out.n < 0 || (out.n > 0 && out.y_stride < out.n)) return false;
    if (reinterpret_cast<uintptr_t>(out.weight) % 16 != 0) return false;
  }
  return true;
}

bool skinny_gemm_enabled(SkinnyGemmInput input) {
  // 0: off, 1: bf16 only, 2: bf16 and fp32.
  static const int level = [] {
    const char* value = std::getenv("DELTASERVE_SKINNY_GEMM");
    if (value == nullptr) return 2;
    if (std::strcmp(value, "off") == 0 || std::strcmp(value, "0") == 0) return 0;
    if (std::strcmp(value, "bf16") == 0) return 1;
    return 2;
  }();
  return input == SkinnyGemmInput::kBf16 ? level >= 1 : level >= 2;
}

Status skinny_gemm(const SkinnyGemmParams& params, cudaStream_t stream) {
  if (!skinny_gemm_supported(params)) {
    return invalid_argument(
        "skinny_gemm: unsupported shape: rows " + std::to_string(params.rows) + " in " + std::to_string(params.in) +
        " x_stride " + std::to_string(params.x_stride) + " outputs " + std::to_string(params.num_outputs) +
        " (rows <= " + std::to_string(kSkinnyGemmMaxRows) +
        ", in % 8 == 0 (bf16) or in % 4 == 0 (fp32), 16-byte aligned weights, y_stride >= n, no bf16 "
        "accumulate, fp32 input only with plain fp32 output)");
  }
  if (params.rows == 0) return Status::ok();
  if (params.x == nullptr) return invalid_argument("skinny_gemm: null x");
  for (int o = 0; o < params.num_outputs; ++o) {
    if (params.outputs[o].n > 0 && (params.outputs[o].weight == nullptr || params.outputs[o].y == nullptr)) {
      return invalid_argument("skinny_gemm: null weight or y of output " + std::to_string(o));
    }
  }
  SkinnyGemmArgs args{};
  args.p = params;
  // Outputs with n == 0 get no groups (their pointers are never touched).
  switch (bucket_rows(params.rows)) {
    case 1:
      return launch_rows<1>(args, stream);
    case 2:
      return launch_rows<2>(args, stream);
    case 4:
      return launch_rows<4>(args, stream);
    case 8:
      return launch_rows<8>(args, stream);
    default:
      return launch_rows<16>(args, stream);
  }
}

}  // namespace deltaserve::kernels::cuda
