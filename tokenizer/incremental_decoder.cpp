#include "tokenizer/incremental_decoder.hpp"

#include "tokenizer/utf8.hpp"

namespace deltaserve::tokenizer {

std::string IncrementalDecoder::push(int32_t id) {
  if (const auto bytes = tokenizer_->token_bytes(id)) pending_.append(*bytes);
  return drain(/*final=*/false);
}

std::string IncrementalDecoder::push(std::span<const int32_t> ids) {
  for (int32_t id : ids) {
    if (const auto bytes = tokenizer_->token_bytes(id)) pending_.append(*bytes);
  }
  return drain(/*final=*/false);
}

std::string IncrementalDecoder::flush() {
  return drain(/*final=*/true);
}

std::string IncrementalDecoder::drain(bool final) {
  std::string out;
  out.reserve(pending_.size());
  const std::string_view bytes = pending_;
  size_t pos = 0;
  while (pos < bytes.size()) {
    const Utf8Step step = utf8_step(bytes.substr(pos));
    if (step.kind == Utf8Step::Kind::kIncomplete && !final) break;  // wait for the rest
    if (step.kind == Utf8Step::Kind::kValid) {
      out.append(bytes.substr(pos, step.length));
    } else {
      out.append(kReplacementCharacter);
    }
    pos += step.length;
  }
  pending_.erase(0, pos);
  return out;
}

}  // namespace deltaserve::tokenizer
