// A worker node's membership in the registries of its routers: one link per router, each joining this node's
// workers to that router's registry, watching it, and joining again, with backoff, once it is gone (a router
// that crashed and was started again, a network cut that healed).
//
//   worker actors ──heartbeat/leave/cache──► fan-out actor ──► registry of router A   (link A: thread)
//                                                          └──► registry of router B   (link B: thread)
//
// The workers are given the fan-out actor as their registry (it speaks registry_actor): what they report
// reaches every registry this node is joined to at that moment, and nothing is lost by a registry changing
// under them. The fan-out runs on this node, so the registries see its messages from the workers' node (the
// name binding of registry_protocol.hpp holds). Requests reach a worker from any router it is joined to and
// carry that router's handles, so replies go to the router that asked.
//
// A link's thread: connect (bounded) → join every worker (request; the registry has it when the reply
// comes) → attach to the fan-out and monitor the registry → wait for its down message (the connection closed:
// router process gone) or a failed probe (a list request unanswered within probe_timeout: the silent network
// a closed connection never reports) → detach → connect again after a backoff of backoff_initial doubling to
// backoff_max, each wait drawn uniformly from [half, all] of the current step, so workers that lost the same
// router do not all knock at once. A probe that finds one of this node's workers missing from the list (the
// registry dropped it) joins it again. Threads rather than actors: a detached actor with a pending
// delayed_send keeps actor-system shutdown waiting (heartbeat.hpp says more).
//
// Lifetime: made after the actor system, stop() before it goes; not copyable.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "actors/registry_protocol.hpp"
#include "common/status.hpp"

namespace deltaserve::actors {

struct RouterLinkOptions {
  std::chrono::milliseconds backoff_initial{100};  // first wait after a failed (re)join
  std::chrono::milliseconds backoff_max{5000};     // the wait doubles up to this
  std::chrono::milliseconds probe_interval{2000};  // while joined: a list request this often
  std::chrono::milliseconds probe_timeout{10000};  // unanswered this long: the router counts as gone
  std::chrono::milliseconds join_timeout{10000};   // one connect or join request
};

// Where CAF reaches one router's registry: `label` names it in errors (the address as configured); CAF
// connects to caf_host:caf_port (the router itself, or this node's end of a TLS tunnel to it).
struct RouterEndpoint {
  std::string label;
  std::string caf_host;
  uint16_t caf_port = 0;
  std::function<std::string()> transport_error;  // why the tunnel's last connection failed; may be empty
};

class RouterLinks {
 public:
  RouterLinks(caf::actor_system& system, RouterLinkOptions options);
  ~RouterLinks();  // stop()
  RouterLinks(const RouterLinks&) = delete;
  RouterLinks& operator=(const RouterLinks&) = delete;

  // The handle the workers report to (the fan-out actor). Valid until stop().
  registry_actor registry() const { return fanout_; }

  // Starts one link per endpoint; `workers` are joined to every router. Once.
  void start(std::vector<RouterEndpoint> endpoints, std::vector<WorkerInfo> workers);

  // Waits until a link has joined every worker (OK), a registry refused a join (Unavailable, with the
  // registry's reason: a configuration error such as a name held by another node's worker), or `deadline`
  // (DeadlineExceeded naming each router and its last error).
  Status wait_first_join(std::chrono::steady_clock::time_point deadline);

  // Routers this node is joined to now.
  int64_t joined() const;
  // Since when this node has been joined to no router; nullopt while joined to one, before start(), and once
  // draining (a draining node joins nothing on purpose).
  std::optional<std::chrono::steady_clock::time_point> orphaned_since() const;

  // From now on nothing is joined again (the node is draining); the workers' own leave goes through the
  // fan-out. Then tells every router joined now that `names` leave, and waits (bounded) until each has
  // processed it.
  void leave(const std::vector<std::string>& names);

  // Stops and joins the threads (a thread in a connect or request returns within join_timeout), stops the
  // fan-out. Idempotent.
  void stop();

  struct Link;

 private:
  void on_joined(bool joined);

  caf::actor_system& system_;
  RouterLinkOptions options_;
  registry_actor fanout_;
  std::vector<std::unique_ptr<Link>> links_;
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  int64_t joined_ = 0;
  bool started_ = false;
  std::chrono::steady_clock::time_point orphaned_since_;
  Status refused_ = Status::ok();
  std::atomic<bool> draining_{false};
  bool stopped_ = false;
};

}  // namespace deltaserve::actors
