// What the router actor reports as it works, for metrics: an interface free of CAF and Prometheus, so
// the CLI can implement it with telemetry::Metrics and tests with a recorder. Calls come from the router
// actor's thread (one at a time); implementations must be quick and must not block.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace deltaserve::actors {

struct RouterWorkerLoad {
  std::string name;
  std::string role;  // "prefill" | "decode"
  int64_t load = 0;  // requests active + queued, from its latest report
  int64_t free_slots = 0;
};

class RouterObserver {
 public:
  virtual ~RouterObserver() = default;
  // A queued request was dispatched `seconds` after it arrived at the HTTP front.
  virtual void queue_time(double /*seconds*/) {}
  // A placement looked the prompt's `query_tokens` up in the index; the chosen worker's usable hit.
  virtual void prefix_lookup(std::string_view /*cache_namespace*/, int64_t /*query_tokens*/, int64_t /*hit_tokens*/) {}
  // One batch of cache events written to the prefix index.
  virtual void index_write(double /*seconds*/) {}
  // A handoff's bytes and the prefill worker's time to encode and send it; !ok: it failed.
  virtual void handoff(int64_t /*bytes*/, double /*seconds*/, bool /*ok*/) {}
  // The workers as the router sees them, after every registry update.
  virtual void workers(const std::vector<RouterWorkerLoad>& /*workers*/) {}
};

}  // namespace deltaserve::actors
