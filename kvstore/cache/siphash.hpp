// SipHash-2-4 with a 128-bit output (Aumasson & Bernstein): a keyed PRF, so whoever does not know the
// 16-byte key can neither predict nor forge collisions of block hashes.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>

namespace deltaserve::kvstore {

using SipKey = std::array<uint8_t, 16>;

// Output as the reference implementation writes it: 16 bytes, the two 64-bit halves little-endian.
std::array<uint8_t, 16> siphash128(const SipKey& key, std::span<const std::byte> message);

}  // namespace deltaserve::kvstore
