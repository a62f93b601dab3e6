// The cluster port's mutual TLS as a byte tunnel in front of CAF's plain BASP (Boost.Asio SSL, OpenSSL).
//
//   worker process                                         router process
//   CAF remote_actor ─plain─► client tunnel ══mutual TLS══► server tunnel ─plain─► CAF publish
//                             127.0.0.1:ephemeral           cluster host:port      127.0.0.1:ephemeral
//
// Why a tunnel and not CAF's own OpenSSL module (caf::openssl, 0.17.6): with that module, once one TLS peer of
// the router disconnects (a worker leaving or restarting, a refused worker, a port probe), the router's other
// TLS connections stop carrying messages and the cluster stops serving, while plain BASP survives the same
// churn. CAF cannot be patched here, so CAF only ever speaks plain BASP over loopback and TLS lives in this
// tunnel: one TLS connection per CAF connection, each independent, its failure closing only itself.
//
// Both ends require a certificate that chains to ca.crt (mutual TLS, TLS 1.2 or newer, no anonymous or null
// ciphers). The client does not check the router's host name: every member of a cluster holds a certificate of
// the same CA (often one certificate for all pods) and is trusted alike, so a name check would stop no member
// from posing as the router while it would tie the certificate to one Service name.
//
// Loopback trust: the plain ends (CAF's port on the router, the client tunnel's port on a worker) accept any
// process of the same host (in Kubernetes: of the same pod's network namespace); such a process is as trusted
// as the one that holds the key file.
//
// Each tunnel owns one thread and one io_context; every socket and timer lives on that thread. Free of CAF and
// Asio types (pimpl), so headers above stay light.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "actors/cluster_tls.hpp"
#include "common/status.hpp"

namespace deltaserve::actors {

class TlsTunnel {
 public:
  // A connection whose TCP connect and TLS handshake take longer is closed: an idle probe or a plain client
  // of the TLS port cannot hold a socket and its buffers for long.
  static constexpr std::chrono::seconds kHandshakeTimeout{10};

  // Router side: listens on host:port (0 = ephemeral; see port()) for mutual-TLS clients and splices each
  // authenticated connection to a fresh plain connection to 127.0.0.1:loopback_port (CAF's published port).
  // Errors: a bad certificate/key for OpenSSL (InvalidArgument, naming the file), host:port not bindable
  // (Unavailable).
  static Result<std::unique_ptr<TlsTunnel>> serve(const ClusterTlsFiles& files, const std::string& host, uint16_t port,
                                                  uint16_t loopback_port);

  // Worker side: listens on 127.0.0.1:ephemeral (see port()) and tunnels each accepted plain connection
  // through a new mutual-TLS connection to host:port. When that connection cannot be made (unreachable,
  // refused certificate, handshake timeout) the local connection is closed, so the local client (CAF) sees a
  // disconnect, and last_error() says why.
  static Result<std::unique_ptr<TlsTunnel>> connect(const ClusterTlsFiles& files, const std::string& host,
                                                    uint16_t port);

  ~TlsTunnel();  // stop()
  TlsTunnel(const TlsTunnel&) = delete;
  TlsTunnel& operator=(const TlsTunnel&) = delete;

  // The listening port: the cluster port (serve) or the local plain port (connect).
  uint16_t port() const;

  // Why the most recent tunnelled connection failed to open ("" while none failed): the resolve, connect or
  // handshake error with the peer address. Thread-safe.
  std::string last_error() const;

  // Closes the listener and every connection (both ends of each splice) and joins the thread. Idempotent;
  // not from the tunnel's own thread.
  void stop();

  struct Impl;

 private:
  explicit TlsTunnel(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace deltaserve::actors
