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
//   drop(request_id, attempt)  a handoff of that request from that attempt or an earlier one, still in
//                        flight, is dropped without a chunk (the router prefills the request again elsewhere).
//   step()               internal (self-sent while requests are active): one forward pass over the batch,
//                        then one chunk per request (final: finish_reason + usage).
//   drain()              leaves the registry; active requests finish.
//   stats()              -> WorkerStats.
//   tick()               internal heartbeat timer.
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
  int32_t next_token = 0;     // prompt[N−1], fed by the first decode step
  caf::actor sink;            // sink_actor
  int64_t cached_tokens = 0;  // prompt tokens the prefill worker served from its prefix cache
  caf::actor router;          // router_actor: told admitted()/handoff_failed(); may be null (tests)
  int64_t attempt = 0;        // the router's dispatch attempt (PrefillJob::attempt), echoed to the router
};

struct Handoff {
  HandoffEnvelope envelope;
  std::vector<uint8_t> state;  // engine::encode_state bytes (checksummed)
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, HandoffEnvelope& x) {
  return f(caf::meta::type_name("HandoffEnvelope"), x.handoff_id, x.request, x.next_token, x.sink, x.cached_tokens,
           x.router, x.attempt);
}

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, Handoff& x) {
  return f(caf::meta::type_name("Handoff"), x.envelope, x.state);
}

using drop_atom = caf::atom_constant<caf::atom("drop")>;

using decode_actor = caf::typed_actor<caf::reacts_to<handoff_atom, Handoff>, caf::reacts_to<cancel_atom, std::string>,
                                      caf::reacts_to<drop_atom, std::string, int64_t>, caf::reacts_to<drain_atom>,
                                      caf::replies_to<stats_atom>::with<WorkerStats>, caf::reacts_to<step_atom>,
                                      caf::reacts_to<tick_atom>>;

}  // namespace deltaserve::actors
