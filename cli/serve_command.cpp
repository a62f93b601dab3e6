// The cluster roles: serve (everything in one process), router, prefill, decode. Thin wiring of
// actors::Node (CAF), router::HttpServer (Beast) and the model files; no CAF or Beast headers here.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <ctime>
#include <memory>
#include <ostream>

#include <signal.h>

#include "actors/cluster_tls.hpp"
#include "actors/node.hpp"
#include "cli/commands.hpp"
#include "engine/model_config.hpp"
#include "router/api_keys.hpp"
#include "router/http_server.hpp"
#include "telemetry/metrics.hpp"
#include "telemetry/metrics_listener.hpp"
#include "tokenizer/tiktoken_tokenizer.hpp"

namespace deltaserve::cli {
namespace {

int fail(std::ostream& err, const Status& status) {
  err << "error: " << status.message() << "\n" << std::flush;
  return 1;
}

// Blocks SIGTERM/SIGINT in this thread before any other thread starts (so they inherit the mask), and
// waits for one of them with sigwait: no async-signal-safety concerns.
class SignalWaiter {
 public:
  SignalWaiter() {
    sigemptyset(&set_);
    sigaddset(&set_, SIGTERM);
    sigaddset(&set_, SIGINT);
    pthread_sigmask(SIG_BLOCK, &set_, nullptr);
  }
  int wait() {
    int signal = 0;
    sigwait(&set_, &signal);
    return signal;
  }

 private:
  sigset_t set_;
};

// Id of the served model: --served-model-name, else "deltaserve-<dir>" for the built-in model, else the
// directory's basename.
std::string served_name(const std::optional<std::string>& flag, const std::optional<std::string>& model,
                        const std::filesystem::path& dir) {
  if (flag && !flag->empty()) return *flag;
  std::filesystem::path d = dir;
  if (d.filename().empty()) d = d.parent_path();
  return model ? d.filename().string() : "deltaserve-" + d.filename().string();
}

std::vector<int32_t> stop_token_ids(const engine::ModelConfig& config, const tokenizer::Tokenizer& tok) {
  std::vector<int32_t> ids;
  if (config.eos_token_id >= 0) ids.push_back(config.eos_token_id);
  if (auto im_end = tok.special_token_id("<|im_end|>")) ids.push_back(*im_end);
  return ids;
}

Result<std::pair<std::string, uint16_t>> parse_host_port(const std::string& text) {
  const auto colon = text.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == text.size()) {
    return invalid_argument("--join must be HOST:PORT, got '" + text + "'");
  }
  try {
    const int port = std::stoi(text.substr(colon + 1));
    if (port <= 0 || port > 65535) throw std::out_of_range("port");
    return std::make_pair(text.substr(0, colon), static_cast<uint16_t>(port));
  } catch (const std::exception&) {
    return invalid_argument("--join must be HOST:PORT, got '" + text + "'");
  }
}

// Every HOST:PORT of `flags`, each of which may be a comma list; duplicates are an error.
Result<std::vector<actors::ClusterAddress>> parse_join_list(const std::vector<std::string>& flags) {
  std::vector<actors::ClusterAddress> out;
  for (const std::string& flag : flags) {
    size_t begin = 0;
    while (begin <= flag.size()) {
      const size_t end = std::min(flag.find(',', begin), flag.size());
      auto address = parse_host_port(flag.substr(begin, end - begin));
      if (!address.is_ok()) return address.status();
      for (const auto& seen : out) {
        if (seen.host == address->first && seen.port == address->second) {
          return invalid_argument("--join names " + address->first + ":" + std::to_string(address->second) + " twice");
        }
      }
      out.push_back({address->first, address->second});
      begin = end + 1;
    }
  }
  if (out.empty()) return invalid_argument("--join: no router address");
  return out;
}

// The Metrics of one process, and its separate listener when `listen` is set ("deltaserve: metrics
// listening on http://HOST:PORT/metrics" on stdout). The collect hook that reads this node's workers
// is removed by the destructor, before the node goes away.
class ProcessMetrics {
 public:
  ProcessMetrics(std::string model_name, std::string role)
      : metrics_(std::make_shared<telemetry::Metrics>(telemetry::MetricsOptions{model_name, role, 16})) {}
  ~ProcessMetrics() { close(); }

  // Stops the listener and removes the node hook (call before the node shuts down). Idempotent.
  void close() {
    listener_.reset();
    if (hook_ != 0) metrics_->remove_collect_hook(hook_);
    hook_ = 0;
  }

  // What the node's worker counters cannot say by themselves.
  struct WorkerLayout {
    int64_t decode_slots_total = 0;       // decode state slots of this node's decode workers
    int64_t prefill_workers = 0;          // prefill workers in this node (their pools are summed)
    int64_t checkpoint_budget_bytes = 0;  // per prefill worker, when its prefix cache is on
    bool count_handoffs = true;           // false when prefill and decode share the node (both count one)
    bool ucx = false;                     // transport ucx: the transfer engine's gauges too
  };

  // At each scrape: this node's worker counters (Node::worker_stats) and, with `router`, the router's
  // totals (Node::router_stats); bounded waits on local actors.
  void read_node(actors::Node& node, const WorkerLayout& layout, bool router) {
    hook_ = metrics_->add_collect_hook([this, &node, layout, router] {
      if (router) {
        const actors::NodeRouterStats r = node.router_stats();
        metrics_->set_router_totals(
            {r.admitted, r.routed_to_hit, r.expected_cached_tokens, r.index_events, r.index_errors});
        metrics_->set_index_stats({r.index_entries, r.index_bytes});
      }
      if (layout.decode_slots_total == 0 && layout.prefill_workers == 0) return;
      const actors::NodeWorkerStats stats = node.worker_stats();
      telemetry::WorkerGaugeSnapshot w;
      w.requests_active = stats.active;
      w.requests_queued = stats.queued;
      if (layout.decode_slots_total > 0) {
        w.state_slots_total = layout.decode_slots_total;
        w.state_slots_free = stats.free_slots;
      }
      if (layout.prefill_workers > 0) {
        w.prefill_slots_total = stats.slots_total;
        w.prefill_slots_free = stats.slots_free;
        if (layout.checkpoint_budget_bytes > 0) {
          w.pages_total = stats.pages_total;
          w.pages_free = stats.pages_free;
          w.cache_entries = stats.cache_entries;
          w.checkpoints_stored = stats.checkpoints;
          w.checkpoint_bytes = stats.checkpoint_bytes;
          w.checkpoint_budget_bytes = layout.checkpoint_budget_bytes * layout.prefill_workers;
          w.cache_evictions_total = stats.cache_evictions;
        }
      }
      w.steps_total = stats.steps;
      if (layout.count_handoffs) w.handoffs_total = stats.handoffs;
      w.handoffs_failed_total = stats.rejected;
      w.handoff_bytes_total = stats.handoff_bytes;
      w.handoff_seconds_total = static_cast<double>(stats.handoff_us) * 1e-6;
      if (layout.ucx) {
        const actors::NodeTransferStats t = node.transfer_stats();
        w.transfers_pending = t.transfers_pending;
        w.transfer_requests_in_flight = t.requests_in_flight;
        w.transfer_region_uses = t.region_uses;
      }
      metrics_->set_worker_gauges(w);
    });
  }

  // `health`: what /health on the listener answers (none: /health is not served there).
  Status listen(const std::optional<std::string>& address, std::ostream& out,
                telemetry::MetricsListener::HealthCheck health = {}) {
    if (!address || address->empty()) return Status::ok();
    auto listener = telemetry::MetricsListener::start(*address, metrics_, std::move(health));
    if (!listener.is_ok()) return listener.status();
    listener_ = std::move(listener).value();
    const std::string host = address->substr(0, address->rfind(':'));
    out << "deltaserve: metrics listening on http://" << host << ":" << listener_->port() << "/metrics\n" << std::flush;
    return Status::ok();
  }

  const std::shared_ptr<telemetry::Metrics>& metrics() const { return metrics_; }

 private:
  std::shared_ptr<telemetry::Metrics> metrics_;
  std::unique_ptr<telemetry::MetricsListener> listener_;
  telemetry::Metrics::HookId hook_ = 0;
};

// The router's observations into this process's Metrics, once the HTTP front has made them (calls
// before that, during start-up, are dropped).
class MetricsRouterObserver final : public actors::RouterObserver {
 public:
  // `transport`: the handoff transport label ("caf" | "ucx"; a router alone cannot know its workers').
  explicit MetricsRouterObserver(std::string transport) : transport_(std::move(transport)) {}
  void attach(std::shared_ptr<telemetry::Metrics> metrics) { std::atomic_store(&metrics_, std::move(metrics)); }
  void queue_time(double seconds) override {
    if (auto m = std::atomic_load(&metrics_)) m->observe_queue_time(seconds);
  }
  void prefix_lookup(std::string_view ns, int64_t query_tokens, int64_t hit_tokens) override {
    if (auto m = std::atomic_load(&metrics_)) m->observe_prefix_lookup(ns, query_tokens, hit_tokens);
  }
  void index_write(double seconds) override {
    if (auto m = std::atomic_load(&metrics_)) m->observe_index_write(seconds);
  }
  void handoff(int64_t bytes, double seconds, bool ok) override {
    if (auto m = std::atomic_load(&metrics_)) m->observe_handoff(transport_, bytes, seconds, ok);
  }
  void workers(const std::vector<actors::RouterWorkerLoad>& workers) override {
    auto m = std::atomic_load(&metrics_);
    if (!m) return;
    std::vector<telemetry::RouterWorkerView> views;
    for (const auto& w : workers) views.push_back({w.name, w.role, w.load, w.free_slots, true});
    m->set_router_workers(views);
  }

 private:
  std::string transport_;
  std::shared_ptr<telemetry::Metrics> metrics_;
};

struct FrontOptions {
  std::string host;
  uint16_t port;
  std::optional<std::string> api_keys;
  std::optional<std::string> served_model_name;
  std::optional<std::string> model;
  std::filesystem::path dir;
  int64_t drain_timeout_ms;
  std::optional<std::string> metrics_listen;
  std::string role;                                           // "serve" | "router" (deltaserve_build_info)
  ProcessMetrics::WorkerLayout workers;                       // serve: this node's workers (read at each scrape)
  std::shared_ptr<MetricsRouterObserver> observer = nullptr;  // the node's router observer, if any
  int64_t max_prompt_bytes = 0;                               // HttpServerConfig::max_prompt_bytes
  int64_t max_connections = 4096;                             // HttpServerConfig::max_connections
};

// Runs the HTTP front over `node` until a signal, then drains. Returns the exit code: 0 when every request
// finished within the drain timeout, kExitDrainCutRequests when some were cut.
int serve_http(actors::Node& node, const FrontOptions& o, SignalWaiter& signals, std::ostream& out, std::ostream& err) {
  auto config = engine::load_model_config(o.dir);
  if (!config.is_ok()) return fail(err, config.status());
  auto tok = tokenizer::Tokenizer::load(o.dir);
  if (!tok.is_ok()) return fail(err, tok.status().with_context("tokenizer in " + o.dir.string()));
  router::ApiKeys keys = router::ApiKeys::open();
  if (o.api_keys) {
    auto loaded = router::ApiKeys::load(*o.api_keys);
    if (!loaded.is_ok()) return fail(err, loaded.status());
    keys = std::move(loaded).value();
  }
  router::ModelInfo info;
  info.id = served_name(o.served_model_name, o.model, o.dir);
  info.context_length = config->max_position_embeddings;
  info.created_unix = static_cast<int64_t>(std::time(nullptr));
  ProcessMetrics metrics(info.id, o.role);
  metrics.read_node(node, o.workers, /*router=*/true);
  if (o.observer) o.observer->attach(metrics.metrics());
  if (Status listening = metrics.listen(o.metrics_listen, out); !listening.is_ok()) return fail(err, listening);
  router::HttpServerConfig http;
  http.host = o.host;
  http.port = o.port;
  http.metrics = metrics.metrics();
  http.metrics_endpoint = !o.metrics_listen || o.metrics_listen->empty();
  http.max_prompt_bytes = static_cast<size_t>(o.max_prompt_bytes);
  http.max_connections = static_cast<size_t>(o.max_connections);
  router::HttpServer server(http, *tok, info, stop_token_ids(*config, *tok), *node.service(), std::move(keys));
  auto port = server.start();
  if (!port.is_ok()) return fail(err, port.status());
  out << "deltaserve: http listening on http://" << o.host << ":" << *port << "\n" << std::flush;

  signals.wait();
  server.begin_drain();
  int code = 0;
  if (!server.wait_idle(std::chrono::milliseconds(o.drain_timeout_ms))) {
    // Their clients get an error (not a silently closed stream); bounded like one response write.
    const int64_t cut = server.cut_in_flight(std::chrono::milliseconds(5000));
    if (cut > 0) {
      err << "warning: drain timeout: " << cut << " requests cut short (error sent to their clients); exit status "
          << kExitDrainCutRequests << "\n";
      code = kExitDrainCutRequests;
    }
  }
  server.stop();
  if (o.observer) o.observer->attach(nullptr);
  metrics.close();
  node.shutdown();
  return code;
}

}  // namespace

void apply_cache_options(const CacheOptions& c, actors::NodeOptions& n) {
  n.prefix_cache = c.prefix_cache;
  n.cache_page_tokens = c.cache_page_tokens;
  n.cache_memory_bytes = c.cache_memory_mb << 20;
  n.checkpoint_memory_bytes = c.checkpoint_memory_mb << 20;
  n.checkpoint_interval_blocks = c.checkpoint_interval;
  n.checkpoint_on_second_hit = c.checkpoint_second_hit;
  n.state_slots = c.state_slots;
  n.cache_key_hex = c.cache_key.value_or("");
  if (c.index_dir && !c.index_dir->empty()) n.index_dir = *c.index_dir;
  n.routing_policy = c.routing_policy;
}

// `loopback`: every peer of this process is on this host (serve, or a worker joining 127.0.0.1/localhost).
void apply_transport_options(const TransportOptions& t, bool loopback, actors::NodeOptions& n) {
  n.transport = t.transport;
  const char* env_tls = std::getenv("UCX_TLS");
  const char* env_devices = std::getenv("UCX_NET_DEVICES");
  n.ucx_tls = t.ucx_tls ? *t.ucx_tls : (env_tls && *env_tls ? std::string(env_tls) : std::string("tcp,self"));
  n.ucx_net_devices =
      t.ucx_net_devices ? *t.ucx_net_devices : (env_devices ? std::string(env_devices) : (loopback ? "lo" : ""));
  n.transfer_deadline = std::chrono::milliseconds(t.transfer_deadline_ms);
}

void apply_security_options(const ClusterSecurityOptions& s, actors::NodeOptions& n) {
  if (s.tls_dir) n.cluster_tls_dir = *s.tls_dir;
  n.cluster_insecure = s.insecure;
}

int run_serve(const ServeOptions& o, std::ostream& out, std::ostream& err) {
  SignalWaiter signals;
  auto dir = resolve_model_dir(o.model);
  if (!dir.is_ok()) return fail(err, dir.status());
  actors::NodeOptions node_options;
  node_options.role = actors::NodeRole::kServe;
  node_options.model_dir = *dir;
  node_options.device = o.device;
  node_options.prefill_workers = o.prefill_workers;
  node_options.decode_workers = o.decode_workers;
  node_options.max_batch = o.max_batch;
  node_options.prefill_chunk = o.prefill_chunk;
  node_options.max_queue = o.max_queue;
  node_options.queue_timeout = std::chrono::milliseconds(o.queue_timeout_ms);
  apply_cache_options(o.cache, node_options);
  apply_transport_options(o.transport, true, node_options);
  auto observer = std::make_shared<MetricsRouterObserver>(o.transport.transport);
  node_options.router_observer = observer;
  auto node = actors::Node::start(node_options);
  if (!node.is_ok()) return fail(err, node.status());
  FrontOptions front{o.host,           o.port,  o.api_keys, o.served_model_name, o.model, *dir, o.drain_timeout_ms,
                     o.metrics_listen, "serve", {}};
  front.workers.decode_slots_total = o.decode_workers * o.max_batch;
  front.workers.prefill_workers = o.prefill_workers;
  front.workers.checkpoint_budget_bytes = o.cache.prefix_cache ? o.cache.checkpoint_memory_mb << 20 : 0;
  front.workers.count_handoffs = false;  // prefill and decode workers both count each handoff
  front.workers.ucx = node_options.transport == "ucx";
  front.observer = observer;
  front.max_prompt_bytes = o.max_prompt_bytes;
  front.max_connections = o.max_connections;
  return serve_http(**node, front, signals, out, err);
}

int run_router(const RouterOptions& o, std::ostream& out, std::ostream& err) {
  SignalWaiter signals;
  auto dir = resolve_model_dir(o.model);
  if (!dir.is_ok()) return fail(err, dir.status());
  actors::NodeOptions node_options;
  node_options.role = actors::NodeRole::kRouter;
  node_options.model_dir = *dir;
  node_options.max_queue = o.max_queue;
  node_options.queue_timeout = std::chrono::milliseconds(o.queue_timeout_ms);
  node_options.cluster_host = o.cluster_host;
  node_options.cluster_port = o.cluster_port;
  apply_cache_options(o.cache, node_options);
  apply_security_options(o.security, node_options);
  if (o.join && !o.join->empty()) {
    auto join = parse_host_port(*o.join);
    if (!join.is_ok()) return fail(err, join.status());
    node_options.router_joins_registry = true;
    node_options.join = {{join->first, join->second}};
  }
  auto observer = std::make_shared<MetricsRouterObserver>("caf");
  node_options.router_observer = observer;
  auto node = actors::Node::start(node_options);
  if (!node.is_ok()) return fail(err, node.status());
  if (node_options.router_joins_registry) {
    out << "deltaserve: router joined the registry at " << *o.join << "\n" << std::flush;
  } else {
    out << "deltaserve: cluster listening on " << o.cluster_host << ":" << (*node)->cluster_port() << "\n"
        << std::flush;
  }
  FrontOptions front{o.host,           o.port,   o.api_keys, o.served_model_name, o.model, *dir, o.drain_timeout_ms,
                     o.metrics_listen, "router", {}};
  front.observer = observer;
  front.max_prompt_bytes = o.max_prompt_bytes;
  front.max_connections = o.max_connections;
  return serve_http(**node, front, signals, out, err);
}

int run_worker(const WorkerOptions& o, std::ostream& out, std::ostream& err) {
  SignalWaiter signals;
  auto join = parse_join_list(o.join);
  if (!join.is_ok()) return fail(err, join.status());
  auto dir = resolve_model_dir(o.model);
  if (!dir.is_ok()) return fail(err, dir.status());
  actors::NodeOptions node_options;
  node_options.role = o.decode ? actors::NodeRole::kDecode : actors::NodeRole::kPrefill;
  node_options.model_dir = *dir;
  node_options.device = o.device;
  node_options.max_batch = o.max_batch;
  node_options.prefill_chunk = o.prefill_chunk;
  node_options.join = *join;
  node_options.join_timeout = std::chrono::milliseconds(o.join_timeout_ms);
  node_options.orphan_timeout = std::chrono::milliseconds(o.orphan_timeout_ms);
  if (o.peer_listen && !o.peer_listen->empty()) {
    const std::string& text = *o.peer_listen;
    const auto colon = text.rfind(':');
    int port = -1;
    try {
      if (colon != std::string::npos && colon > 0 && colon + 1 < text.size()) port = std::stoi(text.substr(colon + 1));
    } catch (const std::exception&) {
    }
    if (port < 0 || port > 65535) {
      return fail(err, invalid_argument("--peer-listen must be HOST:PORT, got '" + text + "'"));
    }
    node_options.peer_listen = {text.substr(0, colon), static_cast<uint16_t>(port)};
  }
  apply_cache_options(o.cache, node_options);
  const bool loopback = std::all_of(join->begin(), join->end(),
                                    [](const actors::ClusterAddress& a) { return actors::is_loopback_host(a.host); });
  apply_transport_options(o.transport, loopback, node_options);
  apply_security_options(o.security, node_options);
  auto node = actors::Node::start(node_options);
  if (!node.is_ok()) return fail(err, node.status());
  // Start-up waits for one router; the others are joined in the background as they answer (Node: rejoin).
  std::string routers;
  for (const actors::ClusterAddress& address : *join)
    routers += (routers.empty() ? "" : ",") + address.host + ":" + std::to_string(address.port);
  out << "deltaserve: " << (o.decode ? "decode" : "prefill") << " worker joined " << routers;
  if (join->size() > 1) out << " (" << (*node)->routers_joined() << " of " << join->size() << " routers so far)";
  out << "\n" << std::flush;
  std::optional<ProcessMetrics> metrics;
  if (o.metrics_listen && !o.metrics_listen->empty()) {
    metrics.emplace(served_name(std::nullopt, o.model, *dir), o.decode ? "decode" : "prefill");
    ProcessMetrics::WorkerLayout layout;
    layout.decode_slots_total = o.decode ? o.max_batch : 0;
    layout.prefill_workers = o.decode ? 0 : 1;
    layout.checkpoint_budget_bytes = o.cache.prefix_cache ? o.cache.checkpoint_memory_mb << 20 : 0;
    layout.ucx = node_options.transport == "ucx";
    metrics->read_node(**node, layout, /*router=*/false);
    // Liveness: joined to a router within the orphan timeout, and the worker actors answer.
    actors::Node& live = **node;
    auto health = [&live] { return live.liveness(std::chrono::seconds(5)); };
    if (Status listening = metrics->listen(o.metrics_listen, out, health); !listening.is_ok()) {
      metrics.reset();
      (*node)->shutdown();
      return fail(err, listening);
    }
  }
  signals.wait();
  // Leave the registry (no new work), finish what is active, then exit.
  if (!(*node)->drain_workers(std::chrono::milliseconds(o.drain_timeout_ms))) {
    err << "warning: drain timeout: requests still active\n";
  }
  metrics.reset();  // its hook reads the node
  (*node)->shutdown();
  return 0;
}

}  // namespace deltaserve::cli
