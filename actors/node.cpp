#include "actors/node.hpp"

#include <algorithm>
#include <iostream>
#include <random>
#include <thread>

#include <arpa/inet.h>
#include <caf/io/all.hpp>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include "actors/cluster_service_impl.hpp"
#include "actors/cluster_tls.hpp"
#include "actors/decode_peers.hpp"
#include "actors/decode_worker.hpp"
#include "actors/prefill_worker.hpp"
#include "actors/registry_actor.hpp"
#include "actors/router_actor.hpp"
#include "actors/router_links.hpp"
#include "actors/tls_tunnel.hpp"
#include "actors/ucx_transport.hpp"
#if DS_ACTORS_CUDA
#include "kvstore/transfer/cuda/cuda_device_memory.hpp"
#endif
#include "engine/prefix_state.hpp"

namespace deltaserve::actors {
namespace {

uint64_t random_u64() {
  std::random_device device;
  return (static_cast<uint64_t>(device()) << 32) ^ device() ^ static_cast<uint64_t>(::getpid());
}

Result<kvstore::SipKey> cache_key(const NodeOptions& options) {
  if (!options.cache_key_hex.empty()) return kvstore::parse_secret_hex(options.cache_key_hex);
  kvstore::SipKey key;
  std::random_device device;
  for (auto& byte : key) byte = static_cast<uint8_t>(device());
  return key;
}

Result<RoutingPolicy> routing_policy(const std::string& name) {
  if (name == "cache-aware") return RoutingPolicy::kCacheAware;
  if (name == "load") return RoutingPolicy::kLoadOnly;
  return invalid_argument("routing policy: '" + name + "' is not cache-aware or load");
}

std::string default_worker_name(const char* role) {
  char host[256] = {0};
  if (::gethostname(host, sizeof(host) - 1) != 0) std::snprintf(host, sizeof(host), "localhost");
  return std::string(role) + "@" + host + ":" + std::to_string(::getpid());
}

// The cluster-port settings of `options`: the checked TLS files, none (plain TCP), or an error when plain TCP
// would be open to other hosts without cluster_insecure.
Result<std::optional<ClusterTlsFiles>> cluster_tls(const NodeOptions& options) {
  const bool publishes = options.role == NodeRole::kRouter && !options.router_joins_registry;
  const bool joins = options.role == NodeRole::kPrefill || options.role == NodeRole::kDecode ||
                     (options.role == NodeRole::kRouter && options.router_joins_registry);
  if (!options.cluster_tls_dir.empty()) {
    if (!publishes && !joins) {
      return invalid_argument("cluster_tls_dir (--cluster-tls-dir): the serve role has no cluster port");
    }
    auto files = load_cluster_tls_dir(options.cluster_tls_dir, "--cluster-tls-dir");
    if (!files.is_ok()) return files.status();
    return std::optional<ClusterTlsFiles>(std::move(files).value());
  }
  if (joins && options.join.empty()) return invalid_argument("join (--join): no router address to join");
  std::string host = publishes ? options.cluster_host : "";
  for (const ClusterAddress& address : joins ? options.join : std::vector<ClusterAddress>{}) {
    if (!is_loopback_host(address.host)) host = address.host;
  }
  if ((publishes || joins) && !options.cluster_insecure && !host.empty() && !is_loopback_host(host)) {
    return failed_precondition(
        std::string(publishes ? "cluster host " : "join host ") + host +
        " is not loopback and no --cluster-tls-dir is given: anyone who reaches the port could " +
        (publishes ? "join as a worker" : "pose as the router") +
        "; give --cluster-tls-dir (or DELTASERVE_CLUSTER_TLS_DIR), or --cluster-insecure to accept plain TCP");
  }
  return std::optional<ClusterTlsFiles>();
}

// One attempt to reach the registry published at host:port (with TLS: the worker's tunnel end on loopback).
// Bounded by `timeout`: a plain-TCP client of the TLS port sends nothing until the server's BASP handshake,
// which never comes, and CAF's own remote_actor would wait forever.
caf::expected<registry_actor> connect_registry(caf::actor_system& sys, const std::string& host, uint16_t port,
                                               std::chrono::milliseconds timeout) {
  caf::expected<registry_actor> result{caf::sec::cannot_connect_to_node};
  caf::scoped_actor self{sys};
  self->request(sys.middleman().actor_handle(), timeout, caf::connect_atom::value, host, port)
      .receive(
          [&](caf::node_id&, caf::strong_actor_ptr& actor, std::set<std::string>& interface) {
            if (!actor) {
              result = caf::sec::no_actor_published_at_port;
            } else if (!sys.assignable<registry_actor>(interface)) {
              result = caf::sec::unexpected_actor_messaging_interface;
            } else {
              result = caf::actor_cast<registry_actor>(std::move(actor));
            }
          },
          [&](caf::error& err) { result = std::move(err); });
  return result;
}

// This host's address on the route to host:port (a UDP socket "connected" there: nothing is sent), or "" when
// there is none.
std::string local_address_towards(const std::string& host, uint16_t port) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), std::to_string(port == 0 ? 9 : port).c_str(), &hints, &found) != 0) return "";
  std::string out;
  for (addrinfo* a = found; a != nullptr && out.empty(); a = a->ai_next) {
    const int fd = ::socket(a->ai_family, SOCK_DGRAM, 0);
    if (fd < 0) continue;
    sockaddr_storage local{};
    socklen_t length = sizeof(local);
    if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0 &&
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &length) == 0) {
      char text[INET6_ADDRSTRLEN] = {0};
      const void* address = local.ss_family == AF_INET6
                                ? static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&local)->sin6_addr)
                                : static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&local)->sin_addr);
      if (::inet_ntop(local.ss_family, address, text, sizeof(text)) != nullptr) out = text;
    }
    ::close(fd);
  }
  ::freeaddrinfo(found);
  return out;
}

}  // namespace

struct Node::Impl {
  NodeOptions options;
  caf::actor_system_config config;
  std::unique_ptr<caf::actor_system> system;
  registry_actor registry;
  bool own_registry = false;  // spawned here (else a remote one: never stopped from here)
  router_actor router;
  std::shared_ptr<RouterGauges> gauges;
  std::vector<prefill_actor> prefill;
  std::vector<decode_actor> decode;
  std::unique_ptr<ClusterService> service;
  uint16_t cluster_port = 0;
  bool stopped = false;
  std::vector<std::string> worker_names;  // joined workers of this node
  std::shared_ptr<UcxLink> ucx;           // transport "ucx": this process's transfer engine
  // cluster_tls_dir set: the cluster port's TLS (router: the TLS listener in front of CAF's loopback port;
  // workers: the loopback end CAF connects to, one per router). Stopped after the actor system: CAF's
  // connections run through them.
  std::vector<std::unique_ptr<TlsTunnel>> tunnels;
  // Worker roles: the links to the routers; `registry` is their fan-out. Stopped before the actor system.
  std::unique_ptr<RouterLinks> links;
  // kPrefill: the direct connections to decode nodes (their TLS tunnels). Stopped after the actor system.
  std::shared_ptr<DecodePeers> peers;

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
    // Workers leave first (a graceful exit is not a lost worker), and before the transfer engine closes: closing it
    // aborts the handoffs in flight, and a router that still listed this node's prefill worker would prefill them
    // again right here, where each attempt fails the same way (seen in CI: three attempts, then an error). The
    // list request after the leaves returns once the registry has processed them and told its routers (one sender,
    // so in order); an unreachable registry just means there is no one left to tell.
    if (links) {
      links->leave(worker_names);
      links->stop();
    } else if (registry && !worker_names.empty()) {
      caf::scoped_actor self{*system};
      for (const std::string& name : worker_names) self->send(registry, leave_atom::value, name);
      self->request(registry, std::chrono::seconds(2), list_atom::value)
          .receive([](const std::vector<WorkerInfo>&) {}, [](const caf::error&) {});
    }
    if (ucx) ucx->close();  // engine callbacks stop messaging actors before the actor system goes
    auto kill = [&](const auto& handle) {
      if (handle) caf::anon_send_exit(handle, caf::exit_reason::user_shutdown);
    };
    for (auto& p : prefill) kill(p);
    for (auto& d : decode) kill(d);
    kill(router);
    if (own_registry) kill(registry);
    prefill.clear();
    decode.clear();
    router = nullptr;
    registry = nullptr;
    system.reset();  // blocks until every actor (sinks included) has quit
    ucx.reset();     // the engine last: cancels what is still in flight
    // Closes the listener and every connection, joins its thread.
    for (auto& tunnel : tunnels) tunnel->stop();
    if (peers) peers->stop();
  }
};

Node::Node(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Node::~Node() {
  shutdown();
}

Result<std::unique_ptr<Node>> Node::start(NodeOptions options) {
  auto impl = std::make_unique<Impl>();
  const NodeRole role = options.role;
  // Before the model loads: a refused cluster setting should not wait for the weights.
  auto tls = cluster_tls(options);
  if (!tls.is_ok()) return tls.status();
  const bool needs_model = role == NodeRole::kServe || role == NodeRole::kPrefill || role == NodeRole::kDecode;
  const bool needs_tokenizer = role == NodeRole::kServe || role == NodeRole::kDecode;
  if (needs_model && !options.model) {
    auto model = engine::open_model(options.model_dir, options.device,
                                    engine::progress_printer(std::cerr, "loading weights to " + options.device.device));
    if (!model.is_ok()) return model.status().with_context("load model " + options.model_dir.string());
    if (options.device.device != "cpu") {
      const engine::BackendCapacity c = (*model)->backend()->capacity();
      std::cerr << "model on " << c.device << ": " << c.weight_bytes / (1 << 20) << " MiB of weights, " << c.state_slots
                << " request-state slots, " << c.cache_pages << " MLA pages of " << c.page_tokens << " tokens ("
                << c.requests_that_fit(32768) << " requests of 32k tokens fit)\n";
    }
    options.model = std::shared_ptr<const engine::Model>(std::move(model).value());
  }
  if (needs_tokenizer && !options.tokenizer) {
    auto tok = tokenizer::Tokenizer::load(options.model_dir);
    if (!tok.is_ok()) return tok.status().with_context("tokenizer in " + options.model_dir.string());
    options.tokenizer = std::make_shared<const tokenizer::Tokenizer>(std::move(tok).value());
  }

  auto key = cache_key(options);
  if (!key.is_ok()) return key.status().with_context("cache key");
  auto policy = routing_policy(options.routing_policy);
  if (!policy.is_ok()) return policy.status();
  if (options.model_id.empty()) options.model_id = options.model_dir.filename().string();
  if (options.cache_key_hex.empty() && role != NodeRole::kServe && role != NodeRole::kDecode) {
    std::cerr << "warning: no --cache-key: block hashes use a random key of this process; cache-aware routing "
                 "needs the same key on every router and prefill worker\n";
  }
  std::shared_ptr<kvstore::PrefixIndex> index;
  if ((role == NodeRole::kServe || role == NodeRole::kRouter) && !options.index_dir.empty()) {
    auto opened = kvstore::PrefixIndex::open(options.index_dir);
    if (!opened.is_ok()) return opened.status().with_context("prefix index");
    index = std::shared_ptr<kvstore::PrefixIndex>(std::move(opened).value());
  }
  PrefillCacheConfig prefill_cache;
  if (options.prefix_cache && (role == NodeRole::kServe || role == NodeRole::kPrefill)) {
    const int64_t row_values = engine::mla_page_row_values(options.model->config());
    const int64_t page_bytes = options.cache_page_tokens * row_values * static_cast<int64_t>(sizeof(float));
    prefill_cache.enabled = true;
    prefill_cache.cache.pages.page_tokens = options.cache_page_tokens;
    prefill_cache.cache.pages.num_pages =
        page_bytes > 0 ? std::max<int64_t>(1, options.cache_memory_bytes / page_bytes) : 0;
    prefill_cache.cache.checkpoint_budget_bytes = options.checkpoint_memory_bytes;
    prefill_cache.cache.policy.interval_blocks = options.checkpoint_interval_blocks;
    prefill_cache.cache.policy.only_on_second_hit = options.checkpoint_on_second_hit;
    prefill_cache.hash_key = *key;
    prefill_cache.model_id = options.model_id;
    PrefillWorkerConfig check{"prefill", options.prefill_chunk, options.heartbeat_interval, options.state_slots,
                              prefill_cache};
    if (Status valid = validate(check, options.model->config()); !valid.is_ok()) return valid;
  }

  std::shared_ptr<UcxLink> ucx;
  if (options.transport == "ucx") {
    if (role != NodeRole::kRouter) {
      UcxLinkConfig link;
      link.tls = options.ucx_tls;
      link.net_devices = options.ucx_net_devices;
      link.deadline = options.transfer_deadline;
      link.reserve_timeout = options.transfer_reserve_timeout;
      link.piece_bytes = options.transfer_piece_bytes > 0 ? static_cast<uint64_t>(options.transfer_piece_bytes) : 0;
      link.faults = options.transfer_faults;
      engine::Backend* backend = options.model ? options.model->backend() : nullptr;
#if DS_ACTORS_CUDA
      if (backend != nullptr) {  // a GPU worker: the engine may move states in GPU memory
        // The model's GPU: from --device; a preloaded model (tests, embedding) runs on GPU 0 unless it says.
        auto ordinal = engine::parse_device(options.device.device);
        auto device =
            kvstore::transfer::cuda::CudaDeviceMemory::create({ordinal.is_ok() && *ordinal >= 0 ? *ordinal : 0});
        if (!device.is_ok()) return device.status().with_context("transport ucx: GPU memory");
        link.device = *device;
      }
#endif
      auto created = UcxLink::create(link);
      if (!created.is_ok()) return created.status().with_context("transport ucx");
      ucx = std::move(created).value();
      if (link.device) {
        const Status registered = ucx->register_device_memory(*backend);
        std::cerr << "transport ucx: "
                  << (registered.is_ok() ? "request states move from GPU memory to GPU memory"
                                         : "request states move through host memory: " + registered.message())
                  << "\n";
      }
    }
  } else if (options.transport != "caf") {
    return invalid_argument("transport: '" + options.transport + "' is not caf or ucx");
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
  n.ucx = ucx;

  const bool worker_node = role == NodeRole::kPrefill || role == NodeRole::kDecode;
  const bool router_joins = role == NodeRole::kRouter && options.router_joins_registry;
  if (role == NodeRole::kServe || (role == NodeRole::kRouter && !options.router_joins_registry)) {
    // Workers report every heartbeat_interval; ten missed reports and a worker counts as lost.
    n.registry = spawn_registry(sys, options.heartbeat_interval * 10);
    n.own_registry = true;
  }
  // With TLS, CAF connects to this process's end of a tunnel (actors/tls_tunnel.hpp) per router, which opens a
  // mutual-TLS connection to that router for each connection CAF makes (a rejoin's included).
  std::vector<RouterEndpoint> endpoints;
  if (worker_node || router_joins) {
    for (const ClusterAddress& address : options.join) {
      RouterEndpoint endpoint{address.host + ":" + std::to_string(address.port), address.host, address.port, {}};
      if (tls->has_value()) {
        auto tunnel = TlsTunnel::connect(**tls, address.host, address.port);
        if (!tunnel.is_ok()) {
          n.stop();
          return tunnel.status().with_context("cluster TLS tunnel to " + address.host);
        }
        endpoint.caf_host = "127.0.0.1";
        endpoint.caf_port = (*tunnel)->port();
        endpoint.transport_error = [raw = tunnel->get()] { return raw->last_error(); };
        n.tunnels.push_back(std::move(tunnel).value());
      }
      endpoints.push_back(std::move(endpoint));
      if (!worker_node) break;  // a router joins one registry
    }
  }
  const std::string join_what =
      std::string(tls->has_value() ? " over TLS" : " over plain TCP (a TLS listener never answers it)");
  if (router_joins) {
    // Connect with backoff until the deadline: the router may still be starting.
    const RouterEndpoint& endpoint = endpoints.front();
    const auto deadline = std::chrono::steady_clock::now() + options.join_timeout;
    auto backoff = std::chrono::milliseconds(50);
    std::string last_error;
    while (true) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      auto remote =
          connect_registry(sys, endpoint.caf_host, endpoint.caf_port, std::max(left, std::chrono::milliseconds(1)));
      if (remote) {
        n.registry = *remote;
        break;
      }
      last_error = sys.render(remote.error());
      if (endpoint.transport_error && !endpoint.transport_error().empty()) {
        last_error += " (" + endpoint.transport_error() + ")";
      }
      if (std::chrono::steady_clock::now() + backoff > deadline) {
        n.stop();
        return Status(StatusCode::kDeadlineExceeded,
                      "cannot join the registry at " + endpoint.label + join_what + ": " + last_error);
      }
      std::this_thread::sleep_for(backoff);
      backoff = std::min(backoff * 2, std::chrono::milliseconds(1000));
    }
  }
  if (worker_node) {
    RouterLinkOptions links;
    links.backoff_initial = options.rejoin_backoff_initial;
    links.backoff_max = options.rejoin_backoff_max;
    links.probe_interval = options.router_probe_interval;
    links.probe_timeout = options.router_probe_timeout;
    links.join_timeout = std::min<std::chrono::milliseconds>(options.router_probe_timeout, std::chrono::seconds(10));
    n.links = std::make_unique<RouterLinks>(sys, links);
    n.registry = n.links->registry();
  }
  if (role == NodeRole::kServe || role == NodeRole::kRouter) {
    n.gauges = std::make_shared<RouterGauges>();
    RouterConfig router_config;
    router_config.max_queue = options.max_queue;
    router_config.queue_timeout = options.queue_timeout;
    router_config.policy = *policy;
    router_config.index = index;
    router_config.hash_key = *key;
    router_config.observer = options.router_observer;
    n.router = spawn_router(sys, router_config, n.registry, n.gauges);
    n.service = std::make_unique<ClusterService>(
        std::unique_ptr<ClusterService::Impl>(new ClusterService::Impl{sys, n.router, n.gauges}));
  }
  if (role == NodeRole::kRouter && !options.router_joins_registry) {
    // With TLS, CAF publishes plain BASP on loopback only (an ephemeral port) and the tunnel listens on the
    // cluster host:port, splicing each authenticated connection to it (actors/tls_tunnel.hpp says why).
    const bool tunnelled = tls->has_value();
    auto port = sys.middleman().publish(n.registry, tunnelled ? 0 : options.cluster_port,
                                        tunnelled ? "127.0.0.1" : options.cluster_host.c_str(), true);
    if (!port) {
      const std::string why = sys.render(port.error());
      n.stop();
      const std::string where = tunnelled ? "127.0.0.1:0 (behind the TLS tunnel)"
                                          : options.cluster_host + ":" + std::to_string(options.cluster_port);
      return Status(StatusCode::kUnavailable, "cannot listen for workers on " + where + ": " + why);
    }
    n.cluster_port = *port;
    if (tunnelled) {
      auto tunnel = TlsTunnel::serve(**tls, options.cluster_host, options.cluster_port, *port);
      if (!tunnel.is_ok()) {
        n.stop();
        return tunnel.status().with_context("cannot listen for workers over TLS");
      }
      n.cluster_port = (*tunnel)->port();
      n.tunnels.push_back(std::move(tunnel).value());
    }
  }
  // Workers: spawned with the registry handle (local, remote, or the links' fan-out), then joined (worker nodes:
  // by the links, to every router).
  std::vector<WorkerInfo> link_workers;
  auto add_prefill = [&](const std::string& name) -> Status {
    PrefillWorkerConfig cfg{name, options.prefill_chunk, options.heartbeat_interval, options.state_slots,
                            prefill_cache};
    cfg.prefix_cache.epoch = prefill_cache.enabled ? (random_u64() | 1) : 0;
    if (worker_node) {
      if (!n.peers) n.peers = std::make_shared<DecodePeers>(*tls);
      cfg.peers = n.peers;
      cfg.peer_connect_timeout = options.peer_connect_timeout;
    }
    prefill_actor worker =
        spawn_prefill_worker(sys, options.model, n.registry, cfg, n.ucx ? make_ucx_transport(n.ucx) : nullptr);
    n.prefill.push_back(worker);
    n.worker_names.push_back(name);
    WorkerInfo info{name, kPrefillRole, caf::actor_cast<caf::actor>(worker), options.prefill_chunk, {}, 0, {}};
    info.cache_epoch = cfg.prefix_cache.epoch;
    info.model_id = options.model_id;
    if (worker_node) {
      link_workers.push_back(info);
      return Status::ok();
    }
    return n.join(info);
  };
  // A decode worker of a worker node takes direct connections from prefill workers on its peer address
  // (actors/decode_peers.hpp), behind a TLS tunnel when the cluster uses TLS.
  auto publish_peer = [&](const decode_actor& worker) -> Result<ClusterAddress> {
    ClusterAddress peer = options.peer_listen;
    if (peer.host.empty()) {
      const bool loopback = std::all_of(options.join.begin(), options.join.end(),
                                        [](const ClusterAddress& a) { return is_loopback_host(a.host); });
      peer.host = loopback ? "127.0.0.1" : local_address_towards(options.join.front().host, options.join.front().port);
      if (peer.host.empty()) {
        return failed_precondition("peer address (--peer-listen): no route from this host to the router at " +
                                   options.join.front().host + ", give HOST:PORT");
      }
    }
    if (!tls->has_value() && !options.cluster_insecure && !is_loopback_host(peer.host)) {
      return failed_precondition("peer host " + peer.host +
                                 " (--peer-listen) is not loopback and no --cluster-tls-dir is given: anyone who "
                                 "reaches the port could send the decode worker requests; give --cluster-tls-dir, "
                                 "or --cluster-insecure to accept plain TCP");
    }
    const bool tunnelled = tls->has_value();
    auto port =
        sys.middleman().publish(worker, tunnelled ? 0 : peer.port, tunnelled ? "127.0.0.1" : peer.host.c_str(), true);
    if (!port) {
      return Status(StatusCode::kUnavailable, "cannot listen for prefill workers on " + peer.host + ":" +
                                                  std::to_string(peer.port) + ": " + sys.render(port.error()));
    }
    peer.port = *port;
    if (tunnelled) {
      auto tunnel = TlsTunnel::serve(**tls, peer.host, options.peer_listen.port, *port);
      if (!tunnel.is_ok()) return tunnel.status().with_context("cannot listen for prefill workers over TLS");
      peer.port = (*tunnel)->port();
      n.tunnels.push_back(std::move(tunnel).value());
    }
    return peer;
  };
  auto add_decode = [&](const std::string& name) -> Status {
    DecodeWorkerConfig cfg{name, options.max_batch, options.heartbeat_interval};
    cfg.ucx = n.ucx;
    decode_actor worker = spawn_decode_worker(sys, options.model, options.tokenizer, n.registry, cfg);
    n.decode.push_back(worker);
    n.worker_names.push_back(name);
    WorkerLoad load;
    load.free_slots = options.max_batch;
    WorkerInfo info{name, kDecodeRole, caf::actor_cast<caf::actor>(worker), options.max_batch, load, 0, {}};
    if (worker_node) {
      auto peer = publish_peer(worker);
      if (!peer.is_ok()) return peer.status();
      info.peer_host = peer->host;
      info.peer_port = peer->port;
      link_workers.push_back(info);
      return Status::ok();
    }
    return n.join(info);
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
  if (joined.is_ok() && worker_node) {
    n.links->start(std::move(endpoints), std::move(link_workers));
    joined = n.links->wait_first_join(std::chrono::steady_clock::now() + options.join_timeout);
    if (joined.code() == StatusCode::kDeadlineExceeded) {
      std::string routers;
      for (const ClusterAddress& address : options.join)
        routers += (routers.empty() ? "" : ", ") + address.host + ":" + std::to_string(address.port);
      joined = Status(StatusCode::kDeadlineExceeded,
                      "cannot join the registry at " + routers + join_what + ": " + joined.message());
    }
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
  if (n.links) n.links->leave(n.worker_names);  // and no router is joined again: draining is not orphaned
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

int64_t Node::routers_joined() const {
  return impl_->links ? impl_->links->joined() : 0;
}

Status Node::liveness(std::chrono::milliseconds timeout) {
  Impl& n = *impl_;
  if (!n.system) return Status(StatusCode::kUnavailable, "stopped");
  if (n.links && n.options.orphan_timeout.count() > 0) {
    if (auto since = n.links->orphaned_since()) {
      const auto orphaned = std::chrono::steady_clock::now() - *since;
      if (orphaned > n.options.orphan_timeout) {
        return Status(
            StatusCode::kUnavailable,
            "joined to no router for " +
                std::to_string(std::chrono::duration_cast<std::chrono::seconds>(orphaned).count()) +
                " s (orphan timeout " +
                std::to_string(std::chrono::duration_cast<std::chrono::seconds>(n.options.orphan_timeout).count()) +
                " s)");
      }
    }
  }
  caf::scoped_actor self{*n.system};
  Status result = Status::ok();
  auto ask = [&](const auto& worker, const std::string& name) {
    self->request(worker, timeout, stats_atom::value)
        .receive([](const WorkerStats&) {},
                 [&](caf::error& error) {
                   if (result.is_ok()) {
                     result = Status(StatusCode::kUnavailable, name + " does not answer: " + n.system->render(error));
                   }
                 });
  };
  for (auto& p : n.prefill) ask(p, "prefill worker");
  for (auto& d : n.decode) ask(d, "decode worker");
  return result;
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
              out.slots_total += s.slots_total;
              out.slots_free += s.slots_free;
              out.pages_total += s.pages_total;
              out.pages_free += s.pages_free;
              out.cache_entries += s.cache_entries;
              out.checkpoints += s.checkpoints;
              out.checkpoint_bytes += s.checkpoint_bytes;
              out.cache_evictions += s.cache_evictions;
              out.prompt_tokens += s.prompt_tokens;
              out.cached_tokens += s.cached_tokens;
            },
            [&](caf::error&) {});
  };
  for (auto& p : n.prefill) add(p);
  for (auto& d : n.decode) add(d);
  return out;
}

NodeRouterStats Node::router_stats() {
  NodeRouterStats out;
  Impl& n = *impl_;
  if (!n.system || !n.router) return out;
  caf::scoped_actor self{*n.system};
  self->request(n.router, std::chrono::seconds(5), stats_atom::value)
      .receive(
          [&](const RouterStats& s) {
            out.admitted = s.admitted;
            out.routed_to_hit = s.routed_to_hit;
            out.expected_cached_tokens = s.expected_cached_tokens;
            out.index_events = s.index_events;
            out.index_errors = s.index_errors;
            out.index_entries = s.index_entries;
            out.index_bytes = s.index_bytes;
            out.retried = s.retried;
            out.failed = s.failed;
          },
          [&](caf::error&) {});
  return out;
}

NodeTransferStats Node::transfer_stats() {
  NodeTransferStats out;
  if (!impl_->ucx) return out;
  const kvstore::transfer::EngineStats s = impl_->ucx->engine().stats();
  out.regions = s.regions;
  out.region_uses = s.region_uses;
  out.requests_in_flight = s.requests_in_flight;
  out.endpoints = s.endpoints;
  out.transfers = s.transfers;
  out.transfers_pending = s.transfers_pending;
  out.bytes_sent = s.bytes_sent;
  out.bytes_received = s.bytes_received;
  out.pieces_rejected = s.pieces_rejected;
  return out;
}

void Node::shutdown() {
  if (impl_) impl_->stop();
}

}  // namespace deltaserve::actors
