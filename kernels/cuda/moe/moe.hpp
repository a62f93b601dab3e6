// Mixture-of-Experts on the GPU: fused router, token permutation by expert, grouped expert FFNs (a bandwidth-bound
// kernel for few rows per expert, grouped tensor-core GEMMs beyond) and the weighted combine.
// Math: shared/spec/model.md §1-2; CPU references: kernels/cpu/moe.hpp (cpu::moe_route) and engine/model.cpp
// (Model::run_moe / run_dense_ffn). The tests compare against them.
// Flow of one MoE layer:
//   moe_route → moe_plan → moe_gather_rows → moe_expert_ffn_decode → moe_combine,
// or, for at most 16 tokens, moe_small_batch_route → moe_small_batch_experts (three launches, shared expert included).
// An assignment is one (token t, choice j) pair, a = t * k + j; the plan sorts the T * k assignments by expert.
// Every launcher validates its host-visible inputs and returns a Status before anything is launched; device
// pointers are checked for null only (their contents cannot be read here). Everything is asynchronous on `stream`;
// no launcher allocates or synchronises with the host, so all are CUDA-graph capturable. moe_expert_ffn_grouped
// (tensor cores, device tile schedule) serves both many-row decode batches and prefill; moe_expert_ffn_decode
// dispatches to it above kMoeDecodeGemvRowsPerExpert rows per expert.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "common/status.hpp"
#include "kernels/cuda/common/glu.hpp"

namespace deltaserve::kernels::cuda {

constexpr int kMoeMaxExperts = 1024;  // E limit of moe_route
constexpr int kMoeMaxTopK = 32;       // k limit of moe_route

// ---- router ------------------------------------------------------------------------------------------------
struct MoeRoutingConfig {
  int num_experts = 0, top_k = 0, num_groups = 1, top_k_groups = 1;
  bool renormalize = true;
  float routed_scaling_factor = 1.0f;
};

// Fused router for T tokens: logits fp32 [T, E] (row stride E), correction bias fp32 [E] or nullptr.
// expert_ids int32 [T, k] and weights fp32 [T, k] out, each row ordered like cpu::moe_route (descending choice
// score, ties toward the lower expert id, NaN ranks as -inf). Must pick exactly the experts cpu::moe_route picks
// on the same fp32 logits. E up to 1024, k up to 32. T == 0 launches nothing.
// Constraints (as the CPU reference): 1 <= k <= E; groups >= 1 divides E; 1 <= top_k_groups <= groups;
// with groups > 1, k <= top_k_groups * (E / groups).
Status moe_route(const MoeRoutingConfig& config, const float* logits, const float* correction_bias, int64_t T,
                 int32_t* expert_ids, float* weights, cudaStream_t stream);
// The configuration checks of moe_route (ok, or kInvalidArgument naming `who` and the rule broken).
Status moe_routing_check(const MoeRoutingConfig& config, const char* who);

// ---- permutation ---------------------------------------------------------------------------------------------
// Permutation of the T*k (token, choice) assignments, a = t * k + j, grouped by expert (stable in a).
struct MoePlan {
  int32_t* expert_offsets = nullptr;      // device [E + 1]: rows of expert e are [offsets[e], offsets[e+1])
  int32_t* sorted_assignments = nullptr;  // device [T * k]: assignment at sorted position p
  int32_t* assignment_pos = nullptr;      // device [T * k]: sorted position of assignment a
};
// Device scratch of moe_plan (16-byte aligned pointer). Never 0 for valid sizes.
size_t moe_plan_workspace_bytes(int64_t T, int top_k, int num_experts);
// expert_ids: device int32 [T, k], each in [0, E) (out-of-range ids are ignored: such an assignment gets no
// sorted position and is left out of every expert; assignment_pos of it is set to -1). T * k < 2^31.
Status moe_plan(const int32_t* expert_ids, int64_t T, int top_k, int num_experts, const MoePlan& plan, void* workspace,
                size_t workspace_bytes, cudaStream_t stream);
// out[p, :] = x[sorted_assignments[p] / k, :] for p < T*k. x bf16 rows with stride x_stride; out bf16 [T*k, width].
Status moe_gather_rows(const __nv_bfloat16* x, int64_t x_stride, const MoePlan& plan, int64_t T, int top_k,
                       int64_t width, __nv_bfloat16* out, cudaStream_t stream);

// ---- expert FFNs ---------------------------------------------------------------------------------------------
// Expert weights on the device, bf16, row-major [out, in] like the checkpoint:
struct MoeExpertWeights {
  const __nv_bfloat16* gate_up = nullptr;  // [E, 2 * I, width]: rows [0, I) = gate (w1), rows [I, 2I) = up (w3)
  const __nv_bfloat16* down = nullptr;     // [E, width, I] (w2)
  int num_experts = 0;
  int64_t width = 0;         // input/output width of the experts (hidden, or the latent width with LatentMoE)
  int64_t intermediate = 0;  // I
};
struct MoeFfnParams {
  MoeExpertWeights weights;
  GluKind glu = GluKind::kSwiGlu;
  float situ_beta = 4.0f, situ_linear_beta = 25.0f;
  int64_t rows = 0;                         // R = T * k (host)
  const __nv_bfloat16* x_sorted = nullptr;  // [R, width] rows grouped by expert (moe_gather_rows)
  const int32_t* expert_offsets = nullptr;  // device [E + 1] (from moe_plan)
  __nv_bfloat16* activated = nullptr;       // scratch [R, I] bf16 (glu(gate, up), fp32 math, rounded once)
  float* y_sorted = nullptr;                // [R, width] fp32 out: expert(x) per sorted row
};
// Expert FFN for any R (the engine's one entry point): the bandwidth kernels up to kMoeDecodeGemvRowsPerExpert rows
// per expert on average (R <= that * E), moe_expert_ffn_grouped beyond; if the grouped path rejects the shapes or
// alignment (kInvalidArgument) the bandwidth kernels run instead. Bandwidth kernels: width and I multiples of 8
// (16-byte weight rows), pointers 16-byte aligned; each ACTIVE expert's weights read once per 4 of its rows (once
// for decode batches); CTAs of inactive experts exit at once; correct for any R (rows of an expert in tiles of 4).
// Reads counts on the device only: no host sync, no allocation, graph-capturable. R == 0 launches nothing.
Status moe_expert_ffn_decode(const MoeFfnParams& params, cudaStream_t stream);

// Grouped path: both expert GEMMs as one launch each for all experts, the glu fused into the gate/up GEMM's epilogue
// (activated = bf16(glu), rounded once, as the other paths), y_sorted in fp32. Above kMoeWgmmaMinRowsPerExpert rows
// per expert on average it runs moe_expert_ffn_wgmma (detail/wgmma.hpp: Hopper TMA + wgmma); at or below that, and
// whenever the wgmma kernels decline (not a compute capability 9.x GPU, TMA coordinates out of range), the mma.sync
// kernels (bf16 tensor cores, fp32 accumulation) with the row tile of moe_grouped_row_tile. The tile schedule
// (expert, row tile, column tile) is derived on the device from expert_offsets: no host sync, no allocation, no
// workspace, graph-capturable. Experts with no rows cost one block-wide scan of the offsets per idle CTA.
// Requirements: width and intermediate multiples of 8; gate_up, down, x_sorted, activated 16-byte aligned, y_sorted
// 8-byte aligned; ceil(R / row_tile) + min(E, R) <= 65535. Rows >= offsets[E] are not written. R == 0 launches
// nothing.
Status moe_expert_ffn_grouped(const MoeFfnParams& params, cudaStream_t stream);
// moe_expert_ffn_decode uses its bandwidth kernels up to this many rows per expert on average (R <= this * E) and
// the grouped kernels beyond: a bandwidth tile of 4 rows re-reads the expert's weights once per 4 rows, the grouped
// kernel once per row tile (32 to 128 rows).
constexpr int64_t kMoeDecodeGemvRowsPerExpert = 4;
// Row tile of the mma.sync kernels from the mean rows per expert R / E: 32 rows up to
// kMoeGroupedTinyTileRowsPerExpert (mid-size decode batches: fewer wasted tensor-core FLOPs on padding rows), 64 up to
// kMoeGroupedSmallTileRowsPerExpert (weights still read about once per expert), 128 beyond (prefill: twice the
// FLOPs per byte of shared-memory traffic; a 128 x 256 CTA tile with 64-wide k stages).
constexpr int64_t kMoeGroupedTinyTileRowsPerExpert = 16;
constexpr int64_t kMoeGroupedSmallTileRowsPerExpert = 64;
int moe_grouped_row_tile(int64_t rows, int num_experts);
// moe_expert_ffn_grouped runs the wgmma kernels above this many rows per expert on average (prefill sizes, where
// they are well ahead of the mma.sync kernels).
constexpr int64_t kMoeWgmmaMinRowsPerExpert = 64;

// ---- combine -------------------------------------------------------------------------------------------------
// out[t, :] (= or +=, accumulate) Σ_j weights[t, j] · y_sorted[assignment_pos[t*k + j], :], j in order 0..k-1 (fixed
// order: deterministic). out fp32 rows with stride out_stride. An assignment with assignment_pos < 0 adds nothing.
Status moe_combine(const float* y_sorted, const MoePlan& plan, const float* weights, int64_t T, int top_k,
                   int64_t width, bool accumulate, float* out, int64_t out_stride, cudaStream_t stream);

// ---- small-batch decode layer --------------------------------------------------------------------------------
// The whole MoE layer (router GEMM to the residual add, shared expert included) for at most
// kMoeSmallBatchMaxTokens tokens in three launches. At decode batches the layer is bound by the weight bytes of the
// active experts and by launch latency, so each launch streams its weights over every SM:
//   1. moe_small_batch_route: router GEMM (fp32, the hidden dimension split into up to 4 slices whose partial sums
//      are added in slice order), then the last router CTA to finish (a grid counter) adds the partials into the
//      logits, routes every token (the selection of moe_route, detail/route.cuh), builds the plan (the MoePlan
//      contract of moe_plan, bit for bit) and the list of active experts, and gathers x_sorted when asked;
//   2. moe_small_batch_experts' first launch: gate/up + GLU of the shared expert, then of the routed experts, x read
//      by token (no gather needed);
//   3. its second launch: down of every active expert and of the shared expert, then the combine in the same CTA:
//      residual[t, d] = (residual[t, d] + Σ_j w[t, j] · y_j[t, d]) + y_shared[t, d], j in order 0..k-1 —
//      deterministic, no atomics; the additions of moe_combine (accumulate) and then of the shared FFN's
//      accumulating down GEMM.
// Launches 2 and 3 stream weight rows into shared-memory rings with bulk copies (one CTA per SM for gate/up, one per
// 16 output columns for down) and multiply on tensor cores. The routing, plan and logits are bitwise those of
// moe_route / moe_plan on the same logits; expert math as the other paths: bf16 weights and inputs, fp32
// accumulation, the GLU in fp32 rounded once to bf16 (activated rows), fp32 expert outputs (each sum in a fixed
// order: deterministic). No LatentMoE (the expert width must be the hidden width). Nothing allocates or synchronises
// with the host: graph-capturable. T == 0 launches nothing.
// Programmatic dependent launch between the three launches and to the kernels around them: launch 1 starts before
// the kernel before it on the stream has finished (it loads the router rows, then waits for it), and launch 3 lets
// the kernel after it start while it finishes. The kernels around the layer must follow the same rule (read what the
// previous grid writes only after griddepcontrol.wait; start dependents only after that wait), as mla_decode and
// kda_decode_step do; plain launches always do.
constexpr int64_t kMoeSmallBatchMaxTokens = 16;
constexpr int64_t kMoeSmallBatchMaxAssignments = 256;  // T * top_k

struct MoeSmallBatchParams {
  MoeRoutingConfig routing;                // as moe_route's (checked the same way)
  int64_t tokens = 0;                      // T in [0, kMoeSmallBatchMaxTokens], T * top_k <= 256
  int64_t hidden = 0;                      // width of x, of the router and of the experts; a multiple of 8
  const float* x_f32 = nullptr;            // [T, hidden] router input
  int64_t x_f32_stride = 0;                // >= hidden, a multiple of 4
  const float* router = nullptr;           // [E, hidden] fp32
  const float* correction_bias = nullptr;  // [E] fp32 or nullptr
  const __nv_bfloat16* x = nullptr;        // [T, hidden] expert input
  int64_t x_stride = 0;                    // >= hidden, a multiple of 8
  // Optional: the input RMSNorm fused in. With norm_weight set, x_f32 holds the rows before the norm (the layer's
  // residual stream: it may be `residual` itself) and x is not read (may be null): launch 1 normalises them for the
  // router and launch 2 for the experts, each in rms_norm_dual's reduction order, so both see bitwise what
  // rms_norm_dual would have written (x_f32 / rms ⊙ norm_weight in fp32, and its bf16 rounding). x_sorted must be
  // null. It saves the norm's launch in front of every MoE layer.
  const float* norm_weight = nullptr;  // [hidden]
  float norm_eps = 0.0f;
  MoeExpertWeights experts;                       // width == hidden; intermediate a multiple of 8
  const __nv_bfloat16* shared_gate_up = nullptr;  // [2 I_s, hidden] (gate rows, then up rows), nullptr: no shared
  const __nv_bfloat16* shared_down = nullptr;     // [hidden, I_s]
  int64_t shared_intermediate = 0;                // I_s, a multiple of 8 (all shared experts stacked)
  GluKind glu = GluKind::kSwiGlu;
  float situ_beta = 4.0f, situ_linear_beta = 25.0f;
  // Outputs (device, caller-owned). The intermediates keep the contracts of moe_route, moe_plan and moe_gather_rows.
  float* logits = nullptr;                    // [T, E] fp32
  int32_t* expert_ids = nullptr;              // [T, k]
  float* weights = nullptr;                   // [T, k]
  MoePlan plan;                               // offsets [E + 1], sorted_assignments and assignment_pos [T k]
  __nv_bfloat16* x_sorted = nullptr;          // [T k, hidden], written only when non-null (the FFN reads x by token)
  __nv_bfloat16* activated = nullptr;         // [T k, I]: glu(gate, up) per row of the plan
  __nv_bfloat16* shared_activated = nullptr;  // [T, I_s] (with a shared expert), written by launch 2
  float* residual = nullptr;                  // [T, hidden] row stride residual_stride: += routed + shared
  int64_t residual_stride = 0;
  // Scratch of >= moe_small_batch_workspace_bytes bytes, 16-byte aligned (router partial sums, active experts);
  // written by moe_small_batch_route and read by moe_small_batch_experts.
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  // Grid counter of the route launch: device memory that must be 0 before the first launch; every launch leaves it
  // 0 again. Launches that may run concurrently (other streams) need counters of their own.
  unsigned int* counter = nullptr;
};

// Whether the small-batch path takes these shapes (the engine's choice; the launchers check the rest): the limits
// above, and launches 2 and 3's staged rows within their shared-memory budgets (x of every token for gate/up).
bool moe_small_batch_fits(int64_t tokens, int top_k, int num_experts, int64_t hidden, int64_t intermediate,
                          int64_t shared_intermediate);
size_t moe_small_batch_workspace_bytes(int64_t tokens, int top_k, int num_experts, int64_t hidden);
// Launch 1 (router, route, plan, optional gather).
Status moe_small_batch_route(const MoeSmallBatchParams& params, cudaStream_t stream);
// Launches 2 and 3 (shared and routed gate/up + GLU; down, combine and the residual add), after
// moe_small_batch_route with the same params on the same stream.
Status moe_small_batch_experts(const MoeSmallBatchParams& params, cudaStream_t stream);
// Both, in order.
Status moe_small_batch_layer(const MoeSmallBatchParams& params, cudaStream_t stream);

}  // namespace deltaserve::kernels::cuda
