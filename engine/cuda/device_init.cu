#include <cuda_bf16.h>

#include "engine/cuda/cuda_util.hpp"
#include "engine/cuda/device_init.hpp"

namespace deltaserve::engine::cuda {
namespace {

__device__ __forceinline__ uint64_t mix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

__device__ __forceinline__ double to_unit(uint64_t bits) {  // [0, 1)
  return static_cast<double>(bits >> 11) * 0x1.0p-53;
}

__global__ void random_fill_kernel(void* dst, bool as_bf16, int64_t n, uint64_t seed, RandomLaw law, float mean,
                                   float stddev) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint64_t a = mix64(seed ^ mix64(static_cast<uint64_t>(i)));
    const uint64_t b = mix64(a);
    float value;
    if (law == RandomLaw::kLog1p15Uniform) {
      value = static_cast<float>(log(1.0 + 15.0 * to_unit(a)));
    } else {
      const double u1 = 1.0 - to_unit(a), u2 = to_unit(b);
      const double normal = sqrt(-2.0 * log(u1)) * cospi(2.0 * u2);
      value = mean + stddev * static_cast<float>(normal);
    }
    if (as_bf16) {
      static_cast<__nv_bfloat16*>(dst)[i] = __float2bfloat16_rn(value);
    } else {
      static_cast<float*>(dst)[i] = value;
    }
  }
}

}  // namespace

Status random_fill(void* dst, bool as_bf16, int64_t n, uint64_t seed, RandomLaw law, float mean, float stddev,
                   cudaStream_t stream) {
  if (n <= 0) return Status::ok();
  if (dst == nullptr) return internal_error("random_fill: null destination");
  constexpr int kThreads = 256;
  const int64_t blocks = std::min<int64_t>((n + kThreads - 1) / kThreads, 65536);
  random_fill_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(dst, as_bf16, n, seed, law, mean, stddev);
  DS_CUDA_RETURN(cudaGetLastError());
  return Status::ok();
}

}  // namespace deltaserve::engine::cuda
