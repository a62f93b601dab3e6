// A small JSON value, parser and writer for the layers that may use only the standard library
// (engine/, kernels/, tokenizer/): config.json, safetensors headers, tokenizer_config.json.
// The cluster layers use nlohmann-json; this one exists so the engine builds with nvcc alone.
//
// Contract: strict RFC 8259 (no comments, no trailing commas, no NaN), UTF-8 validated in strings,
// \uXXXX escapes incl. surrogate pairs, nesting depth limited to kMaxDepth. Objects keep insertion
// order; duplicate keys are an error (a checkpoint header with two entries for one tensor is corrupt).
// Numbers keep whether they were written as integers, so 64-bit offsets survive exactly; an integer outside
// int64 becomes a double, and a number outside double range (overflow or underflow) is an error.
// Number parsing is locale-independent. Duplicate detection is O(1) per key, so a safetensors index with
// 10^5 entries parses in linear time (lookup with find() stays linear: build a map for repeated lookups).
#pragma once

#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_set>
#include <utility>
#include <variant>
#include <vector>

#include "common/status.hpp"

namespace deltaserve::json {

// Maximum nesting of arrays/objects in a document: "[[1]]" has depth 2.
inline constexpr int kMaxDepth = 256;

class Value;
using Array = std::vector<Value>;
using Object = std::vector<std::pair<std::string, Value>>;

class Value {
 public:
  enum class Kind { kNull, kBool, kInt, kDouble, kString, kArray, kObject };

  Value() = default;
  Value(std::nullptr_t) {}                                                 // NOLINT
  Value(bool b) : kind_(Kind::kBool), bool_(b) {}                          // NOLINT
  Value(int v) : kind_(Kind::kInt), int_(v) {}                             // NOLINT
  Value(int64_t v) : kind_(Kind::kInt), int_(v) {}                         // NOLINT
  Value(uint64_t v) : kind_(Kind::kInt), int_(static_cast<int64_t>(v)) {}  // NOLINT
  Value(double v) : kind_(Kind::kDouble), double_(v) {}                    // NOLINT
  Value(std::string s) : kind_(Kind::kString), string_(std::move(s)) {}    // NOLINT
  Value(const char* s) : kind_(Kind::kString), string_(s) {}               // NOLINT
  Value(std::string_view s) : kind_(Kind::kString), string_(s) {}          // NOLINT

  static Value object() {
    Value v;
    v.kind_ = Kind::kObject;
    return v;
  }
  static Value array() {
    Value v;
    v.kind_ = Kind::kArray;
    return v;
  }

  Kind kind() const { return kind_; }
  bool is_null() const { return kind_ == Kind::kNull; }
  bool is_bool() const { return kind_ == Kind::kBool; }
  bool is_int() const { return kind_ == Kind::kInt; }
  bool is_number() const { return kind_ == Kind::kInt || kind_ == Kind::kDouble; }
  bool is_string() const { return kind_ == Kind::kString; }
  bool is_array() const { return kind_ == Kind::kArray; }
  bool is_object() const { return kind_ == Kind::kObject; }

  // Accessors: callers check the kind first; on a wrong kind they return a neutral value.
  bool as_bool() const { return kind_ == Kind::kBool && bool_; }
  // A double converts by truncation toward zero, saturating at the int64 range (no UB for 1e300).
  int64_t as_int() const {
    if (kind_ == Kind::kInt) return int_;
    if (kind_ != Kind::kDouble || std::isnan(double_)) return 0;
    if (double_ >= 9223372036854775807.0) return INT64_MAX;
    if (double_ <= -9223372036854775808.0) return INT64_MIN;
    return static_cast<int64_t>(double_);
  }
  double as_double() const { return kind_ == Kind::kInt ? static_cast<double>(int_) : double_; }
  const std::string& as_string() const { return string_; }
  const Array& as_array() const { return array_; }
  const Object& as_object() const { return object_; }
  Array& as_array() { return array_; }
  Object& as_object() { return object_; }

  // Object lookup; nullptr when absent or not an object.
  const Value* find(std::string_view key) const {
    if (kind_ != Kind::kObject) return nullptr;
    for (const auto& [k, v] : object_)
      if (k == key) return &v;
    return nullptr;
  }
  // Object insert-or-get (turns a null into an object).
  Value& operator[](std::string_view key) {
    if (kind_ == Kind::kNull) kind_ = Kind::kObject;
    for (auto& [k, v] : object_)
      if (k == key) return v;
    object_.emplace_back(std::string(key), Value());
    return object_.back().second;
  }
  void push_back(Value v) {
    if (kind_ == Kind::kNull) kind_ = Kind::kArray;
    array_.push_back(std::move(v));
  }
  size_t size() const { return kind_ == Kind::kArray ? array_.size() : kind_ == Kind::kObject ? object_.size() : 0; }

  // Serialises compactly (indent < 0) or pretty-printed with `indent` spaces.
  std::string dump(int indent = -1) const {
    std::string out;
    dump_to(out, indent, 0);
    return out;
  }

 private:
  static void dump_string(std::string& out, const std::string& s) {
    out.push_back('"');
    for (unsigned char c : s) {
      switch (c) {
        case '"':
          out += "\\\"";
          break;
        case '\\':
          out += "\\\\";
          break;
        case '\n':
          out += "\\n";
          break;
        case '\r':
          out += "\\r";
          break;
        case '\t':
          out += "\\t";
          break;
        case '\b':
          out += "\\b";
          break;
        case '\f':
          out += "\\f";
          break;
        default:
          if (c < 0x20) {
            char buf[8];
            std::snprintf(buf, sizeof(buf), "\\u%04x", c);
            out += buf;
          } else {
            out.push_back(static_cast<char>(c));
          }
      }
    }
    out.push_back('"');
  }

  static void newline(std::string& out, int indent, int depth) {
    if (indent < 0) return;
    out.push_back('\n');
    out.append(static_cast<size_t>(indent * depth), ' ');
  }

  void dump_to(std::string& out, int indent, int depth) const {
    switch (kind_) {
      case Kind::kNull:
        out += "null";
        break;
      case Kind::kBool:
        out += bool_ ? "true" : "false";
        break;
      case Kind::kInt:
        out += std::to_string(int_);
        break;
      case Kind::kDouble: {
        if (!std::isfinite(double_)) {
          out += "null";  // JSON has no NaN/Inf
          break;
        }
        char buf[32];
        auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), double_);
        std::string_view text(buf, static_cast<size_t>(end - buf));
        out += text;
        if (ec == std::errc() && text.find_first_of(".eE") == std::string_view::npos) out += ".0";
        break;
      }
      case Kind::kString:
        dump_string(out, string_);
        break;
      case Kind::kArray: {
        out.push_back('[');
        for (size_t i = 0; i < array_.size(); ++i) {
          if (i) out.push_back(',');
          newline(out, indent, depth + 1);
          array_[i].dump_to(out, indent, depth + 1);
        }
        if (!array_.empty()) newline(out, indent, depth);
        out.push_back(']');
        break;
      }
      case Kind::kObject: {
        out.push_back('{');
        for (size_t i = 0; i < object_.size(); ++i) {
          if (i) out.push_back(',');
          newline(out, indent, depth + 1);
          dump_string(out, object_[i].first);
          out += indent < 0 ? ":" : ": ";
          object_[i].second.dump_to(out, indent, depth + 1);
        }
        if (!object_.empty()) newline(out, indent, depth);
        out.push_back('}');
        break;
      }
    }
  }

  Kind kind_ = Kind::kNull;
  bool bool_ = false;
  int64_t int_ = 0;
  double double_ = 0.0;
  std::string string_;
  Array array_;
  Object object_;
};

namespace detail {

class Parser {
 public:
  static constexpr int kMaxDepth = json::kMaxDepth;
  explicit Parser(std::string_view text) : text_(text) {}

  Result<Value> parse_document() {
    skip_ws();
    Value v;
    Status s = parse_value(v, 0);
    if (!s.is_ok()) return s;
    skip_ws();
    if (pos_ != text_.size()) return error("unexpected trailing characters");
    return v;
  }

 private:
  Status error(const std::string& what) const {
    return invalid_argument("JSON parse error at byte " + std::to_string(pos_) + ": " + what);
  }
  void skip_ws() {
    while (pos_ < text_.size() &&
           (text_[pos_] == ' ' || text_[pos_] == '\t' || text_[pos_] == '\n' || text_[pos_] == '\r'))
      ++pos_;
  }
  bool consume(std::string_view lit) {
    if (text_.substr(pos_, lit.size()) == lit) {
      pos_ += lit.size();
      return true;
    }
    return false;
  }

  // `depth` = number of arrays/objects enclosing this value.
  Status parse_value(Value& out, int depth) {
    if (pos_ >= text_.size()) return error("unexpected end of input");
    char c = text_[pos_];
    if ((c == '{' || c == '[') && depth >= kMaxDepth) return error("nesting deeper than " + std::to_string(kMaxDepth));
    if (c == '{') return parse_object(out, depth);
    if (c == '[') return parse_array(out, depth);
    if (c == '"') {
      std::string s;
      DS_RETURN_IF_ERROR(parse_string(s));
      out = Value(std::move(s));
      return Status::ok();
    }
    if (consume("true")) {
      out = Value(true);
      return Status::ok();
    }
    if (consume("false")) {
      out = Value(false);
      return Status::ok();
    }
    if (consume("null")) {
      out = Value(nullptr);
      return Status::ok();
    }
    if (c == '-' || (c >= '0' && c <= '9')) return parse_number(out);
    return error(std::string("unexpected character '") + c + "'");
  }

  Status parse_object(Value& out, int depth) {
    ++pos_;  // '{'
    out = Value::object();
    skip_ws();
    if (pos_ < text_.size() && text_[pos_] == '}') {
      ++pos_;
      return Status::ok();
    }
    // Small objects check duplicates by scanning; past kScanLimit keys a hash set takes over, so an
    // object with n keys costs O(n), not O(n^2) (a K3 index.json maps ~250k tensor names).
    constexpr size_t kScanLimit = 16;
    std::unordered_set<std::string> seen;
    while (true) {
      skip_ws();
      if (pos_ >= text_.size() || text_[pos_] != '"') return error("expected object key string");
      std::string key;
      DS_RETURN_IF_ERROR(parse_string(key));
      Object& members = out.as_object();
      if (members.size() == kScanLimit)
        for (const auto& member : members) seen.insert(member.first);
      const bool duplicate = members.size() < kScanLimit ? out.find(key) != nullptr : !seen.insert(key).second;
      if (duplicate) return error("duplicate key \"" + key + "\"");
      skip_ws();
      if (pos_ >= text_.size() || text_[pos_] != ':') return error("expected ':' after key");
      ++pos_;
      skip_ws();
      Value v;
      DS_RETURN_IF_ERROR(parse_value(v, depth + 1));
      out.as_object().emplace_back(std::move(key), std::move(v));
      skip_ws();
      if (pos_ < text_.size() && text_[pos_] == ',') {
        ++pos_;
        continue;
      }
      if (pos_ < text_.size() && text_[pos_] == '}') {
        ++pos_;
        return Status::ok();
      }
      return error("expected ',' or '}' in object");
    }
  }

  Status parse_array(Value& out, int depth) {
    ++pos_;  // '['
    out = Value::array();
    skip_ws();
    if (pos_ < text_.size() && text_[pos_] == ']') {
      ++pos_;
      return Status::ok();
    }
    while (true) {
      skip_ws();
      Value v;
      DS_RETURN_IF_ERROR(parse_value(v, depth + 1));
      out.as_array().push_back(std::move(v));
      skip_ws();
      if (pos_ < text_.size() && text_[pos_] == ',') {
        ++pos_;
        continue;
      }
      if (pos_ < text_.size() && text_[pos_] == ']') {
        ++pos_;
        return Status::ok();
      }
      return error("expected ',' or ']' in array");
    }
  }

  static void append_utf8(std::string& s, uint32_t cp) {
    if (cp < 0x80) {
      s.push_back(static_cast<char>(cp));
    } else if (cp < 0x800) {
      s.push_back(static_cast<char>(0xC0 | (cp >> 6)));
      s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else if (cp < 0x10000) {
      s.push_back(static_cast<char>(0xE0 | (cp >> 12)));
      s.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else {
      s.push_back(static_cast<char>(0xF0 | (cp >> 18)));
      s.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
      s.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
  }

  Status parse_hex4(uint32_t& out) {
    if (pos_ + 4 > text_.size()) return error("truncated \\u escape");
    out = 0;
    for (int i = 0; i < 4; ++i) {
      char c = text_[pos_++];
      out <<= 4;
      if (c >= '0' && c <= '9')
        out |= static_cast<uint32_t>(c - '0');
      else if (c >= 'a' && c <= 'f')
        out |= static_cast<uint32_t>(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F')
        out |= static_cast<uint32_t>(c - 'A' + 10);
      else
        return error("bad hex digit in \\u escape");
    }
    return Status::ok();
  }

  // Length of the valid UTF-8 sequence starting at text_[pos_], or 0 if invalid.
  size_t utf8_length() const {
    auto b = [&](size_t i) { return static_cast<unsigned char>(text_[pos_ + i]); };
    size_t left = text_.size() - pos_;
    unsigned char c0 = b(0);
    auto cont = [&](size_t i) { return i < left && (b(i) & 0xC0) == 0x80; };
    if (c0 >= 0xC2 && c0 <= 0xDF) return cont(1) ? 2 : 0;
    if (c0 >= 0xE0 && c0 <= 0xEF) {
      if (!cont(1) || !cont(2)) return 0;
      if (c0 == 0xE0 && b(1) < 0xA0) return 0;   // overlong
      if (c0 == 0xED && b(1) >= 0xA0) return 0;  // surrogates
      return 3;
    }
    if (c0 >= 0xF0 && c0 <= 0xF4) {
      if (!cont(1) || !cont(2) || !cont(3)) return 0;
      if (c0 == 0xF0 && b(1) < 0x90) return 0;
      if (c0 == 0xF4 && b(1) >= 0x90) return 0;
      return 4;
    }
    return 0;
  }

  Status parse_string(std::string& out) {
    ++pos_;  // opening quote
    while (true) {
      if (pos_ >= text_.size()) return error("unterminated string");
      unsigned char c = static_cast<unsigned char>(text_[pos_]);
      if (c == '"') {
        ++pos_;
        return Status::ok();
      }
      if (c < 0x20) return error("control character in string");
      if (c == '\\') {
        ++pos_;
        if (pos_ >= text_.size()) return error("unterminated escape");
        char e = text_[pos_++];
        switch (e) {
          case '"':
            out.push_back('"');
            break;
          case '\\':
            out.push_back('\\');
            break;
          case '/':
            out.push_back('/');
            break;
          case 'b':
            out.push_back('\b');
            break;
          case 'f':
            out.push_back('\f');
            break;
          case 'n':
            out.push_back('\n');
            break;
          case 'r':
            out.push_back('\r');
            break;
          case 't':
            out.push_back('\t');
            break;
          case 'u': {
            uint32_t cp = 0;
            DS_RETURN_IF_ERROR(parse_hex4(cp));
            if (cp >= 0xD800 && cp <= 0xDBFF) {
              if (!consume("\\u")) return error("unpaired high surrogate");
              uint32_t lo = 0;
              DS_RETURN_IF_ERROR(parse_hex4(lo));
              if (lo < 0xDC00 || lo > 0xDFFF) return error("invalid low surrogate");
              cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
            } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
              return error("unpaired low surrogate");
            }
            append_utf8(out, cp);
            break;
          }
          default:
            return error(std::string("bad escape '\\") + e + "'");
        }
        continue;
      }
      if (c < 0x80) {
        out.push_back(static_cast<char>(c));
        ++pos_;
        continue;
      }
      size_t n = utf8_length();
      if (n == 0) return error("invalid UTF-8 in string");
      out.append(text_.substr(pos_, n));
      pos_ += n;
    }
  }

  Status parse_number(Value& out) {
    size_t start = pos_;
    bool is_integer = true;
    if (text_[pos_] == '-') ++pos_;
    if (pos_ >= text_.size()) return error("truncated number");
    if (text_[pos_] == '0') {
      ++pos_;
    } else if (text_[pos_] >= '1' && text_[pos_] <= '9') {
      while (pos_ < text_.size() && text_[pos_] >= '0' && text_[pos_] <= '9') ++pos_;
    } else {
      return error("bad number");
    }
    if (pos_ < text_.size() && text_[pos_] == '.') {
      is_integer = false;
      ++pos_;
      size_t digits = pos_;
      while (pos_ < text_.size() && text_[pos_] >= '0' && text_[pos_] <= '9') ++pos_;
      if (pos_ == digits) return error("bad number: no digits after '.'");
    }
    if (pos_ < text_.size() && (text_[pos_] == 'e' || text_[pos_] == 'E')) {
      is_integer = false;
      ++pos_;
      if (pos_ < text_.size() && (text_[pos_] == '+' || text_[pos_] == '-')) ++pos_;
      size_t digits = pos_;
      while (pos_ < text_.size() && text_[pos_] >= '0' && text_[pos_] <= '9') ++pos_;
      if (pos_ == digits) return error("bad number: empty exponent");
    }
    std::string_view num = text_.substr(start, pos_ - start);
    if (is_integer) {
      int64_t v = 0;
      auto [end, ec] = std::from_chars(num.data(), num.data() + num.size(), v);
      if (ec == std::errc() && end == num.data() + num.size()) {
        out = Value(v);
        return Status::ok();
      }
      // Out of int64 range: fall through to double.
    }
    // from_chars, not strtod: strtod follows the C locale (LC_NUMERIC "de_DE" reads "1.5" as 1).
    double d = 0.0;
    auto [end, ec] = std::from_chars(num.data(), num.data() + num.size(), d);
    if (ec == std::errc::result_out_of_range) return error("number out of double range");
    if (ec != std::errc() || end != num.data() + num.size()) return error("bad number");
    out = Value(d);
    return Status::ok();
  }

  std::string_view text_;
  size_t pos_ = 0;
};

}  // namespace detail

inline Result<Value> parse(std::string_view text) {
  return detail::Parser(text).parse_document();
}

}  // namespace deltaserve::json
