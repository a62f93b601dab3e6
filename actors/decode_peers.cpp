#include "actors/decode_peers.hpp"

namespace deltaserve::actors {

Result<std::pair<std::string, uint16_t>> DecodePeers::caf_endpoint(const std::string& host, uint16_t port) {
  std::lock_guard lock(mutex_);
  if (stopped_) return Status(StatusCode::kUnavailable, "stopped");
  if (!tls_) return std::make_pair(host, port);
  auto key = std::make_pair(host, port);
  auto it = tunnels_.find(key);
  if (it == tunnels_.end()) {
    auto tunnel = TlsTunnel::connect(*tls_, host, port);
    if (!tunnel.is_ok()) return tunnel.status().with_context("cluster TLS tunnel to " + host);
    it = tunnels_.emplace(key, std::move(tunnel).value()).first;
  }
  return std::make_pair(std::string("127.0.0.1"), it->second->port());
}

std::string DecodePeers::transport_error(const std::string& host, uint16_t port) const {
  std::lock_guard lock(mutex_);
  auto it = tunnels_.find(std::make_pair(host, port));
  return it == tunnels_.end() ? std::string() : it->second->last_error();
}

void DecodePeers::stop() {
  std::map<std::pair<std::string, uint16_t>, std::unique_ptr<TlsTunnel>> tunnels;
  {
    std::lock_guard lock(mutex_);
    stopped_ = true;
    tunnels.swap(tunnels_);
  }
  for (auto& [key, tunnel] : tunnels) tunnel->stop();
}

}  // namespace deltaserve::actors
