// DecodeBatcher against independent references: a hand-written single-request decode loop (prefill
// prompt[0, N−1), forward the last prompt token, argmax / log-softmax written here in fp64, forward
// the sampled token, ...) for greedy decoding, and the batcher running the request alone for seeded
// sampling. Requests join and leave between steps; each must produce exactly the tokens it produces alone.
// Sampling in the pass (Model::forward_sample) against host sampling (each Sampler on forward's logits), and a
// failed pass that must leave every request's RNG stream alone.
#include "engine/decode_batcher.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <unistd.h>

#include "common/temp_dir.hpp"
#include "engine/make_model.hpp"
#include "engine/test_models.hpp"

namespace deltaserve::engine {
namespace {

// Below this gap between the two best logits, greedy may pick either in a batch of another size.
constexpr float kNearTie = 1e-4f;

std::unique_ptr<Model> make_model(const std::string& preset, int64_t max_positions = 0) {
  TempDir dir;
  auto config = preset_config(preset);
  EXPECT_TRUE(config.is_ok()) << config.status().to_string();
  if (!config.is_ok()) return nullptr;
  if (max_positions > 0) config->max_position_embeddings = max_positions;
  MakeModelOptions options;
  options.seed = 11;
  options.dtype = DType::kF32;
  Status written = write_random_model(*config, dir.path(), options);
  EXPECT_TRUE(written.is_ok()) << written.to_string();
  auto model = Model::load(dir.path());
  EXPECT_TRUE(model.is_ok()) << model.status().to_string();
  return model.is_ok() ? std::move(model).value() : nullptr;
}

// One tiny-linear model shared by the tests of this file (loading is the slow part).
const Model& tiny_model() {
  static const std::unique_ptr<Model> model = make_model("tiny-linear");
  return *model;
}

std::vector<int32_t> random_tokens(int64_t n, int64_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> tokens(static_cast<size_t>(n));
  for (auto& t : tokens) t = static_cast<int32_t>(rng() % static_cast<uint32_t>(vocab));
  return tokens;
}

// The handoff a prefill worker makes: the state of prompt[0, N−1) (N−1 may be 0) and prompt[N−1].
RequestState prefill_all_but_last(const Model& model, const std::vector<int32_t>& prompt) {
  RequestState state = model.new_state();
  if (prompt.size() > 1) {
    auto logits = model.prefill(state, std::span<const int32_t>(prompt).first(prompt.size() - 1), 16);
    EXPECT_TRUE(logits.is_ok()) << logits.status().to_string();
  }
  return state;
}

struct ReferenceToken {
  int32_t token;
  double logprob;
  float top2_gap;  // best logit minus the second best
};

// The single-request decode loop written out by hand: greedy argmax (lowest id on ties), fp64 log-softmax.
std::vector<ReferenceToken> reference_greedy(const Model& model, const std::vector<int32_t>& prompt, int64_t max_tokens,
                                             const std::vector<int32_t>& stop_ids = {}) {
  RequestState state = model.new_state();
  if (prompt.size() > 1) {
    EXPECT_TRUE(model.prefill(state, std::span<const int32_t>(prompt).first(prompt.size() - 1)).is_ok());
  }
  std::vector<ReferenceToken> out;
  int32_t feed = prompt.back();
  while (static_cast<int64_t>(out.size()) < max_tokens) {
    std::vector<std::vector<float>> logits;
    SequenceInput input{&state, {&feed, 1}, false};
    EXPECT_TRUE(model.forward({&input, 1}, logits).is_ok());
    const std::vector<float>& row = logits[0];
    size_t best = 0;
    for (size_t i = 1; i < row.size(); ++i) {
      if (row[i] > row[best]) best = i;
    }
    float second = -INFINITY;
    for (size_t i = 0; i < row.size(); ++i) {
      if (i != best) second = std::max(second, row[i]);
    }
    double sum = 0;
    for (float v : row) sum += std::exp(static_cast<double>(v) - row[best]);
    out.push_back({static_cast<int32_t>(best), -std::log(sum), row[best] - second});
    feed = static_cast<int32_t>(best);
    if (std::find(stop_ids.begin(), stop_ids.end(), feed) != stop_ids.end()) break;
  }
  return out;
}

DecodeParams greedy_params(int64_t max_tokens, std::vector<int32_t> stop_ids = {}) {
  DecodeParams params;
  params.sampling.temperature = 0.0f;
  params.max_tokens = max_tokens;
  params.stop_token_ids = std::move(stop_ids);
  params.logprobs = true;
  return params;
}

// Compares `got` with the reference token by token until the reference has a near-tie (after which
// either continuation is right); returns how many tokens were compared.
size_t expect_matches_reference(const std::string& name, const std::vector<int32_t>& got,
                                const std::vector<ReferenceToken>& reference) {
  size_t i = 0;
  for (; i < got.size() && i < reference.size(); ++i) {
    if (reference[i].top2_gap < kNearTie) {
      std::printf("[ near tie ] %s: token %zu has top-2 gap %g; comparison stops there\n", name.c_str(), i,
                  static_cast<double>(reference[i].top2_gap));
      return i;
    }
    EXPECT_EQ(got[i], reference[i].token) << name << " token " << i;
  }
  return i;
}

TEST(DecodeBatcher, AloneEqualsHandWrittenLoop) {
  const Model& model = tiny_model();
  const int64_t vocab = model.config().vocab_size;
  for (const int64_t prompt_length : {1, 2, 9, 40}) {
    const auto prompt = random_tokens(prompt_length, vocab, static_cast<uint32_t>(100 + prompt_length));
    const auto reference = reference_greedy(model, prompt, 20);

    DecodeBatcher batcher(model, 4);
    ASSERT_TRUE(batcher.add("r", prefill_all_but_last(model, prompt), prompt.back(), greedy_params(20)).is_ok());
    std::vector<SampledToken> got;
    while (batcher.active() > 0) {
      auto outputs = batcher.step();
      ASSERT_TRUE(outputs.is_ok()) << outputs.status().to_string();
      ASSERT_EQ(outputs->size(), 1u);
      const DecodeStepOutput& out = (*outputs)[0];
      got.push_back(out.sampled);
      EXPECT_EQ(out.completion_tokens, static_cast<int64_t>(got.size()));
      EXPECT_EQ(out.finished, got.size() == 20);
      if (out.finished) {
        EXPECT_EQ(out.finish_reason, "length");
      }
    }
    ASSERT_EQ(got.size(), reference.size());
    for (size_t i = 0; i < got.size(); ++i) {
      // Same arithmetic in the same arrangement (batch of one): identical ids, logprobs to rounding.
      EXPECT_EQ(got[i].token, reference[i].token) << "prompt " << prompt_length << " token " << i;
      EXPECT_NEAR(got[i].logprob, reference[i].logprob, 1e-5) << "prompt " << prompt_length << " token " << i;
    }
  }
}

TEST(DecodeBatcher, RequestsJoiningAndLeavingProduceTheirAloneTokens) {
  const Model& model = tiny_model();
  const int64_t vocab = model.config().vocab_size;

  struct Plan {
    std::string id;
    std::vector<int32_t> prompt;
    int64_t max_tokens;
    int64_t join_step;            // added before this step
    int64_t remove_step = -1;     // removed by the caller before this step (an abort), -1: never
    bool stop_on_fourth = false;  // stop token = the 4th token it generates alone
  };
  std::vector<Plan> plans = {
      {"a", random_tokens(12, vocab, 1), 14, 0},
      {"b", random_tokens(1, vocab, 2), 30, 0, 6},
      {"c", random_tokens(33, vocab, 3), 3, 2},
      {"d", random_tokens(7, vocab, 4), 25, 3, -1, true},
      {"e", random_tokens(20, vocab, 5), 9, 5},
      {"f", random_tokens(5, vocab, 6), 6, 12},  // joins after several have left
  };
  std::map<std::string, std::vector<ReferenceToken>> reference;
  std::map<std::string, DecodeParams> params;
  for (const Plan& plan : plans) {
    std::vector<int32_t> stop_ids;
    if (plan.stop_on_fourth) {
      const auto unstopped = reference_greedy(model, plan.prompt, 4);
      stop_ids.push_back(unstopped[3].token);
    }
    reference[plan.id] = reference_greedy(model, plan.prompt, plan.max_tokens, stop_ids);
    params[plan.id] = greedy_params(plan.max_tokens, stop_ids);
  }

  DecodeBatcher batcher(model, 4);
  std::map<std::string, std::vector<int32_t>> got;
  std::map<std::string, std::string> finish_reason;
  for (int64_t step = 0; step < 40; ++step) {
    for (const Plan& plan : plans) {
      if (plan.join_step == step) {
        Status added =
            batcher.add(plan.id, prefill_all_but_last(model, plan.prompt), plan.prompt.back(), params[plan.id]);
        ASSERT_TRUE(added.is_ok()) << plan.id << ": " << added.to_string();
      }
      if (plan.remove_step == step) {
        EXPECT_TRUE(batcher.remove(plan.id)) << plan.id;
      }
    }
    auto outputs = batcher.step();
    ASSERT_TRUE(outputs.is_ok()) << outputs.status().to_string();
    // One output per active request, in admission order (plans are listed in admission order).
    std::vector<std::string> order;
    for (const DecodeStepOutput& out : *outputs) {
      order.push_back(out.request_id);
      got[out.request_id].push_back(out.sampled.token);
      EXPECT_EQ(out.completion_tokens, static_cast<int64_t>(got[out.request_id].size()));
      if (out.finished) {
        finish_reason[out.request_id] = out.finish_reason;
        EXPECT_FALSE(batcher.contains(out.request_id));
      }
    }
    EXPECT_TRUE(std::is_sorted(order.begin(), order.end())) << "step " << step;
  }
  EXPECT_EQ(batcher.active(), 0);

  for (const Plan& plan : plans) {
    const auto& ref = reference[plan.id];
    const auto& tokens = got[plan.id];
    const size_t compared = expect_matches_reference(plan.id, tokens, ref);
    if (plan.remove_step >= 0) {
      // Aborted by the caller after (remove_step - join_step) steps: a prefix of its alone tokens.
      EXPECT_EQ(static_cast<int64_t>(tokens.size()), plan.remove_step - plan.join_step) << plan.id;
      EXPECT_FALSE(finish_reason.count(plan.id)) << plan.id;
      continue;
    }
    if (compared < ref.size()) continue;  // a near tie: the continuation may legitimately differ
    EXPECT_EQ(tokens.size(), ref.size()) << plan.id;
    const bool stopped =
        !params[plan.id].stop_token_ids.empty() && ref.back().token == params[plan.id].stop_token_ids[0];
    EXPECT_EQ(finish_reason[plan.id], stopped ? "stop" : "length") << plan.id;
    if (plan.stop_on_fourth) {
      EXPECT_TRUE(stopped);
      EXPECT_LE(tokens.size(), 4u);
    }
  }
}

TEST(DecodeBatcher, CapacityDuplicatesAndBadInput) {
  const Model& model = tiny_model();
  const int64_t vocab = model.config().vocab_size;
  DecodeBatcher batcher(model, 2);
  EXPECT_EQ(batcher.max_batch(), 2);
  ASSERT_TRUE(batcher.add("a", model.new_state(), 1, greedy_params(5)).is_ok());
  EXPECT_EQ(batcher.add("a", model.new_state(), 1, greedy_params(5)).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(batcher.add("b", model.new_state(), 2, greedy_params(5)).is_ok());
  EXPECT_EQ(batcher.free_slots(), 0);
  const Status full = batcher.add("c", model.new_state(), 3, greedy_params(5));
  EXPECT_EQ(full.code(), StatusCode::kFailedPrecondition) << full.to_string();
  EXPECT_EQ(batcher.add("a", model.new_state(), 1, greedy_params(5)).code(), StatusCode::kInvalidArgument);

  EXPECT_FALSE(batcher.remove("nobody"));
  EXPECT_TRUE(batcher.remove("a"));
  EXPECT_FALSE(batcher.contains("a"));
  EXPECT_EQ(batcher.free_slots(), 1);
  ASSERT_TRUE(batcher.add("c", model.new_state(), 3, greedy_params(5)).is_ok());
  EXPECT_TRUE(batcher.remove("b"));

  // Bad input: rejected with InvalidArgument naming the problem, the batcher unchanged.
  auto expect_invalid = [&](RequestState state, int32_t next, const DecodeParams& p, const std::string& needle) {
    const Status s = batcher.add("x", std::move(state), next, p);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
    EXPECT_NE(s.message().find(needle), std::string::npos) << s.to_string();
    EXPECT_FALSE(batcher.contains("x"));
  };
  expect_invalid(model.new_state(), 1, greedy_params(0), "max_tokens");
  DecodeParams done = greedy_params(5);
  done.generated = 5;  // nothing left to generate
  expect_invalid(model.new_state(), 1, done, "max_tokens");
  done.generated = -1;
  expect_invalid(model.new_state(), 1, done, "max_tokens");
  DecodeParams hot = greedy_params(5);
  hot.sampling.temperature = 3.0f;
  expect_invalid(model.new_state(), 1, hot, "temperature");
  expect_invalid(model.new_state(), static_cast<int32_t>(vocab), greedy_params(5), "next token");
  expect_invalid(model.new_state(), -1, greedy_params(5), "next token");
  expect_invalid(model.new_state(), 1, greedy_params(5, {static_cast<int32_t>(vocab)}), "stop token");
  auto other = make_model("tiny-k3");
  ASSERT_NE(other, nullptr);
  expect_invalid(other->new_state(), 1, greedy_params(5), "layers");
  // A state whose host copy is current must hold an MLA row per token.
  RequestState short_rows = model.new_state();
  short_rows.advance(3);
  expect_invalid(std::move(short_rows), 1, greedy_params(5), "MLA layer");
  EXPECT_EQ(batcher.active(), 1);
}

// A device-resident state (one that arrived in GPU memory) keeps its rows on the device: its host containers are
// stale and hold none, and the batcher must not hold that against it.
class RowsOnTheDevice final : public DeviceResidency {
 public:
  Status download(RequestState&) const override { return Status(StatusCode::kUnimplemented, "not in this test"); }
};

TEST(DecodeBatcher, AdmitsADeviceResidentStateWhoseHostRowsLag) {
  const Model& model = tiny_model();
  DecodeBatcher batcher(model, 2);
  RequestState state = model.new_state();
  state.attach_residency(std::make_unique<RowsOnTheDevice>());
  state.advance(9);
  state.set_host_stale(true);
  const Status added = batcher.add("device", std::move(state), 1, greedy_params(5));
  EXPECT_TRUE(added.is_ok()) << added.to_string();
  EXPECT_TRUE(batcher.contains("device"));
  EXPECT_TRUE(batcher.remove("device"));
}

TEST(DecodeBatcher, StateBytesReturnToZeroWhenAllLeave) {
  const Model& model = tiny_model();
  const int64_t vocab = model.config().vocab_size;
  DecodeBatcher batcher(model, 3);
  EXPECT_EQ(batcher.state_bytes(), 0);
  auto step_ok = [&] {
    auto out = batcher.step();
    ASSERT_TRUE(out.is_ok()) << out.status().to_string();
  };
  step_ok();  // an empty batch is a no-op

  const auto p1 = random_tokens(10, vocab, 7), p2 = random_tokens(3, vocab, 8);
  RequestState s1 = prefill_all_but_last(model, p1), s2 = prefill_all_but_last(model, p2);
  const int64_t expected = s1.kda_state_bytes() + s1.mla_cache_bytes() + s2.kda_state_bytes() + s2.mla_cache_bytes();
  ASSERT_TRUE(batcher.add("one", std::move(s1), p1.back(), greedy_params(3)).is_ok());
  ASSERT_TRUE(batcher.add("two", std::move(s2), p2.back(), greedy_params(50)).is_ok());
  EXPECT_EQ(batcher.state_bytes(), expected);
  step_ok();
  EXPECT_GT(batcher.state_bytes(), expected);  // the MLA caches grew by one token each
  step_ok();
  step_ok();  // "one" finishes (max_tokens 3)
  EXPECT_FALSE(batcher.contains("one"));
  EXPECT_GT(batcher.state_bytes(), 0);
  EXPECT_TRUE(batcher.remove("two"));
  EXPECT_EQ(batcher.state_bytes(), 0);
  EXPECT_EQ(batcher.active(), 0);
}

TEST(DecodeBatcher, ContextLimitEndsWithLengthAndRefusesFullStates) {
  auto model = make_model("tiny-linear", /*max_positions=*/8);
  ASSERT_NE(model, nullptr);
  const auto prompt = random_tokens(6, model->config().vocab_size, 9);
  DecodeBatcher batcher(*model, 2);
  // Holds 5 tokens; steps feed positions 6, 7, 8; the third sampled token has no room left.
  ASSERT_TRUE(batcher.add("r", prefill_all_but_last(*model, prompt), prompt.back(), greedy_params(100)).is_ok());
  int64_t steps = 0;
  std::string reason;
  while (batcher.active() > 0 && steps < 10) {
    auto out = batcher.step();
    ASSERT_TRUE(out.is_ok()) << out.status().to_string();
    ++steps;
    if ((*out)[0].finished) reason = (*out)[0].finish_reason;
  }
  EXPECT_EQ(steps, 3);
  EXPECT_EQ(reason, "length");

  const auto full_prompt = random_tokens(9, model->config().vocab_size, 10);
  const Status s = batcher.add("full", prefill_all_but_last(*model, full_prompt), full_prompt.back(), greedy_params(5));
  EXPECT_EQ(s.code(), StatusCode::kOutOfRange) << s.to_string();
}

TEST(DecodeBatcher, SeededSamplingIsTheSameAloneAndBatched) {
  const Model& model = tiny_model();
  const int64_t vocab = model.config().vocab_size;
  DecodeParams sampled;
  sampled.sampling.temperature = 0.9f;
  sampled.sampling.top_p = 0.95f;
  sampled.sampling.top_k = 200;
  sampled.sampling.seed = 1234;
  sampled.max_tokens = 16;
  const auto prompt = random_tokens(15, vocab, 11);

  auto run = [&](int64_t companions) {
    DecodeBatcher batcher(model, 8);
    // Companions join first (so the request is not first in the batch) with other seeds.
    for (int64_t i = 0; i < companions; ++i) {
      DecodeParams other = sampled;
      other.sampling.seed = 99 + static_cast<uint64_t>(i);
      other.max_tokens = 5 + 4 * i;
      const auto p = random_tokens(4 + 3 * i, vocab, static_cast<uint32_t>(50 + i));
      EXPECT_TRUE(batcher.add("other" + std::to_string(i), prefill_all_but_last(model, p), p.back(), other).is_ok());
    }
    EXPECT_TRUE(batcher.add("r", prefill_all_but_last(model, prompt), prompt.back(), sampled).is_ok());
    std::vector<int32_t> tokens;
    while (batcher.contains("r")) {
      auto out = batcher.step();
      EXPECT_TRUE(out.is_ok()) << out.status().to_string();
      if (!out.is_ok()) break;
      for (const DecodeStepOutput& o : *out) {
        if (o.request_id == "r") tokens.push_back(o.sampled.token);
        EXPECT_EQ(o.sampled.top.size(), 0u);  // logprobs not asked for
      }
    }
    return tokens;
  };
  const auto alone = run(0);
  EXPECT_EQ(alone.size(), 16u);
  EXPECT_EQ(run(3), alone);
  EXPECT_EQ(run(6), alone);

  DecodeParams other_seed = sampled;
  other_seed.sampling.seed = 1235;
  DecodeBatcher batcher(model, 1);
  ASSERT_TRUE(batcher.add("r", prefill_all_but_last(model, prompt), prompt.back(), other_seed).is_ok());
  std::vector<int32_t> tokens;
  while (batcher.active() > 0) {
    auto out = batcher.step();
    ASSERT_TRUE(out.is_ok());
    tokens.push_back((*out)[0].sampled.token);
  }
  EXPECT_NE(tokens, alone) << "the seed must matter";
}

// A request resumed after k tokens (a new state: prompt[0, N−1) prefilled, then one pass per token over prompt[N−1]
// and the first k−1 tokens; DecodeParams::generated = k) goes on exactly as the uninterrupted one: the same tokens
// (seeded sampling included), logprobs bit for bit, counts and finish.
TEST(DecodeBatcher, ResumedRequestContinuesTheUninterruptedStream) {
  const Model& model = tiny_model();
  const int64_t vocab = model.config().vocab_size;
  const auto prompt = random_tokens(13, vocab, 12);
  for (SamplingParams sampling :
       {SamplingParams{.temperature = 0.0f, .top_logprobs = 2},
        SamplingParams{.temperature = 1.0f, .top_p = 0.9f, .seed = 4321, .top_logprobs = 2}}) {
    DecodeParams params;
    params.sampling = sampling;
    params.logprobs = true;
    params.max_tokens = 12;
    auto run = [&](const std::vector<int32_t>& done) {
      RequestState state = prefill_all_but_last(model, prompt);
      int32_t next = prompt.back();
      for (int32_t token : done) {  // the decode passes of the tokens already generated
        std::vector<std::vector<float>> logits;
        SequenceInput input{&state, {&next, 1}, false};
        EXPECT_TRUE(model.forward({&input, 1}, logits).is_ok());
        next = token;
      }
      DecodeParams p = params;
      p.generated = static_cast<int64_t>(done.size());
      DecodeBatcher batcher(model, 2);
      EXPECT_TRUE(batcher.add("r", std::move(state), next, p).is_ok());
      std::vector<DecodeStepOutput> out;
      while (batcher.active() > 0) {
        auto step = batcher.step();
        EXPECT_TRUE(step.is_ok()) << step.status().to_string();
        if (!step.is_ok()) break;
        for (DecodeStepOutput& o : *step) out.push_back(std::move(o));
      }
      return out;
    };
    const auto whole = run({});
    ASSERT_EQ(whole.size(), 12u);
    for (size_t k : {size_t{1}, size_t{4}, size_t{11}}) {
      std::vector<int32_t> done;
      for (size_t i = 0; i < k; ++i) done.push_back(whole[i].sampled.token);
      const auto rest = run(done);
      ASSERT_EQ(rest.size(), whole.size() - k) << k;
      for (size_t i = 0; i < rest.size(); ++i) {
        const DecodeStepOutput& want = whole[k + i];
        EXPECT_EQ(rest[i].sampled.token, want.sampled.token) << "k=" << k << " token " << k + i;
        EXPECT_EQ(rest[i].sampled.logprob, want.sampled.logprob) << "k=" << k << " token " << k + i;
        EXPECT_EQ(rest[i].completion_tokens, want.completion_tokens);
        EXPECT_EQ(rest[i].finished, want.finished);
        EXPECT_EQ(rest[i].finish_reason, want.finish_reason);
      }
    }
  }
}

// Requests of mixed sampling params (greedy, temperature, top-k, top-p, logprobs with and without alternatives)
// joining at different steps, on `batcher`; every step's outputs in order. With `flaky` (the backend of the
// batcher's model), the pass before steps 2 and 7 fails first and the step is retried.
std::vector<std::vector<DecodeStepOutput>> run_mixed(const Model& model, DecodeBatcher& batcher,
                                                     testing::CpuModelBackend* flaky = nullptr) {
  const int64_t vocab = model.config().vocab_size;
  const std::vector<SamplingParams> kinds = {{.temperature = 0.0f, .top_logprobs = 3},
                                             {.temperature = 0.8f, .seed = 21},
                                             {.temperature = 1.0f, .top_k = 20, .seed = 22, .top_logprobs = 20},
                                             {.temperature = 0.9f, .top_p = 0.9f, .seed = 23, .top_logprobs = 1},
                                             {.temperature = 1.2f, .top_p = 0.5f, .top_k = 50, .seed = 24}};
  std::vector<std::vector<DecodeStepOutput>> steps;
  size_t joined = 0;
  for (int step = 0; step < 60 && (joined < kinds.size() || batcher.active() > 0); ++step) {
    if (joined < kinds.size() && step % 3 == 0) {
      DecodeParams params;
      params.sampling = kinds[joined];
      params.logprobs = joined % 2 == 0 || joined == 3;
      params.max_tokens = 10 + 3 * static_cast<int64_t>(joined);
      const auto prompt =
          random_tokens(5 + 2 * static_cast<int64_t>(joined), vocab, 70 + static_cast<uint32_t>(joined));
      EXPECT_TRUE(batcher.add("r" + std::to_string(joined), prefill_all_but_last(model, prompt), prompt.back(), params)
                      .is_ok());
      ++joined;
    }
    if (flaky != nullptr && (step == 2 || step == 7)) {
      flaky->fail_passes = 1;
      const int64_t active = batcher.active();
      auto failed = batcher.step();
      EXPECT_EQ(failed.status().code(), StatusCode::kUnavailable) << failed.status().to_string();
      EXPECT_EQ(batcher.active(), active);
    }
    auto out = batcher.step();
    EXPECT_TRUE(out.is_ok()) << out.status().to_string();
    if (!out.is_ok()) break;
    steps.push_back(std::move(*out));
  }
  return steps;
}

void expect_same_steps(const std::vector<std::vector<DecodeStepOutput>>& got,
                       const std::vector<std::vector<DecodeStepOutput>>& expected) {
  ASSERT_EQ(got.size(), expected.size());
  for (size_t s = 0; s < got.size(); ++s) {
    ASSERT_EQ(got[s].size(), expected[s].size()) << "step " << s;
    for (size_t i = 0; i < got[s].size(); ++i) {
      const DecodeStepOutput &a = got[s][i], &b = expected[s][i];
      const std::string where = "step " + std::to_string(s) + " " + b.request_id;
      EXPECT_EQ(a.request_id, b.request_id) << where;
      EXPECT_EQ(a.sampled.token, b.sampled.token) << where;
      EXPECT_EQ(a.sampled.logprob, b.sampled.logprob) << where;
      ASSERT_EQ(a.sampled.top.size(), b.sampled.top.size()) << where;
      for (size_t k = 0; k < a.sampled.top.size(); ++k) {
        EXPECT_EQ(a.sampled.top[k].token, b.sampled.top[k].token) << where;
        EXPECT_EQ(a.sampled.top[k].logprob, b.sampled.top[k].logprob) << where;
      }
      EXPECT_EQ(a.completion_tokens, b.completion_tokens) << where;
      EXPECT_EQ(a.finished, b.finished) << where;
      EXPECT_EQ(a.finish_reason, b.finish_reason) << where;
    }
  }
}

// On the CPU, sampling in the pass and host sampling give the same outputs bit for bit.
TEST(DecodeBatcher, SamplingInThePassEqualsHostSampling) {
  const Model& model = tiny_model();
  DecodeBatcher in_pass(model, 8), on_host(model, 8, /*host_sampling=*/true);
  EXPECT_FALSE(in_pass.host_sampling());
  EXPECT_TRUE(on_host.host_sampling());
  const auto expected = run_mixed(model, on_host);
  EXPECT_GT(expected.size(), 20u);
  expect_same_steps(run_mixed(model, in_pass), expected);
}

// A step whose pass fails changes nothing: no state advanced, no request left, and no RNG stream took its draw, so
// the run continues exactly as one that never failed. (The model's backend samples with Backend's default.)
TEST(DecodeBatcher, FailedStepTakesNoDraw) {
  const Model& model = tiny_model();
  auto backend = std::make_shared<testing::CpuModelBackend>(model);
  const Model flaky(model.config(), backend);
  DecodeBatcher reference(model, 8), batcher(flaky, 8);
  const auto expected = run_mixed(model, reference);
  const auto got = run_mixed(model, batcher, backend.get());
  expect_same_steps(got, expected);
  EXPECT_EQ(backend->passes, static_cast<int>(expected.size()) + 2);
}

}  // namespace
}  // namespace deltaserve::engine
