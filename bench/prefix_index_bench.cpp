// Router prefix-index speed: lookups/s and per-lookup p50/p99 latency for 4k-token (8 blocks) and
// 128k-token (256 blocks) prompts that hit at full depth or miss after a few blocks, and apply()
// throughput in events/s. The index is populated like a busy router's: 8 workers, 4 tenants, about 100k
// (block, worker) entries, then closed and reopened so the entries are read from SST files through the
// block cache (RocksDB flushes the recovered WAL on open), not from the memtable.
//
// Times are wall-clock (UseRealTime): what a router thread sees, including preemption on a shared machine.
// The limit, measured in the same run: the same walk over an in-memory std::unordered_map holding the same
// entries (no persistence, no encoding): what a lookup costs when only the hash-table probes remain.
// bench/prefix_index.sh records the results.
#include <algorithm>
#include <chrono>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

#include <benchmark/benchmark.h>

#include "common/temp_dir.hpp"
#include "kvstore/index/prefix_index.hpp"

namespace {

using namespace deltaserve::kvstore;

constexpr int kWorkers = 8;
constexpr int kTenants = 4;
constexpr int kShortBlocks = 8;   // 4096 tokens
constexpr int kLongBlocks = 256;  // 131072 tokens
constexpr int kShortPromptsPerTenant = 1000;
constexpr int kLongPromptsPerTenant = 16;
constexpr int kPartialLongBlocks = 64;  // a third worker holds the first quarter of each long prompt
constexpr int kMissAfterShort = 2;      // miss prompts share this many blocks with a stored one
constexpr int kMissAfterLong = 4;

struct HashOf {
  size_t operator()(const BlockHash& h) const {
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= uint64_t{h.bytes[static_cast<size_t>(i)]} << (8 * i);
    return v;
  }
};

std::string worker_name(int w) {
  return "prefill-" + std::to_string(w) + ".deltaserve.svc:4242";
}
std::string tenant_name(int t) {
  return "tenant-" + std::to_string(t);
}

struct Prompt {
  std::string cache_namespace;
  std::vector<BlockHash> hashes;
};

// The in-memory ceiling: block hash → holders, walked like the index walks RocksDB.
struct MapEntry {
  std::string worker;
  uint64_t epoch;
  int64_t block_index;
  bool has_checkpoint;
  std::string cache_namespace;
};
using MapIndex = std::unordered_map<BlockHash, std::vector<MapEntry>, HashOf>;

void map_apply(MapIndex& map, const CacheEventBatch& batch) {
  for (const CacheEvent& e : batch.events) {
    auto& holders = map[e.hash];
    auto it = std::find_if(holders.begin(), holders.end(), [&](const MapEntry& m) { return m.worker == batch.worker; });
    if (it == holders.end()) it = holders.insert(holders.end(), MapEntry{batch.worker, 0, 0, false, {}});
    *it = {batch.worker, batch.worker_epoch, e.block_index, e.has_checkpoint, e.cache_namespace};
  }
}

std::vector<WorkerPrefixMatch> map_lookup(const MapIndex& map, std::span<const BlockHash> hashes,
                                          std::string_view cache_namespace) {
  std::vector<WorkerPrefixMatch> matches;
  for (size_t i = 0; i < hashes.size(); ++i) {
    const auto depth = static_cast<int64_t>(i + 1);
    const auto found = map.find(hashes[i]);
    if (found == map.end()) break;
    bool continued = false;
    for (const MapEntry& e : found->second) {
      if (e.cache_namespace != cache_namespace || e.block_index != depth) continue;
      WorkerPrefixMatch* match = nullptr;
      if (depth == 1) {
        match = &matches.emplace_back();
        match->worker = e.worker;
        match->worker_epoch = e.epoch;
      } else {
        for (auto& m : matches) {
          if (m.worker == e.worker && m.pages_blocks == depth - 1) match = &m;
        }
        if (!match) continue;
      }
      match->pages_blocks = depth;
      if (e.has_checkpoint) match->checkpoint_blocks = depth;
      continued = true;
    }
    if (!continued) break;
  }
  std::sort(matches.begin(), matches.end(), better_prefix_match);
  return matches;
}

class Population {
 public:
  Population() : hasher_(SipKey{7, 1, 3, 3, 7}) {
    std::vector<CacheEventBatch> batches;
    uint64_t seed = 1;
    for (int t = 0; t < kTenants; ++t) {
      for (int p = 0; p < kShortPromptsPerTenant; ++p) {
        Prompt prompt = make_prompt(t, kShortBlocks, seed++);
        const int w = (t * kShortPromptsPerTenant + p) % kWorkers;
        for (int holder : {w, (w + 3) % kWorkers}) batches.push_back(store(holder, prompt, kShortBlocks, 4));
        short_hits_.push_back(prompt);
        short_misses_.push_back(diverge(prompt, kMissAfterShort, seed++));
      }
      for (int p = 0; p < kLongPromptsPerTenant; ++p) {
        Prompt prompt = make_prompt(t, kLongBlocks, seed++);
        const int w = (t * kLongPromptsPerTenant + p) % kWorkers;
        batches.push_back(store(w, prompt, kLongBlocks, 16));
        batches.push_back(store((w + 1) % kWorkers, prompt, kLongBlocks, 16));
        batches.push_back(store((w + 2) % kWorkers, prompt, kPartialLongBlocks, 16));
        long_hits_.push_back(prompt);
        long_misses_.push_back(diverge(prompt, kMissAfterLong, seed++));
      }
    }
    {
      auto index = PrefixIndex::open(dir_.path() / "index");
      if (!index.is_ok()) abort_with(index.status());
      for (const auto& batch : batches) {
        if (auto s = (*index)->apply(batch); !s.is_ok()) abort_with(s);
        map_apply(map_, batch);
        entries_ += static_cast<int64_t>(batch.events.size());
      }
    }
    auto index = PrefixIndex::open(dir_.path() / "index");  // reopen: entries now come from SST files
    if (!index.is_ok()) abort_with(index.status());
    index_ = std::move(index).value();
  }

  PrefixIndex& index() { return *index_; }
  const MapIndex& map() const { return map_; }
  int64_t entries() const { return entries_; }
  const std::vector<Prompt>& prompts(int blocks, bool hit) const {
    if (blocks == kShortBlocks) return hit ? short_hits_ : short_misses_;
    return hit ? long_hits_ : long_misses_;
  }
  const BlockHasher& hasher() const { return hasher_; }

  Prompt make_prompt(int tenant, int blocks, uint64_t seed) const {
    std::mt19937 rng(static_cast<uint32_t>(seed));
    std::vector<int32_t> tokens(static_cast<size_t>(blocks) * static_cast<size_t>(hasher_.block_tokens()));
    for (auto& x : tokens) x = static_cast<int32_t>(rng() % 163840);
    return {tenant_name(tenant), hasher_.hash_prompt(hasher_.root(tenant_name(tenant), "kimi-linear-48b"), tokens)};
  }

 private:
  [[noreturn]] static void abort_with(const deltaserve::Status& s) {
    std::fprintf(stderr, "prefix_index_bench: %s\n", s.to_string().c_str());
    std::abort();
  }

  static CacheEventBatch store(int worker, const Prompt& prompt, int blocks, int checkpoint_every) {
    CacheEventBatch batch{.worker = worker_name(worker), .worker_epoch = 1, .events = {}};
    for (int b = 1; b <= blocks; ++b) {
      batch.events.push_back({.kind = CacheEvent::Kind::kStored,
                              .hash = prompt.hashes[static_cast<size_t>(b - 1)],
                              .block_index = b,
                              .has_checkpoint = b % checkpoint_every == 0 || b == blocks,
                              .cache_namespace = prompt.cache_namespace});
    }
    return batch;
  }

  // The same prompt for `shared` blocks, then other tokens.
  Prompt diverge(const Prompt& prompt, int shared, uint64_t seed) const {
    Prompt out{prompt.cache_namespace, {prompt.hashes.begin(), prompt.hashes.begin() + shared}};
    std::mt19937 rng(static_cast<uint32_t>(seed));
    std::vector<int32_t> block(static_cast<size_t>(hasher_.block_tokens()));
    while (out.hashes.size() < prompt.hashes.size()) {
      for (auto& x : block) x = static_cast<int32_t>(rng() % 163840);
      out.hashes.push_back(hasher_.next(out.hashes.back(), block));
    }
    return out;
  }

  deltaserve::TempDir dir_{"prefix_index_bench"};
  BlockHasher hasher_;
  std::unique_ptr<PrefixIndex> index_;
  MapIndex map_;
  int64_t entries_ = 0;
  std::vector<Prompt> short_hits_, short_misses_, long_hits_, long_misses_;
};

Population& population() {
  static Population p;
  return p;
}

// Times each lookup; reports lookups/s and the p50/p99 of single lookups in microseconds.
template <class LookupFn>
void run_lookups(benchmark::State& state, LookupFn&& lookup) {
  const int blocks = static_cast<int>(state.range(0));
  const bool hit = state.range(1) == 1;
  const auto& prompts = population().prompts(blocks, hit);
  std::vector<double> micros;
  micros.reserve(1 << 16);
  size_t next = 0;
  int64_t matched_blocks = 0;
  for (auto _ : state) {
    const Prompt& prompt = prompts[next++ % prompts.size()];
    const auto start = std::chrono::steady_clock::now();
    auto matches = lookup(prompt);
    micros.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count());
    matched_blocks += matches.empty() ? 0 : matches.front().pages_blocks;
    benchmark::DoNotOptimize(matches);
  }
  std::sort(micros.begin(), micros.end());
  auto quantile = [&](double q) { return micros[static_cast<size_t>(q * static_cast<double>(micros.size() - 1))]; };
  state.counters["lookups_per_s"] =
      benchmark::Counter(static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
  state.counters["p50_us"] = quantile(0.50);
  state.counters["p99_us"] = quantile(0.99);
  state.counters["matched_blocks"] =
      static_cast<double>(matched_blocks) / static_cast<double>(std::max<int64_t>(state.iterations(), 1));
  state.counters["entries"] = static_cast<double>(population().entries());
}

void BM_IndexLookup(benchmark::State& state) {
  run_lookups(state, [](const Prompt& prompt) {
    auto got = population().index().lookup(prompt.hashes, prompt.cache_namespace);
    if (!got.is_ok()) std::abort();
    return std::move(got).value();
  });
}

void BM_MapLookupCeiling(benchmark::State& state) {
  run_lookups(state, [](const Prompt& prompt) {
    return map_lookup(population().map(), prompt.hashes, prompt.cache_namespace);
  });
}

// apply() of one 4k-token prompt's blocks (8 kStored events, checkpoint at 4 and 8) per batch, new hashes
// each batch, workers in turn; range(0) = sync_writes.
std::vector<CacheEventBatch> apply_batches() {
  std::vector<CacheEventBatch> batches;
  for (int i = 0; i < 4096; ++i) {
    const Prompt prompt = population().make_prompt(i % kTenants, kShortBlocks, 1000000 + static_cast<uint64_t>(i));
    CacheEventBatch batch{.worker = worker_name(i % kWorkers), .worker_epoch = 1, .events = {}};
    for (int b = 1; b <= kShortBlocks; ++b) {
      batch.events.push_back({.kind = CacheEvent::Kind::kStored,
                              .hash = prompt.hashes[static_cast<size_t>(b - 1)],
                              .block_index = b,
                              .has_checkpoint = b % 4 == 0,
                              .cache_namespace = prompt.cache_namespace});
    }
    batches.push_back(std::move(batch));
  }
  return batches;
}

void BM_IndexApply(benchmark::State& state) {
  static const std::vector<CacheEventBatch> batches = apply_batches();
  deltaserve::TempDir dir("prefix_index_bench_apply");
  auto index = PrefixIndex::open(dir.path() / "index", {.sync_writes = state.range(0) == 1});
  if (!index.is_ok()) {
    state.SkipWithError(index.status().to_string().c_str());
    return;
  }
  size_t next = 0;
  for (auto _ : state) {
    if (!(*index)->apply(batches[next++ % batches.size()]).is_ok()) {
      state.SkipWithError("apply failed");
      break;
    }
  }
  state.counters["events_per_s"] =
      benchmark::Counter(static_cast<double>(state.iterations() * kShortBlocks), benchmark::Counter::kIsRate);
}

void BM_MapApplyCeiling(benchmark::State& state) {
  static const std::vector<CacheEventBatch> batches = apply_batches();
  MapIndex map;
  size_t next = 0;
  for (auto _ : state) map_apply(map, batches[next++ % batches.size()]);
  benchmark::DoNotOptimize(map);
  state.counters["events_per_s"] =
      benchmark::Counter(static_cast<double>(state.iterations() * kShortBlocks), benchmark::Counter::kIsRate);
}

}  // namespace

// Args: {blocks, hit (1) or miss after a few blocks (0)}.
BENCHMARK(BM_IndexLookup)
    ->Args({8, 1})
    ->Args({8, 0})
    ->Args({256, 1})
    ->Args({256, 0})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK(BM_MapLookupCeiling)
    ->Args({8, 1})
    ->Args({8, 0})
    ->Args({256, 1})
    ->Args({256, 0})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK(BM_IndexApply)->Arg(0)->Arg(1)->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK(BM_MapApplyCeiling)->Unit(benchmark::kMicrosecond)->UseRealTime();

BENCHMARK_MAIN();
