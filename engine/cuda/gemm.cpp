#include "engine/cuda/gemm.hpp"

#include <algorithm>
#include <string>

#include "engine/cuda/cuda_util.hpp"
#include "kernels/cuda/gemm/small_batch.hpp"
#include "kernels/cuda/ops/ops.hpp"

namespace deltaserve::engine::cuda {

namespace kc = kernels::cuda;

namespace {

// Batches of at most this many rows take the skinny GEMM (the kernel takes up to kc::kSkinnyGemmMaxRows): its 8- and
// 16-row variants spill and made the decode step at batch 8 slower than cuBLAS.
constexpr int64_t kSkinnyRows = 4;

// Skinny-GEMM parameters for one bf16 x bf16 or fp32 x fp32 projection; num_outputs == 0 when the skinny path
// does not apply (too many rows, or a shape/alignment it does not take).
kc::SkinnyGemmParams skinny_params(const void* x, cudaDataType x_type, int64_t x_stride, const void* w, int64_t rows,
                                   int64_t in, int64_t out, void* y, cudaDataType y_type, int64_t y_stride,
                                   float beta) {
  kc::SkinnyGemmParams p;
  if ((x_type != CUDA_R_16BF && x_type != CUDA_R_32F) || rows > kSkinnyRows) return p;
  p.input = x_type == CUDA_R_32F ? kc::SkinnyGemmInput::kFp32 : kc::SkinnyGemmInput::kBf16;
  p.x = x;
  p.x_stride = x_stride;
  p.rows = rows;
  p.in = in;
  p.outputs[0] = {w, out, y, y_stride};
  p.num_outputs = 1;
  p.y_bf16 = y_type == CUDA_R_16BF;
  p.accumulate = beta != 0.0f;
  if (!kc::skinny_gemm_supported(p)) p.num_outputs = 0;
  return p;
}

}  // namespace

Gemm::~Gemm() {
  if (handle_ != nullptr) (void)cublasDestroy(handle_);  // before its workspace is freed (member order)
}

Status Gemm::init(cudaStream_t stream) {
  DS_CUBLAS_RETURN(cublasCreate(&handle_));
  stream_ = stream;
  DS_RETURN_IF_ERROR(workspace_.allocate(kWorkspaceBytes, "cuBLAS workspace"));
  DS_CUBLAS_RETURN(cublasSetStream(handle_, stream));
  DS_CUBLAS_RETURN(cublasSetWorkspace(handle_, workspace_.data(), workspace_.bytes()));
  // Full fp32 for the fp32 GEMMs (the router): no TF32 down-conversion.
  DS_CUBLAS_RETURN(cublasSetMathMode(handle_, CUBLAS_DEFAULT_MATH));
  return Status::ok();
}

// Row-major y[rows, out] = x[rows, in] · w[out, in]^T is, column-major, y^T[out, rows] = w^T[in, out]^T · x^T[in,
// rows]: A = w read transposed (lda = in), B = x (ldb = x_stride), C = y (ldc = y_stride).
Status Gemm::gemm_ex(const void* x, cudaDataType x_type, int64_t x_stride, const void* w, int64_t rows, int64_t in,
                     int64_t out, void* y, cudaDataType y_type, int64_t y_stride, float beta) {
  if (rows == 0 || out == 0) return Status::ok();
  if (rows < 0 || in <= 0 || out < 0 || x_stride < in || y_stride < out) {
    return internal_error("gemm: bad shape rows " + std::to_string(rows) + " in " + std::to_string(in) + " out " +
                          std::to_string(out) + " x_stride " + std::to_string(x_stride) + " y_stride " +
                          std::to_string(y_stride));
  }
  if (x == nullptr || w == nullptr || y == nullptr) return internal_error("gemm: null pointer");
  const kc::SkinnyGemmParams skinny = skinny_params(x, x_type, x_stride, w, rows, in, out, y, y_type, y_stride, beta);
  if (skinny.num_outputs > 0) return kc::skinny_gemm(skinny, stream_);
  // Another user of the handle (mla_prefill) may have moved it to its own stream; cublasSetStream
  // resets the workspace to cuBLAS's default pool, so ours is set again (graph capture needs it).
  DS_CUBLAS_RETURN(cublasSetStream(handle_, stream_));
  DS_CUBLAS_RETURN(cublasSetWorkspace(handle_, workspace_.data(), workspace_.bytes()));
  const float alpha = 1.0f;
  DS_CUBLAS_RETURN(cublasGemmEx(handle_, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(out), static_cast<int>(rows),
                                static_cast<int>(in), &alpha, w, x_type, static_cast<int>(in), x, x_type,
                                static_cast<int>(x_stride), &beta, y, y_type, static_cast<int>(y_stride),
                                CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  return Status::ok();
}

Status Gemm::run(const __nv_bfloat16* x, int64_t x_stride, const __nv_bfloat16* w, int64_t rows, int64_t in,
                 int64_t out, float* y, int64_t y_stride, bool accumulate) {
  return gemm_ex(x, CUDA_R_16BF, x_stride, w, rows, in, out, y, CUDA_R_32F, y_stride, accumulate ? 1.0f : 0.0f);
}

Status Gemm::run(const __nv_bfloat16* x, int64_t x_stride, const __nv_bfloat16* w, int64_t rows, int64_t in,
                 int64_t out, __nv_bfloat16* y, int64_t y_stride) {
  return gemm_ex(x, CUDA_R_16BF, x_stride, w, rows, in, out, y, CUDA_R_16BF, y_stride, 0.0f);
}

bool Gemm::skinny_rows(int64_t rows) {
  return rows <= kSkinnyRows;
}

bool Gemm::fuses_input_norm(int64_t rows) {
  // The input width does not decide whether the kernel takes the fused norm (only between its 1-row layouts).
  return skinny_rows(rows) && kc::skinny_gemm_kernel_for(rows, /*in=*/0) != kc::SkinnyGemmKernel::kV1;
}

namespace {

Status check_targets(std::initializer_list<GemmTarget> targets) {
  for (const GemmTarget& target : targets) {
    if (target.w == nullptr || target.y == nullptr) return internal_error("gemm: null pointer in shared-input target");
  }
  return Status::ok();
}

// One skinny launch for every target of x (x, x_stride, rows, in already set in *p); false when it does not apply.
bool shared_input_params(std::initializer_list<GemmTarget> targets, kc::SkinnyGemmParams* p) {
  if (targets.size() > static_cast<size_t>(kc::kSkinnyGemmMaxOutputs)) return false;
  // All bf16: the params-wide flag (what every skinny kernel takes); otherwise per output (1-2 rows only).
  p->y_bf16 = std::all_of(targets.begin(), targets.end(), [](const GemmTarget& t) { return t.y_bf16; });
  for (const GemmTarget& target : targets) {
    kc::SkinnyGemmOutput& out = p->outputs[p->num_outputs++];
    out = {target.w, target.out, target.y, target.y_stride};
    out.y_bf16 = target.y_bf16 && !p->y_bf16;
    out.x_offset = target.x_offset;
  }
  return kc::skinny_gemm_supported(*p);
}

}  // namespace

Status Gemm::run_shared_input(const __nv_bfloat16* x, int64_t x_stride, int64_t rows, int64_t in,
                              std::initializer_list<GemmTarget> targets) {
  if (rows == 0) return Status::ok();
  DS_RETURN_IF_ERROR(check_targets(targets));
  if (skinny_rows(rows) && x != nullptr) {
    kc::SkinnyGemmParams p;
    p.x = x;
    p.x_stride = x_stride;
    p.rows = rows;
    p.in = in;
    if (shared_input_params(targets, &p)) return kc::skinny_gemm(p, stream_);
  }
  for (const GemmTarget& target : targets) {
    if (target.y_bf16) {
      DS_RETURN_IF_ERROR(run(x + target.x_offset, x_stride, target.w, rows, in, target.out,
                             static_cast<__nv_bfloat16*>(target.y), target.y_stride));
    } else {
      DS_RETURN_IF_ERROR(run(x + target.x_offset, x_stride, target.w, rows, in, target.out,
                             static_cast<float*>(target.y), target.y_stride));
    }
  }
  return Status::ok();
}

Status Gemm::run_shared_input(const GemmNormInput& x, int64_t rows, int64_t in,
                              std::initializer_list<GemmTarget> targets) {
  if (rows == 0) return Status::ok();
  if (x.x == nullptr || x.scratch == nullptr) return internal_error("gemm: null normalised input");
  DS_RETURN_IF_ERROR(check_targets(targets));
  if (skinny_rows(rows)) {
    kc::SkinnyGemmParams p;
    p.x = x.x;
    p.x_stride = x.x_stride;
    p.rows = rows;
    p.in = in;
    p.norm_x = true;
    p.norm_weight = x.weight;
    p.norm_eps = x.eps;
    if (shared_input_params(targets, &p)) return kc::skinny_gemm(p, stream_);
  }
  DS_RETURN_IF_ERROR(kc::rms_norm(x.x, x.x_stride, x.weight, rows, in, x.eps, x.scratch, in, stream_));
  return run_shared_input(x.scratch, in, rows, in, targets);
}

Status Gemm::run_f32(const float* x, int64_t x_stride, const float* w, int64_t rows, int64_t in, int64_t out, float* y,
                     int64_t y_stride) {
  return gemm_ex(x, CUDA_R_32F, x_stride, w, rows, in, out, y, CUDA_R_32F, y_stride, 0.0f);
}

}  // namespace deltaserve::engine::cuda
