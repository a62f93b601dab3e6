#include "actors/decode_worker.hpp"

#include <algorithm>
#include <cstring>
#include <deque>
#include <iostream>
#include <map>
#include <optional>
#include <unordered_map>
#include <unordered_set>

#include "actors/heartbeat.hpp"
#include "actors/ucx_transport.hpp"
#include "engine/decode_batcher.hpp"
#include "engine/state_codec.hpp"
#include "tokenizer/text_stream.hpp"

namespace deltaserve::actors {
namespace {

constexpr size_t kMaxTombstones = 4096;  // cancelled ids whose handoff may still be in flight

struct Active {
  caf::actor sink;
  int64_t attempt = 0;  // the router's dispatch attempt it belongs to (stream_gate.hpp)
  std::unique_ptr<tokenizer::TextStream> text;
  int64_t prompt_tokens = 0;
  int64_t cached_tokens = 0;
  bool logprobs = false;
};

struct Pending {  // a decoded handoff waiting for a free slot
  HandoffEnvelope envelope;
  engine::RequestState state;
};

struct Incoming {  // a reserved UCX transfer: its region, and what has arrived so far
  std::string request_id;
  int64_t attempt = 0;
  caf::actor router;  // from the reservation (the envelope may never come)
  caf::actor sink;
  kvstore::transfer::RegionId region = 0;  // encoded bytes: the receive region (0 for a device state)
  uint64_t bytes = 0;
  std::unique_ptr<engine::RequestState> device_state;  // a device state: reserved on this worker's backend
  std::optional<HandoffEnvelope> envelope;
  std::optional<Status> status;  // the transfer's outcome (engine on_done)
};

struct DecodeState {
  std::shared_ptr<const engine::Model> model;
  std::shared_ptr<const tokenizer::Tokenizer> tokenizer;
  registry_actor registry;
  DecodeWorkerConfig config;
  std::unique_ptr<engine::DecodeBatcher> batcher;
  std::vector<int32_t> stop_token_ids;  // model eos + <|im_end|>
  int64_t slot_bytes = 0;               // KDA state bytes of one slot (for free_cache_bytes)
  std::unordered_map<std::string, Active> active;
  std::map<caf::actor_addr, std::string> by_sink;
  std::deque<Pending> pending;
  std::unordered_set<std::string> tombstones;
  std::unordered_map<std::string, int64_t> dropped;  // request id -> handoffs of attempts <= this are dropped
  std::deque<std::string> tombstone_order;
  bool step_pending = false;
  bool draining = false;
  std::unique_ptr<LoadReporter> reporter;  // with a registry and a heartbeat interval (heartbeat.hpp)
  WorkerStats stats;
  WorkerLoad last_reported{-1, -1, -1, -1};
  std::unordered_map<uint64_t, Incoming> incoming;  // by the receiver's transfer id
  std::unordered_set<uint32_t> quarantined;         // regions of failed transfers, released later
  // Device states of failed transfers, released at their transfer's timer (reserve + deadline + reserve timeout:
  // by then the sender's own deadline has passed, so nothing writes into their pages any more).
  std::unordered_map<uint64_t, std::unique_ptr<engine::RequestState>> quarantined_states;

  ~DecodeState() {  // the worker stops: cancel its transfers; regions still in use go with the engine
    if (!config.ucx) return;
    kvstore::transfer::TransferEngine& engine = config.ucx->engine();
    for (auto& [id, in] : incoming) {
      engine.abort(id, Status(StatusCode::kCancelled, "decode worker stopped"));
      if (in.region != 0) quarantined.insert(in.region);
    }
    for (uint32_t region : quarantined) (void)engine.release_region(region);
  }
};

using DecodePointer = decode_actor::stateful_pointer<DecodeState>;

WorkerLoad current_load(const DecodeState& s) {
  WorkerLoad load;
  load.queue_length = static_cast<int64_t>(s.pending.size());
  load.free_slots = s.batcher->free_slots();
  load.free_cache_bytes = load.free_slots * s.slot_bytes;
  load.active = s.batcher->active();
  return load;
}

void report_load(DecodePointer self, bool force) {
  auto& s = self->state;
  if (!s.registry || s.draining) return;
  const WorkerLoad load = current_load(s);
  if (!force && load.queue_length == s.last_reported.queue_length && load.free_slots == s.last_reported.free_slots) {
    return;
  }
  s.last_reported = load;
  if (s.reporter) {  // one sender for every report keeps them in order
    s.reporter->set(load);
  } else {
    self->send(s.registry, heartbeat_atom::value, s.config.name, load);
  }
}

void send_chunk(DecodePointer self, const caf::actor& sink, int64_t attempt, router::GenerationChunk chunk) {
  self->send(caf::actor_cast<sink_actor>(sink), chunk_atom::value, attempt, std::move(chunk));
}

void schedule_step(DecodePointer self) {
  auto& s = self->state;
  if (!s.config.self_step || s.step_pending || s.batcher->active() == 0) return;
  s.step_pending = true;
  self->send(self, step_atom::value);
}

void forget(DecodePointer self, const std::string& id) {
  auto& s = self->state;
  auto it = s.active.find(id);
  if (it == s.active.end()) return;
  s.by_sink.erase(it->second.sink.address());
  self->demonitor(it->second.sink);
  s.active.erase(it);
}

// Moves a decoded state into the batcher; on failure the sink gets the error.
void admit(DecodePointer self, HandoffEnvelope envelope, engine::RequestState state) {
  auto& s = self->state;
  const router::GenerationRequest& request = envelope.request;
  engine::DecodeParams params;
  params.sampling = request.sampling;
  params.logprobs = request.logprobs;
  params.max_tokens = request.max_tokens;
  params.generated = static_cast<int64_t>(envelope.generated.size());
  if (!request.ignore_eos) params.stop_token_ids = s.stop_token_ids;
  // A resumed request's text stream picks up where the client's is: fed the tokens it already has (their text
  // was sent, except what the stream still holds back, which it holds back here too). Had they completed a stop
  // string, the stream would have ended there: a sequence that does is not this request's.
  auto text = std::make_unique<tokenizer::TextStream>(*s.tokenizer, request.stop);
  for (int32_t token : envelope.generated) (void)text->push(token);
  Status added = text->stopped() ? invalid_argument("the tokens already sent complete a stop string")
                                 : s.batcher->add(request.request_id, std::move(state), envelope.next_token, params);
  if (!added.is_ok()) {
    ++s.stats.rejected;
    send_chunk(self, envelope.sink, envelope.attempt,
               error_chunk(request.request_id, added.with_context("decode admit")));
    return;
  }
  Active a;
  a.sink = envelope.sink;
  a.attempt = envelope.attempt;
  a.text = std::move(text);
  a.prompt_tokens = static_cast<int64_t>(request.prompt.size());
  // Usage is the uninterrupted request's: the resumed prefill's hits on already sent tokens are not prompt tokens.
  a.cached_tokens = std::min(envelope.cached_tokens, a.prompt_tokens);
  a.logprobs = request.logprobs;
  self->monitor(a.sink);
  s.by_sink[a.sink.address()] = request.request_id;
  s.active.emplace(request.request_id, std::move(a));
  schedule_step(self);
}

void admit_pending(DecodePointer self) {
  auto& s = self->state;
  while (!s.pending.empty() && s.batcher->free_slots() > 0) {
    Pending p = std::move(s.pending.front());
    s.pending.pop_front();
    admit(self, std::move(p.envelope), std::move(p.state));
  }
}

router::GenerationChunk abort_chunk(const std::string& id, int64_t prompt_tokens) {
  router::GenerationChunk chunk;
  chunk.request_id = id;
  chunk.finish_reason = "abort";
  chunk.prompt_tokens = prompt_tokens;
  return chunk;
}

void run_step(DecodePointer self) {
  auto& s = self->state;
  s.step_pending = false;
  if (s.batcher->active() == 0) return;
  auto outputs = s.batcher->step();
  ++s.stats.steps;
  if (!outputs.is_ok()) {
    // An engine error: no request advanced; fail them all rather than loop on the same error.
    std::vector<std::string> ids;
    for (const auto& [id, a] : s.active) ids.push_back(id);
    for (const std::string& id : ids) {
      s.batcher->remove(id);
      send_chunk(self, s.active[id].sink, s.active[id].attempt,
                 error_chunk(id, outputs.status().with_context("decode step")));
      forget(self, id);
    }
  } else {
    for (engine::DecodeStepOutput& out : *outputs) {
      auto it = s.active.find(out.request_id);
      if (it == s.active.end()) continue;
      Active& a = it->second;
      router::GenerationChunk chunk;
      chunk.request_id = out.request_id;
      chunk.tokens.push_back(out.sampled.token);
      if (a.logprobs) {
        chunk.logprobs.push_back(router::TokenLogprobs{out.sampled.token, out.sampled.logprob, out.sampled.top});
      }
      bool final = out.finished;
      std::string finish = out.finish_reason;
      if (out.finished && out.finish_reason == "stop") {
        chunk.text = a.text->finish();  // a stop token has no text; flush what was held back
      } else {
        tokenizer::TextStream::Output text = a.text->push(out.sampled.token);
        chunk.text = std::move(text.text);
        if (text.stopped) {
          if (!out.finished) s.batcher->remove(out.request_id);
          final = true;
          finish = "stop";
        } else if (out.finished) {
          chunk.text += a.text->finish();
        }
      }
      if (final) {
        chunk.finish_reason = finish;
        chunk.prompt_tokens = a.prompt_tokens;
        chunk.cached_tokens = a.cached_tokens;
        chunk.completion_tokens = out.completion_tokens;
      }
      send_chunk(self, a.sink, a.attempt, std::move(chunk));
      if (final) forget(self, out.request_id);
    }
  }
  admit_pending(self);
  schedule_step(self);
  report_load(self, false);
}

// How a running request of a superseded attempt ends (drop_attempts).
enum class RunningEnd {
  // An error chunk of its own attempt, which the sink passes only if that attempt owns the stream and no newer
  // one is announced (the stream then cannot continue) and drops otherwise (stream_gate.hpp).
  kWithError,
  // No chunk: the router, which sent drop(), owns the request's end (a newer attempt, or its own final chunk).
  kQuietly,
};

// Removes what this worker holds of request `id` from dispatch attempts up to `attempt`: the router moved
// the request on. Waiting handoffs go quietly (nothing of them was streamed); a running one ends as `end` says.
// Returns whether anything was removed.
bool drop_attempts(DecodePointer self, const std::string& id, int64_t attempt, RunningEnd end) {
  auto& s = self->state;
  const auto waiting = static_cast<int64_t>(std::erase_if(s.pending, [&](const Pending& p) {
    return p.envelope.request.request_id == id && p.envelope.attempt <= attempt;
  }));
  s.stats.stale_dropped += waiting;
  auto a = s.active.find(id);
  if (a == s.active.end() || a->second.attempt > attempt) return waiting > 0;
  s.batcher->remove(id);
  if (end == RunningEnd::kWithError) {
    send_chunk(self, a->second.sink, a->second.attempt,
               error_chunk(id, Status(StatusCode::kUnavailable, "the request moved to another attempt")));
  }
  forget(self, id);
  ++s.stats.stale_dropped;
  return true;
}

// The state of `envelope`'s request arrived (CAF message or verified UCX region): decodes it and admits the
// request, or reports why not. Stale (dropped) and cancelled handoffs end here too.
// `make_state` gives the request's state (decoded bytes, or a state that arrived in device memory).
template <class MakeState>
void accept_handoff(DecodePointer self, HandoffEnvelope& envelope, MakeState&& make_state) {
  auto& s = self->state;
  const std::string id = envelope.request.request_id;
  if (auto d = s.dropped.find(id); d != s.dropped.end() && envelope.attempt <= d->second) {
    s.dropped.erase(d);  // a stale attempt: the router prefilled the request again
    return;
  }
  if (s.tombstones.erase(id) != 0) {  // cancelled while in transfer
    send_chunk(self, envelope.sink, envelope.attempt,
               abort_chunk(id, static_cast<int64_t>(envelope.request.prompt.size())));
    return;
  }
  // The same request already here: the router dispatched it again while it could not see this worker
  // (declared lost during a stall). The later attempt is the router's current one and replaces the earlier
  // (drop_attempts); an attempt older than the one held is stale.
  const bool newer_here = (s.active.count(id) != 0 && s.active[id].attempt >= envelope.attempt) ||
                          std::any_of(s.pending.begin(), s.pending.end(), [&](const Pending& p) {
                            return p.envelope.request.request_id == id && p.envelope.attempt >= envelope.attempt;
                          });
  if (newer_here) {
    ++s.stats.stale_dropped;
    return;
  }
  drop_attempts(self, id, envelope.attempt - 1, RunningEnd::kWithError);
  Result<engine::RequestState> state = make_state();
  if (!state.is_ok()) {
    ++s.stats.rejected;
    const Status why = state.status().with_context("handoff " + id + " at " + s.config.name);
    if (envelope.router) {  // the router prefills it again elsewhere
      self->send(caf::actor_cast<router_actor>(envelope.router), failed_atom::value, id, envelope.attempt,
                 static_cast<int32_t>(why.code()), why.message());
    } else {
      send_chunk(self, envelope.sink, envelope.attempt, error_chunk(id, why));
    }
    return;
  }
  ++s.stats.handoffs;
  if (envelope.router)
    self->send(caf::actor_cast<router_actor>(envelope.router), admitted_atom::value, id, envelope.attempt);
  if (s.batcher->free_slots() > 0 && s.pending.empty()) {
    admit(self, std::move(envelope), std::move(state).value());
  } else {
    s.pending.push_back(Pending{std::move(envelope), std::move(state).value()});
  }
  report_load(self, false);
}

// ---- UCX receive path (actors/ucx_transport.hpp) ----

namespace xfer = kvstore::transfer;

constexpr uint64_t kMaxStateBytes = 1ull << 34;  // a reserve asking for more is refused (untrusted input)

// How long a failed transfer's region is kept before release: a live sender may put into it until its own
// deadline, armed at most reserve_timeout after the reservation.
std::chrono::milliseconds quarantine(const UcxLink& link) {
  return link.config().deadline + link.config().reserve_timeout;
}

// Releases a region, or retries later while a transfer still uses it.
void release_region(DecodePointer self, xfer::RegionId region) {
  auto& s = self->state;
  Status released = s.config.ucx->engine().release_region(region);
  if (released.code() == StatusCode::kFailedPrecondition) {
    s.quarantined.insert(region);
    self->delayed_send(self, std::chrono::milliseconds(200), region_free_atom::value, region);
    return;
  }
  s.quarantined.erase(region);
  if (!released.is_ok()) std::cerr << "warning: " << s.config.name << ": " << released.to_string() << "\n";
}

// A UCX handoff that will not be decoded: the router prefills the request again (or the sink gets the error);
// the region is quarantined. Cancelled and stale requests end quietly, as on the CAF path.
void fail_incoming(DecodePointer self, uint64_t transfer, Status why) {  // by value: may come from the entry
  auto& s = self->state;
  auto it = s.incoming.find(transfer);
  if (it == s.incoming.end()) return;
  Incoming in = std::move(it->second);
  s.incoming.erase(it);
  ++s.stats.rejected;
  if (in.device_state) {
    s.quarantined_states[transfer] = std::move(in.device_state);  // released at the transfer's timer
  } else {
    s.quarantined.insert(in.region);
    self->delayed_send(self, quarantine(*s.config.ucx), region_free_atom::value, in.region);
  }
  const std::string& id = in.request_id;
  if (auto d = s.dropped.find(id); d != s.dropped.end() && in.attempt <= d->second) {
    s.dropped.erase(d);
    return;
  }
  if (s.tombstones.erase(id) != 0) {
    const int64_t prompt = in.envelope ? static_cast<int64_t>(in.envelope->request.prompt.size()) : 0;
    send_chunk(self, in.sink, in.attempt, abort_chunk(id, prompt));
    return;
  }
  const Status status = why.with_context("UCX handoff " + id + " at " + s.config.name);
  if (in.router) {
    self->send(caf::actor_cast<router_actor>(in.router), failed_atom::value, id, in.attempt,
               static_cast<int32_t>(status.code()), status.message());
  } else {
    send_chunk(self, in.sink, in.attempt, error_chunk(id, status));
  }
}

// Decodes once both the envelope and a successful completion are there; fails on a failed completion.
void try_finish_incoming(DecodePointer self, uint64_t transfer) {
  auto& s = self->state;
  auto it = s.incoming.find(transfer);
  if (it == s.incoming.end() || !it->second.status) return;
  if (!it->second.status->is_ok()) {
    fail_incoming(self, transfer, *it->second.status);
    return;
  }
  if (!it->second.envelope) return;  // the envelope is still on its way (transfer_timer bounds the wait)
  Incoming in = std::move(it->second);
  s.incoming.erase(it);
  if (in.device_state) {  // verified in place: the request decodes from these pages and this slot
    accept_handoff(self, *in.envelope, [&]() -> Result<engine::RequestState> { return std::move(*in.device_state); });
    return;
  }
  const std::span<std::byte> region = s.config.ucx->engine().region_data(in.region);
  if (region.size() < in.bytes) {
    s.incoming.emplace(transfer, std::move(in));
    fail_incoming(self, transfer, internal_error("receive region vanished"));
    return;
  }
  accept_handoff(self, *in.envelope, [&] { return engine::decode_state(s.model->config(), region.first(in.bytes)); });
  release_region(self, in.region);
}

ReserveReply reserve(DecodePointer self, ReserveRequest& request) {
  auto& s = self->state;
  ReserveReply reply;
  auto refuse = [&](const Status& why) {
    reply.code = static_cast<int32_t>(why.code());
    reply.message = why.message();
    return reply;
  };
  if (!s.config.ucx) return refuse(failed_precondition(s.config.name + " has no UCX transport"));
  UcxLink& link = *s.config.ucx;
  xfer::TransferEngine& engine = link.engine();
  xfer::ReceiveSpec spec;
  std::optional<xfer::RegionId> region;
  std::unique_ptr<engine::RequestState> device_state;
  const uint64_t piece = link.config().piece_bytes;
  if (request.device_tokens >= 0) {
    // A state in device memory: a slot and pages of this worker's backend, its spans the pieces' destinations.
    // Refused with FailedPrecondition (the sender then encodes on the host) when the layouts differ.
    if (!link.device_handoff() || s.model->backend() == nullptr) {
      return refuse(failed_precondition(s.config.name + " takes no state in device memory"));
    }
    if (request.device_layout != link.device_layout()) {
      return refuse(failed_precondition(s.config.name + ": device state layout '" + link.device_layout() +
                                        "' differs from the sender's '" + request.device_layout + "'"));
    }
    engine::Backend& backend = *s.model->backend();
    device_state = std::make_unique<engine::RequestState>(s.model->new_state());
    if (Status reserved = backend.reserve_device_state(*device_state, request.device_tokens); !reserved.is_ok()) {
      return refuse(reserved.with_context("reserve " + request.request_id));
    }
    auto spans = backend.device_state_spans(*device_state);
    if (!spans.is_ok()) return refuse(spans.status().with_context("reserve " + request.request_id));
    auto segment = [&](const engine::DeviceSpan& span) { return link.device_segment(span); };
    for (size_t layer = 0; layer < spans->kda_states.size(); ++layer) {
      std::vector<xfer::LocalSegment> piece_segments;
      for (const auto* list : {&spans->kda_states, &spans->kda_tails}) {
        if (layer >= list->size()) continue;
        auto seg = segment((*list)[layer]);
        if (!seg.is_ok()) return refuse(seg.status().with_context("reserve " + request.request_id));
        piece_segments.push_back(*seg);
      }
      spec.pieces.push_back(std::move(piece_segments));
    }
    for (const engine::DeviceSpan& page : spans->mla_pages) {
      auto seg = segment(page);
      if (!seg.is_ok()) return refuse(seg.status().with_context("reserve " + request.request_id));
      spec.pieces.push_back({*seg});
    }
  } else {
    if (request.bytes == 0 || request.bytes > kMaxStateBytes) {
      return refuse(invalid_argument("reserve: " + std::to_string(request.bytes) + " state bytes"));
    }
    auto allocated = engine.allocate_region(request.bytes);
    if (!allocated.is_ok()) return refuse(allocated.status().with_context("reserve " + request.request_id));
    region = *allocated;
    for (uint64_t offset = 0; offset < request.bytes; offset += piece) {
      spec.pieces.push_back({xfer::LocalSegment{*region, offset, std::min(piece, request.bytes - offset)}});
    }
  }
  spec.deadline = link.config().deadline;
  // Runs on the engine's progress thread: only posts a message (to a weak handle; nothing once the Node stops).
  spec.on_done = [link = &link, worker = caf::actor_addr(self->address())](xfer::TransferId id, const Status& status) {
    link->deliver([&] {
      if (auto handle = caf::actor_cast<caf::actor>(worker)) {
        caf::anon_send(caf::actor_cast<decode_actor>(handle), transfer_done_atom::value, static_cast<uint64_t>(id),
                       static_cast<int32_t>(status.code()), status.message());
      }
    });
  };
  auto expected = engine.expect(std::move(spec));
  if (!expected.is_ok()) {
    if (region) release_region(self, *region);
    return refuse(expected.status().with_context("reserve " + request.request_id));
  }
  Incoming in;
  in.request_id = request.request_id;
  in.attempt = request.attempt;
  in.router = std::move(request.router);
  in.sink = std::move(request.sink);
  in.region = region.value_or(0);
  in.bytes = request.bytes;
  in.device_state = std::move(device_state);
  s.incoming.emplace(expected->id, std::move(in));
  self->delayed_send(self, quarantine(link), transfer_timer_atom::value, static_cast<uint64_t>(expected->id));
  reply.transfer = expected->id;
  reply.descriptor.resize(expected->descriptor.size());
  std::memcpy(reply.descriptor.data(), expected->descriptor.data(), expected->descriptor.size());
  reply.piece_bytes = piece;
  return reply;
}
decode_actor::behavior_type decode_impl(DecodePointer self, std::shared_ptr<const engine::Model> model,
                                        std::shared_ptr<const tokenizer::Tokenizer> tokenizer, registry_actor registry,
                                        DecodeWorkerConfig config) {
  auto& s = self->state;
  s.model = std::move(model);
  s.tokenizer = std::move(tokenizer);
  s.registry = std::move(registry);
  s.config = std::move(config);
  if (s.config.max_batch <= 0) s.config.max_batch = 1;
  s.batcher = std::make_unique<engine::DecodeBatcher>(*s.model, s.config.max_batch);
  if (s.model->config().eos_token_id >= 0) s.stop_token_ids.push_back(s.model->config().eos_token_id);
  if (auto im_end = s.tokenizer->special_token_id("<|im_end|>")) s.stop_token_ids.push_back(*im_end);
  s.slot_bytes = s.model->new_state().kda_state_bytes();
  if (s.registry && s.config.heartbeat_interval.count() > 0) {
    s.reporter = std::make_unique<LoadReporter>(self->system(), s.registry, s.config.name, s.config.heartbeat_interval,
                                                current_load(s));
  }
  // A sink that went away (client gone, router process lost) is a cancel without a reply.
  self->set_down_handler([self](const caf::down_msg& down) {
    auto& s = self->state;
    auto it = s.by_sink.find(down.source);
    if (it == s.by_sink.end()) return;
    const std::string id = it->second;
    s.batcher->remove(id);
    forget(self, id);
    admit_pending(self);
    report_load(self, false);
  });
  return {
      [self](handoff_atom, Handoff& handoff) {
        const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(handoff.state.data()),
                                               handoff.state.size());
        accept_handoff(self, handoff.envelope,
                       [&] { return engine::decode_state(self->state.model->config(), bytes); });
      },
      [self](cancel_atom, const std::string& id) {
        auto& s = self->state;
        if (auto it = s.active.find(id); it != s.active.end()) {
          s.batcher->remove(id);
          send_chunk(self, it->second.sink, it->second.attempt, abort_chunk(id, it->second.prompt_tokens));
          forget(self, id);
          admit_pending(self);
          report_load(self, false);
          return;
        }
        for (auto it = s.pending.begin(); it != s.pending.end(); ++it) {
          if (it->envelope.request.request_id != id) continue;
          send_chunk(self, it->envelope.sink, it->envelope.attempt,
                     abort_chunk(id, static_cast<int64_t>(it->envelope.request.prompt.size())));
          s.pending.erase(it);
          report_load(self, false);
          return;
        }
        if (s.tombstones.insert(id).second) {
          s.tombstone_order.push_back(id);
          if (s.tombstone_order.size() > kMaxTombstones) {
            s.tombstones.erase(s.tombstone_order.front());
            s.tombstone_order.pop_front();
          }
        }
      },
      [self](drop_atom, const std::string& id, int64_t attempt) {
        auto& s = self->state;
        const bool held = drop_attempts(self, id, attempt, RunningEnd::kQuietly);
        admit_pending(self);
        report_load(self, false);
        // Nothing here yet: a handoff of such an attempt may still be on its way (by CAF or a UCX transfer).
        // What was held arrived already (one handoff per attempt), so nothing is remembered for it.
        if (held) return;
        if (s.dropped.size() >= kMaxTombstones) s.dropped.clear();  // bounded; a stale handoff is then decoded
        s.dropped[id] = std::max(s.dropped[id], attempt);
      },
      [self](step_atom) { run_step(self); },
      [self](reserve_atom, ReserveRequest& request) -> ReserveReply { return reserve(self, request); },
      [self](handoff_ucx_atom, HandoffEnvelope& envelope, uint64_t transfer) {
        auto it = self->state.incoming.find(transfer);
        if (it == self->state.incoming.end()) return;  // already failed and reported (or never reserved here)
        it->second.envelope = std::move(envelope);
        try_finish_incoming(self, transfer);
      },
      [self](transfer_done_atom, uint64_t transfer, int32_t code, const std::string& message) {
        auto it = self->state.incoming.find(transfer);
        if (it == self->state.incoming.end()) return;
        const auto status_code = code >= 0 && code <= static_cast<int32_t>(StatusCode::kCancelled)
                                     ? static_cast<StatusCode>(code)
                                     : StatusCode::kInternal;
        it->second.status = status_code == StatusCode::kOk ? Status::ok() : Status(status_code, message);
        try_finish_incoming(self, transfer);
      },
      [self](transfer_timer_atom, uint64_t transfer) {
        auto it = self->state.incoming.find(transfer);
        if (it != self->state.incoming.end()) {
          if (!it->second.status) {
            self->state.config.ucx->engine().abort(transfer,
                                                   Status(StatusCode::kDeadlineExceeded, "no completion in time"));
          }
          fail_incoming(self, transfer,
                        Status(StatusCode::kDeadlineExceeded, it->second.envelope ? "transfer did not complete in time"
                                                                                  : "handoff envelope never came"));
        }
        self->state.quarantined_states.erase(transfer);  // its sender's deadline has passed: the pages are free
      },
      [self](region_free_atom, uint32_t region) { release_region(self, region); },
      [self](drain_atom) {
        auto& s = self->state;
        if (s.reporter) s.reporter->set_draining();
        if (s.registry && !s.draining) self->send(s.registry, leave_atom::value, s.config.name);
        s.draining = true;
      },
      [self](stats_atom) -> WorkerStats {
        auto& s = self->state;
        WorkerStats out = s.stats;
        out.active = s.batcher->active();
        out.queued = static_cast<int64_t>(s.pending.size());
        out.free_slots = s.batcher->free_slots();
        return out;
      },
  };
}

}  // namespace

decode_actor spawn_decode_worker(caf::actor_system& system, std::shared_ptr<const engine::Model> model,
                                 std::shared_ptr<const tokenizer::Tokenizer> tokenizer, registry_actor registry,
                                 DecodeWorkerConfig config) {
  return system.spawn(decode_impl, std::move(model), std::move(tokenizer), std::move(registry), std::move(config));
}

}  // namespace deltaserve::actors
