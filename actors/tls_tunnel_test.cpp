// The cluster port's TLS tunnel alone (actors/tls_tunnel.hpp), without CAF: a client tunnel and a server tunnel
// in front of a loopback echo server, driven through plain sockets. Checks that bytes cross both ways per
// connection, that a refused or idle peer closes only its own connection, and that stop() closes everything.
#include "actors/tls_tunnel.hpp"

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include "actors/test_tls.hpp"

namespace deltaserve::actors {
namespace {

using namespace std::chrono_literals;
using testing::TestClusterTls;

// A connected TCP socket to 127.0.0.1:port, closed with the object; -1 when the connect failed.
class Socket {
 public:
  explicit Socket(uint16_t port) : fd_(::socket(AF_INET, SOCK_STREAM, 0)) {
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_port = htons(port);
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd_, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) != 0) {
      ::close(fd_);
      fd_ = -1;
    }
  }
  ~Socket() {
    if (fd_ >= 0) ::close(fd_);
  }
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;

  bool ok() const { return fd_ >= 0; }

  bool send_all(const std::string& data) {
    size_t sent = 0;
    while (sent < data.size()) {
      const ssize_t n = ::send(fd_, data.data() + sent, data.size() - sent, MSG_NOSIGNAL);
      if (n <= 0) return false;
      sent += static_cast<size_t>(n);
    }
    return true;
  }

  // Up to `size` bytes, fewer when the peer closes or the deadline passes.
  std::string receive(size_t size, std::chrono::milliseconds timeout) {
    std::string out;
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    char buffer[1 << 16];
    while (out.size() < size) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) break;
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) break;
      const ssize_t n = ::recv(fd_, buffer, std::min(sizeof(buffer), size - out.size()), 0);
      if (n <= 0) break;
      out.append(buffer, static_cast<size_t>(n));
    }
    return out;
  }

  // True when the peer closes (end of stream or reset) before the deadline; bytes that arrive are dropped.
  bool closed_by_peer(std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    char buffer[4096];
    while (true) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return false;
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) return false;
      if (::recv(fd_, buffer, sizeof(buffer), 0) <= 0) return true;
    }
  }

 private:
  int fd_;
};

// Echoes every byte of every connection on 127.0.0.1:ephemeral until the client closes; counts connections.
class EchoServer {
 public:
  EchoServer() : listener_(::socket(AF_INET, SOCK_STREAM, 0)) {
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t length = sizeof(address);
    if (::bind(listener_, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) != 0 ||
        ::listen(listener_, 16) != 0 || ::getsockname(listener_, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
      ADD_FAILURE() << "echo server: cannot listen on loopback";
      return;
    }
    port_ = ntohs(address.sin_port);
    acceptor_ = std::thread([this] {
      while (true) {
        const int fd = ::accept(listener_, nullptr, nullptr);
        if (fd < 0) return;  // the listener was shut down
        ++accepted_;
        std::lock_guard<std::mutex> lock(mutex_);
        connections_.push_back(fd);
        echoes_.emplace_back([fd] {
          char buffer[1 << 16];
          while (true) {
            const ssize_t n = ::recv(fd, buffer, sizeof(buffer), 0);
            if (n <= 0 || ::send(fd, buffer, static_cast<size_t>(n), MSG_NOSIGNAL) != n) return;
          }
        });
      }
    });
  }
  ~EchoServer() {
    ::shutdown(listener_, SHUT_RDWR);  // wakes accept()
    if (acceptor_.joinable()) acceptor_.join();
    ::close(listener_);
    std::lock_guard<std::mutex> lock(mutex_);
    for (int fd : connections_) ::shutdown(fd, SHUT_RDWR);  // wakes recv()
    for (std::thread& t : echoes_) t.join();
    for (int fd : connections_) ::close(fd);
  }

  uint16_t port() const { return port_; }
  int accepted() const { return accepted_; }

 private:
  int listener_;
  uint16_t port_ = 0;
  std::atomic<int> accepted_{0};
  std::thread acceptor_;
  std::mutex mutex_;
  std::vector<int> connections_;
  std::vector<std::thread> echoes_;
};

ClusterTlsFiles files_of(const std::filesystem::path& dir) {
  return {dir / "ca.crt", dir / "tls.crt", dir / "tls.key"};
}

// `size` bytes that differ per `seed`, so crossed connections would show.
std::string pattern(size_t size, char seed) {
  std::string out(size, '\0');
  for (size_t i = 0; i < size; ++i) out[i] = static_cast<char>(seed + i * 31 + (i >> 8));
  return out;
}

// Threads of this process (Linux).
size_t thread_count() {
  size_t n = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator("/proc/self/task")) ++n;
  return n;
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// A client tunnel, a server tunnel and the echo server behind it, all on loopback.
struct Tunnels {
  explicit Tunnels(const TestClusterTls& tls) {
    auto s = TlsTunnel::serve(files_of(tls.right()), "127.0.0.1", 0, echo.port());
    EXPECT_TRUE(s.is_ok()) << s.status().to_string();
    if (s.is_ok()) server = std::move(s).value();
    if (server) {
      auto c = TlsTunnel::connect(files_of(tls.right()), "127.0.0.1", server->port());
      EXPECT_TRUE(c.is_ok()) << c.status().to_string();
      if (c.is_ok()) client = std::move(c).value();
    }
  }
  bool ok() const { return server && client; }

  EchoServer echo;
  std::unique_ptr<TlsTunnel> server;
  std::unique_ptr<TlsTunnel> client;
};

TEST(TlsTunnelTest, CarriesBytesBothWaysOnEachConnectionAndOneClosingLeavesTheOthers) {
  TestClusterTls tls;
  ASSERT_TRUE(tls.ok());
  Tunnels t(tls);
  ASSERT_TRUE(t.ok());
  EXPECT_NE(t.server->port(), 0);
  EXPECT_NE(t.client->port(), t.server->port());

  // Several concurrent connections, each larger than a splice buffer, each echoed unmixed.
  constexpr size_t kBytes = 3 << 20;
  std::vector<std::unique_ptr<Socket>> sockets;
  for (int i = 0; i < 3; ++i) {
    sockets.push_back(std::make_unique<Socket>(t.client->port()));
    ASSERT_TRUE(sockets.back()->ok());
  }
  std::vector<std::thread> senders;
  for (size_t i = 0; i < sockets.size(); ++i) {
    senders.emplace_back([&, i] { EXPECT_TRUE(sockets[i]->send_all(pattern(kBytes, static_cast<char>('a' + i)))); });
  }
  for (size_t i = 0; i < sockets.size(); ++i) {
    EXPECT_EQ(sockets[i]->receive(kBytes, 30s), pattern(kBytes, static_cast<char>('a' + i))) << "connection " << i;
  }
  for (std::thread& s : senders) s.join();
  EXPECT_EQ(t.echo.accepted(), 3);

  // One connection ends; the others and new ones still carry bytes.
  sockets[0].reset();
  EXPECT_TRUE(sockets[1]->send_all("after"));
  EXPECT_EQ(sockets[1]->receive(5, 10s), "after");
  Socket fresh(t.client->port());
  ASSERT_TRUE(fresh.ok());
  EXPECT_TRUE(fresh.send_all("fresh"));
  EXPECT_EQ(fresh.receive(5, 10s), "fresh");
  EXPECT_EQ(t.client->last_error(), "");
}

TEST(TlsTunnelTest, RefusedPeersCloseOnlyTheirOwnConnection) {
  TestClusterTls tls;
  ASSERT_TRUE(tls.ok());
  Tunnels t(tls);
  ASSERT_TRUE(t.ok());
  Socket member(t.client->port());
  ASSERT_TRUE(member.ok());
  ASSERT_TRUE(member.send_all("one"));
  ASSERT_EQ(member.receive(3, 10s), "one");

  // Another CA's client does not accept the server's certificate: its local connection is closed, and
  // last_error says why.
  auto wrong = TlsTunnel::connect(files_of(tls.wrong()), "127.0.0.1", t.server->port());
  ASSERT_TRUE(wrong.is_ok()) << wrong.status().to_string();
  {
    Socket refused((*wrong)->port());
    ASSERT_TRUE(refused.ok());
    refused.send_all("never echoed");
    EXPECT_TRUE(refused.closed_by_peer(15s));
  }
  EXPECT_TRUE(contains((*wrong)->last_error(), "TLS handshake with 127.0.0.1:" + std::to_string(t.server->port())))
      << (*wrong)->last_error();
  EXPECT_TRUE(contains((*wrong)->last_error(), "certificate verify failed")) << (*wrong)->last_error();

  // A client that trusts the cluster CA but presents another CA's certificate: the server refuses it (under
  // TLS 1.3 after the client finished its side of the handshake, so the local connection closes then).
  ClusterTlsFiles impostor = files_of(tls.wrong());
  impostor.ca = tls.right() / "ca.crt";
  auto impostor_tunnel = TlsTunnel::connect(impostor, "127.0.0.1", t.server->port());
  ASSERT_TRUE(impostor_tunnel.is_ok()) << impostor_tunnel.status().to_string();
  {
    Socket refused((*impostor_tunnel)->port());
    ASSERT_TRUE(refused.ok());
    refused.send_all("never echoed");
    EXPECT_TRUE(refused.closed_by_peer(15s));
  }

  // Plain TCP to the TLS port: bytes that are no TLS record end the handshake and the connection.
  {
    Socket plain(t.server->port());
    ASSERT_TRUE(plain.ok());
    plain.send_all(std::string(64, 'x'));
    EXPECT_TRUE(plain.closed_by_peer(15s));
  }
  // A probe that connects and closes at once.
  { Socket probe(t.server->port()); }

  EXPECT_EQ(t.echo.accepted(), 1) << "a refused peer reached the plain side";
  ASSERT_TRUE(member.send_all("two"));
  EXPECT_EQ(member.receive(3, 10s), "two");
}

TEST(TlsTunnelTest, AnIdleConnectionIsClosedAtTheHandshakeTimeout) {
  TestClusterTls tls;
  ASSERT_TRUE(tls.ok());
  Tunnels t(tls);
  ASSERT_TRUE(t.ok());
  Socket idle(t.server->port());
  ASSERT_TRUE(idle.ok());
  const auto start = std::chrono::steady_clock::now();
  EXPECT_TRUE(idle.closed_by_peer(TlsTunnel::kHandshakeTimeout + 20s));
  EXPECT_GE(std::chrono::steady_clock::now() - start, TlsTunnel::kHandshakeTimeout - 1s);
  EXPECT_EQ(t.echo.accepted(), 0);
}

TEST(TlsTunnelTest, StopClosesEveryConnectionAndTheListenersAndJoinsTheThread) {
  TestClusterTls tls;
  ASSERT_TRUE(tls.ok());
  const size_t threads_before = thread_count();
  {
    Tunnels t(tls);
    ASSERT_TRUE(t.ok());
    Socket member(t.client->port());
    ASSERT_TRUE(member.ok());
    ASSERT_TRUE(member.send_all("x"));
    ASSERT_EQ(member.receive(1, 10s), "x");
    Socket pending(t.server->port());  // accepted by the server tunnel, handshake pending
    ASSERT_TRUE(pending.ok());

    const uint16_t client_port = t.client->port();
    t.client->stop();
    EXPECT_TRUE(member.closed_by_peer(10s));
    t.server->stop();
    EXPECT_TRUE(pending.closed_by_peer(10s));
    t.server->stop();  // idempotent
    EXPECT_FALSE(Socket(client_port).ok()) << "the client tunnel still listens";
  }
  EXPECT_EQ(thread_count(), threads_before) << "a tunnel or echo thread outlived its owner";
}

TEST(TlsTunnelTest, AClientTunnelToANonListeningPortSaysWhy) {
  TestClusterTls tls;
  ASSERT_TRUE(tls.ok());
  // A port that was just free: bind an ephemeral one and close it.
  uint16_t free_port = 0;
  {
    EchoServer gone;
    free_port = gone.port();
  }
  auto c = TlsTunnel::connect(files_of(tls.right()), "127.0.0.1", free_port);
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  Socket local((*c)->port());
  ASSERT_TRUE(local.ok());
  EXPECT_TRUE(local.closed_by_peer(15s));
  EXPECT_TRUE(contains((*c)->last_error(), "connect to 127.0.0.1:" + std::to_string(free_port))) << (*c)->last_error();

  auto taken = TlsTunnel::serve(files_of(tls.right()), "127.0.0.1", (*c)->port(), 1);
  ASSERT_FALSE(taken.is_ok());
  EXPECT_EQ(taken.status().code(), StatusCode::kUnavailable);
  EXPECT_TRUE(contains(taken.status().to_string(), "127.0.0.1:" + std::to_string((*c)->port())))
      << taken.status().to_string();
}

}  // namespace
}  // namespace deltaserve::actors
