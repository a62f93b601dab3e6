// Fused KDA decode step for sm_90a (contract in kda.hpp). Three kernels, picked by KdaDecodeParams::kernel:
//
// cols1 (the default): one CTA of 512 threads per (batch row, head); thread (rg, cgi) holds value columns
// 4 cgi .. 4 cgi + 3 of state rows 8 rg .. 8 rg + 7 in registers (64 KiB of state per CTA, each byte read once and
// written once). The L2 norms are scalars folded into u and o, the q/k sums of squares are reduced by the conv
// warps themselves and column sums over the 16 row groups run on 4 threads per column, which leaves five
// barriers instead of v1's seven. Launched with programmatic dependent launch, so a layer's CTAs become resident
// while the previous kernel drains; with early_state_loads the state's loads are issued before waiting for it.
//
// v1 (DELTASERVE_KDA_DECODE=v1): the same CTA shape with plain launch, the norms applied to q and k in shared
// memory, and seven barriers. Kept as the fallback that needs no programmatic dependent launch.
//
// pipe2 (DELTASERVE_KDA_DECODE=pipe2): cols1's thread layout and arithmetic in persistent CTAs, one per SM
// (512 threads x up to 128 registers), each running items j, j + G, ... with two items' state in registers: an
// item's registers are refilled with the item two ahead as soon as its updated rows are stored, so the loads of
// the next two items are in flight through every barrier and reduction. Why: cols1's two CTAs per SM start
// together (same wave), load 128 KiB, then both reduce with no loads in flight, then store, then retire; the SMs
// stay in step, so HBM idles during the reductions and between waves (0.78-0.81 of copy bandwidth below). With
// pipe2 every SM keeps 64-128 KiB of loads in flight all the time; an item's compute (~1-1.5 us with 16 warps) is
// shorter than its share of HBM time (128 KiB at 4.26 TB/s / 132 SMs = 4.1 us), so the SMs wait on memory, never
// memory on the SMs. Unlike v2 (TMA prefetch into shared memory, measured slower: bench/gpu/NOTES.md) the state
// stays in registers (no shared round trip, no barrier before the next copy), and the inputs that may miss L2
// (raw q/k/v/gate, conv tails, output gate, beta) are loaded two items ahead with the state, so no HBM latency
// sits on an item's path. Not measured yet. Ceiling: besides the state (B = 64: 268 MB) a step moves the conv
// tails and activations (22 MB), so 100 % of copy in all bytes is 68 us at B = 64 (0.925 in state bytes alone);
// expected 0.93-0.97 of copy in all bytes, i.e. B = 64 about 70-74 us per layer with early state loads (0.85-0.90
// in state bytes), 1-3 us more without (the layer boundary is not overlapped), B = 256 about 280-295 us; B = 1 and
// 8 (one or two items per CTA, run one after the other on 16 warps) about cols1's or somewhat slower.
//
// Measured on the H200 (KdaDecodeGpu.VariantsTiming, H = 32, 8-layer graphs, us per layer; 2026-12-01,
// integration build of branches mla/moe/kda/wgmoe/wgmla on 2026-12-01):
//   B      v1      cols1   cols1 + early state loads
//   1      5.03    4.67    4.11
//   8      12.26   11.39   10.88
//   64     84.02   80.73   78.94   (state bytes: 0.75 / 0.78 / 0.80 of 4.26 TB/s copy)
//   256    327.64  315.40  311.88  (0.77 / 0.80 / 0.81)
// Splitting a head's columns over 2 or 4 CTAs (clusters exchanging the output norm's sums) was slower at every
// batch (B = 64: 85.20 / 98.80 us): more prologue per state byte and the cluster barriers (bench/gpu/NOTES.md).
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <iterator>
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
    decay_s[c] = gate_decay(p, row, channel, h);  // decay = e^g
  }
  __syncthreads();
  normalize_qk(x_s, sums, warp, lane, c);
  const float beta = sigmoid(__bfloat162float(p.beta_raw[static_cast<size_t>(b) * H + h]));
  __syncthreads();

  // S = Diag(e^g) S and the partial S^T k of this thread's rows.
  const float4 ks = decay_rows_partial_sk(s, decay_s, x_s[1], rg);
  *reinterpret_cast<float4*>(&partial[rg][cgi * 4]) = ks;
  __syncthreads();
  delta_u(u_s, partial, x_s[2], beta, tid);
  __syncthreads();
  const float4 u = *reinterpret_cast<const float4*>(&u_s[cgi * 4]);
  const float4 o = update_rows_partial_o<true>(s, u, x_s[1], x_s[0], rg, state);
  *reinterpret_cast<float4*>(&partial[rg][cgi * 4]) = o;
  __syncthreads();
  gated_rms_norm_out(p, partial, sums, row, h, tid, lane, warp);
}

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
__device__ __forceinline__ float conv_channel(const float* weight, const float* tail, int K, float x,
                                              float (&next)[3]) {
  const float t0 = K > 1 ? tail[0] : 0.0f, t1 = K > 2 ? tail[1] : 0.0f, t2 = K > 3 ? tail[2] : 0.0f;
  float sum = weight[K - 1] * x;
  if (K > 1) sum += weight[0] * t0;
  if (K > 2) sum += weight[1] * t1;
  if (K > 3) sum += weight[2] * t2;
  next[0] = K == 2 ? x : t1;
  next[1] = K == 3 ? x : t2;
  next[2] = x;
  return silu(sum);
}

// One CTA of 512 threads per (batch row, head); grid (H, B). Thread (rg, cgi) holds value columns 4 cgi .. 4 cgi + 3
// of state rows 8 rg .. 8 rg + 7 (a warp is one row group: 32 x 16 bytes contiguous per row). Sums over the 16 row
// groups run on 4 threads per column (4 partials each, then 2 shuffles), so every thread takes part. Each conv
// tail element is read and rewritten by one thread only, so the tails are updated in place right away.
__global__ void __launch_bounds__(kThreads, 2) kda_decode_cols1_kernel(DecodeArgs p, int early_state_loads) {
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
  const int h = blockIdx.x, b = blockIdx.y;
  const int H = p.num_heads, C = H * kD, K = p.conv_kernel;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const size_t row = static_cast<size_t>(b) * C;

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
    if (tid < kD) p.out[row + h * kD + tid] = __float2bfloat16(0.0f);
    return;
  }

  // Prologue: thread = (which, channel), which = 0 q, 1 k, 2 gate, 3 v. A warp's 32 channels share `which`, so
  // the q and k warps also reduce their sums of squares right away.
  {
    const int which = tid / kD, c = tid % kD, channel = h * kD + c;
    if (which == 2) {
      decay_s[c] = gate_decay(p, row, channel, h);  // decay = e^g
    } else {
      const int conv = which == 3 ? 2 : which;  // q, k, v
      float* tail = p.conv_state + ((static_cast<size_t>(slot) * 3 + conv) * C + channel) * (K - 1);
      const float* weight = (conv == 0 ? p.q_conv_weight : (conv == 1 ? p.k_conv_weight : p.v_conv_weight)) +
                            static_cast<size_t>(channel) * K;
      const bf16* input = conv == 0 ? p.q_in : (conv == 1 ? p.k_in : p.v_in);
      float next[3];
      const float x = conv_channel(weight, tail, K, __bfloat162float(input[row + channel]), next);
      x_s[conv][c] = x;
#pragma unroll
      for (int j = 0; j < 3; ++j) {
        if (j < K - 1) tail[j] = next[j];
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
  const int column = tid >> 2, quarter = tid & 3;
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
    const float gate = sigmoid(__bfloat162float(p.out_gate[row + h * kD + column]));
    p.out[row + h * kD + column] = __float2bfloat16(o_col * inverse_rms * p.o_norm_weight[column] * gate);
  }
}

// ---- pipe2: persistent CTAs, two items' state in flight in registers ----------------------------------------

// What a thread of the pipe2 kernel reads for one item (row, head) besides its state, issued together with that
// state two items before the item runs: the raw input of its prologue channel (q, k or v before the conv, or the
// gate logit), that channel's conv tail (q, k and v threads), the output gate of its output column (threads with
// quarter 0) and the beta logit (thread 0). slot: the item's slot, -1 when the row is skipped or the item is past
// the end (then nothing else is read).
struct ItemInputs {
  int slot = -1;
  float x = 0.0f;
  float tail[3] = {0.0f, 0.0f, 0.0f};
  float out_gate = 0.0f;
  float beta_raw = 0.0f;
};

// Persistent grid (kda_decode_step sizes it to the resident CTAs, 1 per SM); CTA j runs items j, j + G, j + 2 G, ...
// (G = gridDim.x, item = b H + h) with cols1's thread layout, arithmetic and five barriers per item. The thread
// holds two items' state: s_even for items j, j + 2 G, ..., s_odd for j + G, j + 3 G, ... As soon as an item's
// updated rows are stored (before its output reduction), the same registers receive the loads of the item 2 G
// ahead, together with that item's ItemInputs; so while an item's barriers and reductions run, the next item's
// state (issued one item earlier) and the one after it stream in, and each SM always has 64-128 KiB of loads in
// flight instead of cols1's bursts of 128 KiB followed by none. The slot of the item 2 G ahead is read at the start
// of an item, so that no dependent load sits on an item's path; only the conv weights, dt_bias and a_log (L2
// resident) are read in the item's prologue. Shared memory is reused from item to item without extra barriers:
// every read of x_s, decay_s, u_s, squares and beta_s comes before the item's fourth barrier and every read of
// partial and o_squares before the next item's first. 512 threads x up to 128 registers: 1 CTA per SM.
__global__ void __launch_bounds__(kThreads, 1)
    kda_decode_pipe2_kernel(DecodeArgs p, int num_items, int early_state_loads) {
  constexpr int kGroups = kD / 4;
  constexpr int kPartialStride = kD + 8;
  __shared__ float x_s[3][kD];  // q, k, v after conv + SiLU, q and k not normalised
  __shared__ float decay_s[kD];
  __shared__ __align__(16) float u_s[kD];
  __shared__ __align__(16) float partial[kRowGroups * kPartialStride];
  __shared__ float squares[8];
  __shared__ float o_squares[16];
  __shared__ float beta_s;
  const int H = p.num_heads, C = H * kD, K = p.conv_kernel, stride = static_cast<int>(gridDim.x);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int cgi = tid % kGroups, rg = tid / kGroups;
  const int which = tid / kD, c = tid % kD;  // prologue role: 0 q, 1 k, 2 gate, 3 v (warp-uniform)
  const int conv = which == 3 ? 2 : which;   // conv index of the q, k, v roles
  const int column = tid >> 2, quarter = tid & 3;

  const auto item_slot = [&](int item) {
    if (item >= num_items) return -1;
    const int slot = p.slots[item / H];
    return slot >= 0 && slot < p.num_slots ? slot : -1;
  };
  // Columns 4 cgi .. 4 cgi + 3 of the item's state; row r at + r * kD.
  const auto state_columns = [&](int item, int slot) {
    return p.state + ((static_cast<size_t>(slot) * H + item % H) * kD) * kD + cgi * 4;
  };
  const auto tail_of = [&](int item, int slot) {
    return p.conv_state + ((static_cast<size_t>(slot) * 3 + conv) * C + (item % H) * kD + c) * (K - 1);
  };
  const auto load_state = [&](int item, int slot, float4(&s)[8]) {
    if (slot < 0) return;
    const float* state = state_columns(item, slot);
#pragma unroll
    for (int i = 0; i < 8; ++i) s[i] = __ldcs(reinterpret_cast<const float4*>(state + (rg * 8 + i) * kD));
  };
  const auto load_inputs = [&](int item, int slot, ItemInputs& in) {
    in = ItemInputs{};
    in.slot = slot;
    if (slot < 0) return;
    const int b = item / H, h = item - b * H;
    const size_t row = static_cast<size_t>(b) * C;
    const bf16* x = which == 0 ? p.q_in : (which == 1 ? p.k_in : (which == 2 ? p.gate_raw : p.v_in));
    in.x = __bfloat162float(x[row + h * kD + c]);
    if (which != 2) {
      const float* tail = tail_of(item, slot);
#pragma unroll
      for (int j = 0; j < 3; ++j) {
        if (j < K - 1) in.tail[j] = tail[j];
      }
    }
    if (quarter == 0) in.out_gate = __bfloat162float(p.out_gate[row + h * kD + column]);
    if (tid == 0) in.beta_raw = __bfloat162float(p.beta_raw[static_cast<size_t>(b) * H + h]);
  };

  // The first two items: state (before the previous grid is done with early_state_loads), then the inputs.
  const int first = static_cast<int>(blockIdx.x);
  if (!early_state_loads) wait_for_previous_grid();
  float4 s_even[8], s_odd[8];
  const int first_slot = item_slot(first), second_slot = item_slot(first + stride);
  load_state(first, first_slot, s_even);
  load_state(first + stride, second_slot, s_odd);
  wait_for_previous_grid();
  allow_next_grid();
  const float norm_weight = p.o_norm_weight[column];
  ItemInputs in_even, in_odd;
  load_inputs(first, first_slot, in_even);
  load_inputs(first + stride, second_slot, in_odd);
  // One item whose state is in s and inputs in `in`; leaves the item 2 G ahead loading into both.
  const auto run_item = [&](int item, float4(&s)[8], ItemInputs& in) {
    const int b = item / H, h = item - b * H;
    const size_t out_at = static_cast<size_t>(b) * C + h * kD;
    const int later = item + 2 * stride;
    const int later_slot = item_slot(later);
    if (in.slot < 0) {
      if (tid < kD) p.out[out_at + tid] = __float2bfloat16(0.0f);
      load_state(later, later_slot, s);
      load_inputs(later, later_slot, in);
      return;
    }
    float* state = state_columns(item, in.slot);
    if (which == 2) {
      decay_s[c] = gate_decay_of(p, in.x, h * kD + c, h);
    } else {
      const float* weight = (conv == 0 ? p.q_conv_weight : (conv == 1 ? p.k_conv_weight : p.v_conv_weight)) +
                            static_cast<size_t>(h * kD + c) * K;
      float next[3];
      const float x = conv_channel(weight, in.tail, K, in.x, next);
      x_s[conv][c] = x;
      float* tail = tail_of(item, in.slot);
#pragma unroll
      for (int j = 0; j < 3; ++j) {
        if (j < K - 1) tail[j] = next[j];
      }
      if (conv < 2) {
        float square = x * x;
        for (int offset = 16; offset > 0; offset >>= 1) square += __shfl_xor_sync(0xffffffffu, square, offset);
        if (lane == 0) squares[conv * 4 + c / 32] = square;
      }
    }
    if (tid == 0) beta_s = sigmoid(in.beta_raw);
    const float out_gate = sigmoid(in.out_gate);
    __syncthreads();

    const float4 ks = decay_rows_partial_sk(s, decay_s, x_s[1], rg);
    *reinterpret_cast<float4*>(&partial[rg * kPartialStride + cgi * 4]) = ks;
    __syncthreads();
    const auto column_sum = [&]() {
      const float* x = &partial[quarter * kPartialStride + column];
      float sum = (x[0] + x[4 * kPartialStride]) + (x[8 * kPartialStride] + x[12 * kPartialStride]);
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      return sum + __shfl_xor_sync(0xffffffffu, sum, 2);
    };
    {
      const float sk = column_sum();
      const float inverse_k = rsqrtf(squares[4] + squares[5] + squares[6] + squares[7] + kL2Eps);
      if (quarter == 0) u_s[column] = inverse_k * (beta_s * (x_s[2][column] - inverse_k * sk));
    }
    __syncthreads();
    const float4 u = *reinterpret_cast<const float4*>(&u_s[cgi * 4]);
    const float4 o = update_rows_partial_o<true>(s, u, x_s[1], x_s[0], rg, state);
    *reinterpret_cast<float4*>(&partial[rg * kPartialStride + cgi * 4]) = o;
    // This item's rows are stored: its registers take the item 2 G ahead.
    load_state(later, later_slot, s);
    load_inputs(later, later_slot, in);
    const float inverse_q =
        rsqrtf(static_cast<float>(kD)) * rsqrtf(squares[0] + squares[1] + squares[2] + squares[3] + kL2Eps);
    __syncthreads();
    const float o_col = inverse_q * column_sum();
    float square = quarter == 0 ? o_col * o_col : 0.0f;
    for (int offset = 16; offset >= 4; offset >>= 1) square += __shfl_xor_sync(0xffffffffu, square, offset);
    if (lane == 0) o_squares[warp] = square;
    __syncthreads();
    if (quarter == 0) {
      float total = 0.0f;
#pragma unroll
      for (int i = 0; i < 16; ++i) total += o_squares[i];
      const float inverse_rms = rsqrtf(total / static_cast<float>(kD) + p.rms_eps);
      p.out[out_at + column] = __float2bfloat16(o_col * inverse_rms * norm_weight * out_gate);
    }
  };

  for (int item = first; item < num_items; item += 2 * stride) {
    run_item(item, s_even, in_even);
    if (item + stride < num_items) run_item(item + stride, s_odd, in_odd);
  }
}

constexpr KdaDecodeKernel kBuiltInDefault = KdaDecodeKernel::kCols1;
constexpr KdaDecodeKernel kKernels[] = {KdaDecodeKernel::kV1, KdaDecodeKernel::kCols1, KdaDecodeKernel::kPipe2};

// DELTASERVE_KDA_DECODE, read once per process: kDefault when unset or empty; `valid` false for an unknown name.
struct EnvironmentKernel {
  KdaDecodeKernel kernel = KdaDecodeKernel::kDefault;
  bool valid = true;
  std::string value;
};

const EnvironmentKernel& environment_kernel() {
  static const EnvironmentKernel parsed = [] {
    EnvironmentKernel result;
    const char* value = std::getenv("DELTASERVE_KDA_DECODE");
    if (value == nullptr || *value == '\0') return result;
    result.value = value;
    result.valid = false;
    for (const KdaDecodeKernel kernel : kKernels) {
      if (std::strcmp(value, kda_decode_kernel_name(kernel)) == 0) {
        result.kernel = kernel;
        result.valid = true;
      }
    }
    return result;
  }();
  return parsed;
}

Status cuda_status(cudaError_t error, const char* who) {
  if (error == cudaSuccess) return Status::ok();
  (void)cudaGetLastError();  // the error is not sticky; clear it so launch_status of later calls is clean
  return internal_error(std::string(who) + ": " + cudaGetErrorName(error) + " (" + cudaGetErrorString(error) + ")");
}

// Launch configuration with programmatic dependent launch (cols1, pipe2); `attribute` must outlive the launch.
cudaLaunchConfig_t dependent_launch_config(dim3 grid, cudaStream_t stream, cudaLaunchAttribute* attribute) {
  *attribute = {};
  attribute->id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute->val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  config.attrs = attribute;
  config.numAttrs = 1;
  return config;
}

Status launch_cols1(const DecodeArgs& args, const KdaDecodeParams& p, cudaStream_t stream) {
  cudaLaunchAttribute attribute;
  const cudaLaunchConfig_t config = dependent_launch_config(
      dim3(static_cast<unsigned>(p.num_heads), static_cast<unsigned>(p.batch)), stream, &attribute);
  const int early = p.early_state_loads ? 1 : 0;
  DS_RETURN_IF_ERROR(cuda_status(cudaLaunchKernelEx(&config, kda_decode_cols1_kernel, args, early),
                                 "kda_decode_step (cols1): launch"));
  return launch_status("kda_decode_step (cols1)");
}

// pipe2 indexes items b H + h, and the items 2 G ahead of them, with int.
constexpr int64_t kPipe2MaxItems = int64_t{1} << 30;

// pipe2's CTAs per SM: 512 threads at up to 128 registers fill the register file (ptxas: 125 registers).
constexpr int kPipe2CtasPerSm = 1;

// pipe2's grid: as few CTAs as finish the items in the same number of rounds as one CTA per resident slot would
// (B = 64, H = 32 on 132 SMs: 2048 items in 16 rounds of 128 CTAs, not 15.5 rounds of 132), so that every CTA has
// the same number of items (or one less) and the memory-bound SMs finish together. Only attribute queries, which
// are allowed while a stream is being captured.
Status pipe2_grid(int64_t items, int* grid) {
  int device = 0, sms = 0;
  DS_RETURN_IF_ERROR(cuda_status(cudaGetDevice(&device), "kda_decode_step (pipe2): cudaGetDevice"));
  DS_RETURN_IF_ERROR(cuda_status(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
                                 "kda_decode_step (pipe2): multiprocessor count"));
  const int64_t resident = static_cast<int64_t>(sms) * kPipe2CtasPerSm;
  const int64_t rounds = (items + resident - 1) / resident;
  *grid = static_cast<int>((items + rounds - 1) / rounds);
  return Status::ok();
}

Status launch_pipe2(const DecodeArgs& args, const KdaDecodeParams& p, cudaStream_t stream) {
  const int64_t items = static_cast<int64_t>(p.batch) * p.num_heads;
  if (items > kPipe2MaxItems) {
    return unimplemented("kda_decode_step (pipe2): batch x num_heads must be <= 2^30, got " + std::to_string(items));
  }
  int grid = 0;
  DS_RETURN_IF_ERROR(pipe2_grid(items, &grid));
  cudaLaunchAttribute attribute;
  const cudaLaunchConfig_t config = dependent_launch_config(dim3(static_cast<unsigned>(grid)), stream, &attribute);
  const int early = p.early_state_loads ? 1 : 0;
  DS_RETURN_IF_ERROR(
      cuda_status(cudaLaunchKernelEx(&config, kda_decode_pipe2_kernel, args, static_cast<int>(items), early),
                  "kda_decode_step (pipe2): launch"));
  return launch_status("kda_decode_step (pipe2)");
}

}  // namespace

const char* kda_decode_kernel_name(KdaDecodeKernel kernel) {
  switch (kernel) {
    case KdaDecodeKernel::kDefault:
      return "default";
    case KdaDecodeKernel::kV1:
      return "v1";
    case KdaDecodeKernel::kCols1:
      return "cols1";
    case KdaDecodeKernel::kPipe2:
      return "pipe2";
  }
  return "unknown";
}

Status kda_decode_step(const KdaDecodeParams& p, cudaStream_t stream) {
  DS_RETURN_IF_ERROR(validate_decode_params(p, "kda_decode_step"));
  KdaDecodeKernel kernel = p.kernel;
  if (std::find(std::begin(kKernels), std::end(kKernels), kernel) == std::end(kKernels) &&
      kernel != KdaDecodeKernel::kDefault) {
    return invalid_argument("kda_decode_step: unknown kernel " + std::to_string(static_cast<int>(kernel)));
  }
  if (kernel == KdaDecodeKernel::kDefault) {
    const EnvironmentKernel& environment = environment_kernel();
    if (!environment.valid) {
      return invalid_argument("kda_decode_step: DELTASERVE_KDA_DECODE must be v1, cols1 or pipe2, got '" +
                              environment.value + "'");
    }
    kernel = environment.kernel == KdaDecodeKernel::kDefault ? kBuiltInDefault : environment.kernel;
  }
  if (p.batch == 0) return Status::ok();
  const DecodeArgs args = make_decode_args(p);
  if (kernel == KdaDecodeKernel::kCols1) return launch_cols1(args, p, stream);
  if (kernel == KdaDecodeKernel::kPipe2) return launch_pipe2(args, p, stream);
  kda_decode_kernel<<<dim3(static_cast<unsigned>(p.num_heads), static_cast<unsigned>(p.batch)), kThreads, 0, stream>>>(
      args);
  return launch_status("kda_decode_step");
}

}  // namespace deltaserve::kernels::cuda
