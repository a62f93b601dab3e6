// Per-CTA %globaltimer timelines of kernels, for the measurement builds (-DDELTASERVE_MLA_V3_TRACE) that ask where
// a CTA's time goes: a kernel stamps events into a __device__ buffer of [CTA][event] nanosecond stamps (0: none),
// and the host reads the buffer back after the launches and clears it for the next ones.
#pragma once

#include <cstddef>
#include <vector>

#include <cuda_runtime.h>

namespace deltaserve::kernels::cuda::detail {

// The CTA's index with blockIdx flattened (x fastest).
__device__ __forceinline__ unsigned timeline_cta() {
  return blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
}

// Stamps event `event` of this CTA with %globaltimer when both fall inside the buffer.
template <int kCtas, int kEvents>
__device__ __forceinline__ void timeline_stamp(unsigned long long (&buffer)[kCtas][kEvents], int event) {
  const unsigned cta = timeline_cta();
  if (cta >= static_cast<unsigned>(kCtas) || event < 0 || event >= kEvents) return;
  unsigned long long ns;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(ns));
  buffer[cta][event] = ns;
}

// The buffer's stamps, CTA-major, read back and cleared (errors leave zeros, which read as "not stamped").
template <int kCtas, int kEvents>
std::vector<unsigned long long> timeline_take(const unsigned long long (&buffer)[kCtas][kEvents]) {
  constexpr size_t kBytes = sizeof(unsigned long long) * kCtas * kEvents;
  std::vector<unsigned long long> stamps(static_cast<size_t>(kCtas) * kEvents, 0);
  (void)cudaMemcpyFromSymbol(stamps.data(), buffer, kBytes);
  const std::vector<unsigned long long> zeros(stamps.size(), 0);
  (void)cudaMemcpyToSymbol(buffer, zeros.data(), kBytes);
  return stamps;
}

}  // namespace deltaserve::kernels::cuda::detail
