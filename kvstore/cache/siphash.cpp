#include "kvstore/cache/siphash.hpp"

#include <cstring>

namespace deltaserve::kvstore {
namespace {

inline uint64_t rotl(uint64_t x, int b) {
  return (x << b) | (x >> (64 - b));
}

inline uint64_t load_le64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

struct State {
  uint64_t v0, v1, v2, v3;
  void round() {
    v0 += v1;
    v1 = rotl(v1, 13);
    v1 ^= v0;
    v0 = rotl(v0, 32);
    v2 += v3;
    v3 = rotl(v3, 16);
    v3 ^= v2;
    v0 += v3;
    v3 = rotl(v3, 21);
    v3 ^= v0;
    v2 += v1;
    v1 = rotl(v1, 17);
    v1 ^= v2;
    v2 = rotl(v2, 32);
  }
  void absorb(uint64_t m) {
    v3 ^= m;
    round();
    round();  // c = 2
    v0 ^= m;
  }
};

}  // namespace

std::array<uint8_t, 16> siphash128(const SipKey& key, std::span<const std::byte> message) {
  const uint64_t k0 = load_le64(key.data()), k1 = load_le64(key.data() + 8);
  State s{k0 ^ 0x736f6d6570736575ull, k1 ^ 0x646f72616e646f6dull, k0 ^ 0x6c7967656e657261ull,
          k1 ^ 0x7465646279746573ull};
  s.v1 ^= 0xee;  // 128-bit output variant

  const auto* in = reinterpret_cast<const uint8_t*>(message.data());
  const size_t length = message.size();
  const size_t full = length & ~size_t{7};
  for (size_t i = 0; i < full; i += 8) s.absorb(load_le64(in + i));
  uint64_t last = static_cast<uint64_t>(length & 0xff) << 56;
  for (size_t i = 0; i < (length & 7); ++i) last |= static_cast<uint64_t>(in[full + i]) << (8 * i);
  s.absorb(last);

  std::array<uint8_t, 16> out{};
  s.v2 ^= 0xee;
  for (int i = 0; i < 4; ++i) s.round();  // d = 4
  uint64_t half = s.v0 ^ s.v1 ^ s.v2 ^ s.v3;
  for (int i = 0; i < 8; ++i) out[static_cast<size_t>(i)] = static_cast<uint8_t>(half >> (8 * i));
  s.v1 ^= 0xdd;
  for (int i = 0; i < 4; ++i) s.round();
  half = s.v0 ^ s.v1 ^ s.v2 ^ s.v3;
  for (int i = 0; i < 8; ++i) out[static_cast<size_t>(8 + i)] = static_cast<uint8_t>(half >> (8 * i));
  return out;
}

}  // namespace deltaserve::kvstore
