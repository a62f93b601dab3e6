// One process's share of the cluster: an actor_system (with CAF's middleman) running a set of roles.
//   kServe    registry + router + P prefill + D decode workers, all in this process (the embedded default)
//   kRouter   registry + router; the registry is published on cluster_host:cluster_port for workers
//   kPrefill  one prefill worker that joins the registry at join_host:join_port
//   kDecode   one decode worker that joins the registry at join_host:join_port
// The actors are the same on every path; only where the registry handle comes from differs.
// Free of CAF types: the CLI includes this header.
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>

#include "common/status.hpp"
#include "engine/model.hpp"
#include "router/inference_service.hpp"
#include "tokenizer/tiktoken_tokenizer.hpp"

namespace deltaserve::actors {

enum class NodeRole { kServe, kRouter, kPrefill, kDecode };

struct NodeOptions {
  NodeRole role = NodeRole::kServe;
  // Model: preloaded objects win; otherwise loaded from model_dir (workers need weights; the router none).
  std::filesystem::path model_dir;
  std::shared_ptr<const engine::Model> model;
  std::shared_ptr<const tokenizer::Tokenizer> tokenizer;

  int64_t prefill_workers = 1;  // kServe
  int64_t decode_workers = 1;   // kServe
  int64_t max_batch = 32;       // decode state slots per worker
  int64_t prefill_chunk = 512;  // tokens per prefill forward pass
  int64_t max_queue = 256;      // router admission bound

  std::string cluster_host = "127.0.0.1";  // kRouter: where the registry is published
  uint16_t cluster_port = 7000;            // kRouter: 0 = ephemeral (see Node::cluster_port())
  std::string join_host = "127.0.0.1";     // kPrefill/kDecode: the registry to join
  uint16_t join_port = 0;
  std::chrono::milliseconds join_timeout{30000};  // keep retrying the connection until then
  std::chrono::milliseconds heartbeat_interval{500};
  std::string worker_name;  // kPrefill/kDecode; default "<role>@<hostname>:<pid>"
};

// Sums over this node's workers (actors/wire_types.hpp WorkerStats, CAF-free copy).
struct NodeWorkerStats {
  int64_t active = 0, queued = 0, free_slots = 0, steps = 0, handoffs = 0, handoff_bytes = 0, handoff_us = 0,
          rejected = 0;
};

class Node {
 public:
  struct Impl;
  // Starts the actor system and the roles; for workers, connects (with retries) and joins. Errors: bad
  // model (DataLoss/NotFound...), port taken (Unavailable), registry unreachable (DeadlineExceeded).
  static Result<std::unique_ptr<Node>> start(NodeOptions options);
  ~Node();  // shutdown()

  // kServe, kRouter: the service the HTTP front talks to; null for workers. Valid until shutdown().
  router::InferenceService* service();
  // kRouter: the registry's bound port.
  uint16_t cluster_port() const;

  // Workers: leave the registry, then wait (bounded) until active and queued requests are done.
  // Returns true when idle in time.
  bool drain_workers(std::chrono::milliseconds timeout);

  // Asks every worker of this node for its counters (bounded wait).
  NodeWorkerStats worker_stats();

  // Sends exit to every actor of this node and waits for the actor system to stop. Idempotent.
  void shutdown();

 private:
  explicit Node(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace deltaserve::actors
