#!/usr/bin/env python3
"""Per-stage timeline of the small-batch MoE layer's down launch (v2's launch 3): a tool for the GPU machine.

Nsight Compute puts most of the down launch's stall samples on its consumers' wait for a stage's full barrier
(bench/gpu/down_profile.sh), and neither deeper rings nor an even share of the work per CTA made it faster
(bench/gpu/engine_notes.md, eighth session). This shows when each stage's bulk copies are issued and when they land,
per CTA, inside the whole layer replayed in a CUDA graph.

Copies the tracked tree of SRC to DST and patches the copy so that every down CTA stamps %globaltimer into a device
buffer of [CTA][2][32] slots: row 0 (producer) the time each fill's copies were issued (slots 0-27), the CTA's start
(28) and the return of its wait for launch 2 (29); row 1 (consumer warp 0) the time each fill's full barrier
completed (0-27), the tables in shared memory (28) and every ys row written (29). MoeDecodeLayerGpu.Timing then
replays the layer at T = 1, 2, 4 in a graph four times each and prints, per fill index, the median and maximum over
the CTAs of the issue time, the arrival time (us from launch 3's first CTA) and the latency between them, and the
spread of the CTAs' start, wait and finish.

    python3 bench/gpu/moe_down_trace.py . /tmp/down-trace
    cmake -S /tmp/down-trace -B build/down-trace -G Ninja -DDELTASERVE_ENGINE_ONLY=ON -DDELTASERVE_CUDA=ON \\
        -DCMAKE_BUILD_TYPE=Release -DDELTASERVE_BENCH=OFF
    cmake --build build/down-trace --target kernels_cuda_test
    build/down-trace/kernels/cuda/kernels_cuda_test --gtest_filter=MoeDecodeLayerGpu.Timing | grep "down trace"

Each stamp is one plain store from one thread (no atomics), so the timing moves little; compare variants within one
patched build. Each patch names the source text it attaches to; when the kernels change, the tool stops with the
anchor it missed.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tree_patch import copy_and_patch, patch_timing_test  # noqa: E402

SLOTS = 32  # per CTA and row; fills 0-27, then the named points

HELPERS = r'''
__device__ __forceinline__ void down_trace_stamp(unsigned long long* trace, int row, int slot) {
  if (trace == nullptr || slot >= 32) return;
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  trace[(static_cast<long long>(blockIdx.x) * 2 + row) * 32 + slot] = t;
}
'''

PATCHES = {
    "kernels/cuda/moe/detail/small_batch.cuh": [
        ("  int lane_issue, down_min_stages;\n", "  int lane_issue, down_min_stages;\n  unsigned long long* down_trace;\n"),
        ("// ---- launch 1: router partial sums and the plan", HELPERS + "\n// ---- launch 1: router partial sums and the plan"),
    ],
    "kernels/cuda/moe/small_batch.cu": [
        ("namespace deltaserve::kernels::cuda {\nnamespace {\n",
         "namespace deltaserve::kernels::cuda {\nstatic unsigned long long* g_down_trace = nullptr;\n"
         "void moe_down_trace_set(unsigned long long* p) { g_down_trace = p; }\nnamespace {\n"),
        ("LayerArgs make_args(const MoeSmallBatchParams& p, MoeSmallBatchKernel kernel) {\n  LayerArgs a{};\n",
         "LayerArgs make_args(const MoeSmallBatchParams& p, MoeSmallBatchKernel kernel) {\n  LayerArgs a{};\n"
         "  a.down_trace = g_down_trace;\n"),
    ],
    "kernels/cuda/moe/small_batch_pipeline.cu": [
        # the down kernel's start
        ("  if (threadIdx.x == 0) init_pipeline_barriers(base, p.pipe.stages);\n  zero_shared(smem, p.pipe.zero_row",
         "  if (threadIdx.x == 0) down_trace_stamp(p.a.down_trace, 0, 28);\n"
         "  if (threadIdx.x == 0) init_pipeline_barriers(base, p.pipe.stages);\n  zero_shared(smem, p.pipe.zero_row"),
        # producer: each fill's copies issued
        ("    if (lane == 0) sm90::mbarrier_arrive_expect_tx(full, static_cast<uint32_t>(rows + fill.count) * fill.bytes);\n",
         "    if (lane == 0) sm90::mbarrier_arrive_expect_tx(full, static_cast<uint32_t>(rows + fill.count) * fill.bytes);\n"
         "    if (lane == 0) down_trace_stamp(a.down_trace, 0, f);\n"),
        # producer: launch 2 complete (both places the wait happens)
        ("      wait_for_activations();\n      if (lane == 0) {\n        for (int g = 0; g < pipe.stages; ++g)",
         "      wait_for_activations();\n      if (lane == 0) down_trace_stamp(a.down_trace, 0, 29);\n"
         "      if (lane == 0) {\n        for (int g = 0; g < pipe.stages; ++g)"),
        ("  if (!waited) {\n    wait_for_activations();\n",
         "  if (!waited) {\n    wait_for_activations();\n    if (lane == 0) down_trace_stamp(a.down_trace, 0, 29);\n"),
        # consumer: tables, each fill's arrival, ys complete
        ("  sm90::mbarrier_wait(tables_barrier(base), 0);\n  const DownShare share",
         "  sm90::mbarrier_wait(tables_barrier(base), 0);\n  if (tid == 0) down_trace_stamp(a.down_trace, 1, 28);\n"
         "  int trace_fill = 0;\n  const DownShare share"),
        ("      sm90::mbarrier_wait(full_barrier(base, ring.stage), ring.phase);\n"
         "      const uint32_t stage = stage_address(base, pipe, ring.stage);\n      const uint32_t b_row = n < count",
         "      sm90::mbarrier_wait(full_barrier(base, ring.stage), ring.phase);\n"
         "      if (tid == 0) down_trace_stamp(a.down_trace, 1, trace_fill);\n      ++trace_fill;\n"
         "      const uint32_t stage = stage_address(base, pipe, ring.stage);\n      const uint32_t b_row = n < count"),
        ("  consumer_barrier();  // every ys row written (and the weights and positions, long since)\n",
         "  consumer_barrier();  // every ys row written (and the weights and positions, long since)\n"
         "  if (tid == 0) down_trace_stamp(a.down_trace, 1, 29);\n"),
    ],
}

TEST_PRINT = r'''
    {
      d.p.kernel = MoeSmallBatchKernel::kV2;
      const int ctas = static_cast<int>((c.hidden + 15) / 16) * 2;  // the split launch's count at most
      const size_t slots = static_cast<size_t>(ctas) * 2 * 32;
      unsigned long long* trace = nullptr;
      DS_CUDA_OK(cudaMalloc(&trace, slots * sizeof(unsigned long long)));
      moe_down_trace_set(trace);
      cudaGraphExec_t exec = nullptr;
      ASSERT_NO_FATAL_FAILURE(capture_graph(stream, cudaStreamCaptureModeThreadLocal,
                                            [&](cudaStream_t s) { return moe_small_batch_layer(d.p, s); }, &exec));
      moe_down_trace_set(nullptr);
      std::vector<unsigned long long> h(slots);
      for (int rep = 0; rep < 4; ++rep) {
        DS_CUDA_OK(cudaMemset(trace, 0, slots * sizeof(unsigned long long)));
        DS_CUDA_OK(cudaGraphLaunch(exec, stream));
        DS_CUDA_OK(cudaStreamSynchronize(stream));
        DS_CUDA_OK(cudaMemcpy(h.data(), trace, slots * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
        auto at = [&](int cta, int row, int slot) { return h[(static_cast<size_t>(cta) * 2 + row) * 32 + slot]; };
        int used = 0;
        unsigned long long t0 = ~0ull;
        for (int cta = 0; cta < ctas; ++cta) {
          if (at(cta, 0, 28) == 0) continue;
          ++used;
          t0 = std::min(t0, at(cta, 0, 28));
        }
        auto us = [&](unsigned long long t) { return 1e-3 * static_cast<double>(static_cast<long long>(t - t0)); };
        // Median and maximum over the CTAs that stamped both ends of a value.
        auto summary = [&](auto value) {
          std::vector<double> v;
          for (int cta = 0; cta < used; ++cta) {
            double x = 0.0;
            if (value(cta, &x)) v.push_back(x);
          }
          if (v.empty()) return std::string("-");
          std::sort(v.begin(), v.end());
          char text[64];
          std::snprintf(text, sizeof(text), "%.2f/%.2f", v[v.size() / 2], v.back());
          return std::string(text);
        };
        auto point = [&](int row, int slot) {
          return summary([&, row, slot](int cta, double* x) {
            if (at(cta, row, slot) == 0) return false;
            *x = us(at(cta, row, slot));
            return true;
          });
        };
        std::printf("[ down trace T=%lld rep %d ] %d CTAs; median/max us from the first CTA's start: start %s, "
                    "tables %s, launch 2 waited %s, ys done %s\n",
                    static_cast<long long>(T), rep, used, point(0, 28).c_str(), point(1, 28).c_str(),
                    point(0, 29).c_str(), point(1, 29).c_str());
        for (int f = 0; f < 28; ++f) {
          const std::string issued = point(0, f), landed = point(1, f);
          if (issued == "-" && landed == "-") break;
          const std::string latency = summary([&, f](int cta, double* x) {
            if (at(cta, 0, f) == 0 || at(cta, 1, f) == 0) return false;
            *x = 1e-3 * static_cast<double>(static_cast<long long>(at(cta, 1, f) - at(cta, 0, f)));
            return true;
          });
          std::printf("[ down trace T=%lld rep %d ]   fill %2d: issued %s, landed %s, latency %s\n",
                      static_cast<long long>(T), rep, f, issued.c_str(), landed.c_str(), latency.c_str());
        }
      }
      cudaGraphExecDestroy(exec);
      cudaFree(trace);
    }
'''


def patch_test(text):
    return patch_timing_test(text, "namespace deltaserve::kernels::cuda { void moe_down_trace_set(unsigned long long* p); }\n",
                             TEST_PRINT, "moe_down_trace")


def main():
    copy_and_patch(sys.argv[1:], PATCHES, patch_test, __doc__, "moe_down_trace")


if __name__ == "__main__":
    main()
