// Direct connections from prefill worker nodes to decode worker nodes, so that the prefill -> decode handoff
// (handoff / handoff_ucx, and the reserve request of the UCX transport) never passes through a router.
//
// Why: the router hands a prefill node the handle of a decode worker of another node. CAF 0.17's BASP then
// routes to that node through the router (basp_broker::make_proxy: "if a remote node A sends us a handle to a
// third node B, then we assume that A offers a route to B"), and only while it makes a new proxy. When the
// router dies, routing_table::lookup drops the dead hop and finds no route, and the message is dropped; a later
// router handing over the same handle adds no hop, since the proxy already exists. A direct connection is what
// routing_table::lookup always prefers, and it depends on no router. (CAF's own automatic connections,
// middleman.enable-automatic-connections, fire once per node, advertise every interface address with a plain
// BASP port bound to all of them, and know nothing of the TLS tunnel: not usable here.)
//
//   decode node:  publishes its decode worker on its peer address (with cluster TLS: on 127.0.0.1:ephemeral,
//                 behind a TLS tunnel listening on the peer address, as a router's cluster port) and announces
//                 that address in its WorkerInfo (peer_host, peer_port).
//   router:       copies it into every PrefillJob (decode_host, decode_port).
//   prefill node: before each handoff asks CAF's middleman to connect to that address (through a TLS tunnel of
//                 its own when the cluster uses TLS, made on first use and kept). The middleman answers from
//                 its cache while the connection is up (a round trip to a local actor) and connects again once it
//                 closed; the handoff then goes over that connection.
//
// Lifetime: made before the actor system's actors use it; stop() after the actor system is gone (CAF's
// connections run through the tunnels).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

#include "actors/cluster_tls.hpp"
#include "actors/tls_tunnel.hpp"
#include "common/status.hpp"

namespace deltaserve::actors {

class DecodePeers {
 public:
  explicit DecodePeers(std::optional<ClusterTlsFiles> tls) : tls_(std::move(tls)) {}
  ~DecodePeers() { stop(); }
  DecodePeers(const DecodePeers&) = delete;
  DecodePeers& operator=(const DecodePeers&) = delete;

  // Where CAF connects to reach the decode node announced at host:port: that address itself, or (cluster TLS)
  // this process's end of a tunnel to it. Thread-safe. Errors: the tunnel cannot be made (its listener), or
  // stop() was called (Unavailable).
  Result<std::pair<std::string, uint16_t>> caf_endpoint(const std::string& host, uint16_t port);

  // Why the tunnel to host:port last failed to connect ("" without TLS, or while none failed).
  std::string transport_error(const std::string& host, uint16_t port) const;

  // Closes every tunnel. Idempotent.
  void stop();

 private:
  std::optional<ClusterTlsFiles> tls_;
  mutable std::mutex mutex_;
  std::map<std::pair<std::string, uint16_t>, std::unique_ptr<TlsTunnel>> tunnels_;
  bool stopped_ = false;
};

}  // namespace deltaserve::actors
