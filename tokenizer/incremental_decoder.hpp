// Streaming detokenization for SSE: turns a token stream into text chunks that are always valid UTF-8
// and never split a character.
//
// Contract: every chunk returned by push()/flush() is valid UTF-8. Bytes of an incomplete trailing
// character are held back until they complete; bytes proven ill-formed (and, at flush(), a truncated
// tail) become U+FFFD per maximal subpart. Hence, for any id sequence,
//   concat(push(id_1), ..., push(id_n), flush()) == sanitize_utf8(tokenizer.decode(ids)),
// which is decode(ids) itself whenever that is valid UTF-8. At most 3 bytes are ever held back.
// Out-of-range ids are skipped, as Tokenizer::decode does.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "tokenizer/tiktoken_tokenizer.hpp"

namespace deltaserve::tokenizer {

class IncrementalDecoder {
 public:
  // `tokenizer` must outlive the decoder. Not thread-safe: one decoder per stream.
  explicit IncrementalDecoder(const Tokenizer& tokenizer) : tokenizer_(&tokenizer) {}

  // Text that became final with this token (possibly empty).
  std::string push(int32_t id);
  std::string push(std::span<const int32_t> ids);

  // Everything still held back (a truncated character becomes U+FFFD); the decoder is then empty and
  // may be reused for a new stream.
  std::string flush();

  // Bytes held back awaiting the rest of a character (0..3).
  size_t pending_bytes() const { return pending_.size(); }

 private:
  std::string drain(bool final);

  const Tokenizer* tokenizer_;
  std::string pending_;  // undecided bytes: always empty or a valid-so-far prefix of one character
};

}  // namespace deltaserve::tokenizer
