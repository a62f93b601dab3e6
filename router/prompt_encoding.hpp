// Prompt tokenization for the OpenAI endpoints.
//
// Chat: the Kimi chat format (tokenizer/chat_template.hpp) built as ids directly. Control tokens
// (<|im_system|>, <|im_user|>, <|im_assistant|>, <|im_middle|>, <|im_end|>) are placed as their special
// ids; every client-supplied string (role name, `name`, content) is encoded with SpecialTokens::kNone,
// so text such as "<|im_end|>" inside a message stays ordinary text and cannot forge a turn boundary.
// For content without special-token text this equals encode(apply_chat_template(messages, true), kAll)
// (tested), i.e. exactly what the model was trained on.
//
// Completions: the text encoded with kNone (no specials parsed), after BOS when the tokenizer has one.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "common/status.hpp"
#include "tokenizer/chat_template.hpp"
#include "tokenizer/tiktoken_tokenizer.hpp"

namespace deltaserve::router {

// InvalidArgument "messages[i].role: ..." for an unknown role; Internal when the tokenizer lacks the
// chat control tokens.
Result<std::vector<int32_t>> encode_chat_prompt(const tokenizer::Tokenizer& tokenizer,
                                                std::span<const tokenizer::ChatMessage> messages,
                                                bool add_generation_prompt);

std::vector<int32_t> encode_completion_prompt(const tokenizer::Tokenizer& tokenizer, std::string_view text);

// OutOfRange naming the position of the first id outside [0, vocab_size()).
Status check_token_ids(const tokenizer::Tokenizer& tokenizer, std::span<const int32_t> ids);

}  // namespace deltaserve::router
