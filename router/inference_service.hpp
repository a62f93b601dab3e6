// The seam between the HTTP front (router/) and whatever generates tokens (the CAF cluster in
// actors/, in one process or many). The HTTP layer tokenizes, validates and authenticates; it hands
// the service one GenerationRequest per choice and receives GenerationChunks until one carries a
// finish_reason or an error. No CAF, Beast or JSON types cross this seam.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/status.hpp"
#include "engine/request_types.hpp"

namespace deltaserve::router {

// A tenant's priority class (API keys file, "limits.priority"). The router's waiting queue dispatches a
// higher class first and keeps arrival order within a class; it never preempts work already dispatched.
enum class Priority : int8_t { kLow = 0, kNormal = 1, kHigh = 2 };

struct GenerationRequest {
  std::string request_id;                 // unique per choice, e.g. "chatcmpl-<id>-<index>"; used by cancel()
  std::string tenant;                     // authenticated tenant; "default" without API keys
  std::string cache_namespace;            // prefix-cache namespace of the tenant (from auth, never the body)
  std::vector<int32_t> prompt;            // token ids, >= 1, already checked against the context limit
  engine::SamplingParams sampling;        // validated; seed fixed by the HTTP layer when the client gave none
  bool logprobs = false;                  // report the chosen token's logprob (+ sampling.top_logprobs alternatives)
  int64_t max_tokens = 16;                // >= 1 generated tokens at most
  std::vector<std::string> stop;          // stop strings (<= 4); matched on the detokenized text, excluded from it
  bool ignore_eos = false;                // do not stop at the model's end-of-sequence tokens
  std::vector<int32_t> stop_token_ids;    // end-of-sequence ids from the HTTP layer; empty = the service's own
  int64_t arrival_ns = 0;                 // steady-clock time the HTTP request was accepted (for queue/TTFT metrics)
  Priority priority = Priority::kNormal;  // the tenant's class: orders the router's waiting queue

  // The namespace the prefix cache roots this request's block hashes in (and the index files them under):
  // cache_namespace, or the tenant when it is empty. The router and the prefill worker both use this one rule.
  const std::string& prefix_cache_namespace() const { return cache_namespace.empty() ? tenant : cache_namespace; }
};

struct TokenLogprobs {
  int32_t token = 0;
  float logprob = 0.0f;
  std::vector<engine::TokenLogprob> top;  // sampling.top_logprobs alternatives, best first
};

// One step of a stream: zero or more new tokens and their text. Delivered in order; exactly one
// chunk per request is final (finish_reason set, or error non-OK), and nothing follows it.
struct GenerationChunk {
  std::string request_id;
  std::vector<int32_t> tokens;               // new token ids (stop-string tokens included; their text is not)
  std::string text;                          // new text: valid UTF-8, never splits a code point
  std::vector<TokenLogprobs> logprobs;       // one per token when requested
  std::optional<std::string> finish_reason;  // "stop" | "length" | "abort"
  Status error;                              // non-OK: the request failed (e.g. kResourceExhausted, kUnavailable)
  // Valid on the final chunk:
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;
  int64_t cached_tokens = 0;  // prompt tokens served from the prefix cache

  bool is_final() const { return finish_reason.has_value() || !error.is_ok(); }
};

// Receives one request's chunks. Called from service threads, one call at a time per request.
class GenerationSink {
 public:
  virtual ~GenerationSink() = default;
  virtual void on_chunk(GenerationChunk chunk) = 0;
};

struct ServiceStatus {
  bool ready = false;   // can serve (model loaded, >= 1 prefill and decode worker reachable)
  std::string reason;   // why not, when !ready
  int64_t running = 0;  // requests admitted and not finished
  int64_t waiting = 0;  // requests queued before prefill
  // Decode state slots over every live decode worker, from their latest load reports.
  int64_t decode_slots_total = 0;
  int64_t decode_slots_free = 0;
  int64_t worker_requests = 0;  // requests the workers report as active or queued
};

class InferenceService {
 public:
  virtual ~InferenceService() = default;

  // Admits the request or fails it at once through the sink (kResourceExhausted when the queue is
  // full → HTTP 503 with Retry-After). Never blocks on model work.
  virtual void submit(GenerationRequest request, std::shared_ptr<GenerationSink> sink) = 0;

  // The client went away: free every resource the request holds, wherever it is (queued,
  // prefilling, in transfer, decoding). The sink then receives a final chunk with finish_reason
  // "abort" (or nothing, if it already finished). Unknown ids are ignored.
  virtual void cancel(const std::string& request_id) = 0;

  virtual ServiceStatus status() const = 0;
};

}  // namespace deltaserve::router
