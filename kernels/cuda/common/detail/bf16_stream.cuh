// Device helpers of the CUDA-core small-batch GEMVs (moe/small_batch.cu, gemm/small_batch_gemm.cu): streaming
// 16-byte weight loads and fp32 dot products of packed bf16 pairs; bulk copies of weight rows into shared memory and
// L2 prefetches (moe/small_batch_pipeline.cu).
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

// ---- bulk copies into shared memory (sm_90) -------------------------------------------------------------------
// L2 policy for weights streamed once per step: their lines are the first evicted, so the streams keep the
// activations and the other layers' state in L2.
__device__ __forceinline__ uint64_t l2_evict_first_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

// `bytes` (a multiple of 16, both addresses 16-byte aligned) from global memory to this CTA's shared memory at
// `dst` (a shared-window address); the transfer completes `bytes` transaction bytes of the mbarrier at `barrier`.
__device__ __forceinline__ void bulk_copy_to_shared(uint32_t dst, const void* src, uint32_t bytes, uint32_t barrier) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(barrier)
               : "memory");
}
// The same with an L2 cache policy (l2_evict_first_policy).
__device__ __forceinline__ void bulk_copy_to_shared(uint32_t dst, const void* src, uint32_t bytes, uint32_t barrier,
                                                    uint64_t policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::
          "r"(dst),
      "l"(src), "r"(bytes), "r"(barrier), "l"(policy)
      : "memory");
}

// Starts loading `bytes` (a multiple of 16, the address 16-byte aligned) of global memory into L2; nothing to wait
// for.
__device__ __forceinline__ void bulk_prefetch_l2(const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "r"(bytes) : "memory");
}

// Orders this thread's earlier generic-proxy accesses of global memory before its later async-proxy ones (bulk
// copies reading what another grid wrote with ordinary stores).
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

}  // namespace deltaserve::kernels::cuda::detail
