// Speculative decoding for KDA (contract in kda.hpp). KDA updates its state in place, so a rejected draft cannot
// be undone by truncation. Verify runs the k draft tokens of each row from the committed state, keeping the
// state and conv tails untouched (the running state lives in registers only), and saves each token's projected
// inputs (k after the L2 norm, v after the conv, e^g, beta): 1.5 KiB per token and head against 64 KiB of state.
// Commit then rebuilds the state on chip from those saved inputs for the accepted prefix only and writes it, and
// shifts the accepted raw inputs into the conv tails. Same CTA layout as decode.cu (512 threads per row, head).
#include <cmath>
#include <string>

#include <cuda_bf16.h>

#include "kernels/cuda/kda/detail/decode_common.cuh"
#include "kernels/cuda/kda/kda.hpp"

namespace deltaserve::kernels::cuda {
namespace {

using namespace detail;  // NOLINT(google-build-using-namespace)

constexpr int kMaxDraft = 16;

// saved: [B, draft, H, 3, d] (k normalised, v, e^g); saved_beta: [B, draft, H].
__global__ void __launch_bounds__(kThreads, 2)
    kda_spec_verify_kernel(DecodeArgs p, int draft, float* saved, float* saved_beta) {
  __shared__ float x_s[3][kD];
  __shared__ float decay_s[kD], u_s[kD];
  __shared__ __align__(16) float partial[kRowGroups][kD];
  __shared__ float sums[16];
  const int h = blockIdx.x, b = blockIdx.y;
  const int H = p.num_heads, C = H * kD, K = p.conv_kernel;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int slot = p.slots[b];
  if (slot < 0 || slot >= p.num_slots) {
    for (int j = 0; j < draft; ++j) {
      if (tid < kD) p.out[(static_cast<size_t>(b) * draft + j) * C + h * kD + tid] = __float2bfloat16(0.0f);
    }
    return;
  }
  const int cgi = tid & 31, rg = tid >> 5;
  const float* state = p.state + ((static_cast<size_t>(slot) * H + h) * kD) * kD + cgi * 4;
  float4 s[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) s[i] = *reinterpret_cast<const float4*>(state + (rg * 8 + i) * kD);
  const int which = tid >> 7, c = tid & (kD - 1), channel = h * kD + c;
  float tail[3] = {};
  if (which < 3) {
    const bf16* tails = p.conv_state + ((static_cast<size_t>(slot) * 3 + which) * C + channel) * (K - 1);
#pragma unroll
    for (int j = 0; j < 3; ++j) {
      if (j < K - 1) tail[j] = __bfloat162float(tails[j]);
    }
  }
  const float* weight = (which == 0 ? p.q_conv_weight : (which == 1 ? p.k_conv_weight : p.v_conv_weight)) +
                        static_cast<size_t>(channel) * K;
  const bf16* input = which == 0 ? p.q_in : (which == 1 ? p.k_in : p.v_in);

  for (int j = 0; j < draft; ++j) {
    const size_t token = static_cast<size_t>(b) * draft + j;
    const size_t row = token * C;
    if (which < 3) {
      x_s[which][c] = conv_step(weight, tail, __bfloat162float(input[row + channel]), K);
    } else {
      decay_s[c] = gate_decay(p, row, channel, h);
    }
    __syncthreads();
    normalize_qk(x_s, sums, warp, lane, c);
    const float beta = sigmoid(__bfloat162float(p.beta_raw[token * H + h]));
    __syncthreads();
    // Save the projected inputs the commit needs.
    float* saved_token = saved + (token * H + h) * 3 * kD;
    if (which == 1) saved_token[c] = x_s[1][c];
    if (which == 2) saved_token[kD + c] = x_s[2][c];
    if (which == 3) saved_token[2 * kD + c] = decay_s[c];
    if (tid == 0) saved_beta[token * H + h] = beta;

    const float4 ks = decay_rows_partial_sk(s, decay_s, x_s[1], rg);
    *reinterpret_cast<float4*>(&partial[rg][cgi * 4]) = ks;
    __syncthreads();
    delta_u(u_s, partial, x_s[2], beta, tid);
    __syncthreads();
    const float4 u = *reinterpret_cast<const float4*>(&u_s[cgi * 4]);
    const float4 o = update_rows_partial_o<false>(s, u, x_s[1], x_s[0], rg, nullptr);
    *reinterpret_cast<float4*>(&partial[rg][cgi * 4]) = o;
    __syncthreads();
    gated_rms_norm_out(p, partial, sums, row, h, tid, lane, warp);
    __syncthreads();  // x_s, partial and sums are reused by the next token
  }
}

__global__ void __launch_bounds__(kThreads, 2) kda_spec_commit_kernel(DecodeArgs p, int draft, const int32_t* accepted,
                                                                      const float* saved, const float* saved_beta) {
  __shared__ float k_s[kD], v_s[kD], decay_s[kD], u_s[kD];
  __shared__ __align__(16) float partial[kRowGroups][kD];
  const int h = blockIdx.x, b = blockIdx.y;
  const int H = p.num_heads, C = H * kD, K = p.conv_kernel;
  const int tid = threadIdx.x;
  const int slot = p.slots[b];
  if (slot < 0 || slot >= p.num_slots) return;
  const int count = min(max(accepted[b], 0), draft);
  if (count == 0) return;
  const int cgi = tid & 31, rg = tid >> 5;
  float* state = p.state + ((static_cast<size_t>(slot) * H + h) * kD) * kD + cgi * 4;
  float4 s[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) s[i] = __ldcs(reinterpret_cast<const float4*>(state + (rg * 8 + i) * kD));
  // Conv tails: shift in the accepted raw inputs.
  const int which = tid >> 7, c = tid & (kD - 1), channel = h * kD + c;
  if (which < 3 && K > 1) {
    bf16* tails = p.conv_state + ((static_cast<size_t>(slot) * 3 + which) * C + channel) * (K - 1);
    const bf16* input = which == 0 ? p.q_in : (which == 1 ? p.k_in : p.v_in);
    float tail[3] = {};
#pragma unroll
    for (int j = 0; j < 3; ++j) {
      if (j < K - 1) tail[j] = __bfloat162float(tails[j]);
    }
    for (int j = 0; j < count; ++j) {
      const float x = __bfloat162float(input[(static_cast<size_t>(b) * draft + j) * C + channel]);
#pragma unroll
      for (int m = 0; m < 2; ++m) {
        if (m + 1 < K - 1) tail[m] = tail[m + 1];
      }
#pragma unroll
      for (int m = 0; m < 3; ++m) {
        if (m == K - 2) tail[m] = x;
      }
    }
#pragma unroll
    for (int j = 0; j < 3; ++j) {
      if (j < K - 1) tails[j] = __float2bfloat16(tail[j]);  // exact: bf16 inputs
    }
  }
  for (int j = 0; j < count; ++j) {
    const size_t token = static_cast<size_t>(b) * draft + j;
    const float* saved_token = saved + (token * H + h) * 3 * kD;
    if (tid < kD) {
      k_s[tid] = saved_token[tid];
    } else if (tid < 2 * kD) {
      v_s[tid - kD] = saved_token[tid];
    } else if (tid < 3 * kD) {
      decay_s[tid - 2 * kD] = saved_token[tid];
    }
    const float beta = saved_beta[token * H + h];
    __syncthreads();
    const float4 ks = decay_rows_partial_sk(s, decay_s, k_s, rg);
    *reinterpret_cast<float4*>(&partial[rg][cgi * 4]) = ks;
    __syncthreads();
    delta_u(u_s, partial, v_s, beta, tid);
    __syncthreads();
    const float4 u = *reinterpret_cast<const float4*>(&u_s[cgi * 4]);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float kr = k_s[rg * 8 + i];
      s[i].x += kr * u.x;
      s[i].y += kr * u.y;
      s[i].z += kr * u.z;
      s[i].w += kr * u.w;
    }
    __syncthreads();  // k_s, u_s and partial are reused by the next token
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) __stcs(reinterpret_cast<float4*>(state + (rg * 8 + i) * kD), s[i]);
}

Status validate_spec(const KdaDecodeParams& p, int draft_tokens, const KdaSpecBuffers& buffers, const char* who) {
  DS_RETURN_IF_ERROR(validate_decode_params(p, who));
  if (p.gate_low != nullptr)
    return unimplemented(std::string(who) + ": gate_low (fused low-rank gates) is kda_decode_step only");
  if (draft_tokens < 1 || draft_tokens > kMaxDraft) {
    return invalid_argument(std::string(who) + ": draft_tokens must be in [1, 16], got " +
                            std::to_string(draft_tokens));
  }
  if (draft_tokens > buffers.max_draft_tokens) {
    return invalid_argument(std::string(who) + ": draft_tokens exceeds the buffers' max_draft_tokens");
  }
  if (p.batch == 0) return Status::ok();
  DS_RETURN_IF_ERROR(check_pointer(buffers.saved, "saved", who));
  DS_RETURN_IF_ERROR(check_pointer(buffers.saved_beta, "saved_beta", who));
  return Status::ok();
}

}  // namespace

Status kda_spec_verify(const KdaDecodeParams& p, int draft_tokens, const KdaSpecBuffers& buffers, cudaStream_t stream) {
  DS_RETURN_IF_ERROR(validate_spec(p, draft_tokens, buffers, "kda_spec_verify"));
  if (p.batch == 0) return Status::ok();
  kda_spec_verify_kernel<<<dim3(static_cast<unsigned>(p.num_heads), static_cast<unsigned>(p.batch)), kThreads, 0,
                           stream>>>(make_decode_args(p), draft_tokens, buffers.saved, buffers.saved_beta);
  return launch_status("kda_spec_verify");
}

Status kda_spec_commit(const KdaDecodeParams& p, int draft_tokens, const int32_t* accepted,
                       const KdaSpecBuffers& buffers, cudaStream_t stream) {
  DS_RETURN_IF_ERROR(validate_spec(p, draft_tokens, buffers, "kda_spec_commit"));
  if (p.batch == 0) return Status::ok();
  DS_RETURN_IF_ERROR(check_pointer(accepted, "accepted", "kda_spec_commit"));
  kda_spec_commit_kernel<<<dim3(static_cast<unsigned>(p.num_heads), static_cast<unsigned>(p.batch)), kThreads, 0,
                           stream>>>(make_decode_args(p), draft_tokens, accepted, buffers.saved, buffers.saved_beta);
  return launch_status("kda_spec_commit");
}

}  // namespace deltaserve::kernels::cuda
