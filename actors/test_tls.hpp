// Test helper: cluster TLS directories (the Kubernetes TLS Secret layout of actors/cluster_tls.hpp) made with
// the `openssl` CLI in a temp dir: a CA and a certificate/key it signed (EC P-256, valid 2 days, usable as
// server and client, SAN localhost/127.0.0.1), and a second, unrelated CA with its own certificate/key (the
// wrong secret).
#pragma once

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "common/temp_dir.hpp"

namespace deltaserve::actors::testing {

class TestClusterTls {
 public:
  TestClusterTls() : root_("ds_cluster_tls") {
    {
      std::ofstream cnf(root_.path() / "openssl.cnf");
      cnf << "[req]\ndistinguished_name = dn\nprompt = no\n[dn]\nCN = deltaserve-test\n"
             "[v3_ca]\nbasicConstraints = critical, CA:TRUE\nkeyUsage = critical, keyCertSign, cRLSign\n"
             "subjectKeyIdentifier = hash\n"
             "[v3_leaf]\nbasicConstraints = CA:FALSE\nkeyUsage = critical, digitalSignature, keyEncipherment\n"
             "extendedKeyUsage = serverAuth, clientAuth\nsubjectAltName = DNS:localhost, IP:127.0.0.1\n";
    }
    ok_ = make("right") && make("wrong");
  }

  bool ok() const { return ok_; }  // false when the openssl CLI failed (see the test's stderr)
  std::filesystem::path right() const { return root_.path() / "right"; }  // ca.crt, tls.crt, tls.key
  std::filesystem::path wrong() const { return root_.path() / "wrong"; }  // another CA's ca.crt, tls.crt, tls.key
  const std::filesystem::path& root() const { return root_.path(); }

 private:
  bool make(const std::string& name) {
    const std::filesystem::path dir = root_.path() / name;
    std::filesystem::create_directories(dir);
    const std::string cnf = (root_.path() / "openssl.cnf").string();
    const std::string d = dir.string();
    const std::string ec = " -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
    const std::string script = "set -e; openssl req -x509 -config " + cnf + " -extensions v3_ca" + ec + " -keyout " +
                               d + "/ca.key -out " + d + "/ca.crt -days 2 -subj /CN=test-ca-" + name +
                               " && openssl req -new -config " + cnf + ec + " -keyout " + d + "/tls.key -out " + d +
                               "/tls.csr -subj /CN=test-node-" + name + " && openssl x509 -req -in " + d +
                               "/tls.csr -CA " + d + "/ca.crt -CAkey " + d + "/ca.key -CAcreateserial -out " + d +
                               "/tls.crt -days 2" + " -extfile " + cnf + " -extensions v3_leaf";
    return std::system(("sh -c '" + script + "' >/dev/null").c_str()) == 0;
  }

  TempDir root_;
  bool ok_ = false;
};

}  // namespace deltaserve::actors::testing
