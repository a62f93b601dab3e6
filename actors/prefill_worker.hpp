// Spawns a prefill worker actor (protocol: actors/prefill_protocol.hpp).
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "actors/prefill_protocol.hpp"
#include "actors/transport.hpp"
#include "engine/model.hpp"

namespace deltaserve::actors {

struct PrefillWorkerConfig {
  std::string name = "prefill-0";                     // registry name (unique in the cluster)
  int64_t chunk_tokens = 512;                         // prompt tokens per forward pass (one per message)
  std::chrono::milliseconds heartbeat_interval{500};  // load reports to the registry; 0 = only on change
};

// `model` is shared read-only (Model::forward is const and thread-safe). `registry` may be null (tests):
// the worker then reports to nobody. Joining is the caller's (Node) job, since it needs a reply;
// heartbeats and leave on drain are the worker's. `transport` null = make_caf_transport().
prefill_actor spawn_prefill_worker(caf::actor_system& system, std::shared_ptr<const engine::Model> model,
                                   registry_actor registry, PrefillWorkerConfig config,
                                   std::shared_ptr<Transport> transport = nullptr);

}  // namespace deltaserve::actors
