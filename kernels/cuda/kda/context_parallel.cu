// Context-parallel composition of KDA segments (contract in kda.hpp): S_out = M S_in + S0 per head, fp32.
// One CTA per (head, 16 output rows); thread (half, column) accumulates 8 rows of one column over k.
#include <string>
#include <utility>

#include <cuda_runtime.h>

#include "kernels/cuda/kda/kda.hpp"

namespace deltaserve::kernels::cuda {
namespace {

constexpr int kD = kKdaHeadDim;
constexpr int kRows = 16;

__global__ void __launch_bounds__(256)
    kda_compose_kernel(const float* m, const float* s_in, const float* s0, float* s_out) {
  __shared__ float m_rows[kRows][kD];
  const int h = blockIdx.x, row0 = blockIdx.y * kRows;
  const size_t head = static_cast<size_t>(h) * kD * kD;
  for (int i = threadIdx.x; i < kRows * kD; i += 256) m_rows[i / kD][i % kD] = m[head + (row0 + i / kD) * kD + i % kD];
  __syncthreads();
  const int col = threadIdx.x & (kD - 1), half = threadIdx.x >> 7;
  float acc[8] = {};
  for (int k = 0; k < kD; ++k) {
    const float x = s_in[head + k * kD + col];
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] += m_rows[half * 8 + i][k] * x;
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const size_t index = head + (row0 + half * 8 + i) * kD + col;
    s_out[index] = acc[i] + s0[index];
  }
}

}  // namespace

Status kda_compose_segment(const float* m, const float* s_in, const float* s0, float* s_out, int num_heads,
                           cudaStream_t stream) {
  if (num_heads <= 0 || num_heads > 65535) return invalid_argument("kda_compose_segment: num_heads must be >= 1");
  const std::pair<const void*, const char*> pointers[] = {{m, "m"}, {s_in, "s_in"}, {s0, "s0"}, {s_out, "s_out"}};
  for (const auto& [pointer, name] : pointers) {
    if (pointer == nullptr) return invalid_argument(std::string("kda_compose_segment: ") + name + " is null");
  }
  if (s_out == s_in || s_out == m) return invalid_argument("kda_compose_segment: s_out may alias s0 only");
  kda_compose_kernel<<<dim3(static_cast<unsigned>(num_heads), kD / kRows), 256, 0, stream>>>(m, s_in, s0, s_out);
  const cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) return internal_error(std::string("kda_compose_segment: ") + cudaGetErrorString(error));
  return Status::ok();
}

}  // namespace deltaserve::kernels::cuda
