// Everything one request carries between forward passes — exactly what the seeds say must be
// stored, checkpointed and moved from a prefill worker to a decode worker:
//   for each KDA layer: the short-conv tails of q, k, v and the fp32 recurrent state S;
//   for each MLA layer: the per-token cache rows [normed latent ‖ k_rot].
// AttnRes needs nothing across tokens. The CPU engine keeps MLA rows in fp32 and contiguous; the
// page-pool layout replaces MlaLayerCache behind the same append/rows contract (kvstore/cache).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "common/status.hpp"
#include "engine/backend.hpp"
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
  // Copies hold the host contents only (brought up to date first); the device copy stays with the source.
  RequestState(const RequestState& other);
  RequestState& operator=(const RequestState& other);
  RequestState(RequestState&&) noexcept = default;
  RequestState& operator=(RequestState&&) noexcept = default;
  ~RequestState() = default;

  int64_t num_tokens() const { return num_tokens_; }  // positions already consumed
  void advance(int64_t tokens) { num_tokens_ += tokens; }

  // Back to the state of a fresh request (zero KDA state, empty MLA caches), keeping the host memory;
  // a device copy is given back to its backend.
  void reset();

  // ---- device residency (see engine/backend.hpp) ----
  // While a backend keeps this request's caches on its device, `kda` and `mla` below may be out of date:
  // code that reads them calls sync_host() first (the engine's codecs do), and code that writes them calls
  // drop_device() (the next forward pass uploads the host contents).
  const DeviceResidency* residency() const { return residency_.get(); }
  DeviceResidency* mutable_residency() { return residency_.get(); }
  void attach_residency(std::unique_ptr<DeviceResidency> residency) { residency_ = std::move(residency); }
  // The host copy is tracked in two parts: the KDA states (any device pass changes them) and the MLA rows
  // (append-only: rows the host already holds stay valid while the device appends more).
  bool host_stale() const { return residency_ != nullptr && (!host_kda_current_ || host_mla_tokens_ < num_tokens_); }
  // Backends: true after a device pass (the KDA part and any new MLA rows are newer on the device); false after
  // an upload (the host holds everything).
  void set_host_stale(bool stale) {
    host_kda_current_ = !stale;
    if (!stale) host_mla_tokens_ = num_tokens_;
  }
  // Brings the host containers up to date (a no-op unless stale). Logically const: the host containers are
  // a copy of the device contents.
  [[nodiscard]] Status sync_host() const;
  // Only what a reader needs: the KDA part (when `kda`) and the MLA rows of the first `mla_tokens` tokens
  // (clamped to num_tokens()). The prefix cache takes each chunk's new rows and a checkpoint now and then; the
  // full copy waits for the handoff.
  [[nodiscard]] Status sync_host_part(bool kda, int64_t mla_tokens) const;
  void drop_device();
  // For readers of the host containers that cannot fail: a stale host copy there is a bug (the caller
  // skipped sync_host()), so this stops the process naming `reader`. The narrower checks: the KDA part, the MLA
  // rows of the first `mla_tokens` tokens.
  void expect_host_current(const char* reader) const;
  void expect_host_kda_current(const char* reader) const;
  void expect_host_mla_rows(int64_t mla_tokens, const char* reader) const;

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
  std::unique_ptr<DeviceResidency> residency_;
  bool host_kda_current_ = true;
  int64_t host_mla_tokens_ = 0;  // MLA rows the host holds current (meaningful with a residency)
};

}  // namespace deltaserve::engine
