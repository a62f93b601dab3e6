// Small-batch (decode) kernels: a skinny GEMM for at most kSkinnyGemmMaxRows activation rows that streams bf16
// weights at close to the copy rate, serving up to kSkinnyGemmMaxOutputs weight matrices that share one input in a
// single launch. Row-major, strides in elements. Launchers validate host-visible arguments and return a Status
// before launching; they never allocate or synchronise (CUDA-graph capturable).
// The kernel is chosen by the number of rows (skinny_gemm_kernel_for). At 1-2 rows it adds programmatic dependent
// launch, a fused RMSNorm of fp32 input rows, split-K for shapes with few row groups, per-output bf16 / fp32 outputs
// and per-output column offsets into x; at 3-16 rows it takes none of those fields, so skinny_gemm_supported is false
// for them there and callers fall back (to rms_norm + the plain GEMM, or one launch per output).
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "common/status.hpp"

namespace deltaserve::kernels::cuda {

inline constexpr int64_t kSkinnyGemmMaxRows = 16;
inline constexpr int kSkinnyGemmMaxOutputs = 6;
// The activation rows live in shared memory as bf16 [bucket rows, in]; larger inputs fall back (supported() false).
inline constexpr int64_t kSkinnyGemmMaxSharedBytes = 200 * 1024;

// Element type of x and of every weight (one for both): bf16 (the projections) or fp32 (the MoE router, no TF32).
// With SkinnyGemmParams::norm_x, x is fp32 and the weights bf16 (input must be kBf16).
enum class SkinnyGemmInput { kBf16, kFp32 };

// The kernel skinny_gemm runs for a shape (skinny_gemm_kernel_for):
//   kV1:   3-16 rows. A plain launch; two (<= 4 rows) or four weight rows per warp group; none of the fields marked
//          "1-2 rows" below.
//   kV2:   1 row outside kV2R1's widths. kV1's streaming plus programmatic dependent launch (the first weight slabs
//          are loaded before the wait), the fused input norm, split-K and the per-output fields.
//   kV2R1: kV2 with one weight row per warp group and 9 slabs in flight (a 2304-wide row at once, twice the groups:
//          a finer tail), at 2 rows and at 1 row for inputs of 1025-2304.
enum class SkinnyGemmKernel { kV1, kV2, kV2R1 };

// One weight matrix of a skinny GEMM and where its product goes.
struct SkinnyGemmOutput {
  const void* weight =
      nullptr;           // [n, in] of SkinnyGemmParams::input, row stride in (checkpoint layout); 16-byte aligned
  int64_t n = 0;         // output features (may be 0: the output is skipped)
  void* y = nullptr;     // [rows, n] row stride y_stride: float, or __nv_bfloat16 when y_bf16 (here or in params)
  int64_t y_stride = 0;  // >= n
  bool y_bf16 = false;   // 1-2 rows: this output bf16 (rounded once); SkinnyGemmParams::y_bf16 makes every output bf16
  int64_t x_offset = 0;  // 1-2 rows: this output reads x[:, x_offset, x_offset + in); a multiple of 16 / element size
};

// y_o[r, :] = x[r, :] · weight_o^T (fp32 accumulation) for each output o, or y_o += ... when accumulate (fp32 y
// only; beta = 1 of a cuBLAS GEMM). The sum order differs from cuBLAS's (each lane sums a strided eighth of every
// 256-wide k slab, then a warp reduction; split-K adds 2-8 such partial sums in a fixed order), so results agree
// with it to fp32 rounding, not bitwise; every launch of the same shapes sums in the same order.
// norm_x (1-2 rows): x is fp32 and the GEMM input is bf16(x[r, :] * (1 / sqrt(mean(x[r, :]^2) + norm_eps)) *
// norm_weight), bitwise the rows rms_norm (ops.hpp) writes as bf16 (same reduction order).
struct SkinnyGemmParams {
  SkinnyGemmInput input = SkinnyGemmInput::kBf16;
  const void* x = nullptr;  // [rows, in] of `input` (fp32 with norm_x), row stride x_stride (any alignment)
  int64_t x_stride = 0;     // >= in, and >= x_offset + in of every output
  int64_t rows = 0;         // [0, kSkinnyGemmMaxRows]
  int64_t in = 0;           // > 0, a multiple of 8 (bf16) or 4 (fp32): 16-byte weight rows
  SkinnyGemmOutput outputs[kSkinnyGemmMaxOutputs];
  int num_outputs = 0;      // [1, kSkinnyGemmMaxOutputs]
  bool y_bf16 = false;      // every output bf16 (rounded once) instead of fp32
  bool accumulate = false;  // fp32 outputs of bf16 input only (fp32 input: plain fp32 output); no bf16 output
  bool norm_x = false;      // 1-2 rows: x fp32 [rows, >= in], normalised on the fly (see above); x_offset 0
  const float* norm_weight = nullptr;  // fp32 [in] or nullptr (= 1)
  float norm_eps = 0.0f;
};

// The kernel for `rows` activation rows of width `in`: kV1 above 2 rows, kV2R1 at 2 rows and at 1 row when
// 1024 < in <= 2304, kV2 otherwise (docs/perf.md has the measurements behind each boundary).
[[nodiscard]] SkinnyGemmKernel skinny_gemm_kernel_for(int64_t rows, int64_t in);

// Whether skinny_gemm handles these shapes and alignments (rows, in % (16 / element size), 16-byte weights,
// shared-memory size) with the kernel of skinny_gemm_kernel_for (at 3-16 rows none of the 1-2-row fields).
// Callers fall back to cuBLAS when false.
[[nodiscard]] bool skinny_gemm_supported(const SkinnyGemmParams& params);

// Runs the skinny GEMM on `stream`; invalid_argument when !skinny_gemm_supported(params) or pointers are null.
// rows == 0: ok, nothing launched.
[[nodiscard]] Status skinny_gemm(const SkinnyGemmParams& params, cudaStream_t stream);

// The MoE layer's two normalisations of one input in one launch: y_bf16 and y_f32 both get
// x[r, :] * (1 / sqrt(mean(x[r, :]^2) + eps)) * weight (weight fp32 [dim] or nullptr = 1), the fp32 value rounded
// once for y_bf16. Same block reduction order as rms_norm (ops.hpp): each output is expected to be bitwise what
// that kernel writes (the test holds it to 1e-6 relative). x fp32 rows (stride x_stride); y_bf16 / y_f32 rows with
// strides y_bf16_stride / y_f32_stride; neither may alias x. rows == 0: ok, nothing launched.
[[nodiscard]] Status rms_norm_dual(const float* x, int64_t x_stride, const float* weight, int64_t rows, int64_t dim,
                                   float eps, __nv_bfloat16* y_bf16, int64_t y_bf16_stride, float* y_f32,
                                   int64_t y_f32_stride, cudaStream_t stream);

}  // namespace deltaserve::kernels::cuda
