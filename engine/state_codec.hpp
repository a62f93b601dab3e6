// Byte encoding of a RequestState for the prefill → decode handoff (and later, checkpoints).
//
// Layout (little-endian): header {magic "DSRS", version u32, model fingerprint u64, num_tokens i64,
// kda layers u32, mla layers u32, per-section byte counts}, then for each KDA layer conv_q, conv_k,
// conv_v, recurrent (fp32), then for each MLA layer its rows (fp32), then an FNV-1a 64 checksum of
// everything before it. decode_state rejects (DataLoss, with what is wrong) a short buffer, a bad
// magic/version, a state of another model (fingerprint or shapes), and a checksum mismatch — so a
// decode never starts on partial or corrupt state.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "common/status.hpp"
#include "engine/model_config.hpp"
#include "engine/request_state.hpp"

namespace deltaserve::engine {

// Identifies the architecture a state belongs to (hash of the shapes that size the state).
uint64_t state_fingerprint(const ModelConfig& config);

std::vector<std::byte> encode_state(const ModelConfig& config, const RequestState& state);
Result<RequestState> decode_state(const ModelConfig& config, std::span<const std::byte> bytes);

}  // namespace deltaserve::engine
