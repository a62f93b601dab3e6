// MLA prefill attention over a paged cache: any varlen batch (prefill chunks over cached history, mixed batches).
// It runs the same absorbed, context-split kernels as mla_decode with one CTA per (query token, split, head
// group); see mla_decode.cu. Each query token re-reads its visible rows (from L2 when the tokens of a chunk run
// together), so this is correct for every shape but CUDA-core bound: about 4 (H (kv_lora + rope) + H kv_lora)
// FLOPs per visible row per token, far from tensor-core speed. A naive-form (materialised K/V) tensor-core
// prefill kernel over query tiles is future work.
#include "kernels/cuda/mla.hpp"
#include "kernels/cuda/mla_attention.cuh"

namespace deltaserve::kernels::cuda {

Status mla_prefill(const MlaAttentionParams& params, cudaStream_t stream) {
  return detail::mla_attention_launch(params, /*decode=*/false, "mla_prefill", stream);
}

}  // namespace deltaserve::kernels::cuda
