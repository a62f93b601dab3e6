// Dense projections of the CUDA backend through cuBLAS, in the checkpoint's row-major conventions:
//   y[rows, out] (row stride y_stride) = x[rows, in] (row stride x_stride) · w[out, in]^T   (+= when accumulate)
// bf16 x bf16 with fp32 compute and fp32 or bf16 output; fp32 x fp32 with fp32 compute (no TF32) for the router.
// GEMMs (bf16, and the fp32 router) of at most 4 rows run the skinny GEMM (kernels/cuda/gemm/small_batch.hpp) instead
// of cuBLAS when its shape rules hold; its 3-4-row kernel takes no fused norm, offsets or mixed output types
// (run_shared_input then falls back).
#pragma once

#include <cstdint>
#include <initializer_list>

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "common/status.hpp"
#include "engine/cuda/cuda_util.hpp"

namespace deltaserve::engine::cuda {

// One projection of run_shared_input: y[rows, out] (row stride y_stride) = x[:, x_offset, x_offset + in) ·
// w[out, in]^T, bf16 (rounded once) or fp32.
struct GemmTarget {
  GemmTarget(const __nv_bfloat16* w, int64_t out, __nv_bfloat16* y, int64_t y_stride, int64_t x_offset = 0)
      : w(w), out(out), y(y), y_stride(y_stride), y_bf16(true), x_offset(x_offset) {}
  GemmTarget(const __nv_bfloat16* w, int64_t out, float* y, int64_t y_stride, int64_t x_offset = 0)
      : w(w), out(out), y(y), y_stride(y_stride), y_bf16(false), x_offset(x_offset) {}
  const __nv_bfloat16* w;
  int64_t out;
  void* y;
  int64_t y_stride;
  bool y_bf16;
  int64_t x_offset;
};

// The fp32 rows a shared-input projection normalises itself: its input is bf16(rms_norm(x) * weight), bitwise what
// kernels::cuda::rms_norm writes. When the fused skinny GEMM does not apply, rms_norm writes that input to `scratch`
// ([rows, in] bf16) and the plain path runs on it.
struct GemmNormInput {
  const float* x = nullptr;  // [rows, in] row stride x_stride
  int64_t x_stride = 0;
  const float* weight = nullptr;  // [in] or nullptr (= 1)
  float eps = 0.0f;
  __nv_bfloat16* scratch = nullptr;
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
  // Several projections of the same x (at most kernels::cuda::kSkinnyGemmMaxOutputs, each bf16 or fp32, each
  // from its column offset of x): one skinny launch when skinny_rows(rows) and the shapes allow it, otherwise one
  // run() per target in the given order.
  [[nodiscard]] Status run_shared_input(const __nv_bfloat16* x, int64_t x_stride, int64_t rows, int64_t in,
                                        std::initializer_list<GemmTarget> targets);
  // The same on the RMSNorm of fp32 rows (offsets 0): one skinny launch that normalises x itself when the skinny
  // path takes it (v2 kernel, rows <= 4), otherwise rms_norm into x.scratch, then the projections of that.
  [[nodiscard]] Status run_shared_input(const GemmNormInput& x, int64_t rows, int64_t in,
                                        std::initializer_list<GemmTarget> targets);
  // Whether GEMMs of `rows` rows take the skinny path (rows small enough), shapes permitting.
  [[nodiscard]] static bool skinny_rows(int64_t rows);
  // Whether run_shared_input on a GemmNormInput of `rows` rows normalises in the GEMM launch (the skinny path at
  // 1-2 rows), shapes permitting: then the caller skips its separate rms_norm.
  [[nodiscard]] static bool fuses_input_norm(int64_t rows);
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
