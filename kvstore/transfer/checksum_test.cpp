#include "kvstore/transfer/checksum.hpp"

#include <random>
#include <set>
#include <vector>

#include <gtest/gtest.h>

#include "kvstore/transfer/sum64.hpp"

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

// Straight from sum64.hpp's definition: zero-pad to whole words, add one term per word, fold in the length.
uint64_t sum64_by_definition(std::span<const std::byte> bytes) {
  std::vector<std::byte> padded(bytes.begin(), bytes.end());
  padded.resize((bytes.size() + 7) / 8 * 8, std::byte{0});
  uint64_t sum = 0;
  for (size_t i = 0; i < padded.size() / 8; ++i) {
    uint64_t word = 0;
    for (int b = 7; b >= 0; --b) word = (word << 8) | static_cast<uint8_t>(padded[8 * i + b]);
    sum += sum64_terms::term(word, i);
  }
  return sum64_terms::finish(sum, bytes.size());
}

TEST(Sum64, EqualsTheDefinitionForEveryLengthAndSplit) {
  const auto bytes = random_bytes(203, 11);
  for (size_t n = 0; n <= bytes.size(); ++n) {
    const auto prefix = std::span(bytes).subspan(0, n);
    ASSERT_EQ(sum64(prefix), sum64_by_definition(prefix)) << n;
  }
  const uint64_t whole = sum64(bytes);
  for (size_t a : {0, 1, 5, 8, 9, 31, 32, 33, 100, 203}) {
    for (size_t b : {a, a + 3, a + 64}) {
      if (b > bytes.size()) continue;
      Sum64 s;
      s.update(std::span(bytes).subspan(0, a));
      s.update(std::span(bytes).subspan(a, b - a));
      s.update(std::span(bytes).subspan(b));
      EXPECT_EQ(s.finish(), whole) << a << " " << b;
    }
  }
}

TEST(Sum64, EverySingleByteFlipChangesTheHash) {
  const auto bytes = random_bytes(300, 12);
  const uint64_t base = sum64(bytes);
  for (size_t i = 0; i < bytes.size(); ++i) {
    for (uint8_t mask : {0x01, 0x80, 0xFF}) {
      auto changed = bytes;
      changed[i] ^= static_cast<std::byte>(mask);
      ASSERT_NE(sum64(changed), base) << "byte " << i << " mask " << int(mask);
    }
  }
}

TEST(Sum64, OrderLengthAndZeroPaddingMatter) {
  auto bytes = random_bytes(64, 13);
  const uint64_t base = sum64(bytes);
  std::swap_ranges(bytes.begin(), bytes.begin() + 8, bytes.begin() + 8);
  EXPECT_NE(sum64(bytes), base);
  std::vector<std::byte> zeros(40, std::byte{0});
  EXPECT_NE(sum64(zeros), sum64(std::span(zeros).subspan(0, 39)));
  EXPECT_NE(sum64({}), sum64(std::span(zeros).subspan(0, 1)));
  // The two kinds are different functions: a receiver must use the kind the descriptor names.
  EXPECT_NE(sum64(zeros), checksum64(zeros));
  std::set<uint64_t> seen;
  for (uint64_t seed = 0; seed < 2000; ++seed) seen.insert(sum64(random_bytes(24, seed)));
  EXPECT_EQ(seen.size(), 2000u);
}

}  // namespace
}  // namespace deltaserve::kvstore::transfer
