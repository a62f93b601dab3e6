// Piece checksums of the transfer layer. Two functions; a transfer's descriptor names the one both sides use
// (ChecksumKind), chosen by the receiver from where its bytes land:
//   kStripe64  host memory: Checksum64 below
//   kSum64     GPU memory: sum64.hpp, one independent term per word, so a GPU kernel hashes at memory speed
//              (kvstore/transfer/cuda/); Sum64 below is the same function on the CPU.
//
// Checksum64: a 64-bit hash over eight independent add-multiply-rotate
// lanes (64-byte stripes), fast enough that verifying a piece costs less than moving it (bench:
// ucx_transfer_bench reports both). Not cryptographic: it detects corruption, not forgery.
//
// Guarantee: every lane step and the final lane fold are bijections of the running value, so two
// inputs of the same length that differ inside one aligned 8-byte word (any single corrupted byte)
// always hash differently. Other differences collide with probability about 2^-64.
//
// The value depends on the bytes and their order only, not on alignment or on how the caller splits
// them: Checksum64 fed span by span equals checksum64() of the concatenation.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>

namespace deltaserve::kvstore::transfer {

class Checksum64 {
 public:
  Checksum64();
  void update(std::span<const std::byte> bytes);
  // Copies `source` to `destination` (source.size() bytes, no overlap) and updates with it, in chunks
  // that stay in L1 between the copy and the hash: one pass over memory instead of two.
  void copy_and_update(std::byte* destination, std::span<const std::byte> source);
  uint64_t finish() const;  // does not change the state; update() may continue afterwards

 private:
  void consume_stripe(const std::byte* stripe);

  static constexpr size_t kLanes = 8;
  static constexpr size_t kStripe = 8 * kLanes;
  std::array<uint64_t, kLanes> lanes_;
  std::array<std::byte, kStripe> pending_{};  // bytes of an incomplete stripe
  size_t pending_bytes_ = 0;
  uint64_t total_bytes_ = 0;
};

uint64_t checksum64(std::span<const std::byte> bytes);

enum class ChecksumKind : uint16_t { kStripe64 = 0, kSum64 = 1 };

// sum64.hpp's function on the CPU, fed in any split: Sum64 fed span by span equals sum64() of the concatenation.
class Sum64 {
 public:
  void update(std::span<const std::byte> bytes);
  uint64_t finish() const;  // does not change the state

 private:
  uint64_t sum_ = 0;
  uint64_t words_ = 0;    // complete words consumed
  uint64_t pending_ = 0;  // bytes of an incomplete word, little-endian
  size_t pending_bytes_ = 0;
  uint64_t total_bytes_ = 0;
};

uint64_t sum64(std::span<const std::byte> bytes);

}  // namespace deltaserve::kvstore::transfer
