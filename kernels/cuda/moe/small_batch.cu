// Small-batch MoE decode layer (contract in moe.hpp, "small-batch decode layer"): validation, launch shapes and
// launch 1; launches 2 and 3 are in small_batch_pipeline.cu, what they share in detail/small_batch.cuh.
//
// Why this shape. At batch 1 the layer reads 8 routed + 1 shared experts (Kimi-Linear-48B: 9 x 14.2 MB) plus the
// fp32 router (2.4 MB); a chain of router GEMM, route, plan, gather, expert FFN, combine and shared FFN spends most
// of its time in a dozen dependent launches that stream little or nothing. The dependencies leave three launches:
// routing, gate/up of the chosen experts, down of them (which needs all of an expert's activations).
//   * Programmatic dependent launch on all three: each grid becomes resident while the one before it drains, issues
//     what does not depend on it (launch 1: the router rows and the correction bias; launch 2: x and the shared
//     expert's gate/up; launch 3: the first stages' down rows of the routed and shared experts, the routing being
//     launch 1's) and then waits for it (griddepcontrol.wait) before reading its output; it starts its own
//     dependents only after that wait, so a grid that starts early still runs after everything before the previous
//     one (launch 3's early reads of launch 1's routing rely on it).
//   * The shared expert's gate/up runs in launch 2, ahead of the routed items: it streams while launch 1's last CTA
//     routes, and launch 1 carries only the router, so the routing ends sooner.
//   * Launches 2 and 3 stream through shared-memory rings filled by bulk copies, persistent over balanced work
//     lists, and multiply on tensor cores (small_batch_pipeline.cu).
//   * Launch 1's last CTA routes from shared memory (its token's logits and the bias), without reading back its own
//     global writes; ungrouped routing (both Kimi configs) by the whole CTA (route_parallel), whose phases are each a
//     few hundred instructions where one warp a token runs k dependent selection rounds and the sigmoid of every
//     expert; small plans by one warp (build_plan_warp).
#include <algorithm>
#include <climits>
#include <cmath>
#include <string>

#include "kernels/cuda/common/launch_status.hpp"
#include "kernels/cuda/moe/detail/route.cuh"
#include "kernels/cuda/moe/detail/small_batch.cuh"
#include "kernels/cuda/moe/moe.hpp"

namespace deltaserve::kernels::cuda {
namespace {

namespace rd = moe_route_device;

using moe_small_batch_detail::allow_dependent_grids;
using moe_small_batch_detail::build_plan;
using moe_small_batch_detail::grid_dependency_wait;
using moe_small_batch_detail::kMaxAssignments;
using moe_small_batch_detail::kMaxTokens;
using moe_small_batch_detail::kRouterGroup;
using moe_small_batch_detail::kSharedLimit;
using moe_small_batch_detail::kThreads;
using moe_small_batch_detail::kTriggerAfterRouting;
using moe_small_batch_detail::kTriggerAfterWait;
using moe_small_batch_detail::kWarps;
using moe_small_batch_detail::LayerArgs;
using moe_small_batch_detail::load_router_group;
using moe_small_batch_detail::router_group_dot;
using moe_small_batch_detail::store_router_partials;

constexpr int kRouterTargetCtas = 128;  // router CTAs aimed at (slices of the hidden dimension fill them up)
constexpr int kMaxRouterSlices = 4;
constexpr int kLogitBatch = 8;  // experts per lane whose partial sums the routing warps load at once
constexpr int kPairBatch = 4;   // (token, expert) pairs per thread whose partial sums route_parallel loads at once

// ---- launch 1: router, route, plan --------------------------------------------------------------------------------

// Dynamic shared memory of the router kernel: the routing region (route_region_floats: per routing warp
// [route scratch | the token's logits (E)], or the parallel routing's [probs (P E, rounded up to even) | candidate
// keys (P C, 8 bytes each)]), then the correction bias [E], ids [kMaxAssignments], sorted [kMaxAssignments],
// counts [E].
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
  s.bias = s.warps + a.route_region_floats;
  s.ids = reinterpret_cast<int*>(s.bias + a.E);
  s.sorted = s.ids + kMaxAssignments;
  s.counts = s.sorted + kMaxAssignments;
  return s;
}

// Logit (t, e): the slices' partial sums added in slice order. Written by other CTAs: read from L2.
__device__ __forceinline__ float router_logit(const LayerArgs& a, int t, int e) {
  float v[kMaxRouterSlices];
#pragma unroll
  for (int slice = 0; slice < kMaxRouterSlices; ++slice) {
    v[slice] = slice < a.router_slices ? __ldcg(a.partials + (static_cast<int64_t>(slice) * a.T + t) * a.E + e) : 0.0f;
  }
  float sum = v[0];
#pragma unroll
  for (int slice = 1; slice < kMaxRouterSlices; ++slice) {
    if (slice < a.router_slices) sum += v[slice];
  }
  return sum;
}

// Ungrouped routing by the whole CTA, route_pass_tokens tokens at a time. The order is the warp router's (score
// s + bias descending, then the lower index; NaN scores as -inf) as one 64-bit key per expert, [score key | ~e]:
//   A. every (token, expert): the logit (written out), s = sigmoid(logit) into shared memory;
//   B. one warp per (token, 32 experts): each lane's rank in its chunk (32 shuffles of the score key, equal keys
//      ordered by lane); the chunk's top min(k, 32) keys are the token's candidates (a top-k expert is in its
//      chunk's top k), slots of short chunks get key 0;
//   C. one thread per candidate: its rank among the token's candidates; rank j < k is choice j;
//   D. one warp per token: the weights, s of choice j summed in choice order (the warp router's operations).
// Same ids and bitwise the same weights as rd::route_token, without its k dependent selection rounds in one warp.
__device__ void route_parallel(const LayerArgs& a, const RouterSmem& s) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int T = a.T, E = a.E, k = a.k, P = a.route_pass_tokens;
  const int chunks = (E + 31) / 32, kk = min(k, 32), C = chunks * kk;
  float* probs = s.warps;                                                            // [P][E]
  auto* cand = reinterpret_cast<unsigned long long*>(s.warps + ((P * E + 1) & ~1));  // [P][C]
  for (int t0 = 0; t0 < T; t0 += P) {
    const int tokens = min(P, T - t0);
    const int pairs = tokens * E;
    for (int base = tid; base < pairs; base += kThreads * kPairBatch) {
      float logit[kPairBatch];  // kPairBatch pairs' partial sums in flight at once
#pragma unroll
      for (int b = 0; b < kPairBatch; ++b) {
        const int i = base + b * kThreads, tt = i / E;
        logit[b] = i < pairs ? router_logit(a, t0 + tt, i - tt * E) : 0.0f;
      }
#pragma unroll
      for (int b = 0; b < kPairBatch; ++b) {
        const int i = base + b * kThreads;
        if (i < pairs) {
          a.logits[static_cast<int64_t>(t0) * E + i] = logit[b];
          probs[i] = rd::router_sigmoid(logit[b]);
        }
      }
    }
    __syncthreads();
    for (int task = warp; task < tokens * chunks; task += kWarps) {
      const int tt = task / chunks, chunk = task - tt * chunks, e = chunk * 32 + lane;
      unsigned key = 0u;  // below every score's key: experts past E rank last
      if (e < E) {
        const float score = probs[tt * E + e] + (a.bias != nullptr ? s.bias[e] : 0.0f);
        key = rd::score_key(isnan(score) ? -INFINITY : score);
      }
      int rank = 0;  // equal keys: the lower lane (= the lower expert) first
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        const unsigned other = __shfl_sync(0xffffffffu, key, j);
        rank += other > key || (other == key && j < lane) ? 1 : 0;
      }
      if (rank < kk) {
        cand[tt * C + chunk * kk + rank] =
            e < E ? (static_cast<unsigned long long>(key) << 32) | (0xffffffffu - static_cast<unsigned>(e)) : 0ull;
      }
    }
    __syncthreads();
    for (int i = tid; i < tokens * C; i += kThreads) {
      const unsigned long long key = cand[i];
      if (key == 0ull) continue;
      const int tt = i / C;
      const unsigned long long* row = cand + tt * C;
      int rank = 0;
#pragma unroll 8
      for (int j = 0; j < C; ++j) rank += row[j] > key ? 1 : 0;
      if (rank < k) s.ids[(t0 + tt) * k + rank] = static_cast<int>(0xffffffffu - static_cast<unsigned>(key));
    }
    __syncthreads();
    for (int tt = warp; tt < tokens; tt += kWarps) {
      const int t = t0 + tt;
      const float p = lane < k ? probs[tt * E + s.ids[t * k + lane]] : 0.0f;
      float sum = 0.0f;
      for (int j = 0; j < k; ++j) sum += __shfl_sync(0xffffffffu, p, j);
      if (lane < k) {
        float w = p;
        if (a.route.renormalize) w = __fdiv_rn(w, __fadd_rn(sum, 1e-20f));
        a.weights[t * k + lane] = __fmul_rn(w, a.route.routed_scaling_factor);
      }
    }
    __syncthreads();  // probs and candidates are the next pass's; the ids are complete for the plan
  }
}

// build_plan's outputs for R <= 32 assignments without the gather: warp 0 holds assignment j in lane j and finds
// its expert's earlier assignments (match_any) and the assignments and active experts of lower ids (R shuffles); the
// expert offsets (assignments below each e) by the whole CTA. No block barrier after the routing's.
__device__ void build_plan_warp(const LayerArgs& a, const int* ids_s) {
  const int tid = threadIdx.x, lane = tid & 31;
  const int E = a.E, R = a.R;
  for (int e = tid; e <= E; e += kThreads) {
    int below = 0;
    for (int j = 0; j < R; ++j) below += ids_s[j] < e ? 1 : 0;
    a.offsets[e] = below;  // offsets[E] = R: every routed id is valid
  }
  if (tid >= 32) return;
  const bool valid = lane < R;
  const int id = valid ? ids_s[lane] : INT_MAX;  // lanes past R: above every expert, never written
  const unsigned same = __match_any_sync(0xffffffffu, id);
  const int rank = __popc(same & ((1u << lane) - 1u));  // earlier assignments of the same expert
  const bool leader = valid && rank == 0;
  const unsigned leaders = __ballot_sync(0xffffffffu, leader);
  int below = 0, slot = 0;  // assignments of lower ids; active experts of lower ids
  for (int j = 0; j < R; ++j) {
    const int other = __shfl_sync(0xffffffffu, id, j);
    below += other < id ? 1 : 0;
    slot += other < id && ((leaders >> j) & 1u) != 0 ? 1 : 0;
  }
  if (valid) {
    a.expert_ids[lane] = id;
    a.sorted[below + rank] = lane;  // stable, as moe_plan
    a.pos[lane] = below + rank;
  }
  if (leader) {
    a.active[slot] = id;
    a.slot_first[slot] = below;
    a.slot_count[slot] = __popc(same);
  }
  if (lane == 0) *a.num_active = __popc(leaders);
}

// Logits, routing, plan; run by the last router CTA only. Ungrouped: route_parallel. Grouped: each routing
// warp adds its token's partial sums into its own shared-memory row (and the logits output) and routes from there
// with the bias from shared memory (loaded before the router's wait), so no step waits on the CTA's own global
// writes.
__device__ void finish_route(const LayerArgs& a, const RouterSmem& s) {
  if (a.route_pass_tokens > 0) {
    route_parallel(a, s);
    if (a.router_trigger == kTriggerAfterRouting) allow_dependent_grids();
    if (a.warp_plan) {
      build_plan_warp(a, s.ids);
    } else {
      build_plan(a, s.ids, s.sorted, s.counts);
    }
    return;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int T = a.T, E = a.E, k = a.k;
  const int scratch_floats = rd::route_scratch_floats(E, a.route.num_groups);
  if (warp < a.route_warps) {
    float* scratch = s.warps + warp * s.warp_floats;
    float* logits = scratch + scratch_floats;
    for (int t = warp; t < T; t += a.route_warps) {
      // A batch of kLogitBatch experts' partials of every slice in flight at once (E = 256: one round trip).
      for (int base = lane; base < E; base += 32 * kLogitBatch) {
        float v[kLogitBatch];
#pragma unroll
        for (int i = 0; i < kLogitBatch; ++i) v[i] = base + 32 * i < E ? router_logit(a, t, base + 32 * i) : 0.0f;
#pragma unroll
        for (int i = 0; i < kLogitBatch; ++i) {
          const int e = base + 32 * i;
          if (e < E) {
            logits[e] = v[i];
            a.logits[static_cast<int64_t>(t) * E + e] = v[i];
          }
        }
      }
      __syncwarp();
      rd::route_token(a.route, logits, a.bias != nullptr ? s.bias : nullptr, scratch, s.ids + t * k, a.weights + t * k);
    }
  }
  // The warp routing routes token by token: the later trigger fires once every token is routed.
  if (a.router_trigger == kTriggerAfterRouting) allow_dependent_grids();
  __syncthreads();
  build_plan(a, s.ids, s.sorted, s.counts);
}

// Router partial sums (slice `slice` of the hidden dimension, expert e per warp), then the last CTA to finish routes.
// Launched with programmatic dependent launch: the router rows of the first group and the correction bias are
// weights, loaded before waiting for the previous grid; x_f32 and every write come after the wait.
__global__ void __launch_bounds__(kThreads, 2) small_batch_router_kernel(const __grid_constant__ LayerArgs a) {
  extern __shared__ __align__(16) unsigned char router_smem[];
  __shared__ int is_last;
  __shared__ float norm_sums[kMaxTokens * 8], inverse_rms[kMaxTokens];  // the fused input norm
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
  if (a.router_trigger == kTriggerAfterWait) allow_dependent_grids();

  // The fused input norm: every CTA takes the rows' 1 / rms itself (the rows are in L2: a few KB a token).
  const bool normed = a.norm_weight != nullptr;
  if (normed) {
    moe_small_batch_detail::rows_inverse_rms(a.x_f32, a.x_f32_stride, a.hidden, a.T, a.norm_eps, tid, norm_sums,
                                             inverse_rms, [] { __syncthreads(); });
  }
  if (e < a.E) {
    float acc[kMaxTokens];
#pragma unroll
    for (int t = 0; t < kMaxTokens; ++t) acc[t] = 0.0f;
    for (int base = first_base; base < c1; base += 32 * kRouterGroup) {
      if (base != first_base) load_router_group(w, base, c1, wv);
      if (normed) {
        moe_small_batch_detail::router_group_dot_normed(a, wv, base, c1, inverse_rms, acc);
      } else {
        router_group_dot(a, wv, base, c1, acc);
      }
    }
    store_router_partials(a, acc, slice, e);
  }

  __threadfence();
  __syncthreads();  // also: bias and counts in shared memory
  if (tid == 0) is_last = atomicAdd(a.counter, 1u) == static_cast<unsigned>(a.router_ctas - 1);
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  finish_route(a, s);
  if (tid == 0) atomicExch(a.counter, 0u);
}

// ---- host side ----------------------------------------------------------------------------------------------

bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
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

// Dynamic shared memory of the router kernel with a routing region of `region_floats` (RouterSmem).
size_t router_smem_bytes(const MoeRoutingConfig& r, size_t region_floats) {
  return (region_floats + r.num_experts) * sizeof(float) + (2 * kMaxAssignments + r.num_experts) * sizeof(int);
}

// Floats of the routing region: `warps` routing warps, or `pass_tokens` tokens of route_parallel.
size_t warp_route_floats(const MoeRoutingConfig& r, int warps) {
  return static_cast<size_t>(warps) * (rd::route_scratch_floats(r.num_experts, r.num_groups) + r.num_experts);
}
size_t parallel_route_floats(const MoeRoutingConfig& r, int pass_tokens) {
  const size_t probs = (static_cast<size_t>(pass_tokens) * r.num_experts + 1) / 2 * 2;
  const size_t candidates = static_cast<size_t>((r.num_experts + 31) / 32) * std::min(r.top_k, 32);
  return probs + 2 * candidates * pass_tokens;
}

// Static shared memory of the router kernel (block-scan totals, the last-CTA flag, the fused norm's sums).
constexpr size_t kRouterStaticSmem = kWarps * sizeof(int) + sizeof(int) + kMaxTokens * 9 * sizeof(float);

// When launch 1 lets launch 2 start (RouterTrigger): right after the wait at one token, after the routing from two
// tokens on, each the faster at its token counts in the decode step.
int router_trigger_for(int tokens) {
  return tokens >= 2 ? kTriggerAfterRouting : kTriggerAfterWait;
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
                            " <= 16, T * top_k <= 256, hidden and intermediates positive multiples of 8, staged "
                            "rows within the shared-memory budgets)");
  }
  if (w.num_experts != E || w.width != p.hidden) {
    return invalid_argument(name + ": experts must have num_experts = routing.num_experts and width = hidden");
  }
  if (p.glu == GluKind::kSitu && !(p.situ_beta > 0.0f && p.situ_linear_beta > 0.0f)) {
    return invalid_argument(name + ": SiTU betas must be positive");
  }
  if (p.x_f32_stride < p.hidden || p.x_f32_stride % 4 != 0 || p.x_stride < p.hidden || p.x_stride % 8 != 0 ||
      p.residual_stride < p.hidden) {
    return invalid_argument(name + ": strides must be >= hidden (x_f32_stride a multiple of 4, x_stride of 8)");
  }
  const bool fused_norm = p.norm_weight != nullptr;
  if (fused_norm && !(p.norm_eps >= 0.0f && std::isfinite(p.norm_eps))) {
    return invalid_argument(name + ": norm_eps must be finite and >= 0");
  }
  if (fused_norm && p.x_sorted != nullptr) return invalid_argument(name + ": the fused norm writes no x_sorted");
  if (p.tokens == 0) return Status::ok();
  if (fused_norm && !aligned16(p.norm_weight)) return invalid_argument(name + ": norm_weight must be 16-byte aligned");
  if (p.x_f32 == nullptr || p.router == nullptr || (p.x == nullptr && !fused_norm) || w.gate_up == nullptr ||
      w.down == nullptr || p.logits == nullptr || p.expert_ids == nullptr || p.weights == nullptr ||
      p.plan.expert_offsets == nullptr || p.plan.sorted_assignments == nullptr || p.plan.assignment_pos == nullptr ||
      p.activated == nullptr || p.residual == nullptr || p.workspace == nullptr || p.counter == nullptr) {
    return invalid_argument(name + ": inputs, weights, outputs, workspace and counter must be non-null");
  }
  if (p.shared_gate_up != nullptr && (p.shared_down == nullptr || p.shared_activated == nullptr)) {
    return invalid_argument(name + ": a shared expert needs shared_down and shared_activated");
  }
  // The activation rows are bulk-copied by launch 3: 16-byte aligned as well.
  if (!aligned16(p.x_f32) || !aligned16(p.router) || !aligned16(p.x) || !aligned16(w.gate_up) || !aligned16(w.down) ||
      !aligned16(p.shared_gate_up) || !aligned16(p.shared_down) || !aligned16(p.x_sorted) || !aligned16(p.workspace) ||
      !aligned16(p.activated) || !aligned16(p.shared_activated)) {
    return invalid_argument(name +
                            ": x_f32, router, x, expert weights, x_sorted, workspace, activated and shared_activated "
                            "must be 16-byte aligned");
  }
  const size_t needed = moe_small_batch_workspace_bytes(p.tokens, k, E, p.hidden);
  if (p.workspace_bytes < needed) {
    return invalid_argument(name + ": workspace needs " + std::to_string(needed) + " bytes (got " +
                            std::to_string(p.workspace_bytes) + ")");
  }
  return Status::ok();
}

// Kernel arguments and launch shapes from validated params.
LayerArgs make_args(const MoeSmallBatchParams& p) {
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
  a.norm_weight = p.norm_weight;
  a.norm_eps = p.norm_eps;
  a.router = p.router;
  a.bias = p.correction_bias;
  a.router_slices = router_slices(a.E, p.hidden);
  const int chunks = a.hidden / 4;
  a.slice_chunks = (chunks + a.router_slices - 1) / a.router_slices;
  a.expert_blocks = expert_blocks(a.E);
  a.router_ctas = a.expert_blocks * a.router_slices;
  if (r.num_groups == 1) {
    // The CTA-wide routing, as many tokens a pass as fit (all of them, for the models' expert counts).
    a.route_pass_tokens = std::max(a.T, 1);
    while (a.route_pass_tokens > 1 &&
           router_smem_bytes(r, parallel_route_floats(r, a.route_pass_tokens)) + kRouterStaticSmem > kSharedLimit) {
      --a.route_pass_tokens;
    }
    a.route_region_floats = static_cast<int>(parallel_route_floats(r, a.route_pass_tokens));
  } else {
    // Grouped routing: one warp a token, as many routing warps as fit.
    const size_t fixed = router_smem_bytes(r, 0) + kRouterStaticSmem;
    const size_t warp_bytes = warp_route_floats(r, 1) * sizeof(float);
    a.route_warps = static_cast<int>(std::clamp<size_t>((kSharedLimit - fixed) / warp_bytes, 1, kWarps));
    a.route_region_floats = static_cast<int>(warp_route_floats(r, a.route_warps));
  }
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
  a.warp_plan = a.route_pass_tokens > 0 && a.R <= 32 && p.x_sorted == nullptr ? 1 : 0;
  a.activated = p.activated;
  a.shared_activated = p.shared_activated;
  a.residual = p.residual;
  a.residual_stride = p.residual_stride;
  char* ws = static_cast<char*>(p.workspace);
  const size_t partial_bytes = round16(static_cast<size_t>(a.router_slices) * a.T * a.E * sizeof(float));
  a.active = reinterpret_cast<int32_t*>(ws + partial_bytes);
  a.active_capacity = std::min(a.E, a.R);
  a.num_active = a.active + a.active_capacity;
  a.slot_first = a.num_active + 1;
  a.slot_count = a.slot_first + a.active_capacity;
  a.counter = p.counter;
  a.router_trigger = router_trigger_for(a.T);
  return a;
}

}  // namespace

bool moe_small_batch_fits(int64_t tokens, int top_k, int num_experts, int64_t hidden, int64_t intermediate,
                          int64_t shared_intermediate) {
  const auto multiple_of_8 = [](int64_t v) { return v >= 8 && v % 8 == 0 && v <= (int64_t{1} << 20); };
  return tokens >= 0 && tokens <= kMoeSmallBatchMaxTokens && top_k >= 1 && num_experts >= 1 &&
         tokens * top_k <= kMoeSmallBatchMaxAssignments && multiple_of_8(hidden) && multiple_of_8(intermediate) &&
         (shared_intermediate == 0 || multiple_of_8(shared_intermediate)) &&
         moe_small_batch_detail::pipeline_fits(static_cast<int>(tokens), top_k, num_experts, static_cast<int>(hidden),
                                               static_cast<int>(intermediate), static_cast<int>(shared_intermediate));
}

size_t moe_small_batch_workspace_bytes(int64_t tokens, int top_k, int num_experts, int64_t hidden) {
  if (tokens < 0 || top_k < 1 || num_experts < 1 || hidden < 4) return 0;
  const int slices = router_slices(num_experts, hidden);
  // The active list, its count, and the first row and row count per active slot.
  const int64_t capacity = std::min<int64_t>(num_experts, tokens * top_k);
  return round16(static_cast<size_t>(slices * tokens * num_experts) * sizeof(float)) +
         round16(static_cast<size_t>(3 * capacity + 1) * sizeof(int32_t));
}

Status moe_small_batch_route(const MoeSmallBatchParams& params, cudaStream_t stream) {
  Status status = check(params, "moe_small_batch_route");
  if (!status || params.tokens == 0) return status;
  const LayerArgs a = make_args(params);
  return moe_small_batch_detail::launch_with_pdl(small_batch_router_kernel, static_cast<unsigned>(a.router_ctas),
                                                 kThreads, router_smem_bytes(params.routing, a.route_region_floats),
                                                 stream, "moe_small_batch_route", a);
}

Status moe_small_batch_experts(const MoeSmallBatchParams& params, cudaStream_t stream) {
  Status status = check(params, "moe_small_batch_experts");
  if (!status || params.tokens == 0) return status;
  return moe_small_batch_detail::launch_pipeline_experts(make_args(params), stream);
}

Status moe_small_batch_layer(const MoeSmallBatchParams& params, cudaStream_t stream) {
  Status status = moe_small_batch_route(params, stream);
  if (!status) return status;
  return moe_small_batch_experts(params, stream);
}

}  // namespace deltaserve::kernels::cuda
