// Fused KDA decode step for sm_90a (contract in kda.hpp). Two kernels, picked by KdaDecodeParams::kernel:
//
// v1: one CTA of 512 threads per (batch row, head): the state's loads (64 KiB, 8 x 16 bytes per thread,
// streaming) are issued first, the short conv, L2 norms and gate run while they land, then S^T k, u, the update
// and o = S^T q reduce over 16 row groups in shared memory, and the gated RMSNorm of o finishes in the same CTA.
// Each byte of state is read once and written once. Two CTAs per SM start, compute and store in lockstep, so the
// memory system idles while both reduce (bench/gpu/NOTES.md): 75 % of copy bandwidth in state bytes at B = 64.
//
// cols<S> (S = 1, 2, 4): the delta rule is independent per value column (column j of S needs k, q, g, beta, v[j]
// and its own (S^T k)[j]), so the head's 128 columns are split over S CTAs of 512 / S threads, each owning
// 128 / S columns (64 / S KiB of state, still 8 rows x 4 columns per thread) with 2 S CTAs per SM, which drift out
// of phase. Each CTA recomputes the small prologue (q and k conv + SiLU over all 128 channels, the gate, v over its
// own columns); the L2 norms become scalars folded into u and o, which leaves five barriers instead of seven.
// The S CTAs of a (row, head) form a thread block cluster: the output RMSNorm needs the sum of o^2 over all 128
// columns, exchanged through distributed shared memory, and the cluster barrier that completes that exchange also
// orders the conv-tail writes after every CTA's reads (see kda_decode_cols_kernel). Launched with programmatic
// dependent launch, so a layer's CTAs become resident while the previous kernel drains.
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

// Programmatic dependent launch (sm_90): wait until the grid before this one on the stream has finished and its
// writes are visible / let the grid after this one become resident. Both are no-ops without the launch attribute.
__device__ __forceinline__ void wait_for_previous_grid() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}
__device__ __forceinline__ void allow_next_grid() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// Halves of the cluster barrier (every thread of every CTA of the cluster executes each, in the order arrive,
// wait, arrive, wait). Arrive with release / relaxed order; wait with acquire.
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_arrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// Stores `value` at the address of `local` in the shared memory of the cluster's CTA `rank` (which may be this one).
__device__ __forceinline__ void store_shared_cluster(float* local, unsigned rank, float value) {
  const auto address = static_cast<unsigned>(__cvta_generic_to_shared(local));
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(address), "r"(rank));
  asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(remote), "f"(value) : "memory");
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

// One CTA of 512 / kSlices threads per (batch row, head, column slice); grid (H * kSlices, B), clusters of kSlices
// CTAs along x, so the cluster rank is the slice. The CTA owns value columns [slice * kV, slice * kV + kV) of the
// head: thread (rg, cgi) holds columns 4 cgi .. 4 cgi + 3 of those for state rows 8 rg .. 8 rg + 7. Sums over the
// 16 row groups run on 4 threads per column (4 partials each, then 2 shuffles), so every thread takes part.
//
// Conv tails are updated in place and every CTA of a cluster reads the old q and k tails of all 128 channels, so
// a CTA may not write a q/k tail while another CTA of its cluster may still read it. Each CTA keeps its new q/k
// tails in shared memory and writes only those of its own column range, after the cluster barrier that completes
// the o^2 exchange: every CTA arrives at that barrier (release) after its prologue read the old tails, and the
// writer's wait (acquire) follows, so no read can observe a new value; each tail element has exactly one writer.
// The v tails of a column are read and written by the column's own CTA only, right away. The barrier's first half
// (a relaxed arrive at the start, the wait before the exchange) makes sure every CTA of the cluster has started
// before any writes into its shared memory; after the second barrier no CTA touches another's shared memory, so
// each may exit. The release of that barrier waits for this thread's outstanding global writes (a GPU-scope
// fence), so with a cluster the state is stored after it, not before.
template <int kSlices>
__global__ void __launch_bounds__(kThreads / kSlices, 2 * kSlices)
    kda_decode_cols_kernel(DecodeArgs p, int early_state_loads) {
  constexpr int kT = kThreads / kSlices;  // threads
  constexpr int kV = kD / kSlices;        // value columns of this CTA
  constexpr int kGroups = kV / 4;         // float4 column groups per state row
  static_assert(kT / kGroups == kRowGroups && kT == 4 * kV, "16 row groups of 8 rows; 4 threads per column");
  constexpr int kTasks = 3 * kD + kV;     // prologue: 128 q, 128 k, 128 gate rows, kV v channels
  constexpr int kPartialStride = kV + 8;  // the 4 threads of a column read rows q, q + 4, ...: 4 distinct banks
  __shared__ float x_s[2][kD];            // q, k after conv + SiLU, not normalised (the norms are folded in below)
  __shared__ float v_s[kV], decay_s[kD];
  __shared__ __align__(16) float u_s[kV];
  __shared__ float tail_s[2][3][kD];  // new q, k conv tails [which][tap][channel]
  __shared__ __align__(16) float partial[kRowGroups * kPartialStride];
  __shared__ float squares[8];     // sums of squares of q (0..3) and k (4..7) over 32 channels each
  __shared__ float o_squares[16];  // sum of o^2 over the head's columns 8 i .. 8 i + 7, filled across the cluster
  __shared__ float beta_s;
  const int h = blockIdx.x / kSlices, slice = blockIdx.x % kSlices, b = blockIdx.y;
  const int H = p.num_heads, C = H * kD, K = p.conv_kernel;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int first_column = slice * kV;
  const size_t row = static_cast<size_t>(b) * C;

  if (!early_state_loads) wait_for_previous_grid();
  const int slot = p.slots[b];
  const bool skipped = slot < 0 || slot >= p.num_slots;
  const int cgi = tid % kGroups, rg = tid / kGroups;
  float* state = p.state + ((static_cast<size_t>(skipped ? 0 : slot) * H + h) * kD) * kD + first_column + cgi * 4;
  float4 s[8];
  if (!skipped) {
#pragma unroll
    for (int i = 0; i < 8; ++i) s[i] = __ldcs(reinterpret_cast<const float4*>(state + (rg * 8 + i) * kD));
  }
  // Inputs, tails and outputs only after the previous grid is done; dependents may start once every CTA of this
  // grid got here (so they, too, wait for this grid's predecessor before anything they read).
  wait_for_previous_grid();
  allow_next_grid();
  if (skipped) {  // uniform over the cluster (same row)
    if (tid < kV) p.out[row + h * kD + first_column + tid] = __float2bfloat16(0.0f);
    return;
  }
  if constexpr (kSlices > 1) cluster_arrive_relaxed();

  // Prologue: task = (which, channel), which = 0 q, 1 k, 2 gate, 3 v (own columns only). A warp's 32 tasks share
  // `which`, so the q and k warps also reduce their sums of squares right away.
  constexpr int kRounds = (kTasks + kT - 1) / kT;
#pragma unroll
  for (int round = 0; round < kRounds; ++round) {
    const int task = tid + round * kT;
    const int which = task / kD, c = task % kD;
    if (which < 2) {
      const int channel = h * kD + c;
      const float* tail = p.conv_state + ((static_cast<size_t>(slot) * 3 + which) * C + channel) * (K - 1);
      const float* weight = (which == 0 ? p.q_conv_weight : p.k_conv_weight) + static_cast<size_t>(channel) * K;
      const bf16* input = which == 0 ? p.q_in : p.k_in;
      float next[3];
      const float x = conv_channel(weight, tail, K, __bfloat162float(input[row + channel]), next);
      x_s[which][c] = x;
#pragma unroll
      for (int j = 0; j < 3; ++j) tail_s[which][j][c] = next[j];
      float square = x * x;
      for (int offset = 16; offset > 0; offset >>= 1) square += __shfl_xor_sync(0xffffffffu, square, offset);
      if (lane == 0) squares[which * 4 + c / 32] = square;
    } else if (which == 2) {
      // Gate: decay = e^g.
      const int channel = h * kD + c;
      const float x = __bfloat162float(p.gate_raw[row + channel]) + p.dt_bias[channel];
      const float a = __expf(p.a_log[h]);
      const float g = p.bounded ? p.lower_bound * sigmoid(a * x) : -a * (x > 20.0f ? x : log1pf(__expf(x)));
      decay_s[c] = __expf(g);
    } else if (task < kTasks) {
      const int channel = h * kD + first_column + c;
      float* tail = p.conv_state + ((static_cast<size_t>(slot) * 3 + 2) * C + channel) * (K - 1);
      float next[3];
      v_s[c] = conv_channel(p.v_conv_weight + static_cast<size_t>(channel) * K, tail, K,
                            __bfloat162float(p.v_in[row + channel]), next);
#pragma unroll
      for (int j = 0; j < 3; ++j) {
        if (j < K - 1) tail[j] = next[j];
      }
    }
  }
  if (tid == 0) beta_s = sigmoid(__bfloat162float(p.beta_raw[static_cast<size_t>(b) * H + h]));
  __syncthreads();

  // S = Diag(e^g) S and the partial S^T k with k not yet normalised.
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
    if (quarter == 0) u_s[column] = inverse_k * (beta_s * (v_s[column] - inverse_k * sk));
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
    if constexpr (kSlices == 1) __stcs(reinterpret_cast<float4*>(state + r * kD), s[i]);
  }
  *reinterpret_cast<float4*>(&partial[rg * kPartialStride + cgi * 4]) = o;
  __syncthreads();
  // o = S^T q with q = q_raw d^-1/2 / |q_raw|; its squares per 8 columns go to every CTA of the cluster.
  if constexpr (kSlices > 1) cluster_wait();  // every CTA of the cluster has started
  const float inverse_q =
      rsqrtf(static_cast<float>(kD)) * rsqrtf(squares[0] + squares[1] + squares[2] + squares[3] + kL2Eps);
  const float o_col = inverse_q * column_sum();
  float square = quarter == 0 ? o_col * o_col : 0.0f;
  for (int offset = 16; offset >= 4; offset >>= 1) square += __shfl_xor_sync(0xffffffffu, square, offset);
  if (lane == 0) {
    const int group = first_column / 8 + warp;
    if constexpr (kSlices == 1) {
      o_squares[group] = square;
    } else {
#pragma unroll
      for (int rank = 0; rank < kSlices; ++rank) store_shared_cluster(&o_squares[group], rank, square);
    }
  }
  if constexpr (kSlices > 1) {
    cluster_arrive();
    cluster_wait();
#pragma unroll
    for (int i = 0; i < 8; ++i) __stcs(reinterpret_cast<float4*>(state + (rg * 8 + i) * kD), s[i]);
  } else {
    __syncthreads();
  }
  // Gated RMSNorm of o over the head's 128 columns (same sum order in every CTA of the cluster).
  if (quarter == 0) {
    float total = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; ++i) total += o_squares[i];
    const float inverse_rms = rsqrtf(total / static_cast<float>(kD) + p.rms_eps);
    const int channel = first_column + column;
    const float gate = sigmoid(__bfloat162float(p.out_gate[row + h * kD + channel]));
    p.out[row + h * kD + channel] = __float2bfloat16(o_col * inverse_rms * p.o_norm_weight[channel] * gate);
  }
  // New q and k tails of this CTA's channels (see above for why only now).
  const int taps = K - 1;
  for (int e = tid; e < kV * taps; e += kT) {
    const int c = first_column + e / taps, j = e % taps;
#pragma unroll
    for (int which = 0; which < 2; ++which) {
      p.conv_state[((static_cast<size_t>(slot) * 3 + which) * C + h * kD + c) * taps + j] = tail_s[which][j][c];
    }
  }
}

constexpr KdaDecodeKernel kBuiltInDefault = KdaDecodeKernel::kV1;
constexpr KdaDecodeKernel kKernels[] = {KdaDecodeKernel::kV1, KdaDecodeKernel::kCols1, KdaDecodeKernel::kCols2,
                                        KdaDecodeKernel::kCols4};

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
  (void)cudaGetLastError();  // the launch error is not sticky; clear it so launch_status of later calls is clean
  return internal_error(std::string(who) + ": launch: " + cudaGetErrorName(error) + " (" + cudaGetErrorString(error) +
                        ")");
}

template <int kSlices>
Status launch_cols(const DecodeArgs& args, const KdaDecodeParams& p, cudaStream_t stream) {
  cudaLaunchAttribute attributes[2] = {};
  attributes[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attributes[0].val.programmaticStreamSerializationAllowed = 1;
  attributes[1].id = cudaLaunchAttributeClusterDimension;
  attributes[1].val.clusterDim.x = kSlices;
  attributes[1].val.clusterDim.y = 1;
  attributes[1].val.clusterDim.z = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(p.num_heads * kSlices), static_cast<unsigned>(p.batch));
  config.blockDim = dim3(kThreads / kSlices);
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  config.attrs = attributes;
  config.numAttrs = kSlices > 1 ? 2 : 1;
  const int early = p.early_state_loads ? 1 : 0;
  DS_RETURN_IF_ERROR(
      cuda_status(cudaLaunchKernelEx(&config, kda_decode_cols_kernel<kSlices>, args, early), "kda_decode_step (cols)"));
  return launch_status("kda_decode_step (cols)");
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
    case KdaDecodeKernel::kCols2:
      return "cols2";
    case KdaDecodeKernel::kCols4:
      return "cols4";
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
      return invalid_argument("kda_decode_step: DELTASERVE_KDA_DECODE must be v1, cols1, cols2 or cols4, got '" +
                              environment.value + "'");
    }
    kernel = environment.kernel == KdaDecodeKernel::kDefault ? kBuiltInDefault : environment.kernel;
  }
  if (p.batch == 0) return Status::ok();
  const DecodeArgs args = make_decode_args(p);
  switch (kernel) {
    case KdaDecodeKernel::kCols1:
      return launch_cols<1>(args, p, stream);
    case KdaDecodeKernel::kCols2:
      return launch_cols<2>(args, p, stream);
    case KdaDecodeKernel::kCols4:
      return launch_cols<4>(args, p, stream);
    default:  // kV1
      break;
  }
  kda_decode_kernel<<<dim3(static_cast<unsigned>(p.num_heads), static_cast<unsigned>(p.batch)), kThreads, 0, stream>>>(
      args);
  return launch_status("kda_decode_step");
}

}  // namespace deltaserve::kernels::cuda
