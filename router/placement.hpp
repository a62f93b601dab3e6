// Placement: which prefill worker and which decode worker a request goes to. Pure policy over plain data
// (no CAF, no RocksDB): the router actor gathers its workers' reports and its own bookkeeping, asks the prefix
// index when index_lookup_blocks() says to, and passes the index's answer in; it then carries the messages.
//
// Prefill: the least expected work, where a worker's expected work is the prompt tokens this router still
// has queued on it plus the tokens of this prompt it would compute: all of prompt[0, N−1) (the decode worker
// feeds the last token), minus, under the cache-aware policy, the prefix its cache serves according to the
// index. Ties: fewer outstanding jobs, then the shorter reported queue, then the name.
// Decode: the most free slots (capacity minus requests this router placed there); ties by name; none when
// every worker is full.
//
// The index is advisory (kvstore/index/prefix_index.hpp): a hit it reports is what the worker is expected to
// serve, and the worker checks its own cache. Only matches of a worker's live cache epoch count: entries of an
// earlier incarnation (its cache started empty again) and of workers the router does not know are ignored.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

namespace deltaserve::router {

// How the router picks a prefill worker. Both policies weigh the prompt tokens each worker still has to
// prefill for this router; cache-aware also subtracts, per worker, the tokens its prefix cache would serve
// (the deepest boundary where the index says it holds pages and a KDA checkpoint).
enum class RoutingPolicy { kCacheAware, kLoadOnly };

struct PlacementOptions {
  RoutingPolicy policy = RoutingPolicy::kCacheAware;
  int64_t block_tokens = 512;  // prefix-cache block size (kvstore::kDefaultBlockTokens), >= 1
};

// What the router knows of one prefill worker when it places a request.
struct PrefillCandidate {
  std::string_view name;      // unique among the candidates
  uint64_t cache_epoch = 0;   // its prefix cache's incarnation, from its registration (0: no cache)
  int64_t queued_tokens = 0;  // prompt tokens this router sent it that are not prefilled yet
  int64_t jobs = 0;           // jobs this router sent it that are not prefilled yet
  int64_t queue_length = 0;   // jobs waiting there, from its latest load report
};

// One worker's usable prefix of the prompt, as the prefix index reports it (kvstore::WorkerPrefixMatch).
struct IndexMatch {
  std::string_view worker;
  uint64_t worker_epoch = 0;      // the cache epoch the entries were recorded under
  int64_t checkpoint_blocks = 0;  // deepest boundary with pages and a KDA checkpoint: the usable hit, in blocks
};

// The choice and why (the views point into the candidates' names).
struct PrefillChoice {
  std::optional<size_t> worker;   // index into the candidates; none when there are no candidates
  std::string_view name;          // its name
  int64_t hit_tokens = 0;         // what the index says its cache serves (the worker verifies), <= N−1
  int64_t expected_tokens = 0;    // its expected work: queued + prompt tokens it computes
  int64_t queued_tokens = 0;      // of which already queued there for this router
  std::string_view least_loaded;  // the candidate with the fewest queued tokens (first by name on ties)
  int64_t workers_with_hit = 0;   // candidates with a live-epoch index match (a match of 0 blocks included)

  // "prefill <name>: expected work E tokens (cached H, queued Q); least loaded <name>; K workers with a hit",
  // the router's debug log line for this choice.
  std::string describe() const;
};

struct DecodeCandidate {
  std::string_view name;  // unique among the candidates
  int64_t capacity = 0;   // its batch size
  int64_t assigned = 0;   // requests this router placed there that have not finished
};

// The full blocks of prompt[0, N−1): the deepest prefix a prefill can serve from a cache, in blocks (the prefill
// worker's own count: kvstore::usable_prompt_blocks).
int64_t usable_blocks(int64_t prompt_tokens, int64_t block_tokens);

// How many of the prompt's block hashes to look up in the prefix index: usable_blocks() under the cache-aware
// policy, 0 (no lookup) under load-only. The caller skips the lookup as well when it has no index or no
// prefill worker.
int64_t index_lookup_blocks(const PlacementOptions& options, int64_t prompt_tokens);

// Picks the prefill worker for a prompt of `prompt_tokens` tokens. `matches`: the index's answer for the
// prompt's first index_lookup_blocks() hashes, in the index's order (empty: no lookup, or it failed); ignored
// under load-only. A worker with several live matches counts the last.
PrefillChoice choose_prefill(const PlacementOptions& options, int64_t prompt_tokens,
                             std::span<const PrefillCandidate> workers, std::span<const IndexMatch> matches);

// Picks the decode worker: index into `workers`, or none when no worker has a free slot.
std::optional<size_t> choose_decode(std::span<const DecodeCandidate> workers);

}  // namespace deltaserve::router
