// Request state in device memory: the KDA slot pool, the MLA page pool and the DeviceResidency that ties a
// RequestState to one slot and a list of pages.
//
// Layouts (fp32 unless said):
//   KDA recurrent states: one block [kda_layers, num_slots, H, d_k, d_v]; layer i's pool starts at
//                         state_pool(i) = base + i · num_slots · H·d·d (the kernels' [num_slots, H, d, d]).
//   KDA conv tails:       one block [kda_layers, num_slots, 3, C, K-1] bf16 (q, k, v tails, oldest first, as
//                         KdaLayerState::conv_q/k/v and the kernels' pool layout; the tails are bf16 projection
//                         outputs, so bf16 holds them exactly); absent when K = 1. The host copy stays fp32.
//   MLA pages:            kernels/cuda/mla/mla.hpp MlaPagePool, bf16, all MLA layers in each page, row_stride = width
//                         rounded up to 8 values.
// A request holds one slot (the same index in every KDA layer) and pages covering its tokens (token t in page
// pages[t / page_tokens]). Slots and pages are handed out and returned under DevicePools::mutex, which also
// serialises every forward pass and download (the backend takes it).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "common/status.hpp"
#include "engine/backend.hpp"
#include "engine/cuda/cuda_util.hpp"
#include "engine/model_config.hpp"
#include "engine/request_state.hpp"
#include "kernels/cuda/mla/mla.hpp"

namespace deltaserve::engine::cuda {

struct StateShape {
  int64_t kda_layers = 0, heads = 0, head_dim = 0, conv_kernel = 4;
  int64_t mla_layers = 0, mla_width = 0, mla_row_stride = 0;
  int64_t channels() const { return heads * head_dim; }
  int64_t state_floats() const { return heads * head_dim * head_dim; }        // one layer's S
  int64_t tail_floats() const { return 3 * channels() * (conv_kernel - 1); }  // one layer's q, k, v tail values
  // fp32 states, bf16 tails (the tails are raw bf16 projection outputs: exact).
  int64_t slot_bytes() const { return kda_layers * (state_floats() * 4 + tail_floats() * 2); }
  int64_t page_bytes(int64_t page_tokens) const { return mla_layers * page_tokens * mla_row_stride * 2; }
  static StateShape of(const ModelConfig& config);
};

class DevicePools {
 public:
  DevicePools(int device, const StateShape& shape) : device_(device), shape_(shape) {}
  ~DevicePools();
  DevicePools(const DevicePools&) = delete;
  DevicePools& operator=(const DevicePools&) = delete;

  // Creates the stream (first), then allocates `slots` slots and `pages` pages of `page_tokens` tokens.
  [[nodiscard]] Status create_stream();
  [[nodiscard]] Status allocate(int64_t slots, int64_t pages, int page_tokens);

  // Recursive: a residency released while the backend holds the lock (an error path) takes it again.
  std::recursive_mutex& mutex() { return mutex_; }
  int device() const { return device_; }
  cudaStream_t stream() const { return stream_; }
  const StateShape& shape() const { return shape_; }
  int64_t num_slots() const { return num_slots_; }
  int page_tokens() const { return pool_.page_size; }
  const kernels::cuda::MlaPagePool& page_pool() const { return pool_; }
  float* state_pool(int64_t kda_layer) const {
    return states_.as<float>() + kda_layer * num_slots_ * shape_.state_floats();
  }
  __nv_bfloat16* conv_pool(int64_t kda_layer) const {
    return shape_.conv_kernel > 1 ? tails_.as<__nv_bfloat16>() + kda_layer * num_slots_ * shape_.tail_floats()
                                  : nullptr;
  }

  // The spans of `slot` and `pages` (DeviceStateSpans' order and layout) and the allocations they lie in.
  DeviceStateSpans spans(int32_t slot, const std::vector<int32_t>& pages) const;
  std::vector<DeviceSpan> memory_regions() const;

  // Free lists (caller holds the mutex). take_* return -1 when none is free.
  int32_t take_slot();
  int32_t take_page();
  void give_slot(int32_t slot);
  void give_page(int32_t page);
  int64_t free_slots() const { return static_cast<int64_t>(free_slots_.size()); }
  int64_t free_pages() const { return static_cast<int64_t>(free_pages_.size()); }

  // Copies `state`'s host containers into `slot` and `pages` (zeros when it holds no tokens). Caller holds the
  // mutex; asynchronous on stream() (host data staged before return).
  [[nodiscard]] Status upload(const RequestState& state, int32_t slot, const std::vector<int32_t>& pages);
  // Copies the device contents of `slot` and `pages` (state.num_tokens() MLA rows) into the host containers.
  // Caller holds the mutex; synchronous.
  [[nodiscard]] Status download(RequestState& state, int32_t slot, const std::vector<int32_t>& pages);
  // Only the KDA part (when `kda`) and the MLA rows of tokens [mla_begin, mla_end) (rows before stay as the host has
  // them; the host containers grow to mla_end rows when shorter).
  [[nodiscard]] Status download_part(RequestState& state, int32_t slot, const std::vector<int32_t>& pages, bool kda,
                                     int64_t mla_begin, int64_t mla_end);

 private:
  std::recursive_mutex mutex_;
  int device_;
  StateShape shape_;
  cudaStream_t stream_ = nullptr;
  int64_t num_slots_ = 0;
  DeviceMemory states_, tails_, pages_;
  kernels::cuda::MlaPagePool pool_;
  std::vector<int32_t> free_slots_, free_pages_;
};

// A request's caches on the device: its slot and pages. Destroying it returns both to the pools (which it keeps
// alive). The backend extends `pages` as the request grows.
class CudaResidency final : public DeviceResidency {
 public:
  CudaResidency(std::shared_ptr<DevicePools> pools, int32_t slot) : pools_(std::move(pools)), slot_(slot) {}
  ~CudaResidency() override;
  [[nodiscard]] Status download(RequestState& state) const override;
  [[nodiscard]] Status download_part(RequestState& state, bool kda, int64_t mla_begin, int64_t mla_end) const override;

  const DevicePools* pools() const { return pools_.get(); }
  int32_t slot() const { return slot_; }
  std::vector<int32_t>& pages() { return pages_; }
  const std::vector<int32_t>& pages() const { return pages_; }

 private:
  std::shared_ptr<DevicePools> pools_;
  int32_t slot_;
  std::vector<int32_t> pages_;
};

}  // namespace deltaserve::engine::cuda
