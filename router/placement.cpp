#include "router/placement.hpp"

#include <algorithm>
#include <tuple>

#include "kvstore/cache/prefill_plan.hpp"

namespace deltaserve::router {

std::string PrefillChoice::describe() const {
  return "prefill " + std::string(name) + ": expected work " + std::to_string(expected_tokens) + " tokens (cached " +
         std::to_string(hit_tokens) + ", queued " + std::to_string(queued_tokens) + "); least loaded " +
         std::string(least_loaded) + "; " + std::to_string(workers_with_hit) + " workers with a hit";
}

int64_t usable_blocks(int64_t prompt_tokens, int64_t block_tokens) {
  return kvstore::usable_prompt_blocks(prompt_tokens, block_tokens);
}

int64_t index_lookup_blocks(const PlacementOptions& options, int64_t prompt_tokens) {
  if (options.policy != RoutingPolicy::kCacheAware) return 0;
  return usable_blocks(prompt_tokens, options.block_tokens);
}

PrefillChoice choose_prefill(const PlacementOptions& options, int64_t prompt_tokens,
                             std::span<const PrefillCandidate> workers, std::span<const IndexMatch> matches) {
  const int64_t usable = usable_blocks(prompt_tokens, options.block_tokens);
  if (options.policy != RoutingPolicy::kCacheAware) matches = {};
  PrefillChoice best;
  // (expected work, jobs, reported queue, name): the smallest wins.
  auto rank = [](const PrefillCandidate& w, int64_t cost) {
    return std::make_tuple(cost, w.jobs, w.queue_length, w.name);
  };
  std::optional<size_t> least_loaded;
  for (size_t i = 0; i < workers.size(); ++i) {
    const PrefillCandidate& w = workers[i];
    std::optional<int64_t> hit;  // set when the index has a live-epoch entry of this worker
    for (const IndexMatch& m : matches) {
      if (m.worker == w.name && m.worker_epoch == w.cache_epoch) {
        hit = std::min(m.checkpoint_blocks, usable) * options.block_tokens;
      }
    }
    if (hit) ++best.workers_with_hit;
    const int64_t hit_tokens = hit.value_or(0);
    const int64_t cost = w.queued_tokens + std::max<int64_t>(prompt_tokens - 1 - hit_tokens, 0);
    if (!least_loaded || std::tie(w.queued_tokens, w.name) <
                             std::tie(workers[*least_loaded].queued_tokens, workers[*least_loaded].name)) {
      least_loaded = i;
    }
    if (!best.worker || rank(w, cost) < rank(workers[*best.worker], best.expected_tokens)) {
      best.worker = i;
      best.name = w.name;
      best.hit_tokens = hit_tokens;
      best.expected_tokens = cost;
      best.queued_tokens = w.queued_tokens;
    }
  }
  if (least_loaded) best.least_loaded = workers[*least_loaded].name;
  return best;
}

std::optional<size_t> choose_decode(std::span<const DecodeCandidate> workers) {
  std::optional<size_t> best;
  int64_t best_free = 0;
  for (size_t i = 0; i < workers.size(); ++i) {
    const int64_t free = workers[i].capacity - workers[i].assigned;
    if (free > best_free || (best && free == best_free && workers[i].name < workers[*best].name)) {
      best = i;
      best_free = free;
    }
  }
  return best;
}

}  // namespace deltaserve::router
