// A chain of dependent batch-1 GEMVs (x_{s+1} = bf16(W_s x_s), the shapes of o_proj and a KDA projection
// alternating: 2304 -> 4096 -> 2304 ...) run three ways, next to the device-to-device copy bandwidth measured in the
// same run (the third, chain_ring_kernel, is described above it):
//   * launches: one skinny_gemm launch per step (the engine's kernel and its programmatic dependent launch), the
//     chain captured in a CUDA graph;
//   * persistent: one launch, one CTA per SM, for the whole chain. A producer warp streams the CTA's weight rows of
//     every step, in order, through a ring of shared-memory stages (bulk copies); eight consumer warps multiply them
//     with x. Between steps the consumers wait on a grid-wide counter (the previous step's outputs), but the producer
//     does not: it runs on into the next steps' rows as ring slots free up, so the weight stream does not stop at a
//     step boundary; and the same kernel with the producer waiting on the counter too (persistence without it).
// The question it answers: how much of a decode step's latency between dependent kernels does a producer that runs
// ahead across a grid-wide dependency remove, on the simplest chain (bench/gpu/engine_notes.md, eighth session:
// the case for fewer, longer-lived kernels). Correctness: every variant against a CPU reference of the first two
// steps (double sums, bf16 rounding between steps, 2^-7 relative), then the variants' final outputs against each other.
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Xcudafe=--diag_suppress=2810 -I. \
//       bench/gpu/gemv_chain_bench.cu kernels/cuda/small_batch_gemm.cu -o /tmp/gemv_chain
//   /tmp/gemv_chain [--steps N]      (JSON lines on stdout, one per variant)
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "bench/gpu/cuda_check.hpp"
#include "kernels/cuda/bf16_stream.cuh"
#include "kernels/cuda/mma_sm80.cuh"
#include "kernels/cuda/sm90_ptx.cuh"
#include "kernels/cuda/small_batch.hpp"

namespace {

namespace kc = deltaserve::kernels::cuda;
namespace detail = deltaserve::kernels::cuda::detail;
namespace sm90 = deltaserve::kernels::cuda::sm90;

constexpr int kMaxSteps = 128;
constexpr int kConsumerWarps = 8;
constexpr int kThreads = 32 * (kConsumerWarps + 1);  // + the producer warp
constexpr int kStageRows = kConsumerWarps;           // a row per consumer warp
constexpr int kMaxIn = 4096;
constexpr int kStages = 3;  // 3 x 8 rows x 8 KB + x (8 KB) = 200 KB of shared memory
constexpr uint32_t kSlotBytes = kStageRows * kMaxIn * 2;
constexpr uint32_t kRingOffset = 1024;  // barriers first
constexpr uint32_t kXOffset = kRingOffset + kStages * kSlotBytes;
constexpr uint32_t kSmemBytes = kXOffset + kMaxIn * 2;

struct Chain {
  int steps;
  int in[kMaxSteps], n[kMaxSteps];
  const __nv_bfloat16* w[kMaxSteps];  // [n, in]
  __nv_bfloat16* x[kMaxSteps + 1];    // x[0] the input, x[s + 1] step s's output
};

__device__ __forceinline__ uint32_t full_barrier(uint32_t base, int slot) {
  return base + 8u * static_cast<uint32_t>(slot);
}
__device__ __forceinline__ uint32_t empty_barrier(uint32_t base, int slot) {
  return base + 8u * static_cast<uint32_t>(kStages + slot);
}

// Rows [begin, end) of step s for this CTA: an even share of n.
__device__ __forceinline__ void step_rows(const Chain& c, int s, int& begin, int& end) {
  begin = static_cast<int>(static_cast<int64_t>(c.n[s]) * blockIdx.x / gridDim.x);
  end = static_cast<int>(static_cast<int64_t>(c.n[s]) * (blockIdx.x + 1) / gridDim.x);
}

// Until every CTA has finished step s - 1 (the counter counts CTA-steps). One thread; traps after 10 s.
__device__ __forceinline__ void wait_for_step(const unsigned* counter, int s) {
  const unsigned target = static_cast<unsigned>(s) * gridDim.x;
  const uint64_t start = sm90::globaltimer_ns();
  for (;;) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(counter) : "memory");
    if (v >= target) return;
    if (sm90::globaltimer_ns() - start > sm90::kMbarrierTimeoutNs) __trap();
  }
}

__device__ __forceinline__ void consumer_sync() {
  asm volatile("bar.sync 1, %0;" ::"n"(32 * kConsumerWarps) : "memory");
}

__global__ void __launch_bounds__(kThreads, 1)
    chain_kernel(const __grid_constant__ Chain c, unsigned* counter, int mode) {
  // mode 0: the producer waits at each step too; 1: it runs ahead; 2: nobody waits (timing only: the consumers read
  // inputs that may not be written yet, so the results are wrong; what the design streams without the dependency).
  const bool run_ahead = mode >= 1, consumers_wait = mode <= 1;
  extern __shared__ __align__(1024) unsigned char smem[];
  const uint32_t base = detail::smem_address(smem);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (tid == 0) {
    for (int k = 0; k < kStages; ++k) {
      sm90::mbarrier_init(full_barrier(base, k), 1);
      sm90::mbarrier_init(empty_barrier(base, k), kConsumerWarps);
    }
    sm90::mbarrier_init_fence();
  }
  __syncthreads();

  if (warp == kConsumerWarps) {  // the producer: every step's rows in order, through the ring
    const uint64_t policy = detail::l2_evict_first_policy();
    int fill = 0;
    for (int s = 0; s < c.steps; ++s) {
      if (!run_ahead && s > 0) {
        if (lane == 0) wait_for_step(counter, s);
        __syncwarp();
      }
      int begin, end;
      step_rows(c, s, begin, end);
      const uint32_t row_bytes = static_cast<uint32_t>(c.in[s]) * 2u;
      for (int r0 = begin; r0 < end; r0 += kStageRows, ++fill) {
        const int slot = fill % kStages;
        const uint32_t phase = static_cast<uint32_t>(fill / kStages) & 1u;
        const int rows = min(kStageRows, end - r0);
        sm90::mbarrier_wait(empty_barrier(base, slot), phase ^ 1u);
        if (lane == 0)
          sm90::mbarrier_arrive_expect_tx(full_barrier(base, slot), static_cast<uint32_t>(rows) * row_bytes);
        __syncwarp();
        if (lane < rows) {
          detail::bulk_copy_to_shared(base + kRingOffset + static_cast<uint32_t>(slot) * kSlotBytes + lane * row_bytes,
                                      c.w[s] + static_cast<int64_t>(r0 + lane) * c.in[s], row_bytes,
                                      full_barrier(base, slot), policy);
        }
      }
    }
    return;
  }

  // Consumers: per step, wait for its input, stage it, then a row per warp per stage.
  const uint4* x_s = reinterpret_cast<const uint4*>(smem + kXOffset);
  int fill = 0;
  for (int s = 0; s < c.steps; ++s) {
    if (s > 0 && consumers_wait) {
      if (tid == 0) wait_for_step(counter, s);
      consumer_sync();
    }
    const int chunks = c.in[s] / 8;
    for (int i = tid; i < chunks; i += 32 * kConsumerWarps) {
      reinterpret_cast<uint4*>(smem + kXOffset)[i] = __ldcg(reinterpret_cast<const uint4*>(c.x[s]) + i);
    }
    consumer_sync();
    int begin, end;
    step_rows(c, s, begin, end);
    for (int r0 = begin; r0 < end; r0 += kStageRows, ++fill) {
      const int slot = fill % kStages;
      const uint32_t phase = static_cast<uint32_t>(fill / kStages) & 1u;
      sm90::mbarrier_wait(full_barrier(base, slot), phase);
      const int row = r0 + warp;
      if (row < end) {
        const uint4* w = reinterpret_cast<const uint4*>(smem + kRingOffset + slot * kSlotBytes) + warp * chunks;
        float acc = 0.0f;
        for (int k = lane; k < chunks; k += 32) acc = detail::dot8_bf16(w[k], x_s[k], acc);
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, offset);
        if (lane == 0) c.x[s + 1][row] = __float2bfloat16_rn(acc);  // published by the step's fence below
      }
      __syncwarp();
      if (lane == 0) sm90::mbarrier_arrive(empty_barrier(base, slot));
    }
    // Every row of this CTA written (and x_s read by all). The barrier orders the other warps' row stores before
    // thread 0's fence, which is cumulative: once the counter shows this CTA, every row of it is visible.
    consumer_sync();
    if (tid == 0) {
      __threadfence();
      atomicAdd(counter, 1u);
    }
  }
}

// ---- persistent, every warp its own cp.async ring ---------------------------------------------------------------
// The same chain with the streaming of the skinny GEMM instead of one producer warp's bulk copies (which the ninth
// session's run measured at 0.68-0.71 of copy even without the dependency, 8 bulk copies a stage from one warp):
// one CTA of 8 warps per SM; global warp g takes rows g, g + W, ... of every step (W warps in all); each warp keeps
// its next kRingRows rows (of this step and the next ones: the sequence runs on across the steps) in flight with
// 16-byte cp.async from all 32 lanes into its own slots, lane l copying and later reading only chunks l, l + 32,
// ..., so a lane's cp.async.wait_group is all it needs before reading. Per step the CTA waits for the grid-wide
// counter, stages x in shared memory, multiplies each of its rows as it lands, then publishes. While a CTA waits,
// its warps' next rows (most of the next step's bytes: ~140 KB an SM a step against 192 KB of slots) stream on.
constexpr int kRingWarps = 8;
constexpr int kRingThreads = 32 * kRingWarps;
constexpr int kRingRows = 3;                                               // row slots per warp
constexpr uint32_t kRingRowBytes = kMaxIn * 2;                             // 8 KB a slot
constexpr uint32_t kRingXOffset = kRingWarps * kRingRows * kRingRowBytes;  // 192 KB of slots, then x
constexpr uint32_t kRingSmemBytes = kRingXOffset + kMaxIn * 2;

// Rows of step s that global warp g of W takes.
__device__ __forceinline__ int ring_rows(const Chain& c, int s, int g, int warps) {
  return g < c.n[s] ? (c.n[s] - 1 - g) / warps + 1 : 0;
}

__global__ void __launch_bounds__(kRingThreads, 1)
    chain_ring_kernel(const __grid_constant__ Chain c, unsigned* counter, int mode) {
  // mode 1: the consumers wait for each step's input; 2: nobody waits (timing only: wrong results).
  extern __shared__ __align__(1024) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int warps = static_cast<int>(gridDim.x) * kRingWarps, g = static_cast<int>(blockIdx.x) * kRingWarps + warp;
  unsigned char* slots = smem + static_cast<uint32_t>(warp) * kRingRows * kRingRowBytes;
  const uint4* x_s = reinterpret_cast<const uint4*>(smem + kRingXOffset);

  // The issue cursor walks this warp's rows of every step in order; each issue is one commit group (an empty one
  // past the last row), so "the oldest kRingRows groups" always means "the next row to multiply".
  int issue_step = 0, issue_index = 0, issue_slot = 0;
  auto issue_next = [&]() {
    while (issue_step < c.steps && issue_index >= ring_rows(c, issue_step, g, warps)) {
      ++issue_step;
      issue_index = 0;
    }
    if (issue_step < c.steps) {
      const int row = g + issue_index * warps;
      const int chunks = c.in[issue_step] / 8;
      const uint4* src = reinterpret_cast<const uint4*>(c.w[issue_step] + static_cast<int64_t>(row) * c.in[issue_step]);
      uint4* dst = reinterpret_cast<uint4*>(slots + static_cast<uint32_t>(issue_slot) * kRingRowBytes);
      for (int k = lane; k < chunks; k += 32) detail::cp_async16(dst + k, src + k);
      ++issue_index;
    }
    detail::cp_async_commit();
    issue_slot = issue_slot + 1 == kRingRows ? 0 : issue_slot + 1;
  };
  for (int k = 0; k < kRingRows; ++k) issue_next();

  int slot = 0;
  for (int s = 0; s < c.steps; ++s) {
    if (s > 0 && mode == 1) {
      if (tid == 0) wait_for_step(counter, s);
      __syncthreads();
    }
    const int chunks = c.in[s] / 8;
    for (int i = tid; i < chunks; i += kRingThreads) {
      reinterpret_cast<uint4*>(smem + kRingXOffset)[i] = __ldcg(reinterpret_cast<const uint4*>(c.x[s]) + i);
    }
    __syncthreads();
    const int rows = ring_rows(c, s, g, warps);
    for (int i = 0; i < rows; ++i) {
      detail::cp_async_wait<kRingRows - 1>();  // this lane's copies of the oldest row have landed
      const uint4* w = reinterpret_cast<const uint4*>(slots + static_cast<uint32_t>(slot) * kRingRowBytes);
      float acc = 0.0f;
      for (int k = lane; k < chunks; k += 32) acc = detail::dot8_bf16(w[k], x_s[k], acc);
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, offset);
      if (lane == 0) c.x[s + 1][g + i * warps] = __float2bfloat16_rn(acc);  // published by the step's fence below
      issue_next();  // into the slot just read: each lane overwrites only the chunks it read itself
      slot = slot + 1 == kRingRows ? 0 : slot + 1;
    }
    // Every row of this CTA written and x_s read by all before thread 0's cumulative fence and the count.
    __syncthreads();
    if (tid == 0) {
      __threadfence();
      atomicAdd(counter, 1u);
    }
  }
  detail::cp_async_wait<0>();
}

// ---- host -------------------------------------------------------------------------------------------------------

std::vector<__nv_bfloat16> random_bf16(size_t n, float scale, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<__nv_bfloat16> v(n);
  for (auto& e : v) e = __float2bfloat16(dist(rng));
  return v;
}

float to_float(__nv_bfloat16 v) {
  return __bfloat162float(v);
}

double copy_bandwidth() {
  const size_t bytes = size_t{1} << 30;
  void *a = nullptr, *b = nullptr;
  CHECK_CUDA(cudaMalloc(&a, bytes));
  CHECK_CUDA(cudaMalloc(&b, bytes));
  CHECK_CUDA(cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice));
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));
  CHECK_CUDA(cudaEventRecord(e0));
  for (int i = 0; i < 10; ++i) CHECK_CUDA(cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice));
  CHECK_CUDA(cudaEventRecord(e1));
  CHECK_CUDA(cudaEventSynchronize(e1));
  float ms = 0.0f;
  CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
  CHECK_CUDA(cudaFree(a));
  CHECK_CUDA(cudaFree(b));
  return 2.0 * 10.0 * static_cast<double>(bytes) / (1e-3 * ms);  // read + write
}

struct Device {
  Chain c{};
  std::vector<__nv_bfloat16*> buffers;
  unsigned* counter = nullptr;
  double weight_bytes = 0.0;
};

Device make_device(int steps, const std::vector<std::vector<__nv_bfloat16>>& w, const std::vector<__nv_bfloat16>& x0) {
  Device d;
  d.c.steps = steps;
  for (int s = 0; s < steps; ++s) {
    d.c.in[s] = s % 2 == 0 ? 2304 : 4096;
    d.c.n[s] = s % 2 == 0 ? 4096 : 2304;
    __nv_bfloat16* p = nullptr;
    CHECK_CUDA(cudaMalloc(&p, w[s].size() * 2));
    CHECK_CUDA(cudaMemcpy(p, w[s].data(), w[s].size() * 2, cudaMemcpyHostToDevice));
    d.c.w[s] = p;
    d.buffers.push_back(p);
    d.weight_bytes += static_cast<double>(w[s].size()) * 2.0;
  }
  for (int s = 0; s <= steps; ++s) {
    __nv_bfloat16* p = nullptr;
    CHECK_CUDA(cudaMalloc(&p, kMaxIn * 2));
    CHECK_CUDA(cudaMemset(p, 0xff, kMaxIn * 2));  // NaN: a row never written shows
    d.c.x[s] = p;
    d.buffers.push_back(p);
  }
  CHECK_CUDA(cudaMemcpy(d.c.x[0], x0.data(), x0.size() * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMalloc(&d.counter, sizeof(unsigned)));
  return d;
}

void free_device(Device& d) {
  for (auto* p : d.buffers) CHECK_CUDA(cudaFree(p));
  CHECK_CUDA(cudaFree(d.counter));
}

void run_launches(const Device& d, cudaStream_t stream) {
  for (int s = 0; s < d.c.steps; ++s) {
    kc::SkinnyGemmParams p;
    p.x = d.c.x[s];
    p.x_stride = d.c.in[s];
    p.rows = 1;
    p.in = d.c.in[s];
    p.outputs[0] = {d.c.w[s], d.c.n[s], d.c.x[s + 1], d.c.n[s]};
    p.num_outputs = 1;
    p.y_bf16 = true;
    CHECK_STATUS(kc::skinny_gemm(p, stream));
  }
}

void run_persistent(const Device& d, int mode, cudaStream_t stream) {
  int sms = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  CHECK_CUDA(cudaMemsetAsync(d.counter, 0, sizeof(unsigned), stream));
  void* args[] = {const_cast<Chain*>(&d.c), const_cast<unsigned**>(&d.counter), &mode};
  // Cooperative: every CTA resident at once (the grid-wide counter waits on all of them).
  CHECK_CUDA(cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(chain_kernel), dim3(sms), dim3(kThreads), args,
                                         kSmemBytes, stream));
}

// mode 1: consumers wait for each step; 2: nobody waits (timing only).
void run_ring(const Device& d, int mode, cudaStream_t stream) {
  int sms = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  CHECK_CUDA(cudaMemsetAsync(d.counter, 0, sizeof(unsigned), stream));
  void* args[] = {const_cast<Chain*>(&d.c), const_cast<unsigned**>(&d.counter), &mode};
  CHECK_CUDA(cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(chain_ring_kernel), dim3(sms),
                                         dim3(kRingThreads), args, kRingSmemBytes, stream));
}

std::vector<float> download(const __nv_bfloat16* p, int n) {
  std::vector<__nv_bfloat16> h(n);
  CHECK_CUDA(cudaMemcpy(h.data(), p, n * 2, cudaMemcpyDeviceToHost));
  std::vector<float> f(n);
  for (int i = 0; i < n; ++i) f[i] = to_float(h[i]);
  return f;
}

// The CPU chain's first `steps` outputs (double sums, bf16 rounding between steps).
std::vector<float> cpu_chain(int steps, const std::vector<std::vector<__nv_bfloat16>>& w,
                             const std::vector<__nv_bfloat16>& x0) {
  std::vector<float> x(x0.size());
  for (size_t i = 0; i < x0.size(); ++i) x[i] = to_float(x0[i]);
  for (int s = 0; s < steps; ++s) {
    const int in = s % 2 == 0 ? 2304 : 4096, n = s % 2 == 0 ? 4096 : 2304;
    std::vector<float> y(n);
    for (int r = 0; r < n; ++r) {
      double sum = 0.0;
      for (int k = 0; k < in; ++k) sum += static_cast<double>(to_float(w[s][static_cast<size_t>(r) * in + k])) * x[k];
      y[r] = to_float(__float2bfloat16(static_cast<float>(sum)));
    }
    x = y;
  }
  return x;
}

// Largest |a - b| / (|b| + 2^-7 rms(b)) over the elements: bf16 rounding of two sums of different order can differ
// by one ulp (2^-8 relative) at the last step and by a little more once it propagates through a step.
double max_rel(const std::vector<float>& a, const std::vector<float>& b) {
  double sq = 0.0;
  for (float v : b) sq += static_cast<double>(v) * v;
  const double floor_ = std::ldexp(std::sqrt(sq / static_cast<double>(b.size())), -7);
  double worst = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double err = std::fabs(static_cast<double>(a[i]) - b[i]) / (std::fabs(static_cast<double>(b[i])) + floor_);
    worst = std::isnan(err) ? INFINITY : std::max(worst, err);
  }
  return worst;
}

}  // namespace

int main(int argc, char** argv) {
  int steps = 52;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--steps") == 0 && i + 1 < argc) {
      steps = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: gemv_chain [--steps N (2..%d, even)]\n", kMaxSteps);
      return 2;
    }
  }
  if (steps < 2 || steps > kMaxSteps || steps % 2 != 0) {
    std::fprintf(stderr, "gemv_chain: --steps must be an even number in [2, %d]\n", kMaxSteps);
    return 2;
  }
  CHECK_CUDA(cudaFuncSetAttribute(reinterpret_cast<const void*>(chain_kernel),
                                  cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSmemBytes)));
  CHECK_CUDA(cudaFuncSetAttribute(reinterpret_cast<const void*>(chain_ring_kernel),
                                  cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kRingSmemBytes)));
  std::vector<std::vector<__nv_bfloat16>> w(steps);
  for (int s = 0; s < steps; ++s) {
    const int in = s % 2 == 0 ? 2304 : 4096, n = s % 2 == 0 ? 4096 : 2304;
    w[s] = random_bf16(static_cast<size_t>(n) * in, 1.0f / std::sqrt(static_cast<float>(in)), 100 + s);
  }
  const std::vector<__nv_bfloat16> x0 = random_bf16(2304, 1.0f, 7);
  cudaStream_t stream = nullptr;
  CHECK_CUDA(cudaStreamCreate(&stream));
  Device d = make_device(steps, w, x0);

  // Correctness: the first two steps of each variant against the CPU.
  const std::vector<float> reference = cpu_chain(2, w, x0);
  Device two = d;
  two.c.steps = 2;
  bool ok = true;
  for (int variant = 0; variant < 4; ++variant) {
    CHECK_CUDA(cudaMemset(d.c.x[2], 0xff, kMaxIn * 2));
    if (variant == 0) run_launches(two, stream);
    if (variant == 1 || variant == 2) run_persistent(two, variant == 1 ? 1 : 0, stream);
    if (variant == 3) run_ring(two, 1, stream);
    CHECK_CUDA(cudaStreamSynchronize(stream));
    const double err = max_rel(download(d.c.x[2], 2304), reference);
    const char* name = variant == 0   ? "launches"
                       : variant == 1 ? "persistent"
                       : variant == 2 ? "persistent, no run-ahead"
                                      : "persistent, cp.async ring per warp";
    std::fprintf(stderr, "gemv_chain: %s, two steps against the CPU: max relative error %.3g\n", name, err);
    if (!(err <= 0.02)) ok = false;
  }
  if (!ok) {
    std::fprintf(stderr, "gemv_chain: a variant disagrees with the CPU reference\n");
    return 1;
  }

  // Timing: the launches as a CUDA graph, the persistent kernel as one cooperative launch, each 20 times.
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  run_launches(d, stream);
  CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
  CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));
  const double bandwidth = copy_bandwidth();
  const double floor_us = 1e6 * d.weight_bytes / bandwidth;
  const char* names[] = {"launches (skinny_gemm, PDL, graph)",
                         "persistent (producer runs ahead)",
                         "persistent (producer waits at each step)",
                         "persistent without the dependency (timing only)",
                         "persistent, cp.async ring per warp (runs ahead)",
                         "persistent, cp.async ring per warp, without the dependency (timing only)"};
  constexpr int kVariants = 6;
  std::vector<float> finals[kVariants];
  for (int variant = 0; variant < kVariants; ++variant) {
    constexpr int kRuns = 20;
    std::vector<float> times;
    for (int run = 0; run < kRuns + 3; ++run) {
      CHECK_CUDA(cudaEventRecord(e0, stream));
      if (variant == 0) {
        CHECK_CUDA(cudaGraphLaunch(exec, stream));
      } else if (variant <= 3) {
        run_persistent(d, variant == 1 ? 1 : variant == 2 ? 0 : 2, stream);
      } else {
        run_ring(d, variant == 4 ? 1 : 2, stream);
      }
      CHECK_CUDA(cudaEventRecord(e1, stream));
      CHECK_CUDA(cudaEventSynchronize(e1));
      float ms = 0.0f;
      CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
      if (run >= 3) times.push_back(1e3f * ms);
    }
    std::sort(times.begin(), times.end());
    const double median = times[times.size() / 2];
    finals[variant] = download(d.c.x[steps], 2304);  // an even number of steps ends at width 2304
    const char* name = names[variant];
    std::printf(
        "{\"bench\": \"gemv_chain\", \"case\": \"%d steps 2304->4096->2304...,batch 1,%s\", \"metric\": \"time\", "
        "\"value\": %.2f, \"unit\": \"us\", \"limit\": %.2f, \"ratio_to_limit\": %.4f, \"per_step_us\": %.3f, "
        "\"weight_bytes\": %.0f, \"copy_bytes_per_s\": %.4g}\n",
        steps, name, median, floor_us, floor_us / median, median / steps, d.weight_bytes, bandwidth);
  }
  // After many steps the two summation orders' bf16 roundings have spread through every element, so the final
  // outputs are compared as vectors (|a - b| / |b|; ~2^-8 a step adds up to a few percent over 52 steps).
  for (int variant : {1, 2, 4}) {
    double diff = 0.0, norm = 0.0;
    for (size_t i = 0; i < finals[0].size(); ++i) {
      const double dv = static_cast<double>(finals[variant][i]) - finals[0][i];
      diff += dv * dv;
      norm += static_cast<double>(finals[0][i]) * finals[0][i];
    }
    std::fprintf(stderr, "gemv_chain: final outputs, %s against launches: relative difference %.3g (of the norm)\n",
                 names[variant], std::sqrt(diff / norm));
  }
  CHECK_CUDA(cudaGraphExecDestroy(exec));
  CHECK_CUDA(cudaGraphDestroy(graph));
  free_device(d);
  CHECK_CUDA(cudaStreamDestroy(stream));
  return 0;
}
