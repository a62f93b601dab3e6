#include "engine/cuda/device_state.hpp"

#include <algorithm>
#include <cstring>

#include "engine/checkpoint/safetensors.hpp"

namespace deltaserve::engine::cuda {

StateShape StateShape::of(const ModelConfig& config) {
  StateShape s;
  s.kda_layers = config.num_layers_of(LayerKind::kKda);
  s.heads = config.kda.num_heads;
  s.head_dim = config.kda.head_dim;
  s.conv_kernel = config.kda.conv_kernel_size;
  s.mla_layers = config.num_layers_of(LayerKind::kMla);
  s.mla_width = config.mla.cache_width();
  s.mla_row_stride = (s.mla_width + 7) / 8 * 8;
  return s;
}

DevicePools::~DevicePools() {
  (void)cudaSetDevice(device_);
  if (stream_ != nullptr) {
    (void)cudaStreamSynchronize(stream_);
    (void)cudaStreamDestroy(stream_);
  }
}

Status DevicePools::create_stream() {
  DS_CUDA_RETURN(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  return Status::ok();
}

Status DevicePools::allocate(int64_t slots, int64_t pages, int page_tokens) {
  num_slots_ = slots;
  DS_RETURN_IF_ERROR(
      states_.allocate(static_cast<size_t>(shape_.kda_layers * slots * shape_.state_floats()) * 4, "KDA state slots"));
  if (shape_.conv_kernel > 1) {
    DS_RETURN_IF_ERROR(
        tails_.allocate(static_cast<size_t>(shape_.kda_layers * slots * shape_.tail_floats()) * 2, "KDA conv tails"));
  }
  pool_.num_pages = shape_.mla_layers > 0 ? pages : 0;
  pool_.num_layers = static_cast<int>(shape_.mla_layers);
  pool_.page_size = page_tokens;
  pool_.row_stride = shape_.mla_row_stride;
  pool_.width = shape_.mla_width;
  DS_RETURN_IF_ERROR(
      pages_.allocate(static_cast<size_t>(pool_.num_pages * shape_.page_bytes(page_tokens)), "MLA cache pages"));
  pool_.pages = pages_.as<__nv_bfloat16>();
  // Zeroed once so padding columns and unwritten rows never hold NaN.
  if (pages_.bytes() > 0) DS_CUDA_RETURN(cudaMemsetAsync(pages_.data(), 0, pages_.bytes(), stream_));
  free_slots_.clear();
  for (int64_t s = slots - 1; s >= 0; --s) free_slots_.push_back(static_cast<int32_t>(s));  // lowest first
  free_pages_.clear();
  for (int64_t p = pool_.num_pages - 1; p >= 0; --p) free_pages_.push_back(static_cast<int32_t>(p));
  DS_CUDA_RETURN(cudaStreamSynchronize(stream_));
  return Status::ok();
}

DeviceStateSpans DevicePools::spans(int32_t slot, const std::vector<int32_t>& pages) const {
  DeviceStateSpans out;
  out.page_tokens = pool_.page_size;
  for (int64_t layer = 0; layer < shape_.kda_layers; ++layer) {
    out.kda_states.push_back(
        {reinterpret_cast<std::byte*>(state_pool(layer) + slot * shape_.state_floats()), shape_.state_floats() * 4});
    if (shape_.conv_kernel > 1) {
      out.kda_tails.push_back(
          {reinterpret_cast<std::byte*>(conv_pool(layer) + slot * shape_.tail_floats()), shape_.tail_floats() * 2});
    }
  }
  const int64_t page_elements = static_cast<int64_t>(pool_.num_layers) * pool_.page_size * pool_.row_stride;
  for (int32_t page : pages) {
    out.mla_pages.push_back({reinterpret_cast<std::byte*>(pool_.pages + page * page_elements), page_elements * 2});
  }
  return out;
}

std::vector<DeviceSpan> DevicePools::memory_regions() const {
  std::vector<DeviceSpan> out;
  for (const DeviceMemory* m : {&states_, &tails_, &pages_}) {
    if (m->bytes() > 0) out.push_back({static_cast<std::byte*>(m->data()), static_cast<int64_t>(m->bytes())});
  }
  return out;
}

int32_t DevicePools::take_slot() {
  if (free_slots_.empty()) return -1;
  const int32_t slot = free_slots_.back();
  free_slots_.pop_back();
  return slot;
}
int32_t DevicePools::take_page() {
  if (free_pages_.empty()) return -1;
  const int32_t page = free_pages_.back();
  free_pages_.pop_back();
  return page;
}
void DevicePools::give_slot(int32_t slot) {
  free_slots_.push_back(slot);
}
void DevicePools::give_page(int32_t page) {
  free_pages_.push_back(page);
}

namespace {

// Device address of row `token` of MLA layer `layer` in a request's pages.
__nv_bfloat16* mla_row(const kernels::cuda::MlaPagePool& pool, const std::vector<int32_t>& pages, int64_t layer,
                       int64_t token) {
  const int64_t page = pages[static_cast<size_t>(token / pool.page_size)];
  return pool.pages + ((page * pool.num_layers + layer) * pool.page_size + token % pool.page_size) * pool.row_stride;
}

}  // namespace

Status DevicePools::upload(const RequestState& state, int32_t slot, const std::vector<int32_t>& pages) {
  const StateShape& s = shape_;
  const int64_t tail = s.channels() * (s.conv_kernel - 1);
  if (state.kda.size() != static_cast<size_t>(s.kda_layers) || state.mla.size() != static_cast<size_t>(s.mla_layers)) {
    return invalid_argument("request state was made for another model");
  }
  const bool empty = state.num_tokens() == 0;
  // Host-side bf16 rows for the tails and the MLA pages. Pageable source: each copy has taken its bytes when
  // cudaMemcpyAsync returns, so one buffer serves every copy.
  std::vector<uint16_t> staging;
  for (int64_t i = 0; i < s.kda_layers; ++i) {
    const KdaLayerState& layer = state.kda[static_cast<size_t>(i)];
    float* dst_state = state_pool(i) + slot * s.state_floats();
    __nv_bfloat16* dst_tail = conv_pool(i) != nullptr ? conv_pool(i) + slot * s.tail_floats() : nullptr;
    if (empty) {
      DS_CUDA_RETURN(cudaMemsetAsync(dst_state, 0, static_cast<size_t>(s.state_floats()) * 4, stream_));
      if (dst_tail) DS_CUDA_RETURN(cudaMemsetAsync(dst_tail, 0, static_cast<size_t>(s.tail_floats()) * 2, stream_));
      continue;
    }
    if (static_cast<int64_t>(layer.recurrent.size()) != s.state_floats() ||
        static_cast<int64_t>(layer.conv_q.size()) != tail || static_cast<int64_t>(layer.conv_k.size()) != tail ||
        static_cast<int64_t>(layer.conv_v.size()) != tail) {
      return invalid_argument("KDA layer state " + std::to_string(i) + " has the wrong shape");
    }
    DS_CUDA_RETURN(cudaMemcpyAsync(dst_state, layer.recurrent.data(), static_cast<size_t>(s.state_floats()) * 4,
                                   cudaMemcpyHostToDevice, stream_));
    if (dst_tail) {
      // bf16 on the device (round to nearest even; exact for tails a GPU worker wrote).
      const std::vector<float>* tails[3] = {&layer.conv_q, &layer.conv_k, &layer.conv_v};
      staging.resize(static_cast<size_t>(3 * tail));
      for (int j = 0; j < 3; ++j) {
        for (int64_t c = 0; c < tail; ++c) {
          staging[static_cast<size_t>(j * tail + c)] = float_to_bf16((*tails[j])[static_cast<size_t>(c)]);
        }
      }
      DS_CUDA_RETURN(cudaMemcpyAsync(dst_tail, staging.data(), static_cast<size_t>(3 * tail) * 2,
                                     cudaMemcpyHostToDevice, stream_));
    }
  }
  const int64_t n = state.num_tokens();
  if (n == 0 || s.mla_layers == 0) return Status::ok();
  const int64_t page_tokens = pool_.page_size, stride = pool_.row_stride, width = pool_.width;
  if (static_cast<int64_t>(pages.size()) * page_tokens < n) return internal_error("upload: too few pages");
  for (int64_t l = 0; l < s.mla_layers; ++l) {
    const MlaLayerCache& cache = state.mla[static_cast<size_t>(l)];
    if (cache.num_tokens() != n || cache.width() != width) {
      return invalid_argument("MLA layer cache " + std::to_string(l) + " holds " + std::to_string(cache.num_tokens()) +
                              " rows of width " + std::to_string(cache.width()) + ", expected " + std::to_string(n) +
                              " of width " + std::to_string(width));
    }
    staging.assign(static_cast<size_t>(n * stride), 0);
    const float* rows = cache.rows();
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t j = 0; j < width; ++j)
        staging[static_cast<size_t>(t * stride + j)] = float_to_bf16(rows[t * width + j]);
    }
    for (int64_t begin = 0; begin < n; begin += page_tokens) {
      const int64_t count = std::min(page_tokens, n - begin);
      DS_CUDA_RETURN(cudaMemcpyAsync(mla_row(pool_, pages, l, begin), &staging[static_cast<size_t>(begin * stride)],
                                     static_cast<size_t>(count * stride) * 2, cudaMemcpyHostToDevice, stream_));
    }
  }
  return Status::ok();
}

Status DevicePools::download(RequestState& state, int32_t slot, const std::vector<int32_t>& pages) {
  return download_part(state, slot, pages, true, 0, state.num_tokens());
}

Status DevicePools::download_part(RequestState& state, int32_t slot, const std::vector<int32_t>& pages, bool kda,
                                  int64_t mla_begin, int64_t mla_end) {
  const StateShape& s = shape_;
  const int64_t tail = s.channels() * (s.conv_kernel - 1);
  if (state.kda.size() != static_cast<size_t>(s.kda_layers) || state.mla.size() != static_cast<size_t>(s.mla_layers)) {
    return invalid_argument("request state was made for another model");
  }
  mla_end = std::min(mla_end, state.num_tokens());
  mla_begin = std::clamp<int64_t>(mla_begin, 0, std::max<int64_t>(mla_end, 0));
  DS_CUDA_RETURN(cudaSetDevice(device_));
  std::vector<std::vector<uint16_t>> tail_staging(static_cast<size_t>(kda ? s.kda_layers : 0));
  for (int64_t i = 0; kda && i < s.kda_layers; ++i) {
    KdaLayerState& layer = state.kda[static_cast<size_t>(i)];
    layer.recurrent.resize(static_cast<size_t>(s.state_floats()));
    DS_CUDA_RETURN(cudaMemcpyAsync(layer.recurrent.data(), state_pool(i) + slot * s.state_floats(),
                                   static_cast<size_t>(s.state_floats()) * 4, cudaMemcpyDeviceToHost, stream_));
    std::vector<float>* tails[3] = {&layer.conv_q, &layer.conv_k, &layer.conv_v};
    for (int j = 0; j < 3; ++j) tails[j]->resize(static_cast<size_t>(tail));
    if (tail == 0) continue;
    auto& staged = tail_staging[static_cast<size_t>(i)];
    staged.resize(static_cast<size_t>(3 * tail));
    DS_CUDA_RETURN(cudaMemcpyAsync(staged.data(), conv_pool(i) + slot * s.tail_floats(),
                                   static_cast<size_t>(3 * tail) * 2, cudaMemcpyDeviceToHost, stream_));
  }
  // MLA rows of tokens [mla_begin, mla_end) (the host keeps the rows before mla_begin; they never change).
  const int64_t first = mla_begin, n = std::max<int64_t>(mla_end - mla_begin, 0);
  const int64_t page_tokens = pool_.page_size, stride = pool_.row_stride, width = pool_.width;
  if (s.mla_layers > 0 && static_cast<int64_t>(pages.size()) * page_tokens < first + n) {
    return internal_error("download: the request holds " + std::to_string(pages.size()) + " pages for " +
                          std::to_string(first + n) + " tokens");
  }
  std::vector<std::vector<uint16_t>> staging(static_cast<size_t>(s.mla_layers));
  for (int64_t l = 0; l < s.mla_layers && n > 0; ++l) {
    auto& rows = staging[static_cast<size_t>(l)];
    rows.resize(static_cast<size_t>(n * stride));
    for (int64_t t = first; t < first + n;) {  // page by page
      const int64_t count = std::min(page_tokens - t % page_tokens, first + n - t);
      DS_CUDA_RETURN(cudaMemcpyAsync(&rows[static_cast<size_t>((t - first) * stride)], mla_row(pool_, pages, l, t),
                                     static_cast<size_t>(count * stride) * 2, cudaMemcpyDeviceToHost, stream_));
      t += count;
    }
  }
  DS_CUDA_RETURN(cudaStreamSynchronize(stream_));
  for (int64_t i = 0; kda && tail > 0 && i < s.kda_layers; ++i) {  // bf16 tails back to the host's fp32
    KdaLayerState& layer = state.kda[static_cast<size_t>(i)];
    std::vector<float>* tails[3] = {&layer.conv_q, &layer.conv_k, &layer.conv_v};
    const auto& staged = tail_staging[static_cast<size_t>(i)];
    for (int j = 0; j < 3; ++j) {
      for (int64_t c = 0; c < tail; ++c) {
        (*tails[j])[static_cast<size_t>(c)] = bf16_to_float(staged[static_cast<size_t>(j * tail + c)]);
      }
    }
  }
  for (int64_t l = 0; l < s.mla_layers && n > 0; ++l) {
    MlaLayerCache& cache = state.mla[static_cast<size_t>(l)];
    std::vector<float>& out = cache.mutable_data();
    if (static_cast<int64_t>(out.size()) < (first + n) * width) out.resize(static_cast<size_t>((first + n) * width));
    const auto& rows = staging[static_cast<size_t>(l)];
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t j = 0; j < width; ++j)
        out[static_cast<size_t>((first + t) * width + j)] = bf16_to_float(rows[static_cast<size_t>(t * stride + j)]);
    }
  }
  return Status::ok();
}

CudaResidency::~CudaResidency() {
  std::lock_guard<std::recursive_mutex> lock(pools_->mutex());
  pools_->give_slot(slot_);
  for (int32_t page : pages_) pools_->give_page(page);
}

Status CudaResidency::download(RequestState& state) const {
  std::lock_guard<std::recursive_mutex> lock(pools_->mutex());
  return pools_->download(state, slot_, pages_);
}

Status CudaResidency::download_part(RequestState& state, bool kda, int64_t mla_begin, int64_t mla_end) const {
  std::lock_guard<std::recursive_mutex> lock(pools_->mutex());
  return pools_->download_part(state, slot_, pages_, kda, mla_begin, mla_end);
}

}  // namespace deltaserve::engine::cuda
