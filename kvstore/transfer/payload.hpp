// Deterministic payloads and hex text for the two-process tests, the test helper and the benchmark:
// both processes compute the same bytes from a seed, so the receiver can check byte equality without
// a second copy travelling.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.hpp"

namespace deltaserve::kvstore::transfer {

// Word `w` of the payload of `seed`; byte i of the payload is byte (i % 8) of word i / 8 (little-endian).
inline uint64_t payload_word(uint64_t seed, uint64_t w) {
  uint64_t x = w * 0x9E3779B97F4A7C15ull + seed * 0xD1B54A32D192ED03ull;
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  return x;
}

inline std::byte payload_byte(uint64_t seed, uint64_t index) {
  return static_cast<std::byte>(payload_word(seed, index >> 3) >> (8 * (index & 7)));
}

// out[i] = payload_byte(seed, first_index + i); word-at-a-time where aligned (little-endian hosts).
inline void fill_payload(std::span<std::byte> out, uint64_t seed, uint64_t first_index) {
  size_t i = 0;
  for (; i < out.size() && (first_index + i) % 8 != 0; ++i) out[i] = payload_byte(seed, first_index + i);
  for (; i + 8 <= out.size(); i += 8) {
    const uint64_t word = payload_word(seed, (first_index + i) >> 3);
    std::memcpy(out.data() + i, &word, 8);
  }
  for (; i < out.size(); ++i) out[i] = payload_byte(seed, first_index + i);
}

inline bool payload_matches(std::span<const std::byte> bytes, uint64_t seed, uint64_t first_index) {
  size_t i = 0;
  for (; i < bytes.size() && (first_index + i) % 8 != 0; ++i) {
    if (bytes[i] != payload_byte(seed, first_index + i)) return false;
  }
  for (; i + 8 <= bytes.size(); i += 8) {
    const uint64_t word = payload_word(seed, (first_index + i) >> 3);
    if (std::memcmp(bytes.data() + i, &word, 8) != 0) return false;
  }
  for (; i < bytes.size(); ++i) {
    if (bytes[i] != payload_byte(seed, first_index + i)) return false;
  }
  return true;
}

inline std::string to_hex(std::span<const std::byte> bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (std::byte b : bytes) {
    out.push_back(kDigits[static_cast<uint8_t>(b) >> 4]);
    out.push_back(kDigits[static_cast<uint8_t>(b) & 15]);
  }
  return out;
}

inline Result<std::vector<std::byte>> from_hex(std::string_view text) {
  auto digit = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  if (text.size() % 2 != 0) return invalid_argument("hex: odd length");
  std::vector<std::byte> out(text.size() / 2);
  for (size_t i = 0; i < out.size(); ++i) {
    const int hi = digit(text[2 * i]), lo = digit(text[2 * i + 1]);
    if (hi < 0 || lo < 0) return invalid_argument("hex: bad digit");
    out[i] = static_cast<std::byte>(hi << 4 | lo);
  }
  return out;
}

}  // namespace deltaserve::kvstore::transfer
