// Spawns a prefill worker actor (protocol: actors/prefill_protocol.hpp).
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "actors/decode_peers.hpp"
#include "actors/prefill_protocol.hpp"
#include "actors/transport.hpp"
#include "engine/model.hpp"
#include "kvstore/cache/prefix_cache.hpp"

namespace deltaserve::actors {

// The prefill worker's prefix cache (product.md "Caching rules"; kvstore/cache/prefix_cache.hpp).
struct PrefillCacheConfig {
  bool enabled = false;
  kvstore::PrefixCacheConfig cache;  // pages.row_values is set from the model (engine::mla_page_row_values)
  kvstore::SipKey hash_key{};        // per-deployment secret of the block hashes (same on routers and workers)
  std::string model_id;              // the hash chains are rooted in it (and in the tenant namespace)
  uint64_t epoch = 0;                // identifies this (empty at start) cache to the routers' index
};

struct PrefillWorkerConfig {
  std::string name = "prefill-0";                     // registry name (unique in the cluster)
  int64_t chunk_tokens = 512;                         // prompt tokens per forward pass (one per message)
  std::chrono::milliseconds heartbeat_interval{500};  // load reports to the registry; 0 = only on change
  int64_t state_slots = 2;                            // fixed pool of request states (one per job being prefilled)
  PrefillCacheConfig prefix_cache;
  // Worker nodes: a job whose decode worker announces a peer address (PrefillJob::decode_port) is handed off over
  // a direct connection to that node (actors/decode_peers.hpp), made or found within peer_connect_timeout; when
  // it cannot be made the router is told handoff_failed and prefills the request again. Null: the decode
  // worker's handle is used as it came (kServe: the same process).
  std::shared_ptr<DecodePeers> peers;
  std::chrono::milliseconds peer_connect_timeout{10000};
};

// Checks the cache settings against the model (names the offending field).
Status validate(const PrefillWorkerConfig& config, const engine::ModelConfig& model);

// `model` is shared read-only (Model::forward is const and thread-safe). `registry` may be null (tests):
// the worker then reports to nobody. Joining is the caller's (Node) job, since it needs a reply;
// heartbeats and leave on drain are the worker's. `transport` null = make_caf_transport().
prefill_actor spawn_prefill_worker(caf::actor_system& system, std::shared_ptr<const engine::Model> model,
                                   registry_actor registry, PrefillWorkerConfig config,
                                   std::shared_ptr<Transport> transport = nullptr);

}  // namespace deltaserve::actors
