// Byte encoding of a RequestState for the prefill → decode handoff (and later, checkpoints).
//
// Layout, version 1 (integers little-endian, floats IEEE-754 binary32 little-endian):
//   offset  0  magic "DSRS"                  4 bytes
//           4  version                       u32 (1)
//           8  total bytes                   u64 (the whole encoding, checksum included)
//          16  model fingerprint             u64 (state_fingerprint)
//          24  num_tokens                    i64 (positions consumed)
//          32  KDA layers                    u32
//          36  MLA layers                    u32
//          40  conv tail bytes               u64 (each of conv_q, conv_k, conv_v of one KDA layer)
//          48  recurrent bytes               u64 (S of one KDA layer)
//          56  MLA layer bytes               u64 × MLA layers
//   then for each KDA layer conv_q, conv_k, conv_v, recurrent; then for each MLA layer its rows
//   [num_tokens, cache_width]; then an FNV-1a 64 checksum (u64) of every byte before it.
//
// decode_state never starts a decode on partial or corrupt state. It returns DataLoss naming what is
// wrong, checking in this order: a bad magic, an unsupported version, a buffer shorter than its total
// size ("truncated"; also any buffer too short to hold magic, version and size) or longer ("trailing
// bytes"), a checksum mismatch, a state of another model (fingerprint), a KDA or MLA layer count or a
// section size that is not this model's (MLA sections must hold num_tokens rows each). So any flipped
// byte past the first 16 (magic, version, total size) is reported as a checksum mismatch. Any input is
// safe to decode: no crash, no read out of bounds, and memory is allocated only for the returned state
// after every check passed.
//
// Speed: the byte-at-a-time FNV-1a checksum takes most of the encode time; a faster checksum would need a new
// version.
//
// Round trip: decode_state(config, encode_state(config, s)) is bitwise equal to s
// (RequestState::same_contents) for every state the model produced for `config`.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "common/status.hpp"
#include "engine/model_config.hpp"
#include "engine/request_state.hpp"

namespace deltaserve::engine {

inline constexpr uint32_t kStateCodecVersion = 1;

// Identifies the architecture a state belongs to: a hash of the integer, boolean and enum fields of
// the config that shape the state or the math applied to it (layer kinds and their order, widths, head
// counts, conv kernel, gate and MoE structure, AttnRes block size). Deployment knobs (context limit,
// special token ids) and float constants are left out. Weights are not covered: two checkpoints of
// the same architecture share a fingerprint.
uint64_t state_fingerprint(const ModelConfig& config);

// `state` must have this model's shapes (as Model::new_state() and forward() keep them) and a current host
// copy (RequestState::sync_host() after a device forward pass).
std::vector<std::byte> encode_state(const ModelConfig& config, const RequestState& state);
Result<RequestState> decode_state(const ModelConfig& config, std::span<const std::byte> bytes);

}  // namespace deltaserve::engine
