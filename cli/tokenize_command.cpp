#include <ostream>

#include <nlohmann/json.hpp>

#include "cli/commands.hpp"
#include "tokenizer/chat_template.hpp"
#include "tokenizer/tiktoken_tokenizer.hpp"

namespace deltaserve::cli {

int run_tokenize(const TokenizeOptions& options, std::ostream& out, std::ostream& err) {
  auto dir = resolve_model_dir(options.model);
  if (!dir.is_ok()) {
    err << "error: " << dir.status().message() << "\n";
    return 1;
  }
  auto tok = tokenizer::Tokenizer::load(*dir);
  if (!tok.is_ok()) {
    err << "error: " << tok.status().message() << "\n";
    return 1;
  }
  std::vector<int32_t> ids;
  if (options.chat) {
    const tokenizer::ChatMessage message{"user", options.text, std::nullopt};
    auto text = tokenizer::apply_chat_template({&message, 1}, /*add_generation_prompt=*/true);
    if (!text.is_ok()) {
      err << "error: " << text.status().message() << "\n";
      return 1;
    }
    ids = tok->encode(*text, tokenizer::SpecialTokens::kAll);
  } else {
    ids =
        tok->encode(options.text, options.specials ? tokenizer::SpecialTokens::kAll : tokenizer::SpecialTokens::kNone);
  }
  out << nlohmann::json(ids).dump() << "\n";
  return 0;
}

}  // namespace deltaserve::cli
