// Spawns a decode worker actor (protocol: actors/decode_protocol.hpp).
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "actors/decode_protocol.hpp"
#include "engine/model.hpp"
#include "tokenizer/tiktoken_tokenizer.hpp"

namespace deltaserve::actors {

class UcxLink;  // actors/ucx_transport.hpp (not included here: CAF's test DSL defines a macro `expect`)

struct DecodeWorkerConfig {
  std::string name = "decode-0";                      // registry name (unique in the cluster)
  int64_t max_batch = 32;                             // state slots: requests decoding at once
  std::chrono::milliseconds heartbeat_interval{500};  // load reports to the registry; 0 = only on change
  bool self_step = true;         // false: steps run only on step() messages from outside (deterministic tests)
  std::shared_ptr<UcxLink> ucx;  // receive side of the UCX handoff path; null: reserve is refused
};

// `model` and `tokenizer` are shared read-only. `registry` may be null (tests).
decode_actor spawn_decode_worker(caf::actor_system& system, std::shared_ptr<const engine::Model> model,
                                 std::shared_ptr<const tokenizer::Tokenizer> tokenizer, registry_actor registry,
                                 DecodeWorkerConfig config);

}  // namespace deltaserve::actors
