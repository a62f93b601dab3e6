// ClusterService internals shared with node.cpp (CAF types).
#pragma once

#include <memory>

#include "actors/cluster_service.hpp"
#include "actors/router_actor.hpp"

namespace deltaserve::actors {

struct ClusterService::Impl {
  caf::actor_system& system;
  router_actor router;
  std::shared_ptr<RouterGauges> gauges;
};

// The per-request sink actor: forwards the chunks its StreamGate admits to `sink`, exactly one final chunk
// (an error one if the router or the actor system goes away first), then quits.
sink_actor spawn_stream_sink(caf::actor_system& system, std::shared_ptr<router::GenerationSink> sink,
                             std::string request_id, router_actor router);

}  // namespace deltaserve::actors
