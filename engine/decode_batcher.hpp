// Continuous batching for decode: requests join and leave between steps; one step runs one forward
// pass over every active request (one token each), samples with each request's own Sampler and
// applies max_tokens and stop token ids. Text-level work (detokenization, stop strings) is the
// caller's (tokenizer/text_stream.hpp), so the engine stays free of the tokenizer.
//
// Handoff rule ("N−1 prefill"): a prefill worker consumes prompt[0, N−1) into a RequestState and
// hands over that state plus the last prompt token; the first decode step feeds that token, so the
// KDA state advances over every prompt token exactly once and the first sampled token comes from
// the decode worker. `deltaserve generate` uses the same split, so both paths do the same math.
//
// Not thread-safe: owned by one decode worker actor.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/status.hpp"
#include "engine/model.hpp"
#include "engine/sampler.hpp"

namespace deltaserve::engine {

struct DecodeParams {
  SamplingParams sampling;
  bool logprobs = false;               // fill SampledToken.logprob/top in the step output
  int64_t max_tokens = 16;             // >= 1
  std::vector<int32_t> stop_token_ids; // stop when one is sampled (it is reported, finish "stop")
};

struct DecodeStepOutput {
  std::string request_id;
  SampledToken sampled;        // the new token (logprob/top valid when params.logprobs)
  int64_t completion_tokens;   // generated so far, including this one
  bool finished = false;       // max_tokens reached or a stop token sampled; the request has left the batch
  std::string finish_reason;   // "length" | "stop" when finished
};

class DecodeBatcher {
 public:
  // `max_batch`: requests decoding at once (state slots); `model` must outlive the batcher.
  DecodeBatcher(const Model& model, int64_t max_batch);

  // Adds a request whose state holds prompt[0, N−1); `next_token` = prompt[N−1] is fed by the next step.
  // FailedPrecondition when full, InvalidArgument on a duplicate id, bad params, or a state from another model.
  Status add(const std::string& request_id, RequestState state, int32_t next_token, const DecodeParams& params);

  // Removes a request (finished by the caller, e.g. a stop string, or aborted); false if unknown.
  bool remove(const std::string& request_id);

  // One forward pass over every active request. Requests that finish leave the batch.
  // On an engine error no request has advanced.
  Result<std::vector<DecodeStepOutput>> step();

  int64_t active() const { return static_cast<int64_t>(requests_.size()); }
  int64_t free_slots() const { return max_batch_ - active(); }
  int64_t max_batch() const { return max_batch_; }
  bool contains(const std::string& request_id) const { return requests_.count(request_id) != 0; }
  // Bytes held by the active requests' states (KDA state + MLA cache).
  int64_t state_bytes() const;

 private:
  struct Active {
    RequestState state;
    int32_t next_token;
    DecodeParams params;
    Sampler sampler;
    int64_t generated = 0;
    uint64_t order;  // admission order: batches are assembled in this order (deterministic)
  };
  const Model& model_;
  int64_t max_batch_;
  uint64_t next_order_ = 0;
  std::unordered_map<std::string, Active> requests_;
};

}  // namespace deltaserve::engine
