// CUDA graphs of pure-decode passes against the eager path, ctest label gpu: two backends on the same weights, one
// with cuda_graphs on and one with it off, run the same teacher-forced decode steps; the logits (and the request
// states downloaded at the end) must agree. Where both paths run the same kernels with the same launch shapes
// (contexts up to 512: one MLA split) the only allowed difference is none at all up to a tiny tolerance
// (kTiny); past 512 the graph's context bound may give the MLA decode more splits than the eager pass, whose
// bf16-rounded softmax weights then differ by rounding (kSplitTolerance, a tenth of the CPU-comparison tolerance
// of cuda_model_test.cpp: a wrong table or a stale graph is off by the size of the logits).
// Also: the per-phase profile (CudaBackend::enable_profile) names the phases it timed.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "common/temp_dir.hpp"
#include "engine/cuda/cuda_backend.hpp"
#include "engine/cuda/test_compare.hpp"
#include "engine/make_model.hpp"
#include "engine/model.hpp"
#include "engine/model_weights.hpp"
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
  ModelConfig c = *preset;
  c.hidden_size = 256;
  c.intermediate_size = 256;
  c.kda.num_heads = 2;
  c.kda.head_dim = 128;
  c.kda.gate_low_rank = 128;
  c.mla.num_heads = 2;
  c.mla.kv_lora_rank = 512;
  c.mla.qk_rope_head_dim = 64;
  c.mla.qk_nope_head_dim = 128;
  c.mla.v_head_dim = 128;
  if (c.mla.q_lora_rank) c.mla.q_lora_rank = 64;
  c.moe.num_experts = 16;
  c.moe.num_experts_per_token = all_experts ? 16 : 2;
  c.moe.num_expert_groups = 1;
  c.moe.top_k_groups = 1;
  c.moe.moe_intermediate_size = 64;
  if (c.moe.routed_expert_hidden_size) c.moe.routed_expert_hidden_size = 128;
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

// DELTASERVE_CUDA_GRAPHS=0 (the bypass) turns graphs off in every backend: nothing to compare then.
bool graphs_forced_off() {
  const char* value = std::getenv("DELTASERVE_CUDA_GRAPHS");
  return value != nullptr && std::string(value) == "0";
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
  if (graphs_forced_off()) GTEST_SKIP() << "DELTASERVE_CUDA_GRAPHS=0";
  decode_schedule(/*all_experts=*/false, 8);
}

// All 16 experts per token (continuous routing): graph-eligible up to batch 4 (16 rows per token <= 4 per expert).
TEST(CudaGraphs, DecodeMatchesEagerAllExperts) {
  if (graphs_forced_off()) GTEST_SKIP() << "DELTASERVE_CUDA_GRAPHS=0";
  decode_schedule(/*all_experts=*/true, 4);
}

// A context passing 512 needs a larger context bound: a second graph for the same batch size. There the MLA split
// count of the graph may differ from the eager pass (rounding-level differences only; all-experts routing, so no
// expert choice can flip on them).
TEST(CudaGraphs, ContextBoundGrowsPast512) {
  if (graphs_forced_off()) GTEST_SKIP() << "DELTASERVE_CUDA_GRAPHS=0";
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
  if (graphs_forced_off()) GTEST_SKIP() << "DELTASERVE_CUDA_GRAPHS=0";
  Pair p = make_pair_of_backends(23);
  ASSERT_NE(p.graph, nullptr);
  const int64_t vocab = p.config.vocab_size;
  Request a{p.graph->new_state(), p.eager->new_state(), random_tokens(6, vocab, 41)};
  Request b{p.graph->new_state(), p.eager->new_state(), random_tokens(6, vocab, 42)};
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
}

// The profile of eager passes names the phases of the layers this model has; graph replays count as one phase;
// off by default.
TEST(CudaGraphs, ProfileNamesThePhases) {
  if (graphs_forced_off()) GTEST_SKIP() << "DELTASERVE_CUDA_GRAPHS=0";
  Pair p = make_pair_of_backends(24);
  ASSERT_NE(p.graph, nullptr);
  if (std::getenv("DELTASERVE_CUDA_PROFILE") == nullptr) {
    EXPECT_TRUE(p.eager_backend->profile().empty()) << "profiling is off by default";
  }
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

}  // namespace
}  // namespace deltaserve::engine::cuda
