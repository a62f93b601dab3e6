#include "tokenizer/pretokenizer.hpp"

#include <mutex>
#include <string>
#include <utility>

#include <oniguruma.h>

#include "tokenizer/utf8.hpp"

namespace deltaserve::tokenizer {
namespace {

void initialize_oniguruma_once() {
  static std::once_flag once;
  std::call_once(once, [] {
    OnigEncoding encodings[] = {ONIG_ENCODING_UTF8};
    onig_initialize(encodings, 1);
  });
}

const UChar* as_uchar(const char* p) {
  return reinterpret_cast<const UChar*>(p);
}

struct RegionDeleter {
  void operator()(OnigRegion* region) const { onig_region_free(region, /*free_self=*/1); }
};

// Python's str.isspace(): bidirectional class WS, B or S, or general category Zs.
bool is_python_space(char32_t cp) {
  if (cp <= 0x20) return cp == 0x20 || (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x1F);
  switch (cp) {
    case 0x85:
    case 0xA0:
    case 0x1680:
    case 0x2028:
    case 0x2029:
    case 0x202F:
    case 0x205F:
    case 0x3000:
      return true;
    default:
      return cp >= 0x2000 && cp <= 0x200A;
  }
}

// Length in bytes of the character at text[0] and whether it is whitespace.
std::pair<size_t, bool> next_character(std::string_view text) {
  const Utf8Step step = utf8_step(text);
  if (step.kind != Utf8Step::Kind::kValid) return {1, false};
  return {step.length, is_python_space(decode_code_point(text.substr(0, step.length)))};
}

void split_long_runs(std::string_view text, std::vector<std::string_view>& chunks) {
  if (text.empty()) return;
  size_t run_length = 0;
  bool run_is_space = next_character(text).second;
  size_t slice_start = 0;
  for (size_t pos = 0; pos < text.size();) {
    const auto [length, is_space] = next_character(text.substr(pos));
    if (is_space != run_is_space) {
      run_length = 1;
      run_is_space = is_space;
    } else if (++run_length > kMaxConsecutiveRunChars) {
      chunks.push_back(text.substr(slice_start, pos - slice_start));
      slice_start = pos;
      run_length = 1;
    }
    pos += length;
  }
  chunks.push_back(text.substr(slice_start));
}

}  // namespace

void split_encode_chunks(std::string_view text, std::vector<std::string_view>& chunks) {
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t start = pos;
    for (size_t count = 0; pos < text.size() && count < kMaxEncodeChars; ++count) {
      pos += next_character(text.substr(pos)).first;
    }
    split_long_runs(text.substr(start, pos - start), chunks);
  }
}

Result<PreTokenizer> PreTokenizer::create(std::string_view pattern) {
  initialize_oniguruma_once();
  OnigRegex regex = nullptr;
  OnigErrorInfo error_info{};
  const int rc = onig_new(&regex, as_uchar(pattern.data()), as_uchar(pattern.data() + pattern.size()),
                          ONIG_OPTION_CAPTURE_GROUP, ONIG_ENCODING_UTF8, ONIG_SYNTAX_ONIGURUMA, &error_info);
  if (rc != ONIG_NORMAL) {
    UChar message[ONIG_MAX_ERROR_MESSAGE_LEN] = {};
    onig_error_code_to_str(message, rc, &error_info);
    return invalid_argument("pre-tokenizer pattern does not compile: " +
                            std::string(reinterpret_cast<const char*>(message)));
  }
  return PreTokenizer(std::shared_ptr<re_pattern_buffer>(regex, [](OnigRegex r) { onig_free(r); }));
}

void PreTokenizer::split(std::string_view text, std::vector<std::string_view>& pieces) const {
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t valid = valid_utf8_prefix_length(text.substr(pos));
    if (valid > 0) {
      split_valid_run(text.substr(pos, valid), pieces);
      pos += valid;
      continue;
    }
    // An ill-formed sequence: each of its bytes is a piece of its own (it can only become a single-byte
    // token anyway, and keeping them apart keeps them from merging with their valid neighbours).
    const Utf8Step step = utf8_step(text.substr(pos));
    const size_t bad = step.length;  // >= 1; kValid is impossible here
    for (size_t i = 0; i < bad; ++i) pieces.push_back(text.substr(pos + i, 1));
    pos += bad;
  }
}

void PreTokenizer::split_valid_run(std::string_view run, std::vector<std::string_view>& pieces) const {
  std::unique_ptr<OnigRegion, RegionDeleter> region(onig_region_new());
  const UChar* begin = as_uchar(run.data());
  const UChar* end = begin + run.size();
  size_t pos = 0;
  while (pos < run.size()) {
    const int rc = onig_search(regex_.get(), begin, end, begin + pos, end, region.get(), ONIG_OPTION_NONE);
    if (rc < 0 || region->num_regs < 1) {
      // ONIG_MISMATCH (impossible for the Kimi pattern: every character matches some branch) or an
      // engine error: keep the remainder lossless as one piece.
      pieces.push_back(run.substr(pos));
      return;
    }
    const auto match_begin = static_cast<size_t>(region->beg[0]);
    const auto match_end = static_cast<size_t>(region->end[0]);
    if (match_begin > pos) pieces.push_back(run.substr(pos, match_begin - pos));  // unmatched gap
    if (match_end > match_begin) {
      pieces.push_back(run.substr(match_begin, match_end - match_begin));
      pos = match_end;
    } else {
      // Empty match (not produced by the Kimi pattern): take one character so the loop advances.
      const size_t length = utf8_step(run.substr(match_begin)).length;
      pieces.push_back(run.substr(match_begin, length));
      pos = match_begin + length;
    }
  }
}

}  // namespace deltaserve::tokenizer
