// A separate metrics listener (a small Boost.Beast server on its own thread) serving one Metrics at /metrics.
// For processes with no HTTP front (`deltaserve prefill` / `decode`), and for a router whose /metrics
// must not share the API port. Scrapes run the Metrics' collect hooks first. With a health check it also
// serves GET /health: 200 "ok" while the check passes, 503 with the check's message otherwise (a liveness
// probe: the orchestrator restarts the process).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "common/status.hpp"
#include "telemetry/metrics.hpp"

namespace deltaserve::telemetry {

class MetricsListener {
 public:
  // Runs on the listener's thread, one request at a time; must return within the probe's timeout.
  using HealthCheck = std::function<Status()>;

  // `address` is HOST:PORT (port 0 = ephemeral; see port()). InvalidArgument for a malformed address,
  // Unavailable when the port cannot be bound. The listener keeps `metrics` alive. `health` empty: /health
  // is not served (404), as any path but /metrics.
  static Result<std::unique_ptr<MetricsListener>> start(const std::string& address, std::shared_ptr<Metrics> metrics,
                                                        HealthCheck health = {});
  ~MetricsListener();  // stops serving (waits for a scrape in progress)
  MetricsListener(const MetricsListener&) = delete;
  MetricsListener& operator=(const MetricsListener&) = delete;

  uint16_t port() const { return port_; }

 private:
  MetricsListener() = default;
  std::shared_ptr<Metrics> metrics_;
  struct Server;
  std::unique_ptr<Server> server_;
  uint16_t port_ = 0;
};

}  // namespace deltaserve::telemetry
