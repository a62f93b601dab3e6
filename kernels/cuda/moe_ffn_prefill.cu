// MoE expert FFN, prefill path (contract in moe.hpp). By default it hands the work to moe_expert_ffn_grouped
// (moe_ffn_grouped.cu). The reference path here: per expert with rows, two cuBLAS bf16 GEMMs with fp32 compute
// (tensor cores) around one glu kernel over all sorted rows.
// Row-major data in column-major cuBLAS: a row-major [m, n] matrix is the column-major [n, m] one, so
//   H[n_e, 2I] = X[n_e, W] · GU^T   is   H^T (2I x n_e, ld 2I) = op_T(GU as W x 2I, ld W) · (X^T as W x n_e, ld W)
//   Y[n_e, W]  = A[n_e, I] · D^T    is   Y^T (W x n_e, ld W)   = op_T(D as I x W, ld I)   · (A^T as I x n_e, ld I)
// H is the fp32 workspace [R, 2I]; A = activated (bf16, rounded once); Y = y_sorted (fp32).
#include <string>

#include "kernels/cuda/activations.cuh"
#include "kernels/cuda/moe.hpp"

namespace deltaserve::kernels::cuda {
namespace {

__global__ void glu_rows_kernel(const float* h, int64_t rows, int64_t inter, int situ, float beta, float beta_linear,
                                __nv_bfloat16* activated) {
  const int64_t total = rows * inter;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / inter, j = i - r * inter;
    const float gate = h[r * 2 * inter + j], up = h[r * 2 * inter + inter + j];
    activated[i] = __float2bfloat16(situ ? situ_glu_f(gate, up, beta, beta_linear) : swiglu_f(gate, up));
  }
}

Status cublas_status(const char* what, cublasStatus_t status) {
  if (status == CUBLAS_STATUS_SUCCESS) return Status::ok();
  return internal_error(std::string("moe_expert_ffn_prefill: ") + what + ": cuBLAS status " +
                        std::to_string(static_cast<int>(status)));
}

}  // namespace

size_t moe_ffn_prefill_workspace_bytes(int64_t rows, int64_t intermediate) {
  if (rows < 0 || intermediate < 0) return 0;
  return static_cast<size_t>(rows * 2 * intermediate) * sizeof(float);
}

Status moe_expert_ffn_prefill(const MoeFfnParams& params, const std::vector<int32_t>& host_offsets,
                              cublasHandle_t handle, cudaStream_t stream) {
  const MoeExpertWeights& w = params.weights;
  const int64_t W = w.width, I = w.intermediate, R = params.rows;
  const int E = w.num_experts;
  if (E < 1) return invalid_argument("moe_expert_ffn_prefill: num_experts must be >= 1");
  if (W < 1 || I < 1 || W > 0x7fffffff || 2 * I > 0x7fffffff) {
    return invalid_argument("moe_expert_ffn_prefill: width and intermediate must be positive int32");
  }
  if (R < 0 || R > 0x7fffffff) return invalid_argument("moe_expert_ffn_prefill: rows out of range");
  if (params.glu == GluKind::kSitu && !(params.situ_beta > 0.0f && params.situ_linear_beta > 0.0f)) {
    return invalid_argument("moe_expert_ffn_prefill: SiTU betas must be positive");
  }
  if (host_offsets.size() != static_cast<size_t>(E) + 1) {
    return invalid_argument("moe_expert_ffn_prefill: host_offsets must have num_experts + 1 entries (got " +
                            std::to_string(host_offsets.size()) + ")");
  }
  if (host_offsets[0] != 0) return invalid_argument("moe_expert_ffn_prefill: host_offsets[0] must be 0");
  for (int e = 0; e < E; ++e) {
    if (host_offsets[e + 1] < host_offsets[e]) {
      return invalid_argument("moe_expert_ffn_prefill: host_offsets must be non-decreasing (at expert " +
                              std::to_string(e) + ")");
    }
  }
  const int64_t used = host_offsets[E];
  if (used > R) {
    return invalid_argument("moe_expert_ffn_prefill: host_offsets[E] = " + std::to_string(used) + " exceeds rows " +
                            std::to_string(R));
  }
  if (used == 0) return Status::ok();
  if (handle == nullptr) return invalid_argument("moe_expert_ffn_prefill: cuBLAS handle must be non-null");
  if (w.gate_up == nullptr || w.down == nullptr || params.x_sorted == nullptr || params.activated == nullptr ||
      params.y_sorted == nullptr) {
    return invalid_argument("moe_expert_ffn_prefill: weights, x_sorted, activated and y_sorted must be non-null");
  }
  const size_t needed = moe_ffn_prefill_workspace_bytes(R, I);
  if (params.workspace == nullptr || params.workspace_bytes < needed ||
      (reinterpret_cast<uintptr_t>(params.workspace) & 15u) != 0) {
    return invalid_argument("moe_expert_ffn_prefill: workspace must be 16-byte aligned with >= " +
                            std::to_string(needed) + " bytes (got " + std::to_string(params.workspace_bytes) + ")");
  }

  if (!params.use_reference_path && !moe_reference_ffn_forced()) {
    const Status grouped = moe_expert_ffn_grouped(params, stream);
    if (grouped.code() != StatusCode::kInvalidArgument) return grouped;
    // The grouped path's own constraints (alignment, row tiles) were not met: the reference path below handles them.
  }

  Status status = cublas_status("set stream", cublasSetStream(handle, stream));
  if (!status) return status;
  status = cublas_status("set pointer mode", cublasSetPointerMode(handle, CUBLAS_POINTER_MODE_HOST));
  if (!status) return status;
  float* h = static_cast<float*>(params.workspace);
  const float one = 1.0f, zero = 0.0f;
  const int w32 = static_cast<int>(W), i32 = static_cast<int>(I), gu32 = static_cast<int>(2 * I);

  for (int e = 0; e < E; ++e) {
    const int begin = host_offsets[e], n = host_offsets[e + 1] - begin;
    if (n == 0) continue;
    const __nv_bfloat16* gu = w.gate_up + static_cast<int64_t>(e) * 2 * I * W;
    status =
        cublas_status("gate/up GEMM", cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, gu32, n, w32, &one, gu,
                                                   CUDA_R_16BF, w32, params.x_sorted + static_cast<int64_t>(begin) * W,
                                                   CUDA_R_16BF, w32, &zero, h + static_cast<int64_t>(begin) * 2 * I,
                                                   CUDA_R_32F, gu32, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    if (!status) return status;
  }

  const int64_t total = used * I;
  const int threads = 256;
  const int64_t blocks64 = (total + threads - 1) / threads;
  const unsigned blocks = static_cast<unsigned>(blocks64 < (1 << 20) ? blocks64 : (1 << 20));
  glu_rows_kernel<<<blocks, threads, 0, stream>>>(h, used, I, params.glu == GluKind::kSitu ? 1 : 0, params.situ_beta,
                                                  params.situ_linear_beta, params.activated);
  const cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) {
    return internal_error(std::string("moe_expert_ffn_prefill: glu launch: ") + cudaGetErrorName(error) + " (" +
                          cudaGetErrorString(error) + ")");
  }

  for (int e = 0; e < E; ++e) {
    const int begin = host_offsets[e], n = host_offsets[e + 1] - begin;
    if (n == 0) continue;
    const __nv_bfloat16* d = w.down + static_cast<int64_t>(e) * W * I;
    status =
        cublas_status("down GEMM", cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, w32, n, i32, &one, d, CUDA_R_16BF,
                                                i32, params.activated + static_cast<int64_t>(begin) * I, CUDA_R_16BF,
                                                i32, &zero, params.y_sorted + static_cast<int64_t>(begin) * W,
                                                CUDA_R_32F, w32, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    if (!status) return status;
  }
  return Status::ok();
}

}  // namespace deltaserve::kernels::cuda
