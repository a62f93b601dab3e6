// DeviceMemory (kvstore/transfer/device_memory.hpp) for NVIDIA GPUs: the kSum64 kernel on a stream of its own,
// copies with the CUDA runtime. One object serves one engine (any thread; calls are serialised).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "common/status.hpp"
#include "kvstore/transfer/device_memory.hpp"

namespace deltaserve::kvstore::transfer::cuda {

struct CudaDeviceMemoryOptions {
  int device = 0;           // CUDA device ordinal of the engine's memory
  int max_checksums = 256;  // checksums in flight at once (pieces being sent or verified)
};

class CudaDeviceMemory final : public DeviceMemory {
 public:
  // kUnavailable when there is no such CUDA device (no GPU, no driver).
  static Result<std::shared_ptr<CudaDeviceMemory>> create(CudaDeviceMemoryOptions options = {});
  ~CudaDeviceMemory() override;

  bool is_device(const void* address) const override;
  Result<Ticket> begin_checksum(std::span<const std::span<const std::byte>> spans) override;
  std::optional<Result<uint64_t>> poll_checksum(Ticket ticket) override;
  void cancel_checksum(Ticket ticket) override;
  Status copy(void* destination, const void* source, uint64_t bytes) override;

 private:
  struct Slot {
    bool used = false;
    uint32_t generation = 0;
    uint64_t total_bytes = 0;
    void* done = nullptr;  // cudaEvent_t recorded after the result's copy to host
  };
  explicit CudaDeviceMemory(CudaDeviceMemoryOptions options) : options_(options) {}
  Status init();
  Slot* slot_of(Ticket ticket);

  CudaDeviceMemoryOptions options_;
  int multiprocessors_ = 0;  // of options_.device, for the checksum kernel's grid
  mutable std::mutex mu_;
  void* stream_ = nullptr;                     // cudaStream_t, non-blocking
  unsigned long long* device_sums_ = nullptr;  // one per slot
  unsigned long long* host_sums_ = nullptr;    // pinned, one per slot
  std::vector<Slot> slots_;
};

}  // namespace deltaserve::kvstore::transfer::cuda
