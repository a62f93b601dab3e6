#include "tokenizer/tokenizer_writer.hpp"

#include <fstream>
#include <map>
#include <unordered_map>

#include "common/json.hpp"
#include "tokenizer/base64.hpp"
#include "tokenizer/pretokenizer.hpp"
#include "tokenizer/tiktoken_tokenizer.hpp"

namespace deltaserve::tokenizer {
namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

struct Word {
  std::vector<int32_t> ids;
  int64_t count;
};

struct PairHash {
  size_t operator()(const std::pair<int32_t, int32_t>& p) const noexcept {
    return std::hash<uint64_t>{}((static_cast<uint64_t>(static_cast<uint32_t>(p.first)) << 32) |
                                 static_cast<uint32_t>(p.second));
  }
};

// Paragraphs (split on blank lines) pre-split with the Kimi pattern; paragraph p counts
// 1 + splitmix64(seed ^ p) % 3 times. std::map keeps the word order independent of hashing.
Result<std::vector<Word>> training_words(uint64_t seed) {
  DS_ASSIGN_OR_RETURN(PreTokenizer pretokenizer, PreTokenizer::create());
  std::map<std::string, int64_t, std::less<>> counts;
  const std::string_view text = tiny_training_text();
  size_t pos = 0;
  uint64_t paragraph = 0;
  std::vector<std::string_view> pieces;
  while (pos < text.size()) {
    size_t end = text.find("\n\n", pos);
    end = end == std::string_view::npos ? text.size() : end + 2;
    const int64_t weight = 1 + static_cast<int64_t>(splitmix64(seed ^ paragraph) % 3);
    pieces.clear();
    pretokenizer.split(text.substr(pos, end - pos), pieces);
    for (std::string_view piece : pieces) counts[std::string(piece)] += weight;
    pos = end;
    ++paragraph;
  }
  std::vector<Word> words;
  words.reserve(counts.size());
  for (const auto& [piece, count] : counts) {
    Word w{{}, count};
    for (char c : piece) w.ids.push_back(static_cast<uint8_t>(c));  // rank of byte b is b
    words.push_back(std::move(w));
  }
  return words;
}

Status write_file_atomically(const std::filesystem::path& path, std::string_view content) {
  const std::filesystem::path tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return io_error(tmp.string() + ": cannot open for writing");
    out.write(content.data(), static_cast<std::streamsize>(content.size()));
    out.flush();
    if (!out) return io_error(tmp.string() + ": write failed");
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) return io_error(path.string() + ": rename from " + tmp.filename().string() + " failed: " + ec.message());
  return Status::ok();
}

std::string tokenizer_config_json(int32_t num_base_tokens) {
  json::Value added = json::Value::object();
  for (const SpecialTokenSlot& slot : kKimiSpecialTokenLayout) {
    json::Value entry = json::Value::object();
    entry["content"] = json::Value(std::string(slot.text));
    entry["lstrip"] = json::Value(false);
    entry["normalized"] = json::Value(false);
    entry["rstrip"] = json::Value(false);
    entry["single_word"] = json::Value(false);
    entry["special"] = json::Value(true);
    added[std::to_string(num_base_tokens + slot.offset)] = std::move(entry);
  }
  json::Value additional = json::Value::array();
  for (std::string_view name : {"<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>"}) {
    additional.push_back(json::Value(std::string(name)));
  }
  json::Value config = json::Value::object();
  config["added_tokens_decoder"] = std::move(added);
  config["additional_special_tokens"] = std::move(additional);
  config["bos_token"] = json::Value(std::string("[BOS]"));
  config["eos_token"] = json::Value(std::string("<|im_end|>"));
  config["pad_token"] = json::Value(std::string("[PAD]"));
  config["unk_token"] = json::Value(std::string("[UNK]"));
  config["clean_up_tokenization_spaces"] = json::Value(false);
  config["model_max_length"] = json::Value(static_cast<int64_t>(1048576));
  config["tokenizer_class"] = json::Value(std::string("TikTokenTokenizer"));
  return config.dump(2) + "\n";
}

}  // namespace

Result<std::vector<std::string>> train_tiny_bpe(int32_t num_base_tokens, uint64_t seed) {
  if (num_base_tokens < 256) {
    return invalid_argument("num_base_tokens " + std::to_string(num_base_tokens) + " < 256 (the byte tokens)");
  }
  std::vector<std::string> vocab;
  vocab.reserve(static_cast<size_t>(num_base_tokens));
  for (int b = 0; b < 256; ++b) vocab.emplace_back(1, static_cast<char>(b));
  std::unordered_map<std::string, int32_t> id_of;
  for (int b = 0; b < 256; ++b) id_of.emplace(vocab[static_cast<size_t>(b)], b);

  DS_ASSIGN_OR_RETURN(std::vector<Word> words, training_words(seed));
  std::unordered_map<std::pair<int32_t, int32_t>, int64_t, PairHash> pair_counts;
  while (vocab.size() < static_cast<size_t>(num_base_tokens)) {
    pair_counts.clear();
    for (const Word& w : words) {
      for (size_t i = 0; i + 1 < w.ids.size(); ++i) pair_counts[{w.ids[i], w.ids[i + 1]}] += w.count;
    }
    if (pair_counts.empty()) {
      return invalid_argument("num_base_tokens " + std::to_string(num_base_tokens) +
                              ": the embedded training text yields only " + std::to_string(vocab.size()) + " tokens");
    }
    // Most frequent pair; ties broken by the smaller (left, right) ids, so hashing order never matters.
    auto best = pair_counts.begin();
    for (auto it = pair_counts.begin(); it != pair_counts.end(); ++it) {
      if (it->second > best->second || (it->second == best->second && it->first < best->first)) best = it;
    }
    const auto [left, right] = best->first;
    std::string merged = vocab[static_cast<size_t>(left)] + vocab[static_cast<size_t>(right)];
    int32_t merged_id;
    if (auto it = id_of.find(merged); it != id_of.end()) {
      merged_id = it->second;  // the same bytes were reached by another pair: no new rank
    } else {
      merged_id = static_cast<int32_t>(vocab.size());
      id_of.emplace(merged, merged_id);
      vocab.push_back(std::move(merged));
    }
    for (Word& w : words) {
      size_t out = 0;
      for (size_t i = 0; i < w.ids.size(); ++i) {
        if (i + 1 < w.ids.size() && w.ids[i] == left && w.ids[i + 1] == right) {
          w.ids[out++] = merged_id;
          ++i;
        } else {
          w.ids[out++] = w.ids[i];
        }
      }
      w.ids.resize(out);
    }
  }
  return vocab;
}

Status write_tiny_tokenizer(const std::filesystem::path& dir, int32_t num_base_tokens, uint64_t seed) {
  DS_ASSIGN_OR_RETURN(std::vector<std::string> vocab, train_tiny_bpe(num_base_tokens, seed));
  std::string model;
  for (size_t rank = 0; rank < vocab.size(); ++rank) {
    model.append(base64_encode(vocab[rank])).append(" ").append(std::to_string(rank)).append("\n");
  }
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return io_error(dir.string() + ": cannot create directory: " + ec.message());
  DS_RETURN_IF_ERROR(write_file_atomically(dir / kTiktokenModelFile, model));
  return write_file_atomically(dir / kTokenizerConfigFile, tokenizer_config_json(num_base_tokens));
}

}  // namespace deltaserve::tokenizer
