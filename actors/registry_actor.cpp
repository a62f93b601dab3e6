#include "actors/registry_actor.hpp"

#include <algorithm>
#include <map>

namespace deltaserve::actors {
namespace {

struct RegistryState {
  std::map<std::string, WorkerInfo> workers;                      // by name (sorted: list() and ties are by name)
  std::map<std::string, caf::actor_clock::time_point> last_seen;  // join or heartbeat (actor clock)
  std::chrono::milliseconds expiry{0};                            // 0 = no heartbeat expiry
  std::vector<registry_subscriber> subscribers;
  std::string label;
  // Workers dropped for missed heartbeats whose actor did not go down: a heartbeat brings them back
  // (a worker stalled by a long step, or a slow network, is not dead). Bounded.
  std::map<std::string, WorkerInfo> expired;
};

constexpr size_t kMaxExpired = 1024;

using RegistryPointer = registry_actor::stateful_pointer<RegistryState>;

// Whether the current message comes from the node whose worker holds `info`'s name (the node of the handle
// it joined with; join checks that this is the joining node). Anonymous messages hold and match no name. (An
// actor system without the middleman has the empty node id; its actors all match each other.)
bool from_holder(RegistryPointer self, const WorkerInfo& info) {
  const caf::strong_actor_ptr& sender = self->current_sender();
  return sender && info.handle && info.handle.node() == sender->node();
}

std::vector<WorkerInfo> snapshot(const RegistryState& state) {
  std::vector<WorkerInfo> out;
  out.reserve(state.workers.size());
  for (const auto& [name, info] : state.workers) out.push_back(info);
  return out;
}

void publish(RegistryPointer self) {
  const std::vector<WorkerInfo> list = snapshot(self->state);
  for (const registry_subscriber& subscriber : self->state.subscribers)
    self->send(subscriber, workers_atom::value, list);
}

// Removes workers that are gone without leaving and tells the subscribers, which fail their requests.
// `revivable`: they only stopped reporting (their actor did not go down); a later heartbeat restores them.
void drop_lost(RegistryPointer self, const std::vector<std::string>& lost, bool revivable) {
  auto& state = self->state;
  if (lost.empty()) return;
  for (const std::string& name : lost) {
    if (auto it = state.workers.find(name); it != state.workers.end()) {
      self->demonitor(it->second.handle);
      if (revivable) {
        if (state.expired.size() >= kMaxExpired) state.expired.clear();
        state.expired[name] = it->second;
      }
      state.workers.erase(it);
    }
    state.last_seen.erase(name);
    for (const registry_subscriber& subscriber : state.subscribers) self->send(subscriber, lost_atom::value, name);
  }
  publish(self);
}

// `label` names the registry in errors; it also keeps CAF 0.17 off its no-argument spawn path, which binds a
// reference to a null shared_ptr<tuple<>> (UBSan: init_fun_factory.hpp:85).
registry_actor::behavior_type registry_impl(RegistryPointer self, const std::string& label,
                                            std::chrono::milliseconds expiry) {
  self->state.label = label;
  self->state.expiry = expiry;
  if (expiry.count() > 0) self->delayed_send(self, expiry / 4, tick_atom::value);
  self->set_down_handler([self](const caf::down_msg& down) {
    auto& state = self->state;
    // A subscriber went away.
    state.subscribers.erase(std::remove_if(state.subscribers.begin(), state.subscribers.end(),
                                           [&](const registry_subscriber& s) { return s.address() == down.source; }),
                            state.subscribers.end());
    // A worker went away without leaving: tell subscribers, which fail its in-flight requests.
    std::vector<std::string> lost;
    for (const auto& [name, info] : state.workers) {
      if (info.handle.address() == down.source) lost.push_back(name);
    }
    drop_lost(self, lost, false);
    for (auto it = state.expired.begin(); it != state.expired.end();) {
      it = it->second.handle.address() == down.source ? state.expired.erase(it) : std::next(it);
    }
  });
  return {
      [self](join_atom, WorkerInfo info) -> caf::result<uint64_t> {
        auto& workers = self->state.workers;
        const caf::strong_actor_ptr& sender = self->current_sender();
        if (!sender || !info.handle || info.handle.node() != sender->node()) {
          return caf::make_error(caf::sec::runtime_error,
                                 "join " + info.name + ": the worker's actor must live on the joining node");
        }
        auto it = workers.find(info.name);
        if (it != workers.end() && it->second.handle.node() != sender->node()) {
          // Alive and held by another node: only its holder may replace it. Once it is down or expired (missed
          // heartbeats) the name is free again.
          return caf::make_error(caf::sec::runtime_error,
                                 "join " + info.name + ": the name is held by a live worker of another node");
        }
        self->state.expired.erase(info.name);
        if (it != workers.end() && it->second.handle != info.handle) self->demonitor(it->second.handle);
        self->monitor(info.handle);
        self->state.last_seen[info.name] = self->clock().now();
        workers[info.name] = std::move(info);
        publish(self);
        return workers.size();
      },
      [self](heartbeat_atom, const std::string& name, WorkerLoad load) {
        auto it = self->state.workers.find(name);
        if (it != self->state.workers.end() && !from_holder(self, it->second)) return;  // not its holder: ignored
        if (it == self->state.workers.end()) {
          auto back = self->state.expired.find(name);
          if (back == self->state.expired.end()) return;  // unknown, left, or down: ignored
          if (!from_holder(self, back->second)) return;
          self->monitor(back->second.handle);
          it = self->state.workers.emplace(name, std::move(back->second)).first;
          self->state.expired.erase(back);
        }
        self->state.last_seen[name] = self->clock().now();
        it->second.load = load;
        publish(self);
      },
      [self](leave_atom, const std::string& name) {
        if (auto back = self->state.expired.find(name);
            back != self->state.expired.end() && from_holder(self, back->second)) {
          self->state.expired.erase(back);
        }
        auto it = self->state.workers.find(name);
        if (it == self->state.workers.end() || !from_holder(self, it->second)) return;
        self->demonitor(it->second.handle);
        self->state.workers.erase(it);
        self->state.last_seen.erase(name);
        publish(self);
      },
      [self](list_atom) -> std::vector<WorkerInfo> { return snapshot(self->state); },
      [self](tick_atom) {
        auto& state = self->state;
        const auto now = self->clock().now();
        std::vector<std::string> expired;
        for (const auto& [name, seen] : state.last_seen) {
          if (now - seen > state.expiry) expired.push_back(name);
        }
        drop_lost(self, expired, true);
        self->delayed_send(self, state.expiry / 4, tick_atom::value);
      },
      [self](subscribe_atom, caf::actor subscriber) {
        if (!subscriber) return;
        auto typed = caf::actor_cast<registry_subscriber>(subscriber);
        self->monitor(typed);
        self->send(typed, workers_atom::value, snapshot(self->state));
        self->state.subscribers.push_back(std::move(typed));
      },
      [self](cache_atom, kvstore::CacheEventBatch& batch) {
        auto& state = self->state;
        auto it = state.workers.find(batch.worker);
        if (it == state.workers.end()) return;       // left or expired: its entries are being dropped
        if (!from_holder(self, it->second)) return;  // another node may not speak for this worker's cache
        for (const registry_subscriber& subscriber : state.subscribers)
          self->send(subscriber, cache_atom::value, batch);
      },
  };
}

}  // namespace

registry_actor spawn_registry(caf::actor_system& system, std::chrono::milliseconds expiry) {
  return system.spawn(registry_impl, std::string("registry"), expiry);
}

}  // namespace deltaserve::actors
