// Elementwise, normalisation and short-conv ops of the GPU engine (the pieces between the GEMMs).
// Math: shared/spec/model.md; CPU references: kernels/cpu/basic_ops.hpp, attn_res.hpp, kda.hpp (the tests compare
// against them). Row-major; "[T, C]" means element (t, c) at t * C + c unless a stride is given (in elements).
// Every launcher validates its host-visible arguments and returns a Status before anything is launched, runs
// asynchronously on `stream`, never allocates and never synchronises (CUDA-graph capturable). Zero rows or
// tokens: ok, nothing launched. The engine keeps the residual stream in fp32 and feeds the GEMMs bf16.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "common/status.hpp"
#include "kernels/cuda/common/glu.hpp"

namespace deltaserve::kernels::cuda {

// out[t, :] = float(table[ids[t], :]). table bf16 [vocab, hidden]; ids device int32 [T] (the host checked them;
// an id outside [0, vocab) writes a row of NaN). out fp32 [T, hidden].
[[nodiscard]] Status embedding_gather(const __nv_bfloat16* table, int64_t vocab, int64_t hidden, const int32_t* ids,
                                      int64_t T, float* out, cudaStream_t stream);

// y[r, :] = x[r, :] * rsqrt(mean(x[r, :]^2) + eps) * weight  (fp32 math; weight fp32 [dim] or nullptr = 1).
// x fp32 rows with stride x_stride; y rows with stride y_stride (two overloads: bf16 or fp32 output).
// y == x allowed for the fp32 overload (same stride). Matches cpu::rms_norm.
[[nodiscard]] Status rms_norm(const float* x, int64_t x_stride, const float* weight, int64_t rows, int64_t dim,
                              float eps, __nv_bfloat16* y, int64_t y_stride, cudaStream_t stream);
[[nodiscard]] Status rms_norm(const float* x, int64_t x_stride, const float* weight, int64_t rows, int64_t dim,
                              float eps, float* y, int64_t y_stride, cudaStream_t stream);

// y[i] += x[i] (fp32, n values).
[[nodiscard]] Status add_inplace(float* y, const float* x, int64_t n, cudaStream_t stream);
// out[i] = bf16(x[i]).
[[nodiscard]] Status to_bf16(const float* x, int64_t n, __nv_bfloat16* out, cudaStream_t stream);
// x[i] = sigmoid(x[i]) (fp32, in place).
[[nodiscard]] Status sigmoid_inplace(float* x, int64_t n, cudaStream_t stream);
// out[i] = bf16(x[i] * sigmoid(gate[i])) — the MLA output gate. x, gate fp32 [n].
[[nodiscard]] Status sigmoid_gate(const float* x, const float* gate, int64_t n, __nv_bfloat16* out,
                                  cudaStream_t stream);

// gate_up fp32 [rows, 2 * width]: gate in columns [0, width), up in [width, 2 * width).
// out bf16 [rows, width] = glu(gate, up) (cpu::swiglu / cpu::situ_glu; betas used by kSitu only).
[[nodiscard]] Status glu(const float* gate_up, int64_t rows, int64_t width, GluKind kind, float situ_beta,
                         float situ_linear_beta, __nv_bfloat16* out, cudaStream_t stream);

// Block Attention Residuals (cpu::attn_res_mix): up to kMaxAttnResSources sources, each fp32 [T, dim];
// pointers passed by value (host array copied into the kernel's parameters, so a graph captures them).
// norm_weight fp32 [dim] (the RMSNorm of the keys), proj_weight fp32 [dim] (the pseudo-query); out fp32 [T, dim]
// (must not alias a source).
constexpr int kMaxAttnResSources = 64;
[[nodiscard]] Status attn_res_mix(const float* const* sources, int num_sources, const float* norm_weight,
                                  const float* proj_weight, int64_t T, int64_t dim, float eps, float* out,
                                  cudaStream_t stream);

// ---- KDA layer pieces (varlen batches of sequences whose states live in a slot pool) ----
// Sequences: n in [0, N); its tokens are rows [cu_seqlens[n], cu_seqlens[n+1]) of the token-major inputs;
// cu_seqlens and slots are DEVICE int32 arrays ([N + 1] and [N]); the host passes N and T = cu_seqlens[N].
// A sequence with slot < 0 is skipped (its output rows are left untouched). Zero-length sequences are allowed.
struct KdaPrepParams {
  int num_seqs = 0;                     // N
  int64_t num_tokens = 0;               // T
  const int32_t* cu_seqlens = nullptr;  // device [N + 1]
  const int32_t* slots = nullptr;       // device [N]
  int num_heads = 0, head_dim = 0;      // C = H * d channels; head_dim in [1, 128]
  int conv_kernel = 4;                  // K in [1, 4]
  // The three projections (outputs of one GEMM each, or one fused GEMM with a row stride):
  const __nv_bfloat16* q_in = nullptr;
  const __nv_bfloat16* k_in = nullptr;
  const __nv_bfloat16* v_in = nullptr;
  int64_t in_stride = 0;  // row stride of q_in/k_in/v_in in elements (>= C)
  const float* q_conv_weight = nullptr;
  const float* k_conv_weight = nullptr;
  const float* v_conv_weight = nullptr;  // [C, K]
  // Conv tails, the same pool layout kda_decode_step uses: [num_slots, 3, C, K-1] bf16 (q, k, v), oldest first
  // (the inputs are bf16, so the tails are exact). May be null when K = 1.
  __nv_bfloat16* conv_state = nullptr;
  int num_slots = 0;
  float l2_eps = 1e-6f;
  float q_scale = 1.0f;  // q is L2-normalised then multiplied by q_scale
  // Outputs, [T, H, d] each: q (L2 + q_scale), k (L2), v (conv + SiLU only).
  __nv_bfloat16* q = nullptr;
  __nv_bfloat16* k = nullptr;
  __nv_bfloat16* v = nullptr;
  // Force the per-channel reference kernel (the tests compare the two); otherwise a
  // vectorised kernel runs when head_dim % 4 == 0, in_stride % 4 == 0 and the rows are aligned (same results up to
  // fp32 summation order in the L2 norms; tails bit-identical).
  bool reference_kernel = false;
};
// Short causal conv + SiLU for q, k, v over each sequence with its tails (cpu::short_conv_silu semantics,
// tails updated to the last K-1 inputs of tail ‖ x, also for sequences shorter than K-1), then per-head L2
// normalisation of q (times q_scale) and k (cpu::l2_normalize_heads). fp32 math, bf16 out.
// Slots are not range-checked on the device beyond slot < num_slots (a slot >= num_slots is skipped too).
[[nodiscard]] Status kda_prep(const KdaPrepParams& params, cudaStream_t stream);

// Same as kda_prep but with fp32 outputs for q, k, v (used by the generic-head-size path; same semantics).
// The bf16 output pointers of `params` are ignored.
struct KdaPrepF32Outputs {
  float* q = nullptr;
  float* k = nullptr;
  float* v = nullptr;
};
[[nodiscard]] Status kda_prep_f32(const KdaPrepParams& params, const KdaPrepF32Outputs& out, cudaStream_t stream);

// cpu::kda_gate on T rows: raw fp32 [T, H*d] (row stride raw_stride), a_log [H], dt_bias [H*d] fp32, g fp32 [T, H*d].
//   lower_bound set:  g = lb * sigmoid(exp(a_log[h]) * (raw + dt_bias))
//   otherwise:        g = -exp(a_log[h]) * softplus(raw + dt_bias)
[[nodiscard]] Status kda_gate(const float* raw, int64_t raw_stride, const float* a_log, const float* dt_bias, int64_t T,
                              int H, int d, std::optional<float> lower_bound, float* g, cudaStream_t stream);

// cpu::kda_gated_output_norm: o [T, H, d] (bf16 or fp32 overloads), gate logits fp32 [T, H*d] (row stride
// gate_stride), norm_weight fp32 [d], out bf16 [T, H*d] = rms_norm_d(o[t, h, :]) * norm_weight * sigmoid(gate).
[[nodiscard]] Status kda_gated_output_norm(const __nv_bfloat16* o, const float* gate, int64_t gate_stride,
                                           const float* norm_weight, int64_t T, int H, int d, float eps,
                                           __nv_bfloat16* out, cudaStream_t stream);
[[nodiscard]] Status kda_gated_output_norm(const float* o, const float* gate, int64_t gate_stride,
                                           const float* norm_weight, int64_t T, int H, int d, float eps,
                                           __nv_bfloat16* out, cudaStream_t stream);

// Copy fixed-size rows between a slot pool and a dense buffer: dense[i] <-> pool[slots[i]] for i < n
// (slots device int32 [n]; slot < 0: gather writes zeros, scatter skips). row_bytes a multiple of 16; pool and
// dense 16-byte aligned.
[[nodiscard]] Status gather_slots(const void* pool, int64_t row_bytes, const int32_t* slots, int64_t n, void* dense,
                                  cudaStream_t stream);
[[nodiscard]] Status scatter_slots(const void* dense, int64_t row_bytes, const int32_t* slots, int64_t n, void* pool,
                                   cudaStream_t stream);

}  // namespace deltaserve::kernels::cuda
