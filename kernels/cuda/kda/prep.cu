// KDA input preparation over a varlen batch: short causal conv + SiLU of q, k, v with the conv tails of each
// sequence's slot, then per-head L2 normalisation of q (times q_scale) and k. Two kernels in stream order:
//   1. one warp per (token, head) row of one tensor: conv over tail ‖ x (reads the old tails), SiLU, L2;
//      (or, when head_dim % 4 == 0 and rows are aligned, one warp per run of tokens of one head, see below);
//   2. one block per (sequence, tensor): tails = the last K-1 inputs of tail ‖ x.
// So tails are never read and written by the same kernel, and no host sync is needed (graph-capturable).
#include <cmath>
#include <cstdint>
#include <string>

#include "kernels/cuda/common/detail/activations.cuh"
#include "kernels/cuda/ops/ops.hpp"

namespace deltaserve::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kRowsPerBlock = kThreads / 32;
constexpr int kMaxHeadDim = 128;
constexpr int kMaxValuesPerLane = kMaxHeadDim / 32;
constexpr int kMaxConvKernel = 4;

struct PrepArgs {
  int num_seqs;
  int64_t num_tokens;
  const int32_t* cu_seqlens;
  const int32_t* slots;
  int num_heads, head_dim, conv_kernel;
  const __nv_bfloat16* in[3];
  int64_t in_stride;
  const float* conv_weight[3];
  __nv_bfloat16* conv_state;  // bf16 tails (exact: the inputs are bf16)
  int num_slots;
  float l2_eps, q_scale;
};

__device__ __forceinline__ float warp_sum(float x) {
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

__device__ __forceinline__ void store(float* p, float x) {
  *p = x;
}
__device__ __forceinline__ void store(__nv_bfloat16* p, float x) {
  *p = __float2bfloat16(x);
}

// The sequence holding token t: the last n with cu[n] <= t (zero-length sequences are passed over).
__device__ __forceinline__ int find_sequence(const int32_t* cu, int num_seqs, int64_t t) {
  int lo = 0, hi = num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (cu[mid] <= t) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

template <class Out>
__global__ void __launch_bounds__(kThreads) prep_rows_kernel(PrepArgs a, Out* q_out, Out* k_out, Out* v_out) {
  const int which = blockIdx.y;  // 0 = q, 1 = k, 2 = v
  const int lane = threadIdx.x & 31;
  const int64_t row = blockIdx.x * static_cast<int64_t>(kRowsPerBlock) + (threadIdx.x >> 5);
  if (row >= a.num_tokens * a.num_heads) return;
  const int64_t t = row / a.num_heads;
  const int h = static_cast<int>(row - t * a.num_heads);
  const int n = find_sequence(a.cu_seqlens, a.num_seqs, t);
  const int32_t slot = a.slots[n];
  if (slot < 0 || slot >= a.num_slots) return;
  const int64_t first = a.cu_seqlens[n];
  const int64_t i = t - first;  // position in the sequence
  const int K = a.conv_kernel, tail_length = K - 1, d = a.head_dim;
  const int64_t C = static_cast<int64_t>(a.num_heads) * d;
  const __nv_bfloat16* x = which == 0 ? a.in[0] : (which == 1 ? a.in[1] : a.in[2]);  // no dynamic param index
  const float* weight = which == 0 ? a.conv_weight[0] : (which == 1 ? a.conv_weight[1] : a.conv_weight[2]);
  const __nv_bfloat16* tail = a.conv_state + (static_cast<int64_t>(slot) * 3 + which) * C * tail_length;

  float values[kMaxValuesPerLane];
  float sum_squares = 0.0f;
#pragma unroll
  for (int m = 0; m < kMaxValuesPerLane; ++m) {
    const int c_local = lane + 32 * m;
    values[m] = 0.0f;
    if (c_local < d) {
      const int64_t c = static_cast<int64_t>(h) * d + c_local;
      float sum = 0.0f;
      for (int j = 0; j < K; ++j) {
        const int64_t s = i + j;  // index into tail ‖ x
        const float input = s < tail_length ? __bfloat162float(tail[c * tail_length + s])
                                            : __bfloat162float(x[(first + s - tail_length) * a.in_stride + c]);
        sum += weight[c * K + j] * input;
      }
      values[m] = silu_f(sum);
      sum_squares += values[m] * values[m];
    }
  }
  float factor = 1.0f;
  if (which < 2) {
    sum_squares = warp_sum(sum_squares);
    factor = (which == 0 ? a.q_scale : 1.0f) / sqrtf(sum_squares + a.l2_eps);
  }
  Out* out = which == 0 ? q_out : (which == 1 ? k_out : v_out);
#pragma unroll
  for (int m = 0; m < kMaxValuesPerLane; ++m) {
    const int c_local = lane + 32 * m;
    if (c_local < d) store(out + row * d + c_local, values[m] * factor);
  }
}

// Vectorised form (head_dim % 4 == 0, 8-byte aligned inputs): one warp per (run of kTokensPerWarp tokens, head)
// of one tensor, lane l owning channels 4l..4l+3 of the head (8-byte bf16 loads, one per token and lane). The K-1
// previous inputs stay in registers as the warp walks its tokens, reloaded (from tail ‖ x) only at the warp's
// first token and at sequence starts; weights are loaded once per warp. Per-token arithmetic is the same whatever
// the reload point, so results do not depend on how tokens fall into runs.
// The current-token loads are issued kPrefetch tokens at a time ahead of the arithmetic (several 256-byte warp
// requests in flight per warp: the kernel is bandwidth-bound only with enough bytes in flight).
constexpr int kTokensPerWarp = 16;
constexpr int kPrefetch = 8;
// ~96 registers a thread: blocks of 4 warps keep 20 warps an SM resident (blocks of 8 would fit only 16).
constexpr int kVecThreads = 128;
constexpr int kVecWarpsPerBlock = kVecThreads / 32;

__device__ __forceinline__ void unpack4(const uint2 raw, float (&v)[4]) {
  const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
  const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
  v[0] = a.x, v[1] = a.y, v[2] = b.x, v[3] = b.y;
}

__device__ __forceinline__ void load4(const __nv_bfloat16* p, float (&v)[4]) {
  unpack4(*reinterpret_cast<const uint2*>(p), v);
}

__device__ __forceinline__ void store4(float* p, const float (&v)[4]) {
  *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
}
__device__ __forceinline__ void store4(__nv_bfloat16* p, const float (&v)[4]) {
  const __nv_bfloat162 a = __floats2bfloat162_rn(v[0], v[1]), b = __floats2bfloat162_rn(v[2], v[3]);
  uint2 raw;
  raw.x = *reinterpret_cast<const uint32_t*>(&a);
  raw.y = *reinterpret_cast<const uint32_t*>(&b);
  *reinterpret_cast<uint2*>(p) = raw;
}

// SiLU with the approximate divide: this kernel is bound by instruction issue rather than DRAM bandwidth, and the
// IEEE divide of sigmoid_f is a ~10-instruction sequence per value. x / (1 + e^-x) -> 0 for x < -87 (the denominator
// overflows), as the exact form does.
__device__ __forceinline__ float silu_fast(float x) {
  return __fdividef(x, 1.0f + __expf(-x));
}

template <class Out, int K>
__global__ void __launch_bounds__(kVecThreads) prep_rows_vec_kernel(PrepArgs a, Out* q_out, Out* k_out, Out* v_out) {
  constexpr int kTail = K - 1;
  constexpr int kWindow = K > 1 ? K - 1 : 1;
  const int which = blockIdx.y;
  const int lane = threadIdx.x & 31;
  const int64_t warp = blockIdx.x * static_cast<int64_t>(kVecWarpsPerBlock) + (threadIdx.x >> 5);
  const int64_t runs = (a.num_tokens + kTokensPerWarp - 1) / kTokensPerWarp;
  if (warp >= runs * a.num_heads) return;  // whole warp: the shuffles below stay full-warp
  const int64_t run = warp / a.num_heads;
  const int h = static_cast<int>(warp - run * a.num_heads);
  const int d = a.head_dim;
  const bool active = 4 * lane < d;
  const int64_t C = static_cast<int64_t>(a.num_heads) * d;
  const int64_t c0 = static_cast<int64_t>(h) * d + 4 * lane;  // first channel of this lane
  const __nv_bfloat16* x = which == 0 ? a.in[0] : (which == 1 ? a.in[1] : a.in[2]);
  const float* weight = which == 0 ? a.conv_weight[0] : (which == 1 ? a.conv_weight[1] : a.conv_weight[2]);
  Out* out = which == 0 ? q_out : (which == 1 ? k_out : v_out);
  const float scale = which == 0 ? a.q_scale : 1.0f;

  float w[4][K];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
#pragma unroll
    for (int j = 0; j < K; ++j) w[e][j] = active ? weight[(c0 + e) * K + j] : 0.0f;
  }

  const int64_t t0 = run * kTokensPerWarp;
  const int64_t t_end = t0 + kTokensPerWarp < a.num_tokens ? t0 + kTokensPerWarp : a.num_tokens;
  // The current sequence's first token, slot and the next sequence's first token stay in registers; they are
  // reloaded only when a token crosses into the next sequence.
  int n = find_sequence(a.cu_seqlens, a.num_seqs, t0);
  int64_t first = 0, next_first = 0;
  int32_t slot = 0;
  auto enter = [&](int sequence) {
    first = a.cu_seqlens[sequence];
    next_first = sequence + 1 < a.num_seqs ? a.cu_seqlens[sequence + 1] : INT64_MAX;
    slot = a.slots[sequence];
  };
  enter(n);
  float window[kWindow][4];
  bool have_window = false;
  for (int64_t base = t0; base < t_end; base += kPrefetch) {
    uint2 raw[kPrefetch];
#pragma unroll
    for (int u = 0; u < kPrefetch; ++u) {
      raw[u] = make_uint2(0u, 0u);
      if (active && base + u < t_end) raw[u] = *reinterpret_cast<const uint2*>(x + (base + u) * a.in_stride + c0);
    }
#pragma unroll
    for (int u = 0; u < kPrefetch; ++u) {
      const int64_t t = base + u;
      if (t >= t_end) break;
      bool new_sequence = false;
      while (t >= next_first) {  // zero-length sequences are passed over
        enter(++n);
        new_sequence = true;
      }
      if (slot < 0 || slot >= a.num_slots) {  // skipped sequence: outputs left untouched (warp-uniform)
        have_window = false;
        continue;
      }
      const int64_t i = t - first;
      if (new_sequence || !have_window) {
        const __nv_bfloat16* tail = a.conv_state + (static_cast<int64_t>(slot) * 3 + which) * C * kTail;
#pragma unroll
        for (int j = 0; j < kTail; ++j) {
          const int64_t s = i + j;  // index into tail ‖ x
          if (!active) {
            window[j][0] = window[j][1] = window[j][2] = window[j][3] = 0.0f;
          } else if (s < kTail) {
#pragma unroll
            for (int e = 0; e < 4; ++e) window[j][e] = __bfloat162float(tail[(c0 + e) * kTail + s]);
          } else {
            load4(x + (first + s - kTail) * a.in_stride + c0, window[j]);
          }
        }
        have_window = true;
      }
      float current[4];
      unpack4(raw[u], current);  // zeros on idle lanes
      float values[4];
      float sum_squares = 0.0f;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float sum = 0.0f;
#pragma unroll
        for (int j = 0; j < kTail; ++j) sum += w[e][j] * window[j][e];
        sum += w[e][K - 1] * current[e];
        values[e] = silu_fast(sum);
        sum_squares += values[e] * values[e];
      }
      if (which < 2) {
        const float factor = scale * rsqrtf(warp_sum(sum_squares) + a.l2_eps);
#pragma unroll
        for (int e = 0; e < 4; ++e) values[e] *= factor;
      }
      if (active) store4(out + t * C + c0, values);
#pragma unroll
      for (int j = 0; j + 1 < kTail; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) window[j][e] = window[j + 1][e];
      }
      if constexpr (kTail > 0) {
#pragma unroll
        for (int e = 0; e < 4; ++e) window[kTail - 1][e] = current[e];
      }
    }
  }
}

// grid (N, 3): new tail[j] = (tail ‖ x)[L + j] for j < K-1; L = 0 leaves the tail unchanged.
__global__ void __launch_bounds__(kThreads) update_tails_kernel(PrepArgs a) {
  const int n = blockIdx.x, which = blockIdx.y;
  const int32_t slot = a.slots[n];
  if (slot < 0 || slot >= a.num_slots) return;
  const int64_t first = a.cu_seqlens[n];
  const int64_t length = a.cu_seqlens[n + 1] - first;
  if (length <= 0) return;
  const int tail_length = a.conv_kernel - 1;
  const int64_t C = static_cast<int64_t>(a.num_heads) * a.head_dim;
  const __nv_bfloat16* x = which == 0 ? a.in[0] : (which == 1 ? a.in[1] : a.in[2]);
  __nv_bfloat16* tail = a.conv_state + (static_cast<int64_t>(slot) * 3 + which) * C * tail_length;
  for (int64_t c = threadIdx.x; c < C; c += kThreads) {
    float updated[kMaxConvKernel - 1];
#pragma unroll
    for (int j = 0; j < kMaxConvKernel - 1; ++j) {
      if (j < tail_length) {
        const int64_t s = length + j;
        updated[j] = s < tail_length ? __bfloat162float(tail[c * tail_length + s])
                                     : __bfloat162float(x[(first + s - tail_length) * a.in_stride + c]);
      }
    }
#pragma unroll
    for (int j = 0; j < kMaxConvKernel - 1; ++j) {
      if (j < tail_length) tail[c * tail_length + j] = __float2bfloat16(updated[j]);  // exact: bf16 values
    }
  }
}

Status validate(const char* name, const KdaPrepParams& p, const void* q, const void* k, const void* v) {
  const std::string prefix = std::string(name) + ": ";
  if (p.num_seqs < 0) return invalid_argument(prefix + "num_seqs must be >= 0, got " + std::to_string(p.num_seqs));
  if (p.num_tokens < 0)
    return invalid_argument(prefix + "num_tokens must be >= 0, got " + std::to_string(p.num_tokens));
  if (p.num_seqs == 0 && p.num_tokens != 0) return invalid_argument(prefix + "num_tokens > 0 with no sequences");
  if (p.num_heads < 1) return invalid_argument(prefix + "num_heads must be >= 1, got " + std::to_string(p.num_heads));
  if (p.head_dim < 1 || p.head_dim > kMaxHeadDim) {
    return invalid_argument(prefix + "head_dim must be in [1, 128], got " + std::to_string(p.head_dim));
  }
  if (p.conv_kernel < 1 || p.conv_kernel > kMaxConvKernel) {
    return invalid_argument(prefix + "conv_kernel must be in [1, 4], got " + std::to_string(p.conv_kernel));
  }
  const int64_t C = static_cast<int64_t>(p.num_heads) * p.head_dim;
  if (p.in_stride < C) {
    return invalid_argument(prefix + "in_stride " + std::to_string(p.in_stride) + " < H * d = " + std::to_string(C));
  }
  if (p.num_slots < 0) return invalid_argument(prefix + "num_slots must be >= 0");
  if (!(p.l2_eps >= 0.0f)) return invalid_argument(prefix + "l2_eps must be >= 0");
  if (!std::isfinite(p.q_scale)) return invalid_argument(prefix + "q_scale must be finite");
  if (p.num_tokens * p.num_heads / kRowsPerBlock + 1 > 0x7fffffff) return invalid_argument(prefix + "too many tokens");
  if (p.num_tokens == 0) return Status::ok();
  if (p.cu_seqlens == nullptr || p.slots == nullptr) return invalid_argument(prefix + "cu_seqlens or slots is null");
  if (p.q_in == nullptr || p.k_in == nullptr || p.v_in == nullptr) return invalid_argument(prefix + "an input is null");
  if (p.q_conv_weight == nullptr || p.k_conv_weight == nullptr || p.v_conv_weight == nullptr) {
    return invalid_argument(prefix + "a conv weight is null");
  }
  if (p.conv_kernel > 1 && p.conv_state == nullptr) return invalid_argument(prefix + "conv_state is null (K > 1)");
  if (q == nullptr || k == nullptr || v == nullptr) return invalid_argument(prefix + "an output is null");
  return Status::ok();
}

bool aligned(const void* p, uintptr_t bytes) {
  return (reinterpret_cast<uintptr_t>(p) & (bytes - 1)) == 0;
}

// The vectorised kernel needs whole 4-channel groups and 8-byte (bf16 in/out) or 16-byte (fp32 out) alignment of
// every row it touches; anything else (or params.reference_kernel, which the tests set) takes the per-channel
// kernel, which takes any head_dim in [1, 128] and any stride.
template <class Out>
bool use_vector_kernel(const KdaPrepParams& p, const Out* q, const Out* k, const Out* v) {
  if (p.reference_kernel) return false;
  if (p.head_dim % 4 != 0 || p.in_stride % 4 != 0) return false;
  if (!aligned(p.q_in, 8) || !aligned(p.k_in, 8) || !aligned(p.v_in, 8)) return false;
  const uintptr_t out_alignment = 4 * sizeof(Out);
  return aligned(q, out_alignment) && aligned(k, out_alignment) && aligned(v, out_alignment);
}

template <class Out>
Status launch_prep(const char* name, const KdaPrepParams& p, Out* q, Out* k, Out* v, cudaStream_t stream) {
  DS_RETURN_IF_ERROR(validate(name, p, q, k, v));
  if (p.num_tokens == 0) return Status::ok();  // zero-length sequences leave their tails unchanged
  PrepArgs a{};
  a.num_seqs = p.num_seqs;
  a.num_tokens = p.num_tokens;
  a.cu_seqlens = p.cu_seqlens;
  a.slots = p.slots;
  a.num_heads = p.num_heads;
  a.head_dim = p.head_dim;
  a.conv_kernel = p.conv_kernel;
  a.in[0] = p.q_in;
  a.in[1] = p.k_in;
  a.in[2] = p.v_in;
  a.in_stride = p.in_stride;
  a.conv_weight[0] = p.q_conv_weight;
  a.conv_weight[1] = p.k_conv_weight;
  a.conv_weight[2] = p.v_conv_weight;
  a.conv_state = p.conv_state;
  a.num_slots = p.num_slots;
  a.l2_eps = p.l2_eps;
  a.q_scale = p.q_scale;
  if (use_vector_kernel(p, q, k, v)) {
    const int64_t warps = (p.num_tokens + kTokensPerWarp - 1) / kTokensPerWarp * p.num_heads;
    const dim3 grid(static_cast<unsigned>((warps + kVecWarpsPerBlock - 1) / kVecWarpsPerBlock), 3);
    switch (p.conv_kernel) {
      case 1:
        prep_rows_vec_kernel<Out, 1><<<grid, kVecThreads, 0, stream>>>(a, q, k, v);
        break;
      case 2:
        prep_rows_vec_kernel<Out, 2><<<grid, kVecThreads, 0, stream>>>(a, q, k, v);
        break;
      case 3:
        prep_rows_vec_kernel<Out, 3><<<grid, kVecThreads, 0, stream>>>(a, q, k, v);
        break;
      default:
        prep_rows_vec_kernel<Out, 4><<<grid, kVecThreads, 0, stream>>>(a, q, k, v);
        break;
    }
  } else {
    const int64_t rows = p.num_tokens * p.num_heads;
    const dim3 grid(static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock), 3);
    prep_rows_kernel<Out><<<grid, kThreads, 0, stream>>>(a, q, k, v);
  }
  if (p.conv_kernel > 1) update_tails_kernel<<<dim3(static_cast<unsigned>(p.num_seqs), 3), kThreads, 0, stream>>>(a);
  const cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) {
    return internal_error(std::string(name) + ": launch: " + cudaGetErrorName(error) + " (" +
                          cudaGetErrorString(error) + ")");
  }
  return Status::ok();
}

}  // namespace

Status kda_prep(const KdaPrepParams& params, cudaStream_t stream) {
  return launch_prep("kda_prep", params, params.q, params.k, params.v, stream);
}

Status kda_prep_f32(const KdaPrepParams& params, const KdaPrepF32Outputs& out, cudaStream_t stream) {
  return launch_prep("kda_prep_f32", params, out.q, out.k, out.v, stream);
}

}  // namespace deltaserve::kernels::cuda
