// Internal to the MLA kernels: the shared attention launch behind mla_decode and mla_prefill (mla_decode.cu).
#pragma once

#include <cuda_runtime.h>

#include "common/status.hpp"
#include "kernels/cuda/mla.hpp"

namespace deltaserve::kernels::cuda::detail {

// Validates `params` (decode: also num_tokens <= num_seqs) and enqueues absorb -> split attention -> combine.
// `who` names the public launcher in error messages.
Status mla_attention_launch(const MlaAttentionParams& params, bool decode, const char* who, cudaStream_t stream);

// Shared check of a page pool (`who`: launcher name for messages).
Status validate_mla_pool(const MlaPagePool& pool, int layer, const char* who);

}  // namespace deltaserve::kernels::cuda::detail
