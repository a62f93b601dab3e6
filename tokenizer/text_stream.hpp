// Per-request text output: incremental detokenization plus stop strings. Tokens go in one at a time;
// text comes out that is valid UTF-8, never contains a stop string, and is never taken back. Text
// that could be the beginning of a stop string is held back until it is proven not to be.
//
// Exactly: let T be the text of the tokens pushed so far, sanitize_utf8(decode(non-special ids))
// (special tokens produce no text, as OpenAI-compatible servers skip them; ids outside the vocabulary
// are skipped, as Tokenizer::decode does). The stream stops at the first point of T where a stop
// string ends, and its whole output is T up to the start of the longest stop string ending there
// (the stop string itself is never emitted). Equivalently: the output is the shortest prefix of T that
// contains a stop string, cut at the first occurrence of a stop string in it. This depends on the text
// only, not on how it is split into tokens; generation can stop at the token that completes a stop
// string. (It differs from "cut T at the first occurrence" only when one stop string occurs inside
// another and ends first: stops {"abcd", "bc"} on "xabcd" give "xa".) Without a stop, the output after
// finish() is T.
//
// Held back at any time: at most the decoder's 0..3 bytes of an incomplete character, plus the longest
// suffix of the text that is a proper prefix of a stop string (so < the longest stop string).
// Not thread-safe: one stream per request.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tokenizer/incremental_decoder.hpp"
#include "tokenizer/tiktoken_tokenizer.hpp"

namespace deltaserve::tokenizer {

class TextStream {
 public:
  // `tokenizer` must outlive the stream. Stop strings that are empty or not valid UTF-8 are ignored
  // (the text is UTF-8 and a stop string must match whole characters). Duplicates are harmless.
  TextStream(const Tokenizer& tokenizer, std::vector<std::string> stop);

  struct Output {
    std::string text;      // newly final text (may be empty); valid UTF-8
    bool stopped = false;  // a stop string was completed; nothing more will be emitted
  };

  // Feeds one generated token. After the stream stopped (or finished), returns empty output.
  Output push(int32_t token);

  // End of generation without a stop token: everything held back (a truncated final character becomes
  // U+FFFD), cut before a stop string if that text completes one (then stopped() turns true). Later
  // calls of push() and finish() return nothing.
  std::string finish();

  bool stopped() const { return stopped_; }

 private:
  // Appends `text` to held_ and emits what is final: up to a completed stop string (stopping), or
  // everything when `final`, else all but a possible stop-string prefix.
  Output take(std::string text, bool final);

  IncrementalDecoder decoder_;
  std::vector<std::string> stop_;  // non-empty, valid UTF-8
  std::string held_;               // decoded text not yet emitted (a possible stop-string prefix)
  bool stopped_ = false;
  bool finished_ = false;  // finish() was called
  const Tokenizer* tokenizer_;
};

}  // namespace deltaserve::tokenizer
