// The small-batch MoE decode layer's first kernels, v1 (DELTASERVE_MOE_SMALL_BATCH_KERNEL=v1 or
// MoeSmallBatchParams::kernel = kV1; contract in moe.hpp, dispatch, v2 and the measured figures in
// moe_small_batch.cu). Kept to compare against v2 and for shapes v2 does not take.
//
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
#include <algorithm>
#include <cstdint>

#include "kernels/cuda/common/detail/bf16_stream.cuh"
#include "kernels/cuda/common/launch_status.hpp"
#include "kernels/cuda/moe/moe.hpp"
#include "kernels/cuda/moe/detail/route.cuh"
#include "kernels/cuda/moe/detail/small_batch.cuh"

namespace deltaserve::kernels::cuda::moe_small_batch_detail {
namespace {

namespace rd = moe_route_device;

constexpr int kMaxOutRows = kMaxAssignments + kMaxTokens;  // routed rows, then the shared expert's
constexpr int kDownColumnsPerWarp = 2;

using detail::load_streaming;

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

// Chunks a lane holds per weight row: the smallest of {1, 2, 4, 9} that covers a row of `chunks` 16-byte chunks,
// else 9 with several segments (9: hidden 2304 in one segment).
int chunks_per_lane(int64_t chunks) {
  const int64_t per_lane = (chunks + 31) / 32;
  for (const int cpl : {1, 2, 4}) {
    if (per_lane <= cpl) return cpl;
  }
  return 9;
}

// Dynamic shared memory of the front kernel for `warps` routing warps.
size_t front_smem_bytes(const MoeRoutingConfig& r, int warps) {
  return static_cast<size_t>(warps) * rd::route_scratch_floats(r.num_experts, r.num_groups) * sizeof(float) +
         (2 * kMaxAssignments + r.num_experts) * sizeof(int);
}

// Static shared memory of the front kernel (gate/up partial sums, block-scan totals, the last-CTA flag).
constexpr size_t kFrontStaticSmem = kWarps * 2 * kMaxTokens * sizeof(float) + kWarps * sizeof(int) + sizeof(int);

template <class Kernel>
Kernel pick(int cpl, Kernel k1, Kernel k2, Kernel k4, Kernel k9) {
  return cpl == 1 ? k1 : cpl == 2 ? k2 : cpl == 4 ? k4 : k9;
}

}  // namespace

int v1_route_warps(const MoeRoutingConfig& routing) {
  const size_t warp_bytes = rd::route_scratch_floats(routing.num_experts, routing.num_groups) * sizeof(float);
  const size_t fixed = front_smem_bytes(routing, 0) + kFrontStaticSmem;
  return static_cast<int>(std::clamp<size_t>((kSharedLimit - fixed) / warp_bytes, 1, kWarps));
}

Status launch_v1_route(const LayerArgs& a, const MoeRoutingConfig& routing, cudaStream_t stream) {
  const int cpl = chunks_per_lane(a.hidden / 8);
  const int shared_ctas = a.shared_gate_up != nullptr ? (a.shared_inter + kWarps - 1) / kWarps : 0;
  const size_t smem = front_smem_bytes(routing, a.route_warps);
  const auto front = pick(cpl, small_batch_front_kernel<1>, small_batch_front_kernel<2>, small_batch_front_kernel<4>,
                          small_batch_front_kernel<9>);
  front<<<a.router_ctas + shared_ctas, kThreads, smem, stream>>>(a);
  return launch_status("moe_small_batch_route");
}

Status launch_v1_experts(const LayerArgs& a, cudaStream_t stream) {
  // Launch 2: min(E, R) expert slots (the active count is only known on the device) x I / 8 column blocks.
  const int64_t slots = std::min(a.E, a.R);
  const int64_t gate_up_ctas = slots * (a.inter / kWarps);
  if (gate_up_ctas > 0x7fffffff) return invalid_argument("moe_small_batch_experts: too many gate/up CTAs");
  const auto gate_up = pick(chunks_per_lane(a.hidden / 8), small_batch_gate_up_kernel<1>, small_batch_gate_up_kernel<2>,
                            small_batch_gate_up_kernel<4>, small_batch_gate_up_kernel<9>);
  gate_up<<<static_cast<unsigned>(gate_up_ctas), kThreads, 0, stream>>>(a);
  Status status = launch_status("moe_small_batch_experts gate/up");
  if (!status) return status;
  const int down_ctas = (a.hidden + kWarps * kDownColumnsPerWarp - 1) / (kWarps * kDownColumnsPerWarp);
  const auto down = pick(chunks_per_lane(std::max(a.inter, a.shared_inter) / 8), small_batch_down_kernel<1>,
                         small_batch_down_kernel<2>, small_batch_down_kernel<4>, small_batch_down_kernel<9>);
  down<<<down_ctas, kThreads, 0, stream>>>(a);
  return launch_status("moe_small_batch_experts down");
}

}  // namespace deltaserve::kernels::cuda::moe_small_batch_detail
