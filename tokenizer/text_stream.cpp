#include "tokenizer/text_stream.hpp"

#include <algorithm>
#include <string_view>
#include <utility>

#include "tokenizer/utf8.hpp"

namespace deltaserve::tokenizer {

TextStream::TextStream(const Tokenizer& tokenizer, std::vector<std::string> stop)
    : decoder_(tokenizer), tokenizer_(&tokenizer) {
  for (std::string& s : stop) {
    if (!s.empty() && is_valid_utf8(s)) stop_.push_back(std::move(s));
  }
}

TextStream::Output TextStream::push(int32_t token) {
  if (stopped_ || finished_) return {};
  if (tokenizer_->is_special(token)) return {};
  return take(decoder_.push(token), /*final=*/false);
}

std::string TextStream::finish() {
  if (stopped_ || finished_) return {};
  finished_ = true;
  return take(decoder_.flush(), /*final=*/true).text;
}

TextStream::Output TextStream::take(std::string text, bool final) {
  held_ += text;
  // Everything emitted so far was proven not to start a stop string, so every occurrence starts in
  // held_. Find the smallest end of an occurrence; among the stop strings ending there, the longest
  // starts first.
  const std::string_view held = held_;
  size_t best_end = std::string_view::npos, best_start = 0;
  for (const std::string& s : stop_) {
    const size_t at = held.find(s);
    if (at == std::string_view::npos) continue;
    const size_t end = at + s.size();
    if (best_end == std::string_view::npos || end < best_end || (end == best_end && at < best_start)) {
      best_end = end;
      best_start = at;
    }
  }
  Output out;
  if (best_end != std::string_view::npos) {
    out.text = held_.substr(0, best_start);
    out.stopped = true;
    stopped_ = true;
    held_.clear();
    return out;
  }
  if (final) {
    out.text = std::move(held_);
    held_.clear();
    return out;
  }
  // Hold back the longest suffix that a stop string starts with. A valid UTF-8 stop string starts with
  // a lead byte, so the cut falls on a character boundary.
  size_t keep_from = held.size();
  for (size_t p = 0; p < held.size() && keep_from == held.size(); ++p) {
    const std::string_view tail = held.substr(p);
    for (const std::string& s : stop_) {
      if (s.size() > tail.size() && std::string_view(s).starts_with(tail)) {
        keep_from = p;
        break;
      }
    }
  }
  out.text = held_.substr(0, keep_from);
  held_.erase(0, keep_from);
  return out;
}

}  // namespace deltaserve::tokenizer
