// rms_norm_dual: one block of 256 threads per row, in the reduction order of rms_norm_order.cuh (that of
// rms_norm_kernel in ops_norm.cu, so the results are expected to be bitwise those of rms_norm).
#include <string>

#include "kernels/cuda/common/detail/rms_norm_order.cuh"
#include "kernels/cuda/gemm/small_batch.hpp"

namespace deltaserve::kernels::cuda {
namespace {

constexpr int kThreads = detail::kRmsOrderThreads;
constexpr int kWarps = detail::kRmsOrderWarps;

__global__ void __launch_bounds__(kThreads)
    rms_norm_dual_kernel(const float* __restrict__ x, int64_t x_stride, const float* __restrict__ weight, int64_t dim,
                         float eps, __nv_bfloat16* __restrict__ y_bf16, int64_t y_bf16_stride,
                         float* __restrict__ y_f32, int64_t y_f32_stride) {
  __shared__ float warp_sums[kWarps];
  const float* x_row = x + blockIdx.x * x_stride;
  detail::rms_square_partials(x_row, 0, dim, 1, static_cast<int>(threadIdx.x), warp_sums);
  __syncthreads();
  const float inverse_rms = detail::rms_inverse(warp_sums, dim, eps);
  __nv_bfloat16* bf16_row = y_bf16 + blockIdx.x * y_bf16_stride;
  float* f32_row = y_f32 + blockIdx.x * y_f32_stride;
  for (int64_t c = threadIdx.x; c < dim; c += kThreads) {
    const float value = x_row[c] * inverse_rms * (weight != nullptr ? weight[c] : 1.0f);
    f32_row[c] = value;
    bf16_row[c] = __float2bfloat16_rn(value);
  }
}

}  // namespace

Status rms_norm_dual(const float* x, int64_t x_stride, const float* weight, int64_t rows, int64_t dim, float eps,
                     __nv_bfloat16* y_bf16, int64_t y_bf16_stride, float* y_f32, int64_t y_f32_stride,
                     cudaStream_t stream) {
  if (rows < 0 || dim <= 0 || x_stride < dim || y_bf16_stride < dim || y_f32_stride < dim ||
      rows > int64_t{0x7fffffff}) {
    return invalid_argument("rms_norm_dual: bad shape rows " + std::to_string(rows) + " dim " + std::to_string(dim) +
                            " strides x " + std::to_string(x_stride) + " y_bf16 " + std::to_string(y_bf16_stride) +
                            " y_f32 " + std::to_string(y_f32_stride));
  }
  if (rows == 0) return Status::ok();
  if (x == nullptr || y_bf16 == nullptr || y_f32 == nullptr) return invalid_argument("rms_norm_dual: null pointer");
  rms_norm_dual_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(x, x_stride, weight, dim, eps, y_bf16,
                                                                             y_bf16_stride, y_f32, y_f32_stride);
  const cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) {
    return internal_error(std::string("rms_norm_dual: launch: ") + cudaGetErrorName(error) + " (" +
                          cudaGetErrorString(error) + ")");
  }
  return Status::ok();
}

}  // namespace deltaserve::kernels::cuda
