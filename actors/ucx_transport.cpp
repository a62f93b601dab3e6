#include "actors/ucx_transport.hpp"

#include <cstring>
#include <iostream>
#include <span>

#include "engine/state_codec.hpp"

namespace deltaserve::actors {
namespace {

namespace xfer = kvstore::transfer;

// A dead peer fails its transfers at once (instead of at the deadline) only with a network transport;
// UCX 1.13 refuses shared-memory transports with peer error handling (stack.md §6.3).
bool network_transport(const std::string& tls) {
  size_t start = 0;
  while (start <= tls.size()) {
    const size_t end = std::min(tls.find(',', start), tls.size());
    const std::string name = tls.substr(start, end - start);
    if (name == "tcp" || name == "rc" || name == "ud" || name == "dc" || name == "all") return true;
    start = end + 1;
  }
  return false;
}

bool shared_memory_transport(const std::string& tls) {
  for (const char* name : {"posix", "sysv", "sm", "cma", "shm"}) {
    if (tls.find(name) != std::string::npos) return true;
  }
  return false;
}

// Sends the failure of a handoff that never started moving bytes: to the router (which prefills the request
// again) or, without one, to the sink.
void report_failure(caf::event_based_actor* self, const HandoffEnvelope& envelope, const Status& why) {
  const std::string& id = envelope.request.request_id;
  if (envelope.router) {
    self->send(caf::actor_cast<router_actor>(envelope.router), failed_atom::value, id, envelope.attempt,
               static_cast<int32_t>(why.code()), why.message());
  } else if (envelope.sink) {
    self->send(caf::actor_cast<sink_actor>(envelope.sink), chunk_atom::value, envelope.attempt, error_chunk(id, why));
  }
}

// One handoff: reserve at the receiver, put the pieces, hand the envelope over, quit. The bytes outlive the
// actor when needed: the engine's on_done holds the last reference until the sender's side finished.
caf::behavior sender(caf::event_based_actor* self, std::shared_ptr<UcxLink> link, decode_actor decode_worker,
                     HandoffEnvelope envelope, std::shared_ptr<const std::vector<uint8_t>> state) {
  ReserveRequest reserve{envelope.request.request_id, envelope.attempt, state->size(), envelope.router, envelope.sink};
  const std::string id = envelope.request.request_id;
  self->request(decode_worker, link->config().reserve_timeout, reserve_atom::value, std::move(reserve))
      .then(
          [self, link, decode_worker, envelope, state](ReserveReply& reply) mutable {
            const std::string& id = envelope.request.request_id;
            if (reply.code != 0) {
              report_failure(self, envelope,
                             Status(static_cast<StatusCode>(reply.code), reply.message).with_context("reserve " + id));
              self->quit();
              return;
            }
            xfer::TransferEngine& engine = link->engine();
            const auto descriptor = std::as_bytes(std::span(reply.descriptor));
            auto started = engine.start_send(descriptor, [state](xfer::TransferId, const Status&) {});
            if (!started.is_ok()) {
              report_failure(self, envelope, started.status().with_context("start transfer of " + id));
              self->quit();
              return;
            }
            const xfer::TransferId transfer = *started;
            const uint64_t piece = std::max<uint64_t>(reply.piece_bytes, 1);
            const auto bytes = std::as_bytes(std::span(*state));
            Status sent = Status::ok();
            uint32_t seq = 0;
            for (uint64_t offset = 0; offset < bytes.size() && sent.is_ok(); offset += piece, ++seq) {
              const std::span<const std::byte> source = bytes.subspan(offset, std::min(piece, bytes.size() - offset));
              sent = engine.send_piece(transfer, seq, std::span(&source, 1));
            }
            if (sent.is_ok()) sent = engine.finish_send(transfer);
            if (!sent.is_ok()) {
              // The receiver learns of it (abort tells the peer, else its deadline) and reports the failure.
              engine.abort(transfer, sent);
            }
            self->send(decode_worker, handoff_ucx_atom::value, std::move(envelope), reply.transfer);
            self->quit();
          },
          [self, envelope, id](caf::error& error) {
            report_failure(self, envelope,
                           Status(StatusCode::kUnavailable, "reserve " + id + ": " + self->system().render(error)));
            self->quit();
          });
  return {[](int32_t) {}};  // nothing arrives here; the actor lives for its request
}

// The pieces of a device state, in the order ReserveRequest names: each KDA layer's state and tails, then each
// MLA page.
std::vector<std::vector<engine::DeviceSpan>> device_pieces(const engine::DeviceStateSpans& spans) {
  std::vector<std::vector<engine::DeviceSpan>> pieces;
  for (size_t layer = 0; layer < spans.kda_states.size(); ++layer) {
    pieces.push_back({spans.kda_states[layer]});
    if (layer < spans.kda_tails.size()) pieces.back().push_back(spans.kda_tails[layer]);
  }
  for (const engine::DeviceSpan& page : spans.mla_pages) pieces.push_back({page});
  return pieces;
}

// One handoff of a device state: reserve at the receiver with the layout, put every piece from GPU memory, hand the
// envelope over, quit. `state` (its device slot and pages) lives until the engine finished this side of the
// transfer. A receiver that cannot take device state (FailedPrecondition) gets the state encoded on the host.
caf::behavior device_sender(caf::event_based_actor* self, std::shared_ptr<UcxLink> link, decode_actor decode_worker,
                            HandoffEnvelope envelope, std::shared_ptr<engine::RequestState> state,
                            std::shared_ptr<const engine::Model> model) {
  ReserveRequest reserve{envelope.request.request_id, envelope.attempt,     0, envelope.router, envelope.sink,
                         state->num_tokens(),         link->device_layout()};
  self->request(decode_worker, link->config().reserve_timeout, reserve_atom::value, std::move(reserve))
      .then(
          [self, link, decode_worker, envelope, state, model](ReserveReply& reply) mutable {
            const std::string& id = envelope.request.request_id;
            if (reply.code == static_cast<int32_t>(StatusCode::kFailedPrecondition)) {
              // No device path there: encode on the host and send the bytes.
              Status synced = state->sync_host();
              if (!synced.is_ok()) {
                report_failure(self, envelope, synced.with_context("handoff " + id));
              } else {
                const std::vector<std::byte> encoded = engine::encode_state(model->config(), *state);
                auto bytes = std::make_shared<std::vector<uint8_t>>(encoded.size());
                if (!encoded.empty()) std::memcpy(bytes->data(), encoded.data(), encoded.size());
                state.reset();
                self->spawn(sender, link, decode_worker, std::move(envelope),
                            std::shared_ptr<const std::vector<uint8_t>>(std::move(bytes)));
              }
              self->quit();
              return;
            }
            if (reply.code != 0) {
              report_failure(self, envelope,
                             Status(static_cast<StatusCode>(reply.code), reply.message).with_context("reserve " + id));
              self->quit();
              return;
            }
            auto spans = model->backend()->device_state_spans(*state);  // waits for the passes that wrote it
            if (!spans.is_ok()) {
              report_failure(self, envelope, spans.status().with_context("handoff " + id));
              self->quit();
              return;
            }
            xfer::TransferEngine& engine = link->engine();
            auto started = engine.start_send(std::as_bytes(std::span(reply.descriptor)),
                                             [state](xfer::TransferId, const Status&) {});
            if (!started.is_ok()) {
              report_failure(self, envelope, started.status().with_context("start transfer of " + id));
              self->quit();
              return;
            }
            const xfer::TransferId transfer = *started;
            Status sent = Status::ok();
            uint32_t seq = 0;
            for (const auto& piece : device_pieces(*spans)) {
              std::vector<std::span<const std::byte>> sources;
              for (const engine::DeviceSpan& span : piece) {
                sources.emplace_back(span.data, static_cast<size_t>(span.bytes));
              }
              sent = engine.send_piece(transfer, seq++, sources);
              if (!sent.is_ok()) break;
            }
            if (sent.is_ok()) sent = engine.finish_send(transfer);
            if (!sent.is_ok()) engine.abort(transfer, sent);
            self->send(decode_worker, handoff_ucx_atom::value, std::move(envelope), reply.transfer);
            self->quit();
          },
          [self, envelope](caf::error& error) {
            report_failure(self, envelope,
                           Status(StatusCode::kUnavailable,
                                  "reserve " + envelope.request.request_id + ": " + self->system().render(error)));
            self->quit();
          });
  return {[](int32_t) {}};
}

class UcxTransport final : public Transport {
 public:
  explicit UcxTransport(std::shared_ptr<UcxLink> link) : link_(std::move(link)) {}

  bool moves_device_state() const override { return link_->device_handoff(); }

  Status send_device_state(const caf::actor& decode_worker, HandoffEnvelope envelope,
                           std::shared_ptr<engine::RequestState> state,
                           std::shared_ptr<const engine::Model> model) override {
    if (!decode_worker) return Status(StatusCode::kUnavailable, "handoff: no decode worker");
    if (!link_->device_handoff() || model->backend() == nullptr) {
      return failed_precondition("handoff: the UCX link moves no device state");
    }
    decode_worker.home_system().spawn(device_sender, link_, caf::actor_cast<decode_actor>(decode_worker),
                                      std::move(envelope), std::move(state), std::move(model));
    return Status::ok();
  }

  Status send_state(const caf::actor& decode_worker, HandoffEnvelope envelope, std::vector<uint8_t> state) override {
    if (!decode_worker) return Status(StatusCode::kUnavailable, "handoff: no decode worker");
    if (state.empty()) return invalid_argument("handoff: empty state");
    auto bytes = std::make_shared<const std::vector<uint8_t>>(std::move(state));
    decode_worker.home_system().spawn(sender, link_, caf::actor_cast<decode_actor>(decode_worker), std::move(envelope),
                                      std::move(bytes));
    return Status::ok();
  }

 private:
  std::shared_ptr<UcxLink> link_;
};

}  // namespace

Status validate(const UcxLinkConfig& config) {
  if (config.deadline.count() <= 0) return invalid_argument("transfer deadline: must be positive");
  if (config.reserve_timeout.count() <= 0) return invalid_argument("transfer reserve timeout: must be positive");
  if (config.piece_bytes == 0) return invalid_argument("transfer piece bytes: must be positive");
  return Status::ok();
}

UcxLink::UcxLink(UcxLinkConfig config, std::unique_ptr<xfer::TransferEngine> engine)
    : config_(std::move(config)), engine_(std::move(engine)) {}

UcxLink::~UcxLink() {
  close();
  engine_.reset();  // cancels what is still running; its callbacks find the link closed
}

Result<std::shared_ptr<UcxLink>> UcxLink::create(const UcxLinkConfig& config) {
  DS_RETURN_IF_ERROR(validate(config));
  xfer::EngineConfig engine_config;
  engine_config.tls = config.tls;
  engine_config.net_devices = config.net_devices;
  engine_config.detect_peer_failure = network_transport(config.tls) && !shared_memory_transport(config.tls);
  engine_config.carrier = xfer::carrier_for_transports(config.tls);
  engine_config.progress_thread = true;
  engine_config.faults = config.faults;
  engine_config.device = config.device;
  auto engine = xfer::TransferEngine::create(engine_config);
  if (!engine.is_ok()) return engine.status().with_context("UCX transfer engine (tls '" + config.tls + "')");
  return std::shared_ptr<UcxLink>(new UcxLink(config, std::move(engine).value()));
}

Status UcxLink::register_device_memory(engine::Backend& backend) {
  if (device_handoff()) return Status::ok();
  if (!config_.device) return failed_precondition("the UCX link has no GPU memory access");
  if (!engine_->memory_info().cuda) {
    return failed_precondition(
        "this UCX build cannot register CUDA memory (Debian's UCX has none; PyPI's "
        "libucx-cu13 does): handoffs go through host memory");
  }
  const std::string layout = backend.device_state_layout();
  if (layout.empty()) return failed_precondition("the backend keeps no state in device memory");
  std::vector<DeviceRegion> regions;
  for (const engine::DeviceSpan& span : backend.device_memory_regions()) {
    auto region = engine_->register_device_region(span.data, static_cast<uint64_t>(span.bytes));
    if (!region.is_ok()) {
      for (const DeviceRegion& r : regions) (void)engine_->release_region(r.region);
      return region.status().with_context("registering the backend's device memory");
    }
    regions.push_back({span.data, span.bytes, *region});
  }
  device_regions_ = std::move(regions);
  device_layout_ = layout;
  return Status::ok();
}

Result<xfer::LocalSegment> UcxLink::device_segment(const engine::DeviceSpan& span) const {
  for (const DeviceRegion& r : device_regions_) {
    if (span.data >= r.base && span.bytes <= r.bytes && span.data - r.base <= r.bytes - span.bytes) {
      return xfer::LocalSegment{r.region, static_cast<uint64_t>(span.data - r.base), static_cast<uint64_t>(span.bytes)};
    }
  }
  return Status(StatusCode::kNotFound, "a device span outside the registered device memory");
}

void UcxLink::deliver(const std::function<void()>& post) {
  std::lock_guard lock(mutex_);
  if (!closed_) post();
}

void UcxLink::close() {
  std::lock_guard lock(mutex_);
  closed_ = true;
}

std::shared_ptr<Transport> make_ucx_transport(std::shared_ptr<UcxLink> link) {
  return std::make_shared<UcxTransport>(std::move(link));
}

}  // namespace deltaserve::actors
