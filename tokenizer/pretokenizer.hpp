// Regex pre-split of text into pieces before byte-level BPE (the tiktoken `pat_str` step), with the
// Kimi pattern compiled by Oniguruma (it needs class intersection `&&`, which RE2/PCRE lack).
//
// Contract of split(): the pieces exactly tile the input (their concatenation is the input), for ANY
// byte string. Oniguruma only ever sees valid UTF-8: the input is cut into maximal valid runs, each
// run is regex-split, and every byte of an ill-formed sequence becomes a piece of its own.
// Thread safety: a PreTokenizer is immutable after create(); split() may run concurrently (Oniguruma
// 6.x keeps all match state in the per-call OnigRegion / stack). Copies share the compiled regex.
#pragma once

#include <memory>
#include <string_view>
#include <vector>

#include "common/status.hpp"

struct re_pattern_buffer;  // Oniguruma's regex_t

namespace deltaserve::tokenizer {

// The Kimi (K2 / Kimi Linear) pre-tokenizer pattern, as in tokenization_kimi.py, joined with "|".
inline constexpr std::string_view kKimiPattern =
    R"([\p{Han}]+)"
    "|"
    R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?)"
    "|"
    R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?)"
    "|"
    R"(\p{N}{1,3})"
    "|"
    R"( ?[^\s\p{L}\p{N}]+[\r\n]*)"
    "|"
    R"(\s*[\r\n]+)"
    "|"
    R"(\s+(?!\S))"
    "|"
    R"(\s+)";

// The chunking tokenization_kimi.py applies before tiktoken (inherited from Llama 3's tokenizer.py):
// the text is cut every kMaxEncodeChars characters, and each part wherever a run of consecutive
// whitespace or non-whitespace characters (Python str.isspace) would exceed kMaxConsecutiveRunChars.
// Chunks are then encoded independently (special tokens and regex pieces never span two chunks).
// Characters are code points; each byte of an ill-formed sequence counts as one non-space character.
// Appends non-empty views that tile `text` in order.
inline constexpr size_t kMaxEncodeChars = 400'000;
inline constexpr size_t kMaxConsecutiveRunChars = 25'000;
void split_encode_chunks(std::string_view text, std::vector<std::string_view>& chunks);

class PreTokenizer {
 public:
  // Compiles `pattern` (Oniguruma syntax, UTF-8). InvalidArgument with Oniguruma's message on failure.
  static Result<PreTokenizer> create(std::string_view pattern = kKimiPattern);

  // Appends to `pieces` views into `text` that tile it in order; empty text appends nothing.
  // Should Oniguruma report an error (e.g. its retry limit on pathological input), the rest of that
  // valid run becomes one piece: tokenization then differs from tiktoken but stays lossless.
  void split(std::string_view text, std::vector<std::string_view>& pieces) const;

  std::vector<std::string_view> split(std::string_view text) const {
    std::vector<std::string_view> pieces;
    split(text, pieces);
    return pieces;
  }

 private:
  explicit PreTokenizer(std::shared_ptr<re_pattern_buffer> regex) : regex_(std::move(regex)) {}

  // Regex-splits `run`, which must be valid UTF-8.
  void split_valid_run(std::string_view run, std::vector<std::string_view>& pieces) const;

  std::shared_ptr<re_pattern_buffer> regex_;  // never null after create()
};

}  // namespace deltaserve::tokenizer
