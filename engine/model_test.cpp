// The forward pass against itself in independent arrangements: one-shot prefill as the reference for
// chunked prefill (any split), decode steps, batching with other requests; the sampled pass (forward_sample)
// against forward + Sampler; and the loader against the generated checkpoints in every storage format.
#include "engine/model.hpp"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "common/temp_dir.hpp"
#include "engine/make_model.hpp"
#include "engine/sampler.hpp"
#include "engine/test_models.hpp"

namespace deltaserve::engine {
namespace {

using testing::make_model;
using testing::random_tokens;

// Max |a - b| relative to max |b| (logits are O(1..10)).
double relative_error(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double diff = 0, scale = 1e-6;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    diff = std::max(diff, static_cast<double>(std::fabs(a[i] - b[i])));
    scale = std::max(scale, static_cast<double>(std::fabs(b[i])));
  }
  return diff / scale;
}

// All-token logits of `tokens` prefilled in one call: the reference.
std::vector<float> one_shot_logits(const Model& model, const std::vector<int32_t>& tokens) {
  RequestState state = model.new_state();
  std::vector<std::vector<float>> logits;
  SequenceInput input{&state, tokens, true};
  Status s = model.forward({&input, 1}, logits);
  EXPECT_TRUE(s.is_ok()) << s.to_string();
  return logits[0];
}

class ModelPresetTest : public ::testing::TestWithParam<std::string> {};

TEST_P(ModelPresetTest, PrefillInAnySplitEqualsOneShot) {
  auto model = make_model(GetParam());
  ASSERT_NE(model, nullptr);
  const int64_t vocab = model->config().vocab_size;
  const auto tokens = random_tokens(150, vocab, 1);
  const std::vector<float> reference = one_shot_logits(*model, tokens);

  // Splits: uneven pieces, single tokens at the start, pieces crossing the KDA chunk size.
  const std::vector<std::vector<int64_t>> splits = {
      {1, 149}, {64, 64, 22}, {7, 1, 1, 80, 61}, {149, 1}, {33, 33, 33, 33, 18}};
  for (const auto& split : splits) {
    RequestState state = model->new_state();
    std::vector<float> logits;
    size_t begin = 0;
    for (int64_t piece : split) {
      std::vector<std::vector<float>> out;
      SequenceInput input{&state, std::span<const int32_t>(tokens).subspan(begin, static_cast<size_t>(piece)), true};
      ASSERT_TRUE(model->forward({&input, 1}, out).is_ok());
      logits.insert(logits.end(), out[0].begin(), out[0].end());
      begin += static_cast<size_t>(piece);
    }
    EXPECT_LT(relative_error(logits, reference), 2e-4) << "split starting " << split[0];
    EXPECT_EQ(state.num_tokens(), 150);
  }
}

TEST_P(ModelPresetTest, DecodeAfterPrefillEqualsPrefillOfLongerPrompt) {
  auto model = make_model(GetParam());
  ASSERT_NE(model, nullptr);
  const auto tokens = random_tokens(90, model->config().vocab_size, 2);
  const std::vector<float> reference = one_shot_logits(*model, tokens);
  const int64_t vocab = model->config().vocab_size;

  RequestState state = model->new_state();
  auto first = model->prefill(state, std::span<const int32_t>(tokens).first(70), 32);
  ASSERT_TRUE(first.is_ok());
  EXPECT_LT(relative_error(*first, {reference.begin() + 69 * vocab, reference.begin() + 70 * vocab}), 2e-4);
  for (size_t t = 70; t < tokens.size(); ++t) {
    std::vector<std::vector<float>> out;
    SequenceInput input{&state, {&tokens[t], 1}, false};
    ASSERT_TRUE(model->forward({&input, 1}, out).is_ok());
    const std::vector<float> expected(reference.begin() + static_cast<int64_t>(t) * vocab,
                                      reference.begin() + static_cast<int64_t>(t + 1) * vocab);
    EXPECT_LT(relative_error(out[0], expected), 2e-4) << "decode position " << t;
  }
}

TEST_P(ModelPresetTest, BatchedSequencesEqualEachAlone) {
  auto model = make_model(GetParam());
  ASSERT_NE(model, nullptr);
  const int64_t vocab = model->config().vocab_size;
  const auto a = random_tokens(40, vocab, 3), b = random_tokens(1, vocab, 4), c = random_tokens(17, vocab, 5);
  RequestState sa = model->new_state(), sb = model->new_state(), sc = model->new_state();
  std::vector<SequenceInput> batch = {{&sa, a, false}, {&sb, b, false}, {&sc, c, true}};
  std::vector<std::vector<float>> out;
  ASSERT_TRUE(model->forward(batch, out).is_ok());
  const auto ref_a = one_shot_logits(*model, a), ref_b = one_shot_logits(*model, b), ref_c = one_shot_logits(*model, c);
  EXPECT_LT(relative_error(out[0], {ref_a.end() - vocab, ref_a.end()}), 1e-5);
  EXPECT_LT(relative_error(out[1], ref_b), 1e-5);
  EXPECT_LT(relative_error(out[2], ref_c), 1e-5);
}

TEST_P(ModelPresetTest, RejectsBadTokensAndLeavesStateUntouched) {
  auto model = make_model(GetParam());
  ASSERT_NE(model, nullptr);
  RequestState state = model->new_state();
  const std::vector<int32_t> bad = {1, 2, static_cast<int32_t>(model->config().vocab_size)};
  std::vector<std::vector<float>> out;
  SequenceInput input{&state, bad, false};
  Status s = model->forward({&input, 1}, out);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("outside the vocabulary"), std::string::npos) << s.message();
  EXPECT_TRUE(state.same_contents(model->new_state()));
  const std::vector<int32_t> negative = {-1};
  SequenceInput input2{&state, negative, false};
  EXPECT_FALSE(model->forward({&input2, 1}, out).is_ok());
}

TEST_P(ModelPresetTest, LogitsAreFiniteAndDependOnContext) {
  auto model = make_model(GetParam());
  ASSERT_NE(model, nullptr);
  const int64_t vocab = model->config().vocab_size;
  auto x = random_tokens(20, vocab, 9);
  auto y = x;
  y[0] = (y[0] + 1) % static_cast<int32_t>(vocab);  // change only the first token
  const auto lx = one_shot_logits(*model, x), ly = one_shot_logits(*model, y);
  for (float v : lx) ASSERT_TRUE(std::isfinite(v));
  // The last position must see the first token through KDA state and MLA attention.
  EXPECT_GT(relative_error({lx.end() - vocab, lx.end()}, {ly.end() - vocab, ly.end()}), 1e-4);
}

// Sampling params of the forward_sample tests: greedy, plain temperature, top-k, top-p over many candidates, top-k
// with top-p, top-k 1; with and without alternatives.
std::vector<SamplingParams> mixed_sampling_params() {
  return {{.temperature = 0.0f, .top_logprobs = 2},
          {.temperature = 0.8f, .seed = 11},
          {.temperature = 1.1f, .top_k = 7, .seed = 12, .top_logprobs = 5},
          {.temperature = 0.9f, .top_p = 0.85f, .seed = 13, .top_logprobs = 20},
          {.temperature = 1.3f, .top_p = 0.7f, .top_k = 40, .seed = 14},
          {.temperature = 0.6f, .top_k = 1, .seed = 15, .top_logprobs = 1}};
}

void expect_same_sampled(const SampledToken& got, const SampledToken& expected, const std::string& where) {
  EXPECT_EQ(got.token, expected.token) << where;
  EXPECT_EQ(got.logprob, expected.logprob) << where;
  ASSERT_EQ(got.top.size(), expected.top.size()) << where;
  for (size_t k = 0; k < got.top.size(); ++k) {
    EXPECT_EQ(got.top[k].token, expected.top[k].token) << where << " alternative " << k;
    EXPECT_EQ(got.top[k].logprob, expected.top[k].logprob) << where << " alternative " << k;
  }
}

// forward_sample on the CPU is forward + each request's Sampler, bit for bit, over several steps (the first with a
// multi-token chunk for one sequence), with the streams consumed identically (the caller takes the peeked draw).
TEST_P(ModelPresetTest, ForwardSampleEqualsForwardThenSampler) {
  auto model = make_model(GetParam());
  ASSERT_NE(model, nullptr);
  const int64_t vocab = model->config().vocab_size;
  const std::vector<SamplingParams> params = mixed_sampling_params();
  const size_t n = params.size();
  std::vector<RequestState> states_a, states_b;
  std::vector<Sampler> samplers_a, samplers_b;
  std::vector<std::vector<int32_t>> feed(n);
  for (size_t i = 0; i < n; ++i) {
    states_a.push_back(model->new_state());
    states_b.push_back(model->new_state());
    samplers_a.emplace_back(params[i]);
    samplers_b.emplace_back(params[i]);
    feed[i] = random_tokens(i == 2 ? 9 : 1, vocab, 40 + static_cast<uint32_t>(i));  // sequence 2: a chunk first
  }
  for (int step = 0; step < 6; ++step) {
    std::vector<SequenceInput> batch_a, batch_b;
    std::vector<SampleRequest> rows;
    for (size_t i = 0; i < n; ++i) {
      batch_a.push_back({&states_a[i], feed[i], false});
      batch_b.push_back({&states_b[i], feed[i], false});
      rows.push_back({params[i], samplers_b[i].peek_draw(), /*logprobs=*/true});
    }
    std::vector<std::vector<float>> logits;
    ASSERT_TRUE(model->forward(batch_a, logits).is_ok());
    std::vector<SampledToken> sampled;
    const Status status = model->forward_sample(batch_b, rows, sampled);
    ASSERT_TRUE(status.is_ok()) << status.to_string();
    ASSERT_EQ(sampled.size(), n);
    for (size_t i = 0; i < n; ++i) {
      (void)samplers_b[i].next_draw();
      const SampledToken expected = samplers_a[i].sample(logits[i]);
      expect_same_sampled(sampled[i], expected, "step " + std::to_string(step) + ", sequence " + std::to_string(i));
      EXPECT_EQ(states_b[i].num_tokens(), states_a[i].num_tokens());
      feed[i] = {expected.token};
    }
  }
  for (size_t i = 0; i < n; ++i) EXPECT_EQ(samplers_a[i].peek_draw(), samplers_b[i].peek_draw()) << i;
}

TEST_P(ModelPresetTest, ForwardSampleRejectsBadRowsAndLeavesStateUntouched) {
  auto model = make_model(GetParam());
  ASSERT_NE(model, nullptr);
  RequestState state = model->new_state();
  const std::vector<int32_t> tokens = {1, 2, 3};
  std::vector<SampledToken> out;
  const SampleRequest good{{}, 0.5, false};
  auto check = [&](SequenceInput input, std::vector<SampleRequest> rows, const std::string& expected) {
    const Status s = model->forward_sample({&input, 1}, rows, out);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << expected;
    EXPECT_NE(s.message().find(expected), std::string::npos) << s.message();
    EXPECT_TRUE(state.same_contents(model->new_state())) << expected;
  };
  check({&state, tokens, false}, {}, "sampling rows");
  check({&state, tokens, false}, {good, good}, "sampling rows");
  check({&state, tokens, true}, {good}, "all_logits");
  check({&state, tokens, false}, {{{}, 1.0, false}}, "draw");
  check({&state, tokens, false}, {{{.temperature = 3.0f}, 0.5, false}}, "temperature");
  const std::vector<int32_t> bad = {static_cast<int32_t>(model->config().vocab_size)};
  check({&state, bad, false}, {good}, "outside the vocabulary");
}

INSTANTIATE_TEST_SUITE_P(Presets, ModelPresetTest, ::testing::Values("tiny-linear", "tiny-k3"));

// A backend that does not sample itself gets Backend::forward_sample's default: its forward pass, then the rule on the
// host; the results are those of the CPU model's forward_sample. A failed pass returns its error.
TEST(ModelForwardSample, BackendDefaultSamplesItsLogitsOnTheHost) {
  auto cpu = make_model("tiny-linear");
  ASSERT_NE(cpu, nullptr);
  auto backend = std::make_shared<testing::CpuModelBackend>(*cpu);
  const Model with_backend(cpu->config(), backend);
  const std::vector<SamplingParams> params = mixed_sampling_params();
  std::vector<RequestState> states_a, states_b;
  std::vector<std::vector<int32_t>> tokens;
  std::vector<SampleRequest> rows;
  for (size_t i = 0; i < params.size(); ++i) {
    states_a.push_back(cpu->new_state());
    states_b.push_back(cpu->new_state());
    tokens.push_back(
        random_tokens(3 + static_cast<int64_t>(i), cpu->config().vocab_size, 60 + static_cast<uint32_t>(i)));
    rows.push_back({params[i], 0.1 + 0.15 * static_cast<double>(i), i % 2 == 0});
  }
  std::vector<SequenceInput> batch_a, batch_b;
  for (size_t i = 0; i < params.size(); ++i) {
    batch_a.push_back({&states_a[i], tokens[i], false});
    batch_b.push_back({&states_b[i], tokens[i], false});
  }
  std::vector<SampledToken> expected, got;
  backend->fail_passes = 1;
  const Status failed = with_backend.forward_sample(batch_b, rows, got);
  EXPECT_EQ(failed.code(), StatusCode::kUnavailable) << failed.to_string();
  EXPECT_EQ(states_b[0].num_tokens(), 0);
  ASSERT_TRUE(cpu->forward_sample(batch_a, rows, expected).is_ok());
  ASSERT_TRUE(with_backend.forward_sample(batch_b, rows, got).is_ok());
  EXPECT_EQ(backend->passes, 2);
  ASSERT_EQ(got.size(), expected.size());
  for (size_t i = 0; i < got.size(); ++i) {
    expect_same_sampled(got[i], expected[i], "sequence " + std::to_string(i));
    if (!rows[i].logprobs) {
      EXPECT_EQ(got[i].logprob, 0.0f);
      EXPECT_TRUE(got[i].top.empty());
    }
  }
}

TEST(ModelLoad, ShardingDoesNotChangeTheModelAndFp8IsReallyQuantised) {
  // A random model is chaotic (a tiny weight change can flip an MoE routing decision), so storage
  // formats are compared for identity where they must be identical, not for closeness.
  auto bf16 = make_model("tiny-k3", DType::kBF16);
  auto bf16_sharded = make_model("tiny-k3", DType::kBF16, /*shard_bytes=*/64 * 1024);
  auto fp8 = make_model("tiny-k3", DType::kF8E4M3, /*shard_bytes=*/100 * 1024);
  ASSERT_TRUE(bf16 && bf16_sharded && fp8);
  const auto tokens = random_tokens(24, bf16->config().vocab_size, 11);
  const auto reference = one_shot_logits(*bf16, tokens);
  EXPECT_EQ(one_shot_logits(*bf16_sharded, tokens), reference);
  const auto quantised = one_shot_logits(*fp8, tokens);
  for (float v : quantised) ASSERT_TRUE(std::isfinite(v));
  EXPECT_GT(relative_error(quantised, reference), 0.0);
}

// Writes a tiny-linear checkpoint holding every expected tensor except `skip`, plus `extra`.
void write_edited_checkpoint(const std::filesystem::path& dir, const std::string& skip, const std::string& extra) {
  auto config = preset_config("tiny-linear");
  ASSERT_TRUE(config.is_ok());
  SafetensorsWriter writer;
  for (const TensorSpec& spec : expected_tensors(*config)) {
    if (spec.name == skip) continue;
    int64_t n = 1;
    for (int64_t d : spec.shape) n *= d;
    ASSERT_TRUE(
        writer.add(spec.name, spec.shape, std::vector<float>(static_cast<size_t>(n), 0.5f), DType::kF32).is_ok());
  }
  if (!extra.empty()) {
    ASSERT_TRUE(writer.add(extra, {4}, std::vector<float>(4, 1.0f), DType::kF32).is_ok());
  }
  ASSERT_TRUE(writer.write(dir).is_ok());
  std::ofstream(dir / "config.json") << model_config_to_json(*config).dump();
}

TEST(ModelLoad, MissingTensorIsNamed) {
  TempDir dir;
  write_edited_checkpoint(dir.path(), "model.layers.4.self_attn.f_b_proj.weight", "");
  auto model = Model::load(dir.path());
  ASSERT_FALSE(model.is_ok());
  EXPECT_NE(model.status().message().find("model.layers.4.self_attn.f_b_proj.weight"), std::string::npos)
      << model.status().message();
}

TEST(ModelLoad, ExtraTensorIsNamed) {
  TempDir dir;
  write_edited_checkpoint(dir.path(), "", "model.layers.2.self_attn.mystery.weight");
  auto model = Model::load(dir.path());
  ASSERT_FALSE(model.is_ok());
  EXPECT_NE(model.status().message().find("mystery"), std::string::npos) << model.status().message();
}

TEST(ModelLoad, WrongExpertCountIsNamed) {
  TempDir dir;
  auto config = preset_config("tiny-linear");
  ASSERT_TRUE(config.is_ok());
  ASSERT_TRUE(write_random_model(*config, dir.path(), {}).is_ok());
  for (int64_t experts : {7, 9}) {
    ModelConfig edited = *config;
    edited.moe.num_experts = experts;
    std::ofstream(dir.path() / "config.json") << model_config_to_json(edited).dump();
    auto model = Model::load(dir.path());
    ASSERT_FALSE(model.is_ok());
    const std::string& m = model.status().message();
    EXPECT_NE(m.find("block_sparse_moe.gate.weight"), std::string::npos) << m;
    EXPECT_NE(m.find("[" + std::to_string(experts) + ", 64]"), std::string::npos) << m;
  }
}

TEST(ModelLoad, BadConfigIsNamedWithItsFile) {
  TempDir dir;
  std::ofstream(dir.path() / "config.json") << "{\"model_type\": \"kimi_linear\", \"hidden_size\": \"big\"}";
  auto model = Model::load(dir.path());
  ASSERT_FALSE(model.is_ok());
  EXPECT_NE(model.status().message().find("config.json"), std::string::npos) << model.status().message();
}

}  // namespace
}  // namespace deltaserve::engine
