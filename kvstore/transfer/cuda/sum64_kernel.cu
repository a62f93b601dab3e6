#include <algorithm>

#include "kvstore/transfer/cuda/sum64_kernel.hpp"
#include "kvstore/transfer/sum64.hpp"

namespace deltaserve::kvstore::transfer::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;  // independent 16-byte loads in flight per thread

struct Spans {
  Sum64Span span[kSum64SpansPerLaunch];
};

// grid.y = span; grid.x blocks stride over the span's words. Each thread adds its words' terms; the block
// reduces and adds one value to *sum (addition mod 2^64 is what the checksum needs: order does not matter).
__global__ void __launch_bounds__(kThreads) sum64_kernel(Spans spans, unsigned long long* sum) {
  const Sum64Span s = spans.span[blockIdx.y];
  const uint64_t words = s.bytes / 8;
  const auto* data = static_cast<const uint64_t*>(s.data);
  uint64_t acc = 0;
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * kThreads;
  uint64_t i = static_cast<uint64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if ((reinterpret_cast<uintptr_t>(data) & 15) == 0) {
    // Pairs of words: 16-byte loads, kUnroll of them in flight.
    const auto* pairs = reinterpret_cast<const ulonglong2*>(data);
    const uint64_t npairs = words / 2;
    for (; i + (kUnroll - 1) * stride < npairs; i += kUnroll * stride) {
      ulonglong2 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) v[u] = __ldcs(pairs + i + u * stride);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const uint64_t w = s.first_word + 2 * (i + u * stride);
        acc += sum64_terms::term(v[u].x, w) + sum64_terms::term(v[u].y, w + 1);
      }
    }
    for (; i < npairs; i += stride) {
      const ulonglong2 v = __ldcs(pairs + i);
      acc += sum64_terms::term(v.x, s.first_word + 2 * i) + sum64_terms::term(v.y, s.first_word + 2 * i + 1);
    }
    if (blockIdx.x == 0 && threadIdx.x == 0 && (words & 1))
      acc += sum64_terms::term(data[words - 1], s.first_word + words - 1);
  } else {
    for (; i < words; i += stride) acc += sum64_terms::term(__ldcs(data + i), s.first_word + i);
  }
  if (blockIdx.x == 0 && threadIdx.x == 0 && (s.bytes & 7)) {  // zero-padded partial last word
    const auto* tail = reinterpret_cast<const unsigned char*>(data + words);
    uint64_t w = 0;
    for (uint64_t b = 0; b < (s.bytes & 7); ++b) w |= static_cast<uint64_t>(tail[b]) << (8 * b);
    acc += sum64_terms::term(w, s.first_word + words);
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) acc += __shfl_down_sync(0xffffffffu, acc, offset);
  __shared__ uint64_t warp_sums[kThreads / 32];
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x / 32] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint64_t block = 0;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) block += warp_sums[w];
    atomicAdd(sum, static_cast<unsigned long long>(block));
  }
}

}  // namespace

cudaError_t launch_sum64(const Sum64Span* spans, int count, int multiprocessors, unsigned long long* sum,
                         cudaStream_t stream) {
  const int sms = std::max(1, multiprocessors);
  for (int first = 0; first < count; first += kSum64SpansPerLaunch) {
    const int n = std::min(kSum64SpansPerLaunch, count - first);
    Spans args{};
    uint64_t largest = 0;
    for (int k = 0; k < n; ++k) {
      args.span[k] = spans[first + k];
      largest = std::max(largest, spans[first + k].bytes);
    }
    // Enough blocks to keep every SM's memory pipeline busy (about 4 per SM in all), no more than the largest
    // span needs.
    const uint64_t needed = (largest / 16 + kThreads - 1) / kThreads;
    const uint64_t per_span = std::max<uint64_t>(1, (static_cast<uint64_t>(sms) * 4 + n - 1) / n);
    const dim3 grid(static_cast<unsigned>(std::max<uint64_t>(1, std::min(needed, per_span))), static_cast<unsigned>(n));
    sum64_kernel<<<grid, kThreads, 0, stream>>>(args, sum);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace deltaserve::kvstore::transfer::cuda
