// MLA page pool writes: RMS-normed latent ‖ k_rot rows, bf16, at the pool slots named by slot_mapping.
// One CTA per token, launched with programmatic dependent launch: the norm weight (a weight, never written by the
// previous kernel) is read into registers before griddepcontrol.wait, then the slot and the kv row are read
// together, so one global round trip remains after the wait (the kernel is latency-bound at decode batches).
#include <cmath>
#include <string>

#include "kernels/cuda/common/launch_status.hpp"
#include "kernels/cuda/mla/detail/attention.cuh"
#include "kernels/cuda/mla/mla.hpp"

namespace deltaserve::kernels::cuda {
namespace {

constexpr int kWriteThreads = 128;

// The CTA's inverse RMS from each thread's partial sum of squares, reduced in one order (the warp's butterfly, then
// the warps in order): the same rows on every run.
__device__ __forceinline__ float block_inverse_rms(float sum, float (&s_partial)[kWriteThreads / 32], int kv_lora,
                                                   float eps) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if ((threadIdx.x & 31) == 0) s_partial[threadIdx.x >> 5] = sum;
  __syncthreads();
  float total = 0.0f;
#pragma unroll
  for (int w = 0; w < kWriteThreads / 32; ++w) total += s_partial[w];
  return rsqrtf(total / static_cast<float>(kv_lora) + eps);
}

// The pool row of `slot` in `layer` (pages hold every layer's rows of a page together).
__device__ __forceinline__ __nv_bfloat16* pool_row(__nv_bfloat16* pages, int num_layers, int page_size,
                                                   int64_t row_stride, int layer, int64_t slot) {
  const int64_t page = slot / page_size, offset = slot - page * page_size;
  return pages + ((page * num_layers + layer) * page_size + offset) * row_stride;
}

// grid (T), block kWriteThreads, launched with PDL. Columns c = threadIdx.x + kWriteThreads i: the first
// kWriteRegs of them (all of them up to kv_lora 512) in registers, the rest re-read from global memory.
constexpr int kWriteRegs = 4;

__global__ void __launch_bounds__(kWriteThreads)
    mla_write_rows_kernel(__nv_bfloat16* __restrict__ pages, int64_t num_pages, int num_layers, int page_size,
                          int64_t row_stride, int layer, const float* __restrict__ kv, int64_t kv_stride,
                          const float* __restrict__ norm_weight, float eps, int kv_lora, int rope,
                          const int64_t* __restrict__ slot_mapping) {
  __shared__ float s_partial[kWriteThreads / 32];
  const int64_t t = blockIdx.x;
  const int tid = threadIdx.x;
  float weight[kWriteRegs];
#pragma unroll
  for (int i = 0; i < kWriteRegs; ++i) {
    const int c = tid + i * kWriteThreads;
    weight[i] = c < kv_lora ? norm_weight[c] : 0.0f;
  }
  detail::mla_wait_for_previous_grid();
  detail::mla_allow_next_grid();
  const int64_t slot = slot_mapping[t];
  const float* x = kv + t * kv_stride;
  float value[kWriteRegs];
#pragma unroll
  for (int i = 0; i < kWriteRegs; ++i) {
    const int c = tid + i * kWriteThreads;
    value[i] = c < kv_lora ? x[c] : 0.0f;
  }
  if (slot < 0 || slot >= num_pages * page_size) return;  // skipped token (uniform over the CTA)
  // The sum in one order: c = tid, tid + 128, ... sequentially, then the warp, then the warps in order.
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < kWriteRegs; ++i) {
    if (tid + i * kWriteThreads < kv_lora) sum = fmaf(value[i], value[i], sum);
  }
  for (int c = tid + kWriteRegs * kWriteThreads; c < kv_lora; c += kWriteThreads) sum = fmaf(x[c], x[c], sum);
  const float inverse_rms = block_inverse_rms(sum, s_partial, kv_lora, eps);
  __nv_bfloat16* row = pool_row(pages, num_layers, page_size, row_stride, layer, slot);
#pragma unroll
  for (int i = 0; i < kWriteRegs; ++i) {
    const int c = tid + i * kWriteThreads;
    if (c < kv_lora) row[c] = __float2bfloat16(value[i] * inverse_rms * weight[i]);
  }
  for (int c = tid + kWriteRegs * kWriteThreads; c < kv_lora; c += kWriteThreads)
    row[c] = __float2bfloat16(x[c] * inverse_rms * norm_weight[c]);
  for (int j = tid; j < rope; j += kWriteThreads) row[kv_lora + j] = __float2bfloat16(x[kv_lora + j]);
}

}  // namespace

Status mla_write_rows(const MlaWriteParams& p, cudaStream_t stream) {
  const std::string w = "mla_write_rows";
  if (Status s = detail::validate_mla_pool(p.pool, p.layer, "mla_write_rows"); !s.is_ok()) return s;
  if (p.kv_lora_rank < 1 || p.qk_rope < 0) return invalid_argument(w + ": kv_lora_rank >= 1 and qk_rope >= 0 needed");
  if (p.pool.width != static_cast<int64_t>(p.kv_lora_rank) + p.qk_rope) {
    return invalid_argument(w + ": pool.width " + std::to_string(p.pool.width) + " != kv_lora_rank + qk_rope");
  }
  if (p.num_tokens < 0) return invalid_argument(w + ": num_tokens is negative");
  if (p.num_tokens > INT32_MAX) return invalid_argument(w + ": num_tokens exceeds int32");
  if (p.kv_stride < p.pool.width) {
    return invalid_argument(w + ": kv_stride " + std::to_string(p.kv_stride) + " < kv_lora_rank + qk_rope");
  }
  if (!std::isfinite(p.eps) || p.eps < 0.0f) return invalid_argument(w + ": eps must be finite and >= 0");
  if (p.num_tokens == 0) return Status::ok();
  if (p.kv == nullptr || p.norm_weight == nullptr || p.slot_mapping == nullptr) {
    return invalid_argument(w + ": kv, norm_weight or slot_mapping is null");
  }
  return launch_kernel_ex(true, mla_write_rows_kernel, dim3(static_cast<unsigned>(p.num_tokens)), dim3(kWriteThreads),
                          0, stream, "mla_write_rows", p.pool.pages, p.pool.num_pages, p.pool.num_layers,
                          p.pool.page_size, p.pool.row_stride, p.layer, p.kv, p.kv_stride, p.norm_weight, p.eps,
                          p.kv_lora_rank, p.qk_rope, p.slot_mapping);
}

}  // namespace deltaserve::kernels::cuda
