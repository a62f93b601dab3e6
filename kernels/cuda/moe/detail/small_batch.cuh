// Internals of the small-batch MoE decode layer (contract in moe.hpp, "small-batch decode layer") shared by its
// files: small_batch.cu (validation, launch 1) and small_batch_pipeline.cu (launches 2 and 3). Kernel arguments, the
// GLU, warp sums, the router partial sums and the plan (launch 1), programmatic dependent launch.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "common/status.hpp"
#include "kernels/cuda/common/detail/activations.cuh"
#include "kernels/cuda/common/detail/bf16_stream.cuh"
#include "kernels/cuda/common/detail/rms_norm_order.cuh"
#include "kernels/cuda/common/launch_status.hpp"
#include "kernels/cuda/moe/detail/route.cuh"
#include "kernels/cuda/moe/moe.hpp"

namespace deltaserve::kernels::cuda::moe_small_batch_detail {

constexpr int kThreads = 256;  // launch 1
constexpr int kWarps = kThreads / 32;
constexpr int kMaxTokens = static_cast<int>(kMoeSmallBatchMaxTokens);
constexpr int kMaxAssignments = static_cast<int>(kMoeSmallBatchMaxAssignments);
constexpr size_t kSharedLimit = 48 * 1024;  // default dynamic + static limit of launch 1: no opt-in attribute

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
  const float* norm_weight;  // x_f32 is normalised in the kernels (MoeSmallBatchParams::norm_weight), or null
  float norm_eps;
  const float* router;
  const float* bias;
  int router_slices, slice_chunks, expert_blocks, router_ctas, route_warps;
  // Launch 1: tokens per pass of the CTA-wide routing (ungrouped; 0: one warp a token, route_warps of them) and the
  // floats of its shared-memory routing region.
  int route_pass_tokens, route_region_floats;
  // Launch 1: the plan by one warp (build_plan_warp: CTA-wide routing, R <= 32, no gather) instead of the whole CTA.
  int warp_plan;
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
  // count [1], and each active slot's first plan row and row count [active_capacity] each.
  int32_t* active;
  int active_capacity;
  int32_t* num_active;
  int32_t* slot_first;
  int32_t* slot_count;
  unsigned int* counter;
  // Launch 1: when it lets launch 2 become resident (RouterTrigger, by token count).
  int router_trigger;
};

// When launch 1 lets launch 2 (programmatic dependent launch) start. Launch 2's early CTAs stream the shared
// expert's gate/up, and beside those streams the routing CTA's first L2 reads and its phases take about twice as
// long; the later trigger trades some of that early stream for a faster routing (a gain from two tokens on, a loss
// at one).
enum RouterTrigger : int {
  kTriggerAfterWait = 0,     // every CTA right after its grid-dependency wait (one token)
  kTriggerAfterRouting = 1,  // the routing CTA once the ids and weights are written, before the plan (the others at
                             // exit; two tokens and more)
};

// ---- launch 1: router partial sums and the plan ---------------------------------------------------------------

// acc + dot of 4 fp32 pairs, in element order.
__device__ __forceinline__ float dot4(const uint4& w, const float4& x, float acc) {
  acc = fmaf(__uint_as_float(w.x), x.x, acc);
  acc = fmaf(__uint_as_float(w.y), x.y, acc);
  acc = fmaf(__uint_as_float(w.z), x.z, acc);
  acc = fmaf(__uint_as_float(w.w), x.w, acc);
  return acc;
}

// Router rows are read in groups of kRouterGroup 16-byte chunks a lane, all in flight at once (a whole slice at
// hidden 2304 with 4 slices), then every token's x chunks (from L1) against them.
constexpr int kRouterGroup = 6;

__device__ __forceinline__ void load_router_group(const uint4* w, int base, int end, uint4 (&wv)[kRouterGroup]) {
#pragma unroll
  for (int q = 0; q < kRouterGroup; ++q) {
    const int ch = base + 32 * q;
    wv[q] = ch < end ? detail::load_streaming(w + ch) : make_uint4(0u, 0u, 0u, 0u);
  }
}

__device__ __forceinline__ void router_group_dot(const LayerArgs& a, const uint4 (&wv)[kRouterGroup], int base, int end,
                                                 float (&acc)[kMaxTokens]) {
#pragma unroll
  for (int t = 0; t < kMaxTokens; ++t) {
    if (t < a.T) {
      const float4* xr = reinterpret_cast<const float4*>(a.x_f32 + t * a.x_f32_stride);
#pragma unroll
      for (int q = 0; q < kRouterGroup; ++q) {
        const int ch = base + 32 * q;
        if (ch < end) acc[t] = dot4(wv[q], __ldg(xr + ch), acc[t]);
      }
    }
  }
}

// router_group_dot with the fused input norm: x_f32's element times inverse_rms[t], times the norm weight, as
// rms_norm_dual computes it (fp32, in that order).
__device__ __forceinline__ void router_group_dot_normed(const LayerArgs& a, const uint4 (&wv)[kRouterGroup], int base,
                                                        int end, const float* inverse_rms, float (&acc)[kMaxTokens]) {
  const float4* norm = reinterpret_cast<const float4*>(a.norm_weight);
#pragma unroll
  for (int t = 0; t < kMaxTokens; ++t) {
    if (t < a.T) {
      const float4* xr = reinterpret_cast<const float4*>(a.x_f32 + t * a.x_f32_stride);
      const float inverse = inverse_rms[t];
#pragma unroll
      for (int q = 0; q < kRouterGroup; ++q) {
        const int ch = base + 32 * q;
        if (ch < end) {
          const float4 x = __ldg(xr + ch), w = __ldg(norm + ch);
          const float4 normed =
              make_float4(x.x * inverse * w.x, x.y * inverse * w.y, x.z * inverse * w.z, x.w * inverse * w.w);
          acc[t] = dot4(wv[q], normed, acc[t]);
        }
      }
    }
  }
}

// 1 / rms of rows x[t * stride, + dim) for t < rows into inverse_rms[t] in rms_norm_dual's order
// (rms_norm_order.cuh), by the 256 threads 0.. of the CTA (thread_index in [0, 256)); warp_sums: [rows][8] scratch.
// `sync` is a barrier of exactly those threads, called twice (inverse_rms is complete when this returns).
template <class Sync>
__device__ __forceinline__ void rows_inverse_rms(const float* x, int64_t stride, int dim, int rows, float eps,
                                                 int thread_index, float* warp_sums, float* inverse_rms, Sync sync) {
  detail::rms_square_partials(x, stride, dim, rows, thread_index, warp_sums);
  sync();
  if (thread_index < rows) {
    inverse_rms[thread_index] = detail::rms_inverse(warp_sums + thread_index * detail::kRmsOrderWarps, dim, eps);
  }
  sync();
}

// partials[slice, t, e] = the warp's sum for token t.
__device__ __forceinline__ void store_router_partials(const LayerArgs& a, float (&acc)[kMaxTokens], int slice, int e) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int t = 0; t < kMaxTokens; ++t) {
    if (t < a.T) {
      const float v = warp_sum(acc[t]);
      if (lane == 0) a.partials[(static_cast<int64_t>(slice) * a.T + t) * a.E + e] = v;
    }
  }
}

// Exclusive block scan of values[0, n) (n <= 4 * kThreads) in place; returns the total to every thread.
__device__ inline int block_exclusive_scan(int* values, int n, int* warp_totals) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int per = (n + kThreads - 1) / kThreads;  // <= 4
  int local[4];
  int sum = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int e = tid * per + i;
    const int v = (i < per && e < n) ? values[e] : 0;
    local[i] = sum;
    sum += v;
  }
  int inclusive = sum;
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const int other = __shfl_up_sync(0xffffffffu, inclusive, offset);
    if (lane >= offset) inclusive += other;
  }
  if (lane == 31) warp_totals[warp] = inclusive;
  __syncthreads();
  int base = inclusive - sum, total = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    if (w < warp) base += warp_totals[w];
    total += warp_totals[w];
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int e = tid * per + i;
    if (i < per && e < n) values[e] = base + local[i];
  }
  __syncthreads();
  return total;
}

// The plan of the routed ids ids_s[0, R) (shared memory), run by the whole CTA: expert_ids, expert_offsets and the
// active-expert list with slot_first / slot_count, the position of each assignment (the stable order of moe_plan)
// and the optional gather. counts_s: E ints of shared memory, zeroed by the caller with a
// block barrier since.
__device__ inline void build_plan(const LayerArgs& a, const int* ids_s, int* sorted_s, int* counts_s) {
  __shared__ int warp_totals[kWarps];
  const int tid = threadIdx.x;
  const int E = a.E, k = a.k, R = a.R;
  // Counts per expert, exclusive scan into offsets (low 16 bits) and active ranks (high bits) at once.
  for (int i = tid; i < R; i += kThreads) {
    a.expert_ids[i] = ids_s[i];
    atomicAdd(&counts_s[ids_s[i]], 1);
  }
  __syncthreads();
  for (int e = tid; e < E; e += kThreads) counts_s[e] |= (counts_s[e] > 0 ? 1 : 0) << 16;
  __syncthreads();
  // Copy the counts first: the scan overwrites them and the active list needs them.
  int rows[4];
  const int per = (E + kThreads - 1) / kThreads;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int e = tid * per + i;
    rows[i] = (i < per && e < E) ? (counts_s[e] & 0xffff) : 0;
  }
  const int total = block_exclusive_scan(counts_s, E, warp_totals);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int e = tid * per + i;
    if (i < per && e < E) {
      const int first = counts_s[e] & 0xffff;
      a.offsets[e] = first;
      if (rows[i] > 0) {
        const int slot = counts_s[e] >> 16;
        a.active[slot] = e;
        a.slot_first[slot] = first;
        a.slot_count[slot] = rows[i];
      }
    }
  }
  if (tid == 0) {
    a.offsets[E] = total & 0xffff;  // = R: every routed id is valid
    *a.num_active = total >> 16;
  }
  // Position of assignment i: offsets[e] + the earlier assignments of e (stable, as moe_plan).
  for (int i = tid; i < R; i += kThreads) {
    const int e = ids_s[i];
    int rank = 0;
    for (int j = 0; j < i; ++j) rank += ids_s[j] == e ? 1 : 0;
    const int p = (counts_s[e] & 0xffff) + rank;
    a.sorted[p] = i;
    a.pos[i] = p;
    sorted_s[p] = i;
  }
  if (a.x_sorted != nullptr) {
    __syncthreads();
    const int chunks = a.hidden / 8;
    for (int i = tid; i < R * chunks; i += kThreads) {
      const int p = i / chunks, c = i - p * chunks;
      const int64_t token = sorted_s[p] / k;
      reinterpret_cast<uint4*>(a.x_sorted + static_cast<int64_t>(p) * a.hidden)[c] =
          __ldg(reinterpret_cast<const uint4*>(a.x + token * a.x_stride) + c);
    }
  }
}

// ---- programmatic dependent launch (sm_90) ------------------------------------------------------------------
// Waits until the grid before this one on the stream has completed and its writes are visible; a no-op for a grid
// launched without the attribute. Every kernel of the layer calls it before it reads anything the previous grid
// writes and before allow_dependent_grids, so a grid that starts early still runs after everything before the
// previous one.
__device__ __forceinline__ void grid_dependency_wait() {
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
}
// Lets the next grid on the stream (if launched with the attribute) become resident; the first call of a CTA counts.
__device__ __forceinline__ void allow_dependent_grids() {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}

// Every launch of the layer uses programmatic dependent launch (launch_status.hpp).
template <typename... Params, typename... Args>
Status launch_with_pdl(void (*kernel)(Params...), unsigned grid, unsigned threads, size_t smem, cudaStream_t stream,
                       const char* who, Args... args) {
  return launch_kernel_ex(true, kernel, dim3(grid), dim3(threads), smem, stream, who, args...);
}

// ---- launches 2 and 3 (small_batch_pipeline.cu) ---------------------------------------------------------------
// Whether launches 2 and 3 take these shapes (their shared-memory stages and staged x rows fit their budgets);
// moe_small_batch_fits asks it.
bool pipeline_fits(int tokens, int top_k, int num_experts, int hidden, int intermediate, int shared_intermediate);
// Launches 2 and 3 (after launch 1 on the same stream).
Status launch_pipeline_experts(const LayerArgs& a, cudaStream_t stream);

}  // namespace deltaserve::kernels::cuda::moe_small_batch_detail
