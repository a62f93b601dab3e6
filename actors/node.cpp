#include "actors/node.hpp"

#include <thread>

#include <caf/io/all.hpp>
#include <unistd.h>

#include "actors/cluster_service_impl.hpp"
#include "actors/decode_worker.hpp"
#include "actors/prefill_worker.hpp"
#include "actors/registry_actor.hpp"
#include "actors/router_actor.hpp"

namespace deltaserve::actors {
namespace {

std::string default_worker_name(const char* role) {
  char host[256] = {0};
  if (::gethostname(host, sizeof(host) - 1) != 0) std::snprintf(host, sizeof(host), "localhost");
  return std::string(role) + "@" + host + ":" + std::to_string(::getpid());
}

}  // namespace

struct Node::Impl {
  NodeOptions options;
  caf::actor_system_config config;
  std::unique_ptr<caf::actor_system> system;
  registry_actor registry;
  router_actor router;
  std::shared_ptr<RouterGauges> gauges;
  std::vector<prefill_actor> prefill;
  std::vector<decode_actor> decode;
  std::unique_ptr<ClusterService> service;
  uint16_t cluster_port = 0;
  bool stopped = false;
  std::vector<std::string> worker_names;  // joined workers of this node

  // Joins one worker through a request (so the caller knows the registry has it).
  Status join(const WorkerInfo& info) {
    caf::scoped_actor self{*system};
    Status result = Status::ok();
    self->request(registry, std::chrono::seconds(10), join_atom::value, info)
        .receive([](uint64_t) {},
                 [&](caf::error& err) {
                   result = Status(StatusCode::kUnavailable, "join " + info.name + ": " + system->render(err));
                 });
    return result;
  }

  void stop() {
    if (stopped || !system) return;
    stopped = true;
    service.reset();
    // Workers leave first (a graceful exit is not a lost worker); same connection as the joins, so it
    // arrives before the connection closes.
    if (registry) {
      for (const std::string& name : worker_names) caf::anon_send(registry, leave_atom::value, name);
    }
    auto kill = [&](const auto& handle) {
      if (handle) caf::anon_send_exit(handle, caf::exit_reason::user_shutdown);
    };
    for (auto& p : prefill) kill(p);
    for (auto& d : decode) kill(d);
    kill(router);
    kill(registry);
    prefill.clear();
    decode.clear();
    router = nullptr;
    registry = nullptr;
    system.reset();  // blocks until every actor (sinks included) has quit
  }
};

Node::Node(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Node::~Node() {
  shutdown();
}

Result<std::unique_ptr<Node>> Node::start(NodeOptions options) {
  auto impl = std::make_unique<Impl>();
  const NodeRole role = options.role;
  const bool needs_model = role == NodeRole::kServe || role == NodeRole::kPrefill || role == NodeRole::kDecode;
  const bool needs_tokenizer = role == NodeRole::kServe || role == NodeRole::kDecode;
  if (needs_model && !options.model) {
    auto model = engine::Model::load(options.model_dir);
    if (!model.is_ok()) return model.status().with_context("load model " + options.model_dir.string());
    options.model = std::shared_ptr<const engine::Model>(std::move(model).value());
  }
  if (needs_tokenizer && !options.tokenizer) {
    auto tok = tokenizer::Tokenizer::load(options.model_dir);
    if (!tok.is_ok()) return tok.status().with_context("tokenizer in " + options.model_dir.string());
    options.tokenizer = std::make_shared<const tokenizer::Tokenizer>(std::move(tok).value());
  }

  impl->config.load<caf::io::middleman>();
  register_wire_types(impl->config);
  impl->config.set("logger.verbosity", caf::atom("quiet"));
  impl->config.set("logger.file-verbosity", caf::atom("quiet"));
  impl->system = std::make_unique<caf::actor_system>(impl->config);
  caf::actor_system& sys = *impl->system;
  auto node = std::unique_ptr<Node>(new Node(std::move(impl)));
  Impl& n = *node->impl_;
  n.options = options;

  if (role == NodeRole::kServe || role == NodeRole::kRouter) {
    // Workers report every heartbeat_interval; ten missed reports and a worker counts as lost.
    n.registry = spawn_registry(sys, options.heartbeat_interval * 10);
    n.gauges = std::make_shared<RouterGauges>();
    n.router = spawn_router(sys, RouterConfig{options.max_queue}, n.registry, n.gauges);
    n.service = std::make_unique<ClusterService>(
        std::unique_ptr<ClusterService::Impl>(new ClusterService::Impl{sys, n.router, n.gauges}));
  }
  if (role == NodeRole::kRouter) {
    auto port = sys.middleman().publish(n.registry, options.cluster_port, options.cluster_host.c_str(), true);
    if (!port) {
      const std::string why = sys.render(port.error());
      n.stop();
      return Status(StatusCode::kUnavailable, "cannot listen for workers on " + options.cluster_host + ":" +
                                                  std::to_string(options.cluster_port) + ": " + why);
    }
    n.cluster_port = *port;
  }
  if (role == NodeRole::kPrefill || role == NodeRole::kDecode) {
    // Connect with backoff until the deadline: the router may still be starting.
    const auto deadline = std::chrono::steady_clock::now() + options.join_timeout;
    auto backoff = std::chrono::milliseconds(50);
    std::string last_error;
    while (true) {
      auto remote = sys.middleman().remote_actor<registry_actor>(options.join_host, options.join_port);
      if (remote) {
        n.registry = *remote;
        break;
      }
      last_error = sys.render(remote.error());
      if (std::chrono::steady_clock::now() + backoff > deadline) {
        n.stop();
        return Status(StatusCode::kDeadlineExceeded, "cannot join the registry at " + options.join_host + ":" +
                                                         std::to_string(options.join_port) + ": " + last_error);
      }
      std::this_thread::sleep_for(backoff);
      backoff = std::min(backoff * 2, std::chrono::milliseconds(1000));
    }
  }

  // Workers: spawned with the registry handle (local or remote), then joined.
  auto add_prefill = [&](const std::string& name) -> Status {
    PrefillWorkerConfig cfg{name, options.prefill_chunk, options.heartbeat_interval};
    prefill_actor worker = spawn_prefill_worker(sys, options.model, n.registry, cfg);
    n.prefill.push_back(worker);
    n.worker_names.push_back(name);
    return n.join(WorkerInfo{name, kPrefillRole, caf::actor_cast<caf::actor>(worker), options.prefill_chunk, {}});
  };
  auto add_decode = [&](const std::string& name) -> Status {
    DecodeWorkerConfig cfg{name, options.max_batch, options.heartbeat_interval};
    decode_actor worker = spawn_decode_worker(sys, options.model, options.tokenizer, n.registry, cfg);
    n.decode.push_back(worker);
    n.worker_names.push_back(name);
    WorkerLoad load;
    load.free_slots = options.max_batch;
    return n.join(WorkerInfo{name, kDecodeRole, caf::actor_cast<caf::actor>(worker), options.max_batch, load});
  };
  Status joined = Status::ok();
  if (role == NodeRole::kServe) {
    for (int64_t i = 0; i < options.prefill_workers && joined.is_ok(); ++i)
      joined = add_prefill("prefill-" + std::to_string(i));
    for (int64_t i = 0; i < options.decode_workers && joined.is_ok(); ++i)
      joined = add_decode("decode-" + std::to_string(i));
  } else if (role == NodeRole::kPrefill) {
    joined = add_prefill(options.worker_name.empty() ? default_worker_name("prefill") : options.worker_name);
  } else if (role == NodeRole::kDecode) {
    joined = add_decode(options.worker_name.empty() ? default_worker_name("decode") : options.worker_name);
  }
  if (!joined.is_ok()) {
    n.stop();
    return joined;
  }
  return node;
}

router::InferenceService* Node::service() {
  return impl_->service.get();
}
uint16_t Node::cluster_port() const {
  return impl_->cluster_port;
}

bool Node::drain_workers(std::chrono::milliseconds timeout) {
  Impl& n = *impl_;
  if (!n.system) return true;
  for (auto& p : n.prefill) caf::anon_send(p, drain_atom::value);
  for (auto& d : n.decode) caf::anon_send(d, drain_atom::value);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  caf::scoped_actor self{*n.system};
  while (std::chrono::steady_clock::now() < deadline) {
    int64_t busy = 0;
    auto count = [&](const auto& worker) {
      self->request(worker, std::chrono::seconds(5), stats_atom::value)
          .receive([&](const WorkerStats& s) { busy += s.active + s.queued; }, [&](caf::error&) {});
    };
    for (auto& p : n.prefill) count(p);
    for (auto& d : n.decode) count(d);
    if (busy == 0) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

NodeWorkerStats Node::worker_stats() {
  NodeWorkerStats out;
  Impl& n = *impl_;
  if (!n.system) return out;
  caf::scoped_actor self{*n.system};
  auto add = [&](const auto& worker) {
    self->request(worker, std::chrono::seconds(5), stats_atom::value)
        .receive(
            [&](const WorkerStats& s) {
              out.active += s.active;
              out.queued += s.queued;
              out.free_slots += s.free_slots;
              out.steps += s.steps;
              out.handoffs += s.handoffs;
              out.handoff_bytes += s.handoff_bytes;
              out.handoff_us += s.handoff_us;
              out.rejected += s.rejected;
            },
            [&](caf::error&) {});
  };
  for (auto& p : n.prefill) add(p);
  for (auto& d : n.decode) add(d);
  return out;
}

void Node::shutdown() {
  if (impl_) impl_->stop();
}

}  // namespace deltaserve::actors
