#include "router/prompt_encoding.hpp"

#include <optional>
#include <string>

namespace deltaserve::router {
namespace {

struct ChatControlIds {
  int32_t im_system, im_user, im_assistant, im_middle, im_end;
};

std::optional<ChatControlIds> chat_control_ids(const tokenizer::Tokenizer& tokenizer) {
  const auto system = tokenizer.special_token_id("<|im_system|>");
  const auto user = tokenizer.special_token_id("<|im_user|>");
  const auto assistant = tokenizer.special_token_id("<|im_assistant|>");
  const auto middle = tokenizer.special_token_id("<|im_middle|>");
  const auto end = tokenizer.special_token_id("<|im_end|>");
  if (!system || !user || !assistant || !middle || !end) return std::nullopt;
  return ChatControlIds{*system, *user, *assistant, *middle, *end};
}

void append(std::vector<int32_t>& out, const std::vector<int32_t>& ids) {
  out.insert(out.end(), ids.begin(), ids.end());
}

}  // namespace

Result<std::vector<int32_t>> encode_chat_prompt(const tokenizer::Tokenizer& tokenizer,
                                                std::span<const tokenizer::ChatMessage> messages,
                                                bool add_generation_prompt) {
  const auto control = chat_control_ids(tokenizer);
  if (!control) return internal_error("the tokenizer has no Kimi chat control tokens (<|im_system|>, ...)");
  using tokenizer::SpecialTokens;
  std::vector<int32_t> ids;
  auto add_turn = [&](int32_t header, std::string_view role_text, std::string_view content) {
    ids.push_back(header);
    append(ids, tokenizer.encode(role_text, SpecialTokens::kNone));
    ids.push_back(control->im_middle);
    append(ids, tokenizer.encode(content, SpecialTokens::kNone));
    ids.push_back(control->im_end);
  };
  if (!messages.empty() && messages.front().role != "system") {
    add_turn(control->im_system, "system", tokenizer::kDefaultSystemPrompt);
  }
  for (size_t i = 0; i < messages.size(); ++i) {
    const tokenizer::ChatMessage& message = messages[i];
    int32_t header = 0;
    if (message.role == "system" || message.role == "tool") {
      header = control->im_system;
    } else if (message.role == "user") {
      header = control->im_user;
    } else if (message.role == "assistant") {
      header = control->im_assistant;
    } else {
      return invalid_argument("messages[" + std::to_string(i) + "].role: must be one of system, user, assistant, tool");
    }
    const std::string_view role_text =
        message.name.has_value() && !message.name->empty() ? std::string_view(*message.name) : message.role;
    add_turn(header, role_text, message.content);
  }
  if (add_generation_prompt) {
    ids.push_back(control->im_assistant);
    append(ids, tokenizer.encode("assistant", SpecialTokens::kNone));
    ids.push_back(control->im_middle);
  }
  return ids;
}

std::vector<int32_t> encode_completion_prompt(const tokenizer::Tokenizer& tokenizer, std::string_view text) {
  std::vector<int32_t> ids;
  if (const auto bos = tokenizer.bos_id()) ids.push_back(*bos);
  append(ids, tokenizer.encode(text, tokenizer::SpecialTokens::kNone));
  return ids;
}

Status check_token_ids(const tokenizer::Tokenizer& tokenizer, std::span<const int32_t> ids) {
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= tokenizer.vocab_size()) {
      return out_of_range("token id " + std::to_string(ids[i]) + " at position " + std::to_string(i) +
                          " is outside the vocabulary [0, " + std::to_string(tokenizer.vocab_size()) + ")");
    }
  }
  return Status::ok();
}

}  // namespace deltaserve::router
