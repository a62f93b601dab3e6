// CUDA graphs of pure-decode passes against the eager path, ctest label gpu: two backends on the same weights, one
// with cuda_graphs on and one with it off, run the same teacher-forced decode steps; the logits (and the request
// states downloaded at the end) must agree. Where both paths run the same kernels with the same launch shapes
// (contexts up to 512: one MLA split) the only allowed difference is none at all up to a tiny tolerance
// (kTiny); past 512 the graph's context bound may give the MLA decode more splits than the eager pass, whose
// bf16-rounded softmax weights then differ by rounding (kSplitTolerance, a tenth of the CPU-comparison tolerance
// of cuda_model_test.cpp: a wrong table or a stale graph is off by the size of the logits).
// Also: the per-phase profile (CudaBackend::enable_profile) names the phases it timed.
//
// Sampling in the pass (CudaBackend::forward_sample), eager and after a graph replay: the tokens, logprobs and
// alternatives against SamplingRule (the CPU rule) applied with the same draws to the very logits the pass sampled
// (device_logits(), themselves checked against a twin pass's forward() logits); a DecodeBatcher sampling on the device
// against one sampling on the host from forward's logits; and the timing of a decode step at Kimi's vocabulary with
// host sampling and device sampling.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "common/temp_dir.hpp"
#include "engine/cuda/cuda_backend.hpp"
#include "engine/cuda/test_compare.hpp"
#include "engine/decode_batcher.hpp"
#include "engine/make_model.hpp"
#include "engine/model.hpp"
#include "engine/model_weights.hpp"
#include "engine/sampler.hpp"
#include "engine/test_models.hpp"

namespace deltaserve::engine::cuda {
namespace {

using compare::max_abs;
using compare::max_diff;

using testing::random_tokens;

// Tolerance max |graph - eager| <= relative * max |eager| + absolute.
struct Tolerance {
  double relative, absolute;
};
constexpr Tolerance kTiny{1e-5, 1e-6};
constexpr Tolerance kSplitTolerance{5e-3, 2e-3};

// KDA head size 128 (kda_decode_step), MLA rows of 512 + 64 (mla_decode), 16 experts with top-2 so that decode
// batches up to 32 stay on the MoE decode kernel (graph-eligible). Routing is discrete, but both paths compute
// bitwise-equal router inputs while their kernels agree, so no choice can flip between them. all_experts: top-16
// (continuous routing, for the test whose paths differ by rounding; graphs then serve batches up to 4).
ModelConfig graph_test_config(bool all_experts) {
  auto preset = preset_config("tiny-linear");
  EXPECT_TRUE(preset.is_ok()) << preset.status().to_string();
  ModelConfig c = testing::real_head_sizes(*preset);
  c.moe.num_experts = 16;
  c.moe.num_experts_per_token = all_experts ? 16 : 2;
  c.moe.num_expert_groups = 1;
  c.moe.top_k_groups = 1;
  return c;
}

CudaBackendOptions graph_test_options(bool graphs) {
  CudaBackendOptions options;
  options.memory_fraction = 0.3;
  options.max_batch_tokens = 512;
  options.max_requests = 64;
  options.cache_pages = 1024;
  options.page_tokens = 16;  // contexts cross page boundaries every 16 steps
  options.cuda_graphs = graphs;
  return options;
}

// Two GPU models on one set of weights (a bf16 checkpoint): graphs on and off.
struct Pair {
  ModelConfig config;
  std::unique_ptr<Model> graph, eager;
  CudaBackend* graph_backend = nullptr;
  CudaBackend* eager_backend = nullptr;
};

Pair make_pair_of_backends(uint64_t seed, bool all_experts = false) {
  Pair p;
  p.config = graph_test_config(all_experts);
  TempDir dir;
  MakeModelOptions make;
  make.seed = seed;
  make.dtype = DType::kBF16;
  const Status written = write_random_model(p.config, dir.path(), make);
  EXPECT_TRUE(written.is_ok()) << written.to_string();
  auto checkpoint = Checkpoint::open(dir.path());
  EXPECT_TRUE(checkpoint.is_ok()) << checkpoint.status().to_string();
  if (!checkpoint.is_ok()) return p;
  auto weights = load_model_weights(**checkpoint, p.config);
  EXPECT_TRUE(weights.is_ok()) << weights.status().to_string();
  if (!weights.is_ok()) return p;
  auto graph = make_cuda_backend(p.config, *weights, graph_test_options(true));
  auto eager = make_cuda_backend(p.config, *weights, graph_test_options(false));
  EXPECT_TRUE(graph.is_ok()) << graph.status().to_string();
  EXPECT_TRUE(eager.is_ok()) << eager.status().to_string();
  if (!graph.is_ok() || !eager.is_ok()) return p;
  p.graph_backend = dynamic_cast<CudaBackend*>(graph->get());
  p.eager_backend = dynamic_cast<CudaBackend*>(eager->get());
  p.graph = std::make_unique<Model>(p.config, std::move(graph).value());
  p.eager = std::make_unique<Model>(p.config, std::move(eager).value());
  return p;
}

// Checks graph vs eager logits of one sequence; returns false (with a message naming `where`) when off.
bool expect_close(std::span<const float> graph, std::span<const float> eager, Tolerance tolerance,
                  const std::string& where) {
  const double diff = max_diff(graph, eager);
  const double bound = tolerance.relative * max_abs(eager) + tolerance.absolute;
  EXPECT_LE(diff, bound) << where << ": max |graph - eager| " << diff << " > " << bound << " (max |eager| "
                         << max_abs(eager) << ", " << eager.size() << " values)";
  return diff <= bound;
}

// One request on both backends.
struct Request {
  RequestState graph, eager;
  std::vector<int32_t> tokens;  // teacher-forced decode tokens
};

// One pass of `active` requests (one token each, step `step`) on both backends; compares every sequence's logits.
void decode_step(Pair& p, std::vector<Request*>& active, int step, Tolerance tolerance, int* failures) {
  std::vector<SequenceInput> graph_batch, eager_batch;
  for (Request* r : active) {
    const std::span<const int32_t> token(&r->tokens[static_cast<size_t>(step)], 1);
    graph_batch.push_back({&r->graph, token, false});
    eager_batch.push_back({&r->eager, token, false});
  }
  std::vector<std::vector<float>> graph_logits, eager_logits;
  const Status g = p.graph->forward(graph_batch, graph_logits);
  const Status e = p.eager->forward(eager_batch, eager_logits);
  ASSERT_TRUE(g.is_ok()) << "step " << step << " graph backend: " << g.to_string();
  ASSERT_TRUE(e.is_ok()) << "step " << step << " eager backend: " << e.to_string();
  ASSERT_EQ(graph_logits.size(), active.size());
  ASSERT_EQ(eager_logits.size(), active.size());
  for (size_t s = 0; s < active.size(); ++s) {
    const std::string where = "step " + std::to_string(step) + ", batch " + std::to_string(active.size()) +
                              ", sequence " + std::to_string(s) + " (context " +
                              std::to_string(active[s]->eager.num_tokens()) + ")";
    if (!expect_close(graph_logits[s], eager_logits[s], tolerance, where)) ++*failures;
  }
}

void prefill(Pair& p, Request& r, const std::vector<int32_t>& prompt) {
  std::vector<std::vector<float>> out;
  SequenceInput g{&r.graph, prompt, false}, e{&r.eager, prompt, false};
  ASSERT_TRUE(p.graph->forward({&g, 1}, out).is_ok());
  ASSERT_TRUE(p.eager->forward({&e, 1}, out).is_ok());
}

// The downloaded device states of both backends (KDA conv tails and recurrent states, MLA rows) agree.
void expect_same_states(const Request& r, Tolerance tolerance, const std::string& where) {
  ASSERT_TRUE(r.graph.sync_host().is_ok()) << where;
  ASSERT_TRUE(r.eager.sync_host().is_ok()) << where;
  ASSERT_EQ(r.graph.num_tokens(), r.eager.num_tokens()) << where;
  ASSERT_EQ(r.graph.kda.size(), r.eager.kda.size()) << where;
  for (size_t l = 0; l < r.graph.kda.size(); ++l) {
    const KdaLayerState &a = r.graph.kda[l], &b = r.eager.kda[l];
    const std::string at = where + ", KDA layer " + std::to_string(l);
    expect_close(a.recurrent, b.recurrent, tolerance, at + " recurrent state");
    expect_close(a.conv_q, b.conv_q, tolerance, at + " conv tail q");
    expect_close(a.conv_k, b.conv_k, tolerance, at + " conv tail k");
    expect_close(a.conv_v, b.conv_v, tolerance, at + " conv tail v");
  }
  ASSERT_EQ(r.graph.mla.size(), r.eager.mla.size()) << where;
  for (size_t l = 0; l < r.graph.mla.size(); ++l) {
    const MlaLayerCache &a = r.graph.mla[l], &b = r.eager.mla[l];
    ASSERT_EQ(a.num_tokens(), b.num_tokens()) << where << ", MLA layer " << l;
    const auto n = static_cast<size_t>(a.num_tokens() * a.width());
    expect_close({a.rows(), n}, {b.rows(), n}, tolerance, where + ", MLA layer " + std::to_string(l) + " rows");
  }
}

// Batch grows 1 -> 3 -> `largest`, a request leaves in the middle, the batch shrinks to 2; contexts cross page
// boundaries (16 tokens). Every step's logits agree; graphs were replayed and none failed to capture.
void decode_schedule(bool all_experts, size_t largest) {
  Pair p = make_pair_of_backends(21, all_experts);
  ASSERT_NE(p.graph, nullptr);
  const int64_t vocab = p.config.vocab_size;
  constexpr int kSteps = 40;
  const std::vector<int64_t> prompt_lengths = {5, 14, 15, 16, 17, 30, 31, 33};
  std::vector<std::unique_ptr<Request>> requests;
  for (size_t i = 0; i < prompt_lengths.size(); ++i) {
    auto r = std::make_unique<Request>(
        Request{p.graph->new_state(), p.eager->new_state(), random_tokens(kSteps, vocab, 100 + i)});
    prefill(p, *r, random_tokens(prompt_lengths[i], vocab, 200 + i));
    requests.push_back(std::move(r));
  }
  int failures = 0;
  for (int step = 0; step < kSteps && failures < 5; ++step) {
    std::vector<Request*> active;
    const size_t count = step < 6 ? 1 : step < 14 ? 3 : step < 32 ? largest : 2;
    for (size_t i = 0; i < count; ++i) {
      if (i == 3 && step >= 22) continue;  // request 3 leaves mid-way (batch largest - 1 from step 22)
      active.push_back(requests[i].get());
    }
    decode_step(p, active, step, kTiny, &failures);
    if (step == 22) {
      requests[3].reset();  // its slot and pages go back while the others continue
      requests[3] = std::make_unique<Request>(Request{p.graph->new_state(), p.eager->new_state(), {}});
    }
  }
  const CudaBackend::GraphStats stats = p.graph_backend->graph_stats();
  std::printf("graph backend: %lld captured, %lld replays, %lld cached, %lld failed\n",
              static_cast<long long>(stats.captures), static_cast<long long>(stats.replays),
              static_cast<long long>(stats.cached), static_cast<long long>(stats.failed));
  EXPECT_EQ(stats.failed, 0) << "a decode graph failed to capture (see stderr)";
  EXPECT_GE(stats.captures, 4) << "batch sizes 1, 3, largest, largest - 1, 2 each run more than once";
  EXPECT_GE(stats.replays, kSteps - 10) << "most steps should replay a graph";
  EXPECT_EQ(p.eager_backend->graph_stats().replays, 0);
  EXPECT_EQ(p.eager_backend->graph_stats().captures, 0);
  for (size_t i = 0; i < 3; ++i) expect_same_states(*requests[i], kTiny, "request " + std::to_string(i));
}

// Top-2 of 16 experts: batches up to 8 are graph-eligible. A failure far above kTiny here while the all-experts
// variant below passes means the two paths differ by rounding and a routing near-tie flipped (then look for the
// first step that failed and its size), not a wrong table.
TEST(CudaGraphs, DecodeMatchesEagerAcrossBatchSizesAndPages) {
  decode_schedule(/*all_experts=*/false, 8);
}

// All 16 experts per token (continuous routing): graph-eligible up to batch 4 (16 rows per token <= 4 per expert).
TEST(CudaGraphs, DecodeMatchesEagerAllExperts) {
  decode_schedule(/*all_experts=*/true, 4);
}

// A context passing 512 needs a larger context bound: a second graph for the same batch size. There the MLA split
// count of the graph may differ from the eager pass (rounding-level differences only; all-experts routing, so no
// expert choice can flip on them).
TEST(CudaGraphs, ContextBoundGrowsPast512) {
  Pair p = make_pair_of_backends(22, /*all_experts=*/true);
  ASSERT_NE(p.graph, nullptr);
  const int64_t vocab = p.config.vocab_size;
  constexpr int kSteps = 16;
  Request a{p.graph->new_state(), p.eager->new_state(), random_tokens(kSteps, vocab, 31)};
  Request b{p.graph->new_state(), p.eager->new_state(), random_tokens(kSteps, vocab, 32)};
  prefill(p, a, random_tokens(504, vocab, 33));
  prefill(p, b, random_tokens(300, vocab, 34));
  int failures = 0;
  std::vector<Request*> active = {&a, &b};
  for (int step = 0; step < kSteps && failures < 5; ++step) {
    // Contexts up to 512 share the graph bound 512 with the eager pass's single split.
    const Tolerance tolerance = a.eager.num_tokens() + 1 <= 512 ? kTiny : kSplitTolerance;
    decode_step(p, active, step, tolerance, &failures);
  }
  EXPECT_EQ(a.eager.num_tokens(), 504 + kSteps);
  const CudaBackend::GraphStats stats = p.graph_backend->graph_stats();
  EXPECT_EQ(stats.failed, 0);
  EXPECT_GE(stats.captures, 2) << "bounds 512 and 1024";
  expect_same_states(b, kSplitTolerance, "request b");
}

// Logits left on the device (forward_on_device) by a replayed graph equal the eager backend's host logits, and
// switching graphs off at run time stops the replays.
TEST(CudaGraphs, DeviceLogitsAndRuntimeSwitch) {
  Pair p = make_pair_of_backends(23);
  ASSERT_NE(p.graph, nullptr);
  const int64_t vocab = p.config.vocab_size;
  Request a{p.graph->new_state(), p.eager->new_state(), random_tokens(8, vocab, 41)};
  Request b{p.graph->new_state(), p.eager->new_state(), random_tokens(8, vocab, 42)};
  prefill(p, a, random_tokens(20, vocab, 43));
  prefill(p, b, random_tokens(9, vocab, 44));
  for (int step = 0; step < 4; ++step) {
    std::vector<SequenceInput> graph_batch = {{&a.graph, {&a.tokens[step], 1}, false},
                                              {&b.graph, {&b.tokens[step], 1}, false}};
    std::vector<SequenceInput> eager_batch = {{&a.eager, {&a.tokens[step], 1}, false},
                                              {&b.eager, {&b.tokens[step], 1}, false}};
    ASSERT_TRUE(p.graph_backend->forward_on_device(graph_batch).is_ok());
    ASSERT_TRUE(p.graph_backend->synchronize().is_ok());
    std::vector<float> device(static_cast<size_t>(2 * vocab));
    ASSERT_EQ(cudaMemcpy(device.data(), p.graph_backend->device_logits(), device.size() * sizeof(float),
                         cudaMemcpyDeviceToHost),
              cudaSuccess);
    std::vector<std::vector<float>> eager_logits;
    ASSERT_TRUE(p.eager->forward(eager_batch, eager_logits).is_ok());
    for (size_t s = 0; s < 2; ++s) {
      expect_close(std::span<const float>(device).subspan(s * vocab, vocab), eager_logits[s], kTiny,
                   "device logits, step " + std::to_string(step) + ", sequence " + std::to_string(s));
    }
  }
  const int64_t replays = p.graph_backend->graph_stats().replays;
  EXPECT_GE(replays, 3) << "steps after the warm-up replay";
  p.graph_backend->set_cuda_graphs(false);
  EXPECT_FALSE(p.graph_backend->cuda_graphs());
  int failures = 0;
  std::vector<Request*> active = {&a, &b};
  decode_step(p, active, 4, kTiny, &failures);
  EXPECT_EQ(p.graph_backend->graph_stats().replays, replays);
  p.graph_backend->set_cuda_graphs(true);
  decode_step(p, active, 5, kTiny, &failures);
  EXPECT_EQ(p.graph_backend->graph_stats().replays, replays + 1);
  // clear_cuda_graphs: none cached; the next pass of the (already seen) shape captures again and replays the new
  // graph, the one after it replays it, both still matching eager.
  const CudaBackend::GraphStats before = p.graph_backend->graph_stats();
  p.graph_backend->clear_cuda_graphs();
  EXPECT_EQ(p.graph_backend->graph_stats().cached, 0);
  decode_step(p, active, 6, kTiny, &failures);
  decode_step(p, active, 7, kTiny, &failures);
  EXPECT_EQ(p.graph_backend->graph_stats().captures, before.captures + 1);
  EXPECT_EQ(p.graph_backend->graph_stats().replays, before.replays + 2);
  EXPECT_EQ(p.graph_backend->graph_stats().cached, 1);
  EXPECT_EQ(failures, 0);
}

// The profile of eager passes names the phases of the layers this model has; graph replays count as one phase;
// off by default.
TEST(CudaGraphs, ProfileNamesThePhases) {
  Pair p = make_pair_of_backends(24);
  ASSERT_NE(p.graph, nullptr);
  EXPECT_TRUE(p.eager_backend->profile().empty()) << "profiling is off by default";
  p.eager_backend->enable_profile(true);
  p.graph_backend->enable_profile(true);
  const int64_t vocab = p.config.vocab_size;
  Request a{p.graph->new_state(), p.eager->new_state(), random_tokens(4, vocab, 51)};
  prefill(p, a, random_tokens(40, vocab, 52));
  int failures = 0;
  std::vector<Request*> active = {&a};
  for (int step = 0; step < 4; ++step) decode_step(p, active, step, kTiny, &failures);
  auto has = [](const std::vector<std::pair<std::string, double>>& rows, const std::string& phase) {
    for (const auto& [name, ms] : rows) {
      if (name == phase) return ms > 0.0;
    }
    return false;
  };
  const auto eager = p.eager_backend->profile();
  std::printf("%s", p.eager_backend->profile_table().c_str());
  for (const char* phase : {"table upload", "embedding", "norms + AttnRes", "KDA projections", "KDA conv (prep)",
                            "KDA recurrence", "KDA output", "MLA projections", "MLA attention", "MLA output",
                            "MoE router", "MoE plan", "MoE expert FFN", "MoE combine", "LM head"}) {
    EXPECT_TRUE(has(eager, phase)) << "eager profile lacks a positive time for '" << phase << "'\n"
                                   << p.eager_backend->profile_table();
  }
  EXPECT_FALSE(has(eager, "decode graph (whole step)"));
  EXPECT_TRUE(has(p.graph_backend->profile(), "decode graph (whole step)")) << p.graph_backend->profile_table();
  p.eager_backend->reset_profile();
  EXPECT_TRUE(p.eager_backend->profile().empty());
}

// ---- sampling in the pass (forward_sample) -------------------------------------------------------------------

// The logprob tolerance of one computation (the kernel's fp64 sums in another order than the CPU's).
constexpr double kLogprobAtol = 2e-6, kLogprobRtol = 1e-6;

bool logprob_close(double got, double expected) {
  return std::fabs(got - expected) <= kLogprobAtol + kLogprobRtol * std::fabs(expected);
}

// A row kind: its params, whether it reports logprobs, and whether the GPU must pick the CPU's very token (everything
// but top_p < 1 over more than 64 top-k candidates, where only the nucleus is the same: kernels/cuda/ops/sampling.hpp).
struct SampleKind {
  SamplingParams params;
  bool logprobs;
  bool exact;
};

std::vector<SampleKind> sample_kinds() {
  return {{{.temperature = 0.0f, .top_logprobs = 5}, true, true},
          {{.temperature = 0.0f}, false, true},
          {{.temperature = 0.8f, .seed = 1}, false, true},
          {{.temperature = 1.0f, .top_k = 40, .seed = 2, .top_logprobs = 20}, true, true},
          {{.temperature = 0.9f, .top_p = 0.9f, .top_k = 64, .seed = 3, .top_logprobs = 1}, true, true},
          {{.temperature = 0.7f, .top_k = 1, .seed = 4}, true, true},
          {{.temperature = 1.2f, .top_p = 0.8f, .seed = 5, .top_logprobs = 3}, true, false}};
}

// Whether `token` lies in the nucleus of `params` over `logits` (value desc, id asc; fewest best of the top-k whose
// mass at the temperature reaches top_p of the top-k mass), in fp64.
bool in_nucleus(std::span<const float> logits, const SamplingParams& params, int32_t token) {
  std::vector<int32_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
  const auto vocab = static_cast<int64_t>(logits.size());
  const int64_t k = params.top_k > 0 ? std::min<int64_t>(params.top_k, vocab) : vocab;
  const double max_value = logits[order[0]], inverse_t = 1.0 / params.temperature;
  double mass = 0.0;
  for (int64_t i = 0; i < k; ++i) mass += std::exp((logits[order[i]] - max_value) * inverse_t);
  double cumulative = 0.0;
  int64_t nucleus = k;
  for (int64_t i = 0; i < k; ++i) {
    cumulative += std::exp((logits[order[i]] - max_value) * inverse_t);
    if (cumulative >= mass * params.top_p * (1.0 - 1e-12)) {  // rounding: a nucleus one token longer is fine
      nucleus = std::min<int64_t>(i + 2, k);
      break;
    }
  }
  const auto rank = std::find(order.begin(), order.end(), token) - order.begin();
  return rank < nucleus;
}

// The GPU's result for one row against SamplingRule on the logits it sampled from. Returns false when off.
bool expect_sampled(const SampledToken& got, const SampleRequest& row, bool exact, std::span<const float> logits,
                    const std::string& where) {
  SamplingRule rule;
  const SampledToken cpu = rule.apply(row, logits);
  bool ok = true;
  if (exact) {
    EXPECT_EQ(got.token, cpu.token) << where << ": GPU token differs from SamplingRule's";
    ok = ok && got.token == cpu.token;
  } else {
    EXPECT_TRUE(in_nucleus(logits, row.params, got.token))
        << where << ": token " << got.token << " outside the nucleus";
  }
  if (!row.logprobs) {
    EXPECT_EQ(got.logprob, 0.0f) << where;
    EXPECT_TRUE(got.top.empty()) << where;
    return ok;
  }
  // The logprob of the GPU's own token (another than the CPU's in inexact rows) against an fp64 log-softmax.
  double max_value = -INFINITY, sum = 0.0;
  for (float v : logits) max_value = std::max<double>(max_value, v);
  for (float v : logits) sum += std::exp(v - max_value);
  const double expected = logits[static_cast<size_t>(got.token)] - max_value - std::log(sum);
  EXPECT_TRUE(logprob_close(got.logprob, expected)) << where << ": logprob " << got.logprob << ", fp64 " << expected;
  EXPECT_TRUE(got.token != cpu.token || logprob_close(got.logprob, cpu.logprob))
      << where << ": logprob " << got.logprob << ", SamplingRule " << cpu.logprob;
  EXPECT_EQ(got.top.size(), cpu.top.size()) << where;
  for (size_t k = 0; k < std::min(got.top.size(), cpu.top.size()); ++k) {
    EXPECT_EQ(got.top[k].token, cpu.top[k].token) << where << " alternative " << k;
    EXPECT_TRUE(logprob_close(got.top[k].logprob, cpu.top[k].logprob))
        << where << " alternative " << k << ": " << got.top[k].logprob << " vs " << cpu.top[k].logprob;
  }
  return ok;
}

// Batches of `batch` requests of every kind, 6 teacher-forced steps, on the graph or the eager backend of a pair:
// each step's forward_sample results against SamplingRule on device_logits() (the pass's own logits, one LM-head piece
// here) with the same draws, and those logits against a twin request set's forward() logits of the same step.
void sampled_steps(Pair& p, bool graph, size_t batch) {
  Model& model = graph ? *p.graph : *p.eager;
  CudaBackend& backend = graph ? *p.graph_backend : *p.eager_backend;
  const int64_t vocab = p.config.vocab_size;
  ASSERT_LE(static_cast<int64_t>(batch), backend.logit_chunk_rows());
  const std::vector<SampleKind> kinds = sample_kinds();
  std::vector<RequestState> states, twins;
  std::vector<Sampler> samplers;
  std::vector<const SampleKind*> kind_of;
  for (size_t i = 0; i < batch; ++i) {
    states.push_back(model.new_state());
    twins.push_back(model.new_state());
    const SampleKind& kind = kinds[i % kinds.size()];
    SamplingParams params = kind.params;
    params.seed += 1000 * i;
    samplers.emplace_back(params);
    kind_of.push_back(&kind);
  }
  for (size_t i = 0; i < batch; ++i) {
    const auto prompt = random_tokens(5 + 3 * static_cast<int64_t>(i), vocab, 300 + static_cast<uint32_t>(i));
    std::vector<std::vector<float>> out;
    SequenceInput a{&states[i], prompt, false}, b{&twins[i], prompt, false};
    ASSERT_TRUE(model.forward({&a, 1}, out).is_ok());
    ASSERT_TRUE(model.forward({&b, 1}, out).is_ok());
  }
  const int64_t replays_before = backend.graph_stats().replays;
  int failures = 0;
  for (int step = 0; step < 6 && failures < 5; ++step) {
    const auto tokens = random_tokens(static_cast<int64_t>(batch), vocab, 400 + static_cast<uint32_t>(step));
    std::vector<SequenceInput> inputs, twin_inputs;
    std::vector<SampleRequest> rows;
    for (size_t i = 0; i < batch; ++i) {
      inputs.push_back({&states[i], {&tokens[i], 1}, false});
      twin_inputs.push_back({&twins[i], {&tokens[i], 1}, false});
      rows.push_back({samplers[i].params(), samplers[i].peek_draw(), kind_of[i]->logprobs});
    }
    std::vector<SampledToken> sampled;
    const Status status = model.forward_sample(inputs, rows, sampled);
    ASSERT_TRUE(status.is_ok()) << status.to_string();
    ASSERT_EQ(sampled.size(), batch);
    for (Sampler& sampler : samplers) (void)sampler.next_draw();
    std::vector<float> device(batch * static_cast<size_t>(vocab));
    ASSERT_EQ(cudaMemcpy(device.data(), backend.device_logits(), device.size() * sizeof(float), cudaMemcpyDeviceToHost),
              cudaSuccess);
    std::vector<std::vector<float>> twin_logits;
    ASSERT_TRUE(model.forward(twin_inputs, twin_logits).is_ok());
    for (size_t i = 0; i < batch; ++i) {
      const std::string where = std::string(graph ? "graph" : "eager") + " batch " + std::to_string(batch) + ", step " +
                                std::to_string(step) + ", sequence " + std::to_string(i);
      const std::span<const float> row(device.data() + i * vocab, static_cast<size_t>(vocab));
      if (!expect_close(row, twin_logits[i], kTiny, where + " (sampled logits vs forward)")) ++failures;
      if (!expect_sampled(sampled[i], rows[i], kind_of[i]->exact, row, where)) ++failures;
    }
  }
  if (graph) {
    EXPECT_GE(backend.graph_stats().replays - replays_before, 6) << "sampled passes after a replay";
  } else {
    EXPECT_EQ(backend.graph_stats().replays, 0);
  }
}

TEST(CudaSampling, ForwardSampleMatchesTheRuleOnItsLogits) {
  Pair p = make_pair_of_backends(25);
  ASSERT_NE(p.graph, nullptr);
  for (size_t batch : {1, 3, 17}) {
    sampled_steps(p, /*graph=*/false, batch);
    sampled_steps(p, /*graph=*/true, batch);
  }
}

// A sampled pass checks its rows; nothing advances on an error.
TEST(CudaSampling, ForwardSampleRejectsBadRows) {
  Pair p = make_pair_of_backends(26);
  ASSERT_NE(p.graph, nullptr);
  RequestState state = p.eager->new_state();
  const std::vector<int32_t> tokens = {1, 2};
  SequenceInput input{&state, tokens, false};
  std::vector<SampledToken> out;
  const SampleRequest good{{}, 0.5, false};
  const std::vector<SampleRequest> two = {good, good};
  EXPECT_EQ(p.eager_backend->forward_sample({&input, 1}, two, out, {}).code(), StatusCode::kInvalidArgument);
  const std::vector<SampleRequest> bad_draw = {{{}, 1.5, false}};
  EXPECT_EQ(p.eager_backend->forward_sample({&input, 1}, bad_draw, out, {}).code(), StatusCode::kInvalidArgument);
  SequenceInput all{&state, tokens, true};
  const std::vector<SampleRequest> one = {good};
  EXPECT_EQ(p.eager_backend->forward_sample({&all, 1}, one, out, {}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(state.num_tokens(), 0);
  ASSERT_TRUE(p.eager_backend->forward_sample({&input, 1}, one, out, {}).is_ok());
  EXPECT_EQ(state.num_tokens(), 2);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_GE(out[0].token, 0);
  EXPECT_LT(out[0].token, p.config.vocab_size);
}

// Outputs of two batchers, step by step: tokens and finish exactly; logprobs of two passes of the same computation.
void expect_same_outputs(const std::vector<DecodeStepOutput>& got, const std::vector<DecodeStepOutput>& expected,
                         const std::string& where, int* failures) {
  ASSERT_EQ(got.size(), expected.size()) << where;
  constexpr double kTwinLogprob = 1e-3;  // two passes agree to kTiny in the logits
  for (size_t i = 0; i < got.size(); ++i) {
    const DecodeStepOutput &a = got[i], &b = expected[i];
    const std::string at = where + " " + b.request_id;
    EXPECT_EQ(a.request_id, b.request_id) << at;
    if (a.sampled.token != b.sampled.token) ++*failures;
    EXPECT_EQ(a.sampled.token, b.sampled.token) << at;
    EXPECT_NEAR(a.sampled.logprob, b.sampled.logprob, kTwinLogprob) << at;
    ASSERT_EQ(a.sampled.top.size(), b.sampled.top.size()) << at;
    for (size_t k = 0; k < a.sampled.top.size(); ++k) {
      EXPECT_NEAR(a.sampled.top[k].logprob, b.sampled.top[k].logprob, kTwinLogprob) << at << " alternative " << k;
      // Ids may swap only where two alternatives are that close.
      if (a.sampled.top[k].token != b.sampled.top[k].token) {
        EXPECT_TRUE(k + 1 < a.sampled.top.size() &&
                    std::fabs(a.sampled.top[k].logprob - a.sampled.top[k + 1].logprob) <= kTwinLogprob)
            << at << " alternative " << k << ": " << a.sampled.top[k].token << " vs " << b.sampled.top[k].token;
      }
    }
    EXPECT_EQ(a.completion_tokens, b.completion_tokens) << at;
    EXPECT_EQ(a.finished, b.finished) << at;
    EXPECT_EQ(a.finish_reason, b.finish_reason) << at;
  }
}

// A DecodeBatcher sampling on the device and one sampling on the host (forward's logits, each Sampler), on the same
// CUDA model, 32 steps of requests with mixed params (the kinds where the GPU must pick the CPU's token), joining at
// different steps: the same outputs. On the graph backend (sampling after replays) and the eager one.
TEST(CudaSampling, DecodeBatcherOnTheDeviceEqualsHostSampling) {
  Pair p = make_pair_of_backends(27);
  ASSERT_NE(p.graph, nullptr);
  std::vector<SampleKind> kinds = sample_kinds();
  kinds.erase(std::remove_if(kinds.begin(), kinds.end(), [](const SampleKind& k) { return !k.exact; }), kinds.end());
  for (bool graph : {true, false}) {
    const Model& model = graph ? *p.graph : *p.eager;
    const int64_t vocab = p.config.vocab_size;
    DecodeBatcher device(model, 16), host(model, 16, /*host_sampling=*/true);
    ASSERT_FALSE(device.host_sampling());
    const int64_t replays_before = (graph ? p.graph_backend : p.eager_backend)->graph_stats().replays;
    int failures = 0, steps = 0;
    for (int step = 0; step < 40 && failures < 3; ++step) {
      if (step < 8) {  // one request joins at each of the first 8 steps
        DecodeParams params;
        params.sampling = kinds[static_cast<size_t>(step) % kinds.size()].params;
        params.sampling.seed += 77 * static_cast<uint64_t>(step);
        params.logprobs = kinds[static_cast<size_t>(step) % kinds.size()].logprobs;
        params.max_tokens = 32;
        const auto prompt = random_tokens(4 + 5 * step, vocab, 500 + static_cast<uint32_t>(step));
        for (DecodeBatcher* batcher : {&device, &host}) {
          RequestState state = model.new_state();
          const auto head = std::span<const int32_t>(prompt).first(prompt.size() - 1);
          ASSERT_TRUE(model.prefill(state, head).is_ok());
          ASSERT_TRUE(state.sync_host().is_ok());  // the batcher checks the host containers' shapes
          ASSERT_TRUE(batcher->add("r" + std::to_string(step), std::move(state), prompt.back(), params).is_ok());
        }
      }
      if (device.active() == 0) break;
      auto on_device = device.step();
      auto on_host = host.step();
      ASSERT_TRUE(on_device.is_ok()) << on_device.status().to_string();
      ASSERT_TRUE(on_host.is_ok()) << on_host.status().to_string();
      expect_same_outputs(*on_device, *on_host,
                          std::string(graph ? "graph" : "eager") + " step " + std::to_string(step), &failures);
      ++steps;
    }
    EXPECT_EQ(device.active(), 0);
    EXPECT_GE(steps, 32 + 7);
    const int64_t replays = (graph ? p.graph_backend : p.eager_backend)->graph_stats().replays - replays_before;
    if (graph) {
      EXPECT_GT(replays, steps) << "both batchers' steps should mostly replay graphs";
    }
  }
}

// The decode step at Kimi's vocabulary (163840), batch 1, 64 and 256: forward only (logits stay on the device),
// host sampling (forward copies every row's logits to the host, each Sampler samples there) and forward_sample
// (sampled on the device, tokens back), greedy and top-p 0.95 at temperature 0.8. Host wall time per step; the GPU
// time of the sampling phase (kernels + result copy) from the backend's profile, and the logit bytes it reads once
// as a share of 4.26 TB/s. Asserts only correctness: the last step's tokens against SamplingRule on its logits.
TEST(CudaSampling, DecodeStepTiming) {
  ModelConfig config = graph_test_config(/*all_experts=*/false);
  config.vocab_size = 163840;
  CudaBackendOptions options = graph_test_options(/*graphs=*/true);
  options.memory_fraction = 0.5;
  options.max_requests = 512;
  options.cache_pages = 16384;
  auto made = make_cuda_backend_random(config, 9, options);
  ASSERT_TRUE(made.is_ok()) << made.status().to_string();
  auto* backend = dynamic_cast<CudaBackend*>(made->get());
  const Model model(config, std::move(made).value());
  const int64_t vocab = config.vocab_size;
  constexpr size_t kMaxBatch = 256;
  ASSERT_GE(backend->logit_chunk_rows(), static_cast<int64_t>(kMaxBatch));
  // Two request sets (device sampling, host sampling) at a context of 64, zero states (the step's work is the same).
  std::vector<RequestState> fresh;
  for (size_t i = 0; i < kMaxBatch * 2; ++i) {
    fresh.push_back(model.new_state());
    ASSERT_TRUE(backend->assume_context(fresh.back(), 64).is_ok());
  }
  std::mt19937 rng(5);
  struct Mix {
    const char* name;
    SamplingParams params;
  };
  const Mix mixes[] = {{"greedy", {.temperature = 0.0f}}, {"top-p 0.95 T 0.8", {.temperature = 0.8f, .top_p = 0.95f}}};
  for (size_t batch : {size_t{1}, size_t{64}, kMaxBatch}) {
    for (const Mix& mix : mixes) {
      std::vector<Sampler> samplers;
      for (size_t i = 0; i < batch; ++i) {
        SamplingParams params = mix.params;
        params.seed = 10 * i + 1;
        samplers.emplace_back(params);
      }
      std::vector<int32_t> tokens(batch), host_tokens(batch);
      auto next_tokens = [&] {
        for (int32_t& t : tokens) t = static_cast<int32_t>(rng() % static_cast<uint32_t>(vocab));
      };
      auto inputs = [&](size_t offset) {
        std::vector<SequenceInput> in;
        for (size_t i = 0; i < batch; ++i) in.push_back({&fresh[offset + i], {&tokens[i], 1}, false});
        return in;
      };
      std::vector<SampleRequest> rows(batch);
      std::vector<SampledToken> sampled;
      auto device_step = [&] {
        next_tokens();
        auto in = inputs(0);
        for (size_t i = 0; i < batch; ++i) rows[i] = {samplers[i].params(), samplers[i].peek_draw(), false};
        const Status status = model.forward_sample(in, rows, sampled);
        ASSERT_TRUE(status.is_ok()) << status.to_string();
        for (Sampler& sampler : samplers) (void)sampler.next_draw();
      };
      auto host_step = [&] {
        next_tokens();
        auto in = inputs(kMaxBatch);
        std::vector<std::vector<float>> logits;
        ASSERT_TRUE(model.forward(in, logits).is_ok());
        for (size_t i = 0; i < batch; ++i) host_tokens[i] = samplers[i].sample(logits[i]).token;
      };
      auto forward_only = [&] {
        next_tokens();
        auto in = inputs(0);
        ASSERT_TRUE(backend->forward_on_device(in).is_ok());
        ASSERT_TRUE(backend->synchronize().is_ok());
      };
      auto time_ms = [&](auto&& step, int steps) {
        for (int i = 0; i < 3; ++i) step();  // the eager warm-up and the capture of this batch size's graph
        const auto begin = std::chrono::steady_clock::now();
        for (int i = 0; i < steps; ++i) step();
        return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - begin).count() / steps;
      };
      const int steps = batch >= 256 ? 5 : 20;  // the host path samples 256 rows of 163840 logits per step
      const double forward_ms = time_ms(forward_only, steps);
      const double host_ms = time_ms(host_step, steps);
      const double device_ms = time_ms(device_step, steps);
      backend->reset_profile();
      backend->enable_profile(true);
      for (int i = 0; i < steps; ++i) device_step();
      backend->enable_profile(false);
      double sampling_ms = 0.0;
      for (const auto& [phase, ms] : backend->profile()) {
        if (phase == "sampling") sampling_ms = ms / steps;
      }
      backend->reset_profile();
      // Correctness of the last step: every row against SamplingRule on the logits it sampled from.
      std::vector<float> device(batch * static_cast<size_t>(vocab));
      ASSERT_EQ(
          cudaMemcpy(device.data(), backend->device_logits(), device.size() * sizeof(float), cudaMemcpyDeviceToHost),
          cudaSuccess);
      const bool exact = mix.params.top_p == 1.0f;
      for (size_t i = 0; i < batch && (exact || i < 64); ++i) {  // (the nucleus check sorts a row on the host)
        const std::span<const float> row(device.data() + i * vocab, static_cast<size_t>(vocab));
        expect_sampled(sampled[i], rows[i], exact, row,
                       std::string(mix.name) + " batch " + std::to_string(batch) + " row " + std::to_string(i));
      }
      const double logit_mb = static_cast<double>(batch) * vocab * 4 / 1e6;
      const double read_share = sampling_ms > 0 ? logit_mb * 1e6 / (sampling_ms * 1e-3) / 4.26e12 : 0.0;
      std::printf(
          "[ timing ] decode step, vocab %lld, batch %zu, %s: forward only %.3f ms | old: forward + %.1f MB of logits "
          "to the host + CPU Sampler %.3f ms | new: forward_sample %.3f ms, GPU sampling phase %.3f ms (one read of "
          "the logits = %.1f%% of 4.26 TB/s)\n",
          static_cast<long long>(vocab), batch, mix.name, forward_ms, logit_mb, host_ms, device_ms, sampling_ms,
          100.0 * read_share);
    }
  }
}

}  // namespace
}  // namespace deltaserve::engine::cuda
