#include "actors/cluster_service.hpp"

#include <algorithm>

#include "actors/cluster_service_impl.hpp"
#include "actors/stream_gate.hpp"

namespace deltaserve::actors {
namespace {

struct SinkState {
  std::shared_ptr<router::GenerationSink> sink;
  router_actor router;  // told of every worker chunk forwarded (delivered): the resume point of a retry
  std::string request_id;
  std::shared_ptr<bool> done;  // shared with the exit functor, which outlives the state
  StreamGate gate;
};

using SinkPointer = sink_actor::stateful_pointer<SinkState>;

sink_actor::behavior_type sink_impl(SinkPointer self, std::shared_ptr<router::GenerationSink> sink,
                                    std::string request_id, router_actor router) {
  auto done = std::make_shared<bool>(false);
  self->state.sink = sink;
  self->state.router = router;
  self->state.request_id = request_id;
  self->state.done = done;
  // Exactly one final chunk, whatever happens: a shutdown or crash before the final chunk ends the stream.
  self->attach_functor([sink, request_id, done](const caf::error&) {
    if (*done) return;
    *done = true;
    sink->on_chunk(error_chunk(request_id, Status(StatusCode::kUnavailable, "service shut down")));
  });
  self->monitor(router);
  self->set_down_handler([self](const caf::down_msg&) {
    if (!*self->state.done) {
      *self->state.done = true;
      self->state.sink->on_chunk(
          error_chunk(self->state.request_id, Status(StatusCode::kUnavailable, "router went down")));
    }
    self->quit();
  });
  return {
      [self](chunk_atom, int64_t attempt, router::GenerationChunk& chunk) {
        auto& s = self->state;
        if (*s.done) return;
        switch (s.gate.admit(attempt, chunk)) {
          case StreamGate::Verdict::kForward:
            break;
          case StreamGate::Verdict::kDrop:
            return;
          case StreamGate::Verdict::kDiverged:  // a new attempt computed other tokens: never rewrite the stream
            *s.done = true;
            s.sink->on_chunk(error_chunk(
                s.request_id, Status(StatusCode::kUnavailable,
                                     "the request moved to another worker, which could not reproduce the stream")));
            self->quit();
            return;
        }
        const bool final = chunk.is_final();
        if (final) *s.done = true;
        if (!final && attempt != kRouterChunk) self->send(s.router, delivered_atom::value, s.request_id, chunk.tokens);
        s.sink->on_chunk(std::move(chunk));
        if (final) self->quit();
      },
      [self](attempt_atom, int64_t attempt, int64_t start) {
        self->state.gate.announce(attempt, static_cast<size_t>(std::max<int64_t>(start, 0)));
      },
  };
}

}  // namespace

sink_actor spawn_stream_sink(caf::actor_system& system, std::shared_ptr<router::GenerationSink> sink,
                             std::string request_id, router_actor router) {
  return system.spawn(sink_impl, std::move(sink), std::move(request_id), std::move(router));
}

ClusterService::ClusterService(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ClusterService::~ClusterService() = default;

void ClusterService::submit(router::GenerationRequest request, std::shared_ptr<router::GenerationSink> sink) {
  if (!sink) return;
  const std::string id = request.request_id;
  auto actor = spawn_stream_sink(impl_->system, sink, id, impl_->router);
  caf::anon_send(impl_->router, submit_atom::value, std::move(request), caf::actor_cast<caf::actor>(actor));
}

void ClusterService::cancel(const std::string& request_id) {
  caf::anon_send(impl_->router, cancel_atom::value, request_id);
}

router::ServiceStatus ClusterService::status() const {
  router::ServiceStatus out;
  const RouterGauges& g = *impl_->gauges;
  out.running = g.running.load();
  out.waiting = g.waiting.load();
  out.decode_slots_total = g.decode_slots_total.load();
  out.decode_slots_free = g.decode_slots_free.load();
  out.worker_requests = g.worker_requests.load();
  const int64_t prefill = g.prefill_workers.load(), decode = g.decode_workers.load();
  out.ready = prefill >= 1 && decode >= 1;
  if (!out.ready) {
    out.reason = "workers alive: " + std::to_string(prefill) + " prefill, " + std::to_string(decode) +
                 " decode (need >= 1 of each)";
  }
  return out;
}

}  // namespace deltaserve::actors
