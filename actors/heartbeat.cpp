#include "actors/heartbeat.hpp"

namespace deltaserve::actors {
namespace {

load_reporter::behavior_type reporter(load_reporter::pointer self, registry_actor registry, std::string name,
                                      std::chrono::milliseconds interval, std::shared_ptr<const LoadBoard> board,
                                      caf::actor worker) {
  self->monitor(worker);
  self->set_down_handler([self](const caf::down_msg&) { self->quit(); });
  auto report = [self, registry, name, board] {
    if (auto load = board->read()) self->send(registry, heartbeat_atom::value, name, *load);
  };
  self->delayed_send(self, interval, tick_atom::value);
  return {
      [report](poke_atom) { report(); },
      [self, report, interval](tick_atom) {
        report();
        self->delayed_send(self, interval, tick_atom::value);
      },
  };
}

}  // namespace

load_reporter spawn_load_reporter(caf::actor_system& system, registry_actor registry, std::string name,
                                  std::chrono::milliseconds interval, std::shared_ptr<const LoadBoard> board,
                                  caf::actor worker) {
  return system.spawn<caf::detached>(reporter, std::move(registry), std::move(name), interval, std::move(board),
                                     std::move(worker));
}

}  // namespace deltaserve::actors
