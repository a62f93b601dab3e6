// A worker's load reports to the registry, sent from an actor on its own thread (caf::detached). The
// worker actor runs prefill chunks and decode steps inline; one long chunk or step on a loaded machine
// would otherwise hold back its periodic report until the registry (ten missed intervals) declares it lost.
// Liveness here means "the process runs and its worker can still post its load", not "the worker answers
// quickly": a slow worker is the router's placement problem, not a death.
//
// The worker writes its load into the board and pokes the reporter when it changed; the reporter sends
// every report (on a poke at once, else every interval), so reports reach the registry in the order they
// were read. Once the board is marked draining the reporter sends nothing more.
#pragma once

#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "actors/registry_protocol.hpp"

namespace deltaserve::actors {

class LoadBoard {
 public:
  void set(const WorkerLoad& load) {
    std::lock_guard lock(mutex_);
    load_ = load;
  }
  void set_draining() {
    std::lock_guard lock(mutex_);
    draining_ = true;
  }
  // The load to report, or nothing once draining.
  std::optional<WorkerLoad> read() const {
    std::lock_guard lock(mutex_);
    if (draining_) return std::nullopt;
    return load_;
  }

 private:
  mutable std::mutex mutex_;
  WorkerLoad load_;
  bool draining_ = false;
};

using poke_atom = caf::atom_constant<caf::atom("poke")>;

// poke: the board changed, report now. tick: its own interval timer.
using load_reporter = caf::typed_actor<caf::reacts_to<poke_atom>, caf::reacts_to<tick_atom>>;

// Spawns the reporter of worker `name` (detached). It quits when `worker` goes down.
load_reporter spawn_load_reporter(caf::actor_system& system, registry_actor registry, std::string name,
                                  std::chrono::milliseconds interval, std::shared_ptr<const LoadBoard> board,
                                  caf::actor worker);

}  // namespace deltaserve::actors
