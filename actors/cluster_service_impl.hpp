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

}  // namespace deltaserve::actors
