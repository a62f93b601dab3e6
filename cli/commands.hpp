// The subcommands of the `deltaserve` binary, apart from their flag parsing (cli/main.cpp), so tests
// can call them in-process. Each returns the process exit code and writes errors to stderr.
#pragma once

#include <cstdint>
#include <filesystem>
#include <iosfwd>
#include <optional>
#include <string>

#include "common/status.hpp"
#include "engine/open_model.hpp"

namespace deltaserve::cli {

// Directory of the built-in tiny model (`preset`), created deterministically on first use under
// $DELTASERVE_HOME (default: $XDG_CACHE_HOME/deltaserve, else ~/.cache/deltaserve). Concurrent
// first uses are safe: the model is written to a temporary directory and renamed into place.
Result<std::filesystem::path> builtin_model_dir(const std::string& preset = "tiny-linear");

// `--model DIR` if given, else the built-in tiny model.
Result<std::filesystem::path> resolve_model_dir(const std::optional<std::string>& model);

struct GenerateOptions {
  std::optional<std::string> model;
  engine::DeviceOptions device;
  std::string prompt;
  bool chat = false;
  int64_t max_tokens = 64;
  float temperature = 0.0f;
  float top_p = 1.0f;
  int32_t top_k = 0;
  uint64_t seed = 0;
  int32_t logprobs = -1;  // < 0: plain text; >= 0: one JSON line per token with its logprob and top-K alternatives
  int64_t prefill_chunk = 512;
  bool ignore_eos = false;
};
int run_generate(const GenerateOptions& options, std::ostream& out, std::ostream& err);

// Prints the token ids of `text` as a JSON list (no BOS is added).
struct TokenizeOptions {
  std::optional<std::string> model;
  std::string text;
  bool chat = false;      // wrap as a user message in the chat format (specials parsed)
  bool specials = false;  // parse special-token text in `text` as special ids
};
int run_tokenize(const TokenizeOptions& options, std::ostream& out, std::ostream& err);

int run_inspect_model(const std::string& path, std::ostream& out, std::ostream& err);

struct MakeModelCommandOptions {
  std::string preset = "tiny-linear";  // a preset name, or a config.json path / inline JSON object
  std::string out_dir;
  uint64_t seed = 0;
  std::string dtype = "bf16";  // f32 | bf16 | f16 | fp8
  uint64_t shard_bytes = 0;
};
int run_make_model(const MakeModelCommandOptions& options, std::ostream& out, std::ostream& err);

// Prefix cache (prefill workers) and prefix index + placement (routers); see actors::NodeOptions.
struct CacheOptions {
  bool prefix_cache = true;
  int64_t cache_page_tokens = 2048;
  int64_t cache_memory_mb = 256;
  int64_t checkpoint_memory_mb = 256;
  int64_t checkpoint_interval = 4;
  bool checkpoint_second_hit = false;
  int64_t state_slots = 2;
  std::optional<std::string> cache_key;  // 32 hex digits (or DELTASERVE_CACHE_KEY)
  std::optional<std::string> index_dir;  // routers: RocksDB prefix index directory
  std::string routing_policy = "cache-aware";
};

// Handoff transport of the workers (serve, prefill, decode); README "Cluster" flags.
struct TransportOptions {
  std::string transport = "caf";               // caf | ucx
  std::optional<std::string> ucx_tls;          // default: $UCX_TLS, else "tcp,self"
  std::optional<std::string> ucx_net_devices;  // default: $UCX_NET_DEVICES, else "lo" on loopback, else all
  int64_t transfer_deadline_ms = 10000;
};

// The cluster port's security (router, prefill, decode); actors::NodeOptions cluster_tls_dir / cluster_insecure.
struct ClusterSecurityOptions {
  std::optional<std::string> tls_dir;  // ca.crt, tls.crt, tls.key (or DELTASERVE_CLUSTER_TLS_DIR)
  bool insecure = false;               // plain TCP on a non-loopback cluster/join host
};

// The cluster roles (cli/serve_command.cpp). Each runs until SIGTERM/SIGINT, then drains and returns 0;
// fatal startup errors (bad model, port taken, registry unreachable) print "error: ..." and return 1.
struct ServeOptions {  // deltaserve serve: registry + router + workers + HTTP in one process
  std::optional<std::string> model;
  engine::DeviceOptions device;
  std::string host = "127.0.0.1";
  uint16_t port = 8000;
  std::optional<std::string> api_keys;
  std::optional<std::string> served_model_name;
  int64_t prefill_workers = 1;
  int64_t decode_workers = 1;
  int64_t max_batch = 32;
  int64_t prefill_chunk = 512;
  int64_t max_queue = 256;
  int64_t queue_timeout_ms = 30000;  // a request waiting this long for a worker gets 503 (0 = no deadline)
  int64_t max_prompt_bytes = 0;      // prompt text over this is 400 before tokenizing (0 = 16 per context token)
  int64_t max_connections = 4096;    // open HTTP connections at most; one more gets 503 and is closed
  int64_t drain_timeout_ms = 30000;
  // HOST:PORT of a separate /metrics listener; for serve/router it also takes /metrics off the API port.
  std::optional<std::string> metrics_listen;
  CacheOptions cache;
  TransportOptions transport;
};
// Exit status of serve/router when the drain timeout cut requests still in flight (they got an error
// event or a 503); 0 when every request finished within the drain.
inline constexpr int kExitDrainCutRequests = 3;

int run_serve(const ServeOptions& options, std::ostream& out, std::ostream& err);

struct RouterOptions {  // deltaserve router: registry + router + HTTP; workers join over the network
  std::optional<std::string> model;
  std::string host = "127.0.0.1";
  uint16_t port = 8000;
  std::string cluster_host = "127.0.0.1";
  uint16_t cluster_port = 7000;
  std::optional<std::string> api_keys;
  std::optional<std::string> served_model_name;
  int64_t max_queue = 256;
  int64_t queue_timeout_ms = 30000;  // a request waiting this long for a worker gets 503 (0 = no deadline)
  int64_t max_prompt_bytes = 0;      // prompt text over this is 400 before tokenizing (0 = 16 per context token)
  int64_t max_connections = 4096;    // open HTTP connections at most; one more gets 503 and is closed
  int64_t drain_timeout_ms = 30000;
  // HOST:PORT of a separate /metrics listener; for serve/router it also takes /metrics off the API port.
  std::optional<std::string> metrics_listen;
  // HOST:PORT of another router's cluster listener: use its registry and workers (no listener of our own).
  std::optional<std::string> join;
  CacheOptions cache;
  ClusterSecurityOptions security;
};
int run_router(const RouterOptions& options, std::ostream& out, std::ostream& err);

struct WorkerOptions {  // deltaserve prefill | decode
  bool decode = false;
  std::optional<std::string> model;
  engine::DeviceOptions device;
  // HOST:PORT of each router's cluster listener (the flag repeated, or a comma list): joined independently
  std::vector<std::string> join;
  int64_t prefill_chunk = 512;
  int64_t max_batch = 32;
  int64_t join_timeout_ms = 30000;
  int64_t orphan_timeout_ms = 60000;  // NodeOptions::orphan_timeout (0 = never)
  // decode: HOST:PORT where prefill workers connect directly (NodeOptions::peer_listen; PORT 0 = ephemeral)
  std::optional<std::string> peer_listen;
  int64_t drain_timeout_ms = 30000;
  // HOST:PORT of a separate /metrics listener; for serve/router it also takes /metrics off the API port.
  std::optional<std::string> metrics_listen;
  CacheOptions cache;
  TransportOptions transport;
  ClusterSecurityOptions security;
};
int run_worker(const WorkerOptions& options, std::ostream& out, std::ostream& err);

}  // namespace deltaserve::cli
