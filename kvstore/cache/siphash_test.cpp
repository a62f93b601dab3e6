#include "kvstore/cache/siphash.hpp"

#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace deltaserve::kvstore {
namespace {

std::string hex(const std::array<uint8_t, 16>& bytes) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (uint8_t b : bytes) {
    out += digits[b >> 4];
    out += digits[b & 15];
  }
  return out;
}

// The reference implementation's published vectors (vectors_sip128): key 00..0f, message 00..(n-1).
TEST(SipHash128, ReferenceVectors) {
  const std::vector<std::string> expected = {"a3817f04ba25a8e66df67214c7550293", "da87c1d86b99af44347659119b22fc45",
                                             "8177228da4a45dc7fca38bdef60affe4", "9c70b60c5267a94e5f33b6b02985ed51",
                                             "f88164c12d9c8faf7d0f6e7c7bcd5579", "1368875980776f8854527a07690e9627",
                                             "14eeca338b208613485ea0308fd7a15e", "a1f1ebbed8dbc153c0b84aa61ff08239",
                                             "3b62a9ba6258f5610f83e264f31497b4", "264499060ad9baabc47f8b02bb6d71ed"};
  SipKey key{};
  for (size_t i = 0; i < key.size(); ++i) key[i] = static_cast<uint8_t>(i);
  std::vector<std::byte> message;
  for (size_t n = 0; n < expected.size(); ++n) {
    EXPECT_EQ(hex(siphash128(key, message)), expected[n]) << "length " << n;
    message.push_back(static_cast<std::byte>(n));
  }
}

TEST(SipHash128, KeyAndEveryBitMatter) {
  SipKey key{};
  std::vector<std::byte> message(1024, std::byte{0x5a});
  const auto base = siphash128(key, message);
  key[15] ^= 1;
  EXPECT_NE(siphash128(key, message), base);
  key[15] ^= 1;
  for (size_t bit : {0ul, 7ul, 4095ul, 8191ul}) {
    message[bit / 8] ^= static_cast<std::byte>(1u << (bit % 8));
    EXPECT_NE(siphash128(key, message), base) << "bit " << bit;
    message[bit / 8] ^= static_cast<std::byte>(1u << (bit % 8));
  }
  EXPECT_EQ(siphash128(key, message), base);
}

}  // namespace
}  // namespace deltaserve::kvstore
