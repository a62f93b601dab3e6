// Prefix-cache block hashing throughput (GB/s of token ids) for 4k- and 128k-token prompts, and the
// memory copy bandwidth of this machine measured in the same run as the limit. bench/block_hash.sh
// records the results.
#include <cstring>
#include <random>
#include <vector>

#include <benchmark/benchmark.h>

#include "kvstore/cache/block_hasher.hpp"

namespace {

std::vector<int32_t> tokens(size_t n) {
  std::mt19937 rng(7);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = static_cast<int32_t>(rng() % 163840);
  return t;
}

void BM_HashPrompt(benchmark::State& state) {
  const auto prompt = tokens(static_cast<size_t>(state.range(0)));
  deltaserve::kvstore::SipKey key{};
  const deltaserve::kvstore::BlockHasher hasher(key);
  const auto root = hasher.root("tenant", "model");
  for (auto _ : state) benchmark::DoNotOptimize(hasher.hash_prompt(root, prompt));
  state.counters["bytes_per_s"] =
      benchmark::Counter(static_cast<double>(state.iterations()) * static_cast<double>(prompt.size() * sizeof(int32_t)),
                         benchmark::Counter::kIsRate);
}

// The ceiling: read + write bandwidth of a large memcpy (counted as bytes copied).
void BM_MemcpyCeiling(benchmark::State& state) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  std::vector<char> src(bytes, 1), dst(bytes);
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), bytes);
    benchmark::DoNotOptimize(dst.data());
  }
  state.counters["bytes_per_s"] = benchmark::Counter(
      static_cast<double>(state.iterations()) * static_cast<double>(bytes), benchmark::Counter::kIsRate);
}

}  // namespace

BENCHMARK(BM_MemcpyCeiling)->Arg(64 << 20)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_HashPrompt)->Arg(4096)->Arg(131072)->Unit(benchmark::kMicrosecond);

BENCHMARK_MAIN();
