// Router actor: admission, queueing and placement of requests on workers; and the per-request sink
// actor that streams chunks back to whoever submitted (ClusterService).
//
// Router protocol (one-way):
//   submit(GenerationRequest, sink)  admits the request. Dispatched at once when a prefill worker and a
//                                    decode worker with a free slot exist, else queued (by priority class,
//                                    then arrival; see router_actor.cpp's enqueue); with max_queue
//                                    requests already waiting the sink gets a final chunk with
//                                    kResourceExhausted at once. A duplicate id fails with kInvalidArgument.
//   cancel(request_id)               queued: final chunk "abort" from the router; dispatched: forwarded to
//                                    its prefill and decode workers, which send the "abort" chunk.
//   prefilled(id, attempt, bytes, us) from the prefill worker after the handoff left (stage → transfer).
//   admitted(id, attempt)            from the decode worker once the state checked out (stage → decode).
//   handoff_failed(id, attempt, code, msg) from the decode worker: the state did not check out. The request is
//                                    prefilled again (another attempt, up to max_attempts), else failed.
//                                    (Transfer deadlines belong to the transport: a transfer that does not
//                                    complete in time is reported by the decode side as handoff_failed.)
//   delivered(id, tokens)            from the request's sink: the tokens of a worker chunk it passed to the client
//                                    (one per non-final chunk, in stream order). The router records them as
//                                    the request's resume point.
//   workers(list) / lost(name)       from the registry subscription. Requests on a lost worker are prefilled
//                                    again (another attempt, up to max_attempts): a lost prefill worker's
//                                    requests in prefill or in transfer (prefilled, not yet admitted: the
//                                    handoff may never have left it), a lost decode worker's, also those already
//                                    streaming: the new attempt resumes after the tokens recorded as delivered
//                                    (PrefillJob::generated: the prompt plus those tokens is prefilled, through
//                                    the prefix cache where it hits, and the decode worker continues the
//                                    stream, its sampler at the next draw, max_tokens and stop conditions
//                                    counting what was sent). A lost worker is also sent drop(id, attempt) for
//                                    each request moved off it: if it only stalled, it frees them when it
//                                    comes back. The sink's StreamGate joins the attempts without repeating,
//                                    losing or rewriting a token.
//   queue_timeout(id, epoch)         self-sent: the request has waited RouterConfig::queue_timeout since it entered
//                                    the queue (its `epoch`-th time); if it still waits, the sink gets a final
//                                    chunk with kUnavailable.
//   cache(CacheEventBatch)           prefix-cache events of a worker (via the registry): applied to the index.
//   stats()                          -> RouterStats.
// The router monitors every sink: a sink that goes down ends the request's bookkeeping (and, if the
// request is still on a worker, cancels it there).
//
// Replies carry the dispatch attempt they belong to; replies of an earlier attempt are ignored.
//
// Sink protocol (stream_gate.hpp):
//   chunk(attempt, GenerationChunk)  in order per sender; attempt 0 = the router's own chunk. Chunks of an
//                                    attempt the gate refuses are dropped.
//   attempt(n, start)                from the router before it dispatches attempt n >= 2, which resumes the
//                                    stream at chunk `start` (the chunks recorded as delivered). The new
//                                    attempt replays what the client got after `start` (checked, not
//                                    repeated) and then takes over, or the attempt that owns the stream goes
//                                    on.
// The sink reports each worker chunk it forwards (not final) to the router: delivered(id, tokens).
// The sink quits after the first final chunk it passes, ignoring anything else.
#pragma once

#include <string>

#include "actors/registry_protocol.hpp"

namespace deltaserve::actors {

using submit_atom = caf::atom_constant<caf::atom("submit")>;
using prefilled_atom = caf::atom_constant<caf::atom("prefilled")>;
using chunk_atom = caf::atom_constant<caf::atom("chunk")>;
using admitted_atom = caf::atom_constant<caf::atom("admitted")>;
using failed_atom = caf::atom_constant<caf::atom("hofailed")>;
using attempt_atom = caf::atom_constant<caf::atom("attempt")>;
using queue_timeout_atom = caf::atom_constant<caf::atom("qtimeout")>;
using delivered_atom = caf::atom_constant<caf::atom("delivered")>;

// The attempt number of the router's own chunks (stream_gate.hpp).
inline constexpr int64_t kRouterChunk = 0;

struct RouterStats {
  int64_t running = 0;  // dispatched to workers, not finished
  int64_t waiting = 0;  // queued before prefill
  int64_t prefill_workers = 0;
  int64_t decode_workers = 0;
  int64_t admitted = 0;        // total
  int64_t rejected = 0;        // total, queue full
  int64_t failed = 0;          // total, worker lost, handoff attempts exhausted or queue timeout
  int64_t retried = 0;         // total, prefilled again after a failed, late or lost handoff
  int64_t resumed = 0;         // of those, continued after tokens the client already had (prompt + tokens re-prefilled)
  int64_t resumed_tokens = 0;  // the already delivered tokens those resumed attempts prefilled, in total
  // Prefix-aware placement:
  int64_t routed_to_hit = 0;           // requests placed on a worker the index says holds a usable prefix
  int64_t expected_cached_tokens = 0;  // the prompt tokens those hits cover, in total (the worker verifies)
  int64_t index_events = 0;            // cache events applied to the index
  int64_t index_errors = 0;            // failed index writes or lookups
  int64_t index_entries = 0;           // (block, worker) entries in the index (RocksDB estimate)
  int64_t index_bytes = 0;             // its files on disk
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, RouterStats& x) {
  return f(caf::meta::type_name("RouterStats"), x.running, x.waiting, x.prefill_workers, x.decode_workers, x.admitted,
           x.rejected, x.failed, x.retried, x.resumed, x.resumed_tokens, x.routed_to_hit, x.expected_cached_tokens,
           x.index_events, x.index_errors, x.index_entries, x.index_bytes);
}

using sink_actor = caf::typed_actor<caf::reacts_to<chunk_atom, int64_t, router::GenerationChunk>,
                                    caf::reacts_to<attempt_atom, int64_t, int64_t>>;

using router_actor = caf::typed_actor<
    caf::reacts_to<submit_atom, router::GenerationRequest, caf::actor>, caf::reacts_to<cancel_atom, std::string>,
    caf::reacts_to<prefilled_atom, std::string, int64_t, int64_t, int64_t>,
    caf::reacts_to<admitted_atom, std::string, int64_t>,
    caf::reacts_to<failed_atom, std::string, int64_t, int32_t, std::string>,
    caf::reacts_to<delivered_atom, std::string, std::vector<int32_t>>,
    caf::reacts_to<workers_atom, std::vector<WorkerInfo>>, caf::reacts_to<lost_atom, std::string>,
    caf::reacts_to<cache_atom, kvstore::CacheEventBatch>, caf::reacts_to<queue_timeout_atom, std::string, uint64_t>,
    caf::replies_to<stats_atom>::with<RouterStats>>;

}  // namespace deltaserve::actors
