// MLA prefill attention over a paged cache: any varlen batch (prefill chunks over cached history, mixed batches).
// It runs the same absorbed, context-split kernels as mla_decode (see mla_decode.cu) with one CTA per (query
// token, split, head group). Correct for every shape; FLOP efficiency is that of the absorbed form, about 3.4x the
// work of the naive form per (query, row) pair at Kimi dims, and every query token re-reads its visible rows.
// A naive-form (materialised K/V) tensor-core prefill over query tiles is future work.
#include "kernels/cuda/mla.hpp"
#include "kernels/cuda/mla_attention.cuh"

namespace deltaserve::kernels::cuda {

Status mla_prefill(const MlaAttentionParams& params, cudaStream_t stream) {
  return detail::mla_attention_launch(params, /*decode=*/false, "mla_prefill", stream);
}

}  // namespace deltaserve::kernels::cuda
