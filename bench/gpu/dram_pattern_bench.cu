// Streams a large buffer into shared memory the way the small-batch MoE kernels do (one producer thread a CTA
// issuing bulk copies of weight rows into a ring of stages, a consumer warp releasing each stage when it lands) and
// prints the bandwidth of each address pattern next to the device-to-device copy bandwidth measured in the same run.
// Questions it answered on the H200 (bench/results/kernels_gpu.jsonl, dram_pattern records):
//   * do CTAs that copy the rows of 32 KB-aligned tiles in the same order at the same time (launch 3's down stages)
//     queue on the same memory channels, where rows copied in an order rotated by the CTA would not? No: the rotated
//     order streams at less than half the in-order rate;
//   * is the rate of 2 KB copies from one issuing thread the limit (the same tiles as one 32 KB copy, or from three
//     CTAs an SM, stream at the copy bandwidth)? The lane-issue patterns copy a stage's rows from 16 lanes at once.
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -I. bench/gpu/dram_pattern_bench.cu -o /tmp/dram
//   /tmp/dram            (JSON lines on stdout)
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include <cuda_runtime.h>

#include "bench/gpu/cuda_check.hpp"
#include "kernels/cuda/common/detail/bf16_stream.cuh"
#include "kernels/cuda/common/detail/mma_sm80.cuh"
#include "kernels/cuda/common/detail/sm90_ptx.cuh"

namespace {

namespace detail = deltaserve::kernels::cuda::detail;
namespace sm90 = deltaserve::kernels::cuda::sm90;

constexpr int kMaxStages = 8;

struct Pattern {
  const char* name;
  int rows;             // rows a stage (a tile)
  int row_bytes;        // bytes a row copy
  int64_t row_stride;   // bytes between a tile's rows in global memory
  int64_t tile_stride;  // bytes between tiles
  int halves;  // tiles t and t + 1 of a pair: the same rows, bytes [h * row_bytes, +row_bytes) of each (gate/up)
  int rotate;  // 1: CTA c copies rows c % rows, c % rows + 1, ... (mod rows)
  int stages;
  int ctas_per_sm;
  int lane_issue;  // 1: lane i of the producer warp issues row i of a stage (rows <= 32)
};

// Grid-stride over tiles: CTA c takes tiles c, c + grid, ... of `tiles`.
__global__ void stream_kernel(const char* src, int64_t tiles, Pattern p, unsigned* sink) {
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t base = detail::smem_address(smem);
  const uint32_t barriers = base;  // full[kMaxStages], empty[kMaxStages]
  const uint32_t ring = base + 16 * kMaxStages;
  const int stage_bytes = p.rows * p.row_bytes;
  if (threadIdx.x == 0) {
    for (int s = 0; s < p.stages; ++s) {
      sm90::mbarrier_init(barriers + 8 * s, 1);
      sm90::mbarrier_init(barriers + 8 * (kMaxStages + s), 1);
    }
    sm90::mbarrier_init_fence();
  }
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  int stage = 0;
  uint32_t phase = 0;
  if (warp == 0) {
    if (!p.lane_issue && lane != 0) return;
    const uint64_t policy = detail::l2_evict_first_policy();
    const int first = p.lane_issue ? lane : 0, step = p.lane_issue ? 32 : 1;
    for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
      const uint32_t full = barriers + 8 * stage;
      sm90::mbarrier_wait(barriers + 8 * (kMaxStages + stage), phase ^ 1u);
      if (lane == 0) sm90::mbarrier_arrive_expect_tx(full, static_cast<uint32_t>(stage_bytes));
      __syncwarp(p.lane_issue ? 0xffffffffu : 1u);
      const uint32_t dst = ring + static_cast<uint32_t>(stage * stage_bytes);
      for (int i = first; i < p.rows; i += step) {
        const int m = p.rotate ? (i + static_cast<int>(blockIdx.x % p.rows)) % p.rows : i;
        const int64_t offset = (t / p.halves) * p.tile_stride + (t % p.halves) * p.row_bytes + m * p.row_stride;
        detail::bulk_copy_to_shared(dst + m * p.row_bytes, src + offset, static_cast<uint32_t>(p.row_bytes), full,
                                    policy);
      }
      if (++stage == p.stages) stage = 0, phase ^= 1u;
    }
  } else if (warp == 1) {
    unsigned acc = 0;
    for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
      sm90::mbarrier_wait(barriers + 8 * stage, phase);
      acc += reinterpret_cast<const unsigned*>(smem + 16 * kMaxStages + stage * stage_bytes)[lane];
      __syncwarp();
      if (lane == 0) sm90::mbarrier_arrive(barriers + 8 * (kMaxStages + stage));
      if (++stage == p.stages) stage = 0, phase ^= 1u;
    }
    if (acc == 0x12345678u) sink[blockIdx.x] = acc;  // keeps the reads
  }
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main() {
  int sms = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  constexpr int64_t kBytes = int64_t{2} << 30;  // 2 GiB streamed per pass
  char* src = nullptr;
  char* dst = nullptr;
  unsigned* sink = nullptr;
  CHECK_CUDA(cudaMalloc(&src, kBytes));
  CHECK_CUDA(cudaMalloc(&dst, kBytes));
  CHECK_CUDA(cudaMalloc(&sink, 4096 * sizeof(unsigned)));
  CHECK_CUDA(cudaMemset(src, 1, kBytes));
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  auto time_ms = [&](auto&& body) {
    std::vector<double> runs;
    for (int r = 0; r < 7; ++r) {
      CHECK_CUDA(cudaEventRecord(start));
      body();
      CHECK_CUDA(cudaEventRecord(stop));
      CHECK_CUDA(cudaEventSynchronize(stop));
      float ms = 0.0f;
      CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
      if (r > 0) runs.push_back(ms);
    }
    return median(runs);
  };
  // The copy limit: read + write of kBytes / 2.
  const double copy_ms = time_ms([&] { CHECK_CUDA(cudaMemcpy(dst, src, kBytes / 2, cudaMemcpyDeviceToDevice)); });
  const double copy_bw = 2.0 * (kBytes / 2) / (copy_ms * 1e-3);
  std::printf("{\"pattern\": \"device copy\", \"bandwidth_TBps\": %.3f}\n", copy_bw / 1e12);

  const Pattern patterns[] = {
      // launch 3's down stages: 16 rows of 2 KB, tiles 32 KB apart (contiguous), in order / rotated
      {"down: 16 x 2 KB rows, contiguous 32 KB tiles, in order", 16, 2048, 2048, 32768, 1, 0, 4, 1, 0},
      {"down: 16 x 2 KB rows, contiguous 32 KB tiles, rotated", 16, 2048, 2048, 32768, 1, 1, 4, 1, 0},
      {"down, 3 CTAs an SM x 2 stages, in order", 16, 2048, 2048, 32768, 1, 0, 2, 3, 0},
      {"down, 3 CTAs an SM x 2 stages, rotated", 16, 2048, 2048, 32768, 1, 1, 2, 3, 0},
      // launch 2's gate/up stages: 16 rows of 4608 B (hidden 2304), half a row (2304 B) a copy, the two halves in
      // consecutive stages
      {"gate/up: 16 half rows of 2304 B (rows 4608 B apart), in order", 16, 2304, 4608, 73728, 2, 0, 4, 1, 0},
      {"gate/up: 16 half rows of 2304 B (rows 4608 B apart), rotated", 16, 2304, 4608, 73728, 2, 1, 4, 1, 0},
      // the same 32 KB tiles as one 32 KB copy each
      {"down: one 32 KB copy a tile", 1, 32768, 32768, 32768, 1, 0, 4, 1, 0},
      // 8 KB rows (o_proj's width in bf16), 4 rows a stage
      {"8 KB rows, 4 a stage, contiguous, in order", 4, 8192, 8192, 32768, 1, 0, 4, 1, 0},
      {"8 KB rows, 4 a stage, contiguous, rotated", 4, 8192, 8192, 32768, 1, 1, 4, 1, 0},
      // the same with the 16 rows issued by 16 lanes at once
      {"down: 16 x 2 KB rows, in order, 16 lanes issue", 16, 2048, 2048, 32768, 1, 0, 4, 1, 1},
      {"gate/up: 16 half rows of 2304 B, in order, 16 lanes issue", 16, 2304, 4608, 73728, 2, 0, 4, 1, 1},
      // launch 3 as it runs at hidden 2304, inter 1024 (split, 74 KB a CTA): 16 half rows of 1 KB (rows 2 KB apart),
      // three CTAs an SM x 4 stages; one lane / 16 lanes issue; and whole 2 KB rows in 2 stages
      {"down as launched: 16 x 1 KB half rows, 3 CTAs an SM x 4 stages", 16, 1024, 2048, 32768, 2, 0, 4, 3, 0},
      {"down as launched, 16 lanes issue", 16, 1024, 2048, 32768, 2, 0, 4, 3, 1},
      {"down, 3 CTAs an SM x 2 stages, 16 lanes issue", 16, 2048, 2048, 32768, 1, 0, 2, 3, 1},
      // two CTAs an SM (288 CTAs over 132 SMs leave most SMs two)
      {"down as launched, 2 CTAs an SM", 16, 1024, 2048, 32768, 2, 0, 4, 2, 0},
      {"down as launched, 2 CTAs an SM, 16 lanes issue", 16, 1024, 2048, 32768, 2, 0, 4, 2, 1},
      {"down, 2 CTAs an SM x 2 stages of 2 KB rows", 16, 2048, 2048, 32768, 1, 0, 2, 2, 0},
  };
  for (const Pattern& p : patterns) {
    const int64_t tiles = (kBytes - 2 * p.tile_stride) / p.tile_stride * p.halves;
    const int64_t bytes = tiles * p.rows * int64_t{p.row_bytes};
    const size_t smem = 16 * kMaxStages + static_cast<size_t>(p.stages) * p.rows * p.row_bytes;
    CHECK_CUDA(
        cudaFuncSetAttribute(stream_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    const int grid = sms * p.ctas_per_sm;
    const double ms = time_ms([&] { stream_kernel<<<grid, 64, smem>>>(src, tiles, p, sink); });
    CHECK_CUDA(cudaGetLastError());
    const double bw = bytes / (ms * 1e-3);
    std::printf(
        "{\"pattern\": \"%s\", \"ctas\": %d, \"stages\": %d, \"stage_KB\": %.1f, \"bandwidth_TBps\": %.3f, "
        "\"of_copy\": %.3f}\n",
        p.name, grid, p.stages, p.rows * p.row_bytes / 1024.0, bw / 1e12, bw / copy_bw);
  }
  CHECK_CUDA(cudaDeviceSynchronize());
  return 0;
}
