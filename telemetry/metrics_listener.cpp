#include "telemetry/metrics_listener.hpp"

#include <exception>

#include <prometheus/exposer.h>

namespace deltaserve::telemetry {

Result<std::unique_ptr<MetricsListener>> MetricsListener::start(const std::string& address,
                                                                std::shared_ptr<Metrics> metrics) {
  const auto colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == address.size() ||
      address.find_first_not_of("0123456789", colon + 1) != std::string::npos || address.size() - colon > 6) {
    return invalid_argument("metrics listen address must be HOST:PORT, got '" + address + "'");
  }
  std::unique_ptr<MetricsListener> listener(new MetricsListener());
  listener->metrics_ = std::move(metrics);
  try {
    // civetweb: one listening thread + one worker is plenty for a scrape every few seconds.
    listener->exposer_ = std::make_unique<prometheus::Exposer>(address, /*num_threads=*/1);
  } catch (const std::exception& e) {  // CivetException: the port is taken or the host is not local
    return Status(StatusCode::kUnavailable, "metrics listener on " + address + ": " + e.what());
  }
  listener->exposer_->RegisterCollectable(listener->metrics_->collectable());
  const std::vector<int> ports = listener->exposer_->GetListeningPorts();
  if (ports.empty()) return Status(StatusCode::kUnavailable, "metrics listener on " + address + ": no port bound");
  listener->port_ = static_cast<uint16_t>(ports.front());
  return listener;
}

MetricsListener::~MetricsListener() = default;

}  // namespace deltaserve::telemetry
