// Internals of the small-batch MoE decode layer (contract in moe.hpp, "small-batch decode layer") shared by its
// two files: moe_small_batch.cu (validation, launch 1 of both kernel generations, the v1 expert launches) and
// moe_small_batch_pipeline.cu (the v2 expert launches). Kernel arguments, the GLU, warp sums and programmatic
// dependent launch.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "common/status.hpp"
#include "kernels/cuda/activations.cuh"
#include "kernels/cuda/launch_status.hpp"
#include "kernels/cuda/moe.hpp"
#include "kernels/cuda/moe_route.cuh"

namespace deltaserve::kernels::cuda::moe_small_batch_detail {

constexpr int kThreads = 256;  // launch 1 and the v1 expert launches
constexpr int kWarps = kThreads / 32;
constexpr int kMaxTokens = static_cast<int>(kMoeSmallBatchMaxTokens);
constexpr int kMaxAssignments = static_cast<int>(kMoeSmallBatchMaxAssignments);

struct GluArgs {
  int situ;
  float beta, beta_linear;
};

__device__ __forceinline__ float glu(const GluArgs& g, float gate, float up) {
  return g.situ ? situ_glu_f(gate, up, g.beta, g.beta_linear) : swiglu_f(gate, up);
}

// Butterfly sum: every lane ends with the same total (fixed order: deterministic).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

struct LayerArgs {
  // shapes
  int T, E, k, hidden, inter, shared_inter;
  int R;  // T * k
  // router
  moe_route_device::RouteConfig route;
  const float* x_f32;
  int64_t x_f32_stride;
  const float* router;
  const float* bias;
  int router_slices, slice_chunks, expert_blocks, router_ctas, route_warps;
  float* partials;  // [slices, T, E]
  // experts
  const __nv_bfloat16* x;
  int64_t x_stride;
  const __nv_bfloat16* gate_up;
  const __nv_bfloat16* down;
  const __nv_bfloat16* shared_gate_up;  // nullptr: no shared expert
  const __nv_bfloat16* shared_down;
  GluArgs glu;
  // outputs
  float* logits;
  int32_t* expert_ids;
  float* weights;
  int32_t* offsets;
  int32_t* sorted;
  int32_t* pos;
  __nv_bfloat16* x_sorted;
  __nv_bfloat16* activated;
  __nv_bfloat16* shared_activated;
  float* residual;
  int64_t residual_stride;
  // Workspace after the router partials: the active experts in id order [active_capacity = min(E, R)], their
  // count [1], and (v2 only) each active slot's first plan row and row count [active_capacity] each.
  int32_t* active;
  int active_capacity;
  int32_t* num_active;
  int32_t* slot_first;
  int32_t* slot_count;
  unsigned int* counter;
};

// ---- programmatic dependent launch (sm_90) ------------------------------------------------------------------
// Waits until the grid before this one on the stream has completed and its writes are visible; a no-op for a grid
// launched without the attribute. Every v2 kernel calls it before it reads anything the previous grid writes and
// before allow_dependent_grids, so a grid that starts early still runs after everything before the previous one.
__device__ __forceinline__ void grid_dependency_wait() {
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
}
// Lets the next grid on the stream (if launched with the attribute) become resident; the first call of a CTA counts.
__device__ __forceinline__ void allow_dependent_grids() {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}

// cudaLaunchKernelEx with cudaLaunchAttributeProgrammaticStreamSerialization (graph-capturable).
template <typename... Params, typename... Args>
Status launch_with_pdl(void (*kernel)(Params...), unsigned grid, unsigned threads, size_t smem, cudaStream_t stream,
                       const char* who, Args... args) {
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attribute;
  config.numAttrs = 1;
  if (const cudaError_t e = cudaLaunchKernelEx(&config, kernel, args...); e != cudaSuccess) {
    (void)cudaGetLastError();
    return internal_error(std::string(who) + ": launch: " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
  }
  return launch_status(who);
}

// ---- v2 expert launches (moe_small_batch_pipeline.cu) ---------------------------------------------------------
// Whether the v2 expert launches take these shapes (their shared-memory stages and staged x rows fit); otherwise
// the layer runs v1 throughout, so launch 1 must ask the same question.
bool pipeline_fits(const LayerArgs& a);
// Launches 2 and 3 of v2 (after the v2 launch 1 on the same stream).
Status launch_pipeline_experts(const LayerArgs& a, cudaStream_t stream);

}  // namespace deltaserve::kernels::cuda::moe_small_batch_detail
