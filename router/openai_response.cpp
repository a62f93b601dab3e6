#include "router/openai_response.hpp"

#include <nlohmann/json.hpp>

#include "tokenizer/utf8.hpp"

namespace deltaserve::router {
namespace {

using Json = nlohmann::ordered_json;

std::string dump(const Json& value) {
  return value.dump(-1, ' ', false, Json::error_handler_t::replace);
}

std::string_view raw_token(const tokenizer::Tokenizer& tokenizer, int32_t id) {
  return tokenizer.token_bytes(id).value_or(std::string_view());
}

Json bytes_of(std::string_view raw) {
  Json bytes = Json::array();
  for (const char c : raw) bytes.push_back(static_cast<int>(static_cast<uint8_t>(c)));
  return bytes;
}

// Chat: {"content": [{token, logprob, bytes, top_logprobs}]}.
Json chat_logprobs(const tokenizer::Tokenizer& tokenizer, std::span<const TokenLogprobs> logprobs) {
  Json content = Json::array();
  for (const TokenLogprobs& entry : logprobs) {
    const std::string_view raw = raw_token(tokenizer, entry.token);
    Json item;
    item["token"] = tokenizer::sanitize_utf8(raw);
    item["logprob"] = entry.logprob;
    item["bytes"] = bytes_of(raw);
    Json top = Json::array();
    for (const engine::TokenLogprob& alternative : entry.top) {
      const std::string_view alt_raw = raw_token(tokenizer, alternative.token);
      Json alt;
      alt["token"] = tokenizer::sanitize_utf8(alt_raw);
      alt["logprob"] = alternative.logprob;
      alt["bytes"] = bytes_of(alt_raw);
      top.push_back(std::move(alt));
    }
    item["top_logprobs"] = std::move(top);
    content.push_back(std::move(item));
  }
  Json out;
  out["content"] = std::move(content);
  return out;
}

// Completions: {tokens, token_logprobs, top_logprobs, text_offset}; advances `text_offset`.
Json completion_logprobs(const tokenizer::Tokenizer& tokenizer, std::span<const TokenLogprobs> logprobs,
                         int64_t& text_offset) {
  Json tokens = Json::array(), token_logprobs = Json::array(), top_logprobs = Json::array(), offsets = Json::array();
  for (const TokenLogprobs& entry : logprobs) {
    const std::string_view raw = raw_token(tokenizer, entry.token);
    tokens.push_back(tokenizer::sanitize_utf8(raw));
    token_logprobs.push_back(entry.logprob);
    Json top = Json::object();
    for (const engine::TokenLogprob& alternative : entry.top) {
      top[tokenizer::sanitize_utf8(raw_token(tokenizer, alternative.token))] = alternative.logprob;
    }
    top_logprobs.push_back(std::move(top));
    offsets.push_back(text_offset);
    text_offset += static_cast<int64_t>(raw.size());
  }
  Json out;
  out["tokens"] = std::move(tokens);
  out["token_logprobs"] = std::move(token_logprobs);
  out["top_logprobs"] = std::move(top_logprobs);
  out["text_offset"] = std::move(offsets);
  return out;
}

Json usage_json(const Usage& usage) {
  Json out;
  out["prompt_tokens"] = usage.prompt_tokens;
  out["completion_tokens"] = usage.completion_tokens;
  out["total_tokens"] = usage.prompt_tokens + usage.completion_tokens;
  Json details;
  details["cached_tokens"] = usage.cached_tokens;
  out["prompt_tokens_details"] = std::move(details);
  return out;
}

Json envelope(const ResponseContext& context, const char* object) {
  Json out;
  out["id"] = context.id;
  out["object"] = object;
  out["created"] = context.created;
  out["model"] = context.model;
  return out;
}

bool is_chat(const ResponseContext& context) {
  return context.endpoint == Endpoint::kChatCompletions;
}

}  // namespace

std::string sse_event(const std::string& json) {
  return "data: " + json + "\n\n";
}

std::string models_json(const ModelInfo& model) {
  Json entry;
  entry["id"] = model.id;
  entry["object"] = "model";
  entry["created"] = model.created_unix;
  entry["owned_by"] = model.owned_by;
  entry["max_model_len"] = model.context_length;
  Json out;
  out["object"] = "list";
  out["data"] = Json::array({std::move(entry)});
  return dump(out);
}

std::string completion_json(const ResponseContext& context, std::span<const ChoiceOutput> choices, const Usage& usage) {
  const bool chat = is_chat(context);
  Json out = envelope(context, chat ? "chat.completion" : "text_completion");
  Json list = Json::array();
  for (size_t i = 0; i < choices.size(); ++i) {
    const ChoiceOutput& choice = choices[i];
    Json item;
    item["index"] = i;
    if (chat) {
      Json message;
      message["role"] = "assistant";
      message["content"] = choice.text;
      item["message"] = std::move(message);
    } else {
      item["text"] = choice.text;
    }
    if (context.logprobs && context.tokenizer != nullptr) {
      int64_t offset = 0;
      item["logprobs"] = chat ? chat_logprobs(*context.tokenizer, choice.logprobs)
                              : completion_logprobs(*context.tokenizer, choice.logprobs, offset);
    } else {
      item["logprobs"] = nullptr;
    }
    item["finish_reason"] = choice.finish_reason;
    list.push_back(std::move(item));
  }
  out["choices"] = std::move(list);
  out["usage"] = usage_json(usage);
  return dump(out);
}

StreamFormatter::StreamFormatter(ResponseContext context, int choices)
    : context_(std::move(context)),
      started_(static_cast<size_t>(choices), false),
      text_offset_(static_cast<size_t>(choices), 0) {}

std::string StreamFormatter::on_chunk(int index, const GenerationChunk& chunk) {
  const auto at = static_cast<size_t>(index);
  const bool first = !started_.at(at);
  const bool has_logprobs = context_.logprobs && !chunk.logprobs.empty();
  if (!first && !chunk.finish_reason && chunk.text.empty() && !has_logprobs) return {};
  started_[at] = true;
  const bool chat = is_chat(context_);
  Json out = envelope(context_, chat ? "chat.completion.chunk" : "text_completion");
  Json item;
  item["index"] = index;
  if (chat) {
    Json delta = Json::object();
    if (first) delta["role"] = "assistant";
    if (first || !chunk.text.empty()) delta["content"] = chunk.text;
    item["delta"] = std::move(delta);
  } else {
    item["text"] = chunk.text;
  }
  if (has_logprobs && context_.tokenizer != nullptr) {
    item["logprobs"] = chat ? chat_logprobs(*context_.tokenizer, chunk.logprobs)
                            : completion_logprobs(*context_.tokenizer, chunk.logprobs, text_offset_[at]);
  } else {
    item["logprobs"] = nullptr;
  }
  item["finish_reason"] = chunk.finish_reason ? Json(*chunk.finish_reason) : Json(nullptr);
  out["choices"] = Json::array({std::move(item)});
  if (context_.include_usage) out["usage"] = nullptr;
  return sse_event(dump(out));
}

std::string StreamFormatter::usage_event(const Usage& usage) const {
  Json out = envelope(context_, is_chat(context_) ? "chat.completion.chunk" : "text_completion");
  out["choices"] = Json::array();
  out["usage"] = usage_json(usage);
  return sse_event(dump(out));
}

std::string StreamFormatter::error_event(const ApiError& error) {
  return sse_event(error_json(error));
}

}  // namespace deltaserve::router
