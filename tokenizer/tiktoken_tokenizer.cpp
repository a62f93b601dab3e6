#include "tokenizer/tiktoken_tokenizer.hpp"

#include <algorithm>
#include <charconv>
#include <fstream>
#include <functional>
#include <queue>
#include <sstream>
#include <tuple>

#include "common/json.hpp"
#include "tokenizer/base64.hpp"

namespace deltaserve::tokenizer {
namespace {

constexpr int32_t kMaxBaseTokens = INT32_MAX - kNumReservedSpecialTokens;

Result<std::string> read_file(const std::filesystem::path& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return not_found(path.string() + ": no such file");
  std::ifstream in(path, std::ios::binary);
  if (!in) return io_error(path.string() + ": cannot open for reading");
  std::ostringstream buffer;
  buffer << in.rdbuf();
  if (in.bad()) return io_error(path.string() + ": read failed");
  return std::move(buffer).str();
}

bool is_blank(char c) {
  return c == ' ' || c == '\t' || c == '\r';
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && is_blank(s.front())) s.remove_prefix(1);
  while (!s.empty() && is_blank(s.back())) s.remove_suffix(1);
  return s;
}

std::string hex_byte(uint8_t b) {
  static constexpr char kDigits[] = "0123456789abcdef";
  return std::string("0x") + kDigits[b >> 4] + kDigits[b & 15];
}

// A special-token name from tokenizer_config.json: a string, {"content": "..."} (HF AddedToken), or
// null/absent (no such token).
Result<std::string> token_name(const json::Value& config, std::string_view key, std::string_view label) {
  const json::Value* v = config.find(key);
  if (v == nullptr || v->is_null()) return std::string();
  if (v->is_string()) return v->as_string();
  if (v->is_object()) {
    const json::Value* content = v->find("content");
    if (content != nullptr && content->is_string()) return content->as_string();
  }
  return data_loss(std::string(label) + ": '" + std::string(key) +
                   "' must be a string, an object with a string 'content', or null");
}

Result<SpecialTokenConfig> parse_tokenizer_config(std::string_view content, std::string_view label) {
  auto parsed = json::parse(content);
  if (!parsed.is_ok()) return data_loss(std::string(label) + ": " + parsed.status().message());
  const json::Value& config = parsed.value();
  if (!config.is_object()) return data_loss(std::string(label) + ": top level must be an object");

  SpecialTokenConfig out;
  if (const json::Value* added = config.find("added_tokens_decoder"); added != nullptr && !added->is_null()) {
    if (!added->is_object()) return data_loss(std::string(label) + ": 'added_tokens_decoder' must be an object");
    for (const auto& [key, entry] : added->as_object()) {
      const std::string where = std::string(label) + ": added_tokens_decoder[\"" + key + "\"]";
      int64_t id = -1;
      const auto [end, ec] = std::from_chars(key.data(), key.data() + key.size(), id);
      if (ec != std::errc() || end != key.data() + key.size() || id < 0 || id > INT32_MAX) {
        return data_loss(where + ": key is not a token id");
      }
      const json::Value* text = entry.is_object() ? entry.find("content") : nullptr;
      if (text == nullptr || !text->is_string() || text->as_string().empty()) {
        return data_loss(where + ": needs a non-empty string 'content'");
      }
      out.added_tokens.emplace_back(static_cast<int32_t>(id), text->as_string());
    }
  }
  DS_ASSIGN_OR_RETURN(out.bos_token, token_name(config, "bos_token", label));
  DS_ASSIGN_OR_RETURN(out.eos_token, token_name(config, "eos_token", label));
  DS_ASSIGN_OR_RETURN(out.pad_token, token_name(config, "pad_token", label));
  return out;
}

}  // namespace

Result<std::vector<std::string>> parse_tiktoken_model(std::string_view content, std::string_view file_label) {
  struct Entry {
    std::string bytes;
    int64_t rank;
    size_t line;
  };
  std::vector<Entry> entries;
  std::unordered_map<int64_t, size_t> line_of_rank;
  std::unordered_map<std::string, size_t> line_of_bytes;
  const auto error = [&](size_t line, const std::string& what) {
    return data_loss(std::string(file_label) + ":" + std::to_string(line) + ": " + what);
  };

  size_t line_number = 0;
  size_t pos = 0;
  while (pos < content.size()) {
    size_t eol = content.find('\n', pos);
    if (eol == std::string_view::npos) eol = content.size();
    const std::string_view line = trim(content.substr(pos, eol - pos));
    pos = eol + 1;
    ++line_number;
    if (line.empty()) continue;

    const size_t space = line.find_first_of(" \t");
    if (space == std::string_view::npos) return error(line_number, "expected \"<base64 token> <rank>\"");
    const std::string_view token_field = line.substr(0, space);
    const std::string_view rank_field = trim(line.substr(space));
    if (rank_field.find_first_of(" \t") != std::string_view::npos) {
      return error(line_number, "expected exactly two fields \"<base64 token> <rank>\"");
    }
    std::optional<std::string> bytes = base64_decode(token_field);
    if (!bytes) return error(line_number, "bad base64 token '" + std::string(token_field) + "'");
    if (bytes->empty()) return error(line_number, "empty token");
    int64_t rank = -1;
    const auto [end, ec] = std::from_chars(rank_field.data(), rank_field.data() + rank_field.size(), rank);
    if (ec != std::errc() || end != rank_field.data() + rank_field.size() || rank < 0 || rank >= kMaxBaseTokens) {
      return error(line_number, "bad rank '" + std::string(rank_field) + "'");
    }
    if (auto it = line_of_rank.find(rank); it != line_of_rank.end()) {
      return error(line_number,
                   "duplicate rank " + std::to_string(rank) + " (first on line " + std::to_string(it->second) + ")");
    }
    if (auto it = line_of_bytes.find(*bytes); it != line_of_bytes.end()) {
      return error(line_number, "duplicate token (same bytes as line " + std::to_string(it->second) + ")");
    }
    line_of_rank.emplace(rank, line_number);
    line_of_bytes.emplace(*bytes, line_number);
    entries.push_back({std::move(*bytes), rank, line_number});
  }
  if (entries.empty()) return data_loss(std::string(file_label) + ": no tokens");

  // Ranks are distinct; they are contiguous iff every rank is below the count. Otherwise report the
  // smallest missing rank and the line of the smallest rank above it.
  const int64_t count = static_cast<int64_t>(entries.size());
  std::vector<std::string> ranked(entries.size());
  std::vector<bool> present(entries.size(), false);
  const Entry* first_too_large = nullptr;
  for (Entry& e : entries) {
    if (e.rank >= count) {
      if (first_too_large == nullptr || e.rank < first_too_large->rank) first_too_large = &e;
      continue;
    }
    present[static_cast<size_t>(e.rank)] = true;
  }
  if (first_too_large != nullptr) {
    const auto missing = std::find(present.begin(), present.end(), false) - present.begin();
    return error(first_too_large->line, "ranks are not contiguous: rank " + std::to_string(first_too_large->rank) +
                                            " but rank " + std::to_string(missing) + " is missing");
  }
  for (Entry& e : entries) ranked[static_cast<size_t>(e.rank)] = std::move(e.bytes);
  return ranked;
}

Result<Tokenizer> Tokenizer::load(const std::filesystem::path& dir) {
  const std::filesystem::path model_path = dir / kTiktokenModelFile;
  const std::filesystem::path config_path = dir / kTokenizerConfigFile;
  DS_ASSIGN_OR_RETURN(std::string model_content, read_file(model_path));
  DS_ASSIGN_OR_RETURN(std::vector<std::string> ranked, parse_tiktoken_model(model_content, model_path.string()));
  DS_ASSIGN_OR_RETURN(std::string config_content, read_file(config_path));
  DS_ASSIGN_OR_RETURN(SpecialTokenConfig specials, parse_tokenizer_config(config_content, config_path.string()));
  auto tokenizer = build(std::move(ranked), specials);
  if (!tokenizer.is_ok()) return tokenizer.status().with_context("load tokenizer " + dir.string());
  return tokenizer;
}

Result<Tokenizer> Tokenizer::build(std::vector<std::string> ranked_tokens, const SpecialTokenConfig& specials) {
  if (ranked_tokens.empty()) return data_loss("no base tokens");
  if (ranked_tokens.size() > static_cast<size_t>(kMaxBaseTokens)) return data_loss("too many base tokens");
  DS_ASSIGN_OR_RETURN(PreTokenizer pretokenizer, PreTokenizer::create());

  Tokenizer t(std::move(pretokenizer));
  t.num_base_tokens_ = static_cast<int32_t>(ranked_tokens.size());
  t.base_ranks_.reserve(ranked_tokens.size());
  t.byte_ids_.fill(-1);
  for (size_t rank = 0; rank < ranked_tokens.size(); ++rank) {
    const std::string& bytes = ranked_tokens[rank];
    if (bytes.empty()) return data_loss("rank " + std::to_string(rank) + ": empty token");
    if (!t.base_ranks_.emplace(bytes, static_cast<int32_t>(rank)).second) {
      return data_loss("rank " + std::to_string(rank) + ": duplicate token bytes");
    }
    if (bytes.size() == 1) t.byte_ids_[static_cast<uint8_t>(bytes[0])] = static_cast<int32_t>(rank);
  }
  for (int b = 0; b < 256; ++b) {
    if (t.byte_ids_[b] < 0) return data_loss("no single-byte token for byte " + hex_byte(static_cast<uint8_t>(b)));
  }

  const int32_t first_special = t.num_base_tokens_;
  std::vector<std::string> special_texts(kNumReservedSpecialTokens);
  for (const auto& [id, text] : specials.added_tokens) {
    if (id < first_special || id >= t.vocab_size()) {
      return data_loss("added token " + std::to_string(id) + " '" + text + "' is outside the special range [" +
                       std::to_string(first_special) + ", " + std::to_string(t.vocab_size()) + ")");
    }
    if (text.empty()) return data_loss("added token " + std::to_string(id) + " has empty text");
    special_texts[static_cast<size_t>(id - first_special)] = text;
  }
  t.id_to_bytes_ = std::move(ranked_tokens);
  t.id_to_bytes_.reserve(static_cast<size_t>(t.vocab_size()));
  for (int32_t i = 0; i < kNumReservedSpecialTokens; ++i) {
    const int32_t id = first_special + i;
    std::string& text = special_texts[static_cast<size_t>(i)];
    if (text.empty()) text = "<|reserved_token_" + std::to_string(id) + "|>";
    if (!t.special_ids_.emplace(text, id).second) {
      return data_loss("special token text '" + text + "' is used by two ids");
    }
    t.specials_by_first_byte_[static_cast<uint8_t>(text[0])].push_back(id);
    t.id_to_bytes_.push_back(std::move(text));
  }
  for (auto& bucket : t.specials_by_first_byte_) {
    std::stable_sort(bucket.begin(), bucket.end(), [&](int32_t a, int32_t b) {
      return t.id_to_bytes_[static_cast<size_t>(a)].size() > t.id_to_bytes_[static_cast<size_t>(b)].size();
    });
  }

  const auto resolve = [&](const std::string& name, std::string_view field, std::optional<int32_t>& out) -> Status {
    if (name.empty()) return Status::ok();
    const std::optional<int32_t> id = t.special_token_id(name);
    if (!id) return data_loss(std::string(field) + " '" + name + "' is not a special token");
    out = id;
    return Status::ok();
  };
  DS_RETURN_IF_ERROR(resolve(specials.bos_token, "bos_token", t.bos_id_));
  DS_RETURN_IF_ERROR(resolve(specials.eos_token, "eos_token", t.eos_id_));
  DS_RETURN_IF_ERROR(resolve(specials.pad_token, "pad_token", t.pad_id_));
  return t;
}

std::optional<int32_t> Tokenizer::rank_of(std::string_view bytes) const {
  const auto it = base_ranks_.find(bytes);
  if (it == base_ranks_.end()) return std::nullopt;
  return it->second;
}

std::optional<int32_t> Tokenizer::special_token_id(std::string_view text) const {
  const auto it = special_ids_.find(text);
  if (it == special_ids_.end()) return std::nullopt;
  return it->second;
}

std::optional<std::string_view> Tokenizer::token_bytes(int32_t id) const {
  if (id < 0 || id >= vocab_size()) return std::nullopt;
  return std::string_view(id_to_bytes_[static_cast<size_t>(id)]);
}

void Tokenizer::encode_piece(std::string_view piece, std::vector<int32_t>& out) const {
  const size_t n = piece.size();
  if (n == 0) return;
  if (n == 1) {
    out.push_back(byte_ids_[static_cast<uint8_t>(piece[0])]);
    return;
  }
  if (const auto whole = rank_of(piece)) {
    out.push_back(*whole);
    return;
  }

  // Parts are byte ranges [start, next[start]); `prev`/`next` link the live part starts; n marks the end.
  std::vector<uint32_t> next(n), prev(n);
  std::vector<bool> alive(n, true);
  for (size_t i = 0; i < n; ++i) {
    next[i] = static_cast<uint32_t>(i + 1);
    prev[i] = static_cast<uint32_t>(i == 0 ? n : i - 1);  // n = no previous part
  }
  // Candidate merges (rank, left start, end of the right part): min-heap, leftmost first on equal rank.
  using Candidate = std::tuple<int32_t, uint32_t, uint32_t>;
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> heap;
  const auto push_pair = [&](uint32_t start) {
    if (start >= n || next[start] >= n) return;
    const uint32_t end = next[next[start]];
    if (const auto rank = rank_of(piece.substr(start, end - start))) heap.emplace(*rank, start, end);
  };
  for (uint32_t i = 0; i + 1 < n; ++i) push_pair(i);

  while (!heap.empty()) {
    const auto [rank, start, end] = heap.top();
    heap.pop();
    // Stale when the left part was absorbed or either part has grown since the push: merges only
    // remove boundaries, so an unchanged end of the right part means the same two parts.
    if (!alive[start] || next[start] >= n || next[next[start]] != end) continue;
    const uint32_t right = next[start];
    alive[right] = false;
    next[start] = next[right];
    if (next[start] < n) prev[next[start]] = start;
    if (prev[start] < n) push_pair(prev[start]);
    push_pair(start);
  }

  for (uint32_t i = 0; i < n; i = next[i]) {
    const auto rank = rank_of(piece.substr(i, next[i] - i));
    // Every part is a single byte or the product of a ranked merge, so it always has a rank.
    out.push_back(rank ? *rank : byte_ids_[static_cast<uint8_t>(piece[i])]);
  }
}

void Tokenizer::encode_ordinary(std::string_view text, std::vector<int32_t>& out) const {
  std::vector<std::string_view> pieces;
  pretokenizer_.split(text, pieces);
  for (std::string_view piece : pieces) encode_piece(piece, out);
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, SpecialTokens allow) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 1);
  std::vector<std::string_view> chunks;
  split_encode_chunks(text, chunks);
  for (std::string_view chunk : chunks) encode_chunk(chunk, allow, out);
  return out;
}

void Tokenizer::encode_chunk(std::string_view text, SpecialTokens allow, std::vector<int32_t>& out) const {
  if (allow == SpecialTokens::kNone) {
    encode_ordinary(text, out);
    return;
  }
  // Leftmost special token, longest first among those starting at the same byte.
  size_t segment_begin = 0;
  size_t pos = 0;
  while (pos < text.size()) {
    const auto& bucket = specials_by_first_byte_[static_cast<uint8_t>(text[pos])];
    int32_t found = -1;
    for (int32_t id : bucket) {
      if (text.substr(pos).starts_with(id_to_bytes_[static_cast<size_t>(id)])) {
        found = id;
        break;
      }
    }
    if (found < 0) {
      ++pos;
      continue;
    }
    encode_ordinary(text.substr(segment_begin, pos - segment_begin), out);
    out.push_back(found);
    pos += id_to_bytes_[static_cast<size_t>(found)].size();
    segment_begin = pos;
  }
  encode_ordinary(text.substr(segment_begin), out);
}

std::string Tokenizer::decode(std::span<const int32_t> ids) const {
  std::string out;
  for (int32_t id : ids) {
    if (id >= 0 && id < vocab_size()) out.append(id_to_bytes_[static_cast<size_t>(id)]);
  }
  return out;
}

Result<std::string> Tokenizer::decode_checked(std::span<const int32_t> ids) const {
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= vocab_size()) {
      return out_of_range("token [" + std::to_string(i) + "] = " + std::to_string(ids[i]) +
                          " is outside the vocabulary [0, " + std::to_string(vocab_size()) + ")");
    }
  }
  return decode(ids);
}

}  // namespace deltaserve::tokenizer
