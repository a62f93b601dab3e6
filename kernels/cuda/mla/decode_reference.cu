// The fp32 CUDA-core split attention (MlaAttentionParams::fp32_attention): step 2 of decode.cu's file comment with
// everything in fp32 and tiles of 32 rows, between the same absorb and combine kernels. The exact reference the
// tests hold the tensor-core kernels against (several times slower). It writes the partials of
// detail/attention.cuh (MlaAttentionArgs) and reads the real context lengths on the device.
#include <algorithm>
#include <cmath>
#include <string>

#include "kernels/cuda/common/launch_status.hpp"
#include "kernels/cuda/mla/detail/attention.cuh"
#include "kernels/cuda/mla/mla.hpp"

namespace deltaserve::kernels::cuda {
namespace {

using detail::MlaAttentionArgs;
using AttentionArgs = MlaAttentionArgs;

constexpr int kAttnThreads = 512;
constexpr int kAttnWarps = kAttnThreads / 32;
constexpr int kTileRows = 32;      // rows per tile; == warp size (the softmax maps lane -> row)
constexpr int kMaxHeadGroup = 32;  // heads per attention CTA
constexpr int kAccPerThread = 32;  // latent accumulators per thread: head_group * kv_lora <= 512 * 32

__device__ __forceinline__ int64_t i64_min(int64_t a, int64_t b) {
  return detail::mla_i64_min(a, b);
}
__device__ __forceinline__ int64_t i64_max(int64_t a, int64_t b) {
  return detail::mla_i64_max(a, b);
}
__device__ __forceinline__ float warp_sum(float x) {
  return detail::mla_warp_sum(x);
}
__device__ __forceinline__ float warp_max(float x) {
  return detail::mla_warp_max(x);
}

struct ReferenceSlice {
  int n;                       // sequence of the token
  int64_t row_begin, row_end;  // context rows of this split
};

// Rows of token t's visible context that split `split` covers (equal slices, the last may be shorter or empty);
// the sequence is the largest n with cu_q[n] <= t (zero-length sequences share their start).
__device__ __forceinline__ ReferenceSlice reference_slice(const AttentionArgs& a, int64_t t, int split) {
  int lo = 0, hi = a.num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (a.cu_q[mid] <= t) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const int n = lo;
  const int64_t q_begin = a.cu_q[n];
  const int64_t q_len = static_cast<int64_t>(a.cu_q[n + 1]) - q_begin;
  const int64_t context = a.context_lens[n];
  int64_t visible = context - q_len + (t - q_begin) + 1;  // rows 0 .. position
  visible = i64_max(0, i64_min(visible, static_cast<int64_t>(a.max_pages_per_seq) * a.page_size));
  const int64_t per_split = (visible + a.splits - 1) / a.splits;
  const int64_t row_begin = i64_min(visible, per_split * split);
  return ReferenceSlice{n, row_begin, i64_min(visible, row_begin + per_split)};
}

// ---- fp32 split attention ------------------------------------------------------------------------------
size_t attention_smem_bytes(int head_group, int width) {
  return sizeof(float) * (static_cast<size_t>(head_group) * width + static_cast<size_t>(kTileRows) * width +
                          static_cast<size_t>(head_group) * kTileRows + 3 * static_cast<size_t>(head_group));
}

// grid (T, splits, ceil(H / head_group)), block kAttnThreads, dynamic smem attention_smem_bytes.
__global__ void __launch_bounds__(kAttnThreads, 1) mla_split_attention_kernel(AttentionArgs a) {
  extern __shared__ float smem[];
  const int width = a.kv_lora + a.rope;
  const int group = a.head_group;
  float* s_q = smem;                         // [group][width]
  float* s_rows = s_q + group * width;       // [kTileRows][width]
  float* s_p = s_rows + kTileRows * width;   // [group][kTileRows]: scores, then probabilities
  float* s_scale = s_p + group * kTileRows;  // [group]
  float* s_m = s_scale + group;              // [group]
  float* s_l = s_m + group;                  // [group]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t t = blockIdx.x;
  const int split = blockIdx.y;
  const int h0 = blockIdx.z * group;
  const int heads = min(group, a.num_heads - h0);

  const ReferenceSlice slice = reference_slice(a, t, split);
  const int n = slice.n;
  const int64_t row_begin = slice.row_begin, row_end = slice.row_end;

  const float* q_src = a.q_tilde + (t * a.num_heads + h0) * width;
  for (int i = tid; i < heads * width; i += kAttnThreads) s_q[i] = q_src[i];
  if (tid < group) {
    s_m[tid] = -INFINITY;
    s_l[tid] = 0.0f;
  }
  const int32_t* table = a.block_tables + static_cast<int64_t>(n) * a.max_pages_per_seq;
  const int vecs_per_row = width / 8;
  const int elements = heads * a.kv_lora;

  float o[kAccPerThread];
#pragma unroll
  for (int k = 0; k < kAccPerThread; ++k) o[k] = 0.0f;

  for (int64_t tile = row_begin; tile < row_end; tile += kTileRows) {
    const int rows = static_cast<int>(i64_min(kTileRows, row_end - tile));
    __syncthreads();  // s_q / s_m ready (first tile); the previous tile's s_rows and s_p are consumed
    for (int v = tid; v < kTileRows * vecs_per_row; v += kAttnThreads) {
      const int r = v / vecs_per_row, cv = v - r * vecs_per_row;
      float4* dst = reinterpret_cast<float4*>(s_rows + r * width + cv * 8);
      float4 lo4 = make_float4(0.f, 0.f, 0.f, 0.f), hi4 = lo4;
      if (r < rows) {
        const int64_t position = tile + r;
        const int32_t page = table[position / a.page_size];
        if (page >= 0 && page < a.num_pages) {
          const int64_t slot = position % a.page_size;
          const __nv_bfloat16* src =
              a.pages + ((static_cast<int64_t>(page) * a.num_layers + a.layer) * a.page_size + slot) * a.row_stride +
              cv * 8;
          const uint4 raw = __ldg(reinterpret_cast<const uint4*>(src));
          const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
          const float2 f0 = __bfloat1622float2(pairs[0]), f1 = __bfloat1622float2(pairs[1]);
          const float2 f2 = __bfloat1622float2(pairs[2]), f3 = __bfloat1622float2(pairs[3]);
          lo4 = make_float4(f0.x, f0.y, f1.x, f1.y);
          hi4 = make_float4(f2.x, f2.y, f3.x, f3.y);
        }
      }
      dst[0] = lo4;
      dst[1] = hi4;
    }
    __syncthreads();
    // Scores (log2 units): one warp per (head, row), lanes split the row.
    for (int pair = warp; pair < heads * kTileRows; pair += kAttnWarps) {
      const int h = pair / kTileRows, r = pair - h * kTileRows;
      float acc = 0.0f;
      if (r < rows) {
        const float* qh = s_q + h * width;
        const float* row = s_rows + r * width;
        for (int c = lane; c < width; c += 32) acc = fmaf(qh[c], row[c], acc);
      }
      acc = warp_sum(acc);
      if (lane == 0) s_p[h * kTileRows + r] = r < rows ? acc : -INFINITY;
    }
    __syncthreads();
    // Online softmax: one warp per head, lane = row.
    for (int h = warp; h < heads; h += kAttnWarps) {
      const float s = s_p[h * kTileRows + lane];
      const float m_old = s_m[h];
      const float m_new = fmaxf(m_old, warp_max(s));  // finite: the tile has >= 1 row
      const float p = lane < rows ? exp2f(s - m_new) : 0.0f;
      const float sum = warp_sum(p);
      s_p[h * kTileRows + lane] = p;
      if (lane == 0) {
        const float rescale = exp2f(m_old - m_new);  // 0 when m_old = -inf
        s_scale[h] = rescale;
        s_m[h] = m_new;
        s_l[h] = s_l[h] * rescale + sum;
      }
    }
    __syncthreads();
    // Latent sum: thread owns elements tid + k * kAttnThreads of the [heads, kv_lora] block.
#pragma unroll
    for (int k = 0; k < kAccPerThread; ++k) {
      const int e = tid + k * kAttnThreads;
      if (e < elements) {
        const int h = e / a.kv_lora, c = e - h * a.kv_lora;
        const float* p = s_p + h * kTileRows;
        const float* col = s_rows + c;
        float acc = o[k] * s_scale[h];
        for (int r = 0; r < rows; ++r) acc = fmaf(p[r], col[r * width], acc);
        o[k] = acc;
      }
    }
  }
  __syncthreads();
  const int64_t part = (t * a.splits + split) * a.num_heads + h0;
  float* out_o = a.partial_o + part * a.kv_lora;
#pragma unroll
  for (int k = 0; k < kAccPerThread; ++k) {
    const int e = tid + k * kAttnThreads;
    if (e < elements) out_o[e] = o[k];
  }
  if (tid < heads) a.partial_ml[part + tid] = make_float2(s_m[tid], s_l[tid]);
}

}  // namespace

namespace detail {

int mla_fp32_head_group(int num_heads, int kv_lora) {
  return std::min({num_heads, kMaxHeadGroup, kAttnThreads * kAccPerThread / kv_lora});
}

Status launch_mla_fp32_attention(const MlaAttentionArgs& args, int64_t num_tokens, cudaStream_t stream,
                                 const char* who) {
  const size_t smem = attention_smem_bytes(args.head_group, args.kv_lora + args.rope);
  if (cudaError_t e = cudaFuncSetAttribute(mla_split_attention_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(smem));
      e != cudaSuccess) {
    return Status(StatusCode::kInternal, std::string(who) + ": cudaFuncSetAttribute: " + cudaGetErrorString(e));
  }
  const dim3 grid(static_cast<unsigned>(num_tokens), static_cast<unsigned>(args.splits),
                  static_cast<unsigned>((args.num_heads + args.head_group - 1) / args.head_group));
  mla_split_attention_kernel<<<grid, kAttnThreads, smem, stream>>>(args);
  return launch_status(who);
}

}  // namespace detail
}  // namespace deltaserve::kernels::cuda
