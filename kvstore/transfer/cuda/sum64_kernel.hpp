// The kSum64 checksum kernel (sum64.hpp) over spans of GPU memory. Included by C++20 host code and by nvcc
// (C++17), so plain types only.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace deltaserve::kvstore::transfer::cuda {

// `bytes` bytes at `data` (8-byte aligned) whose first word is word `first_word` of the piece. Only the last
// span of a piece may hold a partial word (zero-padded).
struct Sum64Span {
  const void* data = nullptr;
  uint64_t bytes = 0;
  uint64_t first_word = 0;
};

// Adds the terms of every word of `spans[0..count)` to *sum (device memory) on `stream`; sum64_terms::finish
// of the total and the piece's length is the checksum. Any count: spans go to the GPU in launches of up to
// kSum64SpansPerLaunch. `multiprocessors`: the current device's SM count (sizes the grid).
inline constexpr int kSum64SpansPerLaunch = 32;
cudaError_t launch_sum64(const Sum64Span* spans, int count, int multiprocessors, unsigned long long* sum,
                         cudaStream_t stream);

}  // namespace deltaserve::kvstore::transfer::cuda
