// Prefix-cache block hashes (product.md, "Caching rules"): the prompt is hashed in blocks of 512
// tokens; each block's hash covers the previous one, so a hash names the whole prefix up to it. The
// chain is rooted in the tenant's cache namespace and the model id, and every hash is a SipHash-128
// keyed with a per-deployment secret: clients cannot forge collisions, and one tenant's prompt never
// hashes like another tenant's (isolation of pages, checkpoints, index keys and routing affinity).
//
// Encoding (version 1), all hashed with the deployment key:
//   root  = H("deltaserve-prefix-v1" ‖ u32 len ‖ namespace ‖ u32 len ‖ model id ‖ u32 block_tokens)
//   h_i   = H(h_{i-1} (16 bytes) ‖ block_tokens × i32 little-endian token ids)
// Only full blocks are hashed; a trailing partial block has no hash (it can never be a cache hit).
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.hpp"
#include "kvstore/cache/siphash.hpp"

namespace deltaserve::kvstore {

inline constexpr int64_t kDefaultBlockTokens = 512;

struct BlockHash {
  std::array<uint8_t, 16> bytes{};
  bool operator==(const BlockHash&) const = default;
  std::string hex() const;  // 32 lowercase hex digits
};

// A prompt's block hashes as one party made them, passed on so that another need not hash the prompt again (the
// router hashes for its index lookup; the prefill worker it picks reuses the chain). `root` commits to everything
// the chain depends on besides the tokens: the deployment key, the namespace, the model id and the block size.
struct PromptHashes {
  BlockHash root;                 // BlockHasher::root() of the chain
  std::vector<BlockHash> blocks;  // the first blocks.size() full blocks' hashes, chained from root; empty: none
};

class BlockHasher {
 public:
  // `secret`: the per-deployment key (keep it out of logs and configs checked into git).
  explicit BlockHasher(const SipKey& secret, int64_t block_tokens = kDefaultBlockTokens);

  int64_t block_tokens() const { return block_tokens_; }

  BlockHash root(std::string_view cache_namespace, std::string_view model_id) const;

  // Hash of one full block (exactly block_tokens ids) following `previous`.
  BlockHash next(const BlockHash& previous, std::span<const int32_t> block) const;

  // Hashes of every full block of `tokens`, in order, chained from `root`.
  std::vector<BlockHash> hash_prompt(const BlockHash& root, std::span<const int32_t> tokens) const;

  // hash_prompt(root, tokens), or `sent.blocks` when they are that chain already: sent.root == root and one hash
  // per full block of `tokens`. The caller vouches that `sent` was made from these tokens (the same request's
  // prompt); a chain made with another key, namespace, model id or block size has another root and is recomputed.
  std::vector<BlockHash> hash_prompt(const BlockHash& root, std::span<const int32_t> tokens, PromptHashes sent) const;

 private:
  SipKey secret_;
  int64_t block_tokens_;
};

// Parses a deployment secret given as 32 hex digits; the error names what is wrong (never the value).
Result<SipKey> parse_secret_hex(std::string_view hex);

}  // namespace deltaserve::kvstore
