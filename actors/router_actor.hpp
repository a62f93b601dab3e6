// Spawns the router actor (protocol: actors/router_protocol.hpp).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>

#include "actors/router_observer.hpp"
#include "actors/router_protocol.hpp"
#include "kvstore/cache/block_hasher.hpp"
#include "kvstore/index/prefix_index.hpp"
#include "router/placement.hpp"

namespace deltaserve::actors {

// How the router picks a prefill worker (router/placement.hpp, where the policies are written).
using RoutingPolicy = router::RoutingPolicy;

struct RouterConfig {
  int64_t max_queue = 256;  // requests waiting for a worker at most; beyond → kResourceExhausted
  RoutingPolicy policy = RoutingPolicy::kCacheAware;
  std::shared_ptr<kvstore::PrefixIndex> index;  // null: no index (placement by load only)
  // The workers' key (--cache-key): with another key the index never matches and the workers hash every prompt
  // again instead of reusing the router's hashes (PrefillJob::prompt_hashes).
  kvstore::SipKey hash_key{};
  int64_t block_tokens = kvstore::kDefaultBlockTokens;
  std::shared_ptr<RouterObserver> observer;  // metrics; null = none
  int64_t max_attempts = 3;  // prefills of one request at most (a failed/lost handoff is prefilled again)
  // A request waiting longer than this for a worker (each time it enters the queue) ends with kUnavailable
  // (HTTP 503 + Retry-After). 0 = no deadline.
  std::chrono::milliseconds queue_timeout{30000};
};

// Written by the router actor after every change, read by any thread (ClusterService::status()).
struct RouterGauges {
  std::atomic<int64_t> running{0};
  std::atomic<int64_t> waiting{0};
  std::atomic<int64_t> prefill_workers{0};
  std::atomic<int64_t> decode_workers{0};
  std::atomic<int64_t> decode_slots_total{0};  // from the workers' latest load reports
  std::atomic<int64_t> decode_slots_free{0};
  std::atomic<int64_t> worker_requests{0};
};

// `registry` may be null (tests feed workers()/lost() directly); otherwise the router subscribes to it.
// `gauges` may be null.
router_actor spawn_router(caf::actor_system& system, RouterConfig config, registry_actor registry,
                          std::shared_ptr<RouterGauges> gauges);

}  // namespace deltaserve::actors
