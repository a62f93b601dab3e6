// Registry of workers: who is alive, in which role, and how loaded. Lives next to the router actor;
// published on --cluster-host/--cluster-port for workers in other processes.
//
// Protocol (all messages one-way except join and list). A name is bound to the node (CAF node id) that
// joined it: the node of the sender of join, which must also be the node of the worker's handle. Over a
// cluster port with TLS (actors/cluster_tls.hpp) only nodes with a certificate of the cluster's CA connect at
// all; among them, one node cannot evict, impersonate or speak for another node's worker. (A node id is
// what the peer declares in CAF's handshake: the binding separates honest peers and stray processes, and is
// no defence against a peer that holds a valid certificate and lies.) Anonymous messages hold no name.
//   join(WorkerInfo)          -> uint64_t workers now registered, or an error when the name is held by a live
//                                worker of another node (free again once that one is down or expired) or the
//                                handle is not on the joining node. Monitors the worker; its node joining again
//                                under the same name replaces its old entry.
//   heartbeat(name, load)     from the name's node: updates the load of a registered worker. A worker dropped
//                             for missed heartbeats (its actor still up) is registered again by its next
//                             heartbeat; other unknown names, and other nodes' messages, are ignored.
//   leave(name)               from the name's node: removes the worker (graceful: its in-flight requests
//                             continue). From another node: ignored.
//   list()                    -> std::vector<WorkerInfo>, sorted by name.
//   subscribe(actor)          the subscriber receives (workers_atom, std::vector<WorkerInfo>) now and after
//                             every change, and (lost_atom, name) when a worker goes down without leaving
//                             (its in-flight requests are then failed by the subscriber, which knows them).
//   cache(CacheEventBatch)    a prefill worker's prefix-cache events; forwarded to every subscriber (the
//                             routers keep the prefix index). Batches of unknown workers, and batches from a
//                             node other than the one holding batch.worker, are dropped.
#pragma once

#include <string>
#include <vector>

#include "actors/wire_types.hpp"

namespace deltaserve::actors {

using join_atom = caf::atom_constant<caf::atom("join")>;
using heartbeat_atom = caf::atom_constant<caf::atom("heartbeat")>;
using leave_atom = caf::atom_constant<caf::atom("leave")>;
using list_atom = caf::atom_constant<caf::atom("list")>;
using subscribe_atom = caf::atom_constant<caf::atom("subscribe")>;
using workers_atom = caf::atom_constant<caf::atom("workers")>;
using lost_atom = caf::atom_constant<caf::atom("lost")>;
using cache_atom = caf::atom_constant<caf::atom("cache")>;

inline constexpr const char* kPrefillRole = "prefill";
inline constexpr const char* kDecodeRole = "decode";

struct WorkerLoad {
  int64_t queue_length = 0;      // requests waiting at the worker (prefill jobs / handoffs without a slot)
  int64_t free_slots = 0;        // decode: free state slots (batcher); prefill: 0
  int64_t free_cache_bytes = 0;  // decode: bytes of state the free slots can hold; prefill: 0
  int64_t active = 0;            // requests being worked on
};

struct WorkerInfo {
  std::string name;      // unique in the cluster, e.g. "decode-0" or "decode@host:pid"
  std::string role;      // kPrefillRole | kDecodeRole
  caf::actor handle;     // prefill_actor or decode_actor (actor_cast at the receiver)
  int64_t capacity = 0;  // decode: max_batch; prefill: chunk tokens
  WorkerLoad load;
  uint64_t cache_epoch = 0;  // prefill: changes whenever the worker's prefix cache starts empty; 0 = no cache
  std::string model_id;      // prefill: the model id the block hashes are rooted in
  // decode workers of a worker node: where prefill workers connect to it directly (actors/decode_peers.hpp), so
  // handoffs never pass through a router; empty / 0 for workers spawned with their router (kServe).
  std::string peer_host;
  uint16_t peer_port = 0;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, WorkerLoad& x) {
  return f(caf::meta::type_name("WorkerLoad"), x.queue_length, x.free_slots, x.free_cache_bytes, x.active);
}

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, WorkerInfo& x) {
  return f(caf::meta::type_name("WorkerInfo"), x.name, x.role, x.handle, x.capacity, x.load, x.cache_epoch, x.model_id,
           x.peer_host, x.peer_port);
}

// What a subscriber must accept (the router actor does).
using registry_subscriber =
    caf::typed_actor<caf::reacts_to<workers_atom, std::vector<WorkerInfo>>, caf::reacts_to<lost_atom, std::string>,
                     caf::reacts_to<cache_atom, kvstore::CacheEventBatch>>;

using registry_actor =
    caf::typed_actor<caf::replies_to<join_atom, WorkerInfo>::with<uint64_t>,
                     caf::reacts_to<heartbeat_atom, std::string, WorkerLoad>, caf::reacts_to<leave_atom, std::string>,
                     caf::replies_to<list_atom>::with<std::vector<WorkerInfo>>,
                     caf::reacts_to<subscribe_atom, caf::actor>, caf::reacts_to<tick_atom>,
                     caf::reacts_to<cache_atom, kvstore::CacheEventBatch>>;

}  // namespace deltaserve::actors
