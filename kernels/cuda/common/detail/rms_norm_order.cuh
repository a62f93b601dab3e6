// The reduction order of rms_norm_dual (gemm/small_batch_norm.cu), for every kernel that must reproduce its results
// bitwise (the skinny GEMM's fused input norm, the small-batch MoE's fused input norm): 256 threads, thread i sums
// the squares of columns i, i + 256, ... in increasing order (the same contracted multiply-add), a warp xor-shuffle
// reduction, lane 0 stores the warp's sum; after a barrier of the 256 threads, the 8 warp sums are added in warp
// order from 0.0f and the inverse is 1 / sqrtf(sum / dim + eps).
#pragma once

#include <cstdint>

namespace deltaserve::kernels::cuda::detail {

constexpr int kRmsOrderThreads = 256;
constexpr int kRmsOrderWarps = kRmsOrderThreads / 32;

// Rows x[t * stride, + dim) for t < rows: thread thread_index (in [0, 256)) of the 256 stores, per row, its warp's
// sum of squares into warp_sums[t * 8 + warp]. The caller synchronises the 256 threads before rms_inverse.
__device__ __forceinline__ void rms_square_partials(const float* x, int64_t stride, int64_t dim, int rows,
                                                    int thread_index, float* warp_sums) {
  const int lane = thread_index & 31, warp = thread_index >> 5;
  for (int t = 0; t < rows; ++t) {
    const float* x_row = x + t * stride;
    float partial = 0.0f;
    for (int64_t c = thread_index; c < dim; c += kRmsOrderThreads) partial += x_row[c] * x_row[c];
    for (int offset = 16; offset > 0; offset >>= 1) partial += __shfl_xor_sync(0xffffffffu, partial, offset);
    if (lane == 0) warp_sums[t * kRmsOrderWarps + warp] = partial;
  }
}

// 1 / rms of a row from its 8 warp sums (rms_square_partials' warp_sums + 8 t).
__device__ __forceinline__ float rms_inverse(const float* row_warp_sums, int64_t dim, float eps) {
  float sum_squares = 0.0f;
  for (int w = 0; w < kRmsOrderWarps; ++w) sum_squares += row_warp_sums[w];
  return 1.0f / sqrtf(sum_squares / static_cast<float>(dim) + eps);
}

}  // namespace deltaserve::kernels::cuda::detail
