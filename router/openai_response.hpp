// The OpenAI response schema: JSON bodies (non-streaming), SSE events (streaming) and /v1/models.
//
// Streaming (text/event-stream): every event is "data: <json>\n\n"; the stream ends with
// "data: [DONE]\n\n". Per choice, the first event carries delta.role "assistant" (chat), later ones only
// delta.content; finish_reason is null until the choice's final event. With include_usage every chunk
// carries "usage": null and one last chunk has "choices": [] and the usage. A failure after the first
// byte is one event "data: {"error": {...}}\n\n" and the stream is closed without [DONE].
//
// Logprobs: chat → choices[].logprobs.content[] = {token, logprob, bytes, top_logprobs[{token, logprob,
// bytes}]}; completions → choices[].logprobs = {tokens, token_logprobs, top_logprobs [{token: logprob}],
// text_offset}. `token` is the token's bytes as text (invalid UTF-8 replaced by U+FFFD), `bytes` the raw
// bytes; text_offset counts bytes of the completion text from 0 (echo is not supported).
//
// Usage: prompt_tokens once per request (not per choice), completion_tokens summed over choices,
// prompt_tokens_details.cached_tokens the most any choice reused (<= prompt_tokens).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "router/errors.hpp"
#include "router/inference_service.hpp"
#include "router/openai_request.hpp"
#include "tokenizer/tiktoken_tokenizer.hpp"

namespace deltaserve::router {

struct ModelInfo {
  std::string id;
  int64_t context_length = 0;
  int64_t created_unix = 0;
  std::string owned_by = "deltaserve";
};

// GET /v1/models: {"object": "list", "data": [{"id", "object": "model", "created", "owned_by", "max_model_len"}]}
std::string models_json(const ModelInfo& model);

struct Usage {
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;
  int64_t cached_tokens = 0;
};

struct ResponseContext {
  Endpoint endpoint = Endpoint::kChatCompletions;
  std::string id;  // "chatcmpl-..." / "cmpl-..."
  int64_t created = 0;
  std::string model;
  bool logprobs = false;
  bool include_usage = false;                       // streaming only
  const tokenizer::Tokenizer* tokenizer = nullptr;  // for logprob token texts; must outlive the formatter
};

// One finished choice of a non-streaming response.
struct ChoiceOutput {
  std::string text;
  std::vector<TokenLogprobs> logprobs;
  std::string finish_reason;
};

// The whole non-streaming body ("chat.completion" / "text_completion").
std::string completion_json(const ResponseContext& context, std::span<const ChoiceOutput> choices, const Usage& usage);

// Formats one streamed response; keeps per-choice state (first event sent, text offset).
class StreamFormatter {
 public:
  StreamFormatter(ResponseContext context, int choices);

  // The events for one chunk of choice `index` (empty when it carries nothing to say: no text, no
  // logprobs, not the first and not final). Errors are not formatted here (see error_event).
  std::string on_chunk(int index, const GenerationChunk& chunk);

  // The usage chunk (only when include_usage).
  std::string usage_event(const Usage& usage) const;

  static std::string done_event() { return "data: [DONE]\n\n"; }
  static std::string error_event(const ApiError& error);

 private:
  ResponseContext context_;
  std::vector<bool> started_;
  std::vector<int64_t> text_offset_;
};

// "data: " + json + "\n\n".
std::string sse_event(const std::string& json);

}  // namespace deltaserve::router
