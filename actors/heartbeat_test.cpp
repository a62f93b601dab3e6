// A worker whose actor cannot run (its actor system's only scheduler thread held by a long task, as in a
// CPU-starved process) keeps reporting through its load reporter thread, so the registry does not declare
// it lost. Before the reporter existed, the worker actor sent its own reports and the registry dropped it
// after ten missed intervals.
#include "actors/heartbeat.hpp"

#include <future>
#include <thread>

#include <caf/io/all.hpp>
#include <gtest/gtest.h>

#include "actors/decode_worker.hpp"
#include "actors/registry_actor.hpp"
#include "actors/test_model.hpp"
#include "actors/test_sink.hpp"

namespace deltaserve::actors {
namespace {

using namespace std::chrono_literals;

bool listed(caf::actor_system& system, const registry_actor& registry, const std::string& name) {
  caf::scoped_actor self{system};
  bool found = false;
  self->request(registry, caf::infinite, list_atom::value)
      .receive(
          [&](const std::vector<WorkerInfo>& workers) {
            for (const WorkerInfo& w : workers) found = found || w.name == name;
          },
          [&](const caf::error&) {});
  return found;
}

TEST(LoadReporter, AWorkerWhoseActorCannotRunIsNotDeclaredLost) {
  const auto& tiny = testing::tiny_model();
  ASSERT_TRUE(tiny.model);
  constexpr auto kInterval = 200ms;  // the registry drops a worker after ten missed intervals: 2 s
  // Two actor systems connected over loopback, as a router process and a worker process.
  caf::actor_system_config registry_config;
  registry_config.load<caf::io::middleman>();
  register_wire_types(registry_config);
  caf::actor_system registry_system{registry_config};
  registry_actor registry = spawn_registry(registry_system, kInterval * 10);
  auto port = registry_system.middleman().publish(registry, 0, "127.0.0.1", true);
  ASSERT_TRUE(port) << registry_system.render(port.error());

  caf::actor_system_config worker_config;
  worker_config.load<caf::io::middleman>();
  register_wire_types(worker_config);
  worker_config.set("scheduler.max-threads", size_t{1});
  caf::actor_system worker_system{worker_config};
  auto remote = worker_system.middleman().remote_actor<registry_actor>("127.0.0.1", *port);
  ASSERT_TRUE(remote) << worker_system.render(remote.error());
  decode_actor worker = spawn_decode_worker(worker_system, tiny.model, tiny.tokenizer, *remote,
                                            DecodeWorkerConfig{"decode-starved", 2, kInterval});
  {
    caf::scoped_actor self{worker_system};
    WorkerInfo info{"decode-starved", kDecodeRole, caf::actor_cast<caf::actor>(worker), 2, {}, 0, {}};
    std::string refused;
    self->request(*remote, caf::infinite, join_atom::value, info)
        .receive([](uint64_t) {}, [&](const caf::error& e) { refused = worker_system.render(e); });
    ASSERT_EQ(refused, "");
  }
  ASSERT_TRUE(listed(registry_system, registry, "decode-starved"));

  // Hold the worker system's only scheduler thread for three times the expiry.
  std::promise<void> holding, release;
  std::shared_future<void> released = release.get_future().share();
  // The unused argument avoids CAF 0.17's no-argument spawn path (UB on a null shared_ptr<tuple<>>).
  auto blocker = worker_system.spawn(
      [&holding, released](caf::event_based_actor*, int) -> caf::behavior {
        return {[&holding, released](int) {
          holding.set_value();
          released.wait();
        }};
      },
      0);
  caf::anon_send(blocker, 1);
  holding.get_future().wait();
  const auto until = std::chrono::steady_clock::now() + kInterval * 30;
  bool always_listed = true;
  while (std::chrono::steady_clock::now() < until && always_listed) {
    always_listed = listed(registry_system, registry, "decode-starved");
    std::this_thread::sleep_for(kInterval);
  }
  release.set_value();
  EXPECT_TRUE(always_listed) << "the registry declared a worker lost whose actor only could not run";

  caf::anon_send_exit(worker, caf::exit_reason::user_shutdown);
  caf::anon_send_exit(blocker, caf::exit_reason::user_shutdown);
  caf::anon_send_exit(registry, caf::exit_reason::user_shutdown);
}

}  // namespace
}  // namespace deltaserve::actors
