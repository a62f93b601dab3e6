// Seam for GPU memory (not implemented yet). The Debian UCX 1.13 has no CUDA transport
// (TransferEngine::memory_info().cuda == false), so device pages and states travel through pinned host
// memory that the engine has registered:
//
//   sender (prefill)    for each layer, when its bytes are final on the GPU:
//                         stage->to_host(slice of a registered host region, device pointer)
//                         engine.send_piece(id, layer, {slice})
//   receiver (decode)   after the transfer's on_done(OK):
//                         stage->to_device(device pointer, slice of the destination region)
//
// A CUDA implementation (engine/ or kernels/ side, cudaMemcpyAsync on a copy stream into
// cudaHostRegister'ed memory, one event per layer) plugs in here without touching the transfer layer.
// With a UCX built --with-cuda (memory_info().cuda == true), register_region on device memory and
// puts straight from/to the GPU replace the staging copies; the descriptor and the protocol stay the same.
#pragma once

#include <cstddef>
#include <span>

#include "common/status.hpp"

namespace deltaserve::kvstore::transfer {

class DeviceStaging {
 public:
  virtual ~DeviceStaging() = default;
  // Copies `host.size()` bytes from `device` into `host` (pinned, registered); returns once they are there.
  virtual Status to_host(std::span<std::byte> host, const void* device) = 0;
  // Copies `host` to `device`; returns once the device holds them (or the copy is ordered before any
  // kernel that reads them).
  virtual Status to_device(void* device, std::span<const std::byte> host) = 0;
};

}  // namespace deltaserve::kvstore::transfer
