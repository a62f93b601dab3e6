// Everything one request carries between forward passes — exactly what the seeds say must be
// stored, checkpointed and moved from a prefill worker to a decode worker:
//   for each KDA layer: the short-conv tails of q, k, v and the fp32 recurrent state S;
//   for each MLA layer: the per-token cache rows [normed latent ‖ k_rot].
// AttnRes needs nothing across tokens. The CPU engine keeps MLA rows in fp32 and contiguous; the
// page-pool layout replaces MlaLayerCache behind the same append/rows contract (kvstore/cache).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "engine/model_config.hpp"

namespace deltaserve::engine {

struct KdaLayerState {
  std::vector<float> conv_q, conv_k, conv_v;  // [H·d, K-1] each, oldest input first
  std::vector<float> recurrent;               // S: [H, d_k, d_v] fp32
};

class MlaLayerCache {
 public:
  explicit MlaLayerCache(int64_t width = 0) : width_(width) {}
  int64_t width() const { return width_; }  // values per token (kv_lora_rank + qk_rope)
  int64_t num_tokens() const { return width_ ? static_cast<int64_t>(rows_.size()) / width_ : 0; }
  void append(std::span<const float> rows) { rows_.insert(rows_.end(), rows.begin(), rows.end()); }
  const float* rows() const { return rows_.data(); }  // [num_tokens, width], row stride = width
  void truncate(int64_t num_tokens) { rows_.resize(static_cast<size_t>(num_tokens * width_)); }
  std::span<const float> data() const { return rows_; }
  std::vector<float>& mutable_data() { return rows_; }

 private:
  int64_t width_ = 0;
  std::vector<float> rows_;
};

class RequestState {
 public:
  RequestState() = default;
  explicit RequestState(const ModelConfig& config);

  int64_t num_tokens() const { return num_tokens_; }  // positions already consumed
  void advance(int64_t tokens) { num_tokens_ += tokens; }

  // Back to the state of a fresh request (zero KDA state, empty MLA caches), keeping the memory.
  void reset();

  // Indexed by the layer's ordinal among layers of its kind (see Model::layer_slot).
  std::vector<KdaLayerState> kda;
  std::vector<MlaLayerCache> mla;

  // Bytes held: fixed-size recurrent state (S + conv tails) and the growing MLA cache (as stored here, fp32).
  int64_t kda_state_bytes() const;
  int64_t mla_cache_bytes() const;

  // Bitwise equality of every cache (used to check handoffs and checkpoints restore exactly).
  bool same_contents(const RequestState& other) const;

 private:
  int64_t num_tokens_ = 0;
};

}  // namespace deltaserve::engine
