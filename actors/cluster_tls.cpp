#include "actors/cluster_tls.hpp"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>

#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509_vfy.h>

namespace deltaserve::actors {
namespace {

struct FileCloser {
  void operator()(FILE* f) const { std::fclose(f); }
};
struct X509Free {
  void operator()(X509* x) const { X509_free(x); }
};
struct KeyFree {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
struct StoreFree {
  void operator()(X509_STORE* s) const { X509_STORE_free(s); }
};
struct StoreContextFree {
  void operator()(X509_STORE_CTX* c) const { X509_STORE_CTX_free(c); }
};
using File = std::unique_ptr<FILE, FileCloser>;
using Certificate = std::unique_ptr<X509, X509Free>;
using Key = std::unique_ptr<EVP_PKEY, KeyFree>;

// The oldest queued OpenSSL error as text ("" when none); clears the queue.
std::string openssl_error() {
  const unsigned long code = ERR_get_error();
  ERR_clear_error();
  if (code == 0) return "";
  char text[256];
  ERR_error_string_n(code, text, sizeof(text));
  return text;
}

// A key that needs a passphrase is refused (CAF would prompt for none): the callback gives no passphrase.
int no_passphrase(char*, int, int, void*) {
  return 0;
}

Result<File> open_file(const std::filesystem::path& path, const std::string& option) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return not_found(option + ": " + path.string() + " does not exist");
  if (!std::filesystem::is_regular_file(path, ec))
    return invalid_argument(option + ": " + path.string() + " is not a regular file");
  File file(std::fopen(path.c_str(), "rb"));
  if (!file) return io_error(option + ": cannot read " + path.string() + ": " + std::strerror(errno));
  return file;
}

}  // namespace

Result<ClusterTlsFiles> load_cluster_tls_dir(const std::filesystem::path& dir, const std::string& option) {
  ERR_clear_error();
  ClusterTlsFiles files{dir / "ca.crt", dir / "tls.crt", dir / "tls.key"};
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec))
    return not_found(option + ": " + dir.string() + " is not a directory (expected ca.crt, tls.crt, tls.key in it)");

  // ca.crt: one or more certificates, all of which become trust anchors.
  std::unique_ptr<X509_STORE, StoreFree> store(X509_STORE_new());
  {
    auto file = open_file(files.ca, option);
    if (!file.is_ok()) return file.status();
    int count = 0;
    while (Certificate ca{PEM_read_X509(file->get(), nullptr, no_passphrase, nullptr)}) {
      X509_STORE_add_cert(store.get(), ca.get());
      ++count;
    }
    ERR_clear_error();  // the read that ends the loop leaves "no start line"
    if (count == 0) return invalid_argument(option + ": " + files.ca.string() + " holds no PEM certificate");
  }

  Certificate certificate;
  {
    auto file = open_file(files.certificate, option);
    if (!file.is_ok()) return file.status();
    certificate.reset(PEM_read_X509(file->get(), nullptr, no_passphrase, nullptr));
    if (!certificate) {
      return invalid_argument(option + ": " + files.certificate.string() + " is not a PEM certificate (" +
                              openssl_error() + ")");
    }
  }

  Key key;
  {
    auto file = open_file(files.key, option);
    if (!file.is_ok()) return file.status();
    key.reset(PEM_read_PrivateKey(file->get(), nullptr, no_passphrase, nullptr));
    if (!key) {
      return invalid_argument(option + ": " + files.key.string() + " is not an unencrypted PEM private key (" +
                              openssl_error() + ")");
    }
  }
  if (X509_check_private_key(certificate.get(), key.get()) != 1) {
    ERR_clear_error();
    return invalid_argument(option + ": " + files.key.string() + " is not the private key of " +
                            files.certificate.string());
  }

  // tls.crt must chain to ca.crt: the peers check exactly that, and would refuse every connection.
  std::unique_ptr<X509_STORE_CTX, StoreContextFree> context(X509_STORE_CTX_new());
  if (!context || X509_STORE_CTX_init(context.get(), store.get(), certificate.get(), nullptr) != 1) {
    return internal_error(option + ": cannot set up certificate verification: " + openssl_error());
  }
  if (X509_verify_cert(context.get()) != 1) {
    const int why = X509_STORE_CTX_get_error(context.get());
    ERR_clear_error();
    return invalid_argument(option + ": " + files.certificate.string() + " does not verify against " +
                            files.ca.string() + ": " + X509_verify_cert_error_string(why));
  }
  return files;
}

bool is_loopback_host(const std::string& host) {
  return host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0;
}

}  // namespace deltaserve::actors
