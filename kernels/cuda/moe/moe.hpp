// Mixture-of-Experts on the GPU: fused router, token permutation by expert, grouped expert FFNs (a bandwidth-bound
// decode path and a cuBLAS prefill path) and the weighted combine.
// Math: shared/spec/model.md §1-2; CPU references: kernels/cpu/moe.hpp (cpu::moe_route) and engine/model.cpp
// (Model::run_moe / run_dense_ffn). The tests compare against them.
// Flow of one MoE layer:
//   moe_route → moe_plan → moe_gather_rows → moe_expert_ffn_decode | moe_expert_ffn_prefill → moe_combine,
// or, for at most 16 tokens, moe_small_batch_route → moe_small_batch_experts (three launches, shared expert included).
// An assignment is one (token t, choice j) pair, a = t * k + j; the plan sorts the T * k assignments by expert.
// Every launcher validates its host-visible inputs and returns a Status before anything is launched; device
// pointers are checked for null only (their contents cannot be read here). Everything is asynchronous on `stream`;
// no launcher allocates or synchronises with the host, so all but the prefill FFN (which reads host offsets) are
// CUDA-graph capturable. moe_expert_ffn_grouped (tensor cores, device tile schedule) serves both many-row decode
// batches and prefill without host offsets; moe_expert_ffn_decode dispatches to it above 4 rows per expert.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include <cublas_v2.h>
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
  // Prefill only: device scratch of >= moe_ffn_prefill_workspace_bytes(R, I) bytes (the fp32 gate/up GEMM
  // output [R, 2I]), 16-byte aligned. The decode path ignores it.
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  // Path selection. false (default): moe_expert_ffn_prefill runs the grouped tensor-core kernels
  // (moe_expert_ffn_grouped) and moe_expert_ffn_decode hands batches of more than kMoeDecodeGemvRowsPerExpert rows
  // per expert (R > that * E) to them. true: the original paths exactly (per-expert cublasGemmEx loop + glu kernel
  // for prefill; the GEMV kernels for any R in decode), kept for tests and as a fallback. The environment variable
  // DELTASERVE_MOE_REFERENCE_FFN=1 (read once per process) forces true everywhere.
  bool use_reference_path = false;
  // Grouped path only: rows per CTA tile, 32, 64 or 128, or 0 = automatic (moe_grouped_row_tile); weight rows per
  // CTA tile, 128 or 256 (256 only with 128-row tiles), or 0 = automatic (256 with 128-row tiles:
  // kMoeGroupedWideColTile).
  int row_tile = 0;
  int col_tile = 0;
  // Grouped path only: k elements per pipeline stage, 32 or 64 (64 only with 128-row tiles), or 0 = automatic
  // (moe_grouped_auto_k_tile() with 128-row tiles, 32 otherwise).
  int k_tile = 0;
  // Grouped path only: false (default): a warp skips the ldmatrix/mma of its m16 row tiles that lie wholly past
  // the expert's last row (an expert's last row tile is usually partly empty). true: every warp runs every m16
  // tile (the previous kernel; zero-filled rows, never stored). DELTASERVE_MOE_GROUPED_FULL_TILES=1 forces true.
  bool full_row_tiles = false;
};
// Decode path: width and I must be multiples of 8 (16-byte weight rows); pointers 16-byte aligned.
// Reads each ACTIVE expert's weights once per 4 of its rows (so once for decode batches); CTAs of inactive
// experts exit at once. Reads counts on the device only: no host sync, no allocation, graph-capturable.
// Correct for any R (rows of an expert are processed in tiles of 4). R == 0 launches nothing.
// Unless use_reference_path, R > kMoeDecodeGemvRowsPerExpert * E goes to moe_expert_ffn_grouped (still no host
// sync; if it rejects the shapes or alignment the GEMV kernels run instead).
Status moe_expert_ffn_decode(const MoeFfnParams& params, cudaStream_t stream);

// Scratch bytes of the prefill path: fp32 [rows, 2 * intermediate].
size_t moe_ffn_prefill_workspace_bytes(int64_t rows, int64_t intermediate);
// Prefill path: many rows per expert. Default: moe_expert_ffn_grouped (the host offsets are validated, not needed;
// handle unused; if the grouped path rejects the shapes or alignment it falls back to the reference path). With
// use_reference_path: tensor cores via cuBLAS (cublasGemmEx per expert, bf16 in, fp32 compute) with the glu in a
// neighbouring kernel. host_offsets: the host copy of expert_offsets [E + 1] (the caller copied it back; validated: 0 =
// offsets[0] <= ... <= offsets[E] <= R). handle: caller-owned; this function sets its stream and its pointer mode
// (host). Experts with no rows are skipped; rows >= offsets[E] are not written.
Status moe_expert_ffn_prefill(const MoeFfnParams& params, const std::vector<int32_t>& host_offsets,
                              cublasHandle_t handle, cudaStream_t stream);

// Grouped path: both expert GEMMs as one launch each for all experts (mma.sync bf16 tensor cores, fp32
// accumulation), the glu fused into the gate/up GEMM's epilogue (activated = bf16(glu), rounded once, as the other
// paths), y_sorted in fp32. The tile schedule (expert, row tile, column tile) is derived on the device from
// expert_offsets: no host sync, no allocation, no workspace, graph-capturable. Experts with no rows cost one
// block-wide scan of the offsets per idle CTA. Requirements: width and intermediate multiples of 8; gate_up, down,
// x_sorted, activated 16-byte aligned, y_sorted 8-byte aligned; ceil(R / row_tile) + min(E, R) <= 65535. Rows >=
// offsets[E] are not written. R == 0 launches nothing.
Status moe_expert_ffn_grouped(const MoeFfnParams& params, cudaStream_t stream);
// moe_expert_ffn_decode uses its GEMV kernels up to this many rows per expert on average (R <= this * E) and the
// grouped kernels beyond (unless use_reference_path). Reasoning (not yet measured): a GEMV tile of 4 rows re-reads the
// expert's weights once per 4 rows; the grouped kernel reads them once per row tile (32 to 128 rows).
constexpr int64_t kMoeDecodeGemvRowsPerExpert = 4;
// Automatic row tile of the grouped path from the mean rows per expert R / E: 32 rows up to
// kMoeGroupedTinyTileRowsPerExpert (mid-size decode batches: fewer wasted tensor-core FLOPs on padding rows), 64 up to
// kMoeGroupedSmallTileRowsPerExpert (weights still read about once per expert), 128 beyond (prefill: twice the
// FLOPs per byte of shared-memory traffic).
constexpr int64_t kMoeGroupedTinyTileRowsPerExpert = 16;
constexpr int64_t kMoeGroupedSmallTileRowsPerExpert = 64;
// Automatic weight-row tile with 128-row tiles: 256 (a 128 x 256 CTA tile, 64 x 64 per warp, one CTA per SM, 4
// stages: 176 bytes of shared-memory traffic per mma against 256 for 128 x 128). Set to 128 to fall back to the
// 128 x 128 tile.
constexpr int kMoeGroupedWideColTile = 256;
int moe_grouped_row_tile(int64_t rows, int num_experts);
// Automatic k tile with 128-row tiles: 64 (3 stages; half the block barriers per mma of the 32-wide stage, 128
// contiguous bytes per row per cp.async group). moe_grouped_auto_k_tile() returns it, or 32 (the previous kernel:
// 4 stages of 32 for 128 x 256) if DELTASERVE_MOE_GROUPED_K_TILE=32 is set (read once per process).
constexpr int kMoeGroupedWideKTile = 64;
int moe_grouped_auto_k_tile();
// True if DELTASERVE_MOE_GROUPED_FULL_TILES is set to a value other than "0" (cached at the first call).
bool moe_grouped_full_row_tiles_forced();
// True if DELTASERVE_MOE_REFERENCE_FFN is set to a value other than "0" (cached at the first call).
bool moe_reference_ffn_forced();

// cuBLAS grouped path (opt-in, not graph-capturable, synchronises with the host): copies expert_offsets to the host
// (host_offsets, if non-null, is used instead: E + 1 entries, validated as in moe_expert_ffn_prefill), stages the
// per-expert pointer arrays in pinned host memory and copies them to a cached device array (one per thread and
// device, allocated at first use), then runs one cublasGemmGroupedBatchedEx for gate/up (bf16 in, fp32 compute; C
// fp32 where cuBLAS supports it, else bf16), the glu kernel into `activated` (bf16, rounded once), and one grouped
// call for down into y_sorted (fp32 C). If cuBLAS rejects fp32 C for down, down runs as per-expert cublasGemmEx
// calls (fp32 out) instead. The gate/up output lives in params.workspace if it holds fp32 [R, 2I], else in the
// y_sorted buffer (fp32 if 2I <= width, bf16 if I <= width; else kInvalidArgument). handle: nullptr = a cached handle
// of this thread and device. Requirements as moe_expert_ffn_grouped (16-byte aligned bf16 buffers), E <= 1024,
// R < 2^31. Returns kInvalidArgument before launching anything when it cannot run, kUnimplemented when cuBLAS
// rejects a grouped call (the message names the call and the cuBLAS status; the outputs are then incomplete but the
// grouped kernels recompute them all from x_sorted): the selector then runs moe_expert_ffn_grouped's kernels.
Status moe_expert_ffn_cublas_grouped(const MoeFfnParams& params, const int32_t* host_offsets, cublasHandle_t handle,
                                     cudaStream_t stream);
// What the cuBLAS grouped path last ran, for logs and timing lines: "gate_up C fp32|bf16|unprobed, down grouped
// fp32|per-expert|unprobed".
const char* moe_cublas_grouped_mode();
// Prefill FFN selector, DELTASERVE_MOE_PREFILL (read once per process): "wgmma" (default, also for unset or unknown
// values), "grouped-kernel" or "cublas-grouped". moe_expert_ffn_grouped (so moe_expert_ffn_prefill and
// moe_expert_ffn_decode above kMoeDecodeGemvRowsPerExpert) hands batches with automatic tiles (row_tile, col_tile,
// k_tile 0, full_row_tiles false) to
//   wgmma:          moe_expert_ffn_wgmma (moe_wgmma.hpp: Hopper TMA + wgmma, graph-capturable) above
//                   kMoeWgmmaMinRowsPerExpert rows per expert on average (measured on the H200 at Kimi-48B dims:
//                   2.0x the mma.sync kernels at 256 rows per expert, 0.47-0.60 of the bf16 peak);
//   cublas-grouped: moe_expert_ffn_cublas_grouped above kMoeCublasGroupedMinRowsPerExpert, unless `stream` is
//                   capturing a graph.
// If the chosen path declines (kInvalidArgument / kUnimplemented, e.g. not a Hopper GPU) the mma.sync kernels run.
enum class MoePrefillPath { kWgmma, kGroupedKernel, kCublasGrouped };
MoePrefillPath moe_prefill_path();
bool moe_prefill_cublas_grouped_selected();  // moe_prefill_path() == kCublasGrouped
constexpr int64_t kMoeWgmmaMinRowsPerExpert = 64;
constexpr int64_t kMoeCublasGroupedMinRowsPerExpert = 16;

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
//      logits, routes every token (the selection of moe_route, moe_route.cuh), builds the plan (the MoePlan
//      contract of moe_plan, bit for bit) and the list of active experts, and gathers x_sorted when asked. v1: the
//      other CTAs of the launch run the shared expert's gate/up + GLU meanwhile (it does not depend on the routing).
//   2. moe_small_batch_experts, launch 1: gate/up + GLU of the routed experts (v2: and, first, of the shared
//      expert), x read by token (no gather needed).
//   3. launch 2: down of every active expert and of the shared expert, then the combine in the same CTA:
//      residual[t, d] = (residual[t, d] + Σ_j w[t, j] · y_j[t, d]) + y_shared[t, d], j in order 0..k-1 —
//      deterministic, no atomics; the additions of moe_combine (accumulate) and then of the shared FFN's
//      accumulating down GEMM.
// Two generations of kernels (moe_small_batch.cu has the design and the H200 figures):
//   kV2: the default. Programmatic dependent launch between the three launches (and to the kernels around them);
//        the shared expert's gate/up runs in launch 2, streamed while launch 1 routes; launches 2 and 3 stream
//        weight rows into shared-memory rings with bulk copies (one CTA per SM for gate/up, one per 16 output
//        columns for down) and multiply on tensor cores. Shapes whose staged rows do not fit shared memory run v1.
//   kV1: the first kernels: plain launches, the shared expert's gate/up in launch 1, one warp per weight column
//        with CUDA-core dot products.
//   kDefault: DELTASERVE_MOE_SMALL_BATCH_KERNEL=v1|v2 when set (read once per process), else kV2.
// Both give the same routing, plan and logits bit for bit, and the same expert outputs up to fp32 summation order
// (each deterministic). Expert math as the other paths: bf16 weights and inputs, fp32 accumulation, the GLU in
// fp32 rounded once to bf16 (activated rows), fp32 expert outputs. No LatentMoE (the expert width must be the
// hidden width). Nothing allocates or synchronises with the host: graph-capturable. T == 0 launches nothing.
// v2's launch 1 starts before the kernel before it on the stream has finished (it loads the router rows, then
// waits for it), and launch 3 lets the kernel after it start while it finishes: the kernels around the layer must
// follow the same rule (read what the previous grid writes only after griddepcontrol.wait; start dependents only
// after that wait), as mla_decode and kda_decode_step do; plain launches always do.
constexpr int64_t kMoeSmallBatchMaxTokens = 16;
constexpr int64_t kMoeSmallBatchMaxAssignments = 256;  // T * top_k
constexpr int64_t kMoeSmallBatchSplitTokens = 4;       // v2 splits its down launch up to this many tokens

enum class MoeSmallBatchKernel { kDefault, kV1, kV2 };
// "v1", "v2" ("default" for kDefault).
const char* moe_small_batch_kernel_name(MoeSmallBatchKernel kernel);

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
  // Optional, v2 only (v1 rejects it): the input RMSNorm fused in. With norm_weight set, x_f32 holds the rows before
  // the norm (the layer's residual stream: it may be `residual` itself) and x is not read (may be null): launch 1
  // normalises them for the router and launch 2 for the experts, each in rms_norm_dual's reduction order, so both
  // see bitwise what rms_norm_dual would have written (x_f32 / rms ⊙ norm_weight in fp32, and its bf16 rounding).
  // x_sorted must be null. It saves the norm's launch in front of every MoE layer.
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
  __nv_bfloat16* shared_activated = nullptr;  // [T, I_s] (with a shared expert): launch 1 (v1) or 2 (v2)
  float* residual = nullptr;                  // [T, hidden] row stride residual_stride: += routed + shared
  int64_t residual_stride = 0;
  // Scratch of >= moe_small_batch_workspace_bytes bytes, 16-byte aligned (router partial sums, active experts);
  // written by moe_small_batch_route and read by moe_small_batch_experts.
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  // Grid counter of the route launch: device memory that must be 0 before the first launch; every launch leaves it
  // 0 again. Launches that may run concurrently (other streams) need counters of their own.
  unsigned int* counter = nullptr;
  // Which kernels run; moe_small_batch_route and moe_small_batch_experts must get the same value.
  MoeSmallBatchKernel kernel = MoeSmallBatchKernel::kDefault;
  // v2's down launch for T <= kMoeSmallBatchSplitTokens: each 16-column tile by two CTAs, each streaming half of
  // the experts (the same sums: results are bitwise those of the unsplit launch). 0: unsplit unless the environment
  // says DELTASERVE_MOE_DOWN_SPLIT=1 (read once); 1: never; 2: split. Route and experts must get the same value.
  int down_split = 0;
};

// Whether the small-batch path takes these shapes (the engine's choice; the launchers check the rest).
bool moe_small_batch_fits(int64_t tokens, int top_k, int num_experts, int64_t hidden, int64_t intermediate,
                          int64_t shared_intermediate);
size_t moe_small_batch_workspace_bytes(int64_t tokens, int top_k, int num_experts, int64_t hidden);
// Launch 1 (router, route, plan, optional gather; v1: also the shared expert's gate/up + GLU).
Status moe_small_batch_route(const MoeSmallBatchParams& params, cudaStream_t stream);
// Launches 2 and 3 (routed gate/up + GLU; down, combine and the residual add), after moe_small_batch_route with the
// same params on the same stream.
Status moe_small_batch_experts(const MoeSmallBatchParams& params, cudaStream_t stream);
// Both, in order.
Status moe_small_batch_layer(const MoeSmallBatchParams& params, cudaStream_t stream);
// The kernels these params run (kV1 or kV2: params.kernel, or the environment's choice, with v2's fallback to v1
// for shapes it does not take applied); kDefault when the launchers would reject the params or the environment.
MoeSmallBatchKernel moe_small_batch_kernel_for(const MoeSmallBatchParams& params);
// Whether the engine takes the small-batch path at all: false if DELTASERVE_MOE_SMALL_BATCH is set to "0" or "off"
// (read once per process); the previous chain (router GEMM, moe_route, moe_plan, gather, moe_expert_ffn_decode,
// moe_combine, shared FFN) then runs at every batch size.
bool moe_small_batch_enabled();
// Whether the engine fuses the MoE layer's input norm into the small-batch launches (MoeSmallBatchParams::
// norm_weight): yes unless DELTASERVE_MOE_FUSED_NORM is "0" or "off" (read once per process). Measured on the H200
// (Kimi-Linear-48B decode step, ctx 4k, graphs, 2026-12-01, bench/results/engine_gpu_ab.jsonl): 2.777 / 3.962 /
// 5.639 -> 2.704 / 3.856 / 5.612 ms at 1 / 2 / 4 rows.
bool moe_small_batch_fused_norm_enabled();

}  // namespace deltaserve::kernels::cuda
