// The cluster port with mutual TLS (actors/cluster_tls.hpp) and the registry's binding of worker names to the
// node that joined them (actors/registry_protocol.hpp): a TLS router node, workers of other actor systems of
// this process over loopback, and a registry client that holds a valid certificate but is another node.
#include "actors/cluster_tls.hpp"

#include <algorithm>
#include <fstream>

#include <arpa/inet.h>
#include <caf/io/all.hpp>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "actors/node.hpp"
#include "actors/registry_protocol.hpp"
#include "actors/test_model.hpp"
#include "actors/test_sink.hpp"
#include "actors/test_tls.hpp"
#include "actors/tls_tunnel.hpp"

namespace deltaserve::actors {
namespace {

using namespace std::chrono_literals;

using testing::CollectingSink;
using testing::TestClusterTls;
using testing::wait_until;

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

void copy_dir(const std::filesystem::path& from, const std::filesystem::path& to) {
  std::filesystem::create_directories(to);
  for (const char* name : {"ca.crt", "tls.crt", "tls.key"}) std::filesystem::copy_file(from / name, to / name);
}

// An actor system of its own (so another CAF node) connected to the registry with a certificate of `tls_dir`
// (through a TLS tunnel of its own, as a worker's Node does), or over plain TCP when `tls_dir` is empty.
class RegistryClient {
 public:
  RegistryClient(const std::filesystem::path& tls_dir, uint16_t port) {
    config_.load<caf::io::middleman>();
    register_wire_types(config_);
    config_.set("logger.verbosity", caf::atom("quiet"));
    config_.set("logger.file-verbosity", caf::atom("quiet"));
    system_ = std::make_unique<caf::actor_system>(config_);
    uint16_t caf_port = port;
    if (!tls_dir.empty()) {
      auto files = load_cluster_tls_dir(tls_dir, "test");
      auto tunnel = files.is_ok() ? TlsTunnel::connect(*files, "127.0.0.1", port) : files.status();
      if (!tunnel.is_ok()) {
        error_ = tunnel.status().to_string();
        return;
      }
      tunnel_ = std::move(tunnel).value();
      caf_port = tunnel_->port();
    }
    // Bounded: CAF's remote_actor has no timeout of its own.
    caf::scoped_actor self{*system_};
    self->request(system_->middleman().actor_handle(), 20s, caf::connect_atom::value, std::string("127.0.0.1"),
                  caf_port)
        .receive(
            [&](caf::node_id&, caf::strong_actor_ptr& actor, std::set<std::string>&) {
              registry_ = caf::actor_cast<registry_actor>(std::move(actor));
              if (!registry_) error_ = "no actor published";
            },
            [&](caf::error& e) { error_ = system_->render(e); });
    if (!registry_ && tunnel_) error_ += " (tunnel: " + tunnel_->last_error() + ")";
  }
  ~RegistryClient() {
    for (const caf::actor& a : idle_) caf::anon_send_exit(a, caf::exit_reason::user_shutdown);
    registry_ = nullptr;
    system_.reset();
    tunnel_.reset();  // after the system: CAF's connection runs through it
  }

  bool connected() const { return static_cast<bool>(registry_); }
  const std::string& error() const { return error_; }

  std::vector<WorkerInfo> list() {
    std::vector<WorkerInfo> out;
    caf::scoped_actor self{*system_};
    self->request(registry_, 10s, list_atom::value)
        .receive([&](std::vector<WorkerInfo>& l) { out = std::move(l); },
                 [&](caf::error& e) { ADD_FAILURE() << "list: " << system_->render(e); });
    return out;
  }
  std::vector<std::string> names() {
    std::vector<std::string> out;
    for (const WorkerInfo& w : list()) out.push_back(w.name);
    return out;
  }
  // "" when joined, else the registry's error.
  std::string join(const WorkerInfo& info) {
    std::string out = "no reply";
    caf::scoped_actor self{*system_};
    self->request(registry_, 10s, join_atom::value, info)
        .receive([&](uint64_t) { out.clear(); }, [&](caf::error& e) { out = system_->render(e); });
    return out;
  }
  // leave(name), then list(), both from one actor: the registry handles them in that order.
  std::vector<std::string> leave_then_list(const std::string& name) {
    std::vector<std::string> out;
    caf::scoped_actor self{*system_};
    self->send(registry_, leave_atom::value, name);
    self->request(registry_, 10s, list_atom::value)
        .receive(
            [&](std::vector<WorkerInfo>& l) {
              for (const WorkerInfo& w : l) out.push_back(w.name);
            },
            [&](caf::error& e) { ADD_FAILURE() << "list: " << system_->render(e); });
    return out;
  }
  // An actor of this node that ignores everything: a join handle that is really on this node.
  caf::actor spawn_idle() {
    // The unused argument avoids CAF 0.17's no-argument spawn path (UB on a null shared_ptr<tuple<>>).
    idle_.push_back(system_->spawn([](caf::event_based_actor*, int) -> caf::behavior { return {[](int32_t) {}}; }, 0));
    return idle_.back();
  }

 private:
  caf::actor_system_config config_;
  std::unique_ptr<caf::actor_system> system_;
  std::unique_ptr<TlsTunnel> tunnel_;
  registry_actor registry_;
  std::vector<caf::actor> idle_;
  std::string error_;
};

NodeOptions tls_router(const std::filesystem::path& dir) {
  NodeOptions o = testing::remote_router_options();
  o.cluster_tls_dir = dir;
  return o;
}

NodeOptions worker(NodeRole role, uint16_t port, const std::string& name, const std::filesystem::path& tls_dir) {
  NodeOptions o = testing::tiny_serve_options();
  o.role = role;
  o.join = {{"127.0.0.1", port}};
  o.join_timeout = 10s;
  o.worker_name = name;
  o.cluster_tls_dir = tls_dir;
  return o;
}

// A greedy request through the router, compared with the reference loop of the same model.
void expect_greedy_served(router::InferenceService& service, const std::string& id) {
  const std::vector<int32_t> prompt{9, 8, 7, 6, 5, 4, 3};
  auto sink = std::make_shared<CollectingSink>();
  service.submit(testing::greedy_request(id, prompt, 6), sink);
  ASSERT_TRUE(sink->wait_final(30s));
  EXPECT_TRUE(sink->last().error.is_ok()) << sink->last().error.to_string();
  EXPECT_EQ(sink->tokens(), testing::reference_greedy(*testing::tiny_model().model, prompt, 6, 4));
}

TEST(ClusterTlsOptionsTest, BadFilesAreRefusedNamingTheFileAndTheOption) {
  TestClusterTls tls;
  ASSERT_TRUE(tls.ok()) << "the openssl CLI could not make the test certificates";
  const std::string option = "--cluster-tls-dir";
  ASSERT_TRUE(load_cluster_tls_dir(tls.right(), option).is_ok());

  auto refused = [&](const std::filesystem::path& dir, StatusCode code, const std::string& file,
                     const std::string& why) {
    auto loaded = load_cluster_tls_dir(dir, option);
    ASSERT_FALSE(loaded.is_ok()) << dir;
    const std::string text = loaded.status().to_string();
    EXPECT_EQ(loaded.status().code(), code) << text;
    EXPECT_TRUE(contains(text, option)) << text;
    EXPECT_TRUE(contains(text, file)) << text;
    EXPECT_TRUE(contains(text, why)) << text;
  };

  refused(tls.root() / "absent", StatusCode::kNotFound, (tls.root() / "absent").string(), "not a directory");

  const std::filesystem::path no_key = tls.root() / "no_key";
  copy_dir(tls.right(), no_key);
  std::filesystem::remove(no_key / "tls.key");
  refused(no_key, StatusCode::kNotFound, (no_key / "tls.key").string(), "does not exist");

  const std::filesystem::path garbage = tls.root() / "garbage";
  copy_dir(tls.right(), garbage);
  std::ofstream(garbage / "tls.crt", std::ios::trunc) << "-----BEGIN CERTIFICATE-----\nnot base64\n";
  refused(garbage, StatusCode::kInvalidArgument, (garbage / "tls.crt").string(), "not a PEM certificate");

  const std::filesystem::path garbage_key = tls.root() / "garbage_key";
  copy_dir(tls.right(), garbage_key);
  std::ofstream(garbage_key / "tls.key", std::ios::trunc) << "hello\n";
  refused(garbage_key, StatusCode::kInvalidArgument, (garbage_key / "tls.key").string(), "private key");

  const std::filesystem::path empty_ca = tls.root() / "empty_ca";
  copy_dir(tls.right(), empty_ca);
  std::ofstream(empty_ca / "ca.crt", std::ios::trunc) << "";
  refused(empty_ca, StatusCode::kInvalidArgument, (empty_ca / "ca.crt").string(), "no PEM certificate");

  const std::filesystem::path other_key = tls.root() / "other_key";
  copy_dir(tls.right(), other_key);
  std::filesystem::copy_file(tls.wrong() / "tls.key", other_key / "tls.key",
                             std::filesystem::copy_options::overwrite_existing);
  refused(other_key, StatusCode::kInvalidArgument, (other_key / "tls.key").string(), "is not the private key of");

  const std::filesystem::path other_ca = tls.root() / "other_ca";  // certificate and key of the wrong CA
  copy_dir(tls.wrong(), other_ca);
  std::filesystem::copy_file(tls.right() / "ca.crt", other_ca / "ca.crt",
                             std::filesystem::copy_options::overwrite_existing);
  refused(other_ca, StatusCode::kInvalidArgument, (other_ca / "tls.crt").string(), "does not verify against");

  if (::geteuid() != 0) {  // root reads any file
    const std::filesystem::path unreadable = tls.root() / "unreadable";
    copy_dir(tls.right(), unreadable);
    std::filesystem::permissions(unreadable / "tls.key", std::filesystem::perms::none);
    refused(unreadable, StatusCode::kIoError, (unreadable / "tls.key").string(), "cannot read");
  }

  // Node::start checks them before anything listens or connects.
  auto router = Node::start(tls_router(other_key));
  ASSERT_FALSE(router.is_ok());
  EXPECT_TRUE(contains(router.status().to_string(), (other_key / "tls.key").string())) << router.status().to_string();
  auto decode = Node::start(worker(NodeRole::kDecode, 1, "decode-bad", garbage));
  ASSERT_FALSE(decode.is_ok());
  EXPECT_TRUE(contains(decode.status().to_string(), (garbage / "tls.crt").string())) << decode.status().to_string();
  // serve has no cluster port: the option would do nothing there.
  NodeOptions serve = testing::tiny_serve_options();
  serve.cluster_tls_dir = tls.right();
  auto served = Node::start(serve);
  ASSERT_FALSE(served.is_ok());
  EXPECT_EQ(served.status().code(), StatusCode::kInvalidArgument);
}

TEST(ClusterTlsOptionsTest, PlainTcpOffLoopbackNeedsClusterInsecure) {
  NodeOptions router = testing::remote_router_options();
  router.cluster_host = "0.0.0.0";
  auto refused = Node::start(router);
  ASSERT_FALSE(refused.is_ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(contains(refused.status().to_string(), "--cluster-insecure")) << refused.status().to_string();
  EXPECT_TRUE(contains(refused.status().to_string(), "--cluster-tls-dir")) << refused.status().to_string();

  NodeOptions decode = worker(NodeRole::kDecode, 7000, "decode-x", {});
  decode.join = {{"10.11.12.13", 7000}};  // refused before any connection attempt
  auto refused_worker = Node::start(decode);
  ASSERT_FALSE(refused_worker.is_ok());
  EXPECT_EQ(refused_worker.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(contains(refused_worker.status().to_string(), "--cluster-insecure"))
      << refused_worker.status().to_string();

  // The override: plain TCP on every interface (an ephemeral port, closed at once).
  router.cluster_insecure = true;
  auto insecure = Node::start(router);
  ASSERT_TRUE(insecure.is_ok()) << insecure.status().to_string();
  (*insecure)->shutdown();
  // Loopback without TLS stays allowed (single-host development).
  auto loopback = Node::start(testing::remote_router_options());
  ASSERT_TRUE(loopback.is_ok()) << loopback.status().to_string();
  (*loopback)->shutdown();
}

TEST(ClusterTlsTest, OnlyWorkersWithACertificateOfTheClusterCaJoin) {
  ASSERT_TRUE(testing::tiny_model().model);
  TestClusterTls tls;
  ASSERT_TRUE(tls.ok());
  auto router_node = Node::start(tls_router(tls.right()));
  ASSERT_TRUE(router_node.is_ok()) << router_node.status().to_string();
  const uint16_t port = (*router_node)->cluster_port();
  router::InferenceService& service = *(*router_node)->service();

  // No TLS: the router waits for a TLS ClientHello, the worker for CAF's handshake; refused at the deadline.
  NodeOptions plain = worker(NodeRole::kDecode, port, "decode-plain", {});
  plain.join_timeout = 3s;
  auto plain_node = Node::start(plain);
  ASSERT_FALSE(plain_node.is_ok());
  EXPECT_EQ(plain_node.status().code(), StatusCode::kDeadlineExceeded) << plain_node.status().to_string();

  // A certificate of another CA: the handshake fails (each retry) until the deadline.
  NodeOptions wrong = worker(NodeRole::kDecode, port, "decode-wrong", tls.wrong());
  wrong.join_timeout = 3s;
  auto wrong_node = Node::start(wrong);
  ASSERT_FALSE(wrong_node.is_ok());
  EXPECT_EQ(wrong_node.status().code(), StatusCode::kDeadlineExceeded) << wrong_node.status().to_string();
  EXPECT_TRUE(contains(wrong_node.status().to_string(), "over TLS")) << wrong_node.status().to_string();

  // A client with the wrong CA cannot even list; one with the right CA sees that nobody joined.
  {
    RegistryClient outsider(tls.wrong(), port);
    EXPECT_FALSE(outsider.connected());
  }
  RegistryClient observer(tls.right(), port);
  ASSERT_TRUE(observer.connected()) << observer.error();
  EXPECT_TRUE(observer.names().empty());
  EXPECT_FALSE(service.status().ready);

  // Workers with the cluster's certificate join and serve.
  auto prefill = Node::start(worker(NodeRole::kPrefill, port, "prefill-tls", tls.right()));
  ASSERT_TRUE(prefill.is_ok()) << prefill.status().to_string();
  auto decode = Node::start(worker(NodeRole::kDecode, port, "decode-tls", tls.right()));
  ASSERT_TRUE(decode.is_ok()) << decode.status().to_string();
  ASSERT_TRUE(wait_until([&] { return service.status().ready; }, 10s));
  EXPECT_EQ(observer.names(), (std::vector<std::string>{"decode-tls", "prefill-tls"}));
  expect_greedy_served(service, "tls-0");
  EXPECT_EQ((*decode)->worker_stats().handoffs, 1);  // the only decode worker got the only request

  (*decode)->shutdown();
  (*prefill)->shutdown();
  (*router_node)->shutdown();
}

// `tls_dir` empty: plain TCP on loopback. The binding is the same either way; `release_the_name` adds a
// worker leaving (its connection closing) while the others stay connected.
void another_node_cannot_evict_take_or_speak_for(const std::filesystem::path& tls_dir, bool release_the_name) {
  ASSERT_TRUE(testing::tiny_model().model);
  auto router_node = Node::start(tls_router(tls_dir));
  ASSERT_TRUE(router_node.is_ok()) << router_node.status().to_string();
  const uint16_t port = (*router_node)->cluster_port();
  router::InferenceService& service = *(*router_node)->service();
  auto prefill = Node::start(worker(NodeRole::kPrefill, port, "prefill-real", tls_dir));
  ASSERT_TRUE(prefill.is_ok()) << prefill.status().to_string();
  auto decode = Node::start(worker(NodeRole::kDecode, port, "decode-real", tls_dir));
  ASSERT_TRUE(decode.is_ok()) << decode.status().to_string();
  ASSERT_TRUE(wait_until([&] { return service.status().ready; }, 10s));

  // A member of the cluster (valid certificate), but another node than the real workers'.
  auto other = std::make_unique<RegistryClient>(tls_dir, port);
  ASSERT_TRUE(other->connected()) << other->error();
  const std::vector<std::string> both{"decode-real", "prefill-real"};

  EXPECT_EQ(other->leave_then_list("decode-real"), both) << "another node evicted decode-real";
  const std::string taken = other->join(WorkerInfo{"decode-real", kDecodeRole, other->spawn_idle(), 4, {}, 0, {}});
  EXPECT_TRUE(contains(taken, "held by a live worker of another node")) << "join: '" << taken << "'";
  // Nor may it register the real worker's actor under a name of its own.
  caf::actor real_decode;
  for (const WorkerInfo& w : other->list()) {
    if (w.name == "decode-real") real_decode = w.handle;
  }
  ASSERT_TRUE(real_decode);
  const std::string ghost = other->join(WorkerInfo{"ghost", kDecodeRole, real_decode, 4, {}, 0, {}});
  EXPECT_TRUE(contains(ghost, "must live on the joining node")) << "join: '" << ghost << "'";
  real_decode = nullptr;
  EXPECT_EQ(other->names(), both);
  expect_greedy_served(service, "after-intruder");

  // Positive control: its own name it may join and leave (the messages above did reach the registry).
  EXPECT_EQ(other->join(WorkerInfo{"other-0", kPrefillRole, other->spawn_idle(), 4, {}, 0, {}}), "");
  EXPECT_EQ(other->names(), (std::vector<std::string>{"decode-real", "other-0", "prefill-real"}));
  EXPECT_EQ(other->leave_then_list("other-0"), both);

  // Once its holder has left, the name is free for another node.
  if (release_the_name) {
    (*decode)->shutdown();
    ASSERT_TRUE(wait_until([&] { return other->names() == std::vector<std::string>{"prefill-real"}; }, 10s));
    EXPECT_EQ(other->join(WorkerInfo{"decode-real", kDecodeRole, other->spawn_idle(), 4, {}, 0, {}}), "");
    EXPECT_EQ(other->leave_then_list("decode-real"), std::vector<std::string>{"prefill-real"});
  }

  other.reset();
  (*decode)->shutdown();
  (*prefill)->shutdown();
  (*router_node)->shutdown();
}

TEST(ClusterTlsTest, AnotherNodeCannotEvictTakeOrSpeakForAWorkersName) {
  TestClusterTls tls;
  ASSERT_TRUE(tls.ok());
  another_node_cannot_evict_take_or_speak_for(tls.right(), false);
}

TEST(ClusterRegistryBindingTest, AnotherNodeCannotEvictATakenNameAndGetsItOnceFree) {
  another_node_cannot_evict_take_or_speak_for({}, true);
}

// Churn over TLS: a worker's TLS connection closes (it leaves) while the router's other TLS connections (the
// other worker, the intruder) keep carrying messages and a new node takes the freed name. With CAF 0.17.6's
// OpenSSL module the registry stopped answering at that point; the tunnel (actors/tls_tunnel.hpp) replaced it.
TEST(ClusterTlsTest, RegistryAnswersAfterATlsWorkerLeaves) {
  TestClusterTls tls;
  ASSERT_TRUE(tls.ok());
  another_node_cannot_evict_take_or_speak_for(tls.right(), true);
}

// The cluster keeps serving through what a deployment does to the TLS port: a port probe, a peer of another
// CA (refused), a decode worker that leaves and its replacement; every step is followed by a served request.
TEST(ClusterTlsTest, ClusterServesThroughProbesRefusedPeersAndWorkerChurn) {
  ASSERT_TRUE(testing::tiny_model().model);
  TestClusterTls tls;
  ASSERT_TRUE(tls.ok());
  auto router_node = Node::start(tls_router(tls.right()));
  ASSERT_TRUE(router_node.is_ok()) << router_node.status().to_string();
  const uint16_t port = (*router_node)->cluster_port();
  router::InferenceService& service = *(*router_node)->service();
  auto prefill = Node::start(worker(NodeRole::kPrefill, port, "prefill-0", tls.right()));
  ASSERT_TRUE(prefill.is_ok()) << prefill.status().to_string();
  auto decode = Node::start(worker(NodeRole::kDecode, port, "decode-0", tls.right()));
  ASSERT_TRUE(decode.is_ok()) << decode.status().to_string();
  ASSERT_TRUE(wait_until([&] { return service.status().ready; }, 10s));
  expect_greedy_served(service, "churn-0");

  // A TCP probe: connects and closes without a handshake.
  {
    const int probe = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_port = htons(port);
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::connect(probe, reinterpret_cast<const sockaddr*>(&address), sizeof(address)), 0);
    ::close(probe);
  }
  expect_greedy_served(service, "churn-probe");

  // A worker of another CA is refused, naming the TLS failure; its attempts close only their own connections.
  NodeOptions wrong = worker(NodeRole::kDecode, port, "decode-wrong", tls.wrong());
  wrong.join_timeout = 1s;
  auto wrong_node = Node::start(wrong);
  ASSERT_FALSE(wrong_node.is_ok());
  EXPECT_TRUE(contains(wrong_node.status().to_string(), "certificate verify failed"))
      << wrong_node.status().to_string();
  expect_greedy_served(service, "churn-refused");

  // The decode worker leaves (its TLS connection closes); a new one joins under a new name and serves.
  (*decode)->shutdown();
  ASSERT_TRUE(wait_until([&] { return !service.status().ready; }, 10s));
  auto replacement = Node::start(worker(NodeRole::kDecode, port, "decode-1", tls.right()));
  ASSERT_TRUE(replacement.is_ok()) << replacement.status().to_string();
  ASSERT_TRUE(wait_until([&] { return service.status().ready; }, 10s));
  expect_greedy_served(service, "churn-replaced");
  EXPECT_EQ((*replacement)->worker_stats().handoffs, 1);

  // The same name again after its holder left: a restarted worker.
  (*replacement)->shutdown();
  ASSERT_TRUE(wait_until([&] { return !service.status().ready; }, 10s));
  auto restarted = Node::start(worker(NodeRole::kDecode, port, "decode-1", tls.right()));
  ASSERT_TRUE(restarted.is_ok()) << restarted.status().to_string();
  ASSERT_TRUE(wait_until([&] { return service.status().ready; }, 10s));
  expect_greedy_served(service, "churn-restarted");

  (*restarted)->shutdown();
  (*prefill)->shutdown();
  (*router_node)->shutdown();
}

}  // namespace
}  // namespace deltaserve::actors
