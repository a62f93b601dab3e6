#include "kvstore/transfer/checksum.hpp"

#include <algorithm>
#include <bit>
#include <cstring>

#include "kvstore/transfer/sum64.hpp"

namespace deltaserve::kvstore::transfer {
namespace {

// Odd multipliers (bijective mod 2^64): the golden-ratio constant and two large primes.
constexpr uint64_t kMulA = 0x9E3779B97F4A7C15ull;
constexpr uint64_t kMulB = 0xC2B2AE3D27D4EB4Full;
constexpr uint64_t kMulC = 0x165667B19E3779F9ull;

inline uint64_t load_le64(const std::byte* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof v);
  if constexpr (std::endian::native == std::endian::big) v = __builtin_bswap64(v);
  return v;
}

// For a fixed word, lane -> step(lane, word) is a bijection (add, multiply by an odd constant,
// rotate); for a fixed lane, word -> step(lane, word) is one too. One multiply per 8 bytes: with eight
// independent lanes the loop runs at the multiplier's throughput, not its latency.
inline uint64_t step(uint64_t lane, uint64_t word) {
  return std::rotl((lane + word) * kMulA, 31);
}

inline uint64_t avalanche(uint64_t h) {
  h ^= h >> 31;
  h *= kMulC;
  h ^= h >> 29;
  h *= kMulB;
  h ^= h >> 32;
  return h;
}

}  // namespace

Checksum64::Checksum64()
    : lanes_{0x243F6A8885A308D3ull, 0x13198A2E03707344ull, 0xA4093822299F31D0ull, 0x082EFA98EC4E6C89ull,
             0x452821E638D01377ull, 0xBE5466CF34E90C6Cull, 0xC0AC29B7C97C50DDull, 0x3F84D5B5B5470917ull} {}

void Checksum64::consume_stripe(const std::byte* stripe) {
  for (size_t i = 0; i < kLanes; ++i) lanes_[i] = step(lanes_[i], load_le64(stripe + 8 * i));
}

void Checksum64::update(std::span<const std::byte> bytes) {
  const std::byte* p = bytes.data();
  size_t n = bytes.size();
  total_bytes_ += n;
  if (pending_bytes_ > 0) {
    const size_t take = std::min(n, pending_.size() - pending_bytes_);
    std::memcpy(pending_.data() + pending_bytes_, p, take);
    pending_bytes_ += take;
    p += take;
    n -= take;
    if (pending_bytes_ < pending_.size()) return;
    consume_stripe(pending_.data());
    pending_bytes_ = 0;
  }
  // Hot loop: eight independent dependency chains, 64 bytes per iteration.
  uint64_t a = lanes_[0], b = lanes_[1], c = lanes_[2], d = lanes_[3];
  uint64_t e = lanes_[4], f = lanes_[5], g = lanes_[6], h = lanes_[7];
  while (n >= kStripe) {
    a = step(a, load_le64(p));
    b = step(b, load_le64(p + 8));
    c = step(c, load_le64(p + 16));
    d = step(d, load_le64(p + 24));
    e = step(e, load_le64(p + 32));
    f = step(f, load_le64(p + 40));
    g = step(g, load_le64(p + 48));
    h = step(h, load_le64(p + 56));
    p += kStripe;
    n -= kStripe;
  }
  lanes_ = {a, b, c, d, e, f, g, h};
  if (n > 0) {
    std::memcpy(pending_.data(), p, n);
    pending_bytes_ = n;
  }
}

void Checksum64::copy_and_update(std::byte* destination, std::span<const std::byte> source) {
  constexpr size_t kChunk = 16 << 10;
  for (size_t at = 0; at < source.size(); at += kChunk) {
    const size_t n = std::min(kChunk, source.size() - at);
    std::memcpy(destination + at, source.data() + at, n);
    update(source.subspan(at, n));
  }
}

uint64_t Checksum64::finish() const {
  // Tail: zero-padded last stripe (length is folded in below, so padding cannot collide with data).
  std::array<uint64_t, kLanes> lanes = lanes_;
  if (pending_bytes_ > 0) {
    std::array<std::byte, kStripe> padded{};
    std::memcpy(padded.data(), pending_.data(), pending_bytes_);
    for (size_t i = 0; i < kLanes; ++i) lanes[i] = step(lanes[i], load_le64(padded.data() + 8 * i));
  }
  // Fold: h -> (h ^ lane) * odd is a bijection in each lane for a fixed h.
  uint64_t h = total_bytes_ * kMulC;
  for (uint64_t lane : lanes) h = (h ^ lane) * kMulA;
  return avalanche(h);
}

uint64_t checksum64(std::span<const std::byte> bytes) {
  Checksum64 c;
  c.update(bytes);
  return c.finish();
}

void Sum64::update(std::span<const std::byte> bytes) {
  const std::byte* p = bytes.data();
  size_t n = bytes.size();
  total_bytes_ += n;
  while (pending_bytes_ > 0 && n > 0) {
    pending_ |= static_cast<uint64_t>(static_cast<uint8_t>(*p)) << (8 * pending_bytes_);
    ++p;
    --n;
    if (++pending_bytes_ == 8) {
      sum_ += sum64_terms::term(pending_, words_++);
      pending_ = 0;
      pending_bytes_ = 0;
    }
  }
  // Four independent partial sums: the multiplies of neighbouring words overlap.
  uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  uint64_t i = words_;
  while (n >= 32) {
    s0 += sum64_terms::term(load_le64(p), i);
    s1 += sum64_terms::term(load_le64(p + 8), i + 1);
    s2 += sum64_terms::term(load_le64(p + 16), i + 2);
    s3 += sum64_terms::term(load_le64(p + 24), i + 3);
    p += 32;
    n -= 32;
    i += 4;
  }
  while (n >= 8) {
    s0 += sum64_terms::term(load_le64(p), i++);
    p += 8;
    n -= 8;
  }
  sum_ += s0 + s1 + s2 + s3;
  words_ = i;
  for (; n > 0; --n, ++p) {
    pending_ |= static_cast<uint64_t>(static_cast<uint8_t>(*p)) << (8 * pending_bytes_);
    ++pending_bytes_;
  }
}

uint64_t Sum64::finish() const {
  const uint64_t sum = pending_bytes_ > 0 ? sum_ + sum64_terms::term(pending_, words_) : sum_;
  return sum64_terms::finish(sum, total_bytes_);
}

uint64_t sum64(std::span<const std::byte> bytes) {
  Sum64 s;
  s.update(bytes);
  return s.finish();
}

}  // namespace deltaserve::kvstore::transfer
