// Per-request text output: incremental detokenization plus stop strings. Tokens go in one at a time;
// text comes out that is valid UTF-8, never contains (or starts) a stop string, and is never taken
// back. Text that could be the beginning of a stop string is held back until it is proven not to be.
// Special tokens produce no text (as OpenAI-compatible servers skip them).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tokenizer/incremental_decoder.hpp"
#include "tokenizer/tiktoken_tokenizer.hpp"

namespace deltaserve::tokenizer {

class TextStream {
 public:
  // `tokenizer` must outlive the stream. Empty stop strings are ignored.
  TextStream(const Tokenizer& tokenizer, std::vector<std::string> stop);

  struct Output {
    std::string text;      // newly final text (may be empty)
    bool stopped = false;  // a stop string was completed; nothing more will be emitted
  };

  // Feeds one generated token. After `stopped`, further calls return empty output.
  Output push(int32_t token);

  // End of generation without a stop string (max_tokens, eos): everything held back.
  std::string finish();

  bool stopped() const { return stopped_; }

 private:
  IncrementalDecoder decoder_;
  std::vector<std::string> stop_;
  std::string held_;  // decoded text not yet emitted (a possible stop-string prefix)
  bool stopped_ = false;
  const Tokenizer* tokenizer_;
};

}  // namespace deltaserve::tokenizer
