// The absorbed MLA attention's step 1 (decode.cu's file comment): the absorbed queries
//   q̃[t, h] = [W_UK_hᵀ q_nope (kv_lora) ‖ q_rot (rope)] · scale, fp32 in the workspace,
// on tensor cores (mma.sync bf16, fp32 accumulate: the products of bf16 values are exact, so this is the fp32 result
// up to summation order). One CTA per (64 tokens, head, 64 latent columns): 256 CTAs at Kimi-48B dims for any
// T <= 64, so the 4 MB of W_UK spread over every SM (16 KB per CTA, copied by cp.async before the PDL wait).
#include <string>

#include "kernels/cuda/common/detail/mma_sm80.cuh"
#include "kernels/cuda/common/launch_status.hpp"
#include "kernels/cuda/mla/detail/attention.cuh"
#include "kernels/cuda/mla/mla.hpp"

namespace deltaserve::kernels::cuda {
namespace {

// ---- 1. absorb ----------------------------------------------------------------------------------------------
// q̃[t0 .. t0 + 64, h, c0 .. c0 + 64] = q_nope[t, h] · W_UK_h[:, c0 .. c0 + 64] on tensor cores: A = q_nope tile
// [64 tokens][nope padded to 16] bf16, B = the W_UK slice [nope][64] bf16, both in shared memory; warp w computes
// tokens 16 w .. 16 w + 16 (skipped past the batch). CTAs with blockIdx.z == 0 also copy the scaled q_rot.
constexpr int kAbsorbThreads = 128;
constexpr int kAbsorbTokens = 64;  // 4 warps x one m16 tile
constexpr int kAbsorbCols = 64;    // latent columns per CTA: 4 n pairs of 16
constexpr int kAbsorbLdW = kAbsorbCols + 8;

size_t absorb_smem_bytes(int nope) {
  const size_t k16 = static_cast<size_t>((nope + 15) / 16 * 16);
  return sizeof(__nv_bfloat16) * (k16 * kAbsorbLdW + kAbsorbTokens * (k16 + 8));
}

// grid (ceil(T / 64), H, ceil(kv_lora / 64)), block kAbsorbThreads, dynamic smem absorb_smem_bytes(nope).
__global__ void __launch_bounds__(kAbsorbThreads)
    mla_absorb_kernel(const __nv_bfloat16* __restrict__ q, int64_t q_stride, const __nv_bfloat16* __restrict__ kv_b,
                      int64_t num_tokens, int num_heads, int kv_lora, int nope, int rope, int v_head, float scale,
                      float* __restrict__ q_tilde) {
  extern __shared__ __align__(16) unsigned char absorb_smem[];
  const int k16 = (nope + 15) / 16 * 16, ld_q = k16 + 8;
  __nv_bfloat16* s_w = reinterpret_cast<__nv_bfloat16*>(absorb_smem);  // [k16][kAbsorbLdW]
  __nv_bfloat16* s_q = s_w + k16 * kAbsorbLdW;                         // [kAbsorbTokens][ld_q]
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kAbsorbTokens;
  const int h = blockIdx.y, c0 = blockIdx.z * kAbsorbCols;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int q_width = nope + rope, width = kv_lora + rope;

  // The weights do not depend on the previous kernel: copy them before waiting for it. Rows past nope and
  // columns past kv_lora are zero-filled (16-byte vectors: kv_lora is a multiple of 8).
  const __nv_bfloat16* w_uk = kv_b + static_cast<int64_t>(h) * (nope + v_head) * kv_lora;  // [nope, kv_lora]
  for (int v = tid; v < k16 * (kAbsorbCols / 8); v += kAbsorbThreads) {
    const int d = v / (kAbsorbCols / 8), cv = v % (kAbsorbCols / 8), c = c0 + cv * 8;
    const bool valid = d < nope && c < kv_lora;
    detail::cp_async16_zfill(s_w + d * kAbsorbLdW + cv * 8, valid ? w_uk + static_cast<int64_t>(d) * kv_lora + c : w_uk,
                             valid);
  }
  detail::cp_async_commit();
  detail::mla_wait_for_previous_grid();
  detail::mla_allow_next_grid();

  const int count = static_cast<int>(min(static_cast<int64_t>(kAbsorbTokens), num_tokens - t0));
  const int rows16 = (count + 15) / 16 * 16;
  const __nv_bfloat16 zero = __float2bfloat16(0.0f);
  for (int i = tid; i < rows16 * k16; i += kAbsorbThreads) {
    const int tt = i / k16, d = i - tt * k16;
    s_q[tt * ld_q + d] =
        tt < count && d < nope ? q[(t0 + tt) * q_stride + static_cast<int64_t>(h) * q_width + d] : zero;
  }
  if (blockIdx.z == 0) {
    for (int i = tid; i < count * rope; i += kAbsorbThreads) {
      const int tt = i / rope, j = i - tt * rope;
      const float x = __bfloat162float(q[(t0 + tt) * q_stride + static_cast<int64_t>(h) * q_width + nope + j]);
      q_tilde[((t0 + tt) * num_heads + h) * width + kv_lora + j] = x * scale;
    }
  }
  detail::cp_async_wait<0>();
  __syncthreads();
  if (warp * 16 >= count) return;

  float acc[kAbsorbCols / 16][2][4];
#pragma unroll
  for (int j = 0; j < kAbsorbCols / 16; ++j)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[j][nt][e] = 0.0f;
  for (int k0 = 0; k0 < k16; k0 += 16) {
    uint32_t af[4];
    detail::load_a(af, s_q, ld_q, warp * 16, k0);
#pragma unroll
    for (int j = 0; j < kAbsorbCols / 16; ++j) {
      uint32_t bf[4];
      detail::load_b_kn(bf, s_w, kAbsorbLdW, j * 16, k0);
      detail::mma_bf16_16816(acc[j][0], af, bf[0], bf[1]);
      detail::mma_bf16_16816(acc[j][1], af, bf[2], bf[3]);
    }
  }
  const int g = lane >> 2, tq = lane & 3;
#pragma unroll
  for (int j = 0; j < kAbsorbCols / 16; ++j) {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const int col = c0 + j * 16 + nt * 8 + 2 * tq;  // even, and kv_lora is a multiple of 8: col + 1 < kv_lora too
      if (col >= kv_lora) continue;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int tt = warp * 16 + g + 8 * half;
        if (tt < count) {
          *reinterpret_cast<float2*>(&q_tilde[((t0 + tt) * num_heads + h) * width + col]) =
              make_float2(acc[j][nt][2 * half] * scale, acc[j][nt][2 * half + 1] * scale);
        }
      }
    }
  }
}

}  // namespace

namespace detail {

Status launch_mla_absorb(const MlaAttentionParams& p, float* q_tilde, float scale, cudaStream_t stream,
                         const char* who) {
  const int64_t T = p.num_tokens;
  const size_t absorb_smem = absorb_smem_bytes(p.qk_nope);
  if (Status s = mla_set_smem(reinterpret_cast<const void*>(mla_absorb_kernel), absorb_smem, who); !s.is_ok()) {
    return s;
  }
  const dim3 absorb_grid(static_cast<unsigned>((T + kAbsorbTokens - 1) / kAbsorbTokens),
                         static_cast<unsigned>(p.num_heads),
                         static_cast<unsigned>((p.kv_lora_rank + kAbsorbCols - 1) / kAbsorbCols));
  return mla_launch_with_pdl(mla_absorb_kernel, absorb_grid, kAbsorbThreads, absorb_smem, stream, who, p.q, p.q_stride,
                             p.kv_b, T, p.num_heads, p.kv_lora_rank, p.qk_nope, p.qk_rope, p.v_head, scale, q_tilde);
}

}  // namespace detail
}  // namespace deltaserve::kernels::cuda
