#include <chrono>
#include <ostream>

#include <nlohmann/json.hpp>

#include "cli/commands.hpp"
#include "engine/model.hpp"
#include "engine/open_model.hpp"
#include "engine/sampler.hpp"
#include "tokenizer/chat_template.hpp"
#include "tokenizer/incremental_decoder.hpp"
#include "tokenizer/tiktoken_tokenizer.hpp"
#include "tokenizer/utf8.hpp"

namespace deltaserve::cli {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// One token in the shape of OpenAI's chat `logprobs.content[]` entry.
nlohmann::json token_entry(const tokenizer::Tokenizer& tok, int32_t id, float logprob) {
  const std::string bytes(tok.token_bytes(id).value_or(""));
  nlohmann::json entry;
  entry["token"] = tokenizer::sanitize_utf8(bytes);  // a token may hold part of a character
  entry["logprob"] = logprob;
  nlohmann::json raw = nlohmann::json::array();
  for (unsigned char c : bytes) raw.push_back(static_cast<int>(c));
  entry["bytes"] = raw;
  return entry;
}

}  // namespace

int run_generate(const GenerateOptions& options, std::ostream& out, std::ostream& err) {
  auto fail = [&](const Status& status) {
    err << "error: " << status.message() << "\n";
    return 1;
  };
  auto dir = resolve_model_dir(options.model);
  if (!dir.is_ok()) return fail(dir.status());
  auto model = engine::open_model(*dir, options.device,
                                  engine::progress_printer(err, "loading weights to " + options.device.device));
  if (!model.is_ok()) return fail(model.status());
  auto tok = tokenizer::Tokenizer::load(*dir);
  if (!tok.is_ok()) return fail(tok.status().with_context("tokenizer in " + dir->string()));
  const engine::ModelConfig& config = (*model)->config();

  engine::SamplingParams params;
  params.temperature = options.temperature;
  params.top_p = options.top_p;
  params.top_k = options.top_k;
  params.seed = options.seed;
  params.top_logprobs = std::max<int32_t>(0, options.logprobs);
  if (Status s = engine::validate(params); !s.is_ok()) return fail(s);
  if (options.max_tokens < 0) return fail(invalid_argument("--max-tokens must be >= 0"));

  std::vector<int32_t> prompt;
  if (options.chat) {
    const tokenizer::ChatMessage message{"user", options.prompt, std::nullopt};
    auto text = tokenizer::apply_chat_template({&message, 1}, /*add_generation_prompt=*/true);
    if (!text.is_ok()) return fail(text.status());
    prompt = tok->encode(*text, tokenizer::SpecialTokens::kAll);
  } else {
    prompt = tok->encode(options.prompt, tokenizer::SpecialTokens::kNone);
    if (tok->bos_id()) prompt.insert(prompt.begin(), *tok->bos_id());
  }
  if (prompt.empty()) return fail(invalid_argument("the prompt encodes to no tokens"));

  engine::RequestState state = (*model)->new_state();
  // The cluster's split (engine/decode_batcher.hpp, "N−1 prefill"): prefill prompt[0, N−1) in chunks,
  // then one decode step on the last prompt token gives the first logits. Same math as serving.
  const auto prefill_start = Clock::now();
  const std::span<const int32_t> all(prompt);
  if (prompt.size() > 1) {
    auto prefilled = (*model)->prefill(state, all.first(prompt.size() - 1), options.prefill_chunk);
    if (!prefilled.is_ok()) return fail(prefilled.status());
  }
  std::vector<std::vector<float>> first;
  engine::SequenceInput last{&state, all.last(1), false};
  if (Status s = (*model)->forward({&last, 1}, first); !s.is_ok()) return fail(s);
  const double prefill_seconds = seconds_since(prefill_start);

  // Stop on the model's eos and on <|im_end|> (the chat turn end), unless told to ignore them.
  std::vector<int32_t> stop_ids;
  if (config.eos_token_id >= 0) stop_ids.push_back(config.eos_token_id);
  if (auto im_end = tok->special_token_id("<|im_end|>")) stop_ids.push_back(*im_end);

  engine::Sampler sampler(params);
  tokenizer::IncrementalDecoder decoder(*tok);
  std::vector<float> current = std::move(first[0]);
  int64_t generated = 0;
  std::string finish_reason = "length";
  const auto decode_start = Clock::now();
  while (generated < options.max_tokens) {
    const engine::SampledToken sampled = sampler.sample(current);
    ++generated;
    const bool stop =
        !options.ignore_eos && std::find(stop_ids.begin(), stop_ids.end(), sampled.token) != stop_ids.end();
    if (options.logprobs >= 0) {
      nlohmann::json line = token_entry(*tok, sampled.token, sampled.logprob);
      line["index"] = generated - 1;
      line["token_id"] = sampled.token;
      nlohmann::json top = nlohmann::json::array();
      for (const engine::TokenLogprob& alt : sampled.top) top.push_back(token_entry(*tok, alt.token, alt.logprob));
      line["top_logprobs"] = top;
      out << line.dump() << "\n" << std::flush;
    } else if (!stop && !tok->is_special(sampled.token)) {
      // Special tokens are control tokens, not text (as OpenAI-compatible servers skip them).
      out << decoder.push(sampled.token) << std::flush;
    }
    if (stop) {
      finish_reason = "stop";
      break;
    }
    if (generated == options.max_tokens) break;
    std::vector<std::vector<float>> next;
    engine::SequenceInput input{&state, {&sampled.token, 1}, false};
    if (Status s = (*model)->forward({&input, 1}, next); !s.is_ok()) return fail(s);
    current = std::move(next[0]);
  }
  if (options.logprobs < 0) out << decoder.flush() << "\n";
  const double decode_seconds = seconds_since(decode_start);
  err << "prompt " << prompt.size() << " tokens, prefill " << static_cast<int64_t>(prompt.size() / prefill_seconds)
      << " tok/s; generated " << generated << " tokens, decode "
      << static_cast<int64_t>(generated / std::max(decode_seconds, 1e-9)) << " tok/s; finish_reason " << finish_reason
      << "\n";
  return 0;
}

}  // namespace deltaserve::cli
