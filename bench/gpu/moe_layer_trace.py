#!/usr/bin/env python3
"""Timeline of one small-batch MoE layer (v2) from in-kernel timestamps: a tool for the GPU machine.

Copies the tracked tree of SRC to DST and patches the copy so that the three launches of
kernels/cuda/moe_small_batch*.cu stamp %globaltimer at fixed points (atomicMin for "first", atomicMax for "last"
over the CTAs) into a 32-slot device buffer, and so that MoeDecodeLayerGpu.Timing, after its graph replays of each
token count, replays one layer alone in a graph four times and prints the stamps in microseconds from launch 1's
first CTA, then the same for launch 1 alone (moe_small_batch_route in a graph). The last router CTA also stamps
clock64() when it is known, after its fence, after each phase of the CTA-wide routing and when the plan is done: the
tool prints those SM cycles from "known", and the SM clock in GHz while it routes.

    python3 bench/gpu/moe_layer_trace.py . /tmp/trace-tree
    cmake -S /tmp/trace-tree -B build/trace -G Ninja -DDELTASERVE_ENGINE_ONLY=ON -DDELTASERVE_CUDA=ON \
        -DCMAKE_BUILD_TYPE=Release -DDELTASERVE_BENCH=OFF
    cmake --build build/trace --target kernels_cuda_test
    build/trace/kernels/cuda/kernels_cuda_test --gtest_filter=MoeDecodeLayerGpu.Timing | grep trace

The stamps cost an atomic each and change the timing a little; compare variants within one patched build. Each
patch names the source text it attaches to; when the kernels change, the tool stops with the anchor it missed.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tree_patch import copy_and_patch, patch_timing_test  # noqa: E402

HELPERS = r'''
__device__ __forceinline__ unsigned long long trace_clock() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
#define DS_TRACE_FIRST(a, i) \
  do { if ((a).trace) atomicMin((a).trace + (i), ::deltaserve::kernels::cuda::moe_small_batch_detail::trace_clock()); } while (0)
#define DS_TRACE_LAST(a, i) \
  do { if ((a).trace) atomicMax((a).trace + (i), ::deltaserve::kernels::cuda::moe_small_batch_detail::trace_clock()); } while (0)
// After `v` is available (the asm reads it, so the stamp waits for the load that produced it).
#define DS_TRACE_AFTER(a, i, v) \
  do { if ((a).trace) { unsigned long long t_; \
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_) : "f"(v)); atomicMax((a).trace + (i), t_); } } while (0)
#define DS_TRACE_CYCLES(a, i) do { if ((a).trace) atomicMax((a).trace + (i), static_cast<unsigned long long>(clock64())); } while (0)
'''

# Slot names (index = slot). "first" slots start at ~0 and take the minimum; the others the maximum.
NAMES = [
    "L1 first CTA", "L1 past wait", "L1 sums stored", "L1 last CTA known", "L1 routed", "L1 planned",
    "L2 first CTA", "L2 tables (last)", "L2 tables (first)", "L2 end", "L3 first CTA", "L3 past wait", "L3 end",
    "fenced", "route A", "route B", "route C", "plan counts", "plan scan", "A sums loaded", "A first sigmoid",
    "dot (last)",
]
FIRST_SLOTS = (0, 6, 8, 10)  # slots 22-28 (not named): clock64 of the last router CTA: known, planned, fenced, A, B, C, routed

PATCHES = {
    "kernels/cuda/moe/detail/small_batch.cuh": [
        ("  int lane_issue, down_min_stages;\n};", "  int lane_issue, down_min_stages;\n  unsigned long long* trace;\n};\n" + HELPERS),
        ("  __syncthreads();\n  for (int e = tid; e < E; e += kThreads) counts_s[e] |=",
         "  __syncthreads();\n  if (tid == 0) DS_TRACE_LAST(a, 17);\n  for (int e = tid; e < E; e += kThreads) counts_s[e] |="),
        ("  const int total = block_exclusive_scan(counts_s, E, warp_totals);\n",
         "  const int total = block_exclusive_scan(counts_s, E, warp_totals);\n  if (tid == 0) DS_TRACE_LAST(a, 18);\n"),
    ],
    "kernels/cuda/moe/small_batch.cu": [
        ("namespace deltaserve::kernels::cuda {\nnamespace {\n",
         "namespace deltaserve::kernels::cuda {\nstatic unsigned long long* g_moe_trace = nullptr;\n"
         "void moe_trace_set(unsigned long long* p) { g_moe_trace = p; }\nnamespace {\n"),
        ("LayerArgs make_args(const MoeSmallBatchParams& p, MoeSmallBatchKernel kernel) {\n  LayerArgs a{};\n",
         "LayerArgs make_args(const MoeSmallBatchParams& p, MoeSmallBatchKernel kernel) {\n  LayerArgs a{};\n"
         "  a.trace = g_moe_trace;\n"),
        ("  const RouterSmem s = router_smem_layout(a, router_smem);\n",
         "  const RouterSmem s = router_smem_layout(a, router_smem);\n  if (threadIdx.x == 0) DS_TRACE_FIRST(a, 0);\n"),
        ("  grid_dependency_wait();\n  allow_dependent_grids();\n  // The split down",
         "  grid_dependency_wait();\n  allow_dependent_grids();\n  if (tid == 0) DS_TRACE_LAST(a, 1);\n  // The split down"),
        ("    store_router_partials(a, acc, slice, e);\n",
         "    if (threadIdx.x == 0) DS_TRACE_AFTER(a, 21, acc[0]);\n    store_router_partials(a, acc, slice, e);\n"),
        ("  __threadfence();\n  __syncthreads();  // also: bias and counts in shared memory\n",
         "  __threadfence();\n  __syncthreads();  // also: bias and counts in shared memory\n  if (tid == 0) DS_TRACE_LAST(a, 2);\n"),
        ("  if (!is_last) return;\n  __threadfence();\n  finish_route_v2(a, s);\n",
         "  if (!is_last) return;\n  if (tid == 0) { DS_TRACE_LAST(a, 3); DS_TRACE_CYCLES(a, 22); }\n  __threadfence();\n"
         "  if (tid == 0) { DS_TRACE_LAST(a, 13); DS_TRACE_CYCLES(a, 24); }\n  finish_route_v2(a, s);\n  __syncthreads();\n"
         "  if (tid == 0) { DS_TRACE_LAST(a, 5); DS_TRACE_CYCLES(a, 23); }\n"),
        ("    route_parallel(a, s);\n", "    route_parallel(a, s);\n    if (threadIdx.x == 0) { DS_TRACE_LAST(a, 4); DS_TRACE_CYCLES(a, 28); }\n"),
        ("  __syncthreads();\n  build_plan(a, s.ids, s.sorted, s.counts);\n}",
         "  __syncthreads();\n  if (threadIdx.x == 0) DS_TRACE_LAST(a, 4);\n  build_plan(a, s.ids, s.sorted, s.counts);\n}"),
        ("        logit[b] = i < pairs ? router_logit(a, t0 + tt, i - tt * E) : 0.0f;\n      }\n",
         "        logit[b] = i < pairs ? router_logit(a, t0 + tt, i - tt * E) : 0.0f;\n      }\n"
         "      if (base == 0) DS_TRACE_AFTER(a, 19, logit[0]);\n"),
        ("          probs[i] = rd::router_sigmoid(logit[b]);\n",
         "          probs[i] = rd::router_sigmoid(logit[b]);\n          if (i == 0) DS_TRACE_AFTER(a, 20, probs[i]);\n"),
        ("    __syncthreads();\n    for (int task = warp;",
         "    __syncthreads();\n    if (tid == 0) { DS_TRACE_LAST(a, 14); DS_TRACE_CYCLES(a, 25); }\n    for (int task = warp;"),
        ("    __syncthreads();\n    for (int i = tid; i < tokens * C;",
         "    __syncthreads();\n    if (tid == 0) { DS_TRACE_LAST(a, 15); DS_TRACE_CYCLES(a, 26); }\n    for (int i = tid; i < tokens * C;"),
        ("    __syncthreads();\n    for (int tt = warp; tt < tokens;",
         "    __syncthreads();\n    if (tid == 0) { DS_TRACE_LAST(a, 16); DS_TRACE_CYCLES(a, 27); }\n    for (int tt = warp; tt < tokens;"),
    ],
    "kernels/cuda/moe/small_batch_pipeline.cu": [
        ("  if (threadIdx.x == 0) init_pipeline_barriers(base, p.pipe.stages);\n  zero_shared(smem, p.pipe.extra",
         "  if (threadIdx.x == 0) DS_TRACE_FIRST(p.a, 6);\n"
         "  if (threadIdx.x == 0) init_pipeline_barriers(base, p.pipe.stages);\n  zero_shared(smem, p.pipe.extra"),
        ("    gate_up_consumer(p, smem, base, t, reinterpret_cast<float*>(smem + p.pipe.reduce));\n  }\n}",
         "    gate_up_consumer(p, smem, base, t, reinterpret_cast<float*>(smem + p.pipe.reduce));\n  }\n"
         "  if ((threadIdx.x & 31) == 0) DS_TRACE_LAST(p.a, 9);\n}"),
        ("  load_tables(a, t, true);\n  if (!issues) return;\n",
         "  load_tables(a, t, true);\n  if (lane == 0) { DS_TRACE_LAST(a, 7); DS_TRACE_FIRST(a, 8); }\n"
         "  if (!issues) return;\n"),
        ("  if (threadIdx.x == 0) init_pipeline_barriers(base, p.pipe.stages);\n  zero_shared(smem, p.pipe.zero_row",
         "  if (threadIdx.x == 0) DS_TRACE_FIRST(p.a, 10);\n"
         "  if (threadIdx.x == 0) init_pipeline_barriers(base, p.pipe.stages);\n  zero_shared(smem, p.pipe.zero_row"),
        ("    down_consumer(p, base, smem, t);\n  }\n}",
         "    down_consumer(p, base, smem, t);\n  }\n  if ((threadIdx.x & 31) == 0) DS_TRACE_LAST(p.a, 12);\n}"),
        ("      wait_for_activations();\n      if (lane == 0) {\n        for (int g = 0; g < pipe.stages; ++g)",
         "      wait_for_activations();\n      if (lane == 0) DS_TRACE_LAST(a, 11);\n"
         "      if (lane == 0) {\n        for (int g = 0; g < pipe.stages; ++g)"),
    ],
}

TEST_PRINT = r'''
    {
      d.p.kernel = MoeSmallBatchKernel::kV2;
      unsigned long long* trace = nullptr;
      DS_CUDA_OK(cudaMalloc(&trace, 32 * sizeof(unsigned long long)));
      for (int alone = 0; alone < 2; ++alone) {
      moe_trace_set(trace);
      cudaGraphExec_t exec = nullptr;
      ASSERT_NO_FATAL_FAILURE(capture_graph(stream, cudaStreamCaptureModeThreadLocal, [&](cudaStream_t s) {
        return alone ? moe_small_batch_route(d.p, s) : moe_small_batch_layer(d.p, s); }, &exec));
      moe_trace_set(nullptr);
      const char* names[] = {NAMES};
      for (int rep = 0; rep < 4; ++rep) {
        unsigned long long h[32];
        for (int i = 0; i < 32; ++i) h[i] = (FIRST_TEST) ? ~0ull : 0ull;
        DS_CUDA_OK(cudaMemcpy(trace, h, sizeof(h), cudaMemcpyHostToDevice));
        DS_CUDA_OK(cudaGraphLaunch(exec, stream));
        DS_CUDA_OK(cudaStreamSynchronize(stream));
        DS_CUDA_OK(cudaMemcpy(h, trace, sizeof(h), cudaMemcpyDeviceToHost));
        std::printf("[ trace%s T=%lld rep %d ]", alone ? " launch 1 alone" : "", static_cast<long long>(T), rep);
        for (int i = 0; i < NUM_NAMES; ++i) {
          std::printf(" %s %.2f;", names[i], 1e-3 * static_cast<double>(static_cast<long long>(h[i] - h[0])));
        }
        std::printf(" cycles from known: fenced %lld, A %lld, B %lld, C %lld, routed %lld, planned %lld;",
                    (long long)(h[24] - h[22]), (long long)(h[25] - h[22]), (long long)(h[26] - h[22]),
                    (long long)(h[27] - h[22]), (long long)(h[28] - h[22]), (long long)(h[23] - h[22]));
        std::printf(" SM GHz while routing %.2f\n",
                    static_cast<double>(h[23] - h[22]) / static_cast<double>(static_cast<long long>(h[5] - h[3])));
      }
      cudaGraphExecDestroy(exec);
      }
      cudaFree(trace);
    }
'''


def patch_test(text):
    body = (TEST_PRINT.replace("NUM_NAMES", str(len(NAMES)))
            .replace("{NAMES}", "{" + ", ".join(f'"{n}"' for n in NAMES) + "}")
            .replace("FIRST_TEST", " || ".join(f"i == {s}" for s in FIRST_SLOTS)))
    return patch_timing_test(text, "namespace deltaserve::kernels::cuda { void moe_trace_set(unsigned long long* p); }\n",
                             body, "moe_layer_trace")


def main():
    copy_and_patch(sys.argv[1:], PATCHES, patch_test, __doc__, "moe_layer_trace")


if __name__ == "__main__":
    main()
