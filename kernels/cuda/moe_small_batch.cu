// Small-batch MoE decode layer (contract in moe.hpp, "small-batch decode layer"): three launches per layer, two
// generations of kernels. This file: validation and dispatch, launch 1 of both, and v1's expert launches; v2's
// expert launches are in moe_small_batch_pipeline.cu.
//
// Why this shape. At batch 1 the layer reads 8 routed + 1 shared experts (Kimi-Linear-48B: 9 x 14.2 MB = 127 MB,
// 30 us at 4.26 TB/s) plus the fp32 router (2.4 MB); the previous chain spent ~100 us in 12 dependent launches, most
// of which streamed little or nothing. The dependencies leave three launches: routing, gate/up of the chosen
// experts, down of them (which needs all of an expert's activations).
//
// ---- v1 (DELTASERVE_MOE_SMALL_BATCH_KERNEL=v1) ----
// Every launch keeps all SMs streaming weights with 16-byte loads that are all issued before their first use (a
// warp holds a whole 2 x 2304-wide gate/up column pair, 18 loads a lane, or 2 x 2 down rows of I = 1024, 16 loads a
// lane), and the serial route and plan of <= 16 tokens run beside the shared expert's gate/up in launch 1.
// Launch 1 (front): CTAs [0, router_ctas) compute router partial sums, one warp per (expert, slice of the hidden
//   dimension); the last of them to finish (grid counter, threadfence-reduction pattern) adds the slices in order,
//   routes each token with one warp (moe_route.cuh), counts experts in shared memory, scans the counts into
//   expert_offsets and the active-expert list, places each assignment at offsets[e] + (earlier assignments of e)
//   (the stable order of moe_plan) and resets the counter. CTAs [router_ctas, ...) run the shared expert's gate/up:
//   one warp per intermediate column, all T rows.
// Launch 2 (gate/up): CTA = (active expert slot, 8 intermediate columns); slots past the active count exit at once.
//   A warp streams gate row j and up row I + j, dots them with each of the expert's rows of x (read by token through
//   the plan, from L1), and writes activated[p, j] = bf16(glu(gate, up)).
// Launch 3 (down + combine): one warp per 2 output columns d over every active expert and the shared expert (their
//   weight rows d, U experts' loads in flight at once); per-row results y[p, d] stay in the warp's shared memory,
//   then lanes t < T add Σ_j w[t, j] · y[pos[t, j], d] in order j and the shared expert's y[t, d] to the residual.
//   144 CTAs at hidden 2304: all resident, equal work each.
// Weight rows longer than 32 * CPL 16-byte chunks (CPL, chunks per lane, a template parameter from {1, 2, 4, 9})
// are processed in segments whose reduced partial sums are added in segment order in shared memory.
// Measured on the H200 (MoeDecodeLayerGpu.Timing, 2026-12-01): 65.6 / 102 / 160 / 282 / 503 us at T = 1 / 2 / 4 /
// 8 / 16, 0.46 / 0.56 / 0.56 / 0.57 / 0.52 of the touched bytes at 4.26 TB/s. Where it loses: (a) nothing streams
// while launch 1's last CTA routes (the shared gate/up ends about when the router does), and every launch boundary
// drains the GPU and ramps it up again; (b) in launches 2 and 3 each warp issues its loads, waits a full memory
// round trip with nothing else in flight, computes, and only then issues more (launch 2: one column per warp and
// CTA lifetime, after a dependent L2 read of the active list; launch 3: U experts at a time), and slots past the
// active count still occupy CTA slots; (c) from T = 4 the CUDA-core dot products (bf16 unpacking per token) cost
// about as many issue slots as the bytes allow.
//
// ---- v2 (the default) ----
// The same three launches and the same routing and plan (bit for bit), with:
//   * programmatic dependent launch on all three: each grid becomes resident while the one before it drains,
//     issues what does not depend on it (launch 1: the router rows and the correction bias; launch 2: x and the
//     shared expert's gate/up; launch 3: the first stages' down rows of the routed and shared experts, the routing
//     being launch 1's) and then waits for it (griddepcontrol.wait) before reading its output; it starts its own
//     dependents only after that wait, so a grid that starts early still runs after everything before the previous
//     one (launch 3's early reads of launch 1's routing rely on it);
//   * the shared expert's gate/up moved from launch 1 to launch 2, ahead of the routed items: its 9.4 MB stream
//     while launch 1's last CTA routes, and launch 1 carries only the 2.4 MB router, so the routing ends sooner;
//   * launches 2 and 3 stream through shared-memory rings filled by bulk copies (a producer warp, 3-4 stages of
//     16 rows, 70-150 KB of ring per SM, well above the ~30 KB per SM that 4.26 TB/s needs at ~1 us latency),
//     persistent over balanced work lists, and multiply on tensor cores (mma.sync m16n8k16: a weight row's bytes
//     cost two ldmatrix and one mma per 16 k instead of 16 fma and 16 unpacks per token), which also removes (c);
//   * launch 1's last CTA routes from shared memory (its token's logits and the bias), without reading back its
//     own global writes.
// Not yet measured (no GPU where this was written). The estimate at T = 1: launch 1 ~4 us with the shared gate/up
// beside it, the routed gate/up 75.5 MB and the down 42.5 MB near the copy rate, ~35-40 us against 65.6.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

#include "kernels/cuda/bf16_stream.cuh"
#include "kernels/cuda/launch_status.hpp"
#include "kernels/cuda/moe.hpp"
#include "kernels/cuda/moe_route.cuh"
#include "kernels/cuda/moe_small_batch.cuh"

namespace deltaserve::kernels::cuda {
namespace {

namespace rd = moe_route_device;

using moe_small_batch_detail::allow_dependent_grids;
using moe_small_batch_detail::glu;
using moe_small_batch_detail::GluArgs;
using moe_small_batch_detail::grid_dependency_wait;
using moe_small_batch_detail::kMaxAssignments;
using moe_small_batch_detail::kMaxTokens;
using moe_small_batch_detail::kThreads;
using moe_small_batch_detail::kWarps;
using moe_small_batch_detail::LayerArgs;
using moe_small_batch_detail::warp_sum;

constexpr int kMaxOutRows = kMaxAssignments + kMaxTokens;  // routed rows, then the shared expert's
constexpr int kDownColumnsPerWarp = 2;
constexpr int kRouterTargetCtas = 128;  // router CTAs aimed at (slices of the hidden dimension fill them up)
constexpr int kMaxRouterSlices = 4;
constexpr size_t kSharedLimit = 48 * 1024;  // default dynamic + static limit: no opt-in attribute needed

// ---- small device helpers -------------------------------------------------------------------------------------

using detail::load_streaming;

// acc + dot of 4 fp32 pairs, in element order.
__device__ __forceinline__ float dot4(const uint4& w, const float4& x, float acc) {
  acc = fmaf(__uint_as_float(w.x), x.x, acc);
  acc = fmaf(__uint_as_float(w.y), x.y, acc);
  acc = fmaf(__uint_as_float(w.z), x.z, acc);
  acc = fmaf(__uint_as_float(w.w), x.w, acc);
  return acc;
}

// ---- gate/up + GLU of one intermediate column (one warp) --------------------------------------------------------

// Row r of a work item: x row token(r), output row out_row0 + r. Routed experts: token = sorted[first + r] / k;
// the shared expert: token = r.
struct ItemRows {
  const int32_t* sorted;  // nullptr: row r is token r
  int first, count, top_k;
};

// out[r * out_stride] = bf16(glu(gate_row · x_r, up_row · x_r)) for the item's rows r < rows.count (out: column j
// of the item's first output row). acc: this warp's shared-memory partial sums [kMaxTokens][2], used when a weight
// row spans several segments.
template <int CPL>
__device__ __forceinline__ void gate_up_column(const LayerArgs& a, const __nv_bfloat16* gate_row,
                                               const __nv_bfloat16* up_row, const ItemRows& rows, __nv_bfloat16* out,
                                               int64_t out_stride, float* acc) {
  const int lane = threadIdx.x & 31;
  const int chunks = a.hidden / 8;
  constexpr int kSegment = 32 * CPL;
  const int segments = (chunks + kSegment - 1) / kSegment;
  const uint4* gate = reinterpret_cast<const uint4*>(gate_row);
  const uint4* up = reinterpret_cast<const uint4*>(up_row);
  for (int seg = 0; seg < segments; ++seg) {
    const int base = seg * kSegment + lane;
    uint4 wg[CPL], wu[CPL];
#pragma unroll
    for (int c = 0; c < CPL; ++c) {
      const int ch = base + 32 * c;
      if (ch < chunks) {
        wg[c] = load_streaming(gate + ch);
        wu[c] = load_streaming(up + ch);
      } else {
        wg[c] = wu[c] = make_uint4(0u, 0u, 0u, 0u);
      }
    }
    // Lane r fetches the token of row r (rows <= 16) while the weights are in flight.
    const int my_token =
        lane < rows.count ? (rows.sorted == nullptr ? lane : __ldg(rows.sorted + rows.first + lane) / rows.top_k) : 0;
    for (int r = 0; r < rows.count; ++r) {
      const int token = __shfl_sync(0xffffffffu, my_token, r);
      const uint4* xr = reinterpret_cast<const uint4*>(a.x + token * a.x_stride);
      float g = 0.0f, u = 0.0f;
#pragma unroll
      for (int c = 0; c < CPL; ++c) {
        const int ch = base + 32 * c;
        if (ch < chunks) {
          const uint4 xv = __ldg(xr + ch);
          g = detail::dot8_bf16(wg[c], xv, g);
          u = detail::dot8_bf16(wu[c], xv, u);
        }
      }
      g = warp_sum(g);
      u = warp_sum(u);
      if (lane == 0) {
        if (segments > 1) {
          if (seg > 0) {
            g = acc[2 * r] + g;
            u = acc[2 * r + 1] + u;
          }
          acc[2 * r] = g;
          acc[2 * r + 1] = u;
        }
        if (seg == segments - 1) out[r * out_stride] = __float2bfloat16(glu(a.glu, g, u));
      }
    }
  }
}

// ---- launch 1: router, route, plan (last CTA); shared expert gate/up (other CTAs) ---------------------------------

// Router rows are read in groups of kRouterGroup 16-byte chunks a lane, all in flight at once (a whole slice at
// hidden 2304 with 4 slices), then every token's x chunks (from L1) against them.
constexpr int kRouterGroup = 6;

__device__ __forceinline__ void load_router_group(const uint4* w, int base, int end, uint4 (&wv)[kRouterGroup]) {
#pragma unroll
  for (int q = 0; q < kRouterGroup; ++q) {
    const int ch = base + 32 * q;
    wv[q] = ch < end ? load_streaming(w + ch) : make_uint4(0u, 0u, 0u, 0u);
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
__device__ int block_exclusive_scan(int* values, int n, int* warp_totals) {
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
// active-expert list (with slot_first / slot_count when the args carry them), the position of each assignment (the
// stable order of moe_plan) and the optional gather. counts_s: E ints of shared memory, zeroed by the caller with a
// block barrier since.
__device__ void build_plan(const LayerArgs& a, const int* ids_s, int* sorted_s, int* counts_s) {
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
        if (a.slot_first != nullptr) {
          a.slot_first[slot] = first;
          a.slot_count[slot] = rows[i];
        }
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

// v1: logits, routing, plan, active list and the optional gather; run by the last router CTA only.
__device__ void finish_route(const LayerArgs& a, unsigned char* dynamic_smem) {
  const int tid = threadIdx.x, warp = tid >> 5;
  const int T = a.T, E = a.E, k = a.k;
  // Dynamic shared memory: route scratch [route_warps][route_scratch_floats] | ids [R] | sorted [R] | counts [E].
  const int scratch_floats = rd::route_scratch_floats(E, a.route.num_groups);
  float* scratch = reinterpret_cast<float*>(dynamic_smem);
  int* ids_s = reinterpret_cast<int*>(scratch + a.route_warps * scratch_floats);
  int* sorted_s = ids_s + kMaxAssignments;
  int* counts_s = sorted_s + kMaxAssignments;

  // Logits: the slices' partial sums added in slice order. The partials were written by other CTAs: read from L2.
  for (int i = tid; i < T * E; i += kThreads) {
    float v = __ldcg(a.partials + i);
    for (int s = 1; s < a.router_slices; ++s) v += __ldcg(a.partials + static_cast<int64_t>(s) * T * E + i);
    a.logits[i] = v;
  }
  for (int e = tid; e < E; e += kThreads) counts_s[e] = 0;
  __syncthreads();  // the logits (global, written by this CTA) are visible to the whole CTA

  if (warp < a.route_warps) {
    for (int t = warp; t < T; t += a.route_warps) {
      rd::route_token(a.route, a.logits + static_cast<int64_t>(t) * E, a.bias, scratch + warp * scratch_floats,
                      ids_s + t * k, a.weights + t * k);
    }
  }
  __syncthreads();
  build_plan(a, ids_s, sorted_s, counts_s);
}

template <int CPL>
__global__ void __launch_bounds__(kThreads, 2) small_batch_front_kernel(const __grid_constant__ LayerArgs a) {
  extern __shared__ __align__(16) unsigned char front_smem[];
  __shared__ float gate_up_acc[kWarps][2 * kMaxTokens];
  __shared__ int is_last;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

  if (static_cast<int>(blockIdx.x) >= a.router_ctas) {
    // Shared expert gate/up: one warp per intermediate column j, all T rows.
    const int j = (blockIdx.x - a.router_ctas) * kWarps + warp;
    if (j >= a.shared_inter) return;
    const __nv_bfloat16* gate_row = a.shared_gate_up + static_cast<int64_t>(j) * a.hidden;
    const __nv_bfloat16* up_row = a.shared_gate_up + static_cast<int64_t>(a.shared_inter + j) * a.hidden;
    gate_up_column<CPL>(a, gate_row, up_row, ItemRows{nullptr, 0, a.T, 1}, a.shared_activated + j, a.shared_inter,
                        gate_up_acc[warp]);
    return;
  }

  // Router partial sums: warp = expert e of this CTA's block, slice s of the hidden dimension (fp32 chunks of 4).
  const int block = blockIdx.x % a.expert_blocks, slice = blockIdx.x / a.expert_blocks;
  const int e = block * kWarps + warp;
  if (e < a.E) {
    const int chunks = a.hidden / 4;
    const int c0 = slice * a.slice_chunks, c1 = min(chunks, c0 + a.slice_chunks);
    const uint4* w = reinterpret_cast<const uint4*>(a.router + static_cast<int64_t>(e) * a.hidden);
    float acc[kMaxTokens];
#pragma unroll
    for (int t = 0; t < kMaxTokens; ++t) acc[t] = 0.0f;
    for (int base = c0 + lane; base < c1; base += 32 * kRouterGroup) {
      uint4 wv[kRouterGroup];
      load_router_group(w, base, c1, wv);
      router_group_dot(a, wv, base, c1, acc);
    }
    store_router_partials(a, acc, slice, e);
  }

  // The last router CTA to arrive finishes the routing (threadfence reduction: publish, then count).
  __threadfence();
  __syncthreads();
  if (tid == 0) is_last = atomicAdd(a.counter, 1u) == static_cast<unsigned>(a.router_ctas - 1);
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  finish_route(a, front_smem);
  if (tid == 0) atomicExch(a.counter, 0u);  // every router CTA has counted: ready for the next launch
}

// ---- launch 1 of v2: router, route, plan ------------------------------------------------------------------------

// Dynamic shared memory of the v2 router kernel: per routing warp [route scratch | the token's logits (E)], then
// the correction bias [E], ids [kMaxAssignments], sorted [kMaxAssignments], counts [E].
struct RouterSmem {
  float* warps;
  int warp_floats;
  float* bias;
  int *ids, *sorted, *counts;
};

__device__ __forceinline__ RouterSmem router_smem_layout(const LayerArgs& a, unsigned char* dynamic_smem) {
  RouterSmem s;
  s.warps = reinterpret_cast<float*>(dynamic_smem);
  s.warp_floats = rd::route_scratch_floats(a.E, a.route.num_groups) + a.E;
  s.bias = s.warps + a.route_warps * s.warp_floats;
  s.ids = reinterpret_cast<int*>(s.bias + a.E);
  s.sorted = s.ids + kMaxAssignments;
  s.counts = s.sorted + kMaxAssignments;
  return s;
}

// v2: logits, routing, plan; run by the last router CTA only. Each routing warp adds its token's partial sums into
// its own shared-memory row (and the logits output) and routes from there with the bias from shared memory
// (loaded before the router's wait), so no step waits on the CTA's own global writes.
__device__ void finish_route_v2(const LayerArgs& a, const RouterSmem& s) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int T = a.T, E = a.E, k = a.k;
  const int scratch_floats = rd::route_scratch_floats(E, a.route.num_groups);
  if (warp < a.route_warps) {
    float* scratch = s.warps + warp * s.warp_floats;
    float* logits = scratch + scratch_floats;
    for (int t = warp; t < T; t += a.route_warps) {
      // The slices' partial sums added in slice order (as v1). Written by other CTAs: read from L2.
#pragma unroll 4
      for (int e = lane; e < E; e += 32) {
        const int64_t i = static_cast<int64_t>(t) * E + e;
        float v = __ldcg(a.partials + i);
        for (int slice = 1; slice < a.router_slices; ++slice) {
          v += __ldcg(a.partials + static_cast<int64_t>(slice) * T * E + i);
        }
        logits[e] = v;
        a.logits[i] = v;
      }
      __syncwarp();
      rd::route_token(a.route, logits, a.bias != nullptr ? s.bias : nullptr, scratch, s.ids + t * k, a.weights + t * k);
    }
  }
  __syncthreads();
  build_plan(a, s.ids, s.sorted, s.counts);
}

// Router partial sums as launch 1 of v1 (no shared-expert CTAs: v2 runs the shared expert's gate/up in launch 2).
// Launched with programmatic dependent launch: the router rows of the first group and the correction bias are
// weights, loaded before waiting for the previous grid; x_f32 and every write come after the wait.
__global__ void __launch_bounds__(kThreads, 2) small_batch_router_kernel(const __grid_constant__ LayerArgs a) {
  extern __shared__ __align__(16) unsigned char router_smem[];
  __shared__ int is_last;
  const int tid = threadIdx.x, warp = tid >> 5;
  const RouterSmem s = router_smem_layout(a, router_smem);

  const int block = blockIdx.x % a.expert_blocks, slice = blockIdx.x / a.expert_blocks;
  const int e = block * kWarps + warp;
  const int chunks = a.hidden / 4;
  const int c0 = slice * a.slice_chunks, c1 = min(chunks, c0 + a.slice_chunks);
  const uint4* w = reinterpret_cast<const uint4*>(a.router + static_cast<int64_t>(min(e, a.E - 1)) * a.hidden);
  const int first_base = c0 + (tid & 31);
  uint4 wv[kRouterGroup];
  if (e < a.E) load_router_group(w, first_base, c1, wv);
  for (int i = tid; i < a.E; i += kThreads) {
    s.counts[i] = 0;
    if (a.bias != nullptr) s.bias[i] = __ldg(a.bias + i);
  }
  grid_dependency_wait();
  allow_dependent_grids();

  if (e < a.E) {
    float acc[kMaxTokens];
#pragma unroll
    for (int t = 0; t < kMaxTokens; ++t) acc[t] = 0.0f;
    for (int base = first_base; base < c1; base += 32 * kRouterGroup) {
      if (base != first_base) load_router_group(w, base, c1, wv);
      router_group_dot(a, wv, base, c1, acc);
    }
    store_router_partials(a, acc, slice, e);
  }

  __threadfence();
  __syncthreads();  // also: bias and counts in shared memory
  if (tid == 0) is_last = atomicAdd(a.counter, 1u) == static_cast<unsigned>(a.router_ctas - 1);
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  finish_route_v2(a, s);
  if (tid == 0) atomicExch(a.counter, 0u);
}

// ---- launch 2: gate/up + GLU of the routed experts ---------------------------------------------------------------

template <int CPL>
__global__ void __launch_bounds__(kThreads, 2) small_batch_gate_up_kernel(const __grid_constant__ LayerArgs a) {
  __shared__ float gate_up_acc[kWarps][2 * kMaxTokens];
  const int warp = threadIdx.x >> 5;
  const int column_blocks = a.inter / kWarps;
  const int slot = blockIdx.x / column_blocks;
  // Both loads in flight together (active[] has min(E, R) entries, set up to the count): one L2 round trip.
  const int num_active = __ldg(a.num_active), e = __ldg(a.active + slot);
  if (slot >= num_active) return;
  const int j = (blockIdx.x - slot * column_blocks) * kWarps + warp;
  const __nv_bfloat16* w = a.gate_up + static_cast<int64_t>(e) * 2 * a.inter * a.hidden;
  const int first = __ldg(a.offsets + e), end = __ldg(a.offsets + e + 1);
  gate_up_column<CPL>(a, w + static_cast<int64_t>(j) * a.hidden, w + static_cast<int64_t>(a.inter + j) * a.hidden,
                      ItemRows{a.sorted, first, end - first, a.k},
                      a.activated + static_cast<int64_t>(first) * a.inter + j, a.inter, gate_up_acc[warp]);
}

// ---- launch 3: down of every active expert and the shared expert, combine, residual add --------------------------

template <int CPL>
__global__ void __launch_bounds__(kThreads, 2) small_batch_down_kernel(const __grid_constant__ LayerArgs a) {
  // Experts whose loads are in flight together: U x 2 columns x CPL 16-byte loads a lane (16 or 18 registers of 4).
  constexpr int U = CPL <= 2 ? 4 : (CPL <= 4 ? 2 : 1);
  constexpr int C = kDownColumnsPerWarp;
  constexpr int kSegment = 32 * CPL;
  __shared__ float ys_all[kWarps][C][kMaxOutRows];  // y[row, d0 + c]: routed rows by plan position, then shared
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int d0 = (blockIdx.x * kWarps + warp) * C;
  if (d0 >= a.hidden) return;
  float(*ys)[kMaxOutRows] = ys_all[warp];
  const bool has_shared = a.shared_down != nullptr;
  const int num_active = __ldg(a.num_active);
  const int items = num_active + (has_shared ? 1 : 0);
  const int max_chunks = max(a.inter, has_shared ? a.shared_inter : 0) / 8;
  const int segments = (max_chunks + kSegment - 1) / kSegment;

  for (int seg = 0; seg < segments; ++seg) {
    int lane_expert = 0, lane_first = 0, lane_end = 0;  // item (group base + lane) of the current group of 32
    for (int i0 = 0; i0 < items; i0 += U) {
      if ((i0 & 31) == 0) {
        const int slot = i0 + lane;
        // active[] holds min(E, R) entries; those past the count are never used (nor their offsets read).
        const int expert = slot < a.active_capacity ? __ldg(a.active + slot) : 0;
        if (slot < num_active) {
          lane_expert = expert;
          lane_first = __ldg(a.offsets + expert);
          lane_end = __ldg(a.offsets + expert + 1);
        }
      }
      // Where each of the U items' weights, input rows and outputs are.
      const uint4* w_rows[U][C];
      const __nv_bfloat16* act[U];
      int chunks[U], count[U], out0[U], stride[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int item = i0 + u;
        const int expert = __shfl_sync(0xffffffffu, lane_expert, item & 31);
        const int first = __shfl_sync(0xffffffffu, lane_first, item & 31);
        const int end = __shfl_sync(0xffffffffu, lane_end, item & 31);
        if (item < num_active) {
          const __nv_bfloat16* base = a.down + static_cast<int64_t>(expert) * a.hidden * a.inter;
#pragma unroll
          for (int c = 0; c < C; ++c) {
            const int d = min(d0 + c, a.hidden - 1);
            w_rows[u][c] = reinterpret_cast<const uint4*>(base + static_cast<int64_t>(d) * a.inter);
          }
          act[u] = a.activated + static_cast<int64_t>(first) * a.inter;
          chunks[u] = a.inter / 8;
          count[u] = end - first;
          out0[u] = first;
          stride[u] = a.inter;
        } else if (item == num_active && has_shared) {
#pragma unroll
          for (int c = 0; c < C; ++c) {
            const int d = min(d0 + c, a.hidden - 1);
            w_rows[u][c] = reinterpret_cast<const uint4*>(a.shared_down + static_cast<int64_t>(d) * a.shared_inter);
          }
          act[u] = a.shared_activated;
          chunks[u] = a.shared_inter / 8;
          count[u] = a.T;
          out0[u] = a.R;
          stride[u] = a.shared_inter;
        } else {
#pragma unroll
          for (int c = 0; c < C; ++c) w_rows[u][c] = nullptr;
          act[u] = nullptr;
          chunks[u] = 0;
          count[u] = 0;
          out0[u] = 0;
          stride[u] = 0;
        }
      }
      uint4 wv[U][C][CPL];
#pragma unroll
      for (int u = 0; u < U; ++u) {
#pragma unroll
        for (int c = 0; c < C; ++c) {
#pragma unroll
          for (int q = 0; q < CPL; ++q) {
            const int ch = seg * kSegment + lane + 32 * q;
            wv[u][c][q] = ch < chunks[u] ? load_streaming(w_rows[u][c] + ch) : make_uint4(0u, 0u, 0u, 0u);
          }
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        for (int r = 0; r < count[u]; ++r) {
          const uint4* x = reinterpret_cast<const uint4*>(act[u] + static_cast<int64_t>(r) * stride[u]);
          float y[C];
#pragma unroll
          for (int c = 0; c < C; ++c) y[c] = 0.0f;
#pragma unroll
          for (int q = 0; q < CPL; ++q) {
            const int ch = seg * kSegment + lane + 32 * q;
            if (ch < chunks[u]) {
              const uint4 xv = __ldg(x + ch);
#pragma unroll
              for (int c = 0; c < C; ++c) y[c] = detail::dot8_bf16(wv[u][c][q], xv, y[c]);
            }
          }
#pragma unroll
          for (int c = 0; c < C; ++c) {
            y[c] = warp_sum(y[c]);
            if (lane == 0) ys[c][out0[u] + r] = seg == 0 ? y[c] : ys[c][out0[u] + r] + y[c];
          }
        }
      }
    }
  }
  __syncwarp();

  // Combine: lane t adds token t's weighted expert rows (order j = 0..k-1), then the shared expert's row.
  if (lane < a.T) {
    const int t = lane;
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int d = d0 + c;
      if (d >= a.hidden) continue;
      float sum = 0.0f;
      for (int j = 0; j < a.k; ++j) {
        const int assignment = t * a.k + j;
        sum = fmaf(__ldg(a.weights + assignment), ys[c][__ldg(a.pos + assignment)], sum);
      }
      float* dst = a.residual + t * a.residual_stride + d;
      float v = *dst + sum;
      if (has_shared) v = v + ys[c][a.R + t];
      *dst = v;
    }
  }
}

// ---- host side ----------------------------------------------------------------------------------------------

bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

// Chunks a lane holds per weight row: the smallest of {1, 2, 4, 9} that covers a row of `chunks` 16-byte chunks,
// else 9 with several segments (9: hidden 2304 in one segment).
int chunks_per_lane(int64_t chunks) {
  const int64_t per_lane = (chunks + 31) / 32;
  for (const int cpl : {1, 2, 4}) {
    if (per_lane <= cpl) return cpl;
  }
  return 9;
}

int expert_blocks(int num_experts) {
  return (num_experts + kWarps - 1) / kWarps;
}

// Slices of the hidden dimension for the router: enough CTAs to spread its weights over the GPU (up to 4 slices),
// each slice at least 32 chunks (one per lane). A function of the shapes only, so the sum order never depends on
// the device.
int router_slices(int num_experts, int64_t hidden) {
  const int blocks = expert_blocks(num_experts);
  int slices = std::clamp(kRouterTargetCtas / blocks, 1, kMaxRouterSlices);
  const int64_t chunks = hidden / 4;
  while (slices > 1 && chunks / slices < 32) --slices;
  return slices;
}

size_t round16(size_t bytes) {
  return (bytes + 15) / 16 * 16;
}

// Dynamic shared memory of the front kernel for `warps` routing warps.
size_t front_smem_bytes(const MoeRoutingConfig& r, int warps) {
  return static_cast<size_t>(warps) * rd::route_scratch_floats(r.num_experts, r.num_groups) * sizeof(float) +
         (2 * kMaxAssignments + r.num_experts) * sizeof(int);
}

// Static shared memory of the front kernel (gate/up partial sums, block-scan totals, the last-CTA flag).
constexpr size_t kFrontStaticSmem = kWarps * 2 * kMaxTokens * sizeof(float) + kWarps * sizeof(int) + sizeof(int);

// Dynamic shared memory of the v2 router kernel for `warps` routing warps (RouterSmem).
size_t router_smem_bytes(const MoeRoutingConfig& r, int warps) {
  const size_t warp_floats = rd::route_scratch_floats(r.num_experts, r.num_groups) + r.num_experts;
  return (static_cast<size_t>(warps) * warp_floats + r.num_experts) * sizeof(float) +
         (2 * kMaxAssignments + r.num_experts) * sizeof(int);
}

// Static shared memory of the v2 router kernel (block-scan totals, the last-CTA flag).
constexpr size_t kRouterStaticSmem = kWarps * sizeof(int) + sizeof(int);

bool env_disabled(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && (std::strcmp(value, "0") == 0 || std::strcmp(value, "off") == 0);
}

constexpr MoeSmallBatchKernel kKernels[] = {MoeSmallBatchKernel::kV1, MoeSmallBatchKernel::kV2};

// DELTASERVE_MOE_SMALL_BATCH_KERNEL, read once per process: kDefault when unset or empty; `valid` false for an
// unknown name.
struct EnvironmentKernel {
  MoeSmallBatchKernel kernel = MoeSmallBatchKernel::kDefault;
  bool valid = true;
  std::string value;
};

const EnvironmentKernel& environment_kernel() {
  static const EnvironmentKernel parsed = [] {
    EnvironmentKernel result;
    const char* value = std::getenv("DELTASERVE_MOE_SMALL_BATCH_KERNEL");
    if (value == nullptr || *value == '\0') return result;
    result.value = value;
    result.valid = false;
    for (const MoeSmallBatchKernel kernel : kKernels) {
      if (std::strcmp(value, moe_small_batch_kernel_name(kernel)) == 0) {
        result.kernel = kernel;
        result.valid = true;
      }
    }
    return result;
  }();
  return parsed;
}

Status check(const MoeSmallBatchParams& p, const char* who) {
  const std::string name(who);
  Status status = moe_routing_check(p.routing, who);
  if (!status) return status;
  const MoeExpertWeights& w = p.experts;
  const int E = p.routing.num_experts, k = p.routing.top_k;
  if (!moe_small_batch_fits(p.tokens, k, E, p.hidden, w.intermediate,
                            p.shared_gate_up != nullptr ? p.shared_intermediate : 0)) {
    return invalid_argument(name + ": shapes outside the small-batch path (T " + std::to_string(p.tokens) +
                            " <= 16, T * top_k <= 256, hidden and intermediates positive multiples of 8)");
  }
  if (w.num_experts != E || w.width != p.hidden) {
    return invalid_argument(name + ": experts must have num_experts = routing.num_experts and width = hidden");
  }
  if (p.kernel != MoeSmallBatchKernel::kDefault && p.kernel != MoeSmallBatchKernel::kV1 &&
      p.kernel != MoeSmallBatchKernel::kV2) {
    return invalid_argument(name + ": unknown kernel");
  }
  if (p.glu == GluKind::kSitu && !(p.situ_beta > 0.0f && p.situ_linear_beta > 0.0f)) {
    return invalid_argument(name + ": SiTU betas must be positive");
  }
  if (p.x_f32_stride < p.hidden || p.x_f32_stride % 4 != 0 || p.x_stride < p.hidden || p.x_stride % 8 != 0 ||
      p.residual_stride < p.hidden) {
    return invalid_argument(name + ": strides must be >= hidden (x_f32_stride a multiple of 4, x_stride of 8)");
  }
  if (p.tokens == 0) return Status::ok();
  if (p.x_f32 == nullptr || p.router == nullptr || p.x == nullptr || w.gate_up == nullptr || w.down == nullptr ||
      p.logits == nullptr || p.expert_ids == nullptr || p.weights == nullptr || p.plan.expert_offsets == nullptr ||
      p.plan.sorted_assignments == nullptr || p.plan.assignment_pos == nullptr || p.activated == nullptr ||
      p.residual == nullptr || p.workspace == nullptr || p.counter == nullptr) {
    return invalid_argument(name + ": inputs, weights, outputs, workspace and counter must be non-null");
  }
  if (p.shared_gate_up != nullptr && (p.shared_down == nullptr || p.shared_activated == nullptr)) {
    return invalid_argument(name + ": a shared expert needs shared_down and shared_activated");
  }
  if (!aligned16(p.x_f32) || !aligned16(p.router) || !aligned16(p.x) || !aligned16(w.gate_up) || !aligned16(w.down) ||
      !aligned16(p.shared_gate_up) || !aligned16(p.shared_down) || !aligned16(p.x_sorted) || !aligned16(p.workspace)) {
    return invalid_argument(name +
                            ": x_f32, router, x, expert weights, x_sorted and workspace must be 16-byte aligned");
  }
  const size_t needed = moe_small_batch_workspace_bytes(p.tokens, k, E, p.hidden);
  if (p.workspace_bytes < needed) {
    return invalid_argument(name + ": workspace needs " + std::to_string(needed) + " bytes (got " +
                            std::to_string(p.workspace_bytes) + ")");
  }
  return Status::ok();
}

// Kernel arguments and launch shapes from validated params, for kernel kV1 or kV2.
LayerArgs make_args(const MoeSmallBatchParams& p, MoeSmallBatchKernel kernel) {
  LayerArgs a{};
  const MoeRoutingConfig& r = p.routing;
  a.T = static_cast<int>(p.tokens);
  a.E = r.num_experts;
  a.k = r.top_k;
  a.hidden = static_cast<int>(p.hidden);
  a.inter = static_cast<int>(p.experts.intermediate);
  a.shared_inter = p.shared_gate_up != nullptr ? static_cast<int>(p.shared_intermediate) : 0;
  a.R = a.T * a.k;
  a.route = {r.num_experts, r.top_k, r.num_groups, r.top_k_groups, r.renormalize, r.routed_scaling_factor};
  a.x_f32 = p.x_f32;
  a.x_f32_stride = p.x_f32_stride;
  a.router = p.router;
  a.bias = p.correction_bias;
  a.router_slices = router_slices(a.E, p.hidden);
  const int chunks = a.hidden / 4;
  a.slice_chunks = (chunks + a.router_slices - 1) / a.router_slices;
  a.expert_blocks = expert_blocks(a.E);
  a.router_ctas = a.expert_blocks * a.router_slices;
  const bool v2 = kernel == MoeSmallBatchKernel::kV2;
  const size_t warp_bytes = v2 ? router_smem_bytes(r, 1) - router_smem_bytes(r, 0)
                               : rd::route_scratch_floats(r.num_experts, r.num_groups) * sizeof(float);
  const size_t fixed = v2 ? router_smem_bytes(r, 0) + kRouterStaticSmem : front_smem_bytes(r, 0) + kFrontStaticSmem;
  a.route_warps = static_cast<int>(std::clamp<size_t>((kSharedLimit - fixed) / warp_bytes, 1, kWarps));
  a.partials = static_cast<float*>(p.workspace);
  a.x = p.x;
  a.x_stride = p.x_stride;
  a.gate_up = p.experts.gate_up;
  a.down = p.experts.down;
  a.shared_gate_up = p.shared_gate_up;
  a.shared_down = p.shared_gate_up != nullptr ? p.shared_down : nullptr;
  a.glu = {p.glu == GluKind::kSitu ? 1 : 0, p.situ_beta, p.situ_linear_beta};
  a.logits = p.logits;
  a.expert_ids = p.expert_ids;
  a.weights = p.weights;
  a.offsets = p.plan.expert_offsets;
  a.sorted = p.plan.sorted_assignments;
  a.pos = p.plan.assignment_pos;
  a.x_sorted = p.x_sorted;
  a.activated = p.activated;
  a.shared_activated = p.shared_activated;
  a.residual = p.residual;
  a.residual_stride = p.residual_stride;
  char* ws = static_cast<char*>(p.workspace);
  const size_t partial_bytes = round16(static_cast<size_t>(a.router_slices) * a.T * a.E * sizeof(float));
  a.active = reinterpret_cast<int32_t*>(ws + partial_bytes);
  a.active_capacity = std::min(a.E, a.R);
  a.num_active = a.active + a.active_capacity;
  a.slot_first = v2 ? a.num_active + 1 : nullptr;
  a.slot_count = v2 ? a.slot_first + a.active_capacity : nullptr;
  a.counter = p.counter;
  return a;
}

template <class Kernel>
Kernel pick(int cpl, Kernel k1, Kernel k2, Kernel k4, Kernel k9) {
  return cpl == 1 ? k1 : cpl == 2 ? k2 : cpl == 4 ? k4 : k9;
}

// The kernels validated params run: p.kernel, kDefault resolved through the environment (kV2 when unset), and kV2
// falling back to kV1 for shapes its expert launches do not take. Launch 1 differs between the two (v1 computes the
// shared expert's gate/up there, v2 in launch 2), so route and experts both ask this of the same params.
Status select_kernel(const MoeSmallBatchParams& p, const char* who, MoeSmallBatchKernel* kernel) {
  MoeSmallBatchKernel selected = p.kernel;
  if (selected == MoeSmallBatchKernel::kDefault) {
    const EnvironmentKernel& environment = environment_kernel();
    if (!environment.valid) {
      return invalid_argument(std::string(who) + ": DELTASERVE_MOE_SMALL_BATCH_KERNEL must be v1 or v2, got '" +
                              environment.value + "'");
    }
    selected = environment.kernel == MoeSmallBatchKernel::kDefault ? MoeSmallBatchKernel::kV2 : environment.kernel;
  }
  if (selected == MoeSmallBatchKernel::kV2 &&
      !moe_small_batch_detail::pipeline_fits(make_args(p, MoeSmallBatchKernel::kV2))) {
    selected = MoeSmallBatchKernel::kV1;
  }
  *kernel = selected;
  return Status::ok();
}

}  // namespace

const char* moe_small_batch_kernel_name(MoeSmallBatchKernel kernel) {
  switch (kernel) {
    case MoeSmallBatchKernel::kV1:
      return "v1";
    case MoeSmallBatchKernel::kV2:
      return "v2";
    case MoeSmallBatchKernel::kDefault:
      break;
  }
  return "default";
}

MoeSmallBatchKernel moe_small_batch_kernel_for(const MoeSmallBatchParams& params) {
  MoeSmallBatchKernel kernel = MoeSmallBatchKernel::kDefault;
  if (!check(params, "moe_small_batch_kernel_for") || !select_kernel(params, "moe_small_batch_kernel_for", &kernel)) {
    return MoeSmallBatchKernel::kDefault;
  }
  return kernel;
}

bool moe_small_batch_fits(int64_t tokens, int top_k, int num_experts, int64_t hidden, int64_t intermediate,
                          int64_t shared_intermediate) {
  const auto multiple_of_8 = [](int64_t v) { return v >= 8 && v % 8 == 0 && v <= (int64_t{1} << 20); };
  return tokens >= 0 && tokens <= kMoeSmallBatchMaxTokens && top_k >= 1 && num_experts >= 1 &&
         tokens * top_k <= kMoeSmallBatchMaxAssignments && multiple_of_8(hidden) && multiple_of_8(intermediate) &&
         (shared_intermediate == 0 || multiple_of_8(shared_intermediate));
}

size_t moe_small_batch_workspace_bytes(int64_t tokens, int top_k, int num_experts, int64_t hidden) {
  if (tokens < 0 || top_k < 1 || num_experts < 1 || hidden < 4) return 0;
  const int slices = router_slices(num_experts, hidden);
  // The active list, its count, and v2's first row and row count per active slot.
  const int64_t capacity = std::min<int64_t>(num_experts, tokens * top_k);
  return round16(static_cast<size_t>(slices * tokens * num_experts) * sizeof(float)) +
         round16(static_cast<size_t>(3 * capacity + 1) * sizeof(int32_t));
}

Status moe_small_batch_route(const MoeSmallBatchParams& params, cudaStream_t stream) {
  Status status = check(params, "moe_small_batch_route");
  if (!status || params.tokens == 0) return status;
  MoeSmallBatchKernel kernel = MoeSmallBatchKernel::kDefault;
  DS_RETURN_IF_ERROR(select_kernel(params, "moe_small_batch_route", &kernel));
  const LayerArgs a = make_args(params, kernel);
  if (kernel == MoeSmallBatchKernel::kV2) {
    return moe_small_batch_detail::launch_with_pdl(small_batch_router_kernel, static_cast<unsigned>(a.router_ctas),
                                                   kThreads, router_smem_bytes(params.routing, a.route_warps), stream,
                                                   "moe_small_batch_route", a);
  }
  const int cpl = chunks_per_lane(a.hidden / 8);
  const int shared_ctas = a.shared_gate_up != nullptr ? (a.shared_inter + kWarps - 1) / kWarps : 0;
  const size_t smem = front_smem_bytes(params.routing, a.route_warps);
  const auto front = pick(cpl, small_batch_front_kernel<1>, small_batch_front_kernel<2>, small_batch_front_kernel<4>,
                          small_batch_front_kernel<9>);
  front<<<a.router_ctas + shared_ctas, kThreads, smem, stream>>>(a);
  return launch_status("moe_small_batch_route");
}

Status moe_small_batch_experts(const MoeSmallBatchParams& params, cudaStream_t stream) {
  Status status = check(params, "moe_small_batch_experts");
  if (!status || params.tokens == 0) return status;
  MoeSmallBatchKernel kernel = MoeSmallBatchKernel::kDefault;
  DS_RETURN_IF_ERROR(select_kernel(params, "moe_small_batch_experts", &kernel));
  const LayerArgs a = make_args(params, kernel);
  if (kernel == MoeSmallBatchKernel::kV2) return moe_small_batch_detail::launch_pipeline_experts(a, stream);
  // Launch 2: min(E, R) expert slots (the active count is only known on the device) x I / 8 column blocks.
  const int64_t slots = std::min(a.E, a.R);
  const int64_t gate_up_ctas = slots * (a.inter / kWarps);
  if (gate_up_ctas > 0x7fffffff) return invalid_argument("moe_small_batch_experts: too many gate/up CTAs");
  const auto gate_up = pick(chunks_per_lane(a.hidden / 8), small_batch_gate_up_kernel<1>, small_batch_gate_up_kernel<2>,
                            small_batch_gate_up_kernel<4>, small_batch_gate_up_kernel<9>);
  gate_up<<<static_cast<unsigned>(gate_up_ctas), kThreads, 0, stream>>>(a);
  status = launch_status("moe_small_batch_experts gate/up");
  if (!status) return status;
  const int down_ctas = (a.hidden + kWarps * kDownColumnsPerWarp - 1) / (kWarps * kDownColumnsPerWarp);
  const auto down = pick(chunks_per_lane(std::max(a.inter, a.shared_inter) / 8), small_batch_down_kernel<1>,
                         small_batch_down_kernel<2>, small_batch_down_kernel<4>, small_batch_down_kernel<9>);
  down<<<down_ctas, kThreads, 0, stream>>>(a);
  return launch_status("moe_small_batch_experts down");
}

Status moe_small_batch_layer(const MoeSmallBatchParams& params, cudaStream_t stream) {
  Status status = moe_small_batch_route(params, stream);
  if (!status) return status;
  return moe_small_batch_experts(params, stream);
}

bool moe_small_batch_enabled() {
  static const bool enabled = !env_disabled("DELTASERVE_MOE_SMALL_BATCH");
  return enabled;
}

}  // namespace deltaserve::kernels::cuda
