// TextStream against a reference computed from the whole token sequence at once:
//   full = sanitize_utf8(decode(non-special ids)); the output is the shortest prefix of `full` that
//   contains a stop string, cut at the first occurrence of a stop string in it (`full` when none occurs).
// At every step the streamed text so far must be a prefix of that reference (nothing is retracted)
// and every chunk valid UTF-8.
#include "tokenizer/text_stream.hpp"

#include <algorithm>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include <gtest/gtest.h>
#include <unistd.h>

#include "tokenizer/tokenizer_writer.hpp"
#include "tokenizer/utf8.hpp"

namespace deltaserve::tokenizer {
namespace {

namespace fs = std::filesystem;

const Tokenizer& tiny_tokenizer() {
  static const std::unique_ptr<Tokenizer> tokenizer = [] {
    std::string templ = (fs::temp_directory_path() / "ds_text_stream_test_XXXXXX").string();
    EXPECT_NE(::mkdtemp(templ.data()), nullptr);
    EXPECT_TRUE(write_tiny_tokenizer(templ, 1024, 7).is_ok());
    auto loaded = Tokenizer::load(templ);
    EXPECT_TRUE(loaded.is_ok()) << loaded.status().to_string();
    std::error_code ec;
    fs::remove_all(templ, ec);
    return std::make_unique<Tokenizer>(std::move(loaded).value());
  }();
  return *tokenizer;
}

struct Reference {
  std::string text;
  bool stopped = false;
};

Reference reference(const Tokenizer& tokenizer, const std::vector<int32_t>& ids, const std::vector<std::string>& stop) {
  std::vector<int32_t> plain;
  for (int32_t id : ids) {
    if (!tokenizer.is_special(id)) plain.push_back(id);
  }
  const std::string full = sanitize_utf8(tokenizer.decode(plain));
  // The shortest prefix containing a stop string ends where the earliest-ending occurrence ends.
  size_t end = std::string::npos;
  for (const std::string& s : stop) {
    if (s.empty()) continue;
    const size_t at = full.find(s);
    if (at != std::string::npos) end = std::min(end, at + s.size());
  }
  if (end == std::string::npos) return {full, false};
  const std::string prefix = full.substr(0, end);
  size_t cut = std::string::npos;
  for (const std::string& s : stop) {
    if (!s.empty()) cut = std::min(cut, prefix.find(s));
  }
  return {full.substr(0, cut), true};
}

// Streams `ids`, checking every step against the reference; returns the concatenated output.
std::string stream_and_check(const Tokenizer& tokenizer, const std::vector<int32_t>& ids,
                             const std::vector<std::string>& stop, const std::string& what) {
  const Reference want = reference(tokenizer, ids, stop);
  TextStream stream(tokenizer, stop);
  std::string out;
  bool stopped = false;
  for (size_t i = 0; i < ids.size(); ++i) {
    const TextStream::Output chunk = stream.push(ids[i]);
    if (stopped) {
      EXPECT_TRUE(chunk.text.empty()) << what << ": text after the stop at token " << i;
    }
    EXPECT_TRUE(is_valid_utf8(chunk.text)) << what << ": token " << i;
    out += chunk.text;
    stopped = stopped || chunk.stopped;
    EXPECT_EQ(stream.stopped(), stopped) << what;
    EXPECT_TRUE(std::string_view(want.text).starts_with(out))
        << what << ": after token " << i << " streamed \"" << out << "\" is not a prefix of \"" << want.text << "\"";
  }
  const std::string rest = stream.finish();
  if (stopped) {
    EXPECT_TRUE(rest.empty()) << what;
  }
  EXPECT_TRUE(is_valid_utf8(rest)) << what;
  out += rest;
  EXPECT_EQ(out, want.text) << what;
  EXPECT_EQ(stream.stopped(), want.stopped) << what;
  EXPECT_TRUE(stream.push(ids.empty() ? 0 : ids[0]).text.empty()) << what << ": push after finish";
  return out;
}

std::vector<int32_t> encode(std::string_view text) {
  return tiny_tokenizer().encode(text, SpecialTokens::kNone);
}

// One token per byte: every character and every stop string spans token boundaries.
std::vector<int32_t> byte_tokens(std::string_view text) {
  std::vector<int32_t> ids;
  for (char c : text) ids.push_back(*tiny_tokenizer().rank_of(std::string(1, c)));
  return ids;
}

// Character boundaries of valid UTF-8 `text`, 0 and text.size() included.
std::vector<size_t> char_boundaries(const std::string& text) {
  std::vector<size_t> at = {0};
  size_t pos = 0;
  while (pos < text.size()) {
    pos += utf8_step(std::string_view(text).substr(pos)).length;
    at.push_back(pos);
  }
  return at;
}

TEST(TextStream, RandomSequencesMatchTheReference) {
  const Tokenizer& tokenizer = tiny_tokenizer();
  const std::string_view corpus = tiny_training_text();
  std::mt19937_64 rng(42);
  int stopped = 0, runs = 0;
  for (int round = 0; round < 300; ++round) {
    // Tokens: encoded slices of the multilingual training text (Cyrillic, CJK), random base tokens
    // (often partial or invalid UTF-8), single bytes of multi-byte characters, and special tokens.
    std::vector<int32_t> ids;
    const int pieces = 1 + static_cast<int>(rng() % 6);
    for (int p = 0; p < pieces; ++p) {
      switch (rng() % 5) {
        case 0:
        case 1: {
          const size_t begin = rng() % corpus.size(), length = 1 + rng() % 60;
          const auto slice = encode(corpus.substr(begin, length));
          ids.insert(ids.end(), slice.begin(), slice.end());
          break;
        }
        case 2:
          for (int k = 0; k < 3; ++k) ids.push_back(static_cast<int32_t>(rng() % tokenizer.num_base_tokens()));
          break;
        case 3: {
          const auto bytes = byte_tokens("Привет 你好 ok");
          const size_t from = rng() % bytes.size();
          ids.insert(ids.end(), bytes.begin() + static_cast<std::ptrdiff_t>(from), bytes.end());
          break;
        }
        default:
          ids.push_back(tokenizer.num_base_tokens() + static_cast<int32_t>(rng() % 256));
          break;
      }
    }
    std::vector<int32_t> plain;
    for (int32_t id : ids) {
      if (!tokenizer.is_special(id)) plain.push_back(id);
    }
    const std::string full = sanitize_utf8(tokenizer.decode(plain));
    const std::vector<size_t> bounds = char_boundaries(full);

    // Stop strings: slices of the text at character boundaries (so they occur; sometimes at the very
    // start, sometimes a pair where one is a prefix of the other) and strings that do not occur.
    std::vector<std::string> stop;
    const int count = static_cast<int>(rng() % 4);
    for (int s = 0; s < count && bounds.size() > 1; ++s) {
      const size_t first = (rng() % 4 == 0) ? 0 : rng() % (bounds.size() - 1);
      const size_t last = std::min(bounds.size() - 1, first + 1 + rng() % 6);
      stop.push_back(full.substr(bounds[first], bounds[last] - bounds[first]));
      if (rng() % 3 == 0 && last + 1 < bounds.size()) {
        stop.push_back(full.substr(bounds[first], bounds[last + 1] - bounds[first]));  // the longer one
      }
    }
    if (rng() % 2) stop.push_back("\x01never\x02");
    if (rng() % 4 == 0) stop.push_back("");
    std::shuffle(stop.begin(), stop.end(), rng);

    const std::string what = "round " + std::to_string(round);
    stream_and_check(tokenizer, ids, stop, what);
    stopped += reference(tokenizer, ids, stop).stopped ? 1 : 0;
    ++runs;
    if (testing::Test::HasFailure()) break;
  }
  EXPECT_GT(stopped, runs / 3) << "most rounds should exercise a stop";
  EXPECT_LT(stopped, runs) << "some rounds should run to the end";
}

TEST(TextStream, StopSpanningTokensAndMultiByteCharacters) {
  const std::string text = "Привет, мир! 你好世界, done";
  for (const auto& ids : {encode(text), byte_tokens(text)}) {
    EXPECT_EQ(stream_and_check(tiny_tokenizer(), ids, {"мир"}, "мир"), "Привет, ");
    EXPECT_EQ(stream_and_check(tiny_tokenizer(), ids, {"好世"}, "好世"), "Привет, мир! 你");
    EXPECT_EQ(stream_and_check(tiny_tokenizer(), ids, {"世界, d"}, "世界, d"), "Привет, мир! 你好");
    EXPECT_EQ(stream_and_check(tiny_tokenizer(), ids, {"мирр"}, "not there"), text);
  }
}

TEST(TextStream, HoldsBackPossibleStopPrefixesAndReleasesThem) {
  const auto ids = byte_tokens("hello world");
  TextStream stream(tiny_tokenizer(), {"wor!", "o w?"});
  std::string out;
  std::vector<std::string> seen;  // seen[i]: the output after token i (one byte each)
  for (int32_t id : ids) {
    out += stream.push(id).text;
    seen.push_back(out);
  }
  EXPECT_EQ(seen[2], "hel");         // nothing in "hel" can start a stop string
  EXPECT_EQ(seen[4], "hell");        // "o" could start "o w?": held
  EXPECT_EQ(seen[6], "hell");        // "o w"
  EXPECT_EQ(seen[7], "hello ");      // "o wo" cannot; "wo" could start "wor!"
  EXPECT_EQ(seen[8], "hello ");      // "wor"
  EXPECT_EQ(seen[9], "hello worl");  // no suffix of "hello worl" starts a stop string
  EXPECT_FALSE(stream.stopped());
  out += stream.finish();
  EXPECT_EQ(out, "hello world");

  TextStream held_at_end(tiny_tokenizer(), {"ld!"});
  std::string text;
  for (int32_t id : ids) text += held_at_end.push(id).text;
  EXPECT_EQ(text, "hello wor");
  EXPECT_EQ(held_at_end.finish(), "ld");  // the end of generation proves "ld" is text
  EXPECT_FALSE(held_at_end.stopped());
}

TEST(TextStream, StopStringsThatArePrefixesOfEachOther) {
  const auto ids = byte_tokens("hello world");
  EXPECT_EQ(stream_and_check(tiny_tokenizer(), ids, {"world", "wor"}, "wor first"), "hello ");
  EXPECT_EQ(stream_and_check(tiny_tokenizer(), ids, {"wor", "world"}, "world first"), "hello ");
  EXPECT_EQ(stream_and_check(tiny_tokenizer(), ids, {"o w", "o", "lo"}, "nested"), "hel");
  // A stop string inside another that ends first wins (the text so far is all that is known).
  EXPECT_EQ(stream_and_check(tiny_tokenizer(), byte_tokens("xabcd"), {"abcd", "bc"}, "infix"), "xa");
  EXPECT_EQ(stream_and_check(tiny_tokenizer(), encode("xabcd"), {"abcd", "bc"}, "infix, any tokens"), "xa");
  // A suffix ending at the same place: the longer one starts first.
  EXPECT_EQ(stream_and_check(tiny_tokenizer(), byte_tokens("xabcd"), {"cd", "abcd"}, "suffix"), "x");
}

TEST(TextStream, StopAtTheVeryStart) {
  const auto ids = encode("hello world");
  EXPECT_EQ(stream_and_check(tiny_tokenizer(), ids, {"h"}, "h"), "");
  EXPECT_EQ(stream_and_check(tiny_tokenizer(), ids, {"hello world"}, "everything"), "");
  TextStream stream(tiny_tokenizer(), {"hello"});
  const TextStream::Output first = stream.push(ids[0]);
  EXPECT_TRUE(first.text.empty());
}

TEST(TextStream, SpecialTokensProduceNoText) {
  const Tokenizer& tokenizer = tiny_tokenizer();
  const int32_t bos = *tokenizer.bos_id(), eos = *tokenizer.eos_id();
  TextStream stream(tokenizer, {});
  EXPECT_EQ(stream.push(bos).text, "");
  // A special between the bytes of one character does not split it.
  const auto bytes = byte_tokens("я");
  EXPECT_EQ(stream.push(bytes[0]).text, "");
  EXPECT_EQ(stream.push(eos).text, "");
  EXPECT_EQ(stream.push(bytes[1]).text, "я");
  EXPECT_EQ(stream.finish(), "");
  // A stop string naming a special's text does not match it: specials are not text.
  std::vector<int32_t> ids = {bos, eos};
  for (int32_t id : encode("ok")) ids.push_back(id);
  EXPECT_EQ(stream_and_check(tokenizer, ids, {"[BOS]", "<|im_end|>"}, "special text"), "ok");
}

TEST(TextStream, TruncatedCharacterAtTheEndAndIgnoredStopStrings) {
  const auto bytes = byte_tokens("aя");  // 'a', then the two bytes of 'я'; drop the last
  const std::vector<int32_t> ids = {bytes[0], bytes[1]};
  EXPECT_EQ(stream_and_check(tiny_tokenizer(), ids, {}, "no stops"), "a\xEF\xBF\xBD");
  // The U+FFFD that only finish() produces completes a stop string.
  EXPECT_EQ(stream_and_check(tiny_tokenizer(), ids, {"\xEF\xBF\xBD"}, "stop on U+FFFD"), "a");
  // Empty and invalid UTF-8 stop strings are ignored (the lead byte of 'я' alone would match mid-character).
  TextStream stream(tiny_tokenizer(), {"", "\xD1"});
  std::string out;
  for (int32_t id : byte_tokens("aяb")) out += stream.push(id).text;
  out += stream.finish();
  EXPECT_EQ(out, "aяb");
  EXPECT_FALSE(stream.stopped());
}

}  // namespace
}  // namespace deltaserve::tokenizer
