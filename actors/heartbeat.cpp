#include "actors/heartbeat.hpp"

namespace deltaserve::actors {

LoadReporter::LoadReporter(caf::actor_system& system, registry_actor registry, std::string name,
                           std::chrono::milliseconds interval, const WorkerLoad& load)
    : registry_(std::move(registry)), name_(std::move(name)), interval_(interval), load_(load) {
  thread_ = std::thread([this, &system] { run(system); });
}

LoadReporter::~LoadReporter() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

void LoadReporter::set(const WorkerLoad& load) {
  {
    std::lock_guard lock(mutex_);
    load_ = load;
    changed_ = true;
  }
  wake_.notify_all();
}

void LoadReporter::set_draining() {
  std::lock_guard lock(mutex_);  // a report is sent under the lock: none starts after this returns
  draining_ = true;
}

void LoadReporter::run(caf::actor_system& system) {
  caf::scoped_actor self{system};
  std::unique_lock lock(mutex_);
  while (!stop_) {
    if (!draining_) {
      const WorkerLoad load = load_;
      changed_ = false;
      self->send(registry_, heartbeat_atom::value, name_, load);
    }
    wake_.wait_for(lock, interval_, [this] { return stop_ || changed_; });
  }
}

}  // namespace deltaserve::actors
