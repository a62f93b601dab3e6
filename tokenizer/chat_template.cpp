#include "tokenizer/chat_template.hpp"

namespace deltaserve::tokenizer {
namespace {

constexpr std::string_view kImSystem = "<|im_system|>";
constexpr std::string_view kImUser = "<|im_user|>";
constexpr std::string_view kImAssistant = "<|im_assistant|>";
constexpr std::string_view kImMiddle = "<|im_middle|>";
constexpr std::string_view kImEnd = "<|im_end|>";

// The opening role token for `role`, or empty for an unknown role.
std::string_view role_token(std::string_view role) {
  if (role == "system" || role == "tool") return kImSystem;
  if (role == "user") return kImUser;
  if (role == "assistant") return kImAssistant;
  return {};
}

void append_message(std::string& out, std::string_view role_token, std::string_view header, std::string_view content) {
  out.append(role_token).append(header).append(kImMiddle).append(content).append(kImEnd);
}

}  // namespace

Result<std::string> apply_chat_template(std::span<const ChatMessage> messages, bool add_generation_prompt) {
  size_t size = 64;
  for (size_t i = 0; i < messages.size(); ++i) {
    if (role_token(messages[i].role).empty()) {
      return invalid_argument("messages[" + std::to_string(i) + "].role: unknown role '" + messages[i].role +
                              "' (expected system, user, assistant or tool)");
    }
    size += messages[i].content.size() + 48;
  }

  std::string out;
  out.reserve(size + kDefaultSystemPrompt.size());
  if (!messages.empty() && messages.front().role != "system") {
    append_message(out, kImSystem, "system", kDefaultSystemPrompt);
  }
  for (const ChatMessage& m : messages) {
    const std::string_view header = m.name && !m.name->empty() ? std::string_view(*m.name) : m.role;
    append_message(out, role_token(m.role), header, m.content);
  }
  if (add_generation_prompt) out.append(kImAssistant).append("assistant").append(kImMiddle);
  return out;
}

}  // namespace deltaserve::tokenizer
