// Mutual TLS of the cluster port (the registry's listener and the workers' connections to it).
// The files come in the layout of a Kubernetes TLS Secret, which cert-manager and
// `kubectl create secret tls` (plus the CA) produce:
//   DIR/ca.crt    PEM, the CA(s) a peer's certificate must chain to
//   DIR/tls.crt   PEM, this process's certificate (chain), signed by a CA of ca.crt; used both as the
//                 server (router) and the client (worker) certificate, so its extended key usage, if any,
//                 must allow serverAuth and clientAuth
//   DIR/tls.key   PEM, the unencrypted private key of tls.crt
// Every process of a cluster uses certificates of the same CA; a peer without one is refused during the
// TLS handshake, before any actor message is read.
// Free of CAF types: the CLI includes this header.
#pragma once

#include <filesystem>
#include <string>

#include "common/status.hpp"

namespace deltaserve::actors {

struct ClusterTlsFiles {
  std::filesystem::path ca;           // DIR/ca.crt
  std::filesystem::path certificate;  // DIR/tls.crt
  std::filesystem::path key;          // DIR/tls.key
};

// Checks DIR at start, before anything listens or connects (the tunnel would otherwise fail per connection): each file
// exists, is readable and parses as PEM; ca.crt holds at least one certificate; tls.key is the key of tls.crt;
// tls.crt chains to ca.crt. Errors name the file and `option` (the flag or field the directory came from).
Result<ClusterTlsFiles> load_cluster_tls_dir(const std::filesystem::path& dir, const std::string& option);

// True for names and addresses that reach only this host: localhost, 127.0.0.0/8, ::1. Anything else
// (0.0.0.0 and :: included) may be reached from other hosts.
bool is_loopback_host(const std::string& host);

}  // namespace deltaserve::actors
