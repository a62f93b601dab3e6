// Kimi Delta Attention on Hopper (sm_90a): chunked prefill over varlen batches and the fused decode step.
// Math: shared/spec/model.md §3; CPU reference: kernels/cpu/kda.hpp (the tests compare against it).
// Layouts are token-major like the CPU reference: [T, H, D] means element (t, h, d) at ((t * H) + h) * D + d.
// Every launcher validates its host-visible inputs and returns a Status before anything is launched;
// device pointers are checked for null and 16-byte alignment only (their contents cannot be read here).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "common/status.hpp"

namespace deltaserve::kernels::cuda {

constexpr int kKdaHeadDim = 128;  // d_k = d_v; the only head size these kernels are built for
constexpr int kKdaChunk = 64;     // tokens per chunk of the prefill kernel (WY/UT form)

// ---- chunked prefill --------------------------------------------------------------------------------------
enum class KdaStatePass { kAuto, kPerSlice, kPerHead, kPerHeadOverlapped };

struct KdaPrefillParams {
  int num_heads = 0;                // H >= 1
  int head_dim = kKdaHeadDim;       // must be 128
  std::vector<int32_t> cu_seqlens;  // host copy [N + 1]: cu[0] = 0, non-decreasing, N >= 1; T = cu[N]. Zero-length ok.

  const __nv_bfloat16* q = nullptr;  // [T, H, d] after conv/SiLU/L2 (q_scale is applied in the kernel)
  const __nv_bfloat16* k = nullptr;  // [T, H, d] after conv/SiLU/L2
  const __nv_bfloat16* v = nullptr;  // [T, H, d] after conv/SiLU
  const float* g = nullptr;          // [T, H, d] fp32 log-decay per key channel (<= 0), or the raw gate if gate_raw
  const float* beta = nullptr;       // [T, H] fp32 in (0, 1)
  float q_scale = 1.0f;              // q is multiplied by this (d^-0.5 when q is only L2-normalised)

  // Fused gate: when gate_raw, g holds f_b(f_a(x)) and the kernel computes
  //   lower_bound set:  g = lb * sigmoid(exp(a_log[h]) * (g + dt_bias))      (lb in [-5, 0))
  //   otherwise:        g = -exp(a_log[h]) * softplus(g + dt_bias)
  bool gate_raw = false;
  const float* a_log = nullptr;      // [H], gate_raw only
  const float* dt_bias = nullptr;    // [H * d], gate_raw only
  std::optional<float> lower_bound;  // gate_raw only
  // Whatever the gate, a chunk whose 16-token sub-tiles keep their cumulative log-decay above -85 (always the
  // case with lb >= -5) takes the dense tensor-core path for the diagonal tiles; any other chunk takes an exact
  // pairwise path for those tiles. Both are correct for any g <= 0.

  const float* initial_state = nullptr;  // [N, H, d_k, d_v] fp32, or nullptr for zeros
  float* final_state = nullptr;          // [N, H, d_k, d_v] fp32, or nullptr; may alias initial_state
  // Prefix-cache checkpoints: the state after every `checkpoint_interval` tokens of each sequence (token counts
  // from the start of this call's segment of the sequence). Sequence n owns floor(len_n / interval) entries,
  // stored after those of sequences < n. interval: 0 (none) or a positive multiple of 64.
  int checkpoint_interval = 0;
  float* checkpoint_states = nullptr;  // [sum_n floor(len_n / interval), H, d_k, d_v] fp32

  __nv_bfloat16* o = nullptr;  // [T, H, d_v] out; rows >= T are never touched

  void* workspace = nullptr;  // device, >= kda_prefill_workspace_bytes(cu_seqlens, H), 16-byte aligned
  size_t workspace_bytes = 0;

  // Which state pass runs the recurrence over the chunks (same results within the tests' tolerance):
  //   kPerSlice: a CTA per (64 value columns, head, sequence), two warpgroups splitting the keys;
  //   kPerHead:  a CTA per (head, sequence), a warpgroup per 64 value columns holding S^T in registers, one stage
  //              of factors for both (half the CTAs: one wave for H up to the SM count);
  //   kPerHeadOverlapped: kPerHead launched first and the prep beside it (programmatic dependent launch), chunk by
  //              chunk: each state CTA reads a chunk's factors once the prep flags them, so the chain runs while
  //              the prep computes later chunks (one SM a CTA). Taken only when the (head, sequence) CTAs fill at
  //              most half the SMs (every one of them then resident; the prep never waits for them); else as kAuto
  //              without it. A CTA whose first chunk is not flagged within overlap_wait_us (kernels serialised, so
  //              the prep is not running beside it) leaves its work to a second launch of the pass after the prep;
  //   kAuto:     kPerHeadOverlapped where its precondition holds (few heads and sequences: the chain is the
  //              critical path); else kPerHead when 2 H CTAs would not fit on the GPU at once (one wave instead of
  //              two), else kPerSlice.
  // The tests force each pass; the engine leaves kAuto.
  KdaStatePass state_pass = KdaStatePass::kAuto;
  // kPerHeadOverlapped: how long a state CTA waits for the prep's first chunk before it leaves its (head, sequence)
  // to a second launch of the pass after the prep (so serialised kernels cost time, never a hang). >= 0; 0: always
  // (the tests' way to run that path).
  int overlap_wait_us = 2000;
};

// Device scratch the prefill needs (chunk tables, the per-chunk WY/UT factors, about 74 KiB per chunk and head,
// and the overlapped pass's flags, 4 bytes per chunk and head). 0 when cu_seqlens is malformed (the launcher then
// reports why).
size_t kda_prefill_workspace_bytes(const std::vector<int32_t>& cu_seqlens, int num_heads);

// Number of checkpoint entries the prefill writes for these sequences (0 when interval == 0).
int64_t kda_prefill_checkpoint_count(const std::vector<int32_t>& cu_seqlens, int checkpoint_interval);

// Enqueues the prefill on `stream`. Asynchronous; no host synchronisation (the tables are copied with
// cudaMemcpyAsync from pageable memory, which stages them before returning).
[[nodiscard]] Status kda_chunk_prefill(const KdaPrefillParams& params, cudaStream_t stream);

// ---- context parallel ---------------------------------------------------------------------------------------
// A segment of a sequence maps its incoming state affinely: S_out = M S_in + S0 (per head, [d_k, d_v] fp32).
//   S0: kda_chunk_prefill of the segment with initial_state = nullptr (its final_state);
//   M:  kda_chunk_prefill of the same segment with v = 0 and initial_state = the identity per head (u = 0, so each
//       chunk applies only its transition Diag(e^gc_last) - (K e^(gc_last - gc))^T W); its o is meaningless.
// Devices exchange the fixed-size (M, S0) pairs (independent of length), compose left to right with
// kda_compose_segment, then rerun their segment with the composed incoming state for the outputs.
// s_out = m s_in + s0 for num_heads heads; s_out may alias s0, not m or s_in. Asynchronous.
[[nodiscard]] Status kda_compose_segment(const float* m, const float* s_in, const float* s0, float* s_out,
                                         int num_heads, cudaStream_t stream);

// ---- fused decode step ------------------------------------------------------------------------------------
// One token per batch row; each row's recurrent state and conv tails live in a slot pool and are updated in
// place. Fuses: short conv + SiLU (q, k, v), L2 norm (q scaled by d^-0.5), gate, beta = sigmoid, the
// recurrent update, o = S^T q, and the gated RMSNorm of o. No allocation, no host sync: CUDA-graph capturable.
struct KdaDecodeParams {
  int batch = 0;      // B >= 0 rows (0: nothing launched)
  int num_heads = 0;  // H >= 1
  int head_dim = kKdaHeadDim;
  int conv_kernel = 4;  // K in [1, 4]
  int num_slots = 0;    // slots in the pool (for documentation and bounds; slots are not range-checked on device
                        // beyond slot < num_slots)

  const int32_t* slots = nullptr;  // [B] device; slot of each row, or < 0 to skip the row (its output is zeros)

  const __nv_bfloat16* q_in = nullptr;      // [B, H*d] projections W_q x (before the conv)
  const __nv_bfloat16* k_in = nullptr;      // [B, H*d]
  const __nv_bfloat16* v_in = nullptr;      // [B, H*d]
  const __nv_bfloat16* gate_raw = nullptr;  // [B, H*d] f_b(f_a(x))
  const __nv_bfloat16* beta_raw = nullptr;  // [B, H] b_proj(x) logits (sigmoid applied inside)
  const __nv_bfloat16* out_gate = nullptr;  // [B, H*d] output gate logits (sigmoid applied inside)
  // Optional (the speculative kernels reject it): the gate logits from the layer's low-rank
  // up-projections inside the step instead of gate_raw (and out_gate): gate_raw[b, c] = f_b[c, :] · gate_low[b,
  // 0:128] and, with g_b set, out_gate[b, c] = g_b[c, :] · gate_low[b, 128:256], each summed in fp32 and rounded to
  // bf16 like the projection GEMM's outputs (gate_raw / out_gate are then not read and may be null). It saves the
  // up-projections' launch at small batches; every (row, head) CTA reads its head's 32 KiB of f_b (and of g_b),
  // from L2 after the first row, so large batches are better served by the separate GEMM.
  const __nv_bfloat16* gate_low = nullptr;  // [B, gate_low_stride] f_a(x) (‖ g_a(x))
  int64_t gate_low_stride = 0;              // elements; a multiple of 8, >= 128 (>= 256 with g_b)
  const __nv_bfloat16* f_b = nullptr;       // [H*d, 128] row-major (output channel x rank)
  const __nv_bfloat16* g_b = nullptr;       // [H*d, 128] row-major, or null: out_gate is read

  const float* q_conv_weight = nullptr;  // [H*d, K]
  const float* k_conv_weight = nullptr;  // [H*d, K]
  const float* v_conv_weight = nullptr;  // [H*d, K]
  const float* a_log = nullptr;          // [H]
  const float* dt_bias = nullptr;        // [H*d]
  std::optional<float> lower_bound;      // gate as in KdaPrefillParams
  const float* o_norm_weight = nullptr;  // [d]
  float rms_eps = 1e-5f;

  // [num_slots, 3, H*d, K-1] bf16 in/out: q, k, v tails, oldest first (null if K = 1). The tails are raw projection
  // outputs, which are bf16 already, so bf16 keeps them exactly (and moves half the bytes of fp32).
  __nv_bfloat16* conv_state = nullptr;
  float* state = nullptr;  // [num_slots, H, d_k, d_v] fp32 in/out

  __nv_bfloat16* out = nullptr;  // [B, H*d] gated, normalised output (input of o_proj)

  // The step is launched with programmatic dependent launch: its CTAs may become resident while the kernel before
  // it on the stream drains, and wait for that kernel to finish (and its writes to be visible) before they read
  // or write anything. With early_state_loads they read `slots` and issue the state's loads before that wait, so
  // the state streams in during the previous kernel's tail. Set it only when the kernel enqueued just before this
  // one on the stream writes neither `state` nor `slots` (e.g. the previous layer's decode step or the layer's
  // projections) and does not start its own dependents before its predecessors finished. The spec verify/commit
  // kernels, which share these params, ignore it.
  bool early_state_loads = false;
};

[[nodiscard]] Status kda_decode_step(const KdaDecodeParams& params, cudaStream_t stream);

// Up to how many batch rows a caller should pass the low-rank gates to the decode step (KdaDecodeParams::gate_low)
// instead of running their up-projections as a GEMM: below it, saving the GEMM's launch wins; above it, every
// (row, head) CTA re-reading its head's f_b (and g_b) costs more than the GEMM.
constexpr int kKdaFusedGateMaxRows = 4;

// ---- speculative decoding ---------------------------------------------------------------------------------
// Device buffers of one verify/commit pair (kept by the caller between the two calls).
struct KdaSpecBuffers {
  int max_draft_tokens = 0;     // k_max in [1, 16]
  float* saved = nullptr;       // [B, k, H, 3, d] fp32: each draft token's k (L2-normalised), v (after conv), e^g
  float* saved_beta = nullptr;  // [B, k, H] fp32
};

// Verify k draft tokens per row: with KdaDecodeParams' activations read as [B, k, H*d] ([B, k, H] for beta_raw)
// and `out` written as [B, k, H*d], runs the tokens in order from the committed state exactly like k decode
// steps, but leaves `state` and `conv_state` untouched; saves the projected inputs into `buffers`.
[[nodiscard]] Status kda_spec_verify(const KdaDecodeParams& params, int draft_tokens, const KdaSpecBuffers& buffers,
                                     cudaStream_t stream);

// Commit the first accepted[b] (device int32 [B], clamped to [0, k]) draft tokens of each row: rebuilds the state
// from the saved inputs and shifts the accepted raw q/k/v inputs (the verify call's q_in/k_in/v_in) into the conv
// tails. The result equals running only the accepted tokens through kda_decode_step. Graph-capturable.
[[nodiscard]] Status kda_spec_commit(const KdaDecodeParams& params, int draft_tokens, const int32_t* accepted,
                                     const KdaSpecBuffers& buffers, cudaStream_t stream);

}  // namespace deltaserve::kernels::cuda
