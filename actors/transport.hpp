// How a prefill worker moves a request's encoded state to a decode worker. The implementation here
// (make_caf_transport) sends one CAF message holding the envelope and the bytes; the UCX issue replaces
// the bulk path (envelope over CAF, bytes over UCX) behind the same interface.
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
  // worker (decode_state rejects partial or corrupt bytes) or as the worker going down.
  virtual Status send_state(const caf::actor& decode_worker, HandoffEnvelope envelope, std::vector<uint8_t> state) = 0;
};

std::shared_ptr<Transport> make_caf_transport();

}  // namespace deltaserve::actors
