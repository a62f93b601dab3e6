// CPU engine throughput on the tiny presets: prefill tokens/s (one request, chunked) and decode
// tokens/s (a batch of B requests, one token each per step). Run through bench/cpu_engine.sh, which
// records the results as JSON lines with date, commit and machine.
#include <filesystem>
#include <map>
#include <memory>
#include <random>
#include <string>

#include <benchmark/benchmark.h>

#include "engine/make_model.hpp"
#include "engine/model.hpp"
#include "engine/model_inspect.hpp"
#include "kernels/cpu/basic_ops.hpp"
#include "kernels/cpu/thread_pool.hpp"

namespace {

using deltaserve::engine::Model;

Model& model_for(const std::string& preset) {
  static std::map<std::string, std::unique_ptr<Model>> models;
  auto& slot = models[preset];
  if (!slot) {
    const auto dir = std::filesystem::temp_directory_path() / ("ds_bench_" + preset + "_" + std::to_string(::getpid()));
    auto config = deltaserve::engine::preset_config(preset);
    if (!config.is_ok() || !deltaserve::engine::write_random_model(*config, dir, {}).is_ok()) std::abort();
    auto model = Model::load(dir);
    std::filesystem::remove_all(dir);
    if (!model.is_ok()) std::abort();
    slot = std::move(model).value();
  }
  return *slot;
}

std::vector<int32_t> tokens(int64_t n, int64_t vocab) {
  std::mt19937 rng(1);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = static_cast<int32_t>(rng() % static_cast<uint32_t>(vocab));
  return t;
}

// Matmul FLOPs per token ≈ 2 × parameters a token touches (attention over the context is extra and
// small at these lengths); the report divides throughput by the ceiling measured below.
double flops_per_token(const Model& model) {
  return 2.0 * static_cast<double>(deltaserve::engine::count_parameters(model.config()).active_per_token);
}

// The ceiling: fp32 FLOP/s of the engine's own matmul at a size where it is compute-bound.
void BM_LinearCeiling(benchmark::State& state) {
  const int64_t n = state.range(0);
  std::vector<float> x(static_cast<size_t>(n * n), 0.5f), w(x.size(), 0.25f), y(x.size());
  for (auto _ : state) {
    deltaserve::kernels::cpu::linear(x.data(), w.data(), y.data(), n, n, n);
    benchmark::DoNotOptimize(y.data());
  }
  state.counters["flops_per_s"] = benchmark::Counter(
      2.0 * static_cast<double>(n * n * n) * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
}

void BM_Prefill(benchmark::State& state, const std::string& preset) {
  Model& model = model_for(preset);
  const auto prompt = tokens(state.range(0), model.config().vocab_size);
  for (auto _ : state) {
    auto request = model.new_state();
    auto logits = model.prefill(request, prompt, 512);
    benchmark::DoNotOptimize(logits);
  }
  state.counters["tokens_per_s"] =
      benchmark::Counter(static_cast<double>(state.iterations() * state.range(0)), benchmark::Counter::kIsRate);
  state.counters["flops_per_token"] = flops_per_token(model);
}

void BM_Decode(benchmark::State& state, const std::string& preset) {
  Model& model = model_for(preset);
  const int64_t batch = state.range(0), context = 128;
  const int64_t vocab = model.config().vocab_size;
  std::vector<deltaserve::engine::RequestState> requests;
  const auto prompt = tokens(context, vocab);
  for (int64_t b = 0; b < batch; ++b) {
    requests.push_back(model.new_state());
    (void)model.prefill(requests.back(), prompt, 512);
  }
  std::vector<int32_t> next(static_cast<size_t>(batch), 1);
  std::vector<std::vector<float>> logits;
  int64_t steps = 0;
  for (auto _ : state) {
    std::vector<deltaserve::engine::SequenceInput> inputs;
    for (int64_t b = 0; b < batch; ++b)
      inputs.push_back({&requests[static_cast<size_t>(b)], {&next[static_cast<size_t>(b)], 1}, false});
    if (!model.forward(inputs, logits).is_ok()) std::abort();
    ++steps;
  }
  state.counters["tokens_per_s"] = benchmark::Counter(static_cast<double>(steps * batch), benchmark::Counter::kIsRate);
  state.counters["flops_per_token"] = flops_per_token(model);
}

}  // namespace

BENCHMARK(BM_LinearCeiling)->Arg(512)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Prefill, tiny_linear, std::string("tiny-linear"))
    ->Arg(512)
    ->Arg(2048)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Prefill, tiny_k3, std::string("tiny-k3"))->Arg(512)->Arg(2048)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Decode, tiny_linear, std::string("tiny-linear"))
    ->Arg(1)
    ->Arg(8)
    ->Arg(32)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Decode, tiny_k3, std::string("tiny-k3"))->Arg(1)->Arg(8)->Arg(32)->Unit(benchmark::kMillisecond);

BENCHMARK_MAIN();
