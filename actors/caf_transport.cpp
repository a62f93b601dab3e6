#include "actors/transport.hpp"

namespace deltaserve::actors {
namespace {

// The whole state travels in one CAF message next to its envelope.
class CafTransport final : public Transport {
 public:
  Status send_state(const caf::actor& decode_worker, HandoffEnvelope envelope, std::vector<uint8_t> state) override {
    if (!decode_worker) return Status(StatusCode::kUnavailable, "handoff: no decode worker");
    caf::anon_send(caf::actor_cast<decode_actor>(decode_worker), handoff_atom::value,
                   Handoff{std::move(envelope), std::move(state)});
    return Status::ok();
  }
};

}  // namespace

std::shared_ptr<Transport> make_caf_transport() {
  return std::make_shared<CafTransport>();
}

}  // namespace deltaserve::actors
