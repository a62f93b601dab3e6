// UTF-8 scanning shared by the pre-tokenizer (which must only hand valid UTF-8 to Oniguruma) and the
// streaming decoder (which must never emit a split or invalid character).
//
// "Valid" means RFC 3629 UTF-8: no overlong forms, no surrogates (U+D800..U+DFFF), nothing above
// U+10FFFF. Invalid input is replaced per the Unicode "maximal subpart" practice (one U+FFFD per
// maximal prefix of a well-formed sequence, or per lone bad byte), the same as Python's
// bytes.decode("utf-8", "replace") and the WHATWG decoder.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace deltaserve::tokenizer {

inline constexpr std::string_view kReplacementCharacter = "\xEF\xBF\xBD";  // U+FFFD

// Outcome of looking at the bytes starting at one position.
struct Utf8Step {
  enum class Kind {
    kValid,       // `length` bytes form one well-formed character
    kInvalid,     // `length` bytes (>= 1) are a maximal ill-formed subpart: replace them by one U+FFFD
    kIncomplete,  // all `length` bytes so far are a valid prefix but the input ends before the character
  };
  Kind kind;
  size_t length;
};

// Classifies the character starting at text[0]. Precondition: !text.empty().
Utf8Step utf8_step(std::string_view text);

// Length of the longest prefix of `text` made of complete valid characters.
size_t valid_utf8_prefix_length(std::string_view text);

bool is_valid_utf8(std::string_view text);

// Code point of one well-formed character (`character` = exactly the bytes of a kValid step).
char32_t decode_code_point(std::string_view character);

// `text` with every maximal ill-formed subpart (incl. a truncated final character) replaced by U+FFFD.
// Equals `text` when it is valid.
std::string sanitize_utf8(std::string_view text);

}  // namespace deltaserve::tokenizer
