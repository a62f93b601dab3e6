// The transfer engine's access to GPU memory (EngineConfig::device), so that kvstore/transfer itself needs
// neither CUDA nor a GPU. The CUDA implementation is kvstore/transfer/cuda/cuda_device_memory.hpp; a CPU
// build passes none, and then every region is host memory.
//
// What the engine does with it:
//   - pieces that land in GPU memory are checksummed with ChecksumKind::kSum64 (sum64.hpp) on the GPU, the
//     sender over its sources and the receiver over the bytes in its own memory, without blocking: begin a
//     checksum, keep progressing UCX, poll it;
//   - bytes that must pass through host memory (PieceCarrier::kMessage, or a GPU source for a host
//     destination) are copied with copy().
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>

#include "common/status.hpp"

namespace deltaserve::kvstore::transfer {

class DeviceMemory {
 public:
  using Ticket = uint64_t;

  virtual ~DeviceMemory() = default;

  // True when `address` is GPU memory (device or managed allocations); false for host memory, pinned
  // or not.
  virtual bool is_device(const void* address) const = 0;

  // Starts the kSum64 checksum of the concatenation of `spans` (each in GPU memory, 8-byte aligned; every
  // span but the last a multiple of 8 bytes, so that no word straddles two spans). The bytes must be final
  // when this is called and stay unchanged until the result is taken. Returns a ticket for poll_checksum;
  // kInvalidArgument for spans that break the rules, kResourceExhausted when too many are in flight.
  virtual Result<Ticket> begin_checksum(std::span<const std::span<const std::byte>> spans) = 0;
  // nullopt while the checksum runs; then its value (or the GPU's error) once, which frees the ticket.
  virtual std::optional<Result<uint64_t>> poll_checksum(Ticket ticket) = 0;
  // Frees a ticket whose result is no longer wanted (its transfer failed); the work may still finish.
  virtual void cancel_checksum(Ticket ticket) = 0;

  // Copies `bytes` bytes between any two of host and GPU memory; returns once the destination holds them.
  virtual Status copy(void* destination, const void* source, uint64_t bytes) = 0;
};

}  // namespace deltaserve::kvstore::transfer
