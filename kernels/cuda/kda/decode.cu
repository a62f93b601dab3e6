// Fused KDA decode step for sm_90a (contract in kda.hpp): one CTA of 512 threads per (batch row, head); thread
// (rg, cgi) holds value columns 4 cgi .. 4 cgi + 3 of state rows 8 rg .. 8 rg + 7 in registers (64 KiB of state per
// CTA, each byte read once and written once). The L2 norms are scalars folded into u and o, the q/k sums of squares
// are reduced by the conv warps themselves and column sums over the 16 row groups run on 4 threads per column,
// which leaves five barriers. Launched with programmatic dependent launch, so a layer's CTAs become resident while
// the previous kernel drains; with early_state_loads the state's loads are issued before waiting for it.
// A head's columns stay in one CTA: split over 2 or 4 CTAs (clusters exchanging the output norm's sums) the step
// was slower at every batch size (more prologue per state byte, and the cluster barriers).
#include <string>

#include <cuda_bf16.h>

#include "kernels/cuda/common/detail/bf16_stream.cuh"
#include "kernels/cuda/common/detail/mma_sm80.cuh"
#include "kernels/cuda/kda/detail/decode_common.cuh"
#include "kernels/cuda/kda/kda.hpp"

namespace deltaserve::kernels::cuda {
namespace {

using namespace detail;  // NOLINT(google-build-using-namespace)

// Programmatic dependent launch (sm_90): wait until the grid before this one on the stream has finished and its
// writes are visible / let the grid after this one become resident. Both are no-ops without the launch attribute.
__device__ __forceinline__ void wait_for_previous_grid() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}
__device__ __forceinline__ void allow_next_grid() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// Causal depthwise conv + SiLU of one channel: taps weight[0..K-1] over (tail[0..K-2], x), oldest first; the new
// tail (the last K - 1 of those values) in next[0..K-2]. Named registers instead of conv_step's shifted array,
// which ptxas keeps in local memory.
__device__ __forceinline__ float conv_channel(const float* weight, const bf16* tail, int K, float x, float (&next)[3]) {
  const float t0 = K > 1 ? __bfloat162float(tail[0]) : 0.0f, t1 = K > 2 ? __bfloat162float(tail[1]) : 0.0f,
              t2 = K > 3 ? __bfloat162float(tail[2]) : 0.0f;
  float sum = weight[K - 1] * x;
  if (K > 1) sum += weight[0] * t0;
  if (K > 2) sum += weight[1] * t1;
  if (K > 3) sum += weight[2] * t2;
  next[0] = K == 2 ? x : t1;
  next[1] = K == 3 ? x : t2;
  next[2] = x;
  return silu(sum);
}
// The same from what it reads loaded beforehand (load_conv_inputs), for a caller that issues those loads early; the
// same arithmetic, so the same bits.
struct ConvInputs {
  float taps[4];  // weight[0..K-1], the rest 0
  float tail[3];  // tail[0..K-2], the rest 0
  float x;
};
__device__ __forceinline__ ConvInputs load_conv_inputs(const float* weight, const bf16* tail, int K, const bf16* x) {
  ConvInputs in;
#pragma unroll
  for (int j = 0; j < 4; ++j) in.taps[j] = j < K ? weight[j] : 0.0f;
#pragma unroll
  for (int j = 0; j < 3; ++j) in.tail[j] = j < K - 1 ? __bfloat162float(tail[j]) : 0.0f;
  in.x = __bfloat162float(*x);
  return in;
}
__device__ __forceinline__ float conv_channel(const ConvInputs& in, int K, float (&next)[3]) {
  const float last = K == 4 ? in.taps[3] : K == 3 ? in.taps[2] : K == 2 ? in.taps[1] : in.taps[0];
  float sum = last * in.x;
  if (K > 1) sum += in.taps[0] * in.tail[0];
  if (K > 2) sum += in.taps[1] * in.tail[1];
  if (K > 3) sum += in.taps[2] * in.tail[2];
  next[0] = K == 2 ? in.x : in.tail[1];
  next[1] = K == 3 ? in.x : in.tail[2];
  next[2] = in.x;
  return silu(sum);
}

// One CTA of 512 threads per (batch row, head); grid (H, B). Thread (rg, cgi) holds value columns 4 cgi .. 4 cgi + 3
// of state rows 8 rg .. 8 rg + 7 (a warp is one row group: 32 x 16 bytes contiguous per row). Sums over the 16 row
// groups run on 4 threads per column (4 partials each, then 2 shuffles), so every thread takes part. Each conv
// tail element is read and rewritten by one thread only, so the tails are updated in place right away.
// kFusedGates: the gate logits from gate_low and f_b (g_b) instead of gate_raw (out_gate). Thread (column, quarter)
// takes ranks 32 quarter .. 32 quarter + 31 of column's f_b (g_b) row: its 64 weight bytes (each) are copied into its
// own shared-memory slots before the wait for the previous grid (weights), the matching gate_low values are read
// after it, and the 4 threads of a column add their partial dot products by 2 shuffles. The column's decay is
// written with the prologue's; the output gate stays in a register of the threads that write the column.
constexpr int kGatePieces = 8;  // 16-byte weight pieces a thread: f_b 0..3, g_b 4..7
// (One CTA an SM for the fused gates: they are for small batches, and 64 registers would spill.)
template <bool kFusedGates>
__global__ void __launch_bounds__(kThreads, kFusedGates ? 1 : 2)
    kda_decode_kernel(DecodeArgs p, int early_state_loads) {
  constexpr int kGroups = kD / 4;         // float4 column groups per state row
  constexpr int kPartialStride = kD + 8;  // the 4 threads of a column read rows q, q + 4, ...: 4 distinct banks
  static_assert(kThreads / kGroups == kRowGroups, "16 row groups of 8 rows");
  static_assert(kThreads == 4 * kD, "4 threads per column; prologue: one of 128 q, k, gate, v channels per thread");
  __shared__ float x_s[3][kD];  // q, k, v after conv + SiLU, q and k not normalised (the norms are folded in below)
  __shared__ float decay_s[kD];
  __shared__ __align__(16) float u_s[kD];
  __shared__ __align__(16) float partial[kRowGroups * kPartialStride];
  __shared__ float squares[8];     // sums of squares of q (0..3) and k (4..7) over 32 channels each
  __shared__ float o_squares[16];  // sum of o^2 over columns 8 i .. 8 i + 7
  __shared__ float beta_s;
  // kFusedGates: [kGatePieces][kThreads] weight pieces, piece j of thread t at j kThreads + t (conflict-free).
  extern __shared__ uint4 gate_weights[];
  const int h = blockIdx.x, b = blockIdx.y;
  const int H = p.num_heads, C = H * kD, K = p.conv_kernel;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const size_t row = static_cast<size_t>(b) * C;
  // Column sums and the fused gates: thread (column, quarter).
  const int column = tid >> 2, quarter = tid & 3;

  if constexpr (kFusedGates) {
    const size_t weight_row = (static_cast<size_t>(h) * kD + column) * kD + 32 * quarter;
#pragma unroll
    for (int j = 0; j < 4; ++j) cp_async16(&gate_weights[j * kThreads + tid], p.f_b + weight_row + 8 * j);
    if (p.g_b != nullptr) {
#pragma unroll
      for (int j = 0; j < 4; ++j) cp_async16(&gate_weights[(4 + j) * kThreads + tid], p.g_b + weight_row + 8 * j);
    }
    cp_async_commit();
  }
  if (!early_state_loads) wait_for_previous_grid();
  const int slot = p.slots[b];
  const bool skipped = slot < 0 || slot >= p.num_slots;
  const int cgi = tid % kGroups, rg = tid / kGroups;
  float* state = p.state + ((static_cast<size_t>(skipped ? 0 : slot) * H + h) * kD) * kD + cgi * 4;
  float4 s[8];
  if (!skipped) {
#pragma unroll
    for (int i = 0; i < 8; ++i) s[i] = __ldcs(reinterpret_cast<const float4*>(state + (rg * 8 + i) * kD));
  }
  // Inputs, tails and outputs only after the previous grid is done; dependents may start once every CTA of this
  // grid got here (so they, too, wait for this grid's predecessor before anything they read).
  wait_for_previous_grid();
  allow_next_grid();
  if (skipped) {
    if constexpr (kFusedGates) cp_async_wait<0>();  // nothing of this CTA's shared memory is left in flight
    if (tid < kD) p.out[row + h * kD + tid] = __float2bfloat16(0.0f);
    return;
  }

  // Prologue roles: thread (which, channel), which = 0 q, 1 k, 2 gate, 3 v; the conv threads' tail, taps and input.
  const int which = tid / kD, c = tid % kD, channel = h * kD + c;
  const int conv = which == 3 ? 2 : which;  // q, k, v (which != 2)
  const auto tail_of = [&] { return p.conv_state + ((static_cast<size_t>(slot) * 3 + conv) * C + channel) * (K - 1); };
  const auto weight_of = [&] {
    return (conv == 0 ? p.q_conv_weight : (conv == 1 ? p.k_conv_weight : p.v_conv_weight)) +
           static_cast<size_t>(channel) * K;
  };
  const auto input_of = [&] { return (conv == 0 ? p.q_in : (conv == 1 ? p.k_in : p.v_in)) + row + channel; };

  // Fused gates: this column's gate logit (its decay goes to decay_s below, with the prologue's) and output-gate
  // logit, each rounded to bf16 like the separate GEMM's outputs. Every load of the thread, the prologue's too, is
  // issued first, in one round: in program order they were four dependent rounds (the low-rank rows, their second
  // half after the first dot product, dt_bias and a_log after both, the conv inputs after the decay).
  float out_gate_logit = 0.0f;
  ConvInputs early{};
  if constexpr (kFusedGates) {
    const bf16* low = p.gate_low + static_cast<size_t>(b) * p.gate_low_stride + 32 * quarter;
    uint4 x[4], y[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) x[j] = *reinterpret_cast<const uint4*>(low + 8 * j);
    if (p.g_b != nullptr) {
#pragma unroll
      for (int j = 0; j < 4; ++j) y[j] = *reinterpret_cast<const uint4*>(low + kD + 8 * j);
    }
    const float dt_bias = quarter == 0 ? p.dt_bias[h * kD + column] : 0.0f;
    const float a_log = quarter == 0 ? p.a_log[h] : 0.0f;
    if (which != 2) early = load_conv_inputs(weight_of(), tail_of(), K, input_of());
    cp_async_wait<0>();  // this thread's own weight pieces
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; ++j) sum = dot8_bf16(gate_weights[j * kThreads + tid], x[j], sum);
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const float gate_logit = __bfloat162float(__float2bfloat16(sum));
    if (p.g_b != nullptr) {
      sum = 0.0f;
#pragma unroll
      for (int j = 0; j < 4; ++j) sum = dot8_bf16(gate_weights[(4 + j) * kThreads + tid], y[j], sum);
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      out_gate_logit = __bfloat162float(__float2bfloat16(sum));
    }
    if (quarter == 0) decay_s[column] = decay_of_values(p, gate_logit, dt_bias, a_log);
  }

  // Prologue. A warp's 32 channels share `which`, so the q and k warps also reduce their sums of squares right away.
  {
    if (which == 2) {
      if constexpr (!kFusedGates) decay_s[c] = gate_decay(p, row, channel, h);  // decay = e^g
    } else {
      bf16* tail = tail_of();
      float next[3];
      float x;
      if constexpr (kFusedGates) {
        x = conv_channel(early, K, next);
      } else {
        x = conv_channel(weight_of(), tail, K, __bfloat162float(*input_of()), next);
      }
      x_s[conv][c] = x;
#pragma unroll
      for (int j = 0; j < 3; ++j) {
        if (j < K - 1) tail[j] = __float2bfloat16(next[j]);  // exact: every tail value is a bf16 input
      }
      if (conv < 2) {
        float square = x * x;
        for (int offset = 16; offset > 0; offset >>= 1) square += __shfl_xor_sync(0xffffffffu, square, offset);
        if (lane == 0) squares[conv * 4 + c / 32] = square;
      }
    }
  }
  if (tid == 0) beta_s = sigmoid(__bfloat162float(p.beta_raw[static_cast<size_t>(b) * H + h]));
  __syncthreads();

  // S = Diag(e^g) S and the partial S^T k with k not yet normalised.
  const float4 ks = decay_rows_partial_sk(s, decay_s, x_s[1], rg);
  *reinterpret_cast<float4*>(&partial[rg * kPartialStride + cgi * 4]) = ks;
  __syncthreads();
  // Column sums over the 16 row groups: thread (column, quarter) adds row groups quarter, quarter + 4, ..., then
  // two shuffles; the butterfly gives all 4 threads the same value.
  const auto column_sum = [&]() {
    const float* x = &partial[quarter * kPartialStride + column];
    float sum = (x[0] + x[4 * kPartialStride]) + (x[8 * kPartialStride] + x[12 * kPartialStride]);
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    return sum + __shfl_xor_sync(0xffffffffu, sum, 2);
  };
  // u = beta (v - S^T k) with k = k_raw / |k_raw|; stored times 1 / |k_raw| so that the update adds k_raw u^T.
  {
    const float sk = column_sum();
    const float inverse_k = rsqrtf(squares[4] + squares[5] + squares[6] + squares[7] + kL2Eps);
    if (quarter == 0) u_s[column] = inverse_k * (beta_s * (x_s[2][column] - inverse_k * sk));
  }
  __syncthreads();
  const float4 u = *reinterpret_cast<const float4*>(&u_s[cgi * 4]);
  const float4 o = update_rows_partial_o<true>(s, u, x_s[1], x_s[0], rg, state);
  *reinterpret_cast<float4*>(&partial[rg * kPartialStride + cgi * 4]) = o;
  __syncthreads();
  // o = S^T q with q = q_raw d^-1/2 / |q_raw|; warp w sums the squares of columns 8 w .. 8 w + 7.
  const float inverse_q =
      rsqrtf(static_cast<float>(kD)) * rsqrtf(squares[0] + squares[1] + squares[2] + squares[3] + kL2Eps);
  const float o_col = inverse_q * column_sum();
  float square = quarter == 0 ? o_col * o_col : 0.0f;
  for (int offset = 16; offset >= 4; offset >>= 1) square += __shfl_xor_sync(0xffffffffu, square, offset);
  if (lane == 0) o_squares[warp] = square;
  __syncthreads();
  // Gated RMSNorm of o over the head's 128 columns.
  if (quarter == 0) {
    float total = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; ++i) total += o_squares[i];
    const float inverse_rms = rsqrtf(total / static_cast<float>(kD) + p.rms_eps);
    const float gate =
        sigmoid(kFusedGates && p.g_b != nullptr ? out_gate_logit : __bfloat162float(p.out_gate[row + h * kD + column]));
    p.out[row + h * kD + column] = __float2bfloat16(o_col * inverse_rms * p.o_norm_weight[column] * gate);
  }
}

Status launch_decode(const DecodeArgs& args, const KdaDecodeParams& p, cudaStream_t stream) {
  const int early = p.early_state_loads ? 1 : 0;
  const dim3 grid(static_cast<unsigned>(p.num_heads), static_cast<unsigned>(p.batch));
  if (p.gate_low == nullptr) {
    return launch_kernel_ex(true, kda_decode_kernel<false>, grid, dim3(kThreads), 0, stream, "kda_decode_step", args,
                            early);
  }
  constexpr size_t kGateSmem = size_t{kGatePieces} * kThreads * sizeof(uint4);
  static const cudaError_t attribute = cudaFuncSetAttribute(
      kda_decode_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kGateSmem));
  if (attribute != cudaSuccess) {
    return internal_error(std::string("kda_decode_step (fused gates): shared memory attribute: ") +
                          cudaGetErrorString(attribute));
  }
  return launch_kernel_ex(true, kda_decode_kernel<true>, grid, dim3(kThreads), kGateSmem, stream,
                          "kda_decode_step (fused gates)", args, early);
}

}  // namespace

Status kda_decode_step(const KdaDecodeParams& p, cudaStream_t stream) {
  DS_RETURN_IF_ERROR(validate_decode_params(p, "kda_decode_step"));
  if (p.batch == 0) return Status::ok();
  return launch_decode(make_decode_args(p), p, stream);
}

}  // namespace deltaserve::kernels::cuda
