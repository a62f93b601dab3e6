// Mixture-of-Experts on the GPU: fused router, token permutation by expert, grouped expert FFNs (a bandwidth-bound
// decode path and a cuBLAS prefill path) and the weighted combine.
// Math: shared/spec/model.md §1-2; CPU references: kernels/cpu/moe.hpp (cpu::moe_route) and engine/model.cpp
// (Model::run_moe / run_dense_ffn). The tests compare against them.
// Flow of one MoE layer:
//   moe_route → moe_plan → moe_gather_rows → moe_expert_ffn_decode | moe_expert_ffn_prefill → moe_combine.
// An assignment is one (token t, choice j) pair, a = t * k + j; the plan sorts the T * k assignments by expert.
// Every launcher validates its host-visible inputs and returns a Status before anything is launched; device
// pointers are checked for null only (their contents cannot be read here). Everything is asynchronous on `stream`;
// no launcher allocates or synchronises with the host, so all but the prefill FFN (which reads host offsets) are
// CUDA-graph capturable.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "common/status.hpp"
#include "kernels/cuda/glu.hpp"

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
};
// Decode path: width and I must be multiples of 8 (16-byte weight rows); pointers 16-byte aligned.
// Reads each ACTIVE expert's weights once per 4 of its rows (so once for decode batches); CTAs of inactive
// experts exit at once. Reads counts on the device only: no host sync, no allocation, graph-capturable.
// Correct for any R (rows of an expert are processed in tiles of 4). R == 0 launches nothing.
Status moe_expert_ffn_decode(const MoeFfnParams& params, cudaStream_t stream);

// Scratch bytes of the prefill path: fp32 [rows, 2 * intermediate].
size_t moe_ffn_prefill_workspace_bytes(int64_t rows, int64_t intermediate);
// Prefill path: many rows per expert; tensor cores via cuBLAS (cublasGemmEx per expert, bf16 in, fp32 compute)
// with the glu in a neighbouring kernel. host_offsets: the host copy of expert_offsets [E + 1] (the caller copied
// it back; validated: 0 = offsets[0] <= ... <= offsets[E] <= R). handle: caller-owned; this function sets its
// stream and its pointer mode (host). Experts with no rows are skipped; rows >= offsets[E] are not written.
Status moe_expert_ffn_prefill(const MoeFfnParams& params, const std::vector<int32_t>& host_offsets,
                              cublasHandle_t handle, cudaStream_t stream);

// ---- combine -------------------------------------------------------------------------------------------------
// out[t, :] (= or +=, accumulate) Σ_j weights[t, j] · y_sorted[assignment_pos[t*k + j], :], j in order 0..k-1 (fixed
// order: deterministic). out fp32 rows with stride out_stride. An assignment with assignment_pos < 0 adds nothing.
Status moe_combine(const float* y_sorted, const MoePlan& plan, const float* weights, int64_t T, int top_k,
                   int64_t width, bool accumulate, float* out, int64_t out_stride, cudaStream_t stream);

}  // namespace deltaserve::kernels::cuda
