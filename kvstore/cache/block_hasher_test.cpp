#include "kvstore/cache/block_hasher.hpp"

#include <cstring>
#include <random>
#include <set>

#include <gtest/gtest.h>

namespace deltaserve::kvstore {
namespace {

SipKey test_key(uint8_t seed) {
  SipKey key{};
  for (size_t i = 0; i < key.size(); ++i) key[i] = static_cast<uint8_t>(seed * 31 + i);
  return key;
}

std::vector<int32_t> random_tokens(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = static_cast<int32_t>(rng() % 163840);
  return t;
}

// The encoding written out by hand from the header's contract, as the independent reference.
std::vector<std::byte> bytes_of(std::initializer_list<int> values) {
  std::vector<std::byte> out;
  for (int v : values) out.push_back(static_cast<std::byte>(v));
  return out;
}

TEST(BlockHasher, MatchesTheDocumentedEncoding) {
  const SipKey key = test_key(1);
  const BlockHasher hasher(key, /*block_tokens=*/2);
  std::vector<std::byte> root_message;
  for (char c : std::string("deltaserve-prefix-v1")) root_message.push_back(static_cast<std::byte>(c));
  for (auto b : bytes_of({3, 0, 0, 0, 'a', 'c', 'm', 4, 0, 0, 0, 'k', 'i', 'm', 'i', 2, 0, 0, 0})) {
    root_message.push_back(b);
  }
  const auto root = hasher.root("acm", "kimi");
  EXPECT_EQ(root.bytes, siphash128(key, root_message));

  std::vector<std::byte> block_message(root.bytes.size());
  std::memcpy(block_message.data(), root.bytes.data(), 16);
  for (auto b : bytes_of({0x01, 0x02, 0x00, 0x00, 0xff, 0xff, 0xff, 0xff})) block_message.push_back(b);  // 513, -1
  const std::vector<int32_t> tokens = {513, -1, 7};  // one full block + a partial one
  const auto hashes = hasher.hash_prompt(root, tokens);
  ASSERT_EQ(hashes.size(), 1u);
  EXPECT_EQ(hashes[0].bytes, siphash128(key, block_message));
}

TEST(BlockHasher, SharedPrefixesShareExactlyTheirFullBlocks) {
  const BlockHasher hasher(test_key(2));
  const auto root = hasher.root("tenant", "model");
  auto a = random_tokens(512 * 5 + 100, 1);
  auto b = a;
  b[512 * 3 + 17] ^= 1;  // differ inside block 3
  const auto ha = hasher.hash_prompt(root, a), hb = hasher.hash_prompt(root, b);
  ASSERT_EQ(ha.size(), 5u);
  ASSERT_EQ(hb.size(), 5u);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(ha[i], hb[i]) << "block " << i;
  for (size_t i = 3; i < 5; ++i) EXPECT_NE(ha[i], hb[i]) << "block " << i;  // chaining: all later blocks differ

  // The partial tail never changes the full-block hashes; shorter than one block hashes nothing.
  a.resize(512 * 5);
  EXPECT_EQ(hasher.hash_prompt(root, a), ha);
  EXPECT_TRUE(hasher.hash_prompt(root, std::span<const int32_t>(a).first(511)).empty());
}

TEST(BlockHasher, NamespaceModelSecretAndBlockSizeIsolateChains) {
  const auto tokens = random_tokens(1024, 3);
  const BlockHasher hasher(test_key(3));
  const auto base = hasher.hash_prompt(hasher.root("alpha", "m"), tokens);
  std::set<std::string> seen;
  for (const auto& h : base) seen.insert(h.hex());
  auto expect_disjoint = [&](const std::vector<BlockHash>& other, const char* what) {
    for (const auto& h : other) EXPECT_EQ(seen.count(h.hex()), 0u) << what;
  };
  expect_disjoint(hasher.hash_prompt(hasher.root("beta", "m"), tokens), "other tenant");
  expect_disjoint(hasher.hash_prompt(hasher.root("alpha", "m2"), tokens), "other model");
  // Length-prefixed fields: moving a character between namespace and model id changes the root.
  EXPECT_NE(hasher.root("ab", "c"), hasher.root("a", "bc"));
  const BlockHasher other_secret(test_key(4));
  expect_disjoint(other_secret.hash_prompt(other_secret.root("alpha", "m"), tokens), "other secret");
  const BlockHasher other_size(test_key(3), 256);
  EXPECT_NE(other_size.root("alpha", "m"), hasher.root("alpha", "m"));
}

TEST(BlockHasher, NoCollisionsAcrossManyBlocks) {
  const BlockHasher hasher(test_key(5), 16);
  std::set<std::string> seen;
  const auto root = hasher.root("t", "m");
  for (uint32_t s = 0; s < 200; ++s) {
    for (const auto& h : hasher.hash_prompt(root, random_tokens(16 * 10, 100 + s))) {
      EXPECT_TRUE(seen.insert(h.hex()).second);
    }
  }
}

TEST(BlockHasher, ASentChainIsReusedOnlyWhenItsRootAndLengthMatch) {
  const BlockHasher hasher(test_key(1), 4);
  const auto tokens = random_tokens(4 * 3 + 2, 7);  // 3 full blocks
  const auto root = hasher.root("acme", "kimi");
  const auto expected = hasher.hash_prompt(root, tokens);
  ASSERT_EQ(expected.size(), 3u);

  // The same chain, made by another party with the same settings: taken as is (not hashed again).
  EXPECT_EQ(hasher.hash_prompt(root, tokens, PromptHashes{root, expected}), expected);
  PromptHashes marked{root, expected};
  marked.blocks[2].bytes[0] ^= 1;  // only to show which was returned: the caller vouches for what it sends
  EXPECT_EQ(hasher.hash_prompt(root, tokens, marked), marked.blocks);

  // Nothing sent, too few or too many hashes: computed here.
  EXPECT_EQ(hasher.hash_prompt(root, tokens, PromptHashes{}), expected);
  EXPECT_EQ(hasher.hash_prompt(root, tokens, PromptHashes{root, {expected[0], expected[1]}}), expected);
  PromptHashes longer{root, expected};
  longer.blocks.push_back(expected[0]);
  EXPECT_EQ(hasher.hash_prompt(root, tokens, longer), expected);

  // A chain rooted elsewhere (another key, namespace, model id or block size): computed here.
  const BlockHasher other_key(test_key(2), 4), other_block(test_key(1), 2);
  const std::vector<BlockHash> roots{other_key.root("acme", "kimi"), hasher.root("other", "kimi"),
                                     hasher.root("acme", "other"), other_block.root("acme", "kimi")};
  for (const BlockHash& other : roots) {
    ASSERT_NE(other, root);
    PromptHashes foreign{other, expected};
    foreign.blocks[0].bytes[0] ^= 1;
    EXPECT_EQ(hasher.hash_prompt(root, tokens, foreign), expected);
  }
}

TEST(BlockHasher, SecretParsing) {
  auto key = parse_secret_hex("000102030405060708090a0b0c0d0E0F");
  ASSERT_TRUE(key.is_ok());
  for (size_t i = 0; i < 16; ++i) EXPECT_EQ((*key)[i], i);
  EXPECT_FALSE(parse_secret_hex("0011").is_ok());
  auto bad = parse_secret_hex("zz0102030405060708090a0b0c0d0e0f");
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("character 0"), std::string::npos);
  EXPECT_EQ(bad.status().message().find("zz"), std::string::npos);  // the secret is never echoed
}

}  // namespace
}  // namespace deltaserve::kvstore
