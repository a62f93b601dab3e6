#include "engine/decode_batcher.hpp"

#include <algorithm>
#include <cassert>
#include <utility>

namespace deltaserve::engine {
namespace {

// The state must have exactly the shapes RequestState(config) gives, with every MLA layer holding one
// row per consumed token; anything else is a state of another model (or a corrupt one).
Status check_state_shapes(const ModelConfig& config, const RequestState& state) {
  const RequestState fresh(config);
  if (state.kda.size() != fresh.kda.size() || state.mla.size() != fresh.mla.size()) {
    return invalid_argument("request state has " + std::to_string(state.kda.size()) + " KDA and " +
                            std::to_string(state.mla.size()) + " MLA layers; the model has " +
                            std::to_string(fresh.kda.size()) + " and " + std::to_string(fresh.mla.size()));
  }
  for (size_t i = 0; i < state.kda.size(); ++i) {
    const KdaLayerState& a = state.kda[i];
    const KdaLayerState& b = fresh.kda[i];
    if (a.conv_q.size() != b.conv_q.size() || a.conv_k.size() != b.conv_k.size() ||
        a.conv_v.size() != b.conv_v.size() || a.recurrent.size() != b.recurrent.size()) {
      return invalid_argument("request state KDA layer " + std::to_string(i) + " has the wrong shape");
    }
  }
  for (size_t i = 0; i < state.mla.size(); ++i) {
    if (state.mla[i].width() != fresh.mla[i].width()) {
      return invalid_argument("request state MLA layer " + std::to_string(i) + " has width " +
                              std::to_string(state.mla[i].width()) + ", the model " +
                              std::to_string(fresh.mla[i].width()));
    }
    // The host rows are checked only where they are the current copy (a device-resident state keeps its rows on
    // the device, e.g. one that arrived in GPU memory).
    if (!state.host_stale() && state.mla[i].num_tokens() != state.num_tokens()) {
      return invalid_argument("request state MLA layer " + std::to_string(i) + " holds " +
                              std::to_string(state.mla[i].num_tokens()) + " tokens, the state " +
                              std::to_string(state.num_tokens()));
    }
  }
  return Status::ok();
}

}  // namespace

DecodeBatcher::DecodeBatcher(const Model& model, int64_t max_batch, bool host_sampling)
    : model_(model), max_batch_(max_batch), host_sampling_(host_sampling) {
  assert(max_batch >= 1);
}

Status DecodeBatcher::add(const std::string& request_id, RequestState state, int32_t next_token,
                          const DecodeParams& params) {
  const ModelConfig& config = model_.config();
  if (contains(request_id)) return invalid_argument("request '" + request_id + "' is already decoding");
  if (free_slots() <= 0) {
    return failed_precondition("decode batch is full (" + std::to_string(max_batch_) + " requests)");
  }
  const std::string where = "request '" + request_id + "'";
  DS_RETURN_IF_ERROR_CTX(validate(params.sampling), where);
  if (params.max_tokens < 1) {
    return invalid_argument(where + ": max_tokens must be >= 1, got " + std::to_string(params.max_tokens));
  }
  if (params.generated < 0 || params.generated >= params.max_tokens) {
    return invalid_argument(where + ": " + std::to_string(params.generated) +
                            " tokens generated before leave none of max_tokens " + std::to_string(params.max_tokens));
  }
  for (int32_t id : params.stop_token_ids) {
    if (id < 0 || id >= config.vocab_size) {
      return invalid_argument(where + ": stop token id " + std::to_string(id) + " is outside the vocabulary [0, " +
                              std::to_string(config.vocab_size) + ")");
    }
  }
  if (next_token < 0 || next_token >= config.vocab_size) {
    return invalid_argument(where + ": next token " + std::to_string(next_token) + " is outside the vocabulary [0, " +
                            std::to_string(config.vocab_size) + ")");
  }
  DS_RETURN_IF_ERROR_CTX(check_state_shapes(config, state), where);
  if (config.max_position_embeddings > 0 && state.num_tokens() + 1 > config.max_position_embeddings) {
    return out_of_range(where + ": the state holds " + std::to_string(state.num_tokens()) +
                        " tokens; the context limit of " + std::to_string(config.max_position_embeddings) +
                        " leaves no room for the next one");
  }
  requests_.emplace(request_id, Active{std::move(state), next_token, params, Sampler(params.sampling, params.generated),
                                       params.generated, next_order_++});
  return Status::ok();
}

bool DecodeBatcher::remove(const std::string& request_id) {
  return requests_.erase(request_id) != 0;
}

Result<std::vector<DecodeStepOutput>> DecodeBatcher::step() {
  std::vector<std::pair<const std::string*, Active*>> batch;
  batch.reserve(requests_.size());
  for (auto& [id, request] : requests_) batch.emplace_back(&id, &request);
  std::sort(batch.begin(), batch.end(), [](const auto& a, const auto& b) { return a.second->order < b.second->order; });

  std::vector<DecodeStepOutput> outputs;
  if (batch.empty()) return outputs;

  std::vector<SequenceInput> inputs;
  inputs.reserve(batch.size());
  for (const auto& [id, request] : batch) {
    inputs.push_back(SequenceInput{&request->state, {&request->next_token, 1}, /*all_logits=*/false});
  }
  const std::string context = "decode step over " + std::to_string(batch.size()) + " requests";
  std::vector<SampleRequest> rows;
  rows.reserve(batch.size());
  for (const auto& [id, request] : batch) {
    rows.push_back(SampleRequest{request->params.sampling, request->sampler.peek_draw(), request->params.logprobs});
  }
  std::vector<SampledToken> sampled;
  if (host_sampling_) {
    std::vector<std::vector<float>> logits;
    DS_RETURN_IF_ERROR_CTX(model_.forward(inputs, logits), context);
    sample_rows(logits, rows, sampled);
  } else {
    DS_RETURN_IF_ERROR_CTX(model_.forward_sample(inputs, rows, sampled), context);
  }
  // The pass used each stream's next draw (peeked, so that a failed pass leaves the streams alone): take it now,
  // exactly as Sampler::sample would have.
  for (const auto& [id, request] : batch) (void)request->sampler.next_draw();

  // From here on nothing fails: the finished requests leave.
  const int64_t context_limit = model_.config().max_position_embeddings;
  outputs.reserve(batch.size());
  std::vector<std::string> finished;  // copies: erasing by a reference to the node's own key is unsafe
  for (size_t i = 0; i < batch.size(); ++i) {
    const auto& [id, request] = batch[i];
    DecodeStepOutput out;
    out.request_id = *id;
    out.sampled = std::move(sampled[i]);  // logprob 0 and no alternatives unless the request asked (its row did)
    out.completion_tokens = ++request->generated;
    const auto& stops = request->params.stop_token_ids;
    if (std::find(stops.begin(), stops.end(), out.sampled.token) != stops.end()) {
      out.finished = true;
      out.finish_reason = "stop";
    } else if (request->generated >= request->params.max_tokens ||
               (context_limit > 0 && request->state.num_tokens() >= context_limit)) {
      out.finished = true;
      out.finish_reason = "length";
    }
    request->next_token = out.sampled.token;
    if (out.finished) finished.push_back(*id);
    outputs.push_back(std::move(out));
  }
  for (const std::string& id : finished) requests_.erase(id);
  return outputs;
}

int64_t DecodeBatcher::state_bytes() const {
  int64_t bytes = 0;
  for (const auto& [id, request] : requests_) {
    bytes += request.state.kda_state_bytes() + request.state.mla_cache_bytes();
  }
  return bytes;
}

}  // namespace deltaserve::engine
