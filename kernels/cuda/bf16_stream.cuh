// Device helpers of the CUDA-core small-batch GEMVs (moe_small_batch.cu, small_batch_gemm.cu): streaming 16-byte
// weight loads and fp32 dot products of packed bf16 pairs.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace deltaserve::kernels::cuda::detail {

// 16 bytes through the non-coherent path without allocating in L1: weights are read once per launch.
__device__ __forceinline__ uint4 load_streaming(const void* address) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(address));
  return v;
}

// The bf16 in the low / high half of a packed pair, exactly, as fp32.
__device__ __forceinline__ float bf16_low(uint32_t pair) {
  return __uint_as_float(pair << 16);
}
__device__ __forceinline__ float bf16_high(uint32_t pair) {
  return __uint_as_float(pair & 0xffff0000u);
}

// acc + dot of the 8 bf16 of w and x, in element order (one fma each).
__device__ __forceinline__ float dot8_bf16(const uint4& w, const uint4& x, float acc) {
  acc = fmaf(bf16_low(w.x), bf16_low(x.x), acc);
  acc = fmaf(bf16_high(w.x), bf16_high(x.x), acc);
  acc = fmaf(bf16_low(w.y), bf16_low(x.y), acc);
  acc = fmaf(bf16_high(w.y), bf16_high(x.y), acc);
  acc = fmaf(bf16_low(w.z), bf16_low(x.z), acc);
  acc = fmaf(bf16_high(w.z), bf16_high(x.z), acc);
  acc = fmaf(bf16_low(w.w), bf16_low(x.w), acc);
  acc = fmaf(bf16_high(w.w), bf16_high(x.w), acc);
  return acc;
}

}  // namespace deltaserve::kernels::cuda::detail
