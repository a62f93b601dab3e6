#include "actors/wire_types.hpp"

#include "actors/decode_protocol.hpp"
#include "actors/prefill_protocol.hpp"
#include "actors/registry_protocol.hpp"
#include "actors/router_protocol.hpp"

namespace deltaserve::actors {

void register_wire_types(caf::actor_system_config& config) {
  config.add_message_type<engine::SamplingParams>("ds::SamplingParams");
  config.add_message_type<engine::TokenLogprob>("ds::TokenLogprob");
  config.add_message_type<std::vector<engine::TokenLogprob>>("ds::TokenLogprobList");
  config.add_message_type<router::GenerationRequest>("ds::GenerationRequest");
  config.add_message_type<router::TokenLogprobs>("ds::TokenLogprobs");
  config.add_message_type<std::vector<router::TokenLogprobs>>("ds::TokenLogprobsList");
  config.add_message_type<router::GenerationChunk>("ds::GenerationChunk");
  config.add_message_type<WorkerStats>("ds::WorkerStats");
  config.add_message_type<WorkerLoad>("ds::WorkerLoad");
  config.add_message_type<WorkerInfo>("ds::WorkerInfo");
  config.add_message_type<std::vector<WorkerInfo>>("ds::WorkerInfoList");
  config.add_message_type<RouterStats>("ds::RouterStats");
  config.add_message_type<PrefillJob>("ds::PrefillJob");
  config.add_message_type<HandoffEnvelope>("ds::HandoffEnvelope");
  config.add_message_type<Handoff>("ds::Handoff");
  config.add_message_type<ReserveRequest>("ds::ReserveRequest");
  config.add_message_type<ReserveReply>("ds::ReserveReply");
  config.add_message_type<std::vector<uint8_t>>("ds::Bytes");
  config.add_message_type<std::vector<int32_t>>("ds::TokenIds");
  config.add_message_type<kvstore::CacheEvent>("ds::CacheEvent");
  config.add_message_type<std::vector<kvstore::CacheEvent>>("ds::CacheEventList");
  config.add_message_type<kvstore::CacheEventBatch>("ds::CacheEventBatch");
  config.add_message_type<kvstore::BlockHash>("ds::BlockHash");
  config.add_message_type<std::vector<kvstore::BlockHash>>("ds::BlockHashList");
  config.add_message_type<kvstore::PromptHashes>("ds::PromptHashes");
}

}  // namespace deltaserve::actors
