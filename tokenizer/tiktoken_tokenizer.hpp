// The Kimi tokenizer: tiktoken byte-level BPE over a regex pre-split, plus 256 special tokens.
//
// Files (HF Kimi layout, as shipped by Kimi K2 / Kimi Linear):
//   tiktoken.model         one "base64(token bytes) rank" per line; ranks are the base token ids and
//                          must be exactly 0..N-1; every single byte must be a token.
//   tokenizer_config.json  `added_tokens_decoder` {"163584": {"content": "[BOS]", ...}, ...} naming
//                          specials; `bos_token` / `eos_token` / `pad_token` (a string, an AddedToken
//                          object with "content", or null).
// Id layout: base tokens 0..N-1 (id == rank), specials N..N+255. A special id not named in
// added_tokens_decoder is `<|reserved_token_{id}|>`. vocab_size() == N + 256.
//
// Note for callers choosing stop tokens: HF Kimi configs name eos_token "[EOS]" in
// tokenizer_config.json while the model's config.json / generation_config.json stop on <|im_end|>;
// eos_id() reports the tokenizer's view only.
//
// Thread safety: a Tokenizer is immutable after load(); all const methods may run concurrently.
#pragma once

#include <array>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/status.hpp"
#include "tokenizer/pretokenizer.hpp"

namespace deltaserve::tokenizer {

inline constexpr int32_t kNumReservedSpecialTokens = 256;
inline constexpr std::string_view kTiktokenModelFile = "tiktoken.model";
inline constexpr std::string_view kTokenizerConfigFile = "tokenizer_config.json";

// Whether special-token strings occurring in the text are parsed as their ids (kAll, tiktoken's
// allowed_special="all") or encoded as ordinary text (kNone, disallowed_special=()). Untrusted user
// content should be encoded with kNone so it cannot forge chat-control tokens.
enum class SpecialTokens { kNone, kAll };

// What tokenizer_config.json contributes, already parsed.
struct SpecialTokenConfig {
  std::vector<std::pair<int32_t, std::string>> added_tokens;  // absolute ids in [N, N+256), non-empty text
  std::string bos_token;                                      // names; empty = the tokenizer has none
  std::string eos_token;
  std::string pad_token;
};

// Parses tiktoken.model content into the token bytes of each rank (index == rank).
// `file_label` prefixes errors, which name the 1-based line: "<file_label>:<line>: <what>".
// DataLoss on: a line without exactly two fields, bad base64, empty token, a rank that is not a
// non-negative integer, duplicate rank, duplicate token bytes, ranks not contiguous from 0, no tokens.
Result<std::vector<std::string>> parse_tiktoken_model(std::string_view content, std::string_view file_label);

class Tokenizer {
 public:
  // Reads dir/tiktoken.model and dir/tokenizer_config.json. Errors name the file (and line/key).
  static Result<Tokenizer> load(const std::filesystem::path& dir);

  // Builds from already-parsed parts. `ranked_tokens[r]` = bytes of rank r; they must be distinct,
  // non-empty and include all 256 single bytes.
  static Result<Tokenizer> build(std::vector<std::string> ranked_tokens, const SpecialTokenConfig& specials);

  // Token ids for `text` (any bytes; invalid UTF-8 is encoded byte-wise). decode(encode(s, any)) == s.
  // Matches tokenization_kimi.py's encode(), incl. its chunking of long runs (split_encode_chunks).
  std::vector<int32_t> encode(std::string_view text, SpecialTokens allow) const;

  // Concatenated bytes of `ids` (specials as their text). The result may be partial / invalid UTF-8.
  // Ids outside [0, vocab_size()) are SKIPPED; use decode_checked() to reject them instead.
  std::string decode(std::span<const int32_t> ids) const;

  // As decode(), but OutOfRange naming the position and value of the first bad id.
  Result<std::string> decode_checked(std::span<const int32_t> ids) const;

  // Bytes of one token (a special's text for special ids); nullopt when out of range.
  // The view lives as long as the Tokenizer.
  std::optional<std::string_view> token_bytes(int32_t id) const;

  // Id of the special token whose text is exactly `text` (incl. reserved names).
  std::optional<int32_t> special_token_id(std::string_view text) const;
  bool is_special(int32_t id) const { return id >= num_base_tokens_ && id < vocab_size(); }

  int32_t vocab_size() const { return num_base_tokens_ + kNumReservedSpecialTokens; }
  int32_t num_base_tokens() const { return num_base_tokens_; }
  std::optional<int32_t> bos_id() const { return bos_id_; }
  std::optional<int32_t> eos_id() const { return eos_id_; }
  std::optional<int32_t> pad_id() const { return pad_id_; }

  // Rank of exactly these bytes as a base token, if any.
  std::optional<int32_t> rank_of(std::string_view bytes) const;

  // BPE of one pre-split piece (tiktoken byte_pair_encode): repeatedly merge the adjacent pair whose
  // concatenation has the lowest rank (leftmost on ties). Appends the ids to `out`. O(n log n).
  void encode_piece(std::string_view piece, std::vector<int32_t>& out) const;

  const PreTokenizer& pretokenizer() const { return pretokenizer_; }

 private:
  struct StringHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const noexcept { return std::hash<std::string_view>{}(s); }
  };
  using RankMap = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

  explicit Tokenizer(PreTokenizer pretokenizer) : pretokenizer_(std::move(pretokenizer)) {}

  // One chunk of split_encode_chunks(): specials (when allowed), then regex pieces, then BPE.
  void encode_chunk(std::string_view text, SpecialTokens allow, std::vector<int32_t>& out) const;
  void encode_ordinary(std::string_view text, std::vector<int32_t>& out) const;

  PreTokenizer pretokenizer_;
  int32_t num_base_tokens_ = 0;
  std::vector<std::string> id_to_bytes_;  // [vocab_size()]: base token bytes, then special texts
  RankMap base_ranks_;                    // base token bytes -> id
  RankMap special_ids_;                   // special text -> id
  std::array<int32_t, 256> byte_ids_{};   // id of each single-byte token
  // Special ids bucketed by their first byte, longest text first (for leftmost-longest matching).
  std::array<std::vector<int32_t>, 256> specials_by_first_byte_;
  std::optional<int32_t> bos_id_, eos_id_, pad_id_;
};

}  // namespace deltaserve::tokenizer
