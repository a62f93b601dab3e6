#include <atomic>
#include <climits>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <unistd.h>

#include "common/temp_dir.hpp"
#include "tokenizer/base64.hpp"
#include "tokenizer/chat_template.hpp"
#include "tokenizer/incremental_decoder.hpp"
#include "tokenizer/pretokenizer.hpp"
#include "tokenizer/tiktoken_tokenizer.hpp"
#include "tokenizer/tokenizer_writer.hpp"
#include "tokenizer/utf8.hpp"

namespace deltaserve::tokenizer {
namespace {

namespace fs = std::filesystem;

constexpr int32_t kTinyBase = 1024;
constexpr uint64_t kTinySeed = 7;

std::string read_all(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

void write_all(const fs::path& path, std::string_view content) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(content.data(), static_cast<std::streamsize>(content.size()));
}

// One tiny tokenizer shared by the tests (written by the real writer, read by the real loader).
class TinyTokenizerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir();
    const Status written = write_tiny_tokenizer(dir_->path(), kTinyBase, kTinySeed);
    ASSERT_TRUE(written.is_ok()) << written.to_string();
    auto loaded = Tokenizer::load(dir_->path());
    ASSERT_TRUE(loaded.is_ok()) << loaded.status().to_string();
    tokenizer_ = new Tokenizer(std::move(loaded).value());
  }
  static void TearDownTestSuite() {
    delete tokenizer_;
    delete dir_;
    tokenizer_ = nullptr;
    dir_ = nullptr;
  }
  static const Tokenizer& tok() { return *tokenizer_; }

  static TempDir* dir_;
  static Tokenizer* tokenizer_;
};
TempDir* TinyTokenizerTest::dir_ = nullptr;
Tokenizer* TinyTokenizerTest::tokenizer_ = nullptr;

// Straightforward tiktoken byte_pair_merge: O(n^2), whole-piece shortcut first.
std::vector<int32_t> reference_bpe(const Tokenizer& t, std::string_view piece) {
  if (const auto whole = t.rank_of(piece)) return {*whole};
  std::vector<std::string> parts;
  for (char c : piece) parts.emplace_back(1, c);
  while (parts.size() > 1) {
    size_t best = SIZE_MAX;
    int32_t best_rank = INT32_MAX;
    for (size_t i = 0; i + 1 < parts.size(); ++i) {
      const auto rank = t.rank_of(parts[i] + parts[i + 1]);
      if (rank && *rank < best_rank) best_rank = *rank, best = i;
    }
    if (best == SIZE_MAX) break;
    parts[best] += parts[best + 1];
    parts.erase(parts.begin() + static_cast<std::ptrdiff_t>(best) + 1);
  }
  std::vector<int32_t> ids;
  for (const std::string& p : parts) ids.push_back(*t.rank_of(p));
  return ids;
}

std::vector<int32_t> reference_encode(const Tokenizer& t, std::string_view text) {
  std::vector<int32_t> ids;
  for (std::string_view piece : t.pretokenizer().split(text)) {
    const std::vector<int32_t> part = reference_bpe(t, piece);
    ids.insert(ids.end(), part.begin(), part.end());
  }
  return ids;
}

// Random bytes biased towards interesting UTF-8: ASCII, multi-byte characters, truncated and stray
// continuation bytes, CR/LF, digits, and fragments of special-token text.
std::string random_bytes(std::mt19937_64& rng, size_t max_length) {
  static const std::vector<std::string> kFragments = {"a",        "Z",          " ",
                                                      "  ",       "\r\n",       "\n",
                                                      "\t",       "7",          "123",
                                                      "'s",       "Ж",          "я",
                                                      "中",       "文",         "😀",
                                                      "é",        "\xE4",       "\xB8",
                                                      "\xF0\x9F", "\xC0\xAF",   "\xED\xA0\x80",
                                                      "\xFF",     "<|im_end|>", "<|im",
                                                      "[BOS]",    "\x80",       "\xF4\x90\x80\x80",
                                                      "\x00"};
  std::uniform_int_distribution<size_t> length_dist(0, max_length);
  std::uniform_int_distribution<int> kind(0, 3);
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_int_distribution<size_t> fragment(0, kFragments.size() - 1);
  std::string s;
  const size_t length = length_dist(rng);
  while (s.size() < length) {
    if (kind(rng) == 0) {
      s.push_back(static_cast<char>(byte(rng)));
    } else {
      s += kFragments[fragment(rng)];
    }
  }
  return s;
}

const std::vector<std::string>& handwritten_strings() {
  static const std::vector<std::string> kStrings = {
      "",
      "Hello world",
      "Hello, world! How's it going? I'm fine; they'll see, we've won, she'd know, it'S OK.",
      "Привет, мир! Как дела? Ёжик в тумане.",
      "你好，世界！语言模型把文本看作一串词元。",
      "emoji: 😀🙂👍🏽 👨‍👩‍👧‍👦 🇺🇦 🚀✨",
      "line one\r\nline two\r\n\r\n\rlast\n",
      std::string(300, ' ') + "x" + std::string(77, '\t') + "\n\n\n   \n",
      "1234567890 3.14159 1e-5 0x7fff 127.0.0.1:8080 ١٢٣ ⅫⅫ",
      "don't DON'T Don't you'RE we'Ve I'M they'LL he'D",
      "int main() { return x->y[3] >= 0 ? a : b; } // comment\n\tif (a && b) {}",
      "mixed 中文 and English и русский 123 😀",
      "ǅemal ǈ Ǉ ŉ ß ﬁ ẞ",                             // titlecase, ligatures
      "e\xCC\x81 a\xCC\x8A \xE0\xA4\xA8\xE0\xA4\xBF",  // combining marks, Devanagari
      "<|im_user|>user<|im_middle|>hi<|im_end|>",
      "[BOS][EOS][PAD] <|reserved_token_1030|> <|im_end",
  };
  return kStrings;
}

// ---- UTF-8 and base64 -----------------------------------------------------------------------------

TEST(Utf8Test, ValidityAndSanitize) {
  EXPECT_TRUE(is_valid_utf8("abc Ж 中 😀"));
  EXPECT_FALSE(is_valid_utf8("\xC0\xAF"));          // overlong
  EXPECT_FALSE(is_valid_utf8("\xED\xA0\x80"));      // surrogate
  EXPECT_FALSE(is_valid_utf8("\xF4\x90\x80\x80"));  // > U+10FFFF
  EXPECT_FALSE(is_valid_utf8("\xE4\xB8"));          // truncated
  EXPECT_EQ(sanitize_utf8("a\xE4\xB8"), "a\xEF\xBF\xBD");
  EXPECT_EQ(sanitize_utf8("\xE4\xB8z"), "\xEF\xBF\xBDz");
  EXPECT_EQ(sanitize_utf8("\xF0\x9F\x98"), "\xEF\xBF\xBD");          // one maximal subpart
  EXPECT_EQ(sanitize_utf8("\xC0\xAF"), "\xEF\xBF\xBD\xEF\xBF\xBD");  // two bad bytes
  EXPECT_EQ(sanitize_utf8("ok 中"), "ok 中");
}

TEST(Base64Test, RoundTripAndStrictness) {
  for (std::string s : {"", "a", "ab", "abc", "abcd", "\xFF\x00\x10"}) {
    const auto decoded = base64_decode(base64_encode(s));
    ASSERT_TRUE(decoded.has_value());
    EXPECT_EQ(*decoded, s);
  }
  EXPECT_EQ(base64_encode("hello"), "aGVsbG8=");
  EXPECT_FALSE(base64_decode("aGVsbG8").has_value());   // length
  EXPECT_FALSE(base64_decode("aGV$bG8=").has_value());  // alphabet
  EXPECT_FALSE(base64_decode("aG=sbG8=").has_value());  // inner '='
  EXPECT_FALSE(base64_decode("a===").has_value());
}

// ---- pre-tokenizer --------------------------------------------------------------------------------

TEST(PreTokenizerTest, KnownSplits) {
  auto pre = PreTokenizer::create();
  ASSERT_TRUE(pre.is_ok()) << pre.status().to_string();
  using V = std::vector<std::string_view>;
  EXPECT_EQ(pre->split("Hello world"), (V{"Hello", " world"}));
  EXPECT_EQ(pre->split("12345678"), (V{"123", "456", "78"}));
  EXPECT_EQ(pre->split("你好世界abc"), (V{"你好世界", "abc"}));
  EXPECT_EQ(pre->split("I'm DON'T they're"), (V{"I'm", " DON'T", " they're"}));
  EXPECT_EQ(pre->split("  hello  "), (V{" ", " hello", "  "}));
  EXPECT_EQ(pre->split("Привет, мир!\r\n\r\n  x"), (V{"Привет", ",", " мир", "!\r\n\r\n", " ", " x"}));
  EXPECT_EQ(pre->split("a\n\nb"), (V{"a", "\n\n", "b"}));
  EXPECT_EQ(pre->split("HTTPServer"), (V{"HTTPServer"}));
  EXPECT_TRUE(pre->split("").empty());
}

TEST(PreTokenizerTest, InvalidUtf8BytesArePiecesOfTheirOwn) {
  auto pre = PreTokenizer::create();
  ASSERT_TRUE(pre.is_ok());
  using V = std::vector<std::string_view>;
  EXPECT_EQ(pre->split("ab\xFF"
                       "cd"),
            (V{"ab", "\xFF", "cd"}));
  EXPECT_EQ(pre->split("x\xE4\xB8"), (V{"x", "\xE4", "\xB8"}));
  // Pieces tile arbitrary input exactly.
  std::mt19937_64 rng(11);
  for (int i = 0; i < 500; ++i) {
    const std::string s = random_bytes(rng, 64);
    std::string joined;
    for (std::string_view piece : pre->split(s)) {
      EXPECT_FALSE(piece.empty());
      joined += piece;
    }
    ASSERT_EQ(joined, s);
  }
}

TEST(PreTokenizerTest, LongRunsAreChunkedLikeTokenizationKimi) {
  const auto chunk_sizes = [](std::string_view text) {
    std::vector<std::string_view> chunks;
    split_encode_chunks(text, chunks);
    std::vector<size_t> sizes;
    for (std::string_view c : chunks) sizes.push_back(c.size());
    return sizes;
  };
  using S = std::vector<size_t>;
  EXPECT_EQ(chunk_sizes(""), S{});
  EXPECT_EQ(chunk_sizes("ab cd"), S{5});
  EXPECT_EQ(chunk_sizes(std::string(25000, 'x')), S{25000});
  EXPECT_EQ(chunk_sizes(std::string(25001, 'x')), (S{25000, 1}));
  EXPECT_EQ(chunk_sizes("ab" + std::string(30000, ' ') + "cd"), (S{25002, 5002}));
  std::string han;
  for (int i = 0; i < 25001; ++i) han += "中";
  EXPECT_EQ(chunk_sizes(han), (S{75000, 3}));                         // characters, not bytes
  EXPECT_EQ(chunk_sizes(std::string(25001, '\x1c')), (S{25000, 1}));  // Python isspace() includes U+001C
  EXPECT_EQ(chunk_sizes(std::string(400001, 'x')), (S{25000, 25000, 25000, 25000, 25000, 25000, 25000, 25000, 25000,
                                                      25000, 25000, 25000, 25000, 25000, 25000, 25000, 1}));
}

TEST(PreTokenizerTest, BadPatternIsAnError) {
  const auto pre = PreTokenizer::create("[unclosed");
  ASSERT_FALSE(pre.is_ok());
  EXPECT_EQ(pre.status().code(), StatusCode::kInvalidArgument);
}

// ---- encode / decode ------------------------------------------------------------------------------

TEST_F(TinyTokenizerTest, SpecialTokenLayoutFollowsKimi) {
  EXPECT_EQ(tok().num_base_tokens(), kTinyBase);
  EXPECT_EQ(tok().vocab_size(), kTinyBase + 256);
  EXPECT_EQ(tok().bos_id(), kTinyBase + 0);
  EXPECT_EQ(tok().eos_id(), kTinyBase + 2);  // <|im_end|>
  EXPECT_EQ(tok().pad_id(), kTinyBase + 255);
  EXPECT_EQ(tok().special_token_id("[EOS]"), kTinyBase + 1);
  EXPECT_EQ(tok().special_token_id("<|im_user|>"), kTinyBase + 3);
  EXPECT_EQ(tok().special_token_id("<|im_assistant|>"), kTinyBase + 4);
  EXPECT_EQ(tok().special_token_id("<|im_system|>"), kTinyBase + 10);
  EXPECT_EQ(tok().special_token_id("<|im_middle|>"), kTinyBase + 17);
  EXPECT_EQ(tok().special_token_id("[UNK]"), kTinyBase + 254);
  EXPECT_EQ(tok().special_token_id("<|reserved_token_1029|>"), kTinyBase + 5);
  EXPECT_EQ(tok().special_token_id("hello"), std::nullopt);
  EXPECT_EQ(tok().token_bytes(kTinyBase + 17), "<|im_middle|>");
  EXPECT_EQ(tok().token_bytes('A'), "A");  // byte tokens are ranks 0..255 in byte order
  EXPECT_EQ(tok().token_bytes(-1), std::nullopt);
  EXPECT_EQ(tok().token_bytes(tok().vocab_size()), std::nullopt);
  EXPECT_TRUE(tok().is_special(kTinyBase));
  EXPECT_FALSE(tok().is_special(kTinyBase - 1));
}

TEST_F(TinyTokenizerTest, HandwrittenStringsRoundTrip) {
  for (const std::string& s : handwritten_strings()) {
    for (SpecialTokens allow : {SpecialTokens::kNone, SpecialTokens::kAll}) {
      const std::vector<int32_t> ids = tok().encode(s, allow);
      EXPECT_EQ(tok().decode(ids), s) << "input: " << s;
      for (int32_t id : ids) ASSERT_TRUE(id >= 0 && id < tok().vocab_size());
    }
  }
  // The tiny vocabulary learned real merges: English text needs far fewer tokens than bytes.
  const std::string english = "The quick brown fox jumps over the lazy dog and the tokenizer";
  EXPECT_LT(tok().encode(english, SpecialTokens::kNone).size(), english.size() / 2);
}

TEST_F(TinyTokenizerTest, RandomBytesRoundTrip) {
  std::mt19937_64 rng(20240601);
  for (int i = 0; i < 3000; ++i) {
    const std::string s = random_bytes(rng, 96);
    const auto allow = i % 2 == 0 ? SpecialTokens::kNone : SpecialTokens::kAll;
    ASSERT_EQ(tok().decode(tok().encode(s, allow)), s) << "case " << i;
  }
}

TEST_F(TinyTokenizerTest, BpeMatchesReferenceImplementation) {
  std::vector<std::string> texts = handwritten_strings();
  texts.emplace_back(tiny_training_text());
  std::mt19937_64 rng(99);
  for (int i = 0; i < 500; ++i) texts.push_back(random_bytes(rng, 80));
  texts.push_back(std::string(2000, 'a'));  // long piece: exercises the heap path and equal-rank ties
  for (const std::string& text : texts) {
    ASSERT_EQ(tok().encode(text, SpecialTokens::kNone), reference_encode(tok(), text)) << "input: " << text;
  }
}

TEST_F(TinyTokenizerTest, LongInputsStayFast) {
  // Quadratic BPE on one 200 KB piece would take minutes; the heap merge takes milliseconds.
  const std::string letters(200000, 'x');
  const std::string spaces(200000, ' ');
  EXPECT_EQ(tok().decode(tok().encode(letters, SpecialTokens::kNone)), letters);
  EXPECT_EQ(tok().decode(tok().encode(spaces, SpecialTokens::kNone)), spaces);
}

TEST_F(TinyTokenizerTest, ChunksAreEncodedIndependently) {
  const std::string long_run(25001, 'x');
  std::vector<int32_t> expected = tok().encode(std::string(25000, 'x'), SpecialTokens::kNone);
  const std::vector<int32_t> tail = tok().encode("x", SpecialTokens::kNone);
  expected.insert(expected.end(), tail.begin(), tail.end());
  EXPECT_EQ(tok().encode(long_run, SpecialTokens::kNone), expected);
}

TEST_F(TinyTokenizerTest, SpecialTokensParsedOnlyWhenAllowed) {
  const std::string text = "<|im_user|>user<|im_middle|>hi<|im_end|>";
  const int32_t im_user = *tok().special_token_id("<|im_user|>");
  const int32_t im_middle = *tok().special_token_id("<|im_middle|>");
  const int32_t im_end = *tok().special_token_id("<|im_end|>");

  const std::vector<int32_t> all = tok().encode(text, SpecialTokens::kAll);
  ASSERT_GE(all.size(), 4u);
  EXPECT_EQ(all.front(), im_user);
  EXPECT_EQ(all.back(), im_end);
  EXPECT_NE(std::find(all.begin(), all.end(), im_middle), all.end());
  const std::vector<int32_t> user_ids = tok().encode("user", SpecialTokens::kNone);
  EXPECT_TRUE(std::equal(user_ids.begin(), user_ids.end(), all.begin() + 1));

  const std::vector<int32_t> none = tok().encode(text, SpecialTokens::kNone);
  for (int32_t id : none) EXPECT_FALSE(tok().is_special(id)) << id;
  EXPECT_EQ(tok().decode(none), text);
  EXPECT_EQ(tok().decode(all), text);

  // Reserved names parse too; an unterminated marker stays text.
  EXPECT_EQ(tok().encode("<|reserved_token_1100|>", SpecialTokens::kAll), std::vector<int32_t>{1100});
  for (int32_t id : tok().encode("<|im_end", SpecialTokens::kAll)) EXPECT_FALSE(tok().is_special(id));
}

TEST_F(TinyTokenizerTest, ConcurrentEncodeMatchesSerial) {
  std::vector<std::string> texts = handwritten_strings();
  std::mt19937_64 rng(17);
  for (int i = 0; i < 200; ++i) texts.push_back(random_bytes(rng, 128));
  std::vector<std::vector<int32_t>> expected;
  for (const std::string& t : texts) expected.push_back(tok().encode(t, SpecialTokens::kAll));

  std::atomic<int> mismatches{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (size_t i = 0; i < texts.size(); ++i) {
        if (tok().encode(texts[i], SpecialTokens::kAll) != expected[i]) mismatches.fetch_add(1);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(mismatches.load(), 0);
}

TEST_F(TinyTokenizerTest, OutOfRangeIdsInDecode) {
  const std::vector<int32_t> ids = {'h', -5, 'i', tok().vocab_size(), INT32_MAX};
  EXPECT_EQ(tok().decode(ids), "hi");  // skipped
  const auto checked = tok().decode_checked(ids);
  ASSERT_FALSE(checked.is_ok());
  EXPECT_EQ(checked.status().code(), StatusCode::kOutOfRange);
  EXPECT_NE(checked.status().message().find("token [1] = -5"), std::string::npos) << checked.status().message();
  const std::vector<int32_t> good = {'o', 'k', kTinyBase + 2};
  EXPECT_EQ(tok().decode_checked(good).value(), "ok<|im_end|>");
}

// ---- incremental decoding -------------------------------------------------------------------------

TEST_F(TinyTokenizerTest, IncrementalDecoderNeverSplitsCharacters) {
  std::vector<std::string> texts = handwritten_strings();
  std::mt19937_64 rng(5);
  for (int i = 0; i < 1000; ++i) texts.push_back(random_bytes(rng, 64));
  size_t held_back_seen = 0;
  for (const std::string& text : texts) {
    const std::vector<int32_t> ids = tok().encode(text, SpecialTokens::kAll);
    IncrementalDecoder decoder(tok());
    std::string streamed;
    for (int32_t id : ids) {
      const std::string chunk = decoder.push(id);
      ASSERT_TRUE(is_valid_utf8(chunk)) << "input: " << text;
      ASSERT_LE(decoder.pending_bytes(), 3u);
      held_back_seen += decoder.pending_bytes() > 0;
      streamed += chunk;
    }
    const std::string tail = decoder.flush();
    ASSERT_TRUE(is_valid_utf8(tail));
    streamed += tail;
    EXPECT_EQ(decoder.pending_bytes(), 0u);
    const std::string whole = tok().decode(ids);
    ASSERT_EQ(streamed, sanitize_utf8(whole)) << "input: " << text;
    if (is_valid_utf8(whole)) {
      ASSERT_EQ(streamed, whole);
    }
  }
  EXPECT_GT(held_back_seen, 0u);  // the tiny vocabulary does split multi-byte characters
}

TEST_F(TinyTokenizerTest, IncrementalDecoderHoldsBackThenCompletes) {
  IncrementalDecoder decoder(tok());
  // "中" = E4 B8 AD, fed one byte token at a time.
  EXPECT_EQ(decoder.push(0xE4), "");
  EXPECT_EQ(decoder.push(0xB8), "");
  EXPECT_EQ(decoder.pending_bytes(), 2u);
  EXPECT_EQ(decoder.push(0xAD), "中");
  // Proven invalid as soon as a non-continuation byte arrives.
  EXPECT_EQ(decoder.push(0xE4), "");
  EXPECT_EQ(decoder.push('a'),
            "\xEF\xBF\xBD"
            "a");
  // A truncated tail becomes U+FFFD only at flush.
  EXPECT_EQ(decoder.push(0xF0), "");
  EXPECT_EQ(decoder.flush(), "\xEF\xBF\xBD");
  const std::vector<int32_t> batch = {'o', 'k', -1, kTinyBase + 2};
  EXPECT_EQ(decoder.push(batch), "ok<|im_end|>");
}

// ---- chat template --------------------------------------------------------------------------------

TEST(ChatTemplateTest, ExactRendering) {
  const std::vector<ChatMessage> with_system = {
      {"system", "Be brief.", std::nullopt},
      {"user", "Hi", std::nullopt},
      {"assistant", "Hello!", std::nullopt},
      {"user", "2+2?", std::nullopt},
  };
  EXPECT_EQ(apply_chat_template(with_system, true).value(),
            "<|im_system|>system<|im_middle|>Be brief.<|im_end|>"
            "<|im_user|>user<|im_middle|>Hi<|im_end|>"
            "<|im_assistant|>assistant<|im_middle|>Hello!<|im_end|>"
            "<|im_user|>user<|im_middle|>2+2?<|im_end|>"
            "<|im_assistant|>assistant<|im_middle|>");

  const std::vector<ChatMessage> no_system = {{"user", "Hi", std::nullopt}};
  EXPECT_EQ(apply_chat_template(no_system, false).value(),
            "<|im_system|>system<|im_middle|>You are a helpful assistant<|im_end|>"
            "<|im_user|>user<|im_middle|>Hi<|im_end|>");

  const std::vector<ChatMessage> tool_turn = {
      {"user", "weather?", std::nullopt},
      {"tool", "{\"temp\": 21}", std::nullopt},
      {"tool", "sunny", std::string("get_weather")},
      {"user", "thanks", std::string("")},  // empty name: role text is used
  };
  EXPECT_EQ(apply_chat_template(tool_turn, true).value(),
            "<|im_system|>system<|im_middle|>You are a helpful assistant<|im_end|>"
            "<|im_user|>user<|im_middle|>weather?<|im_end|>"
            "<|im_system|>tool<|im_middle|>{\"temp\": 21}<|im_end|>"
            "<|im_system|>get_weather<|im_middle|>sunny<|im_end|>"
            "<|im_user|>user<|im_middle|>thanks<|im_end|>"
            "<|im_assistant|>assistant<|im_middle|>");

  EXPECT_EQ(apply_chat_template({}, true).value(), "<|im_assistant|>assistant<|im_middle|>");
  EXPECT_EQ(apply_chat_template({}, false).value(), "");
}

TEST(ChatTemplateTest, UnknownRoleIsInvalidArgument) {
  const std::vector<ChatMessage> messages = {{"user", "a", std::nullopt}, {"developer", "b", std::nullopt}};
  const auto rendered = apply_chat_template(messages, true);
  ASSERT_FALSE(rendered.is_ok());
  EXPECT_EQ(rendered.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(rendered.status().message().find("messages[1].role"), std::string::npos);
}

TEST_F(TinyTokenizerTest, ChatTemplateEncodesToControlTokens) {
  const std::vector<ChatMessage> messages = {{"user", "Hi", std::nullopt}};
  const std::string prompt = apply_chat_template(messages, true).value();
  const std::vector<int32_t> ids = tok().encode(prompt, SpecialTokens::kAll);
  EXPECT_EQ(ids.front(), *tok().special_token_id("<|im_system|>"));
  EXPECT_EQ(ids.back(), *tok().special_token_id("<|im_middle|>"));
  EXPECT_EQ(tok().decode(ids), prompt);
}

// ---- loading malformed files ----------------------------------------------------------------------

// A valid tiktoken.model with the 256 byte tokens, then `extra` lines appended.
std::string byte_model(const std::string& extra = "") {
  std::string model;
  for (int b = 0; b < 256; ++b)
    model += base64_encode(std::string(1, static_cast<char>(b))) + " " + std::to_string(b) + "\n";
  return model + extra;
}

constexpr std::string_view kMinimalConfig = "{}";

Result<Tokenizer> load_from(const TempDir& dir, std::string_view model, std::string_view config) {
  write_all(dir.path() / "tiktoken.model", model);
  write_all(dir.path() / "tokenizer_config.json", config);
  return Tokenizer::load(dir.path());
}

void expect_load_error(std::string_view model, std::string_view expected_location, std::string_view expected_what) {
  TempDir dir;
  const auto loaded = load_from(dir, model, kMinimalConfig);
  ASSERT_FALSE(loaded.is_ok()) << "expected failure: " << expected_what;
  const std::string& message = loaded.status().message();
  EXPECT_EQ(loaded.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(message.find((dir.path() / "tiktoken.model").string() + std::string(expected_location)), std::string::npos)
      << message;
  EXPECT_NE(message.find(expected_what), std::string::npos) << message;
}

TEST(TokenizerLoadTest, MinimalByteTokenizerLoads) {
  TempDir dir;
  const auto loaded = load_from(  // "aGk=" is "hi"
      dir, byte_model("aGk= 256\n"),
      R"({"added_tokens_decoder": {"257": {"content": "[BOS]", "special": true}}, "bos_token": "[BOS]"})");
  ASSERT_TRUE(loaded.is_ok()) << loaded.status().to_string();
  EXPECT_EQ(loaded->num_base_tokens(), 257);
  EXPECT_EQ(loaded->bos_id(), 257);
  EXPECT_EQ(loaded->eos_id(), std::nullopt);
  EXPECT_EQ(loaded->encode("hi", SpecialTokens::kNone), std::vector<int32_t>{256});
}

TEST(TokenizerLoadTest, MalformedModelFilesNameFileAndLine) {
  expect_load_error(byte_model("aGk 256\n"), ":257:", "bad base64");
  expect_load_error(byte_model("aGk= 256\naGo= 258\n"), ":258:", "rank 257 is missing");
  expect_load_error(byte_model("aGk= 255\n"), ":257:", "duplicate rank 255 (first on line 256)");
  expect_load_error(byte_model("YQ== 256\n"), ":257:", "duplicate token (same bytes as line 98)");
  expect_load_error(byte_model("aGk= 256 7\n"), ":257:", "exactly two fields");
  expect_load_error(byte_model("aGk= -3\n"), ":257:", "bad rank");
  expect_load_error(byte_model("aGk=\n"), ":257:", "expected");
  expect_load_error(byte_model("\n\n  \naGk 256\n"), ":260:", "bad base64");  // blank lines still count
}

TEST(TokenizerLoadTest, MissingByteTokenAndBadConfigAreErrors) {
  {
    TempDir dir;
    const auto loaded = load_from(dir, "YQ== 0\n", kMinimalConfig);
    ASSERT_FALSE(loaded.is_ok());
    EXPECT_NE(loaded.status().message().find("no single-byte token for byte 0x00"), std::string::npos);
  }
  {
    TempDir dir;
    const auto loaded = load_from(dir, byte_model(), R"({"added_tokens_decoder": {"9999": {"content": "[X]"}}})");
    ASSERT_FALSE(loaded.is_ok());
    EXPECT_NE(loaded.status().message().find("outside the special range"), std::string::npos)
        << loaded.status().message();
  }
  {
    TempDir dir;
    const auto loaded = load_from(dir, byte_model(), R"({"eos_token": "<|nope|>"})");
    ASSERT_FALSE(loaded.is_ok());
    EXPECT_NE(loaded.status().message().find("eos_token '<|nope|>'"), std::string::npos);
  }
  {
    TempDir dir;
    const auto loaded = load_from(dir, byte_model(), R"({"added_tokens_decoder": [}})");
    ASSERT_FALSE(loaded.is_ok());
    EXPECT_NE(loaded.status().message().find("tokenizer_config.json"), std::string::npos);
  }
  {
    TempDir dir;  // AddedToken objects for bos/eos, as older HF configs write them
    const auto loaded = load_from(dir, byte_model(),
                                  R"({"added_tokens_decoder": {"256": {"content": "[BOS]"}},
                                      "bos_token": {"__type": "AddedToken", "content": "[BOS]"}, "eos_token": null})");
    ASSERT_TRUE(loaded.is_ok()) << loaded.status().to_string();
    EXPECT_EQ(loaded->bos_id(), 256);
  }
  {
    TempDir dir;
    const auto loaded = Tokenizer::load(dir.path() / "absent");
    ASSERT_FALSE(loaded.is_ok());
    EXPECT_EQ(loaded.status().code(), StatusCode::kNotFound);
    EXPECT_NE(loaded.status().message().find("tiktoken.model"), std::string::npos);
  }
}

// ---- writer ---------------------------------------------------------------------------------------

TEST(TokenizerWriterTest, DeterministicAndSeedDependent) {
  TempDir a, b, c;
  ASSERT_TRUE(write_tiny_tokenizer(a.path(), 512, 3).is_ok());
  ASSERT_TRUE(write_tiny_tokenizer(b.path(), 512, 3).is_ok());
  ASSERT_TRUE(write_tiny_tokenizer(c.path(), 512, 4).is_ok());
  EXPECT_EQ(read_all(a.path() / "tiktoken.model"), read_all(b.path() / "tiktoken.model"));
  EXPECT_EQ(read_all(a.path() / "tokenizer_config.json"), read_all(b.path() / "tokenizer_config.json"));
  EXPECT_NE(read_all(a.path() / "tiktoken.model"), read_all(c.path() / "tiktoken.model"));

  const std::string model = read_all(a.path() / "tiktoken.model");
  EXPECT_EQ(std::count(model.begin(), model.end(), '\n'), 512);
  EXPECT_EQ(model.substr(0, 7), "AA== 0\n");  // byte tokens first, in byte order
  const auto loaded = Tokenizer::load(a.path());
  ASSERT_TRUE(loaded.is_ok()) << loaded.status().to_string();
  EXPECT_EQ(loaded->special_token_id("<|im_end|>"), 512 + 2);
  EXPECT_EQ(loaded->pad_id(), 512 + 255);
}

TEST(TokenizerWriterTest, RejectsImpossibleSizes) {
  EXPECT_EQ(train_tiny_bpe(100, 1).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(train_tiny_bpe(1 << 20, 1).status().code(), StatusCode::kInvalidArgument);
  const auto bytes_only = train_tiny_bpe(256, 1);
  ASSERT_TRUE(bytes_only.is_ok());
  EXPECT_EQ(bytes_only->size(), 256u);
}

}  // namespace
}  // namespace deltaserve::tokenizer
