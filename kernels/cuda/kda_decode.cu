// Fused KDA decode step for sm_90a (contract in kda.hpp). One CTA of 512 threads per (batch row, head): the
// state's loads (64 KiB, 8 x 16 bytes per thread, streaming) are issued first, the short conv, L2 norms and gate
// run while they land, then S^T k, u, the update and o = S^T q reduce over 16 row groups in shared memory, and the
// gated RMSNorm of o finishes in the same CTA. Each byte of state is read once and written once.
#include <cmath>
#include <string>

#include <cuda_bf16.h>

#include "kernels/cuda/kda.hpp"
#include "kernels/cuda/kda_decode_common.cuh"

namespace deltaserve::kernels::cuda {
namespace {

using namespace detail;  // NOLINT(google-build-using-namespace)

__global__ void __launch_bounds__(kThreads, 2) kda_decode_kernel(DecodeArgs p) {
  __shared__ float x_s[3][kD];  // q, k, v after conv + SiLU (q, k then normalised)
  __shared__ float decay_s[kD], u_s[kD];
  __shared__ __align__(16) float partial[kRowGroups][kD];
  __shared__ float sums[16];
  const int h = blockIdx.x, b = blockIdx.y;
  const int H = p.num_heads, C = H * kD, K = p.conv_kernel;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int slot = p.slots[b];
  const size_t row = static_cast<size_t>(b) * C;
  if (slot < 0 || slot >= p.num_slots) {
    if (tid < kD) p.out[row + h * kD + tid] = __float2bfloat16(0.0f);
    return;
  }
  // State first, so its loads overlap the conv and norms: thread owns columns 4 cg .. 4 cg + 3 of rows
  // 8 rg .. 8 rg + 7 (a warp is one row group: 32 x 16 bytes contiguous per row).
  const int cgi = tid & 31, rg = tid >> 5;
  float* state = p.state + ((static_cast<size_t>(slot) * H + h) * kD) * kD + cgi * 4;
  float4 s[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) s[i] = __ldcs(reinterpret_cast<const float4*>(state + (rg * 8 + i) * kD));

  // Short conv + SiLU: threads 0..383 = (which in q, k, v) x channel; each updates its own tail.
  const int which = tid >> 7, c = tid & (kD - 1), channel = h * kD + c;
  if (which < 3) {
    const size_t tail_stride = static_cast<size_t>(K - 1);
    float* tail = p.conv_state + ((static_cast<size_t>(slot) * 3 + which) * C + channel) * tail_stride;
    const bf16* input = which == 0 ? p.q_in : (which == 1 ? p.k_in : p.v_in);
    const float* weight = (which == 0 ? p.q_conv_weight : (which == 1 ? p.k_conv_weight : p.v_conv_weight)) +
                          static_cast<size_t>(channel) * K;
    float t[3] = {};
#pragma unroll
    for (int j = 0; j < 3; ++j) {
      if (j < K - 1) t[j] = tail[j];
    }
    x_s[which][c] = conv_step(weight, t, __bfloat162float(input[row + channel]), K);
#pragma unroll
    for (int j = 0; j < 3; ++j) {
      if (j < K - 1) tail[j] = t[j];
    }
  } else {
    // Gate: decay = e^g.
    const float x = __bfloat162float(p.gate_raw[row + channel]) + p.dt_bias[channel];
    const float a = __expf(p.a_log[h]);
    const float g = p.bounded ? p.lower_bound * sigmoid(a * x) : -a * (x > 20.0f ? x : log1pf(__expf(x)));
    decay_s[c] = __expf(g);
  }
  __syncthreads();
  // L2 norms: warps 0..3 sum q^2, warps 4..7 k^2.
  if (warp < 8) {
    const float value = x_s[warp >> 2][c];
    float square = value * value;
    for (int offset = 16; offset > 0; offset >>= 1) square += __shfl_xor_sync(0xffffffffu, square, offset);
    if (lane == 0) sums[warp] = square;
  }
  __syncthreads();
  if (warp < 8) {
    const int base = (warp >> 2) * 4;
    const float total = sums[base] + sums[base + 1] + sums[base + 2] + sums[base + 3];
    const float scale = warp < 4 ? rsqrtf(static_cast<float>(kD)) : 1.0f;
    x_s[warp >> 2][c] *= scale * rsqrtf(total + kL2Eps);
  }
  const float beta = sigmoid(__bfloat162float(p.beta_raw[static_cast<size_t>(b) * H + h]));
  __syncthreads();

  // S = Diag(e^g) S and the partial S^T k of this thread's rows.
  float4 ks = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int r = rg * 8 + i;
    const float d = decay_s[r], kr = x_s[1][r];
    s[i].x *= d;
    s[i].y *= d;
    s[i].z *= d;
    s[i].w *= d;
    ks.x += kr * s[i].x;
    ks.y += kr * s[i].y;
    ks.z += kr * s[i].z;
    ks.w += kr * s[i].w;
  }
  *reinterpret_cast<float4*>(&partial[rg][cgi * 4]) = ks;
  __syncthreads();
  if (tid < kD) {
    float sk = 0.0f;
#pragma unroll
    for (int r = 0; r < kRowGroups; ++r) sk += partial[r][tid];
    u_s[tid] = beta * (x_s[2][tid] - sk);
  }
  __syncthreads();
  const float4 u = *reinterpret_cast<const float4*>(&u_s[cgi * 4]);
  float4 o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int r = rg * 8 + i;
    const float kr = x_s[1][r], qr = x_s[0][r];
    s[i].x += kr * u.x;
    s[i].y += kr * u.y;
    s[i].z += kr * u.z;
    s[i].w += kr * u.w;
    o.x += qr * s[i].x;
    o.y += qr * s[i].y;
    o.z += qr * s[i].z;
    o.w += qr * s[i].w;
    __stcs(reinterpret_cast<float4*>(state + r * kD), s[i]);
  }
  *reinterpret_cast<float4*>(&partial[rg][cgi * 4]) = o;
  __syncthreads();
  // Gated RMSNorm of o (warps 0..3, one column per thread).
  float o_col = 0.0f;
  if (tid < kD) {
#pragma unroll
    for (int r = 0; r < kRowGroups; ++r) o_col += partial[r][tid];
    float square = o_col * o_col;
    for (int offset = 16; offset > 0; offset >>= 1) square += __shfl_xor_sync(0xffffffffu, square, offset);
    if (lane == 0) sums[8 + warp] = square;
  }
  __syncthreads();
  if (tid < kD) {
    const float total = sums[8] + sums[9] + sums[10] + sums[11];
    const float inverse_rms = rsqrtf(total / static_cast<float>(kD) + p.rms_eps);
    const float gate = sigmoid(__bfloat162float(p.out_gate[row + h * kD + tid]));
    p.out[row + h * kD + tid] = __float2bfloat16(o_col * inverse_rms * p.o_norm_weight[tid] * gate);
  }
}

}  // namespace

Status kda_decode_step(const KdaDecodeParams& p, cudaStream_t stream) {
  DS_RETURN_IF_ERROR(validate_decode_params(p, "kda_decode_step"));
  if (p.batch == 0) return Status::ok();
  const DecodeArgs args = make_decode_args(p);
  kda_decode_kernel<<<dim3(static_cast<unsigned>(p.num_heads), static_cast<unsigned>(p.batch)), kThreads, 0, stream>>>(
      args);
  return launch_status("kda_decode_step");
}

}  // namespace deltaserve::kernels::cuda
