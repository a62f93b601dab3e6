// One process's share of the cluster: an actor_system (with CAF's middleman) running a set of roles.
//   kServe    registry + router + P prefill + D decode workers, all in this process (the embedded default)
//   kRouter   registry + router; the registry is published on cluster_host:cluster_port for workers
//   kPrefill  one prefill worker that joins the registry of every router in `join`
//   kDecode   one decode worker that joins the registry of every router in `join`
// The actors are the same on every path; only where the registry handle comes from differs. A worker node
// joins each router independently and joins it again whenever it is lost (actors/router_links.hpp).
// Free of CAF types: the CLI includes this header.
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "actors/router_observer.hpp"
#include "common/status.hpp"
#include "engine/model.hpp"
#include "engine/open_model.hpp"
#include "router/inference_service.hpp"
#include "tokenizer/tiktoken_tokenizer.hpp"

namespace deltaserve::actors {

enum class NodeRole { kServe, kRouter, kPrefill, kDecode };

struct ClusterAddress {
  std::string host;
  uint16_t port = 0;
};

struct NodeOptions {
  NodeRole role = NodeRole::kServe;
  // Model: preloaded objects win; otherwise loaded from model_dir (workers need weights; the router none).
  std::filesystem::path model_dir;
  std::shared_ptr<const engine::Model> model;
  std::shared_ptr<const tokenizer::Tokenizer> tokenizer;
  engine::DeviceOptions device;  // where the workers' model runs (cpu, cuda:N) when loaded from model_dir

  int64_t prefill_workers = 1;                     // kServe
  int64_t decode_workers = 1;                      // kServe
  int64_t max_batch = 32;                          // decode state slots per worker
  int64_t prefill_chunk = 512;                     // tokens per prefill forward pass
  int64_t max_queue = 256;                         // router admission bound
  std::chrono::milliseconds queue_timeout{30000};  // RouterConfig::queue_timeout (0 = none)

  std::string cluster_host = "127.0.0.1";  // kRouter: where the registry is published
  uint16_t cluster_port = 7000;            // kRouter: 0 = ephemeral (see Node::cluster_port())
  // kPrefill/kDecode: the cluster ports of the routers to join, each independently (each router keeps its own
  // registry; a request from any of them is served and answered to it). kRouter with router_joins_registry: the
  // first one is the registry used.
  std::vector<ClusterAddress> join;
  // Start-up: keep retrying until one router (of `join`) has every worker of this node, else fail the start.
  std::chrono::milliseconds join_timeout{30000};
  // Workers after start-up: a lost router (its connection closed, or a probe unanswered) is joined again after
  // rejoin_backoff_initial, doubling to rejoin_backoff_max, each wait drawn from [half, all] of the step. Every
  // router_probe_interval the registry is asked for its list (a worker missing from it is joined again); no
  // answer within router_probe_timeout and the router counts as lost.
  std::chrono::milliseconds rejoin_backoff_initial{100};
  std::chrono::milliseconds rejoin_backoff_max{5000};
  std::chrono::milliseconds router_probe_interval{2000};
  std::chrono::milliseconds router_probe_timeout{10000};
  // Workers: liveness() fails once the node has been joined to no router for longer than this (after
  // start-up), so an orchestrator restarts a worker that cannot get back to any router; 0 = never.
  std::chrono::milliseconds orphan_timeout{60000};
  // Mutual TLS of the cluster port (actors/cluster_tls.hpp): a directory with ca.crt, tls.crt and tls.key.
  // kRouter serves the cluster port over TLS and workers (and a router that joins) connect over TLS, through
  // the tunnel of actors/tls_tunnel.hpp (CAF itself speaks plain BASP on loopback only); a peer needs a
  // certificate of the same CA or is refused in the handshake. Checked at start (errors name the file). kServe has no
  // cluster port and refuses it. Empty: plain TCP, which anyone who reaches the port can join; allowed on loopback
  // hosts only, unless cluster_insecure.
  std::filesystem::path cluster_tls_dir;
  // Accept plain TCP on a cluster_host (kRouter) or join host (workers) that is not loopback.
  bool cluster_insecure = false;
  // kDecode: where the decode worker takes direct connections from prefill workers (actors/decode_peers.hpp), so
  // that handoffs never pass through a router; announced to the routers in its WorkerInfo. Port 0 = ephemeral.
  // Empty host: 127.0.0.1 when every join host is loopback, else this host's address on the route to the first
  // router. With cluster_tls_dir the address is served over the same mutual TLS as a router's cluster port; a
  // non-loopback host without TLS needs cluster_insecure.
  ClusterAddress peer_listen;
  // kPrefill: a direct connection to a decode worker not made within this fails the handoff (the router prefills
  // the request again).
  std::chrono::milliseconds peer_connect_timeout{10000};
  std::chrono::milliseconds heartbeat_interval{500};
  std::string worker_name;  // kPrefill/kDecode; default "<role>@<hostname>:<pid>"

  // kRouter: a further router that uses the registry (and so the workers) of the router at join[0] instead of
  // running its own. Its prefix index is its own. It connects once, at start: it does not survive that router
  // (workers that join several routers do; see `join`).
  bool router_joins_registry = false;

  // Prefix cache of the prefill workers (kServe, kPrefill); product.md "Caching rules".
  bool prefix_cache = true;
  int64_t cache_page_tokens = 2048;               // page group size: a multiple of 512 in [1024, 6144]
  int64_t cache_memory_bytes = 256LL << 20;       // MLA pages per prefill worker
  int64_t checkpoint_memory_bytes = 256LL << 20;  // KDA checkpoints per prefill worker
  int64_t checkpoint_interval_blocks = 4;         // checkpoint every N-th 512-token boundary (+ the last full block)
  bool checkpoint_on_second_hit = false;          // store a boundary's checkpoint only when seen twice
  int64_t state_slots = 2;                        // request states per prefill worker (fixed pool)
  // Block-hash key, 32 hex digits; the same on every router and prefill worker of a deployment. Empty: a
  // random key for this process (fine for kServe; cache-aware routing across processes then never matches).
  std::string cache_key_hex;
  std::string model_id;  // root of the hash chains; default: the model directory's name

  // Routers (kServe, kRouter): the RocksDB prefix index directory (empty = no index: load-only placement)
  // and the placement policy.
  std::filesystem::path index_dir;
  std::string routing_policy = "cache-aware";       // cache-aware | load
  std::shared_ptr<RouterObserver> router_observer;  // metrics of the router (kServe, kRouter); may be null

  // Handoff transport of the workers (kServe, kPrefill, kDecode): "caf" (the state inside the CAF message)
  // or "ucx" (envelope over CAF, state over UCX; actors/ucx_transport.hpp). Prefill and decode workers of a
  // cluster must agree.
  std::string transport = "caf";
  std::string ucx_tls = "tcp,self";                          // UCX_TLS syntax
  std::string ucx_net_devices;                               // UCX_NET_DEVICES; "" = UCX default (all)
  std::chrono::milliseconds transfer_deadline{10000};        // per handoff transfer
  std::chrono::milliseconds transfer_reserve_timeout{5000};  // prefill: wait for the decode worker's descriptor
  int64_t transfer_piece_bytes = 4LL << 20;                  // the state travels in pieces of at most this
  std::string transfer_faults;  // fault_injection.hpp spec: only binaries linked with the test library accept it
};

// Sums over this node's workers (actors/wire_types.hpp WorkerStats, CAF-free copy).
struct NodeWorkerStats {
  int64_t active = 0, queued = 0, free_slots = 0, steps = 0, handoffs = 0, handoff_bytes = 0, handoff_us = 0,
          rejected = 0;
  // Prefill workers' state slots and prefix caches (summed):
  int64_t slots_total = 0, slots_free = 0, pages_total = 0, pages_free = 0, cache_entries = 0, checkpoints = 0,
          checkpoint_bytes = 0, cache_evictions = 0, prompt_tokens = 0, cached_tokens = 0;
};

// Router counters (CAF-free copy of RouterStats).
struct NodeRouterStats {
  int64_t admitted = 0, routed_to_hit = 0, expected_cached_tokens = 0, index_events = 0, index_errors = 0;
  int64_t index_entries = 0, index_bytes = 0;  // the prefix index's size (entries, files on disk)
  int64_t retried = 0, failed = 0;             // prefilled again after a failed/lost handoff; given up
};

// The UCX transfer engine's counters (copy of kvstore/transfer EngineStats; zeros with transport "caf").
struct NodeTransferStats {
  int64_t regions = 0, region_uses = 0, requests_in_flight = 0, endpoints = 0, transfers = 0, transfers_pending = 0;
  uint64_t bytes_sent = 0, bytes_received = 0, pieces_rejected = 0;
};

class Node {
 public:
  struct Impl;
  // Starts the actor system and the roles; for workers, connects (with retries) and joins. Errors: bad
  // model (DataLoss/NotFound...), bad cluster TLS files (NotFound/InvalidArgument/IoError, naming the file),
  // a non-loopback cluster host without TLS or cluster_insecure (FailedPrecondition), port taken
  // (Unavailable), registry unreachable or TLS handshake refused (DeadlineExceeded), worker name held by a
  // live worker of another node (Unavailable).
  static Result<std::unique_ptr<Node>> start(NodeOptions options);
  ~Node();  // shutdown()

  // kServe, kRouter: the service the HTTP front talks to; null for workers. Valid until shutdown().
  router::InferenceService* service();
  // kRouter: the registry's bound port.
  uint16_t cluster_port() const;

  // Workers: leave every router's registry (and join none again), then wait (bounded) until active and queued
  // requests are done.
  // Returns true when idle in time.
  bool drain_workers(std::chrono::milliseconds timeout);

  // Workers: the routers this node is joined to now (0 for other roles).
  int64_t routers_joined() const;

  // Whether the process should be restarted by its orchestrator. Unavailable when a worker node has been
  // joined to no router for longer than orphan_timeout, or one of its worker actors does not answer within
  // `timeout`; OK otherwise (and for the router roles, which have no such state).
  Status liveness(std::chrono::milliseconds timeout);

  // Asks every worker of this node for its counters (bounded wait).
  NodeWorkerStats worker_stats();

  // The router's counters (kServe, kRouter; zeros otherwise).
  NodeRouterStats router_stats();

  // The UCX transfer engine's counters (transport "ucx"; zeros otherwise).
  NodeTransferStats transfer_stats();

  // Sends exit to every actor of this node and waits for the actor system to stop. Idempotent.
  void shutdown();

 private:
  explicit Node(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace deltaserve::actors
