// Fused KDA decode step for sm_90a (contract in kda.hpp). One CTA of 512 threads per (batch row, head): the
// state's loads (64 KiB, 8 x 16 bytes per thread, streaming) are issued first, the short conv, L2 norms and gate
// run while they land, then S^T k, u, the update and o = S^T q reduce over 16 row groups in shared memory, and the
// gated RMSNorm of o finishes in the same CTA. Each byte of state is read once and written once.
//
// v2 (only with DELTASERVE_KDA_DECODE=v2: measured slower, see bench/gpu/NOTES.md): the same per-(row, head)
// arithmetic in a persistent CTA that
// walks items blockIdx.x, blockIdx.x + gridDim.x, ... (two CTAs per SM). The state of an item arrives in a 64 KiB
// shared-memory buffer through cp.async.bulk (TMA, completion on an mbarrier); as soon as every thread holds its
// 8 float4 in registers, thread 0 issues the bulk load of the CTA's next item into the same buffer, so state loads
// stay in flight while the current item reduces and stores (v1 leaves the memory system idle while both resident
// CTAs compute). On the H200 it took 92 us at B=64 and 359 us at B=256 against v1's 84 and 331 (20-layer graphs),
// so v1 stays the default. DELTASERVE_KDA_DECODE=v1 / v2 picks a variant (read at every call).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
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

// ---- v2: persistent CTAs, next item's state prefetched by TMA bulk copies ----------------------------------
constexpr uint32_t kStateBytes = kD * kD * sizeof(float);  // 64 KiB per (slot, head)
constexpr uint32_t kBulkPieces = 4;                        // 16 KiB per cp.async.bulk

__device__ __forceinline__ uint32_t shared_address(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

__device__ __forceinline__ void mbarrier_init(uint64_t* barrier, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(shared_address(barrier)), "r"(count) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// Thread 0 only: one arrival that expects kStateBytes, then the bulk copies that complete them.
__device__ __forceinline__ void issue_state_load(uint64_t* barrier, float* buffer, const float* source) {
  const uint32_t bar = shared_address(barrier);
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // earlier generic reads of the buffer come first
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(kStateBytes) : "memory");
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  constexpr uint32_t piece = kStateBytes / kBulkPieces;
#pragma unroll
  for (uint32_t i = 0; i < kBulkPieces; ++i) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], "
        "%4;" ::"r"(shared_address(buffer) + i * piece),
        "l"(reinterpret_cast<const char*>(source) + i * piece), "r"(piece), "r"(bar), "l"(policy)
        : "memory");
  }
}

__device__ __forceinline__ void mbarrier_wait(uint64_t* barrier, uint32_t parity) {
  const uint32_t bar = shared_address(barrier);
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n .reg .pred ready;\n mbarrier.try_wait.parity.shared::cta.b64 ready, [%1], %2;\n selp.u32 %0, 1, 0, "
        "ready;\n}"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  }
}

__device__ __forceinline__ bool item_slot(const DecodeArgs& p, int item, int* slot) {
  *slot = p.slots[item / p.num_heads];
  return *slot >= 0 && *slot < p.num_slots;
}

__global__ void __launch_bounds__(kThreads, 2) kda_decode_kernel_v2(DecodeArgs p, int items) {
  extern __shared__ __align__(128) float buffer[];  // [kD][kD] state of the current item
  __shared__ float x_s[3][kD];
  __shared__ float decay_s[kD], u_s[kD];
  __shared__ __align__(16) float partial[kRowGroups][kD];
  __shared__ float sums[16];
  __shared__ __align__(8) uint64_t barrier;
  const int H = p.num_heads, C = H * kD, K = p.conv_kernel;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int cgi = tid & 31, rg = tid >> 5;
  const int which = tid >> 7, c = tid & (kD - 1);
  if (tid == 0) {
    mbarrier_init(&barrier, 1);
    int slot;
    const int first = static_cast<int>(blockIdx.x);
    if (first < items && item_slot(p, first, &slot)) {
      issue_state_load(&barrier, buffer, p.state + (static_cast<size_t>(slot) * H + first % H) * kD * kD);
    }
  }
  __syncthreads();
  uint32_t parity = 0;
  for (int item = static_cast<int>(blockIdx.x); item < items; item += static_cast<int>(gridDim.x)) {
    const int b = item / H, h = item - b * H;
    const size_t row = static_cast<size_t>(b) * C;
    int slot;
    const bool valid = item_slot(p, item, &slot);  // uniform over the CTA
    const int channel = h * kD + c;
    // Conv + gate first (x_s and decay_s are free: the previous item's last reads of them precede its final
    // barrier), then this item's state from the buffer.
    float4 s[8];
    if (valid) {
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
        const float x = __bfloat162float(p.gate_raw[row + channel]) + p.dt_bias[channel];
        const float a = __expf(p.a_log[h]);
        const float g = p.bounded ? p.lower_bound * sigmoid(a * x) : -a * (x > 20.0f ? x : log1pf(__expf(x)));
        decay_s[c] = __expf(g);
      }
      mbarrier_wait(&barrier, parity);
      parity ^= 1u;
#pragma unroll
      for (int i = 0; i < 8; ++i) s[i] = *reinterpret_cast<const float4*>(&buffer[(rg * 8 + i) * kD + cgi * 4]);
    }
    __syncthreads();  // the buffer is read (free for the next item); x_s, decay_s written
    if (tid == 0) {
      const int next = item + static_cast<int>(gridDim.x);
      int next_slot;
      if (next < items && item_slot(p, next, &next_slot)) {
        issue_state_load(&barrier, buffer, p.state + (static_cast<size_t>(next_slot) * H + next % H) * kD * kD);
      }
    }
    if (!valid) {
      if (tid < kD) p.out[row + h * kD + tid] = __float2bfloat16(0.0f);
      continue;
    }
    float* state = p.state + ((static_cast<size_t>(slot) * H + h) * kD) * kD + cgi * 4;
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
    __syncthreads();  // after this, x_s / decay_s / u_s are no longer read for this item
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
}

// Which kernel a call runs: v1 unless DELTASERVE_KDA_DECODE=v2 (v2 measured slower at every batch size).
enum class Variant { kAuto, kV1, kV2 };

Status cuda_status(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return Status::ok();
  return internal_error(std::string(what) + ": " + cudaGetErrorName(error) + " (" + cudaGetErrorString(error) + ")");
}

Variant requested_variant() {
  const char* value = std::getenv("DELTASERVE_KDA_DECODE");
  if (value == nullptr) return Variant::kAuto;
  if (std::strcmp(value, "v1") == 0) return Variant::kV1;
  if (std::strcmp(value, "v2") == 0) return Variant::kV2;
  return Variant::kAuto;
}

}  // namespace

Status kda_decode_step(const KdaDecodeParams& p, cudaStream_t stream) {
  DS_RETURN_IF_ERROR(validate_decode_params(p, "kda_decode_step"));
  if (p.batch == 0) return Status::ok();
  const DecodeArgs args = make_decode_args(p);
  // v2 indexes items (row, head) with int: beyond 2^30 of them (never in practice) v1 runs.
  const int64_t items64 = static_cast<int64_t>(p.batch) * p.num_heads;
  const int items = static_cast<int>(std::min<int64_t>(items64, int64_t{1} << 30));
  const Variant variant = requested_variant();
  if (variant == Variant::kV2 && items64 <= (int64_t{1} << 30)) {
    // Persistent grid: as many CTAs as fit at once (2 per SM), at most one per item.
    int device = 0, sms = 0, per_sm = 0;
    DS_RETURN_IF_ERROR(cuda_status(cudaGetDevice(&device), "kda_decode_step: cudaGetDevice"));
    DS_RETURN_IF_ERROR(cuda_status(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
                                   "kda_decode_step: multiprocessor count"));
    DS_RETURN_IF_ERROR(cuda_status(
        cudaFuncSetAttribute(kda_decode_kernel_v2, cudaFuncAttributeMaxDynamicSharedMemorySize, kStateBytes),
        "kda_decode_step: dynamic shared memory"));
    DS_RETURN_IF_ERROR(
        cuda_status(cudaFuncSetAttribute(kda_decode_kernel_v2, cudaFuncAttributePreferredSharedMemoryCarveout,
                                         cudaSharedmemCarveoutMaxShared),
                    "kda_decode_step: carveout"));
    DS_RETURN_IF_ERROR(
        cuda_status(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kda_decode_kernel_v2, kThreads, kStateBytes),
                    "kda_decode_step: occupancy"));
    if (per_sm < 1) return internal_error("kda_decode_step: the v2 kernel does not fit on an SM");
    const int blocks = std::min(items, sms * per_sm);
    kda_decode_kernel_v2<<<static_cast<unsigned>(blocks), kThreads, kStateBytes, stream>>>(args, items);
    return launch_status("kda_decode_step (v2)");
  }
  kda_decode_kernel<<<dim3(static_cast<unsigned>(p.num_heads), static_cast<unsigned>(p.batch)), kThreads, 0, stream>>>(
      args);
  const cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) {
    return internal_error(std::string("kda_decode_step: launch: ") + cudaGetErrorName(error) + " (" +
                          cudaGetErrorString(error) + ")");
  }
  return Status::ok();
}

}  // namespace deltaserve::kernels::cuda
