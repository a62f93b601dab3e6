// SHA-256 (FIPS 180-4) and a constant-time comparison, for hashing API keys without OpenSSL.
// Not for bulk data: one-shot over an in-memory string.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

namespace deltaserve::router {

using Sha256Digest = std::array<uint8_t, 32>;

// Incremental SHA-256: update() any number of times, then finish() once.
class Sha256 {
 public:
  Sha256();
  void update(std::string_view bytes);
  Sha256Digest finish();

 private:
  void compress(const uint8_t* block);  // one 64-byte block

  std::array<uint32_t, 8> state_;
  std::array<uint8_t, 64> block_{};
  size_t block_used_ = 0;
  uint64_t total_bytes_ = 0;
};

Sha256Digest sha256(std::string_view bytes);

// Lower-case hex of the digest (64 characters).
std::string sha256_hex(std::string_view bytes);
std::string to_hex(const Sha256Digest& digest);

// Equality whose running time depends only on the lengths, never on where the inputs differ.
bool constant_time_equal(std::string_view a, std::string_view b);

}  // namespace deltaserve::router
