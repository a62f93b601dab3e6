// The cluster roles: serve (everything in one process), router, prefill, decode. Thin wiring of
// actors::Node (CAF), router::HttpServer (Beast) and the model files; no CAF or Beast headers here.
#include <chrono>
#include <ctime>
#include <ostream>

#include <signal.h>

#include "actors/node.hpp"
#include "cli/commands.hpp"
#include "engine/model_config.hpp"
#include "router/api_keys.hpp"
#include "router/http_server.hpp"
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

struct FrontOptions {
  std::string host;
  uint16_t port;
  std::optional<std::string> api_keys;
  std::optional<std::string> served_model_name;
  std::optional<std::string> model;
  std::filesystem::path dir;
  int64_t drain_timeout_ms;
};

// Runs the HTTP front over `node` until a signal, then drains. Returns the exit code.
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
  router::HttpServerConfig http;
  http.host = o.host;
  http.port = o.port;
  router::HttpServer server(http, *tok, info, stop_token_ids(*config, *tok), *node.service(), std::move(keys));
  auto port = server.start();
  if (!port.is_ok()) return fail(err, port.status());
  out << "deltaserve: http listening on http://" << o.host << ":" << *port << "\n" << std::flush;

  signals.wait();
  server.begin_drain();
  const bool idle = server.wait_idle(std::chrono::milliseconds(o.drain_timeout_ms));
  if (!idle) err << "warning: drain timeout: " << server.in_flight() << " requests still in flight\n";
  server.stop();
  node.shutdown();
  return 0;
}

}  // namespace

int run_serve(const ServeOptions& o, std::ostream& out, std::ostream& err) {
  SignalWaiter signals;
  auto dir = resolve_model_dir(o.model);
  if (!dir.is_ok()) return fail(err, dir.status());
  actors::NodeOptions node_options;
  node_options.role = actors::NodeRole::kServe;
  node_options.model_dir = *dir;
  node_options.prefill_workers = o.prefill_workers;
  node_options.decode_workers = o.decode_workers;
  node_options.max_batch = o.max_batch;
  node_options.prefill_chunk = o.prefill_chunk;
  node_options.max_queue = o.max_queue;
  auto node = actors::Node::start(node_options);
  if (!node.is_ok()) return fail(err, node.status());
  return serve_http(**node, {o.host, o.port, o.api_keys, o.served_model_name, o.model, *dir, o.drain_timeout_ms},
                    signals, out, err);
}

int run_router(const RouterOptions& o, std::ostream& out, std::ostream& err) {
  SignalWaiter signals;
  auto dir = resolve_model_dir(o.model);
  if (!dir.is_ok()) return fail(err, dir.status());
  actors::NodeOptions node_options;
  node_options.role = actors::NodeRole::kRouter;
  node_options.model_dir = *dir;
  node_options.max_queue = o.max_queue;
  node_options.cluster_host = o.cluster_host;
  node_options.cluster_port = o.cluster_port;
  auto node = actors::Node::start(node_options);
  if (!node.is_ok()) return fail(err, node.status());
  out << "deltaserve: cluster listening on " << o.cluster_host << ":" << (*node)->cluster_port() << "\n" << std::flush;
  return serve_http(**node, {o.host, o.port, o.api_keys, o.served_model_name, o.model, *dir, o.drain_timeout_ms},
                    signals, out, err);
}

int run_worker(const WorkerOptions& o, std::ostream& out, std::ostream& err) {
  SignalWaiter signals;
  auto join = parse_host_port(o.join);
  if (!join.is_ok()) return fail(err, join.status());
  auto dir = resolve_model_dir(o.model);
  if (!dir.is_ok()) return fail(err, dir.status());
  actors::NodeOptions node_options;
  node_options.role = o.decode ? actors::NodeRole::kDecode : actors::NodeRole::kPrefill;
  node_options.model_dir = *dir;
  node_options.max_batch = o.max_batch;
  node_options.prefill_chunk = o.prefill_chunk;
  node_options.join_host = join->first;
  node_options.join_port = join->second;
  node_options.join_timeout = std::chrono::milliseconds(o.join_timeout_ms);
  auto node = actors::Node::start(node_options);
  if (!node.is_ok()) return fail(err, node.status());
  out << "deltaserve: " << (o.decode ? "decode" : "prefill") << " worker joined " << join->first << ":" << join->second
      << "\n"
      << std::flush;
  signals.wait();
  // Leave the registry (no new work), finish what is active, then exit.
  if (!(*node)->drain_workers(std::chrono::milliseconds(o.drain_timeout_ms))) {
    err << "warning: drain timeout: requests still active\n";
  }
  (*node)->shutdown();
  return 0;
}

}  // namespace deltaserve::cli
