// The engine's side of the prefix cache: how a RequestState is cut into what the cache keeps and put
// back together from it.
//   - KDA checkpoint: the conv tails and recurrent state S of every KDA layer at a block boundary, as
//     bytes with a header (model fingerprint, position) and a checksum;
//   - MLA rows: one page row per token = the token's cache row of every MLA layer side by side
//     ([layer 0 row ‖ layer 1 row ‖ ...], each kv_lora_rank + qk_rope values, fp32).
// Resuming = restoring the checkpoint at boundary k and loading k × 512 tokens of rows from the shared
// pages; the forward pass then continues exactly as if it had computed those tokens itself.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "common/status.hpp"
#include "engine/model_config.hpp"
#include "engine/request_state.hpp"
#include "kvstore/cache/page_pool.hpp"

namespace deltaserve::engine {

// Values per token in a page row (every MLA layer's cache row); 0 for a model without MLA layers.
int64_t mla_page_row_values(const ModelConfig& config);

// The readers below need a current host copy (RequestState::sync_host() after a device forward pass); the
// writers give up any device copy (the next forward pass uploads the restored contents).
// Checkpoint layout (little-endian): magic "DSKC", u32 version 1, u64 total bytes, u64 state fingerprint,
// i64 position (tokens consumed), u64 payload bytes, payload (per KDA layer: conv_q, conv_k, conv_v, S as
// fp32), u64 checksum of everything before it (64-bit multiply-xor over 8-byte words).
std::vector<std::byte> encode_kda_checkpoint(const ModelConfig& config, const RequestState& state);

// Restores the KDA part of `state` from a checkpoint; returns the checkpoint's position. DataLoss (naming
// what is wrong) on a bad magic/version/size/checksum or a checkpoint of another model; `state` is then
// unchanged.
Result<int64_t> restore_kda_checkpoint(const ModelConfig& config, std::span<const std::byte> bytes,
                                       RequestState& state);

// Page rows of tokens [first, first + count) of `state` ([count, mla_page_row_values]).
std::vector<float> gather_mla_page_rows(const ModelConfig& config, const RequestState& state, int64_t first,
                                        int64_t count);

// Resumes a fresh (or reset) `state` at `tokens` = the boundary of a prefix-cache hit: restores the
// checkpoint (whose position must equal `tokens`) and loads the first `tokens` rows of `pages` into the MLA
// caches. On an error `state` is reset.
Status resume_from_prefix(const ModelConfig& config, std::span<const std::byte> checkpoint,
                          const kvstore::PageTable& pages, const kvstore::PagePool& pool, int64_t tokens,
                          RequestState& state);

}  // namespace deltaserve::engine
