// Decode worker actor: continuous batching over engine::DecodeBatcher slots, detokenization and stop
// strings (tokenizer::TextStream), one GenerationChunk per request per step to the request's sink.
//
// Protocol:
//   handoff(Handoff)     decode_state(bytes). DataLoss on a corrupt/partial/foreign state: nothing is decoded;
//                        the envelope's router gets handoff_failed(id, code, message) and re-prefills the
//                        request elsewhere (without a router the sink gets a final error chunk). Accepted:
//                        the router gets admitted(id); the request joins the batch at the next step, or
//                        waits (FIFO) while every slot is taken. Stops at the model's eos and
//                        <|im_end|> unless ignore_eos.
//   cancel(request_id)   removes the request; the sink gets the final "abort" chunk; no further steps for it.
//                        An id not (yet) known is remembered, so a handoff still in flight is dropped.
//   drop(request_id, attempt)  the router moved the request on: what this worker holds of it from that attempt
//                        or an earlier one (waiting, decoding, or a handoff still in flight) is dropped without a
//                        chunk and its slot freed. Sent to a decode worker declared lost (it may only have
//                        stalled and read it when it comes back) and to one a lost prefill worker handed off to.
//   step()               internal (self-sent while requests are active): one forward pass over the batch,
//                        then one chunk per request (final: finish_reason + usage).
//   drain()              leaves the registry; active requests finish.
//   stats()              -> WorkerStats.
//   tick()               internal heartbeat timer.
// UCX handoff path (actors/ucx_transport.hpp; a worker spawned without a UcxLink answers reserve with
// kFailedPrecondition):
//   reserve(ReserveRequest) -> ReserveReply   a receive region + expected transfer for the request's state.
//   handoff_ucx(envelope, transfer)  the envelope of a reserved transfer; the state is decoded once the
//                        transfer also reported OK (either order). Then as handoff(): admitted/handoff_failed.
//   transfer_done(transfer, code, message)   internal: the engine's on_done, posted from its thread.
//   transfer_timer(transfer)   internal: the reservation's last chance (deadline + reserve timeout): a transfer
//                        still without its envelope or completion fails (handoff_failed to the router).
//   region_free(region)  internal: a quarantined region of a failed transfer is released.
// Every failed UCX handoff counts in WorkerStats::rejected; nothing of it is decoded.
// The worker monitors each request's sink: a sink that goes down is treated as cancel (no chunk sent).
#pragma once

#include <cstdint>
#include <vector>

#include "actors/router_protocol.hpp"

namespace deltaserve::actors {

using handoff_atom = caf::atom_constant<caf::atom("handoff")>;
using step_atom = caf::atom_constant<caf::atom("step")>;

// The control part of a handoff; the state bytes travel beside it (actors/transport.hpp).
struct HandoffEnvelope {
  uint64_t handoff_id = 0;  // unique per prefill worker, for logs and transfer bookkeeping
  router::GenerationRequest request;
  int32_t next_token = 0;     // prompt[N−1] (a resumed request: generated.back()), fed by the first decode step
  caf::actor sink;            // sink_actor
  int64_t cached_tokens = 0;  // prompt tokens the prefill worker served from its prefix cache
  caf::actor router;          // router_actor: told admitted()/handoff_failed(); may be null (tests)
  int64_t attempt = 0;        // the router's dispatch attempt (PrefillJob::attempt), echoed to the router
  // PrefillJob::generated: tokens the client already has; the state holds prompt ++ generated but the last, and
  // next_token is generated.back(). The request continues after them: its sampler at draw generated.size(),
  // max_tokens and completion_tokens counting them, its text stream (stop strings, held-back bytes) fed with them
  // first, its usage the uninterrupted request's (prompt_tokens = prompt.size()). Empty: a fresh request.
  std::vector<int32_t> generated;
};

struct Handoff {
  HandoffEnvelope envelope;
  std::vector<uint8_t> state;  // engine::encode_state bytes (checksummed)
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, HandoffEnvelope& x) {
  return f(caf::meta::type_name("HandoffEnvelope"), x.handoff_id, x.request, x.next_token, x.sink, x.cached_tokens,
           x.router, x.attempt, x.generated);
}

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, Handoff& x) {
  return f(caf::meta::type_name("Handoff"), x.envelope, x.state);
}

using drop_atom = caf::atom_constant<caf::atom("drop")>;
using reserve_atom = caf::atom_constant<caf::atom("reserve")>;
using handoff_ucx_atom = caf::atom_constant<caf::atom("houcx")>;
using transfer_done_atom = caf::atom_constant<caf::atom("xferdone")>;
using transfer_timer_atom = caf::atom_constant<caf::atom("xfertimer")>;
using region_free_atom = caf::atom_constant<caf::atom("regionfree")>;

// The sender's request for a place to put a request's encoded state (UCX path).
struct ReserveRequest {
  std::string request_id;
  int64_t attempt = 0;  // the router's dispatch attempt (echoed in handoff_failed)
  uint64_t bytes = 0;   // encoded state size; 0 is refused (unless device_tokens is set)
  caf::actor router;    // told handoff_failed() when the transfer fails; may be null (tests)
  caf::actor sink;      // gets the error when there is no router
  // A state in device memory (UcxLink::device_handoff): its tokens (>= 0; -1 = encoded bytes) and the sender's
  // engine::Backend::device_state_layout, which must equal the receiver's. Pieces: one per KDA layer (its state,
  // then its conv tails), then one per MLA page.
  int64_t device_tokens = -1;
  std::string device_layout;
};

struct ReserveReply {
  int32_t code = 0;  // StatusCode; 0 = reserved
  std::string message;
  uint64_t transfer = 0;            // the receiver's transfer id (names the transfer in handoff_ucx)
  std::vector<uint8_t> descriptor;  // kvstore/transfer/wire.hpp descriptor for start_send
  uint64_t piece_bytes = 0;         // pieces are `piece_bytes` long, the last one the rest
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, ReserveRequest& x) {
  return f(caf::meta::type_name("ReserveRequest"), x.request_id, x.attempt, x.bytes, x.router, x.sink, x.device_tokens,
           x.device_layout);
}

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, ReserveReply& x) {
  return f(caf::meta::type_name("ReserveReply"), x.code, x.message, x.transfer, x.descriptor, x.piece_bytes);
}

using decode_actor =
    caf::typed_actor<caf::reacts_to<handoff_atom, Handoff>, caf::reacts_to<cancel_atom, std::string>,
                     caf::reacts_to<drop_atom, std::string, int64_t>, caf::reacts_to<drain_atom>,
                     caf::replies_to<stats_atom>::with<WorkerStats>, caf::reacts_to<step_atom>,
                     caf::replies_to<reserve_atom, ReserveRequest>::with<ReserveReply>,
                     caf::reacts_to<handoff_ucx_atom, HandoffEnvelope, uint64_t>,
                     caf::reacts_to<transfer_done_atom, uint64_t, int32_t, std::string>,
                     caf::reacts_to<transfer_timer_atom, uint64_t>, caf::reacts_to<region_free_atom, uint32_t>>;

}  // namespace deltaserve::actors
