#include "actors/tls_tunnel.hpp"

#include <array>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include <boost/asio/connect.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/write.hpp>
#include <openssl/ssl.h>

namespace deltaserve::actors {
namespace {

namespace asio = boost::asio;
namespace ssl = asio::ssl;
using tcp = asio::ip::tcp;
using boost::system::error_code;

// Bytes read per direction before they are written on (BASP frames are mostly small; request states with
// --transport caf are megabytes and stream through in pieces of this size).
constexpr size_t kSpliceBuffer = 64 << 10;

// After a failed accept (e.g. out of file descriptors), wait this long before accepting again instead of
// spinning on the error.
constexpr std::chrono::milliseconds kAcceptRetry{100};

// Forward-secret AEAD suites of TLS 1.2 with an authenticated (certificate) key exchange; TLS 1.3 suites
// are all of that kind and keep OpenSSL's defaults.
constexpr const char* kTls12Ciphers = "ECDHE+AESGCM:ECDHE+CHACHA20:!aNULL:!eNULL";

std::string endpoint_text(const std::string& host, uint16_t port) {
  return (host.find(':') != std::string::npos ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

// Mutual TLS, 1.2 or newer, with the cluster's files. `server`: the router's end (requires a client
// certificate); else a worker's (verifies the server's certificate against ca.crt, no host name check: see the
// header).
Status configure(ssl::context& context, const ClusterTlsFiles& files, bool server) {
  error_code ec;
  context.set_options(ssl::context::default_workarounds | ssl::context::no_sslv2 | ssl::context::no_sslv3 |
                          ssl::context::no_tlsv1 | ssl::context::no_tlsv1_1 | ssl::context::no_compression,
                      ec);
  if (!ec && (SSL_CTX_set_min_proto_version(context.native_handle(), TLS1_2_VERSION) != 1 ||
              SSL_CTX_set_cipher_list(context.native_handle(), kTls12Ciphers) != 1)) {
    return internal_error("cluster TLS: OpenSSL refused the protocol or cipher settings");
  }
  if (ec) return internal_error("cluster TLS: OpenSSL options: " + ec.message());
  // Never ask a terminal for a passphrase: load_cluster_tls_dir refuses encrypted keys already.
  context.set_password_callback([](size_t, ssl::context::password_purpose) { return std::string(); }, ec);
  if (context.load_verify_file(files.ca.string(), ec); ec) {
    return invalid_argument("cluster TLS: " + files.ca.string() + ": " + ec.message());
  }
  if (context.use_certificate_chain_file(files.certificate.string(), ec); ec) {
    return invalid_argument("cluster TLS: " + files.certificate.string() + ": " + ec.message());
  }
  if (context.use_private_key_file(files.key.string(), ssl::context::pem, ec); ec) {
    return invalid_argument("cluster TLS: " + files.key.string() + ": " + ec.message());
  }
  context.set_verify_mode(ssl::verify_peer | (server ? ssl::verify_fail_if_no_peer_cert : 0), ec);
  if (ec) return internal_error("cluster TLS: verify mode: " + ec.message());
  return Status::ok();
}

}  // namespace

class TlsSplice;

struct TlsTunnel::Impl {
  // Declared first, destroyed last: the streams of pending handlers (destroyed with io) use it.
  ssl::context tls{ssl::context::tls};
  asio::io_context io{1};
  asio::executor_work_guard<asio::io_context::executor_type> work{io.get_executor()};
  tcp::acceptor acceptor{io};
  asio::steady_timer accept_retry{io};
  bool server = false;
  std::string remote_host;                     // connect(): the router
  uint16_t remote_port = 0;                    // connect(): the router's cluster port; serve(): CAF's loopback port
  uint16_t port = 0;                           // the listener's bound port
  std::vector<std::weak_ptr<TlsSplice>> live;  // io thread only; closed by stop()
  std::thread thread;

  mutable std::mutex error_mutex;
  std::string last_error;  // guarded by error_mutex

  void record_error(std::string why) {
    std::lock_guard<std::mutex> lock(error_mutex);
    last_error = std::move(why);
  }
  void accept();
};

// One tunnelled connection: the TLS side (to the other process) and the plain side (to the local CAF), bytes
// copied both ways until either side closes or fails, which closes both. Lives on the tunnel's thread, owned by
// its pending handlers.
class TlsSplice : public std::enable_shared_from_this<TlsSplice> {
 public:
  TlsSplice(TlsTunnel::Impl& tunnel, tcp::socket tls_side, tcp::socket plain_side)
      : tunnel_(tunnel),
        tls_(std::move(tls_side), tunnel.tls),
        plain_(std::move(plain_side)),
        deadline_(tunnel.io),
        resolver_(tunnel.io) {}

  // Router: TLS handshake on the accepted socket, then a plain connection to CAF's loopback port.
  void start_server() {
    arm_deadline("TLS handshake with a client");
    tls_.async_handshake(ssl::stream_base::server, [self = shared_from_this()](const error_code& ec) {
      if (self->closed_) return;
      if (ec) return self->fail("TLS handshake with a client: " + ec.message());
      const tcp::endpoint caf(asio::ip::address_v4::loopback(), self->tunnel_.remote_port);
      self->plain_.async_connect(caf, [self](const error_code& ec) {
        if (self->closed_) return;
        if (ec)
          return self->fail("connect to CAF at 127.0.0.1:" + std::to_string(self->tunnel_.remote_port) + ": " +
                            ec.message());
        self->established();
      });
    });
  }

  // Worker: resolve and connect to the router, then the TLS handshake; the accepted local socket waits.
  void start_client() {
    const std::string where = endpoint_text(tunnel_.remote_host, tunnel_.remote_port);
    arm_deadline("connect and TLS handshake with " + where);
    resolver_.async_resolve(
        tunnel_.remote_host, std::to_string(tunnel_.remote_port),
        [self = shared_from_this(), where](const error_code& ec, const tcp::resolver::results_type& found) {
          if (self->closed_) return;
          if (ec) return self->fail("resolve " + where + ": " + ec.message());
          asio::async_connect(
              self->tls_.lowest_layer(), found, [self, where](const error_code& ec, const tcp::endpoint&) {
                if (self->closed_) return;
                if (ec) return self->fail("connect to " + where + ": " + ec.message());
                self->tls_.async_handshake(ssl::stream_base::client, [self, where](const error_code& ec) {
                  if (self->closed_) return;
                  if (ec) return self->fail("TLS handshake with " + where + ": " + ec.message());
                  self->established();
                });
              });
        });
  }

  // Idempotent; cancels every pending operation (their handlers see closed_ and stop).
  void close() {
    if (closed_) return;
    closed_ = true;
    error_code ignored;
    deadline_.cancel();
    resolver_.cancel();
    tls_.lowest_layer().close(ignored);
    plain_.close(ignored);
  }

 private:
  void arm_deadline(std::string what) {
    deadline_.expires_after(TlsTunnel::kHandshakeTimeout);
    deadline_.async_wait([self = shared_from_this(), what = std::move(what)](const error_code& ec) {
      if (ec || self->closed_ || self->established_) return;
      self->fail(what + ": no answer within " + std::to_string(TlsTunnel::kHandshakeTimeout.count()) + " s");
    });
  }

  void fail(std::string why) {
    tunnel_.record_error(std::move(why));
    close();
  }

  void established() {
    established_ = true;
    deadline_.cancel();
    error_code ignored;
    tls_.lowest_layer().set_option(tcp::no_delay(true), ignored);
    tls_.lowest_layer().set_option(asio::socket_base::keep_alive(true), ignored);
    plain_.set_option(tcp::no_delay(true), ignored);
    pump(plain_, tls_, to_tls_);
    pump(tls_, plain_, to_plain_);
  }

  // Copies what `from` delivers to `to`, one read and then one complete write at a time, until an error or
  // end of stream on either (both directions then close). One read and one write may be pending on the TLS
  // stream at once (one per direction), which Asio's SSL stream allows on a single thread.
  template <class From, class To>
  void pump(From& from, To& to, std::array<char, kSpliceBuffer>& buffer) {
    from.async_read_some(asio::buffer(buffer), [self = shared_from_this(), &from, &to, &buffer](const error_code& ec,
                                                                                                size_t n) {
      if (self->closed_) return;
      if (ec) return self->close();  // end of stream or a failure: the tunnelled connection ends
      asio::async_write(to, asio::buffer(buffer.data(), n), [self, &from, &to, &buffer](const error_code& ec, size_t) {
        if (self->closed_) return;
        if (ec) return self->close();
        self->pump(from, to, buffer);
      });
    });
  }

  TlsTunnel::Impl& tunnel_;
  ssl::stream<tcp::socket> tls_;
  tcp::socket plain_;
  asio::steady_timer deadline_;  // bounds connect + handshake; cancelled once established
  tcp::resolver resolver_;       // client only
  bool closed_ = false;
  bool established_ = false;
  std::array<char, kSpliceBuffer> to_tls_{};    // plain -> TLS
  std::array<char, kSpliceBuffer> to_plain_{};  // TLS -> plain
};

void TlsTunnel::Impl::accept() {
  acceptor.async_accept([this](const error_code& ec, tcp::socket socket) {
    if (ec == asio::error::operation_aborted || !acceptor.is_open()) return;  // stop()
    if (ec) {
      record_error("accept on port " + std::to_string(port) + ": " + ec.message());
      accept_retry.expires_after(kAcceptRetry);
      accept_retry.async_wait([this](const error_code& ec) {
        if (!ec) accept();
      });
      return;
    }
    std::erase_if(live, [](const std::weak_ptr<TlsSplice>& s) { return s.expired(); });
    std::shared_ptr<TlsSplice> splice;
    if (server) {
      splice = std::make_shared<TlsSplice>(*this, std::move(socket), tcp::socket(io));
      splice->start_server();
    } else {
      splice = std::make_shared<TlsSplice>(*this, tcp::socket(io), std::move(socket));
      splice->start_client();
    }
    live.push_back(splice);
    accept();
  });
}

namespace {

// Binds impl.acceptor to host:port and starts accepting on the tunnel's thread.
Status listen(TlsTunnel::Impl& impl, const std::string& host, uint16_t port) {
  const std::string where = endpoint_text(host, port);
  error_code ec;
  tcp::resolver resolver(impl.io);
  const auto found = resolver.resolve(host, std::to_string(port), tcp::resolver::passive, ec);
  if (ec || found.empty()) {
    return Status(StatusCode::kUnavailable, "cannot listen on " + where + ": " + (ec ? ec.message() : "no address"));
  }
  const tcp::endpoint endpoint = found.begin()->endpoint();
  impl.acceptor.open(endpoint.protocol(), ec);
  if (!ec) impl.acceptor.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec) impl.acceptor.bind(endpoint, ec);
  if (!ec) impl.acceptor.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) return Status(StatusCode::kUnavailable, "cannot listen on " + where + ": " + ec.message());
  impl.port = impl.acceptor.local_endpoint().port();
  impl.accept();
  impl.thread = std::thread([&impl] { impl.io.run(); });
  return Status::ok();
}

}  // namespace

Result<std::unique_ptr<TlsTunnel>> TlsTunnel::serve(const ClusterTlsFiles& files, const std::string& host,
                                                    uint16_t port, uint16_t loopback_port) {
  auto impl = std::make_unique<Impl>();
  if (Status s = configure(impl->tls, files, true); !s.is_ok()) return s;
  impl->server = true;
  impl->remote_port = loopback_port;
  if (Status s = listen(*impl, host, port); !s.is_ok()) return s;
  return std::unique_ptr<TlsTunnel>(new TlsTunnel(std::move(impl)));
}

Result<std::unique_ptr<TlsTunnel>> TlsTunnel::connect(const ClusterTlsFiles& files, const std::string& host,
                                                      uint16_t port) {
  auto impl = std::make_unique<Impl>();
  if (Status s = configure(impl->tls, files, false); !s.is_ok()) return s;
  impl->remote_host = host;
  impl->remote_port = port;
  if (Status s = listen(*impl, "127.0.0.1", 0); !s.is_ok()) return s;
  return std::unique_ptr<TlsTunnel>(new TlsTunnel(std::move(impl)));
}

TlsTunnel::TlsTunnel(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

TlsTunnel::~TlsTunnel() {
  stop();
}

uint16_t TlsTunnel::port() const {
  return impl_->port;
}

std::string TlsTunnel::last_error() const {
  std::lock_guard<std::mutex> lock(impl_->error_mutex);
  return impl_->last_error;
}

void TlsTunnel::stop() {
  Impl& impl = *impl_;
  if (!impl.thread.joinable()) return;
  // On the tunnel's thread (the only one that touches sockets): close everything, then end run(). Handlers
  // still queued are destroyed uncalled with the io_context, releasing their splices.
  asio::post(impl.io, [&impl] {
    error_code ignored;
    impl.acceptor.close(ignored);
    impl.accept_retry.cancel();
    for (const std::weak_ptr<TlsSplice>& s : impl.live) {
      if (auto splice = s.lock()) splice->close();
    }
    impl.live.clear();
    impl.io.stop();
  });
  impl.thread.join();
}

}  // namespace deltaserve::actors
