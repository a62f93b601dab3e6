// Spawns the router actor (protocol: actors/router_protocol.hpp).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>

#include "actors/router_protocol.hpp"

namespace deltaserve::actors {

struct RouterConfig {
  int64_t max_queue = 256;  // requests waiting for a worker at most; beyond → kResourceExhausted
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
