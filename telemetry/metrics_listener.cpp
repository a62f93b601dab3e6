#include "telemetry/metrics_listener.hpp"

// Asio's awaitable header needs <utility> first with Boost 1.74 + GCC 12 (stack notes); harmless here.
#include <exception>
#include <string_view>
#include <thread>
#include <utility>

#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <sys/socket.h>
#include <sys/time.h>

namespace deltaserve::telemetry {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;

// The serving thread: one connection at a time (a scrape every few seconds needs no more), each answered and
// closed. Its stack is the default one, so libraries with large static TLS blocks (cuBLASLt has 94 KiB) do not
// keep it from starting — the reason this is not civetweb, whose threads get a fixed 100 KiB stack.
struct MetricsListener::Server {
  asio::io_context io;
  tcp::acceptor acceptor{io};
  std::thread thread;

  void serve(const std::shared_ptr<Metrics>& metrics, const HealthCheck& health) {
    while (acceptor.is_open()) {
      beast::error_code error;
      tcp::socket socket(io);
      acceptor.accept(socket, error);
      if (error) {
        if (error == asio::error::operation_aborted || error == asio::error::bad_descriptor || !acceptor.is_open()) {
          return;
        }
        continue;
      }
      answer(socket, *metrics, health);
    }
  }

  static void answer(tcp::socket& socket, const Metrics& metrics, const HealthCheck& health) {
    beast::error_code error;
    // A scraper that connects and says nothing must not hold the listener: 5 s to send the request.
    socket.set_option(asio::socket_base::keep_alive(false), error);
    timeval timeout{5, 0};
    setsockopt(socket.native_handle(), SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
    setsockopt(socket.native_handle(), SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof timeout);
    beast::flat_buffer buffer;
    http::request_parser<http::empty_body> parser;
    parser.header_limit(16 * 1024);
    http::read(socket, buffer, parser, error);
    if (error) return;
    const auto& request = parser.get();
    http::response<http::string_body> response;
    response.version(request.version());
    response.keep_alive(false);
    const std::string_view target = request.target();
    const bool metrics_path = target == "/metrics" || target.starts_with("/metrics?");
    const bool health_path = health && (target == "/health" || target.starts_with("/health?"));
    if (health_path && request.method() != http::verb::get && request.method() != http::verb::head) {
      response.result(http::status::method_not_allowed);
      response.set(http::field::allow, "GET, HEAD");
    } else if (health_path) {
      const Status status = health();
      response.result(status.is_ok() ? http::status::ok : http::status::service_unavailable);
      response.set(http::field::content_type, "text/plain; charset=utf-8");
      if (request.method() == http::verb::get) response.body() = status.is_ok() ? "ok\n" : status.message() + "\n";
    } else if (!metrics_path) {
      response.result(http::status::not_found);
      response.set(http::field::content_type, "text/plain; charset=utf-8");
      response.body() = "not found: only /metrics is served here\n";
    } else if (request.method() != http::verb::get && request.method() != http::verb::head) {
      response.result(http::status::method_not_allowed);
      response.set(http::field::allow, "GET, HEAD");
    } else {
      response.result(http::status::ok);
      response.set(http::field::content_type, "text/plain; version=0.0.4; charset=utf-8");
      if (request.method() == http::verb::get) response.body() = metrics.serialize();
    }
    response.prepare_payload();
    http::write(socket, response, error);
    socket.shutdown(tcp::socket::shutdown_both, error);
  }
};

Result<std::unique_ptr<MetricsListener>> MetricsListener::start(const std::string& address,
                                                                std::shared_ptr<Metrics> metrics, HealthCheck health) {
  const auto colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == address.size() ||
      address.find_first_not_of("0123456789", colon + 1) != std::string::npos || address.size() - colon > 6) {
    return invalid_argument("metrics listen address must be HOST:PORT, got '" + address + "'");
  }
  const unsigned long port_number = std::stoul(address.substr(colon + 1));
  if (port_number > 65535) return invalid_argument("metrics listen port out of range in '" + address + "'");
  std::string host = address.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);

  std::unique_ptr<MetricsListener> listener(new MetricsListener());
  listener->metrics_ = std::move(metrics);
  listener->server_ = std::make_unique<Server>();
  Server& server = *listener->server_;
  beast::error_code error;
  tcp::resolver resolver(server.io);
  const auto endpoints = resolver.resolve(host, std::to_string(port_number), error);
  if (error || endpoints.empty()) {
    return Status(StatusCode::kUnavailable,
                  "metrics listener on " + address + ": cannot resolve '" + host + "': " + error.message());
  }
  const tcp::endpoint endpoint = endpoints.begin()->endpoint();
  server.acceptor.open(endpoint.protocol(), error);
  if (!error) server.acceptor.set_option(asio::socket_base::reuse_address(true), error);
  if (!error) server.acceptor.bind(endpoint, error);
  if (!error) server.acceptor.listen(asio::socket_base::max_listen_connections, error);
  if (error) return Status(StatusCode::kUnavailable, "metrics listener on " + address + ": " + error.message());
  listener->port_ = server.acceptor.local_endpoint().port();
  server.thread = std::thread(
      [&server, metrics = listener->metrics_, health = std::move(health)] { server.serve(metrics, health); });
  return listener;
}

MetricsListener::~MetricsListener() {
  if (!server_) return;
  beast::error_code error;
  // Closing the acceptor from here does not wake a blocking accept on every platform: a connection to
  // ourselves does, and the loop then sees the closed acceptor.
  const tcp::endpoint self(server_->acceptor.local_endpoint(error).address(), port_);
  server_->acceptor.close(error);
  {
    tcp::socket wake(server_->io);
    wake.connect(self, error);
  }
  if (server_->thread.joinable()) server_->thread.join();
}

}  // namespace deltaserve::telemetry
