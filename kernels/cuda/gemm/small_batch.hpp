// Small-batch (decode) kernels: a skinny GEMM for at most kSkinnyGemmMaxRows activation rows that streams bf16
// weights at close to the copy rate, serving up to kSkinnyGemmMaxOutputs weight matrices that share one input in a
// single launch. Row-major, strides in elements. Launchers validate host-visible arguments and return a Status
// before launching; they never allocate or synchronise (CUDA-graph capturable).
// Two kernels (SkinnyGemmKernel): v1, the original launch, and v2 (the default), which adds programmatic dependent
// launch, a fused RMSNorm of fp32 input rows, split-K for shapes with few row groups, per-output bf16 / fp32 outputs
// and per-output column offsets into x. The v2-only fields below make skinny_gemm_supported false under v1, so
// callers fall back (to rms_norm + the plain GEMM, or one launch per output).
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

// Which kernel skinny_gemm runs. kDefault: the environment variable DELTASERVE_SKINNY_GEMM_KERNEL (read once):
// "v1" the original kernel and plain launch; "v2" v2; "v2-nopdl" v2 launched without programmatic dependent launch;
// "v2-r1" v2 with one weight row per warp group and 9 slabs in flight at <= 4 rows (tail balance); unset or anything
// else: by shape (skinny_gemm_kernel_for). Tests and timing cases pick one explicitly.
// DELTASERVE_SKINNY_GEMM_SPLIT=1|2|4|8 (read once) forces v2's split-K where split_k is 0.
enum class SkinnyGemmKernel { kDefault, kV1, kV2, kV2NoPdl, kV2R1 };

// One weight matrix of a skinny GEMM and where its product goes.
struct SkinnyGemmOutput {
  const void* weight =
      nullptr;           // [n, in] of SkinnyGemmParams::input, row stride in (checkpoint layout); 16-byte aligned
  int64_t n = 0;         // output features (may be 0: the output is skipped)
  void* y = nullptr;     // [rows, n] row stride y_stride: float, or __nv_bfloat16 when y_bf16 (here or in params)
  int64_t y_stride = 0;  // >= n
  bool y_bf16 = false;   // v2: this output bf16 (rounded once); SkinnyGemmParams::y_bf16 makes every output bf16
  int64_t x_offset = 0;  // v2: this output reads x[:, x_offset, x_offset + in); a multiple of 16 / element size
};

// y_o[r, :] = x[r, :] · weight_o^T (fp32 accumulation) for each output o, or y_o += ... when accumulate (fp32 y
// only; beta = 1 of a cuBLAS GEMM). The sum order differs from cuBLAS's (each lane sums a strided eighth of every
// 256-wide k slab, then a warp reduction; v2's split-K adds 2-8 such partial sums in a fixed order), so results
// agree with it to fp32 rounding, not bitwise; every launch of the same shapes sums in the same order.
// norm_x (v2): x is fp32 and the GEMM input is bf16(x[r, :] * (1 / sqrt(mean(x[r, :]^2) + norm_eps)) * norm_weight),
// bitwise the rows rms_norm (ops.hpp) writes as bf16 (same reduction order); rows <= 4.
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
  bool norm_x = false;      // v2: x fp32 [rows, >= in], normalised on the fly (see above); x_offset 0
  const float* norm_weight = nullptr;  // fp32 [in] or nullptr (= 1)
  float norm_eps = 0.0f;
  SkinnyGemmKernel kernel = SkinnyGemmKernel::kDefault;
  int split_k = 0;  // v2: warps per row group, 1, 2, 4 or 8; 0 chooses from the row groups and resident warps
};

// The kernel kDefault resolves to for `rows` activation rows of width `in`: the environment's choice when it names
// one, otherwise by shape, as measured on the H200 (SkinnyGemmGpu.Timing and the 48B decode step, 2026-12-01):
// v2-r1 at 1 row when 1024 < in <= 2304 (a whole row in flight: the KDA projection 15.6 against v2's 16.7 and v1's
// 16.4 us, MLA kv_a + q_proj 9.7 against 12.2 and 14.5), v2 at 1 row otherwise (o_proj 7.4 against 8.5, KDA f_b + g_b
// 3.6 against 5.5), v2-r1 at 2 rows (the 48B decode step at batch 2 with the fused gates and MoE norm, 2026-12-01:
// 3.710 against v2's 3.806-3.813 ms; at 1 and 4 rows r1 everywhere was slower, 2.688 against 2.677 and 5.689 against
// 5.549), v1 above 2 rows (at 4 rows v2 is slower: o_proj 18.0 against 13.1 us, the LM head 249 against 193; decode
// step 5.82 against 5.65 ms). Never kDefault.
[[nodiscard]] SkinnyGemmKernel skinny_gemm_kernel_for(int64_t rows, int64_t in);

// Whether skinny_gemm handles these shapes and alignments (rows, in % (16 / element size), 16-byte
// weights, shared-memory size) with the kernel params.kernel selects (v1 takes none of the v2-only fields).
// Callers fall back to cuBLAS when false.
[[nodiscard]] bool skinny_gemm_supported(const SkinnyGemmParams& params);

// Whether the engine routes GEMMs of `input` through the skinny GEMM. The environment variable
// DELTASERVE_SKINNY_GEMM (read once) bypasses it without a rebuild: "off" (or "0") keeps cuBLAS for every GEMM,
// "bf16" keeps it for the fp32 router only; unset or anything else: both.
[[nodiscard]] bool skinny_gemm_enabled(SkinnyGemmInput input);

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
