// Tests of common/json.hpp (header-only, so its test lives with its first user, the engine).
#include "common/json.hpp"

#include <cstdint>
#include <string>

#include <gtest/gtest.h>

namespace deltaserve::json {
namespace {

Value parse_ok(std::string_view text) {
  auto v = parse(text);
  EXPECT_TRUE(v.is_ok()) << text << " -> " << v.status().to_string();
  return v.is_ok() ? *v : Value();
}

// The error message for `text`, which must fail with InvalidArgument.
std::string parse_error(std::string_view text) {
  auto v = parse(text);
  EXPECT_FALSE(v.is_ok()) << "accepted: " << text;
  if (v.is_ok()) return "";
  EXPECT_EQ(v.status().code(), StatusCode::kInvalidArgument);
  return v.status().message();
}

std::string nested_arrays(int depth) {
  return std::string(static_cast<size_t>(depth), '[') + std::string(static_cast<size_t>(depth), ']');
}

TEST(JsonTest, ParsesValidDocuments) {
  const Value v = parse_ok(R"( {"a": [1, -2, 3.5, -0.25e2, true, false, null], "b": {"c": "d"}, "e": {}, "f": []} )");
  ASSERT_TRUE(v.is_object());
  const Value* a = v.find("a");
  ASSERT_NE(a, nullptr);
  ASSERT_EQ(a->size(), 7u);
  EXPECT_TRUE(a->as_array()[0].is_int());
  EXPECT_EQ(a->as_array()[1].as_int(), -2);
  EXPECT_FALSE(a->as_array()[2].is_int());
  EXPECT_DOUBLE_EQ(a->as_array()[2].as_double(), 3.5);
  EXPECT_DOUBLE_EQ(a->as_array()[3].as_double(), -25.0);
  EXPECT_TRUE(a->as_array()[4].as_bool());
  EXPECT_TRUE(a->as_array()[5].is_bool());
  EXPECT_TRUE(a->as_array()[6].is_null());
  EXPECT_EQ(v.find("b")->find("c")->as_string(), "d");
  EXPECT_EQ(v.find("e")->size(), 0u);
  EXPECT_EQ(v.find("missing"), nullptr);
  EXPECT_EQ(a->find("x"), nullptr);  // find on a non-object
  // Scalars as whole documents, insertion order kept.
  EXPECT_EQ(parse_ok("42").as_int(), 42);
  EXPECT_EQ(parse_ok("\"s\"").as_string(), "s");
  const Value ordered = parse_ok(R"({"z": 1, "a": 2, "m": 3})");
  EXPECT_EQ(ordered.as_object()[0].first, "z");
  EXPECT_EQ(ordered.as_object()[2].first, "m");
}

TEST(JsonTest, ReportsEveryErrorKind) {
  EXPECT_NE(parse_error("").find("unexpected end of input"), std::string::npos);
  EXPECT_NE(parse_error("[1] x").find("trailing"), std::string::npos);
  EXPECT_NE(parse_error("{1: 2}").find("expected object key"), std::string::npos);
  EXPECT_NE(parse_error(R"({"a" 1})").find("expected ':'"), std::string::npos);
  EXPECT_NE(parse_error(R"({"a": 1,})").find("expected object key"), std::string::npos);  // trailing comma
  EXPECT_NE(parse_error(R"({"a": 1 "b": 2})").find("expected ',' or '}'"), std::string::npos);
  EXPECT_NE(parse_error("[1 2]").find("expected ',' or ']'"), std::string::npos);
  EXPECT_NE(parse_error("[1,]").find("unexpected character"), std::string::npos);
  EXPECT_NE(parse_error("tru").find("unexpected character"), std::string::npos);
  EXPECT_NE(parse_error("NaN").find("unexpected character"), std::string::npos);
  EXPECT_NE(parse_error("// c\n1").find("unexpected character"), std::string::npos);
  EXPECT_NE(parse_error("\"abc").find("unterminated string"), std::string::npos);
  EXPECT_NE(parse_error("\"a\nb\"").find("control character"), std::string::npos);
  EXPECT_NE(parse_error(R"("\q")").find("bad escape"), std::string::npos);
  EXPECT_NE(parse_error(R"("\u12")").find("\\u escape"), std::string::npos);
  EXPECT_NE(parse_error(R"("\u12G4")").find("bad hex digit"), std::string::npos);
  EXPECT_NE(parse_error("-").find("truncated number"), std::string::npos);
  EXPECT_NE(parse_error("-a").find("bad number"), std::string::npos);
  EXPECT_NE(parse_error("1.").find("no digits after '.'"), std::string::npos);
  EXPECT_NE(parse_error("1e+").find("empty exponent"), std::string::npos);
  EXPECT_NE(parse_error("01").find("trailing"), std::string::npos);  // no leading zeros
  EXPECT_NE(parse_error("+1").find("unexpected character"), std::string::npos);
  EXPECT_NE(parse_error("1e400").find("out of double range"), std::string::npos);
  EXPECT_NE(parse_error("-1e400").find("out of double range"), std::string::npos);
  // The byte offset is reported.
  EXPECT_NE(parse_error("[1, 2, x]").find("at byte 7"), std::string::npos);
}

TEST(JsonTest, KeepsInt64Exactly) {
  EXPECT_EQ(parse_ok("9223372036854775807").as_int(), INT64_MAX);
  EXPECT_EQ(parse_ok("-9223372036854775808").as_int(), INT64_MIN);
  EXPECT_EQ(parse_ok("[123456789012345678]").as_array()[0].as_int(), 123456789012345678);
  // Past int64: a double, and as_int saturates instead of overflowing (UB before).
  const Value big = parse_ok("9223372036854775808");
  EXPECT_FALSE(big.is_int());
  EXPECT_DOUBLE_EQ(big.as_double(), 9223372036854775808.0);
  EXPECT_EQ(big.as_int(), INT64_MAX);
  EXPECT_EQ(parse_ok("-1e300").as_int(), INT64_MIN);
  EXPECT_EQ(parse_ok("2.9").as_int(), 2);
  EXPECT_EQ(Value(int64_t{1} << 62).dump(), "4611686018427387904");
}

TEST(JsonTest, DecodesEscapesAndSurrogates) {
  EXPECT_EQ(parse_ok(R"("a\"b\\c\/d\b\f\n\r\t")").as_string(), "a\"b\\c/d\b\f\n\r\t");
  EXPECT_EQ(parse_ok(R"("\u0041\u00e9\u20ac")").as_string(), "A\xC3\xA9\xE2\x82\xAC");
  EXPECT_EQ(parse_ok(R"("\ud83d\ude00")").as_string(), "\xF0\x9F\x98\x80");  // U+1F600
  EXPECT_EQ(parse_ok(R"("\uDBFF\uDFFF")").as_string(), "\xF4\x8F\xBF\xBF");  // U+10FFFF
  EXPECT_NE(parse_error(R"("\ud83d")").find("unpaired high surrogate"), std::string::npos);
  EXPECT_NE(parse_error(R"("\ud83dx")").find("unpaired high surrogate"), std::string::npos);
  EXPECT_NE(parse_error(R"("\ud83d\u0041")").find("invalid low surrogate"), std::string::npos);
  EXPECT_NE(parse_error(R"("\ude00")").find("unpaired low surrogate"), std::string::npos);
}

TEST(JsonTest, ValidatesUtf8) {
  EXPECT_EQ(parse_ok("\"\xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80\"").as_string(), "\xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80");
  for (const char* bad : {"\"\x80\"",              // lone continuation byte
                          "\"\xC3\"",              // truncated 2-byte sequence
                          "\"\xC0\xAF\"",          // overlong '/'
                          "\"\xE0\x80\xAF\"",      // overlong 3-byte
                          "\"\xED\xA0\x80\"",      // UTF-8-encoded surrogate
                          "\"\xF4\x90\x80\x80\"",  // above U+10FFFF
                          "\"\xF0\x9F\x98\"",      // truncated 4-byte sequence
                          "\"\xFF\""}) {
    EXPECT_NE(parse_error(bad).find("invalid UTF-8"), std::string::npos) << bad;
  }
}

TEST(JsonTest, LimitsDepth) {
  EXPECT_TRUE(parse(nested_arrays(kMaxDepth)).is_ok());
  EXPECT_NE(parse_error(nested_arrays(kMaxDepth + 1)).find("nesting deeper than"), std::string::npos);
  std::string objects;
  for (int i = 0; i <= kMaxDepth; ++i) objects += "{\"a\":";
  objects += "1" + std::string(static_cast<size_t>(kMaxDepth + 1), '}');
  EXPECT_NE(parse_error(objects).find("nesting deeper than"), std::string::npos);
  // Deep input far past the limit fails without exhausting the stack.
  EXPECT_FALSE(parse(std::string(100000, '[')).is_ok());
}

TEST(JsonTest, RejectsDuplicateKeys) {
  EXPECT_NE(parse_error(R"({"a": 1, "b": 2, "a": 3})").find("duplicate key \"a\""), std::string::npos);
  EXPECT_NE(parse_error(R"({"a": 1, "\u0061": 2})").find("duplicate key"), std::string::npos);  // after unescaping
  // Large objects (hash-set path): a duplicate of an early key and of a late key are both caught.
  std::string big = "{";
  for (int i = 0; i < 1000; ++i) big += (i ? ",\"k" : "\"k") + std::to_string(i) + "\":" + std::to_string(i);
  EXPECT_EQ(parse_ok(big + "}").size(), 1000u);
  EXPECT_NE(parse_error(big + ",\"k3\":0}").find("duplicate key \"k3\""), std::string::npos);
  EXPECT_NE(parse_error(big + ",\"k999\":0}").find("duplicate key \"k999\""), std::string::npos);
  // Same key in different objects is fine.
  EXPECT_TRUE(parse(R"({"a": {"a": 1}, "b": {"a": 2}})").is_ok());
}

TEST(JsonTest, ParsesLargeObjectsInLinearTime) {
  // 200k keys, as in a K3 model.safetensors.index.json; quadratic duplicate checks took minutes.
  std::string big = "{";
  for (int i = 0; i < 200000; ++i) big += (i ? ",\"t" : "\"t") + std::to_string(i) + "\":1";
  big += "}";
  const Value v = parse_ok(big);
  EXPECT_EQ(v.size(), 200000u);
}

TEST(JsonTest, DumpRoundTrips) {
  const std::string text =
      R"({"s":"q\"\\\n\t\u0001é😀","i":-9223372036854775808,"d":0.1,"e":1e-05,"big":1e+300,"w":2.0,)"
      R"("b":[true,false,null],"o":{"x":[],"y":{}}})";
  const Value v = parse_ok(text);
  for (int indent : {-1, 0, 2}) {
    const std::string dumped = v.dump(indent);
    const Value again = parse_ok(dumped);
    EXPECT_EQ(again.dump(), v.dump()) << dumped;
  }
  EXPECT_EQ(v.find("d")->dump(), "0.1");
  EXPECT_EQ(v.find("w")->dump(), "2.0");  // stays a double
  EXPECT_EQ(v.find("i")->dump(), "-9223372036854775808");
  EXPECT_EQ(parse_ok(v.find("s")->dump()).as_string(), v.find("s")->as_string());
  EXPECT_EQ(Value(std::string("\x01")).dump(), "\"\\u0001\"");
  EXPECT_EQ(parse_ok("[1,{\"a\":2}]").dump(2), "[\n  1,\n  {\n    \"a\": 2\n  }\n]");
  // Building values programmatically.
  Value built;
  built["k"] = Value::array();
  built["k"].push_back(1);
  built["k"].push_back("two");
  EXPECT_EQ(built.dump(), R"({"k":[1,"two"]})");
}

}  // namespace
}  // namespace deltaserve::json
