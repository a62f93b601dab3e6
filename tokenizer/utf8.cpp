#include "tokenizer/utf8.hpp"

#include <cstdint>

namespace deltaserve::tokenizer {

Utf8Step utf8_step(std::string_view text) {
  const auto byte = [&](size_t i) { return static_cast<uint8_t>(text[i]); };
  const uint8_t lead = byte(0);
  if (lead < 0x80) return {Utf8Step::Kind::kValid, 1};

  // Expected length and the allowed range of the second byte (Unicode Table 3-7).
  size_t length = 0;
  uint8_t second_lo = 0x80, second_hi = 0xBF;
  if (lead >= 0xC2 && lead <= 0xDF) {
    length = 2;
  } else if (lead == 0xE0) {
    length = 3, second_lo = 0xA0;
  } else if ((lead >= 0xE1 && lead <= 0xEC) || lead == 0xEE || lead == 0xEF) {
    length = 3;
  } else if (lead == 0xED) {
    length = 3, second_hi = 0x9F;  // excludes surrogates
  } else if (lead == 0xF0) {
    length = 4, second_lo = 0x90;
  } else if (lead >= 0xF1 && lead <= 0xF3) {
    length = 4;
  } else if (lead == 0xF4) {
    length = 4, second_hi = 0x8F;  // nothing above U+10FFFF
  } else {
    return {Utf8Step::Kind::kInvalid, 1};  // continuation byte, C0/C1 or F5..FF as a lead
  }

  for (size_t i = 1; i < length; ++i) {
    if (i >= text.size()) return {Utf8Step::Kind::kIncomplete, i};
    const uint8_t b = byte(i);
    const uint8_t lo = i == 1 ? second_lo : 0x80;
    const uint8_t hi = i == 1 ? second_hi : 0xBF;
    if (b < lo || b > hi) return {Utf8Step::Kind::kInvalid, i};
  }
  return {Utf8Step::Kind::kValid, length};
}

size_t valid_utf8_prefix_length(std::string_view text) {
  size_t pos = 0;
  while (pos < text.size()) {
    // ASCII fast path.
    if (static_cast<uint8_t>(text[pos]) < 0x80) {
      ++pos;
      continue;
    }
    const Utf8Step step = utf8_step(text.substr(pos));
    if (step.kind != Utf8Step::Kind::kValid) break;
    pos += step.length;
  }
  return pos;
}

bool is_valid_utf8(std::string_view text) {
  return valid_utf8_prefix_length(text) == text.size();
}

char32_t decode_code_point(std::string_view character) {
  const auto byte = [&](size_t i) { return static_cast<char32_t>(static_cast<uint8_t>(character[i])); };
  switch (character.size()) {
    case 1:
      return byte(0);
    case 2:
      return ((byte(0) & 0x1F) << 6) | (byte(1) & 0x3F);
    case 3:
      return ((byte(0) & 0x0F) << 12) | ((byte(1) & 0x3F) << 6) | (byte(2) & 0x3F);
    default:
      return ((byte(0) & 0x07) << 18) | ((byte(1) & 0x3F) << 12) | ((byte(2) & 0x3F) << 6) | (byte(3) & 0x3F);
  }
}

std::string sanitize_utf8(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  size_t pos = 0;
  while (pos < text.size()) {
    const Utf8Step step = utf8_step(text.substr(pos));
    if (step.kind == Utf8Step::Kind::kValid) {
      out.append(text.substr(pos, step.length));
    } else {
      out.append(kReplacementCharacter);
    }
    pos += step.length;
  }
  return out;
}

}  // namespace deltaserve::tokenizer
