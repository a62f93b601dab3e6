// The OpenAI-compatible HTTP/1.1 front: Boost.Beast on an Asio thread pool, one strand per connection.
//
// Endpoints:
//   POST /v1/completions, POST /v1/chat/completions   stream (SSE, chunked) and not (application/json)
//   GET  /v1/models                                   the one served model
//   GET  /health                                      200 while the process runs (no auth)
//   GET  /ready                                       200 when service.status().ready and not draining, else 503 (no
//   auth)
//   GET  /metrics                                     Prometheus text format 0.0.4, when config.metrics is set and
//                                                     config.metrics_endpoint is true. With API keys on it needs a
//                                                     valid key (401 otherwise): its per-namespace series name
//                                                     tenants and their traffic. Scrapers without a key use the
//                                                     separate listener (telemetry::MetricsListener).
// Unknown path 404, wrong method 405 (+ Allow). Errors are OpenAI error objects (errors.hpp).
//
// Limits (HttpServerConfig): a body over max_body_bytes is answered 413 from its Content-Length before any
// of it is read (or as soon as a chunked body passes the limit); headers over max_header_bytes 431; a
// header not complete within header_timeout (slowloris) closes the connection; a keep-alive connection
// idle for idle_timeout is closed; a response write not done within write_timeout (slow reader) closes
// the connection and cancels the request's choices. Every failure of input is a 4xx decided before any
// model work; 503 + Retry-After: 1 when the service is full (kResourceExhausted) or the server drains.
// Prompt text over max_prompt_bytes is 400 context_length_exceeded before it is tokenized; tokenization
// runs on its own pool (tokenize_threads), never on the Asio threads.
//
// Admission (admission.hpp): after the prompt is tokenized, the tenant's limits from the keys file are
// checked; over one: 429 rate_limit_exceeded + Retry-After, and nothing reaches the service. An admitted
// request holds its place until the final chunk of every choice (or its failure / the client leaving) and
// is then charged prompt + generated tokens; its choices carry the tenant's priority.
//
// Streaming: the response head is sent with the first chunk, so a service failure before any token
// (e.g. queue full) is a real HTTP error; later failures are one SSE error event and the connection is
// closed. A client that goes away (socket closed while waiting for tokens, or a failed write) cancels
// every choice of its request (InferenceService::cancel). Chunks from the service (any thread) are queued
// per request and handed to the connection's strand; the queue is unbounded but fills only at model speed.
//
// Thread safety: start/begin_drain/wait_idle/stop/in_flight may be called from any thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/status.hpp"
#include "router/admission.hpp"
#include "router/api_keys.hpp"
#include "router/inference_service.hpp"
#include "router/openai_response.hpp"
#include "tokenizer/tiktoken_tokenizer.hpp"

namespace deltaserve::telemetry {
class Metrics;
}

namespace deltaserve::router {

struct HttpServerConfig {
  std::string host = "127.0.0.1";
  uint16_t port = 8000;                             // 0 = an ephemeral port (start() returns it)
  size_t max_body_bytes = 32u << 20;                // 413 above this, decided before reading the body
  size_t max_header_bytes = 16u << 10;              // 431 above this
  std::chrono::milliseconds header_timeout{10000};  // the request line + headers must arrive within this
  std::chrono::milliseconds idle_timeout{60000};    // keep-alive idle, and the whole-body read deadline
  std::chrono::milliseconds write_timeout{30000};   // one response write (header or SSE chunk)
  int threads = 2;                                  // Asio threads (>= 1)
  // Open client connections at most; one more is answered 503 + Retry-After and closed at once, so a flood
  // of idle connections cannot take every file descriptor of the process.
  size_t max_connections = 4096;
  // Prompt text (chat: every message's role, name and content; completions: the prompt string) over this
  // many bytes is answered 400 context_length_exceeded before it is tokenized. 0 = 16 bytes per token of
  // the model's context (tokenizers average 3-5 bytes per token of ordinary text, so such a prompt that fits
  // the context is not refused by this bound).
  size_t max_prompt_bytes = 0;
  // Prompts are tokenized on a pool of this many threads (>= 1), never on the Asio threads, so a long
  // tokenization does not stall other connections (/health, streams).
  int tokenize_threads = 2;
  // Tests only: runs on the tokenizer pool before each prompt is tokenized (e.g. to hold a tokenization).
  std::function<void()> before_tokenize;
  // Metrics of every request this server sees (responses by route and status, TTFT, inter-token and e2e
  // latency, tokens, finish reasons, cached tokens by namespace); service status is read at each scrape.
  // Null: nothing is measured and /metrics is 404. metrics_endpoint false: measured, but served only by a
  // separate listener (telemetry::MetricsListener), not on this port.
  std::shared_ptr<telemetry::Metrics> metrics;
  bool metrics_endpoint = true;
  // The clock of the per-tenant admission limits (the keys file's "limits", admission.hpp); empty =
  // steady_clock. Tests set a fake one.
  AdmissionClock admission_clock;
};

class HttpServer {
 public:
  // `tokenizer` and `service` must outlive the server. `eos_token_ids` travel in every
  // GenerationRequest::stop_token_ids.
  HttpServer(HttpServerConfig config, const tokenizer::Tokenizer& tokenizer, ModelInfo model,
             std::vector<int32_t> eos_token_ids, InferenceService& service, ApiKeys keys);
  ~HttpServer();  // stops
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Accept errors seen so far (a full file table: EMFILE, ENFILE). After one, accepting waits 50 ms, doubling
  // to 1 s while they go on, and logs at most one line per second.
  uint64_t accept_errors() const;

  // Binds and listens; returns the bound port. IoError naming host:port when binding fails.
  // Call once.
  Result<uint16_t> start();

  // /ready → 503 at once; new generation requests → 503; in-flight requests continue. Not undone.
  void begin_drain();

  // True when no request is in flight (waits up to `timeout`).
  bool wait_idle(std::chrono::milliseconds timeout);

  // The drain timeout passed: every generation still in flight ends now, its choices cancelled at the
  // service. A stream gets an SSE error event (the OpenAI error object, kUnavailable) then `data: [DONE]`;
  // a request whose response has not started gets 503 + Retry-After. Waits up to `grace` for those
  // answers to be written. Returns how many requests were cut, plus any still not done after `grace`
  // (0: nothing was dropped).
  // Call after begin_drain(); then stop().
  int64_t cut_in_flight(std::chrono::milliseconds grace);

  // Closes the listener and every connection (their requests are cancelled), joins the threads. Idempotent.
  void stop();

  // Requests whose head has been read and whose response is not finished.
  int64_t in_flight() const;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace deltaserve::router
