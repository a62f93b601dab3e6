// The naive MLA prefill's flash-attention kernel on Hopper warpgroup MMA and TMA. Internal to prefill.cu, which plans
// the key blocks and runs its mma.sync kernel where this one declines.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "common/status.hpp"

namespace deltaserve::kernels::cuda::detail {

// One launch: the queries of one sequence against one decompressed block of its context (prefill.cu, step 3).
struct MlaWgmmaBlock {
  const __nv_bfloat16* q = nullptr;  // [T, H, nope + rope], row stride q_stride (elements)
  int64_t q_stride = 0;
  const __nv_bfloat16* kv = nullptr;    // [block_rows, H (nope + v_head)]: per head K_nope then V (workspace)
  const __nv_bfloat16* rows = nullptr;  // [block_rows, kv_lora + rope]: the gathered cache rows (k_rot at kv_lora)
  float* out = nullptr;                 // [T, H, v_head] fp32: unnormalised O between blocks, the result after the last
  float2* ml = nullptr;                 // [T, H]: (running max in log2 units, running sum) between blocks
  int num_heads = 0, kv_lora = 0, nope = 0, rope = 0, v_head = 0;
  int64_t q_begin = 0;      // the sequence's first token in the batch
  int64_t q_len = 0;        // its query tokens (positions context - q_len ..)
  int64_t context = 0;      // its context length
  int64_t block_begin = 0;  // first context row of this block
  int64_t block_rows = 0;   // rows in this block (> 0)
  float scale_log2 = 0.0f;  // softmax_scale * log2(e)
  bool first = false;       // the sequence's first block: no state to carry in
  bool last = false;        // its last block: normalise and write the result
};

// Whether this kernel covers these head dims and query layout: qk_nope 128, qk_rope 64, v_head 128 (Kimi Linear,
// K3), q 16-byte aligned with q_stride a multiple of 8 (16-byte rows). Otherwise the caller runs the mma.sync kernel.
bool mla_wgmma_prefill_supported(int nope, int rope, int v_head, const void* q, int64_t q_stride);

// Once per mla_prefill call, before its launches: grants the kernel its shared memory on the current device and
// looks up the driver's tensor-map encoder. false: it cannot run here (the caller runs the mma.sync kernel; the error
// is cleared).
bool mla_wgmma_prefill_ready();

// Launches the block's attention on `stream`: asynchronous, no allocation or host sync (the TMA descriptors are
// encoded on the host into the launch parameters, so a captured graph keeps them). Needs a true
// mla_wgmma_prefill_supported and mla_wgmma_prefill_ready; 16-byte aligned kv and rows; a grid of
// ceil(q_len / 128) * num_heads <= INT32_MAX CTAs.
[[nodiscard]] Status mla_wgmma_prefill_launch(const MlaWgmmaBlock& block, cudaStream_t stream);

}  // namespace deltaserve::kernels::cuda::detail
