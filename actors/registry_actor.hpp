// Spawns the registry actor (protocol: actors/registry_protocol.hpp).
#pragma once

#include <chrono>

#include "actors/registry_protocol.hpp"

namespace deltaserve::actors {

// `expiry` > 0: a worker whose last join/heartbeat is older than that is dropped as lost (subscribers get
// lost(name)), so a worker that vanished without its connection being reported (SIGKILL behind a
// silent network) stops receiving work. 0 = only monitor/leave remove workers (tests without heartbeats).
registry_actor spawn_registry(caf::actor_system& system,
                              std::chrono::milliseconds expiry = std::chrono::milliseconds(0));

}  // namespace deltaserve::actors
