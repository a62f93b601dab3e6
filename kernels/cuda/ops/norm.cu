// Normalisations of the GPU engine: RMSNorm (fp32 or bf16 out), the Block Attention Residuals mix and the KDA
// gated output norm. fp32 math; the CPU references reduce in fp64, so results agree to fp32 rounding (~1e-6 rel).
#include <string>

#include "kernels/cuda/common/detail/activations.cuh"
#include "kernels/cuda/common/launch_status.hpp"
#include "kernels/cuda/ops/ops.hpp"

namespace deltaserve::kernels::cuda {
namespace {

constexpr int kNormThreads = 256;
constexpr int kRowsPerBlock = kNormThreads / 32;  // warp-per-row kernels

__device__ __forceinline__ float warp_sum(float x) {
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// Sum over the block (blockDim.x == kNormThreads); every thread gets the result. `scratch` holds 32 values.
template <class T>
__device__ T block_sum(T x, T* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  T total = 0;
  for (int w = 0; w < kNormThreads / 32; ++w) total += scratch[w];
  return total;
}

__device__ __forceinline__ void store(float* p, float x) {
  *p = x;
}
__device__ __forceinline__ void store(__nv_bfloat16* p, float x) {
  *p = __float2bfloat16(x);
}
__device__ __forceinline__ float load(const float* p) {
  return *p;
}
__device__ __forceinline__ float load(const __nv_bfloat16* p) {
  return __bfloat162float(*p);
}

// One block per row.
template <class Out>
__global__ void rms_norm_kernel(const float* x, int64_t x_stride, const float* __restrict__ weight, int64_t dim,
                                float eps, Out* y, int64_t y_stride) {
  __shared__ float scratch[32];
  const float* x_row = x + blockIdx.x * x_stride;
  Out* y_row = y + blockIdx.x * y_stride;
  float sum_squares = 0.0f;
  for (int64_t c = threadIdx.x; c < dim; c += kNormThreads) sum_squares += x_row[c] * x_row[c];
  sum_squares = block_sum(sum_squares, scratch);
  const float inverse_rms = 1.0f / sqrtf(sum_squares / static_cast<float>(dim) + eps);
  for (int64_t c = threadIdx.x; c < dim; c += kNormThreads) {
    store(y_row + c, x_row[c] * inverse_rms * (weight != nullptr ? weight[c] : 1.0f));
  }
}

struct SourceList {
  const float* pointers[kMaxAttnResSources];
};

// One block per token. Logits reduced in fp64 (like the CPU): the softmax amplifies their rounding by |logit|.
__global__ void attn_res_mix_kernel(SourceList sources, int num_sources, const float* __restrict__ norm_weight,
                                    const float* __restrict__ proj_weight, int64_t dim, float eps,
                                    float* __restrict__ out) {
  __shared__ double scratch[32];
  __shared__ float weights[kMaxAttnResSources];
  const int64_t t = blockIdx.x;
  for (int i = 0; i < num_sources; ++i) {
    const float* v = sources.pointers[i] + t * dim;
    double sum_squares = 0.0, gated = 0.0;
    for (int64_t c = threadIdx.x; c < dim; c += kNormThreads) {
      const double value = v[c];
      sum_squares += value * value;
      gated += static_cast<double>(proj_weight[c] * norm_weight[c]) * value;
    }
    sum_squares = block_sum(sum_squares, scratch);
    gated = block_sum(gated, scratch);
    if (threadIdx.x == 0) {
      weights[i] = static_cast<float>(gated / sqrt(sum_squares / static_cast<double>(dim) + static_cast<double>(eps)));
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float max_logit = -INFINITY;
    for (int i = 0; i < num_sources; ++i) max_logit = fmaxf(max_logit, weights[i]);
    float denominator = 0.0f;
    for (int i = 0; i < num_sources; ++i) denominator += (weights[i] = expf(weights[i] - max_logit));
    for (int i = 0; i < num_sources; ++i) weights[i] /= denominator;
  }
  __syncthreads();
  for (int64_t c = threadIdx.x; c < dim; c += kNormThreads) {
    float mixed = 0.0f;
    for (int i = 0; i < num_sources; ++i) mixed += weights[i] * sources.pointers[i][t * dim + c];
    out[t * dim + c] = mixed;
  }
}

// One warp per (token, head) row.
template <class In>
__global__ void gated_output_norm_kernel(const In* __restrict__ o, const float* __restrict__ gate, int64_t gate_stride,
                                         const float* __restrict__ norm_weight, int64_t T, int H, int d, float eps,
                                         __nv_bfloat16* __restrict__ out) {
  const int lane = threadIdx.x & 31;
  const int64_t row = blockIdx.x * static_cast<int64_t>(kRowsPerBlock) + (threadIdx.x >> 5);
  if (row >= T * H) return;
  const int64_t t = row / H;
  const int h = static_cast<int>(row - t * H);
  const In* values = o + row * d;
  float sum_squares = 0.0f;
  for (int c = lane; c < d; c += 32) {
    const float value = load(values + c);
    sum_squares += value * value;
  }
  sum_squares = warp_sum(sum_squares);
  const float inverse_rms = 1.0f / sqrtf(sum_squares / static_cast<float>(d) + eps);
  const float* gate_row = gate + t * gate_stride + static_cast<int64_t>(h) * d;
  for (int c = lane; c < d; c += 32) {
    const float w = norm_weight != nullptr ? norm_weight[c] : 1.0f;
    out[row * d + c] = __float2bfloat16(load(values + c) * inverse_rms * w * sigmoid_f(gate_row[c]));
  }
}

template <class Out>
Status rms_norm_impl(const float* x, int64_t x_stride, const float* weight, int64_t rows, int64_t dim, float eps,
                     Out* y, int64_t y_stride, cudaStream_t stream) {
  if (rows < 0) return invalid_argument("rms_norm: rows must be >= 0, got " + std::to_string(rows));
  if (dim < 1) return invalid_argument("rms_norm: dim must be >= 1, got " + std::to_string(dim));
  if (x_stride < dim || y_stride < dim) {
    return invalid_argument("rms_norm: strides (" + std::to_string(x_stride) + ", " + std::to_string(y_stride) +
                            ") must be >= dim " + std::to_string(dim));
  }
  if (!(eps >= 0.0f)) return invalid_argument("rms_norm: eps must be >= 0");
  if (rows > 0x7fffffff) return invalid_argument("rms_norm: too many rows");
  if (rows == 0) return Status::ok();
  if (x == nullptr || y == nullptr) return invalid_argument("rms_norm: x or y is null");
  if (static_cast<const void*>(x) == static_cast<const void*>(y) && x_stride != y_stride) {
    return invalid_argument("rms_norm: in place (y == x) needs y_stride == x_stride");
  }
  rms_norm_kernel<Out>
      <<<static_cast<unsigned>(rows), kNormThreads, 0, stream>>>(x, x_stride, weight, dim, eps, y, y_stride);
  return launch_status("rms_norm");
}

template <class In>
Status gated_output_norm_impl(const In* o, const float* gate, int64_t gate_stride, const float* norm_weight, int64_t T,
                              int H, int d, float eps, __nv_bfloat16* out, cudaStream_t stream) {
  constexpr const char* kName = "kda_gated_output_norm";
  if (T < 0) return invalid_argument(std::string(kName) + ": T must be >= 0, got " + std::to_string(T));
  if (H < 1 || d < 1) {
    return invalid_argument(std::string(kName) + ": H and d must be >= 1, got " + std::to_string(H) + ", " +
                            std::to_string(d));
  }
  if (gate_stride < static_cast<int64_t>(H) * d) {
    return invalid_argument(std::string(kName) + ": gate_stride " + std::to_string(gate_stride) + " < H * d");
  }
  if (!(eps >= 0.0f)) return invalid_argument(std::string(kName) + ": eps must be >= 0");
  if (T == 0) return Status::ok();
  if (o == nullptr || gate == nullptr || norm_weight == nullptr || out == nullptr) {
    return invalid_argument(std::string(kName) + ": o, gate, norm_weight and out must be non-null");
  }
  const int64_t rows = T * H;
  const int64_t blocks = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
  if (blocks > 0x7fffffff) return invalid_argument(std::string(kName) + ": too many rows");
  gated_output_norm_kernel<In><<<static_cast<unsigned>(blocks), kNormThreads, 0, stream>>>(
      o, gate, gate_stride, norm_weight, T, H, d, eps, out);
  return launch_status(kName);
}

}  // namespace

Status rms_norm(const float* x, int64_t x_stride, const float* weight, int64_t rows, int64_t dim, float eps,
                __nv_bfloat16* y, int64_t y_stride, cudaStream_t stream) {
  return rms_norm_impl(x, x_stride, weight, rows, dim, eps, y, y_stride, stream);
}

Status rms_norm(const float* x, int64_t x_stride, const float* weight, int64_t rows, int64_t dim, float eps, float* y,
                int64_t y_stride, cudaStream_t stream) {
  return rms_norm_impl(x, x_stride, weight, rows, dim, eps, y, y_stride, stream);
}

Status attn_res_mix(const float* const* sources, int num_sources, const float* norm_weight, const float* proj_weight,
                    int64_t T, int64_t dim, float eps, float* out, cudaStream_t stream) {
  constexpr const char* kName = "attn_res_mix";
  if (num_sources < 1 || num_sources > kMaxAttnResSources) {
    return invalid_argument(std::string(kName) + ": num_sources must be in [1, 64], got " +
                            std::to_string(num_sources));
  }
  if (T < 0) return invalid_argument(std::string(kName) + ": T must be >= 0, got " + std::to_string(T));
  if (dim < 1) return invalid_argument(std::string(kName) + ": dim must be >= 1, got " + std::to_string(dim));
  if (!(eps >= 0.0f)) return invalid_argument(std::string(kName) + ": eps must be >= 0");
  if (T > 0x7fffffff) return invalid_argument(std::string(kName) + ": too many tokens");
  if (T == 0) return Status::ok();
  if (sources == nullptr || out == nullptr) return invalid_argument(std::string(kName) + ": sources or out is null");
  SourceList list{};
  for (int i = 0; i < num_sources; ++i) {
    if (sources[i] == nullptr)
      return invalid_argument(std::string(kName) + ": source " + std::to_string(i) + " is null");
    if (sources[i] == out) return invalid_argument(std::string(kName) + ": out aliases source " + std::to_string(i));
    list.pointers[i] = sources[i];
  }
  if (num_sources == 1) {
    // softmax over one logit is 1 whatever the logit: the source, bit for bit (cpu::attn_res_mix).
    const cudaError_t error = cudaMemcpyAsync(out, sources[0], static_cast<size_t>(T * dim) * sizeof(float),
                                              cudaMemcpyDeviceToDevice, stream);
    if (error != cudaSuccess) return internal_error(std::string(kName) + ": copy: " + cudaGetErrorName(error));
    return Status::ok();
  }
  if (norm_weight == nullptr || proj_weight == nullptr) {
    return invalid_argument(std::string(kName) + ": norm_weight or proj_weight is null");
  }
  attn_res_mix_kernel<<<static_cast<unsigned>(T), kNormThreads, 0, stream>>>(list, num_sources, norm_weight,
                                                                             proj_weight, dim, eps, out);
  return launch_status(kName);
}

Status kda_gated_output_norm(const __nv_bfloat16* o, const float* gate, int64_t gate_stride, const float* norm_weight,
                             int64_t T, int H, int d, float eps, __nv_bfloat16* out, cudaStream_t stream) {
  return gated_output_norm_impl(o, gate, gate_stride, norm_weight, T, H, d, eps, out, stream);
}

Status kda_gated_output_norm(const float* o, const float* gate, int64_t gate_stride, const float* norm_weight,
                             int64_t T, int H, int d, float eps, __nv_bfloat16* out, cudaStream_t stream) {
  return gated_output_norm_impl(o, gate, gate_stride, norm_weight, T, H, d, eps, out, stream);
}

}  // namespace deltaserve::kernels::cuda
