#include "kvstore/transfer/checksum.hpp"

#include <random>
#include <set>
#include <vector>

#include <gtest/gtest.h>

namespace deltaserve::kvstore::transfer {
namespace {

std::vector<std::byte> random_bytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::byte> out(n);
  for (auto& b : out) b = static_cast<std::byte>(rng());
  return out;
}

TEST(Checksum64, SplitAnywhereEqualsWhole) {
  const auto bytes = random_bytes(1000, 1);
  const uint64_t whole = checksum64(bytes);
  for (size_t a : {0, 1, 7, 31, 32, 33, 500, 999, 1000}) {
    for (size_t b : {a, a + 1, a + 40}) {
      if (b > bytes.size()) continue;
      Checksum64 c;
      c.update(std::span(bytes).subspan(0, a));
      c.update(std::span(bytes).subspan(a, b - a));
      c.update(std::span(bytes).subspan(b));
      EXPECT_EQ(c.finish(), whole) << a << " " << b;
    }
  }
}

TEST(Checksum64, EverySingleByteFlipChangesTheHash) {
  // The documented guarantee: a difference inside one 8-byte word is always detected.
  const auto bytes = random_bytes(300, 2);
  const uint64_t base = checksum64(bytes);
  for (size_t i = 0; i < bytes.size(); ++i) {
    for (uint8_t mask : {0x01, 0x80, 0xFF}) {
      auto changed = bytes;
      changed[i] ^= static_cast<std::byte>(mask);
      ASSERT_NE(checksum64(changed), base) << "byte " << i << " mask " << int(mask);
    }
  }
}

TEST(Checksum64, LengthAndZeroPaddingMatter) {
  std::vector<std::byte> a(40, std::byte{0});
  std::vector<std::byte> b(41, std::byte{0});
  EXPECT_NE(checksum64(a), checksum64(b));
  EXPECT_NE(checksum64({}), checksum64(std::span(a).subspan(0, 1)));
}

TEST(Checksum64, SwappedWordsAndDistinctInputsDiffer) {
  auto bytes = random_bytes(64, 3);
  const uint64_t base = checksum64(bytes);
  std::swap_ranges(bytes.begin(), bytes.begin() + 8, bytes.begin() + 8);
  EXPECT_NE(checksum64(bytes), base);
  std::set<uint64_t> seen;
  for (uint64_t seed = 0; seed < 2000; ++seed) seen.insert(checksum64(random_bytes(24, seed)));
  EXPECT_EQ(seen.size(), 2000u);
}

}  // namespace
}  // namespace deltaserve::kvstore::transfer
