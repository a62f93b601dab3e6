// deltaserve: one binary for every role and tool. Flags are documented by `deltaserve <command> --help`.
#include <cctype>
#include <fstream>
#include <iostream>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "cli/commands.hpp"
#include "kernels/cpu/thread_pool.hpp"

namespace {

// "max-batch" -> "DELTASERVE_MAX_BATCH"
std::string env_name(const std::string& flag) {
  std::string out = "DELTASERVE_";
  for (char c : flag) out += c == '-' ? '_' : static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return out;
}

// A cluster-role flag: --NAME, overridable by DELTASERVE_<NAME> and by the --config file.
template <class T>
CLI::Option* role_option(CLI::App* app, const std::string& name, T& value, const std::string& help) {
  auto* opt = app->add_option("--" + name, value, help)->envname(env_name(name));
  if constexpr (!std::is_same_v<T, std::optional<std::string>>) opt->capture_default_str();
  return opt;
}

// --config FILE: a JSON object keyed by long flag names without dashes ({"port": 8000, "max_batch": 16}).
// Applied after parsing to options given neither on the command line nor through the environment, so the
// order of precedence is flag > environment > file > default. Returns an error message or "".
std::string apply_config_file(CLI::App* app, const std::string& path) {
  std::ifstream in(path);
  if (!in) return "cannot read config file " + path;
  nlohmann::json doc = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!doc.is_object()) return path + ": not a JSON object";
  for (const auto& [key, value] : doc.items()) {
    if (key == "config") continue;
    std::string flag = key;
    for (char& c : flag) c = c == '_' ? '-' : c;
    CLI::Option* opt = app->get_option_no_throw("--" + flag);
    if (!opt) return path + ": unknown key '" + key + "' for '" + app->get_name() + "'";
    if (opt->count() != 0) continue;
    std::string text;
    if (value.is_string()) {
      text = value.get<std::string>();
    } else if (value.is_number() || value.is_boolean()) {
      text = value.dump();
    } else {
      return path + ": key '" + key + "' must be a string, number or boolean";
    }
    try {
      opt->add_result(text);
      opt->run_callback();
    } catch (const CLI::Error& e) {
      return path + ": key '" + key + "': " + e.what();
    }
  }
  return "";
}

constexpr const char kCudaGraphsHelp[] =
    "Replay pure-decode GPU passes from CUDA graphs (false: every pass runs eagerly, e.g. to debug a graph)";
constexpr const char kCudaProfileHelp[] =
    "Time the phases of eager GPU passes with CUDA events and print the table to stderr when the model is closed";

}  // namespace

int main(int argc, char** argv) {
  using namespace deltaserve::cli;
  CLI::App app{"deltaserve: serving for hybrid linear-attention MoE models (Kimi Linear, Kimi K3)"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "deltaserve 0.1.0");
  int threads = 0;
  app.add_option("--threads", threads, "CPU threads for the CPU engine (0 = all cores)")
      ->envname("DELTASERVE_THREADS")
      ->check(CLI::NonNegativeNumber);

  GenerateOptions gen;
  auto* generate = app.add_subcommand("generate", "Generate text from a prompt, printing tokens as they come");
  generate->add_option("--model", gen.model, "Checkpoint directory (default: the built-in tiny model)")
      ->envname("DELTASERVE_MODEL");
  generate->add_option("--prompt,-p", gen.prompt, "Prompt text")->required();
  generate->add_flag("--chat", gen.chat, "Wrap the prompt as a user message in the chat format");
  generate->add_option("--max-tokens", gen.max_tokens, "Tokens to generate at most")->capture_default_str();
  generate->add_option("--temperature", gen.temperature, "0 = greedy")->capture_default_str();
  generate->add_option("--top-p", gen.top_p, "Nucleus sampling mass")->capture_default_str();
  generate->add_option("--top-k", gen.top_k, "Sample among the K best tokens (0 = off)")->capture_default_str();
  generate->add_option("--seed", gen.seed, "Sampling seed")->capture_default_str();
  generate->add_option("--logprobs", gen.logprobs,
                       "Print one JSON line per token with its logprob and the top-K alternatives (0..20)");
  generate->add_option("--prefill-chunk", gen.prefill_chunk, "Prefill chunk in tokens")->capture_default_str();
  generate->add_flag("--ignore-eos", gen.ignore_eos, "Do not stop at the end-of-sequence token");
  generate->add_option("--device", gen.device.device, "Where the model runs: cpu | cuda | cuda:N")
      ->envname("DELTASERVE_DEVICE")
      ->capture_default_str();
  generate->add_option("--gpu-memory-fraction", gen.device.gpu_memory_fraction, "Share of the GPU's memory to use")
      ->envname("DELTASERVE_GPU_MEMORY_FRACTION")
      ->capture_default_str();
  generate->add_option("--cuda-graphs", gen.device.cuda_graphs, kCudaGraphsHelp)
      ->envname("DELTASERVE_CUDA_GRAPHS")
      ->capture_default_str();
  generate->add_option("--cuda-profile", gen.device.cuda_profile, kCudaProfileHelp)
      ->envname("DELTASERVE_CUDA_PROFILE")
      ->capture_default_str();

  TokenizeOptions tok;
  auto* tokenize = app.add_subcommand("tokenize", "Print the token ids of a text as a JSON list");
  tokenize->add_option("--model", tok.model, "Checkpoint directory (default: the built-in tiny model)")
      ->envname("DELTASERVE_MODEL");
  tokenize->add_option("text", tok.text, "Text to encode")->required();
  tokenize->add_flag("--chat", tok.chat, "Wrap the text as a user message in the chat format");
  tokenize->add_flag("--specials", tok.specials, "Parse special-token text as special tokens");

  std::string inspect_path;
  auto* inspect = app.add_subcommand("inspect-model", "Print a model's architecture, parameters and cache sizes");
  inspect->add_option("path", inspect_path, "Checkpoint directory or config.json")->required();

  MakeModelCommandOptions make;
  auto* make_model = app.add_subcommand("make-model", "Write a random model checkpoint in the real formats");
  make_model->add_option("--preset", make.preset, "tiny-linear | tiny-k3 | a config.json path | inline JSON")
      ->capture_default_str();
  make_model->add_option("--out", make.out_dir, "Output directory")->required();
  make_model->add_option("--seed", make.seed, "Weight seed")->capture_default_str();
  make_model->add_option("--dtype", make.dtype, "f32 | bf16 | f16 | fp8 (128x128 block scales)")->capture_default_str();
  make_model->add_option("--shard-bytes", make.shard_bytes, "Shard size in bytes (0 = one file)")
      ->capture_default_str();

  // ---- cluster roles ----
  std::string config_file;
  auto add_config = [&](CLI::App* sub) {
    sub->add_option("--config", config_file, "JSON file of flag values (keys: long flag names without dashes)")
        ->envname("DELTASERVE_CONFIG");
  };
  const std::string model_help = "Checkpoint directory (default: the built-in tiny model)";
  const std::string drain_help = "On SIGTERM/SIGINT: wait this long for in-flight requests";
  const std::string max_connections_help =
      "Open HTTP connections at most; one more is answered 503 + Retry-After and closed";
  const std::string max_prompt_help =
      "Prompt text over this many bytes gets 400 before it is tokenized (0 = 16 per token of the model's context)";
  const std::string queue_timeout_help = "A request waiting this long for a worker gets 503 + Retry-After (0 = never)";
  const std::string front_metrics_help =
      "HOST:PORT of a separate Prometheus /metrics listener (then /metrics is not served on the API port)";
  const std::string worker_metrics_help = "HOST:PORT of a Prometheus /metrics listener (default: none)";

  // Prefix cache flags; `worker` = the role runs prefill workers, `router` = it routes (prefix index).
  auto add_cache_options = [&](CLI::App* sub, CacheOptions& c, bool worker, bool router) {
    role_option(sub, "cache-key", c.cache_key,
                "Block-hash key, 32 hex digits, the same on every router and prefill worker (default: random per "
                "process)");
    if (worker) {
      role_option(sub, "prefix-cache", c.prefix_cache, "Keep prompts' MLA pages and KDA checkpoints for reuse");
      role_option(sub, "cache-page-tokens", c.cache_page_tokens, "Tokens per MLA page group (512-multiple, 1024-6144)")
          ->check(CLI::Range(1024, 6144));
      role_option(sub, "cache-memory-mb", c.cache_memory_mb, "MLA page memory per prefill worker (MiB)")
          ->check(CLI::PositiveNumber);
      role_option(sub, "checkpoint-memory-mb", c.checkpoint_memory_mb, "KDA checkpoint memory per prefill worker (MiB)")
          ->check(CLI::PositiveNumber);
      role_option(sub, "checkpoint-interval", c.checkpoint_interval,
                  "Checkpoint the KDA state every N-th 512-token boundary (and at each prompt's last full block)")
          ->check(CLI::PositiveNumber);
      role_option(sub, "checkpoint-second-hit", c.checkpoint_second_hit,
                  "Store a boundary's checkpoint only when it is seen the second time");
      role_option(sub, "state-slots", c.state_slots, "Request states per prefill worker (fixed pool)")
          ->check(CLI::PositiveNumber);
    }
    if (router) {
      role_option(sub, "index-dir", c.index_dir, "RocksDB prefix index directory (default: none, load-only routing)");
      role_option(sub, "routing-policy", c.routing_policy, "Prefill placement: cache-aware | load")
          ->check(CLI::IsMember({"cache-aware", "load"}));
    }
  };

  // Device flags of the roles that run the model (serve, prefill, decode).
  auto add_device_options = [&](CLI::App* sub, deltaserve::engine::DeviceOptions& d) {
    role_option(sub, "device", d.device, "Where the model runs: cpu | cuda | cuda:N");
    role_option(sub, "gpu-memory-fraction", d.gpu_memory_fraction,
                "Share of the GPU's memory for weights, request states, MLA pages and scratch")
        ->check(CLI::Range(0.01, 1.0));
    role_option(sub, "gpu-max-batch-tokens", d.gpu_max_batch_tokens, "Tokens of one GPU forward pass at most")
        ->check(CLI::PositiveNumber);
    role_option(sub, "gpu-max-requests", d.gpu_max_requests, "GPU request-state slots at most")
        ->check(CLI::PositiveNumber);
    role_option(sub, "random-weights", d.random_weights,
                "Benchmarks only: draw the weights on the GPU from config.json (the checkpoint is not read)");
    role_option(sub, "cuda-graphs", d.cuda_graphs, kCudaGraphsHelp);
    role_option(sub, "cuda-profile", d.cuda_profile, kCudaProfileHelp);
  };

  // Handoff transport flags (serve, prefill, decode).
  auto add_transport_options = [&](CLI::App* sub, TransportOptions& t) {
    role_option(sub, "transport", t.transport, "Handoff of request states: caf (inside the actor message) | ucx")
        ->check(CLI::IsMember({"caf", "ucx"}));
    role_option(sub, "ucx-tls", t.ucx_tls, "UCX transports for --transport ucx (default: $UCX_TLS, else tcp,self)");
    role_option(sub, "ucx-net-devices", t.ucx_net_devices,
                "UCX network devices (default: $UCX_NET_DEVICES, else lo when every peer is on this host, else all)");
    role_option(sub, "transfer-deadline-ms", t.transfer_deadline_ms,
                "A handoff transfer not verified by then fails and the request is prefilled again")
        ->check(CLI::PositiveNumber);
  };

  // Cluster port security flags (router, prefill, decode; serve has no cluster port).
  auto add_security_options = [&](CLI::App* sub, ClusterSecurityOptions& s) {
    role_option(sub, "cluster-tls-dir", s.tls_dir,
                "Mutual TLS on the cluster port: a directory with ca.crt, tls.crt, tls.key (a Kubernetes TLS "
                "Secret); every router and worker needs a certificate of the same CA");
    sub->add_flag("--cluster-insecure", s.insecure,
                  "Allow plain TCP on a non-loopback cluster/join host: anyone who reaches the port can join")
        ->envname("DELTASERVE_CLUSTER_INSECURE");
  };

  ServeOptions serve_opts;
  auto* serve = app.add_subcommand("serve", "Serve the OpenAI API with every role in this process");
  add_config(serve);
  role_option(serve, "model", serve_opts.model, model_help);
  role_option(serve, "host", serve_opts.host, "HTTP listen address");
  role_option(serve, "port", serve_opts.port, "HTTP port (0 = ephemeral)");
  role_option(serve, "api-keys", serve_opts.api_keys, "API keys file (default: no authentication)");
  role_option(serve, "served-model-name", serve_opts.served_model_name, "Model id in the API");
  role_option(serve, "prefill-workers", serve_opts.prefill_workers, "Prefill worker actors")
      ->check(CLI::PositiveNumber);
  role_option(serve, "decode-workers", serve_opts.decode_workers, "Decode worker actors")->check(CLI::PositiveNumber);
  role_option(serve, "max-batch", serve_opts.max_batch, "Requests decoding at once per decode worker")
      ->check(CLI::PositiveNumber);
  role_option(serve, "prefill-chunk", serve_opts.prefill_chunk, "Prefill chunk in tokens")->check(CLI::PositiveNumber);
  role_option(serve, "max-queue", serve_opts.max_queue, "Requests waiting for a worker at most (then 503)")
      ->check(CLI::NonNegativeNumber);
  role_option(serve, "max-prompt-bytes", serve_opts.max_prompt_bytes, max_prompt_help)->check(CLI::NonNegativeNumber);
  role_option(serve, "max-connections", serve_opts.max_connections, max_connections_help)->check(CLI::PositiveNumber);
  role_option(serve, "queue-timeout-ms", serve_opts.queue_timeout_ms, queue_timeout_help)
      ->check(CLI::NonNegativeNumber);
  role_option(serve, "drain-timeout-ms", serve_opts.drain_timeout_ms, drain_help)->check(CLI::NonNegativeNumber);
  role_option(serve, "metrics-listen", serve_opts.metrics_listen, front_metrics_help);
  add_cache_options(serve, serve_opts.cache, true, true);
  add_device_options(serve, serve_opts.device);
  add_transport_options(serve, serve_opts.transport);

  RouterOptions router_opts;
  auto* router = app.add_subcommand("router", "Serve the OpenAI API; prefill/decode workers join over the network");
  add_config(router);
  role_option(router, "model", router_opts.model, model_help + " (config and tokenizer only)");
  role_option(router, "host", router_opts.host, "HTTP listen address");
  role_option(router, "port", router_opts.port, "HTTP port (0 = ephemeral)");
  role_option(router, "cluster-host", router_opts.cluster_host, "Address workers join");
  role_option(router, "cluster-port", router_opts.cluster_port, "Port workers join (0 = ephemeral)");
  role_option(router, "api-keys", router_opts.api_keys, "API keys file (default: no authentication)");
  role_option(router, "served-model-name", router_opts.served_model_name, "Model id in the API");
  role_option(router, "max-queue", router_opts.max_queue, "Requests waiting for a worker at most (then 503)")
      ->check(CLI::NonNegativeNumber);
  role_option(router, "max-prompt-bytes", router_opts.max_prompt_bytes, max_prompt_help)->check(CLI::NonNegativeNumber);
  role_option(router, "max-connections", router_opts.max_connections, max_connections_help)->check(CLI::PositiveNumber);
  role_option(router, "queue-timeout-ms", router_opts.queue_timeout_ms, queue_timeout_help)
      ->check(CLI::NonNegativeNumber);
  role_option(router, "drain-timeout-ms", router_opts.drain_timeout_ms, drain_help)->check(CLI::NonNegativeNumber);
  role_option(router, "metrics-listen", router_opts.metrics_listen, front_metrics_help);
  role_option(router, "join", router_opts.join,
              "HOST:PORT of another router's cluster listener: share its registry and workers (a second router)");
  add_cache_options(router, router_opts.cache, false, true);
  add_security_options(router, router_opts.security);

  const std::string join_help =
      "HOST:PORT of a router's cluster listener; several routers: repeat the flag or give a comma list (each is "
      "joined on its own, and joined again whenever it is lost)";
  const std::string orphan_help =
      "Once joined to no router for this long, /health on the metrics listener answers 503 (0 = never)";
  WorkerOptions prefill_opts;
  auto* prefill = app.add_subcommand("prefill", "Run a prefill worker that joins a router");
  add_config(prefill);
  role_option(prefill, "model", prefill_opts.model, model_help);
  role_option(prefill, "join", prefill_opts.join, join_help)->allow_extra_args(false);
  role_option(prefill, "prefill-chunk", prefill_opts.prefill_chunk, "Prefill chunk in tokens")
      ->check(CLI::PositiveNumber);
  role_option(prefill, "join-timeout-ms", prefill_opts.join_timeout_ms, "Keep trying to join this long")
      ->check(CLI::NonNegativeNumber);
  role_option(prefill, "orphan-timeout-ms", prefill_opts.orphan_timeout_ms, orphan_help)->check(CLI::NonNegativeNumber);
  role_option(prefill, "drain-timeout-ms", prefill_opts.drain_timeout_ms, drain_help)->check(CLI::NonNegativeNumber);
  role_option(prefill, "metrics-listen", prefill_opts.metrics_listen, worker_metrics_help);
  add_cache_options(prefill, prefill_opts.cache, true, false);
  add_device_options(prefill, prefill_opts.device);
  add_transport_options(prefill, prefill_opts.transport);
  add_security_options(prefill, prefill_opts.security);

  WorkerOptions decode_opts;
  decode_opts.decode = true;
  auto* decode = app.add_subcommand("decode", "Run a decode worker that joins a router");
  add_config(decode);
  role_option(decode, "model", decode_opts.model, model_help);
  role_option(decode, "join", decode_opts.join, join_help)->allow_extra_args(false);
  role_option(decode, "max-batch", decode_opts.max_batch, "Requests decoding at once")->check(CLI::PositiveNumber);
  role_option(decode, "join-timeout-ms", decode_opts.join_timeout_ms, "Keep trying to join this long")
      ->check(CLI::NonNegativeNumber);
  role_option(decode, "orphan-timeout-ms", decode_opts.orphan_timeout_ms, orphan_help)->check(CLI::NonNegativeNumber);
  role_option(decode, "peer-listen", decode_opts.peer_listen,
              "HOST:PORT where prefill workers connect to this worker directly for handoffs, announced to the "
              "routers (PORT 0 = ephemeral; default: 127.0.0.1 with loopback routers, else this host's address "
              "towards the first router; over the cluster TLS with --cluster-tls-dir)");
  role_option(decode, "drain-timeout-ms", decode_opts.drain_timeout_ms, drain_help)->check(CLI::NonNegativeNumber);
  role_option(decode, "metrics-listen", decode_opts.metrics_listen, worker_metrics_help);
  add_transport_options(decode, decode_opts.transport);
  add_security_options(decode, decode_opts.security);
  add_device_options(decode, decode_opts.device);

  CLI11_PARSE(app, argc, argv);
  deltaserve::kernels::cpu::set_num_threads(threads);

  for (CLI::App* role : {serve, router, prefill, decode}) {
    if (!role->parsed() || config_file.empty()) continue;
    if (std::string error = apply_config_file(role, config_file); !error.empty()) {
      std::cerr << "error: " << error << "\n";
      return 2;
    }
  }
  for (auto [role, opts] : {std::pair{prefill, &prefill_opts}, std::pair{decode, &decode_opts}}) {
    if (role->parsed() && opts->join.empty()) {
      std::cerr << "error: --join HOST:PORT[,HOST:PORT...] is required (flag, DELTASERVE_JOIN or the config file)\n";
      return 2;
    }
  }
  if (serve->parsed()) return run_serve(serve_opts, std::cout, std::cerr);
  if (router->parsed()) return run_router(router_opts, std::cout, std::cerr);
  if (prefill->parsed()) return run_worker(prefill_opts, std::cout, std::cerr);
  if (decode->parsed()) return run_worker(decode_opts, std::cout, std::cerr);

  if (generate->parsed()) return run_generate(gen, std::cout, std::cerr);
  if (tokenize->parsed()) return run_tokenize(tok, std::cout, std::cerr);
  if (inspect->parsed()) return run_inspect_model(inspect_path, std::cout, std::cerr);
  if (make_model->parsed()) return run_make_model(make, std::cout, std::cerr);
  return 2;
}
