// Continuous batching for decode: requests join and leave between steps; one step runs one forward
// pass over every active request (one token each, assembled in admission order), samples with each
// request's own RNG stream and applies max_tokens, stop token ids and the context limit. Text-level work
// (detokenization, stop strings) is the caller's (tokenizer/text_stream.hpp), so the engine stays free
// of the tokenizer.
//
// Handoff rule ("N−1 prefill"): a prefill worker consumes prompt[0, N−1) into a RequestState and
// hands over that state plus the last prompt token; the first decode step feeds that token, so the
// KDA state advances over every prompt token exactly once and the first sampled token comes from
// the decode worker. `deltaserve generate` uses the same split, so both paths do the same math.
// A one-token prompt hands over an empty state (model.new_state()) and that token.
//
// Sampling: the step's pass is Model::forward_sample, given each request's params and the next draw of its
// Sampler, so a device backend samples where the logits are and only the tokens (and the logprobs asked for)
// come back (the CUDA backend: engine/cuda/cuda_backend.hpp); the CPU backend samples on the host with the same
// rule. Host sampling (the constructor's `host_sampling`) copies the logits back and applies the rule there with the
// same draws: identical results on the CPU; on a GPU, up to the kernel's one documented difference (top_p < 1 over
// more than 64 top-k candidates may pick another token of the same nucleus: kernels/cuda/ops/sampling.hpp).
//
// Determinism: a request's tokens depend only on its own state, tokens and params (seed included),
// not on which other requests share its steps: the forward pass treats sequences independently and
// each request owns its Sampler (one random draw per step). Batched and alone can differ only in
// the last bits of the logits (the dense kernels' tiling may differ with the batch's row count).
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
  SamplingParams sampling;              // must pass validate()
  bool logprobs = false;                // fill SampledToken.logprob/top in the step output
  int64_t max_tokens = 16;              // >= 1: tokens to generate, the stop token included
  std::vector<int32_t> stop_token_ids;  // each in [0, vocab); stop when one is sampled (it is reported,
                                        // finish "stop")
  // [0, max_tokens): tokens of this request generated before it joined, for a request resumed elsewhere after
  // losing its decode worker. Its state then holds prompt ++ those tokens but the last (the N−1 rule, with the last
  // generated token as `next_token`); its Sampler continues at draw `generated` (Sampler(params, draws_taken)), and
  // completion_tokens and max_tokens count the earlier tokens, so the stream goes on as if uninterrupted: bit for bit
  // when the state was built as decode builds it, prompt[0, N−1) prefilled and then one forward pass per token over
  // prompt[N−1] and the generated tokens but the last (a chunked prefill of those tokens agrees only up to the last
  // bits of the logits).
  int64_t generated = 0;
};

struct DecodeStepOutput {
  std::string request_id;
  SampledToken sampled;       // the new token; logprob/top are set only when params.logprobs (else 0 / empty)
  int64_t completion_tokens;  // generated so far, including this one (and DecodeParams::generated)
  bool finished = false;      // the request has left the batch (see finish_reason)
  std::string finish_reason;  // when finished: "stop" (a stop token was sampled) or "length" (max_tokens
                              // reached, or the context is full so the token cannot be fed back)
};

class DecodeBatcher {
 public:
  // `max_batch` (>= 1): requests decoding at once (state slots); `model` must outlive the batcher.
  // `host_sampling`: sample on the host from logits copied back (see the top) instead of in the pass.
  DecodeBatcher(const Model& model, int64_t max_batch, bool host_sampling = false);

  // Adds a request whose state holds prompt[0, N−1); `next_token` = prompt[N−1] is fed by the next step.
  // Errors (the batcher is unchanged): FailedPrecondition when full; InvalidArgument on a duplicate id,
  // bad params (sampling, max_tokens, stop ids), `next_token` outside the vocabulary, or a state whose
  // shapes are not this model's; OutOfRange when the state leaves no room in the context for `next_token`.
  Status add(const std::string& request_id, RequestState state, int32_t next_token, const DecodeParams& params);

  // Removes a request (finished by the caller, e.g. a stop string, or aborted) and frees its slot and
  // state; false if unknown (e.g. it already finished in a step).
  bool remove(const std::string& request_id);

  // One forward pass over every active request (none: no pass, empty output). The output holds one
  // entry per request that was active, in admission order; requests that finish leave the batch.
  // On an engine error nothing has changed (no state advanced, no sampler drew, nobody left).
  Result<std::vector<DecodeStepOutput>> step();

  int64_t active() const { return static_cast<int64_t>(requests_.size()); }
  int64_t free_slots() const { return max_batch_ - active(); }
  int64_t max_batch() const { return max_batch_; }
  bool host_sampling() const { return host_sampling_; }
  bool contains(const std::string& request_id) const { return requests_.count(request_id) != 0; }
  // Bytes held by the active requests' states (KDA state + MLA cache, as RequestState stores them).
  int64_t state_bytes() const;

 private:
  struct Active {
    RequestState state;
    int32_t next_token;  // fed by the next step: the last prompt token, then each sampled token
    DecodeParams params;
    Sampler sampler;
    int64_t generated = 0;
    uint64_t order;  // admission order: batches are assembled in this order (deterministic)
  };
  const Model& model_;
  int64_t max_batch_;
  bool host_sampling_;
  uint64_t next_order_ = 0;
  std::unordered_map<std::string, Active> requests_;
};

}  // namespace deltaserve::engine
