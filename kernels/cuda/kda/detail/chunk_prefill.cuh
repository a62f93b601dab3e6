// What the chunked prefill's three translation units share (contract in kda.hpp): the per-(chunk, head) workspace
// block the prep writes and the state pass reads, the chunk and sequence tables, the kernels' arguments, and the
// launchers of the prep (chunk_prefill_prep.cu) and of the state passes (chunk_prefill_state.cu), which
// chunk_prefill.cu (validation, workspace, tables, the choice of pass) calls.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kernels/cuda/kda/kda.hpp"

namespace deltaserve::kernels::cuda::kda_prefill {

using bf16 = __nv_bfloat16;

constexpr int kD = kKdaHeadDim;
constexpr int kC = kKdaChunk;
constexpr int kStateBv = 64;            // value columns per state-pass slice (a CTA of the pass per slice)
constexpr int kLdU = kStateBv + 8;      // bf16 row stride of a u slice [64][kLdU]
constexpr int kSlices = kD / kStateBv;  // value slices of a head

// Per (chunk, head) block of the workspace, laid out as the state pass's shared-memory stage. The wgmma operands
// are 128-byte swizzled blocks of [64 rows][64 bf16] (8 KiB, 1024-byte aligned; sw128 below): w, q e^gc and
// k e^(gc_last - gc) as [64 tokens][128 keys] (two blocks: keys 0..63, 64..127), Aqk [64][64] (one block); then
// e^gc_last [128] fp32 (the part every value slice reads), then u as [2 slices][64][kLdU] (plain rows).
constexpr size_t kBlockBytes = size_t{kC} * 64 * 2;
constexpr size_t kOffW = 0;
constexpr size_t kOffQg = kOffW + 2 * kBlockBytes;
constexpr size_t kOffKg = kOffQg + 2 * kBlockBytes;
constexpr size_t kOffAqk = kOffKg + 2 * kBlockBytes;
constexpr size_t kOffDecay = kOffAqk + kBlockBytes;
constexpr size_t kOffU = kOffDecay + size_t{kD} * 4;  // the shared part ends here
constexpr size_t kUSliceBytes = size_t{kC} * kLdU * 2;
constexpr size_t kChunkBytes = kOffU + kSlices * kUSliceBytes;
static_assert(kOffU % 16 == 0 && kUSliceBytes % 16 == 0 && kChunkBytes % 16 == 0, "bulk copies need 16-byte units");

// Element offset of (row r, column c < 64) in a 128-byte-swizzled block of 64-element rows (the layout TMA's
// SWIZZLE_128B writes and sm90::smem_descriptor_sw128 reads: 16-byte chunk c / 8 of row r sits at chunk
// (c / 8) ^ (r % 8)). Rows may run past 64 (the state's [128][64] operand): the pattern repeats every 8 rows.
__host__ __device__ constexpr int sw128(int r, int c) {
  return r * 64 + ((((c >> 3) ^ (r & 7)) << 3) | (c & 7));
}
// The same for a [64][128] operand stored as two blocks of 64 columns.
__host__ __device__ constexpr int sw128_wide(int r, int c) {
  return (c >> 6) * (kC * 64) + sw128(r, c & 63);
}

struct ChunkEntry {
  int32_t token_begin;  // first token (global row) of the chunk
  int32_t tokens;       // 1..64
  int32_t sequence;
  int32_t unused;
};
struct SequenceEntry {
  int32_t first_chunk;
  int32_t num_chunks;
  int32_t token_begin;
  int32_t length;
  int32_t checkpoint_first;
  int32_t unused[3];
};

enum GateMode : int { kGatePrecomputed = 0, kGateSoftplus = 1, kGateBounded = 2 };

struct PrepArgs {
  const bf16* q;
  const bf16* k;
  const bf16* v;
  const float* g;
  const float* beta;
  float q_scale;
  int gate_mode;
  const float* a_log;
  const float* dt_bias;
  float lower_bound;
  int num_heads;
  const ChunkEntry* chunks;
  uint8_t* data;
  // The overlapped pass (KdaStatePass::kPerHeadOverlapped): a 1-D grid of (chunk, head) items in chunk-major order,
  // flags[item] set (release) once the item's block is written, `done` counting the finished items; the last to
  // finish waits for the state pass (its primary grid), so this grid completes after it. nullptr: the 2-D grid.
  unsigned int* flags;
  unsigned int* done;
  unsigned int total_items;
};

struct StateArgs {
  int num_heads;
  const SequenceEntry* sequences;
  const uint8_t* data;
  const float* initial_state;
  float* final_state;
  int checkpoint_interval;
  float* checkpoint_states;
  bf16* o;
  const unsigned int* flags;  // the overlapped pass: a chunk's block is read once its flag is set; nullptr: at once
  // The overlapped pass: a CTA whose first chunk is not flagged within wait_ns (the prep is not running beside it:
  // kernels serialised) sets fallback[sequence * H + h] and leaves; the same kernel launched after the prep with
  // rerun set runs exactly those CTAs, without flags.
  unsigned int* fallback;
  unsigned long long wait_ns;
  int rerun;
};

// chunk_prefill_prep.cu. The prep of `chunks` x H (chunk, head) blocks: a 2-D grid (chunks, H) when args.flags is
// null; else a 1-D grid of args.total_items CTAs launched as a programmatic dependent of the kernel before it on
// `stream` (the overlapped state pass). Returns the launch's error.
cudaError_t launch_chunk_prep(const PrepArgs& args, int64_t chunks, cudaStream_t stream);

// chunk_prefill_state.cu. The state pass per slice: a CTA per (64 value columns, head, sequence).
cudaError_t launch_chunk_state_per_slice(const StateArgs& args, int64_t sequences, cudaStream_t stream);
// The state pass per head: a CTA per (head, sequence); args.flags set: the overlapped pass (its first launch, or its
// rerun with args.rerun).
cudaError_t launch_chunk_state_per_head(const StateArgs& args, int64_t sequences, cudaStream_t stream);

}  // namespace deltaserve::kernels::cuda::kda_prefill
