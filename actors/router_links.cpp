#include "actors/router_links.hpp"

#include <algorithm>
#include <iostream>
#include <map>
#include <random>
#include <set>

#include <caf/io/all.hpp>

namespace deltaserve::actors {
namespace {

using attach_atom = caf::atom_constant<caf::atom("attach")>;
using detach_atom = caf::atom_constant<caf::atom("detach")>;
using stop_link_atom = caf::atom_constant<caf::atom("stoplink")>;

// The fan-out speaks registry_actor to the workers, plus attach(link, registry) / detach(link) from the links.
using fanout_actor =
    registry_actor::extend<caf::reacts_to<attach_atom, uint64_t, caf::actor>, caf::reacts_to<detach_atom, uint64_t>>;

struct FanoutState {
  std::map<uint64_t, registry_actor> registries;  // by link id: the registries joined now
};

// `unused` keeps CAF 0.17 off its no-argument spawn path (UB under UBSan; registry_actor.cpp says more).
fanout_actor::behavior_type fanout_impl(fanout_actor::stateful_pointer<FanoutState> self, int /*unused*/) {
  return {
      [](join_atom, const WorkerInfo& info) -> caf::result<uint64_t> {
        return caf::make_error(caf::sec::runtime_error, "join " + info.name + ": workers are joined by their node");
      },
      [self](heartbeat_atom, const std::string& name, WorkerLoad load) {
        for (const auto& [link, registry] : self->state.registries)
          self->send(registry, heartbeat_atom::value, name, load);
      },
      [self](leave_atom, const std::string& name) {
        for (const auto& [link, registry] : self->state.registries) self->send(registry, leave_atom::value, name);
      },
      [](list_atom) -> std::vector<WorkerInfo> { return {}; },
      [](subscribe_atom, const caf::actor&) {},
      [](tick_atom) {},
      [self](cache_atom, const kvstore::CacheEventBatch& batch) {
        for (const auto& [link, registry] : self->state.registries) self->send(registry, cache_atom::value, batch);
      },
      [self](attach_atom, uint64_t link, const caf::actor& registry) {
        self->state.registries[link] = caf::actor_cast<registry_actor>(registry);
      },
      [self](detach_atom, uint64_t link) { self->state.registries.erase(link); },
  };
}

// The registry's own refusal of a join (registry_actor.cpp answers those with sec::runtime_error), as opposed to
// an unreachable or slow registry.
bool is_refusal(const caf::error& error) {
  return error == caf::sec::runtime_error;
}

}  // namespace

struct RouterLinks::Link {
  RouterLinks* owner = nullptr;
  uint64_t id = 0;
  RouterEndpoint endpoint;
  std::vector<WorkerInfo> workers;
  std::thread thread;

  std::mutex mutex;         // guards the fields below
  caf::actor wake;          // the thread's scoped actor, to stop it
  bool stop = false;        // stop() was called
  registry_actor attached;  // the registry joined now (null while not)
  std::string last_error;   // why the last connect or join failed

  void run();
  // Connects and joins every worker. Refusals come back as kUnavailable, other failures as kDeadlineExceeded.
  Status connect_and_join(caf::scoped_actor& self, registry_actor& registry);
  Status join(caf::scoped_actor& self, const registry_actor& registry, const WorkerInfo& info);
};

Status RouterLinks::Link::join(caf::scoped_actor& self, const registry_actor& registry, const WorkerInfo& info) {
  Status result = Status::ok();
  self->request(registry, owner->options_.join_timeout, join_atom::value, info)
      .receive([](uint64_t) {},
               [&](caf::error& error) {
                 result = Status(is_refusal(error) ? StatusCode::kUnavailable : StatusCode::kDeadlineExceeded,
                                 "join " + info.name + " at " + endpoint.label + ": " + owner->system_.render(error));
               });
  return result;
}

Status RouterLinks::Link::connect_and_join(caf::scoped_actor& self, registry_actor& registry) {
  caf::actor_system& sys = owner->system_;
  // Bounded: a plain-TCP client of a TLS port sends nothing until the server's BASP handshake, which never
  // comes, and CAF's own remote_actor would wait forever.
  Status connected = Status(StatusCode::kDeadlineExceeded, "no answer");
  self->request(sys.middleman().actor_handle(), owner->options_.join_timeout, caf::connect_atom::value,
                endpoint.caf_host, endpoint.caf_port)
      .receive(
          [&](caf::node_id&, caf::strong_actor_ptr& actor, std::set<std::string>& interface) {
            if (!actor) {
              connected = Status(StatusCode::kDeadlineExceeded, sys.render(caf::sec::no_actor_published_at_port));
            } else if (!sys.assignable<registry_actor>(interface)) {
              connected =
                  Status(StatusCode::kDeadlineExceeded, sys.render(caf::sec::unexpected_actor_messaging_interface));
            } else {
              registry = caf::actor_cast<registry_actor>(std::move(actor));
              connected = Status::ok();
            }
          },
          [&](caf::error& error) { connected = Status(StatusCode::kDeadlineExceeded, sys.render(error)); });
  if (!connected.is_ok()) {
    std::string why = connected.message();
    if (endpoint.transport_error) {
      if (std::string tunnel = endpoint.transport_error(); !tunnel.empty()) why += " (" + tunnel + ")";
    }
    return Status(StatusCode::kDeadlineExceeded, why);
  }
  for (const WorkerInfo& info : workers) {
    if (Status joined = join(self, registry, info); !joined.is_ok()) return joined;
  }
  return Status::ok();
}

void RouterLinks::Link::run() {
  caf::scoped_actor self{owner->system_};
  {
    std::lock_guard lock(mutex);
    if (stop) return;
    wake = caf::actor_cast<caf::actor>(self);
  }
  const RouterLinkOptions& options = owner->options_;
  std::mt19937_64 random{std::random_device{}()};
  std::chrono::milliseconds backoff = options.backoff_initial;
  bool stopping = false;
  registry_actor registry;  // joined now (null while not)
  std::string lost_why;     // set when the joined registry is found gone
  bool was_lost = false;    // joined before: the next join is a rejoin (logged)

  // Handles stop and the joined registry's down message until `until`; returns early on either.
  auto wait_for_events = [&](std::chrono::steady_clock::time_point until) {
    bool down = false;
    while (!stopping && !down) {
      const auto now = std::chrono::steady_clock::now();
      if (now >= until) return;
      self->receive([&](stop_link_atom) { stopping = true; },
                    [&](caf::down_msg& message) {
                      if (registry && message.source == registry.address()) {
                        lost_why = "connection lost: " + owner->system_.render(message.reason);
                        down = true;
                      }
                    },
                    caf::after(std::chrono::duration_cast<std::chrono::milliseconds>(until - now)) >> [] {});
    }
  };
  auto detach = [&] {
    self->demonitor(registry.address());
    self->send(caf::actor_cast<fanout_actor>(owner->fanout_), detach_atom::value, id);
    {
      std::lock_guard lock(mutex);
      attached = nullptr;
    }
    registry = nullptr;
    owner->on_joined(false);
  };

  while (!stopping) {
    if (!registry) {
      if (owner->draining_) {  // nothing is joined again; wait for stop
        wait_for_events(std::chrono::steady_clock::now() + std::chrono::hours(1));
        continue;
      }
      registry_actor candidate;
      Status joined = connect_and_join(self, candidate);
      if (joined.is_ok()) {
        registry = candidate;
        self->monitor(registry);
        self->send(caf::actor_cast<fanout_actor>(owner->fanout_), attach_atom::value, id,
                   caf::actor_cast<caf::actor>(registry));
        {
          std::lock_guard lock(mutex);
          attached = registry;
          last_error.clear();
        }
        owner->on_joined(true);
        if (was_lost) std::cerr << "deltaserve: joined router " << endpoint.label << " again\n";
        backoff = options.backoff_initial;
        continue;
      }
      {
        std::lock_guard lock(mutex);
        last_error = joined.message();
      }
      if (joined.code() == StatusCode::kUnavailable) {
        std::lock_guard lock(owner->mutex_);
        if (owner->refused_.is_ok()) owner->refused_ = joined;
        owner->changed_.notify_all();
      }
      // Full backoff step drawn from [half, all] of it.
      const auto step = backoff.count();
      const auto delay = std::chrono::milliseconds(std::uniform_int_distribution<int64_t>(step / 2, step)(random));
      wait_for_events(std::chrono::steady_clock::now() + delay);
      backoff = std::min(backoff * 2, options.backoff_max);
      continue;
    }
    wait_for_events(std::chrono::steady_clock::now() + options.probe_interval);
    if (stopping) break;
    if (lost_why.empty()) {
      // Probe: the registry answers, and still lists this node's workers (unless draining: they left).
      std::vector<std::string> listed;
      self->request(registry, options.probe_timeout, list_atom::value)
          .receive(
              [&](std::vector<WorkerInfo>& list) {
                for (const WorkerInfo& info : list) listed.push_back(info.name);
              },
              [&](caf::error& error) { lost_why = "probe failed: " + owner->system_.render(error); });
      if (lost_why.empty() && !owner->draining_) {
        for (const WorkerInfo& info : workers) {
          if (std::find(listed.begin(), listed.end(), info.name) != listed.end()) continue;
          if (Status joined = join(self, registry, info); !joined.is_ok()) {
            lost_why = "join again after the registry dropped the worker: " + joined.message();
            break;
          }
        }
      }
    }
    if (!lost_why.empty()) {
      std::cerr << "deltaserve: router " << endpoint.label << ": " << lost_why << "; joining again\n";
      detach();
      lost_why.clear();
      was_lost = true;
    }
  }
  if (registry) detach();
  std::lock_guard lock(mutex);
  wake = nullptr;
}

RouterLinks::RouterLinks(caf::actor_system& system, RouterLinkOptions options) : system_(system), options_(options) {
  fanout_ = caf::actor_cast<registry_actor>(system_.spawn(fanout_impl, 0));
}

RouterLinks::~RouterLinks() {
  stop();
}

void RouterLinks::start(std::vector<RouterEndpoint> endpoints, std::vector<WorkerInfo> workers) {
  {
    std::lock_guard lock(mutex_);
    if (started_) return;
    started_ = true;
    orphaned_since_ = std::chrono::steady_clock::now();
  }
  uint64_t id = 0;
  for (RouterEndpoint& endpoint : endpoints) {
    auto link = std::make_unique<Link>();
    link->owner = this;
    link->id = ++id;
    link->endpoint = std::move(endpoint);
    link->workers = workers;
    links_.push_back(std::move(link));
  }
  for (auto& link : links_) link->thread = std::thread([raw = link.get()] { raw->run(); });
}

Status RouterLinks::wait_first_join(std::chrono::steady_clock::time_point deadline) {
  {
    std::unique_lock lock(mutex_);
    changed_.wait_until(lock, deadline, [&] { return joined_ > 0 || !refused_.is_ok(); });
    if (joined_ > 0) return Status::ok();
    if (!refused_.is_ok()) return refused_;
  }
  std::string why;
  for (auto& link : links_) {
    std::lock_guard lock(link->mutex);
    why += (why.empty() ? "" : "; ") + link->endpoint.label + ": " +
           (link->last_error.empty() ? std::string("no answer yet") : link->last_error);
  }
  return Status(StatusCode::kDeadlineExceeded, why);
}

int64_t RouterLinks::joined() const {
  std::lock_guard lock(mutex_);
  return joined_;
}

std::optional<std::chrono::steady_clock::time_point> RouterLinks::orphaned_since() const {
  std::lock_guard lock(mutex_);
  if (!started_ || joined_ > 0 || draining_) return std::nullopt;
  return orphaned_since_;
}

void RouterLinks::on_joined(bool joined) {
  std::lock_guard lock(mutex_);
  joined_ += joined ? 1 : -1;
  if (!joined && joined_ == 0) orphaned_since_ = std::chrono::steady_clock::now();
  changed_.notify_all();
}

void RouterLinks::leave(const std::vector<std::string>& names) {
  draining_ = true;
  std::vector<registry_actor> registries;
  for (auto& link : links_) {
    std::lock_guard lock(link->mutex);
    if (link->attached) registries.push_back(link->attached);
  }
  if (registries.empty() || names.empty()) return;
  // One sender, so each registry processes the leaves before the list request: its reply says they are done.
  caf::scoped_actor self{system_};
  for (const registry_actor& registry : registries) {
    for (const std::string& name : names) self->send(registry, leave_atom::value, name);
  }
  for (const registry_actor& registry : registries) {
    self->request(registry, std::chrono::seconds(2), list_atom::value)
        .receive([](const std::vector<WorkerInfo>&) {}, [](const caf::error&) {});
  }
}

void RouterLinks::stop() {
  {
    std::lock_guard lock(mutex_);
    if (stopped_) return;
    stopped_ = true;
  }
  draining_ = true;
  for (auto& link : links_) {
    std::lock_guard lock(link->mutex);
    link->stop = true;
    if (link->wake) caf::anon_send(link->wake, stop_link_atom::value);
  }
  for (auto& link : links_) {
    if (link->thread.joinable()) link->thread.join();
  }
  if (fanout_) caf::anon_send_exit(fanout_, caf::exit_reason::user_shutdown);
  fanout_ = nullptr;
}

}  // namespace deltaserve::actors
