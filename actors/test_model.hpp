// Test helper: the tiny-linear model and tiny tokenizer written into a temp directory, loaded once.
#pragma once

#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <unistd.h>

#include "engine/make_model.hpp"
#include "engine/model.hpp"
#include "engine/sampler.hpp"
#include "router/inference_service.hpp"
#include "tokenizer/tiktoken_tokenizer.hpp"
#include "tokenizer/tokenizer_writer.hpp"

namespace deltaserve::actors::testing {

struct TinyModel {
  std::filesystem::path dir;
  std::shared_ptr<const engine::Model> model;
  std::shared_ptr<const tokenizer::Tokenizer> tokenizer;
};

// Written on first use under the temp directory (per process), removed at exit by the OS temp cleaner
// or the next run; `ok` is false with a message on failure.
inline const TinyModel& tiny_model(std::string* error = nullptr) {
  static TinyModel tiny = [] {
    TinyModel t;
    t.dir = std::filesystem::temp_directory_path() / ("ds_actors_test_model_" + std::to_string(::getpid()));
    std::filesystem::remove_all(t.dir);
    auto config = engine::preset_config("tiny-linear");
    if (!config.is_ok()) return t;
    if (!tokenizer::write_tiny_tokenizer(t.dir, engine::kTinyVocabBase, 7).is_ok()) return t;
    engine::MakeModelOptions options;
    options.seed = 7;
    if (!engine::write_random_model(*config, t.dir, options).is_ok()) return t;
    auto model = engine::Model::load(t.dir);
    auto tok = tokenizer::Tokenizer::load(t.dir);
    if (!model.is_ok() || !tok.is_ok()) return t;
    t.model = std::shared_ptr<const engine::Model>(std::move(model).value());
    t.tokenizer = std::make_shared<const tokenizer::Tokenizer>(std::move(tok).value());
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(tiny_model().dir, ec);
    });
    return t;
  }();
  if (error && !tiny.model) *error = "cannot build the tiny model in " + tiny.dir.string();
  return tiny;
}

// The reference: a direct engine loop with the "N−1" split (prefill in `chunk` pieces, the last prompt
// token through one forward), greedy, no stop tokens, `max_tokens` tokens.
inline std::vector<int32_t> reference_greedy(const engine::Model& model, const std::vector<int32_t>& prompt,
                                             int64_t max_tokens, int64_t chunk) {
  engine::RequestState state = model.new_state();
  const std::span<const int32_t> all(prompt);
  if (prompt.size() > 1) {
    auto r = model.prefill(state, all.first(prompt.size() - 1), chunk);
    if (!r.is_ok()) return {};
  }
  engine::SamplingParams params;
  params.temperature = 0.0f;
  engine::Sampler sampler(params);
  std::vector<int32_t> out;
  int32_t next = prompt.back();
  for (int64_t i = 0; i < max_tokens; ++i) {
    std::vector<std::vector<float>> logits;
    engine::SequenceInput input{&state, {&next, 1}, false};
    if (!model.forward({&input, 1}, logits).is_ok()) return {};
    next = sampler.sample(logits[0]).token;
    out.push_back(next);
  }
  return out;
}

// A greedy request of the default tenant that ignores eos (a random model may end its turn early).
inline router::GenerationRequest greedy_request(const std::string& id, std::vector<int32_t> prompt,
                                                int64_t max_tokens) {
  router::GenerationRequest r;
  r.request_id = id;
  r.tenant = "default";
  r.prompt = std::move(prompt);
  r.sampling.temperature = 0.0f;
  r.max_tokens = max_tokens;
  r.ignore_eos = true;
  return r;
}

}  // namespace deltaserve::actors::testing
