// Dense projections of the CUDA backend through cuBLAS, in the checkpoint's row-major conventions:
//   y[rows, out] (row stride y_stride) = x[rows, in] (row stride x_stride) · w[out, in]^T   (+= when accumulate)
// bf16 x bf16 with fp32 compute and fp32 or bf16 output; fp32 x fp32 with fp32 compute (no TF32) for the router.
// GEMMs (bf16, and the fp32 router) of at most kernels::cuda::kSkinnyGemmMaxRows rows run the skinny GEMM
// (kernels/cuda/small_batch.hpp) instead of cuBLAS when its shape rules hold; DELTASERVE_SKINNY_GEMM=off keeps cuBLAS
// for every batch size, DELTASERVE_SKINNY_GEMM=bf16 for the router only.
#pragma once

#include <cstdint>
#include <initializer_list>

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "common/status.hpp"
#include "engine/cuda/cuda_util.hpp"

namespace deltaserve::engine::cuda {

// One projection of run_shared_input: y[rows, out] (row stride y_stride) = x · w[out, in]^T, rounded once to bf16.
struct GemmTarget {
  const __nv_bfloat16* w = nullptr;
  int64_t out = 0;
  __nv_bfloat16* y = nullptr;
  int64_t y_stride = 0;
};

class Gemm {
 public:
  Gemm() = default;
  ~Gemm();
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;

  // One handle bound to `stream`, with its own workspace (kWorkspaceBytes, set with cublasSetWorkspace so that
  // GEMMs can be captured into CUDA graphs: no allocation inside cuBLAS during a capture).
  [[nodiscard]] Status init(cudaStream_t stream);
  static constexpr size_t kWorkspaceBytes = size_t{32} << 20;  // cuBLAS's recommendation for Hopper
  cublasHandle_t handle() const { return handle_; }

  // bf16 weights and activations, fp32 accumulation; y fp32.
  [[nodiscard]] Status run(const __nv_bfloat16* x, int64_t x_stride, const __nv_bfloat16* w, int64_t rows, int64_t in,
                           int64_t out, float* y, int64_t y_stride, bool accumulate = false);
  // Same, y rounded once to bf16 (never accumulates).
  [[nodiscard]] Status run(const __nv_bfloat16* x, int64_t x_stride, const __nv_bfloat16* w, int64_t rows, int64_t in,
                           int64_t out, __nv_bfloat16* y, int64_t y_stride);
  // Several bf16-output projections of the same x (at most kernels::cuda::kSkinnyGemmMaxOutputs): one skinny
  // launch when rows <= kSkinnyGemmMaxRows and the shapes allow it, otherwise one run() per target.
  [[nodiscard]] Status run_shared_input(const __nv_bfloat16* x, int64_t x_stride, int64_t rows, int64_t in,
                                        std::initializer_list<GemmTarget> targets);
  // fp32 throughout (router logits).
  [[nodiscard]] Status run_f32(const float* x, int64_t x_stride, const float* w, int64_t rows, int64_t in, int64_t out,
                               float* y, int64_t y_stride);

 private:
  [[nodiscard]] Status gemm_ex(const void* x, cudaDataType x_type, int64_t x_stride, const void* w, int64_t rows,
                               int64_t in, int64_t out, void* y, cudaDataType y_type, int64_t y_stride, float beta);
  cublasHandle_t handle_ = nullptr;
  cudaStream_t stream_ = nullptr;
  DeviceMemory workspace_;
};

}  // namespace deltaserve::engine::cuda
