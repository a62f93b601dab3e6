// The request/response types the HTTP front (router/) and the engine share: what a request asks of the
// sampler and what it reports per token. Standard library only, so router/ includes this header and never
// the sampler itself (engine/sampler.hpp, which validates and applies these).
#pragma once

#include <cstdint>

namespace deltaserve::engine {

struct SamplingParams {
  float temperature = 1.0f;  // [0, 2]; 0 = greedy
  float top_p = 1.0f;        // (0, 1]; 1 = off
  int32_t top_k = 0;         // >= 0; 0 = off; larger than the vocabulary = off
  uint64_t seed = 0;         // used as is; the API layer picks one when the request has none
  int32_t top_logprobs = 0;  // alternatives to report, [0, 20]
};

struct TokenLogprob {
  int32_t token;
  float logprob;  // natural log
};

}  // namespace deltaserve::engine
