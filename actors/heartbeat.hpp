// A worker's load reports to the registry, sent from a thread of their own. The worker actor runs prefill
// chunks and decode steps inline; one long chunk or step on a loaded machine would otherwise hold back its
// periodic report until the registry (ten missed intervals) declares it lost. Liveness here means "the
// process runs and its worker can still post its load", not "the worker answers quickly": a slow worker is
// the router's placement problem, not a death.
//
// The worker sets its load when it changes (the report goes out at once) and the thread repeats the last one
// every interval. One sender for every report keeps them in the order they were read. The reports come
// from a scoped actor of the worker's actor system, so the registry sees them from the worker's node (it
// ignores reports from any other node). Once draining, nothing more is sent.
//
// A plain thread rather than a detached actor: a detached actor's private thread waits, at actor-system
// shutdown, until every reference to it is gone, and a pending delayed_send to itself holds one until it
// fires, which it no longer does once the system's clock has stopped.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>

#include "actors/registry_protocol.hpp"

namespace deltaserve::actors {

class LoadReporter {
 public:
  // Starts the thread; the first report goes out at once.
  LoadReporter(caf::actor_system& system, registry_actor registry, std::string name, std::chrono::milliseconds interval,
               const WorkerLoad& load);
  ~LoadReporter();  // stops and joins the thread (at most one report in flight)
  LoadReporter(const LoadReporter&) = delete;
  LoadReporter& operator=(const LoadReporter&) = delete;

  void set(const WorkerLoad& load);  // reported at once
  void set_draining();               // nothing is reported after this returns

 private:
  void run(caf::actor_system& system);

  registry_actor registry_;
  std::string name_;
  std::chrono::milliseconds interval_;
  std::mutex mutex_;
  std::condition_variable wake_;
  WorkerLoad load_;
  bool changed_ = true;
  bool draining_ = false;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace deltaserve::actors
