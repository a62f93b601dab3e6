// The content the prefix-index crash test writes (prefix_index_stress.cpp) and verifies
// (prefix_index_crash_test.cpp): derived from a seed, so the verifier can recompute every hash the
// writer could have produced and say which tenant, chain and depth it belongs to.
//
// Two tenants hold the same token contents: their chains differ only in the namespace the hash chain is
// rooted in, so a cross-tenant hit would show up as a lookup of one tenant's hashes under the other's
// namespace returning something.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "kvstore/cache/block_hasher.hpp"

namespace deltaserve::kvstore::stress {

inline constexpr int kWorkers = 4;
inline constexpr std::array<std::string_view, 2> kNamespaces = {"tenant-a", "tenant-b"};
inline constexpr int kChainsPerTenant = 6;
inline constexpr int kMaxDepth = 10;  // blocks per chain
inline constexpr int64_t kBlockTokens = 16;
inline constexpr std::string_view kModel = "stress-model";

inline std::string worker_name(int worker) {
  return "worker-" + std::to_string(worker);
}

inline uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

struct Chain {
  int tenant = 0;
  int chain = 0;
  std::vector<BlockHash> hashes;  // kMaxDepth hashes; hashes[i] ends block i + 1
};

// Chains [tenant * kChainsPerTenant + chain]; tenant 1's chain c has the same tokens as tenant 0's chain c.
inline std::vector<Chain> make_chains(uint64_t content_seed) {
  SipKey secret{};
  for (size_t i = 0; i < secret.size(); ++i) secret[i] = static_cast<uint8_t>(mix(content_seed + i));
  const BlockHasher hasher(secret, kBlockTokens);
  std::vector<Chain> chains;
  for (int tenant = 0; tenant < static_cast<int>(kNamespaces.size()); ++tenant) {
    for (int c = 0; c < kChainsPerTenant; ++c) {
      std::vector<int32_t> tokens(static_cast<size_t>(kMaxDepth * kBlockTokens));
      for (size_t t = 0; t < tokens.size(); ++t) {
        tokens[t] = static_cast<int32_t>(mix(content_seed ^ (uint64_t(c) << 40) ^ t) % 160000);
      }
      chains.push_back({tenant, c, hasher.hash_prompt(hasher.root(kNamespaces[tenant], kModel), tokens)});
    }
  }
  return chains;
}

}  // namespace deltaserve::kvstore::stress
