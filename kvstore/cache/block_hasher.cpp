#include "kvstore/cache/block_hasher.hpp"

#include <cassert>
#include <cstring>
#include <utility>

namespace deltaserve::kvstore {
namespace {

constexpr std::string_view kDomain = "deltaserve-prefix-v1";

void append_u32(std::vector<std::byte>& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<std::byte>(v >> (8 * i)));
}

void append_string(std::vector<std::byte>& out, std::string_view s) {
  append_u32(out, static_cast<uint32_t>(s.size()));
  for (char c : s) out.push_back(static_cast<std::byte>(c));
}

BlockHash wrap(const std::array<uint8_t, 16>& bytes) {
  BlockHash h;
  h.bytes = bytes;
  return h;
}

}  // namespace

std::string BlockHash::hex() const {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  out.reserve(32);
  for (uint8_t b : bytes) {
    out += kDigits[b >> 4];
    out += kDigits[b & 15];
  }
  return out;
}

BlockHasher::BlockHasher(const SipKey& secret, int64_t block_tokens) : secret_(secret), block_tokens_(block_tokens) {
  assert(block_tokens_ > 0);
}

BlockHash BlockHasher::root(std::string_view cache_namespace, std::string_view model_id) const {
  std::vector<std::byte> message;
  for (char c : kDomain) message.push_back(static_cast<std::byte>(c));
  append_string(message, cache_namespace);
  append_string(message, model_id);
  append_u32(message, static_cast<uint32_t>(block_tokens_));
  return wrap(siphash128(secret_, message));
}

BlockHash BlockHasher::next(const BlockHash& previous, std::span<const int32_t> block) const {
  assert(static_cast<int64_t>(block.size()) == block_tokens_);
  std::vector<std::byte> message(16 + 4 * block.size());
  std::memcpy(message.data(), previous.bytes.data(), 16);
  std::byte* out = message.data() + 16;
  for (int32_t token : block) {
    const auto v = static_cast<uint32_t>(token);
    for (int i = 0; i < 4; ++i) *out++ = static_cast<std::byte>(v >> (8 * i));
  }
  return wrap(siphash128(secret_, message));
}

std::vector<BlockHash> BlockHasher::hash_prompt(const BlockHash& root, std::span<const int32_t> tokens) const {
  const size_t blocks = tokens.size() / static_cast<size_t>(block_tokens_);
  std::vector<BlockHash> out;
  out.reserve(blocks);
  BlockHash previous = root;
  for (size_t b = 0; b < blocks; ++b) {
    previous =
        next(previous, tokens.subspan(b * static_cast<size_t>(block_tokens_), static_cast<size_t>(block_tokens_)));
    out.push_back(previous);
  }
  return out;
}

std::vector<BlockHash> BlockHasher::hash_prompt(const BlockHash& root, std::span<const int32_t> tokens,
                                                PromptHashes sent) const {
  const size_t blocks = tokens.size() / static_cast<size_t>(block_tokens_);
  if (sent.root == root && sent.blocks.size() == blocks) return std::move(sent.blocks);
  return hash_prompt(root, tokens);
}

Result<SipKey> parse_secret_hex(std::string_view hex) {
  if (hex.size() != 32) {
    return invalid_argument("prefix-cache secret: expected 32 hex digits, got " + std::to_string(hex.size()) +
                            " characters");
  }
  SipKey key{};
  for (size_t i = 0; i < 32; ++i) {
    const char c = hex[i];
    int v = -1;
    if (c >= '0' && c <= '9') v = c - '0';
    if (c >= 'a' && c <= 'f') v = c - 'a' + 10;
    if (c >= 'A' && c <= 'F') v = c - 'A' + 10;
    if (v < 0) return invalid_argument("prefix-cache secret: character " + std::to_string(i) + " is not a hex digit");
    key[i / 2] = static_cast<uint8_t>((key[i / 2] << 4) | v);
  }
  return key;
}

}  // namespace deltaserve::kvstore
