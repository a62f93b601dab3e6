// The Kimi chat format (moonshotai Kimi K2 / Kimi Linear chat_template.jinja), rendered in C++.
//
//   [<|im_system|>system<|im_middle|>You are a helpful assistant<|im_end|>]   when messages[0] is not system
//   for each message: <|im_X|>{name or role}<|im_middle|>{content}<|im_end|>
//       X = system for "system" and "tool", user for "user", assistant for "assistant"
//   [<|im_assistant|>assistant<|im_middle|>]                                    when add_generation_prompt
//
// No separators or newlines between messages; content is copied verbatim (not trimmed, not escaped).
// An empty message list renders no default system message (the Jinja loop body never runs).
// Not rendered (the struct does not carry them): tool declarations (`tools`), assistant tool_calls,
// the "## Return of {tool_call_id}" prefix of tool results in the K2-0905 template, image parts.
//
// The rendered string contains special-token text: encode it with SpecialTokens::kAll, and encode any
// untrusted content separately with kNone if it must not be able to forge control tokens.
#pragma once

#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "common/status.hpp"

namespace deltaserve::tokenizer {

inline constexpr std::string_view kDefaultSystemPrompt = "You are a helpful assistant";

struct ChatMessage {
  std::string role;  // "system" | "user" | "assistant" | "tool"
  std::string content;
  std::optional<std::string> name;  // replaces the role text in the header when set and non-empty
};

// InvalidArgument "messages[i].role: ..." for an unknown role.
Result<std::string> apply_chat_template(std::span<const ChatMessage> messages, bool add_generation_prompt);

}  // namespace deltaserve::tokenizer
