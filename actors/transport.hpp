// How a prefill worker moves a request's encoded state to a decode worker. make_caf_transport sends one
// CAF message holding the envelope and the bytes; make_ucx_transport (actors/ucx_transport.hpp) sends the
// envelope over CAF and the bytes over UCX into a region the decode worker reserved.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "actors/decode_protocol.hpp"
#include "common/status.hpp"

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
};

std::shared_ptr<Transport> make_caf_transport();

}  // namespace deltaserve::actors
