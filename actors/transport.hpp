// How a prefill worker moves a request's encoded state to a decode worker. make_caf_transport sends one
// CAF message holding the envelope and the bytes; make_ucx_transport (actors/ucx_transport.hpp) sends the
// envelope over CAF and the bytes over UCX into a region the decode worker reserved.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "actors/decode_protocol.hpp"
#include "common/status.hpp"
#include "engine/model.hpp"
#include "engine/request_state.hpp"

namespace deltaserve::actors {

class Transport {
 public:
  virtual ~Transport() = default;

  // Hands `state` (engine::encode_state bytes) for `envelope.request` to `decode_worker`. Returns once the
  // bytes are owned by the transport (not when they arrived); delivery failures surface at the decode
  // worker (decode_state rejects partial or corrupt bytes; UCX: a transfer that fails or misses its
  // deadline), as the worker going down, or (UCX, when no transfer could start) as handoff_failed sent to
  // the envelope's router by the transport itself.
  virtual Status send_state(const caf::actor& decode_worker, HandoffEnvelope envelope, std::vector<uint8_t> state) = 0;

  // True when states of a device backend move in device memory (send_device_state); otherwise they are encoded on
  // the host.
  virtual bool moves_device_state() const { return false; }
  // Hands `state`, resident on `model`'s backend, to `decode_worker` from device memory to device memory, as it is
  // stored (no host copy, no encoding). The transport owns `state` from here on (its device slot and pages are released
  // when the transfer ended on this side). When the decode worker cannot take device state (another layout, no
  // device path), the transport encodes the state on the host and sends the bytes instead. Errors as send_state.
  virtual Status send_device_state(const caf::actor& decode_worker, HandoffEnvelope envelope,
                                   std::shared_ptr<engine::RequestState> state,
                                   std::shared_ptr<const engine::Model> model) {
    (void)decode_worker, (void)envelope, (void)state, (void)model;
    return Status(StatusCode::kUnimplemented, "this transport moves no device state");
  }
};

std::shared_ptr<Transport> make_caf_transport();

}  // namespace deltaserve::actors
