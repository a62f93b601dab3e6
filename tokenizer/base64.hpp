// Standard base64 (RFC 4648 §4, '+' '/' with '=' padding), as used by tiktoken.model files.
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace deltaserve::tokenizer {

std::string base64_encode(std::string_view bytes);

// Strict: length a multiple of 4, alphabet characters only, '=' only as the last one or two characters.
// nullopt on any violation.
std::optional<std::string> base64_decode(std::string_view text);

}  // namespace deltaserve::tokenizer
