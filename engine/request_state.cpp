#include "engine/request_state.hpp"

#include <algorithm>
#include <cstdio>
#include <cstdlib>

namespace deltaserve::engine {

RequestState::RequestState(const ModelConfig& config) {
  const int64_t channels = config.kda.num_heads * config.kda.head_dim;
  const auto tail = static_cast<size_t>(channels * (config.kda.conv_kernel_size - 1));
  const auto state = static_cast<size_t>(config.kda.num_heads * config.kda.head_dim * config.kda.head_dim);
  kda.resize(static_cast<size_t>(config.num_layers_of(LayerKind::kKda)));
  for (KdaLayerState& layer : kda) {
    layer.conv_q.assign(tail, 0.0f);
    layer.conv_k.assign(tail, 0.0f);
    layer.conv_v.assign(tail, 0.0f);
    layer.recurrent.assign(state, 0.0f);
  }
  mla.assign(static_cast<size_t>(config.num_layers_of(LayerKind::kMla)), MlaLayerCache(config.mla.cache_width()));
}

RequestState::RequestState(const RequestState& other) {
  *this = other;
}

RequestState& RequestState::operator=(const RequestState& other) {
  if (this == &other) return *this;
  // A copy of a device-resident state needs its contents. A failed download means a broken device (CUDA
  // errors are sticky): nothing sensible can continue, so stop with the reason rather than copy stale data.
  if (const Status synced = other.sync_host(); !synced.is_ok()) {
    std::fprintf(stderr, "fatal: %s\n", synced.to_string().c_str());
    std::abort();
  }
  kda = other.kda;
  mla = other.mla;
  num_tokens_ = other.num_tokens_;
  residency_.reset();
  host_kda_current_ = true;
  host_mla_tokens_ = num_tokens_;
  return *this;
}

Status RequestState::sync_host() const {
  if (!host_stale()) return Status::ok();
  auto& self = const_cast<RequestState&>(*this);
  DS_RETURN_IF_ERROR_CTX(residency_->download(self), "copying a request's caches from the device");
  self.host_kda_current_ = true;
  self.host_mla_tokens_ = num_tokens_;
  return Status::ok();
}

Status RequestState::sync_host_part(bool kda_part, int64_t mla_tokens) const {
  if (residency_ == nullptr) return Status::ok();
  const bool need_kda = kda_part && !host_kda_current_;
  const int64_t mla_end = std::min(std::max<int64_t>(mla_tokens, 0), num_tokens_);
  const bool need_mla = mla_end > host_mla_tokens_;
  if (!need_kda && !need_mla) return Status::ok();
  auto& self = const_cast<RequestState&>(*this);
  DS_RETURN_IF_ERROR_CTX(residency_->download_part(self, need_kda, host_mla_tokens_, need_mla ? mla_end : 0),
                         "copying part of a request's caches from the device");
  if (need_kda) self.host_kda_current_ = true;
  if (need_mla) self.host_mla_tokens_ = mla_end;
  return Status::ok();
}

void RequestState::drop_device() {
  residency_.reset();
  host_kda_current_ = true;
  host_mla_tokens_ = num_tokens_;
}

namespace {

[[noreturn]] void stale_read(const char* reader, const char* part) {
  std::fprintf(stderr, "fatal: %s read %s of a request state whose device copy is newer (sync not called)\n", reader,
               part);
  std::abort();
}

}  // namespace

void RequestState::expect_host_current(const char* reader) const {
  if (host_stale()) stale_read(reader, "the caches");
}

void RequestState::expect_host_kda_current(const char* reader) const {
  if (residency_ != nullptr && !host_kda_current_) stale_read(reader, "the KDA states");
}

void RequestState::expect_host_mla_rows(int64_t mla_tokens, const char* reader) const {
  if (residency_ != nullptr && host_mla_tokens_ < std::min(mla_tokens, num_tokens_)) stale_read(reader, "MLA rows");
}

void RequestState::reset() {
  drop_device();
  for (KdaLayerState& layer : kda) {
    std::fill(layer.conv_q.begin(), layer.conv_q.end(), 0.0f);
    std::fill(layer.conv_k.begin(), layer.conv_k.end(), 0.0f);
    std::fill(layer.conv_v.begin(), layer.conv_v.end(), 0.0f);
    std::fill(layer.recurrent.begin(), layer.recurrent.end(), 0.0f);
  }
  for (MlaLayerCache& layer : mla) layer.truncate(0);
  num_tokens_ = 0;
}

int64_t RequestState::kda_state_bytes() const {
  size_t values = 0;
  for (const KdaLayerState& layer : kda) {
    values += layer.conv_q.size() + layer.conv_k.size() + layer.conv_v.size() + layer.recurrent.size();
  }
  return static_cast<int64_t>(values * sizeof(float));
}

int64_t RequestState::mla_cache_bytes() const {
  size_t values = 0;
  for (const MlaLayerCache& layer : mla) values += layer.data().size();
  return static_cast<int64_t>(values * sizeof(float));
}

bool RequestState::same_contents(const RequestState& other) const {
  if (!sync_host().is_ok() || !other.sync_host().is_ok()) return false;
  if (num_tokens_ != other.num_tokens_ || kda.size() != other.kda.size() || mla.size() != other.mla.size()) {
    return false;
  }
  for (size_t i = 0; i < kda.size(); ++i) {
    const KdaLayerState& a = kda[i];
    const KdaLayerState& b = other.kda[i];
    if (a.conv_q != b.conv_q || a.conv_k != b.conv_k || a.conv_v != b.conv_v || a.recurrent != b.recurrent) {
      return false;
    }
  }
  for (size_t i = 0; i < mla.size(); ++i) {
    const auto x = mla[i].data();
    const auto y = other.mla[i].data();
    if (x.size() != y.size() || !std::equal(x.begin(), x.end(), y.begin())) return false;
  }
  return true;
}

}  // namespace deltaserve::engine
