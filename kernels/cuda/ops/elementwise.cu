// Elementwise ops of the GPU engine: embedding gather, add, casts, sigmoid, GLU, the KDA gate and slot-pool
// row copies. Grid-stride loops over flat indices; fp32 math (activations.cuh, the CPU formulas).
#include <cmath>
#include <string>

#include "kernels/cuda/common/detail/activations.cuh"
#include "kernels/cuda/common/launch_status.hpp"
#include "kernels/cuda/ops/ops.hpp"

namespace deltaserve::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 8192;

int blocks_for(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<int>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

Status check_count(const char* name, const char* what, int64_t n) {
  if (n < 0) return invalid_argument(std::string(name) + ": " + what + " must be >= 0, got " + std::to_string(n));
  return Status::ok();
}

Status check_pointer(const char* name, const char* what, const void* pointer) {
  if (pointer == nullptr) return invalid_argument(std::string(name) + ": " + what + " is null");
  return Status::ok();
}

__global__ void embedding_gather_kernel(const __nv_bfloat16* __restrict__ table, int64_t vocab, int64_t hidden,
                                        const int32_t* __restrict__ ids, int64_t total, float* __restrict__ out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / hidden, c = i - t * hidden;
    const int64_t id = ids[t];
    out[i] = (id >= 0 && id < vocab) ? __bfloat162float(table[id * hidden + c]) : __int_as_float(0x7fc00000);
  }
}

__global__ void add_kernel(float* __restrict__ y, const float* __restrict__ x, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    y[i] += x[i];
  }
}

__global__ void to_bf16_kernel(const float* __restrict__ x, int64_t n, __nv_bfloat16* __restrict__ out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = __float2bfloat16(x[i]);
  }
}

__global__ void sigmoid_kernel(float* __restrict__ x, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    x[i] = sigmoid_f(x[i]);
  }
}

__global__ void sigmoid_gate_kernel(const float* __restrict__ x, const float* __restrict__ gate, int64_t n,
                                    __nv_bfloat16* __restrict__ out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = __float2bfloat16(x[i] * sigmoid_f(gate[i]));
  }
}

template <GluKind kKind>
__global__ void glu_kernel(const float* __restrict__ gate_up, int64_t rows, int64_t width, float beta,
                           float beta_linear, __nv_bfloat16* __restrict__ out) {
  const int64_t total = rows * width;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / width, c = i - r * width;
    const float gate = gate_up[r * 2 * width + c], up = gate_up[r * 2 * width + width + c];
    const float y = kKind == GluKind::kSwiGlu ? swiglu_f(gate, up) : situ_glu_f(gate, up, beta, beta_linear);
    out[i] = __float2bfloat16(y);
  }
}

template <bool kBounded>
__global__ void kda_gate_kernel(const float* __restrict__ raw, int64_t raw_stride, const float* __restrict__ a_log,
                                const float* __restrict__ dt_bias, int64_t T, int H, int d, float lower_bound,
                                float* __restrict__ g) {
  const int64_t C = static_cast<int64_t>(H) * d, total = T * C;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / C, c = i - t * C;
    const float a = expf(a_log[c / d]);
    const float pre_activation = raw[t * raw_stride + c] + dt_bias[c];
    g[i] = kBounded ? lower_bound * sigmoid_f(a * pre_activation) : -a * softplus_f(pre_activation);
  }
}

// dense[i] <-> pool[slots[i]], 16-byte words; kGather: pool -> dense (zeros for slot < 0), else dense -> pool.
template <bool kGather>
__global__ void slot_copy_kernel(const uint4* __restrict__ from, int64_t words_per_row,
                                 const int32_t* __restrict__ slots, int64_t n, uint4* __restrict__ to) {
  const int64_t total = n * words_per_row;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / words_per_row, word = i - row * words_per_row;
    const int32_t slot = slots[row];
    if (kGather) {
      to[i] = slot >= 0 ? from[slot * words_per_row + word] : make_uint4(0u, 0u, 0u, 0u);
    } else if (slot >= 0) {
      to[slot * words_per_row + word] = from[i];
    }
  }
}

Status check_slot_copy(const char* name, const void* a, const void* b, int64_t row_bytes, const int32_t* slots,
                       int64_t n) {
  DS_RETURN_IF_ERROR(check_count(name, "n", n));
  if (row_bytes <= 0 || row_bytes % 16 != 0) {
    return invalid_argument(std::string(name) + ": row_bytes must be a positive multiple of 16, got " +
                            std::to_string(row_bytes));
  }
  if (n == 0) return Status::ok();
  DS_RETURN_IF_ERROR(check_pointer(name, "pool", a));
  DS_RETURN_IF_ERROR(check_pointer(name, "dense", b));
  DS_RETURN_IF_ERROR(check_pointer(name, "slots", slots));
  if (reinterpret_cast<uintptr_t>(a) % 16 != 0 || reinterpret_cast<uintptr_t>(b) % 16 != 0) {
    return invalid_argument(std::string(name) + ": pool and dense must be 16-byte aligned");
  }
  return Status::ok();
}

}  // namespace

Status embedding_gather(const __nv_bfloat16* table, int64_t vocab, int64_t hidden, const int32_t* ids, int64_t T,
                        float* out, cudaStream_t stream) {
  constexpr const char* kName = "embedding_gather";
  DS_RETURN_IF_ERROR(check_count(kName, "T", T));
  if (vocab < 1 || hidden < 1) {
    return invalid_argument(std::string(kName) + ": vocab and hidden must be >= 1, got " + std::to_string(vocab) +
                            ", " + std::to_string(hidden));
  }
  if (T == 0) return Status::ok();
  DS_RETURN_IF_ERROR(check_pointer(kName, "table", table));
  DS_RETURN_IF_ERROR(check_pointer(kName, "ids", ids));
  DS_RETURN_IF_ERROR(check_pointer(kName, "out", out));
  embedding_gather_kernel<<<blocks_for(T * hidden), kThreads, 0, stream>>>(table, vocab, hidden, ids, T * hidden, out);
  return launch_status(kName);
}

Status add_inplace(float* y, const float* x, int64_t n, cudaStream_t stream) {
  DS_RETURN_IF_ERROR(check_count("add_inplace", "n", n));
  if (n == 0) return Status::ok();
  DS_RETURN_IF_ERROR(check_pointer("add_inplace", "y", y));
  DS_RETURN_IF_ERROR(check_pointer("add_inplace", "x", x));
  add_kernel<<<blocks_for(n), kThreads, 0, stream>>>(y, x, n);
  return launch_status("add_inplace");
}

Status to_bf16(const float* x, int64_t n, __nv_bfloat16* out, cudaStream_t stream) {
  DS_RETURN_IF_ERROR(check_count("to_bf16", "n", n));
  if (n == 0) return Status::ok();
  DS_RETURN_IF_ERROR(check_pointer("to_bf16", "x", x));
  DS_RETURN_IF_ERROR(check_pointer("to_bf16", "out", out));
  to_bf16_kernel<<<blocks_for(n), kThreads, 0, stream>>>(x, n, out);
  return launch_status("to_bf16");
}

Status sigmoid_inplace(float* x, int64_t n, cudaStream_t stream) {
  DS_RETURN_IF_ERROR(check_count("sigmoid_inplace", "n", n));
  if (n == 0) return Status::ok();
  DS_RETURN_IF_ERROR(check_pointer("sigmoid_inplace", "x", x));
  sigmoid_kernel<<<blocks_for(n), kThreads, 0, stream>>>(x, n);
  return launch_status("sigmoid_inplace");
}

Status sigmoid_gate(const float* x, const float* gate, int64_t n, __nv_bfloat16* out, cudaStream_t stream) {
  DS_RETURN_IF_ERROR(check_count("sigmoid_gate", "n", n));
  if (n == 0) return Status::ok();
  DS_RETURN_IF_ERROR(check_pointer("sigmoid_gate", "x", x));
  DS_RETURN_IF_ERROR(check_pointer("sigmoid_gate", "gate", gate));
  DS_RETURN_IF_ERROR(check_pointer("sigmoid_gate", "out", out));
  sigmoid_gate_kernel<<<blocks_for(n), kThreads, 0, stream>>>(x, gate, n, out);
  return launch_status("sigmoid_gate");
}

Status glu(const float* gate_up, int64_t rows, int64_t width, GluKind kind, float situ_beta, float situ_linear_beta,
           __nv_bfloat16* out, cudaStream_t stream) {
  constexpr const char* kName = "glu";
  DS_RETURN_IF_ERROR(check_count(kName, "rows", rows));
  if (width < 1) return invalid_argument(std::string(kName) + ": width must be >= 1, got " + std::to_string(width));
  if (kind != GluKind::kSwiGlu && kind != GluKind::kSitu) return invalid_argument("glu: unknown GluKind");
  if (kind == GluKind::kSitu && !(situ_beta > 0.0f && situ_linear_beta > 0.0f)) {
    return invalid_argument("glu: SiTU betas must be > 0");
  }
  if (rows == 0) return Status::ok();
  DS_RETURN_IF_ERROR(check_pointer(kName, "gate_up", gate_up));
  DS_RETURN_IF_ERROR(check_pointer(kName, "out", out));
  const int blocks = blocks_for(rows * width);
  if (kind == GluKind::kSwiGlu) {
    glu_kernel<GluKind::kSwiGlu><<<blocks, kThreads, 0, stream>>>(gate_up, rows, width, 0.0f, 0.0f, out);
  } else {
    glu_kernel<GluKind::kSitu><<<blocks, kThreads, 0, stream>>>(gate_up, rows, width, situ_beta, situ_linear_beta, out);
  }
  return launch_status(kName);
}

Status kda_gate(const float* raw, int64_t raw_stride, const float* a_log, const float* dt_bias, int64_t T, int H, int d,
                std::optional<float> lower_bound, float* g, cudaStream_t stream) {
  constexpr const char* kName = "kda_gate";
  DS_RETURN_IF_ERROR(check_count(kName, "T", T));
  if (H < 1 || d < 1) {
    return invalid_argument(std::string(kName) + ": H and d must be >= 1, got " + std::to_string(H) + ", " +
                            std::to_string(d));
  }
  if (raw_stride < static_cast<int64_t>(H) * d) {
    return invalid_argument(std::string(kName) + ": raw_stride " + std::to_string(raw_stride) + " < H * d");
  }
  if (lower_bound.has_value() && !std::isfinite(*lower_bound))
    return invalid_argument("kda_gate: lower_bound not finite");
  if (T == 0) return Status::ok();
  DS_RETURN_IF_ERROR(check_pointer(kName, "raw", raw));
  DS_RETURN_IF_ERROR(check_pointer(kName, "a_log", a_log));
  DS_RETURN_IF_ERROR(check_pointer(kName, "dt_bias", dt_bias));
  DS_RETURN_IF_ERROR(check_pointer(kName, "g", g));
  const int blocks = blocks_for(T * H * d);
  if (lower_bound.has_value()) {
    kda_gate_kernel<true><<<blocks, kThreads, 0, stream>>>(raw, raw_stride, a_log, dt_bias, T, H, d, *lower_bound, g);
  } else {
    kda_gate_kernel<false><<<blocks, kThreads, 0, stream>>>(raw, raw_stride, a_log, dt_bias, T, H, d, 0.0f, g);
  }
  return launch_status(kName);
}

Status gather_slots(const void* pool, int64_t row_bytes, const int32_t* slots, int64_t n, void* dense,
                    cudaStream_t stream) {
  DS_RETURN_IF_ERROR(check_slot_copy("gather_slots", pool, dense, row_bytes, slots, n));
  if (n == 0) return Status::ok();
  const int64_t words = row_bytes / 16;
  slot_copy_kernel<true><<<blocks_for(n * words), kThreads, 0, stream>>>(static_cast<const uint4*>(pool), words, slots,
                                                                         n, static_cast<uint4*>(dense));
  return launch_status("gather_slots");
}

Status scatter_slots(const void* dense, int64_t row_bytes, const int32_t* slots, int64_t n, void* pool,
                     cudaStream_t stream) {
  DS_RETURN_IF_ERROR(check_slot_copy("scatter_slots", pool, dense, row_bytes, slots, n));
  if (n == 0) return Status::ok();
  const int64_t words = row_bytes / 16;
  slot_copy_kernel<false><<<blocks_for(n * words), kThreads, 0, stream>>>(static_cast<const uint4*>(dense), words,
                                                                          slots, n, static_cast<uint4*>(pool));
  return launch_status("scatter_slots");
}

}  // namespace deltaserve::kernels::cuda
