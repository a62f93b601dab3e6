// The OpenAI request schema: JSON bodies of POST /v1/completions and POST /v1/chat/completions parsed
// and validated into a typed request, then turned into one GenerationRequest per choice.
//
// Accepted fields (others, e.g. `tools`, `response_format`, `metadata`, are ignored as OpenAI ignores
// unknown fields):
//   model                      string, required; must equal the served model's id (404 model_not_found)
//   messages (chat)            non-empty list of {role: system|user|assistant|tool, content: string |
//                              [{type: "text", text}] | null, name?: string}
//   prompt (completions)       string | [string] (one only) | [token id, ...] | [[token id, ...]] (one only)
//   n                          1..8; choice i is request "<id>-<i>" with seed + i
//   stream, stream_options.include_usage      bool
//   stop                       string | [string] (<= 4)
//   max_tokens, max_completion_tokens         >= 1 (max_completion_tokens wins); default 16 for
//                              completions, the rest of the context for chat
//   temperature [0, 2], top_p (0, 1], top_k >= 0 (-1 = off; extension), seed (integer; random when absent)
//   logprobs                   chat: bool, with top_logprobs 0..20; completions: integer 0..5
//   presence_penalty, frequency_penalty       accepted only when 0 (not implemented: 400 otherwise)
//   user                       string (not logged); ignore_eos bool (extension, as vLLM)
//   echo, suffix, best_of > 1, logit_bias (non-empty)   400: not supported
// Every error names the field in `param` (400 invalid_request_error); nothing here touches the model.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "router/errors.hpp"
#include "router/inference_service.hpp"
#include "tokenizer/chat_template.hpp"
#include "tokenizer/tiktoken_tokenizer.hpp"

namespace deltaserve::router {

enum class Endpoint { kCompletions, kChatCompletions };

inline constexpr int kMaxChoices = 8;
inline constexpr int kMaxStopStrings = 4;
inline constexpr int kMaxChatTopLogprobs = 20;
inline constexpr int kMaxCompletionLogprobs = 5;
inline constexpr int64_t kDefaultCompletionMaxTokens = 16;

struct OpenAiRequest {
  Endpoint endpoint = Endpoint::kChatCompletions;
  std::string model;
  std::vector<tokenizer::ChatMessage> messages;       // chat only
  std::optional<std::string> prompt_text;             // completions: the prompt as text
  std::optional<std::vector<int32_t>> prompt_tokens;  // completions: the prompt as ids (>= 0; vocabulary checked later)
  int n = 1;
  bool stream = false;
  bool include_usage = false;
  std::vector<std::string> stop;
  std::optional<int64_t> max_tokens;
  float temperature = 1.0f;
  float top_p = 1.0f;
  int32_t top_k = 0;
  std::optional<uint64_t> seed;
  bool logprobs = false;     // chat: logprobs; completions: logprobs given (an integer)
  int32_t top_logprobs = 0;  // chat: top_logprobs; completions: the logprobs integer
  std::string user;
  bool ignore_eos = false;
};

// Parses and validates a body. Returns the error (400 with param), or nullopt with `out` filled.
// Never throws, for any bytes.
std::optional<ApiError> parse_openai_request(Endpoint endpoint, std::string_view body, OpenAiRequest& out);

// What the HTTP layer submits for one request: the tokenized prompt and one GenerationRequest per choice.
struct GenerationPlan {
  std::vector<int32_t> prompt;
  int64_t max_tokens = 0;
  std::vector<GenerationRequest> choices;  // size n, request_id "<response_id>-<index>"
};

struct PlanOptions {
  int64_t context_length = 0;           // prompt + max_tokens must not exceed it
  std::string response_id;              // "chatcmpl-..." / "cmpl-..."
  std::string tenant;                   // authenticated tenant
  std::string cache_namespace;          // the tenant's prefix-cache namespace (from auth)
  uint64_t random_seed = 0;             // used when the request has no seed
  std::vector<int32_t> stop_token_ids;  // the model's end-of-sequence ids
  int64_t arrival_ns = 0;
};

// Tokenizes the prompt (see prompt_encoding.hpp), applies max_tokens defaults and the context check
// (400 context_length_exceeded, param messages/prompt), and fills one request per choice.
std::optional<ApiError> plan_generation(const OpenAiRequest& request, const tokenizer::Tokenizer& tokenizer,
                                        const PlanOptions& options, GenerationPlan& out);

}  // namespace deltaserve::router
