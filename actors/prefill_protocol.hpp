// Prefill worker actor: chunked prefill of prompt[0, N−1), then the handoff of the request's state to the
// decode worker chosen by the router ("N−1 prefill", engine/decode_batcher.hpp).
//
// Protocol:
//   prefill(PrefillJob)   queues the job (FIFO). One chunk of at most `prefill_chunk` tokens runs per
//                         self-sent work() message, so cancels and new jobs are handled between chunks.
//                         When prompt[0, N−1) is consumed: encode_state → Transport::send_state → decode
//                         worker (handoff_atom, decode_protocol.hpp), then prefilled(id, bytes, us) to the
//                         job's router. A 1-token prompt hands over the fresh state. An engine error
//                         (bad token id, context limit) fails the request to its sink.
//                         With a prefix cache: when the job starts, its prompt's block hashes (rooted in the
//                         request's prefix_cache_namespace()) are looked up; the deepest boundary with both
//                         pages and a KDA checkpoint is restored and only the rest is computed. Chunks end on
//                         block boundaries and checkpoints are taken at the policy's boundaries on the way
//                         (kvstore/cache/prefill_plan.hpp); at the handoff the prompt's full blocks are
//                         registered and the events go to the registry (cache(CacheEventBatch)).
//                         A resumed job (PrefillJob::generated) then replays the decode passes of the tokens
//                         already delivered, one token each (at most `prefill_chunk` per work()), and hands off.
//   cancel(request_id)    drops a queued or running job; the sink gets the final "abort" chunk. Unknown ids
//                         (already handed off) are ignored: the router cancels at the decode worker too.
//   drain()               leaves the registry; queued jobs still finish.
//   stats()               -> WorkerStats.
//   work(), tick()        internal (self-sent): next chunk; heartbeat timer.
#pragma once

#include "actors/router_protocol.hpp"

namespace deltaserve::actors {

using prefill_atom = caf::atom_constant<caf::atom("prefill")>;
using work_atom = caf::atom_constant<caf::atom("work")>;

struct PrefillJob {
  router::GenerationRequest request;
  caf::actor decode_worker;  // decode_actor
  caf::actor sink;           // sink_actor: receives chunks (errors from here, tokens from the decode worker)
  caf::actor router;         // router_actor: receives prefilled(); may be null (tests)
  int64_t attempt = 0;       // the router's dispatch attempt of this request (echoed in every reply)
  // The block hashes of prompt[0, N−1) the router computed for its index lookup, so the worker does not hash the
  // prompt again; empty when the router did not look up (no index, load-only policy, no full block).
  // Contract: `prompt_hashes.blocks` are the full blocks of prompt[0, N−1) of `request`, chained from
  // `prompt_hashes.root` = BlockHasher::root(request.prefix_cache_namespace(), model id) under the router's key
  // and block size. The worker takes them only when that root equals the one it computes from its own key,
  // model id and block size, and there is one hash per full block of its own; otherwise (another key, another
  // model, another block size, a router without an index) it hashes the prompt itself. The chain's tokens are
  // not checked again: the router hashed this very request's prompt, so a chain the worker takes names exactly
  // the prefixes it would have named and its cache lookups are the same (a stale or foreign index entry still
  // costs a miss, never a wrong hit).
  kvstore::PromptHashes prompt_hashes;
  // A request resumed after losing its decode worker: the tokens the client already has (the router's record of
  // what the sink delivered), k < request.max_tokens of them. The worker prefills prompt[0, N−1) as for a fresh
  // request (through its prefix cache), then replays the k decode passes the lost decode worker ran, one token
  // each, over prompt[N−1] and generated[0, k−1), and hands over that state with generated[k−1] as the next token
  // (HandoffEnvelope::generated). Empty: a fresh request.
  std::vector<int32_t> generated;
  // Where the decode worker takes direct connections (its WorkerInfo::peer_host/peer_port); port 0: none (the
  // handle is reached as is, e.g. an actor of the same process).
  std::string decode_host;
  uint16_t decode_port = 0;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, PrefillJob& x) {
  return f(caf::meta::type_name("PrefillJob"), x.request, x.decode_worker, x.sink, x.router, x.attempt, x.prompt_hashes,
           x.generated, x.decode_host, x.decode_port);
}

using prefill_actor = caf::typed_actor<caf::reacts_to<prefill_atom, PrefillJob>,
                                       caf::reacts_to<cancel_atom, std::string>, caf::reacts_to<drain_atom>,
                                       caf::replies_to<stats_atom>::with<WorkerStats>, caf::reacts_to<work_atom>>;

}  // namespace deltaserve::actors
