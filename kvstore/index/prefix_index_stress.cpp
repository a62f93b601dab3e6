// prefix_index_stress DIR CONTENT_SEED ACTION_SEED EPOCH_BASE SYNC(0|1)
//
// Opens the prefix index in DIR, prints "open" on stdout, then writes batches until it is killed:
// stores, tail evictions, checkpoint evictions, worker restarts (new epoch), dropped workers and
// reconciles, over kWorkers workers and two tenants (prefix_index_stress_workload.hpp). Exits non-zero
// only when the index reports an error. Each batch is built so that a partly applied batch would break
// the invariant the crash test checks (per worker and chain, the held blocks are exactly 1..m):
//   - a store of blocks 1..k writes them deepest first (a torn batch would leave a gap at the front);
//   - a tail eviction of blocks j..kMaxDepth deletes them shallowest first (a torn one leaves a gap).
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>

#include "kvstore/index/prefix_index.hpp"
#include "kvstore/index/prefix_index_stress_workload.hpp"

namespace {

using namespace deltaserve::kvstore;

int fail(const char* what, const deltaserve::Status& status) {
  std::fprintf(stderr, "prefix_index_stress: %s: %s\n", what, status.to_string().c_str());
  return 3;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: %s DIR CONTENT_SEED ACTION_SEED EPOCH_BASE SYNC\n", argv[0]);
    return 2;
  }
  const std::string directory = argv[1];
  const uint64_t content_seed = std::strtoull(argv[2], nullptr, 10);
  const uint64_t action_seed = std::strtoull(argv[3], nullptr, 10);
  uint64_t next_epoch = std::strtoull(argv[4], nullptr, 10);
  const bool sync = std::string(argv[5]) == "1";

  const std::vector<stress::Chain> chains = stress::make_chains(content_seed);
  auto opened = PrefixIndex::open(directory, {.sync_writes = sync});
  if (!opened.is_ok()) return fail("open", opened.status());
  PrefixIndex& index = **opened;

  // Workers already in the index keep their epoch (the same incarnation continues); others start fresh.
  std::vector<uint64_t> epochs(stress::kWorkers, 0);
  auto present = index.workers();
  if (!present.is_ok()) return fail("workers", present.status());
  for (int w = 0; w < stress::kWorkers; ++w) {
    epochs[static_cast<size_t>(w)] = next_epoch++;
    for (const auto& [name, epoch] : *present) {
      if (name == stress::worker_name(w)) epochs[static_cast<size_t>(w)] = epoch;
    }
  }
  std::printf("open\n");
  std::fflush(stdout);

  std::mt19937_64 rng(action_seed);
  auto pick = [&](int n) { return static_cast<int>(rng() % static_cast<uint64_t>(n)); };
  for (;;) {
    const int w = pick(stress::kWorkers);
    const stress::Chain& chain = chains[static_cast<size_t>(pick(static_cast<int>(chains.size())))];
    const std::string ns(stress::kNamespaces[static_cast<size_t>(chain.tenant)]);
    const int action = pick(100);
    if (action >= 99) {
      std::vector<std::pair<std::string, uint64_t>> live;
      const int gone = pick(stress::kWorkers);
      for (int other = 0; other < stress::kWorkers; ++other) {
        if (other != gone) live.emplace_back(stress::worker_name(other), epochs[static_cast<size_t>(other)]);
      }
      auto dropped = index.reconcile(live);
      if (!dropped.is_ok()) return fail("reconcile", dropped.status());
      continue;
    }
    if (action >= 97) {
      if (auto s = index.drop_worker(stress::worker_name(w)); !s.is_ok()) return fail("drop_worker", s);
      continue;
    }
    if (action >= 94) epochs[static_cast<size_t>(w)] = next_epoch++;  // the worker restarted

    CacheEventBatch batch{
        .worker = stress::worker_name(w), .worker_epoch = epochs[static_cast<size_t>(w)], .events = {}};
    if (action < 60 || action >= 94) {
      const int depth = 1 + pick(stress::kMaxDepth);
      for (int block = depth; block >= 1; --block) {
        batch.events.push_back({.kind = CacheEvent::Kind::kStored,
                                .hash = chain.hashes[static_cast<size_t>(block - 1)],
                                .block_index = block,
                                .has_checkpoint = block % 4 == 0 || block == depth,
                                .cache_namespace = ns});
      }
    } else if (action < 85) {
      for (int block = 1 + pick(stress::kMaxDepth); block <= stress::kMaxDepth; ++block) {
        batch.events.push_back({.kind = CacheEvent::Kind::kEvicted,
                                .hash = chain.hashes[static_cast<size_t>(block - 1)],
                                .block_index = block,
                                .cache_namespace = ns});
      }
    } else {
      const int block = 1 + pick(stress::kMaxDepth);
      batch.events.push_back({.kind = CacheEvent::Kind::kCheckpointEvicted,
                              .hash = chain.hashes[static_cast<size_t>(block - 1)],
                              .block_index = block,
                              .cache_namespace = ns});
    }
    if (auto s = index.apply(batch); !s.is_ok()) return fail("apply", s);
  }
}
