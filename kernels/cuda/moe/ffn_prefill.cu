// MoE expert FFN, prefill path (contract in moe.hpp). By default it hands the work to moe_expert_ffn_grouped
// (moe_ffn_grouped.cu). The reference path here: per expert with rows, two cuBLAS bf16 GEMMs with fp32 compute
// (tensor cores) around one glu kernel over all sorted rows.
// Row-major data in column-major cuBLAS: a row-major [m, n] matrix is the column-major [n, m] one, so
//   H[n_e, 2I] = X[n_e, W] · GU^T   is   H^T (2I x n_e, ld 2I) = op_T(GU as W x 2I, ld W) · (X^T as W x n_e, ld W)
//   Y[n_e, W]  = A[n_e, I] · D^T    is   Y^T (W x n_e, ld W)   = op_T(D as I x W, ld I)   · (A^T as I x n_e, ld I)
// H is the fp32 workspace [R, 2I]; A = activated (bf16, rounded once); Y = y_sorted (fp32).
// Also here: moe_expert_ffn_cublas_grouped (DELTASERVE_MOE_PREFILL=cublas-grouped), the same two GEMMs as one
// cublasGemmGroupedBatchedEx call each (one group of one GEMM per expert with rows, the same column-major views),
// the glu kernel between them.
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>

#include "kernels/cuda/common/detail/activations.cuh"
#include "kernels/cuda/moe/moe.hpp"

namespace deltaserve::kernels::cuda {
namespace {

template <typename H>
__global__ void glu_rows_kernel(const H* h, int64_t rows, int64_t inter, int situ, float beta, float beta_linear,
                                __nv_bfloat16* activated) {
  const int64_t total = rows * inter;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / inter, j = i - r * inter;
    const float gate = static_cast<float>(h[r * 2 * inter + j]), up = static_cast<float>(h[r * 2 * inter + inter + j]);
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

// ---- cuBLAS grouped path -------------------------------------------------------------------------------------
namespace {

// Per thread and device: a cuBLAS handle, pinned host staging (offsets, pointer arrays) and the device pointer
// arrays, reused across calls. `done` is recorded after the last GEMM that reads the device pointer arrays; the next
// call waits on it before it rewrites the staging (so neither buffer is overwritten while in use).
struct GroupedContext {
  cublasHandle_t handle = nullptr;
  int32_t* host_offsets = nullptr;  // pinned [kMoeMaxExperts + 1]
  void** host_ptrs = nullptr;       // pinned [6 * kMoeMaxExperts]
  void** dev_ptrs = nullptr;        // device [6 * kMoeMaxExperts]
  cudaEvent_t done = nullptr;
  bool ready = false;
};

Status cuda_status(const char* what, cudaError_t error) {
  if (error == cudaSuccess) return Status::ok();
  return internal_error(std::string("moe_expert_ffn_cublas_grouped: ") + what + ": " + cudaGetErrorName(error) + " (" +
                        cudaGetErrorString(error) + ")");
}

Status grouped_context(GroupedContext** out) {
  int device = 0;
  Status status = cuda_status("get device", cudaGetDevice(&device));
  if (!status) return status;
  // Intentionally never freed: lives until the thread ends (a few hundred KB per thread and device).
  thread_local std::map<int, GroupedContext> contexts;
  GroupedContext& c = contexts[device];
  if (!c.ready) {
    constexpr size_t kPtrBytes = 6 * static_cast<size_t>(kMoeMaxExperts) * sizeof(void*);
    if (c.host_offsets == nullptr) {
      status =
          cuda_status("pinned offsets", cudaMallocHost(reinterpret_cast<void**>(&c.host_offsets),
                                                       (static_cast<size_t>(kMoeMaxExperts) + 1) * sizeof(int32_t)));
      if (!status) return status;
    }
    if (c.host_ptrs == nullptr) {
      status = cuda_status("pinned pointers", cudaMallocHost(reinterpret_cast<void**>(&c.host_ptrs), kPtrBytes));
      if (!status) return status;
    }
    if (c.dev_ptrs == nullptr) {
      status = cuda_status("device pointers", cudaMalloc(reinterpret_cast<void**>(&c.dev_ptrs), kPtrBytes));
      if (!status) return status;
    }
    if (c.done == nullptr) {
      status = cuda_status("event", cudaEventCreateWithFlags(&c.done, cudaEventDisableTiming));
      if (!status) return status;
    }
    c.ready = true;
  }
  *out = &c;
  return Status::ok();
}

Status context_handle(GroupedContext* c, cublasHandle_t* out) {
  if (c->handle == nullptr) {
    const Status status = cublas_status("create handle", cublasCreate(&c->handle));
    if (!status) {
      c->handle = nullptr;
      return status;
    }
  }
  *out = c->handle;
  return Status::ok();
}

// 0: not yet tried; 1: cuBLAS accepted fp32 C with bf16 A/B; 2: it returned NOT_SUPPORTED / INVALID_VALUE.
std::atomic<int> g_gate_up_fp32{0};
std::atomic<int> g_down_fp32{0};
// What the last call used: bit 0 gate/up C bf16, bit 1 down per-expert; -1 none yet.
std::atomic<int> g_last_mode{-1};

// Records `done` on `stream` when it leaves scope (every exit after the pointer arrays were first copied, error
// paths included), so the next call never rewrites the staging or the device array under pending work.
struct RecordOnExit {
  cudaEvent_t event;
  cudaStream_t stream;
  bool armed = false;
  ~RecordOnExit() {
    if (armed) cudaEventRecord(event, stream);
  }
};

bool unsupported(cublasStatus_t s) {
  return s == CUBLAS_STATUS_NOT_SUPPORTED || s == CUBLAS_STATUS_INVALID_VALUE;
}

}  // namespace

const char* moe_cublas_grouped_mode() {
  switch (g_last_mode.load()) {
    case 0:
      return "gate_up C fp32, down grouped fp32";
    case 1:
      return "gate_up C bf16, down grouped fp32";
    case 2:
      return "gate_up C fp32, down per-expert fp32";
    case 3:
      return "gate_up C bf16, down per-expert fp32";
    default:
      return "gate_up C unprobed, down unprobed";
  }
}

MoePrefillPath moe_prefill_path() {
  static const MoePrefillPath path = [] {
    const char* value = std::getenv("DELTASERVE_MOE_PREFILL");
    if (value == nullptr || value[0] == '\0') return MoePrefillPath::kWgmma;
    const std::string v(value);
    if (v == "cublas-grouped") return MoePrefillPath::kCublasGrouped;
    if (v == "grouped-kernel") return MoePrefillPath::kGroupedKernel;
    if (v != "wgmma") {
      std::fprintf(
          stderr, "DELTASERVE_MOE_PREFILL=%s not recognised (wgmma | grouped-kernel | cublas-grouped): wgmma\n", value);
    }
    return MoePrefillPath::kWgmma;
  }();
  return path;
}

bool moe_prefill_cublas_grouped_selected() {
  return moe_prefill_path() == MoePrefillPath::kCublasGrouped;
}

Status moe_expert_ffn_cublas_grouped(const MoeFfnParams& params, const int32_t* host_offsets, cublasHandle_t handle,
                                     cudaStream_t stream) {
  const MoeExpertWeights& w = params.weights;
  const int64_t W = w.width, I = w.intermediate, R = params.rows;
  const int E = w.num_experts;
  const char* const kName = "moe_expert_ffn_cublas_grouped: ";
  if (E < 1 || E > kMoeMaxExperts) {
    return invalid_argument(std::string(kName) + "num_experts must be in [1, 1024] (got " + std::to_string(E) + ")");
  }
  if (W < 8 || W % 8 != 0 || I < 8 || I % 8 != 0 || W > (1 << 29) || I > (1 << 29)) {
    return invalid_argument(std::string(kName) + "width and intermediate must be positive multiples of 8");
  }
  if (R < 0 || R > 0x7fffffff) return invalid_argument(std::string(kName) + "rows out of range");
  if (params.glu == GluKind::kSitu && !(params.situ_beta > 0.0f && params.situ_linear_beta > 0.0f)) {
    return invalid_argument(std::string(kName) + "SiTU betas must be positive");
  }
  if (R == 0) return Status::ok();
  if (w.gate_up == nullptr || w.down == nullptr || params.x_sorted == nullptr || params.activated == nullptr ||
      params.y_sorted == nullptr || (host_offsets == nullptr && params.expert_offsets == nullptr)) {
    return invalid_argument(std::string(kName) + "weights, x_sorted, offsets, activated, y_sorted must be non-null");
  }
  auto misaligned = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) != 0; };
  if (misaligned(w.gate_up) || misaligned(w.down) || misaligned(params.x_sorted) || misaligned(params.activated) ||
      misaligned(params.y_sorted)) {
    return invalid_argument(std::string(kName) + "weights, x_sorted, activated, y_sorted must be 16-byte aligned");
  }
  // Where the gate/up product goes: the caller's workspace (fp32 [R, 2I]) or the y_sorted buffer (dead until the
  // down GEMM, which runs after the glu kernel has read it: same stream).
  const bool workspace_fits = params.workspace != nullptr && !misaligned(params.workspace) &&
                              params.workspace_bytes >= static_cast<size_t>(R * 2 * I) * sizeof(float);
  void* h_buffer = workspace_fits ? params.workspace : static_cast<void*>(params.y_sorted);
  const bool h_fp32_fits = workspace_fits || 2 * I <= W;
  const bool h_bf16_fits = workspace_fits || I <= W;
  if (!h_bf16_fits) {
    return invalid_argument(std::string(kName) + "no room for the gate/up product (no workspace and I > width)");
  }

  // Offsets: 0 = offsets[0] <= ... <= offsets[E] <= R. Host offsets are checked before any CUDA call.
  auto check_offsets = [&](const int32_t* o) -> Status {
    if (o[0] != 0) return invalid_argument(std::string(kName) + "offsets[0] must be 0");
    for (int e = 0; e < E; ++e) {
      if (o[e + 1] < o[e]) {
        return invalid_argument(std::string(kName) + "offsets must be non-decreasing (at expert " + std::to_string(e) +
                                ")");
      }
    }
    if (o[E] > R) {
      return invalid_argument(std::string(kName) + "offsets[E] = " + std::to_string(o[E]) + " exceeds rows " +
                              std::to_string(R));
    }
    return Status::ok();
  };
  if (host_offsets != nullptr) {
    const Status valid = check_offsets(host_offsets);
    if (!valid) return valid;
    if (host_offsets[E] == 0) return Status::ok();
  }

  GroupedContext* ctx = nullptr;
  Status status = grouped_context(&ctx);
  if (!status) return status;
  if (handle == nullptr) {
    status = context_handle(ctx, &handle);
    if (!status) return status;
  }
  // The previous call's GEMMs may still read the device pointer array, its copy the pinned staging.
  status = cuda_status("wait for the previous call", cudaEventSynchronize(ctx->done));
  if (!status) return status;

  // (a) offsets on the host.
  const int32_t* offsets = host_offsets;
  if (offsets == nullptr) {
    status = cuda_status("copy offsets", cudaMemcpyAsync(ctx->host_offsets, params.expert_offsets,
                                                         (static_cast<size_t>(E) + 1) * sizeof(int32_t),
                                                         cudaMemcpyDeviceToHost, stream));
    if (!status) return status;
    status = cuda_status("sync offsets", cudaStreamSynchronize(stream));
    if (!status) return status;
    offsets = ctx->host_offsets;
  }
  Status valid = check_offsets(offsets);
  if (!valid) return valid;
  const int64_t used = offsets[E];
  if (used == 0) return Status::ok();

  // (b) per-expert arrays: one group of one GEMM per expert with rows. Column-major view as in the reference path
  // above: gate/up m = 2I, n = n_e, k = W; down m = W, n = n_e, k = I; A = weights (op T), B = rows (op N).
  thread_local std::vector<int> m_gu, n_rows, k_gu, m_dn, k_dn, ld_w, ld_i, ld_gu, group_size;
  thread_local std::vector<cublasOperation_t> op_t, op_n;
  thread_local std::vector<float> ones, zeros;
  thread_local std::vector<int> begins;
  n_rows.clear();
  begins.clear();
  for (int e = 0; e < E; ++e) {
    const int n = offsets[e + 1] - offsets[e];
    if (n == 0) continue;
    n_rows.push_back(n);
    begins.push_back(e);
  }
  const int G = static_cast<int>(n_rows.size());
  // Each of the 6 device pointer arrays starts on a 256-byte boundary (32 pointers): G <= E <= 1024.
  const int S = (G + 31) / 32 * 32;
  const int w32 = static_cast<int>(W), i32 = static_cast<int>(I), gu32 = static_cast<int>(2 * I);
  m_gu.assign(G, gu32);
  k_gu.assign(G, w32);
  m_dn.assign(G, w32);
  k_dn.assign(G, i32);
  ld_w.assign(G, w32);
  ld_i.assign(G, i32);
  ld_gu.assign(G, gu32);
  group_size.assign(G, 1);
  op_t.assign(G, CUBLAS_OP_T);
  op_n.assign(G, CUBLAS_OP_N);
  ones.assign(G, 1.0f);
  zeros.assign(G, 0.0f);

  // Pointer arrays (6 x G): gate/up A, B, C; down A, B, C. The gate/up C pointers depend on its output type, so
  // they are written for fp32 and, if cuBLAS rejects fp32 C, rewritten for bf16 (another copy).
  void** hp = ctx->host_ptrs;
  void** dp = ctx->dev_ptrs;
  auto fill = [&](bool fp32_c) {
    for (int g = 0; g < G; ++g) {
      const int e = begins[g];
      const int64_t begin = offsets[e];
      hp[0 * S + g] = const_cast<__nv_bfloat16*>(w.gate_up + static_cast<int64_t>(e) * 2 * I * W);
      hp[1 * S + g] = const_cast<__nv_bfloat16*>(params.x_sorted + begin * W);
      hp[2 * S + g] = fp32_c ? static_cast<void*>(static_cast<float*>(h_buffer) + begin * 2 * I)
                             : static_cast<void*>(static_cast<__nv_bfloat16*>(h_buffer) + begin * 2 * I);
      hp[3 * S + g] = const_cast<__nv_bfloat16*>(w.down + static_cast<int64_t>(e) * W * I);
      hp[4 * S + g] = params.activated + begin * I;
      hp[5 * S + g] = params.y_sorted + begin * W;
    }
    return cuda_status("copy pointer arrays", cudaMemcpyAsync(dp, hp, 6 * static_cast<size_t>(S) * sizeof(void*),
                                                              cudaMemcpyHostToDevice, stream));
  };

  status = cublas_status("set stream", cublasSetStream(handle, stream));
  if (!status) return status;
  status = cublas_status("set pointer mode", cublasSetPointerMode(handle, CUBLAS_POINTER_MODE_HOST));
  if (!status) return status;
  RecordOnExit record{ctx->done, stream};

  // (c) gate/up: fp32 C unless cuBLAS rejected it before (or there is no room); else bf16 C.
  bool h_fp32 = h_fp32_fits && g_gate_up_fp32.load() != 2;
  auto gate_up = [&](bool fp32) {
    return cublasGemmGroupedBatchedEx(handle, op_t.data(), op_n.data(), m_gu.data(), n_rows.data(), k_gu.data(),
                                      ones.data(), const_cast<const void* const*>(dp + 0 * S), CUDA_R_16BF, ld_w.data(),
                                      const_cast<const void* const*>(dp + 1 * S), CUDA_R_16BF, ld_w.data(),
                                      zeros.data(), dp + 2 * S, fp32 ? CUDA_R_32F : CUDA_R_16BF, ld_gu.data(), G,
                                      group_size.data(), CUBLAS_COMPUTE_32F);
  };
  record.armed = true;
  status = fill(h_fp32);
  if (!status) return status;
  cublasStatus_t cs = gate_up(h_fp32);
  if (h_fp32 && unsupported(cs)) {
    g_gate_up_fp32.store(2);
    h_fp32 = false;
    // The copy above must land before the staging is rewritten.
    status = cuda_status("sync before restaging", cudaStreamSynchronize(stream));
    if (!status) return status;
    status = fill(false);
    if (!status) return status;
    cs = gate_up(false);
  } else if (h_fp32 && cs == CUBLAS_STATUS_SUCCESS) {
    g_gate_up_fp32.store(1);
  }
  if (cs != CUBLAS_STATUS_SUCCESS) {
    // Nothing but the pointer copy was enqueued: the caller may run the grouped kernels instead.
    return unimplemented(std::string(kName) + "cublasGemmGroupedBatchedEx (gate/up, C " + (h_fp32 ? "fp32" : "bf16") +
                         ") returned cuBLAS status " + std::to_string(static_cast<int>(cs)));
  }

  // (d) glu over the used rows.
  const int64_t total = used * I;
  const int threads = 256;
  const int64_t blocks64 = (total + threads - 1) / threads;
  const unsigned blocks = static_cast<unsigned>(blocks64 < (1 << 20) ? blocks64 : (1 << 20));
  const int situ = params.glu == GluKind::kSitu ? 1 : 0;
  if (h_fp32) {
    glu_rows_kernel<<<blocks, threads, 0, stream>>>(static_cast<const float*>(h_buffer), used, I, situ,
                                                    params.situ_beta, params.situ_linear_beta, params.activated);
  } else {
    glu_rows_kernel<<<blocks, threads, 0, stream>>>(static_cast<const __nv_bfloat16*>(h_buffer), used, I, situ,
                                                    params.situ_beta, params.situ_linear_beta, params.activated);
  }
  status = cuda_status("glu launch", cudaGetLastError());
  if (!status) return status;

  // (e) down into y_sorted, fp32 C; per-expert cublasGemmEx if cuBLAS rejects fp32 C in the grouped call.
  bool down_grouped = g_down_fp32.load() != 2;
  if (down_grouped) {
    cs = cublasGemmGroupedBatchedEx(handle, op_t.data(), op_n.data(), m_dn.data(), n_rows.data(), k_dn.data(),
                                    ones.data(), const_cast<const void* const*>(dp + 3 * S), CUDA_R_16BF, ld_i.data(),
                                    const_cast<const void* const*>(dp + 4 * S), CUDA_R_16BF, ld_i.data(), zeros.data(),
                                    dp + 5 * S, CUDA_R_32F, ld_w.data(), G, group_size.data(), CUBLAS_COMPUTE_32F);
    if (unsupported(cs)) {
      g_down_fp32.store(2);
      down_grouped = false;
    } else if (cs != CUBLAS_STATUS_SUCCESS) {
      // The grouped kernels recompute activated and y_sorted from x_sorted: the caller may fall back to them.
      return unimplemented(std::string(kName) + "cublasGemmGroupedBatchedEx (down, C fp32) returned cuBLAS status " +
                           std::to_string(static_cast<int>(cs)));
    } else {
      g_down_fp32.store(1);
    }
  }
  if (!down_grouped) {
    const float one = 1.0f, zero = 0.0f;
    for (int g = 0; g < G; ++g) {
      const int e = begins[g];
      const int64_t begin = offsets[e];
      status = cublas_status(
          "down GEMM", cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, w32, n_rows[g], i32, &one,
                                    w.down + static_cast<int64_t>(e) * W * I, CUDA_R_16BF, i32,
                                    params.activated + begin * I, CUDA_R_16BF, i32, &zero, params.y_sorted + begin * W,
                                    CUDA_R_32F, w32, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      if (!status) return status;
    }
  }
  g_last_mode.store((h_fp32 ? 0 : 1) | (down_grouped ? 0 : 2));
  record.armed = false;
  return cuda_status("record completion", cudaEventRecord(ctx->done, stream));
}

}  // namespace deltaserve::kernels::cuda
