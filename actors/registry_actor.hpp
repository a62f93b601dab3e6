// Spawns the registry actor (protocol: actors/registry_protocol.hpp).
#pragma once

#include "actors/registry_protocol.hpp"

namespace deltaserve::actors {

registry_actor spawn_registry(caf::actor_system& system);

}  // namespace deltaserve::actors
