// Multi-head Latent Attention (NoPE) on Hopper over a paged cache: page pool writes, the absorbed paged decode
// (split over the context, partials combined with log-sum-exp) and the prefill attention of a varlen chunk over
// its cached pages. Math: shared/spec/model.md §4; CPU reference: kernels/cpu/mla.hpp (the tests compare to it).
// Layouts are token-major: [T, H, D] means element (t, h, d) at ((t * H) + h) * D + d.
// Every launcher validates its host-visible inputs and returns a Status before anything is launched; device
// pointers are checked for null and 16-byte alignment only (their contents cannot be read here).
#pragma once

#include <cstddef>
#include <cstdint>

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "common/status.hpp"

namespace deltaserve::kernels::cuda {

// Limits of the kernels (the tiny test models and Kimi Linear / K3 are all inside them).
constexpr int kMlaMaxKvLora = 512;
constexpr int kMlaMaxRope = 64;
constexpr int kMlaMaxNope = 192;
constexpr int kMlaMaxVHead = 256;
constexpr int kMlaMaxHeads = 128;
constexpr int kMlaMaxPageSize = 256;  // page_size: a positive multiple of 16 up to this

// GPU page pool of MLA cache rows for ALL MLA layers of the model. A page holds `page_size` consecutive tokens of
// one sequence for every MLA layer: value j of token i (0 <= i < page_size) of layer l in page p is at
//   pages[((p * num_layers + l) * page_size + i) * row_stride + j],   j < width = kv_lora_rank + qk_rope.
// bf16. row_stride >= width, a multiple of 8 (16-byte rows).
struct MlaPagePool {
  __nv_bfloat16* pages = nullptr;
  int64_t num_pages = 0;
  int num_layers = 0;
  int page_size = 64;
  int64_t row_stride = 0;
  int64_t width = 0;
};
// Sequences address their pages through block tables: device int32 [num_seqs, max_pages_per_seq], row n lists
// sequence n's page ids in token order (token position t lives in page block_tables[n][t / page_size], slot
// t % page_size). Entries past a sequence's length may hold anything (even -1).

// mla_decode merges the context splits and applies W_UV with a cluster of CTAs per (16 tokens, head) up to this
// many tokens (each CTA a 64-column slice of the latent; more CTAs for small batches), and with one CTA per
// (32 tokens, head) past it (W_UV read once per 32 tokens).
constexpr int kMlaSplitKCombineMaxTokens = 16;

// Writes new cache rows for T tokens of layer `layer`: row t = [rms_norm(kv[t, :kv_lora]) * norm_weight ‖
// kv[t, kv_lora:width]] as bf16 (cpu::rms_norm semantics, fp32 math) at pool position slot_mapping[t]
// (= page * page_size + offset; < 0: token skipped). kv fp32 [T, width] with row stride kv_stride (the kv_a_proj
// GEMM output).
struct MlaWriteParams {
  MlaPagePool pool;
  int layer = 0;
  int64_t num_tokens = 0;
  const float* kv = nullptr;
  int64_t kv_stride = 0;
  const float* norm_weight = nullptr;  // [kv_lora] fp32
  float eps = 1e-5f;
  int kv_lora_rank = 0, qk_rope = 0;
  const int64_t* slot_mapping = nullptr;  // device [T]
};
// Asynchronous, graph-capturable. Slots at or past num_pages * page_size are skipped too (never written).
// Launched with programmatic dependent launch: it may start while the kernel before it drains and waits for it
// (griddepcontrol.wait) before reading kv and slot_mapping or writing the pool (the norm weight is read before).
[[nodiscard]] Status mla_write_rows(const MlaWriteParams& params, cudaStream_t stream);

// The two ways mla_prefill computes the same attention (model.md §4):
//   absorbed: the decode kernels with one CTA per query token (q̃ = W_UKᵀ q_nope, scores and P·c over the 576-wide
//             latent rows, W_UV at the end): about 3.4x the naive form's FLOPs at Kimi dims, every token re-reads
//             its rows. Any shape; graph-capturable.
//   naive:    per sequence and per block of context rows: gather the block's cache rows into the workspace,
//             decompress them with one cuBLAS GEMM (K_nope[h] = W_UK[h] c, V[h] = W_UV[h] c, bf16), then a
//             flash-attention kernel over (128-query tile, head) CTAs on tensor cores (bf16 products, fp32 online
//             softmax; K and V rounded to bf16, P rounded to bf16), the softmax state carried across blocks in
//             `out` plus a (max, sum) workspace array. Needs the host copies, a cuBLAS handle, qk_nope and v_head
//             multiples of 8, qk_nope + qk_rope <= 192, v_head <= 128, and a workspace holding at least one block
//             of 64 rows (mla_prefill_workspace_bytes). The launches are planned on the host from the host copies
//             (no device reads, no sync), so a captured graph holds only for the lengths it was captured with.
//             The flash kernel is the Hopper one (warpgroup MMA, TMA loads; prefill_wgmma.cu) at qk_nope 128,
//             qk_rope 64, v_head 128 (Kimi Linear, K3) with q 16-byte aligned and q_stride a multiple of 8; the
//             mma.sync one (prefill.cu) for the other head dims and query layouts. They agree up to rounding.
// kAuto picks naive when it can run and a FLOP-based cost estimate of the whole batch favours it (prefill.cu:
// the naive form's decompression GEMM covers a sequence's whole context however few its queries, so decode-shaped
// batches stay absorbed; at Kimi-48B dims the naive form wins from about 11 queries per sequence); otherwise
// absorbed. kAbsorbed and kNaive force a form (the tests run both on the same inputs); kNaive fails
// (InvalidArgument) where the naive form cannot run.
enum class MlaPrefillForm : int { kAuto = 0, kAbsorbed = 1, kNaive = 2 };
constexpr int kMlaNaiveMaxQk = 192;  // qk_nope + qk_rope
constexpr int kMlaNaiveMaxV = 128;
constexpr int kMlaNaiveBlockGranule = 64;  // context rows per block are a multiple of this

// Attention of a varlen batch of query tokens over each sequence's paged cache (which already holds the rows of
// these tokens, written by mla_write_rows). Sequence n has q_len[n] = cu_q[n+1] - cu_q[n] query tokens and a
// context of context_lens[n] rows (>= q_len[n]); query token i of sequence n sits at position
// context_lens[n] - q_len[n] + i and sees rows 0..that position (causal). q_len 0 is allowed; context 0 requires
// q_len 0. Same result as cpu::mla_attention_naive / _absorbed up to rounding.
struct MlaAttentionParams {
  int num_heads = 0, kv_lora_rank = 0, qk_nope = 0, qk_rope = 0, v_head = 0;
  float softmax_scale = 0.0f;
  MlaPagePool pool;
  int layer = 0;
  int num_seqs = 0;                       // N
  int64_t num_tokens = 0;                 // T = cu_q[N] (host value)
  const int32_t* cu_q = nullptr;          // device [N + 1]
  const int32_t* context_lens = nullptr;  // device [N]
  const int32_t* block_tables = nullptr;  // device [N, max_pages_per_seq]
  int max_pages_per_seq = 0;
  int max_context = 0;               // host upper bound of every context_lens[n] (sizes the split grid; the
                                     // kernels read the real lengths on the device, so a graph captured with a
                                     // bound stays valid while lengths grow up to it)
  const __nv_bfloat16* q = nullptr;  // [T, H, qk_nope + qk_rope], row stride q_stride (elements) per token
  int64_t q_stride = 0;
  const __nv_bfloat16* kv_b = nullptr;  // kv_b_proj [H * (qk_nope + v_head), kv_lora]: per head W_UK rows then W_UV
  float* out = nullptr;                 // [T, H, v_head] fp32; may be null when out_bf16 is set
  // mla_decode only (mla_prefill rejects it): when set, the output is written here as bf16 (round to nearest of the
  // fp32 value `out` would hold) and `out` is not written: [T, H, v_head], no padding. Saves the engine's separate
  // fp32 -> bf16 conversion launch.
  __nv_bfloat16* out_bf16 = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  // false (default): scores and P·V on tensor cores (q̃ and the softmax weights rounded to bf16, fp32 accumulate);
  // true: the fp32 CUDA-core kernel for that step (exact up to fp32 rounding, several times slower): the reference
  // the tests hold the tensor-core kernels against. Absorbed form only (mla_decode, and mla_prefill when it runs the
  // absorbed form).
  bool fp32_attention = false;

  // mla_prefill only: which form it runs (see MlaPrefillForm) and what the naive form needs. The naive form plans
  // on the host from host copies of cu_q [N + 1] and context_lens [N] (the same values as the device arrays; read
  // during the call only) and decompresses K/V with a cuBLAS GEMM on `cublas` (its stream is set to the launch
  // stream). Without them kAuto runs the absorbed form.
  MlaPrefillForm prefill_form = MlaPrefillForm::kAuto;
  const int32_t* host_cu_q = nullptr;
  const int32_t* host_context_lens = nullptr;
  cublasHandle_t cublas = nullptr;
};
// Workspace for a batch of up to max_tokens query tokens with contexts up to max_context (device, 256-byte
// aligned sections: absorbed queries fp32 [T, H, kv_lora + rope], per-split latent partials fp32
// [T, splits, H, kv_lora] and their (max, sum) pairs): about 4 T H (kv_lora + rope + splits (kv_lora + 2)) bytes,
// e.g. 140 KB per token at Kimi-48B dims with one split (long prefill chunks), so chunk prefill accordingly.
// 0 for non-positive dims.
size_t mla_attention_workspace_bytes(int num_heads, int kv_lora_rank, int qk_rope, int64_t max_tokens, int max_context);
// Both launchers are asynchronous on `stream` and need, beyond the shapes above: kv_lora_rank and qk_rope multiples
// of 8 (16-byte row loads), pool.width == kv_lora_rank + qk_rope, kv_b 16-byte aligned, workspace_bytes >=
// mla_attention_workspace_bytes(H, kv_lora, rope, num_tokens, max_context). Page ids read from the block tables
// outside [0, num_pages) are not dereferenced (their rows count as zeros).
// Decode-shaped batches (every q_len <= 1): absorbed form, graph-capturable (no host sync, no allocation).
[[nodiscard]] Status mla_decode(const MlaAttentionParams& params, cudaStream_t stream);
// Any batch (prefill chunks, mixed): correct for every shape; the absorbed or the naive form per
// MlaAttentionParams::prefill_form (see MlaPrefillForm). When the naive form runs, workspace_bytes needs only
// cover mla_prefill_workspace_bytes(..., num_tokens, 64) (more rows per block where it holds more).
[[nodiscard]] Status mla_prefill(const MlaAttentionParams& params, cudaStream_t stream);

// Whether the naive form supports these head dims (the other requirements are per call).
bool mla_prefill_naive_supported(int qk_nope, int qk_rope, int v_head);
// Workspace for the naive form with up to max_tokens query tokens, decompressing up to block_rows context rows at
// a time (rounded up to kMlaNaiveBlockGranule): a (max, sum) pair per (token, head), fp32, plus per row the gathered
// cache row (2 (kv_lora + rope) bytes) and its decompressed K_nope ‖ V for every head (2 H (qk_nope + v_head)
// bytes), 256-byte aligned sections. Kimi-48B: 8 T H + 17,536 bytes per row, e.g. 68.5 MiB + 2 MiB for 4096 rows
// and T = 8192, 548 MiB for 32768 rows. A longer context runs in several blocks (exact: the online softmax state is
// carried), so block_rows trades memory for fewer, larger GEMMs; 4096..32768 is a good range. mla_prefill takes
// as many rows per block as workspace_bytes holds, so the absorbed workspace (which is larger for long chunks)
// serves too: size the buffer as the max of both functions. 0 for non-positive dims.
size_t mla_prefill_workspace_bytes(int num_heads, int kv_lora_rank, int qk_nope, int qk_rope, int v_head,
                                   int64_t max_tokens, int block_rows);

// Context splits the attention kernels use for a batch of num_tokens query tokens with contexts up to max_context:
// at least 128 rows per split, and about one wave of (token, split) CTAs on the 132 SMs (1 at 132 tokens and more;
// Kimi-48B ctx 4096: 32 at T <= 4, 16 at T = 8, 2 at T = 64); at most kMlaMaxSplits. Exposed for tests and benchmarks;
// mla_attention_workspace_bytes accounts for it.
constexpr int kMlaMaxSplits = 64;
int mla_num_splits(int64_t num_tokens, int max_context);
// Heads per CTA of the tensor-core attention kernels: 32, or 16 or 8 where num_tokens x splits x head groups
// would leave most SMs idle (Kimi-48B ctx 4096: 8 at T = 1, 16 at T = 2, 32 from T = 4), capped at num_heads.
// Exposed for tests and benchmarks.
int mla_decode_head_group(int64_t num_tokens, int num_heads, int max_context);

}  // namespace deltaserve::kernels::cuda
