// The UCX handoff path (actors/ucx_transport.hpp) end to end: real UCX endpoints over loopback (tcp on lo),
// real actors. This binary links the transfer library with its named fault points compiled in
// (ds_kvstore_transfer_faults, listed before ds_actors); each fault test first proves that by creating an
// engine with a fault spec, which the release library rejects.
//   - three Nodes (router, prefill, decode) over loopback with transport ucx: greedy output equals the
//     direct engine loop; every transfer resource is back to zero afterwards;
//   - faults on the first handoff (piece dropped, byte corrupted, piece delayed past the deadline, endpoint
//     killed): the request is prefilled again and completes with the reference output; nothing bad decoded;
//   - faults on every handoff: a clean error after the router's attempts; nothing decoded;
//   - a decode worker without UCX refuses the reservation: clean error, no hang.
#include "actors/ucx_transport.hpp"

#include <gtest/gtest.h>

#include "actors/cluster_service_impl.hpp"
#include "actors/decode_worker.hpp"
#include "actors/node.hpp"
#include "actors/prefill_worker.hpp"
#include "actors/registry_actor.hpp"
#include "actors/router_actor.hpp"
#include "actors/test_model.hpp"
#include "actors/test_sink.hpp"
#include "actors/wire_types.hpp"

namespace deltaserve::actors {
namespace {

using namespace std::chrono_literals;

using testing::CollectingSink;
using testing::wait_until;

UcxLinkConfig loopback_link(const std::string& faults = "") {
  UcxLinkConfig c;
  c.tls = "tcp,self";
  c.net_devices = "lo";
  c.deadline = 1000ms;
  c.reserve_timeout = 1000ms;
  c.piece_bytes = 1024;  // several pieces per state of the tiny model
  c.faults = faults;
  return c;
}

// Every transfer finished and taken, nothing in flight, no region left (all released).
template <class Stats>
bool released(const Stats& s) {
  return s.transfers == 0 && s.transfers_pending == 0 && s.region_uses == 0 && s.requests_in_flight == 0 &&
         s.regions == 0;
}

// The tiny serve options with request states over UCX (tcp on loopback); set the role for workers.
NodeOptions ucx_options() {
  NodeOptions o = testing::tiny_serve_options();
  o.transport = "ucx";
  o.ucx_tls = "tcp,self";
  o.ucx_net_devices = "lo";
  return o;
}

template <class Stats>
std::string describe(const Stats& s) {
  return "transfers " + std::to_string(s.transfers) + " pending " + std::to_string(s.transfers_pending) + " regions " +
         std::to_string(s.regions) + " region_uses " + std::to_string(s.region_uses) + " in_flight " +
         std::to_string(s.requests_in_flight);
}

TEST(UcxTransportNodeTest, RouterPrefillDecodeOverUcxMatchesReference) {
  const auto& tiny = testing::tiny_model();
  ASSERT_TRUE(tiny.model);
  NodeOptions router_options = testing::remote_router_options();
  auto router_node = Node::start(router_options);
  ASSERT_TRUE(router_node.is_ok()) << router_node.status().to_string();
  router::InferenceService& service = *(*router_node)->service();

  NodeOptions worker = ucx_options();
  worker.join = {{"127.0.0.1", (*router_node)->cluster_port()}};
  worker.join_timeout = 5s;
  worker.transfer_piece_bytes = 1024;
  worker.role = NodeRole::kPrefill;
  auto prefill = Node::start(worker);
  ASSERT_TRUE(prefill.is_ok()) << prefill.status().to_string();
  worker.role = NodeRole::kDecode;
  auto decode = Node::start(worker);
  ASSERT_TRUE(decode.is_ok()) << decode.status().to_string();
  ASSERT_TRUE(wait_until([&] { return service.status().ready; }, 5s));

  const std::vector<std::vector<int32_t>> prompts{
      {5, 6, 7, 8, 9, 10, 11, 12, 13, 14}, {42}, {3, 1, 4, 1, 5}, {9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 1, 2, 3, 4, 5, 6, 7}};
  std::vector<std::shared_ptr<CollectingSink>> sinks;
  for (size_t i = 0; i < prompts.size(); ++i) {
    sinks.push_back(std::make_shared<CollectingSink>());
    service.submit(testing::greedy_request("u" + std::to_string(i), prompts[i], 8), sinks.back());
  }
  for (size_t i = 0; i < prompts.size(); ++i) {
    ASSERT_TRUE(sinks[i]->wait_final(20s)) << "request " << i;
    const auto last = sinks[i]->last();
    EXPECT_TRUE(last.error.is_ok()) << last.error.to_string();
    EXPECT_EQ(last.completion_tokens, 8);
    EXPECT_EQ(sinks[i]->tokens(), testing::reference_greedy(*tiny.model, prompts[i], 8, 4)) << "request " << i;
  }
  const NodeWorkerStats sent = (*prefill)->worker_stats();
  const NodeWorkerStats received = (*decode)->worker_stats();
  EXPECT_EQ(sent.handoffs, static_cast<int64_t>(prompts.size()));
  EXPECT_EQ(received.handoffs, static_cast<int64_t>(prompts.size()));
  EXPECT_EQ(received.rejected, 0);
  EXPECT_GT(sent.handoff_bytes, 1024) << "the states should span several pieces";
  // The state bytes went over UCX (the receiving engine verified them), not inside the CAF message.
  EXPECT_TRUE(wait_until([&] { return released((*decode)->transfer_stats()); }, 5s))
      << describe((*decode)->transfer_stats());
  EXPECT_TRUE(wait_until([&] { return released((*prefill)->transfer_stats()); }, 5s))
      << describe((*prefill)->transfer_stats());
  EXPECT_EQ((*decode)->transfer_stats().bytes_received, static_cast<uint64_t>(sent.handoff_bytes));
  EXPECT_EQ((*prefill)->transfer_stats().bytes_sent, static_cast<uint64_t>(sent.handoff_bytes));
  EXPECT_EQ((*router_node)->router_stats().retried, 0);
  (*decode)->shutdown();
  (*prefill)->shutdown();
  (*router_node)->shutdown();
}

// The prefill node (its worker, actor system and UCX engine) goes away while its state is in transfer (the
// first piece held back by a fault): the decode worker fails the transfer (peer gone or deadline), decodes
// nothing, and the router prefills the request again on a prefill node that joins later.
TEST(UcxTransportNodeTest, PrefillNodeGoneMidTransferIsPrefilledAgain) {
  const auto& tiny = testing::tiny_model();
  ASSERT_TRUE(tiny.model);
  NodeOptions router_options = testing::remote_router_options();
  auto router_node = Node::start(router_options);
  ASSERT_TRUE(router_node.is_ok()) << router_node.status().to_string();
  router::InferenceService& service = *(*router_node)->service();

  NodeOptions worker = ucx_options();
  worker.join = {{"127.0.0.1", (*router_node)->cluster_port()}};
  worker.join_timeout = 5s;
  worker.transfer_deadline = 1500ms;
  worker.transfer_reserve_timeout = 1000ms;
  worker.role = NodeRole::kDecode;
  auto decode = Node::start(worker);
  ASSERT_TRUE(decode.is_ok()) << decode.status().to_string();
  worker.role = NodeRole::kPrefill;
  worker.worker_name = "prefill-doomed";
  worker.transfer_faults = "send.delay_piece:0:5000";
  auto doomed = Node::start(worker);
  ASSERT_TRUE(doomed.is_ok()) << "fault injection must be compiled in: " << doomed.status().to_string();
  ASSERT_TRUE(wait_until([&] { return service.status().ready; }, 5s));

  const std::vector<int32_t> prompt{2, 7, 1, 8, 2, 8, 1, 8, 2, 8};
  auto sink = std::make_shared<CollectingSink>();
  service.submit(testing::greedy_request("gone", prompt, 6), sink);
  ASSERT_TRUE(wait_until([&] { return (*decode)->transfer_stats().transfers_pending == 1; }, 10s));
  (*doomed)->shutdown();  // its engine is destroyed with the transfer in flight

  worker.worker_name = "prefill-fresh";
  worker.transfer_faults.clear();
  auto fresh = Node::start(worker);
  ASSERT_TRUE(fresh.is_ok()) << fresh.status().to_string();
  ASSERT_TRUE(sink->wait_final(20s)) << "hang";
  EXPECT_TRUE(sink->last().error.is_ok()) << sink->last().error.to_string();
  EXPECT_EQ(sink->tokens(), testing::reference_greedy(*tiny.model, prompt, 6, 4));
  EXPECT_GE((*router_node)->router_stats().retried, 1);
  const NodeWorkerStats decoded = (*decode)->worker_stats();
  EXPECT_EQ(decoded.rejected, 1);
  EXPECT_EQ(decoded.handoffs, 1);
  EXPECT_EQ(decoded.steps, 6);
  EXPECT_TRUE(wait_until([&] { return released((*decode)->transfer_stats()); }, 10s))
      << describe((*decode)->transfer_stats());
  (*fresh)->shutdown();
  (*decode)->shutdown();
  (*router_node)->shutdown();
}

// All roles in one process: the engine sends to itself (UCX "self" transport).
TEST(UcxTransportNodeTest, ServeWithUcxMatchesReference) {
  const auto& tiny = testing::tiny_model();
  ASSERT_TRUE(tiny.model);
  NodeOptions o = ucx_options();
  auto node = Node::start(o);
  ASSERT_TRUE(node.is_ok()) << node.status().to_string();
  router::InferenceService& service = *(*node)->service();
  ASSERT_TRUE(wait_until([&] { return service.status().ready; }, 5s));
  const std::vector<int32_t> prompt{4, 8, 15, 16, 23, 42};
  auto sink = std::make_shared<CollectingSink>();
  service.submit(testing::greedy_request("s", prompt, 7), sink);
  ASSERT_TRUE(sink->wait_final(20s));
  EXPECT_TRUE(sink->last().error.is_ok()) << sink->last().error.to_string();
  EXPECT_EQ(sink->tokens(), testing::reference_greedy(*tiny.model, prompt, 7, 4));
  const NodeWorkerStats stats = (*node)->worker_stats();
  EXPECT_GT((*node)->transfer_stats().bytes_received, 0u);
  EXPECT_EQ((*node)->transfer_stats().bytes_received, static_cast<uint64_t>(stats.handoff_bytes));
  EXPECT_TRUE(wait_until([&] { return released((*node)->transfer_stats()); }, 5s))
      << describe((*node)->transfer_stats());
  (*node)->shutdown();
}

TEST(UcxTransportNodeTest, UnknownTransportIsRejected) {
  NodeOptions o;
  o.role = NodeRole::kDecode;
  o.model = testing::tiny_model().model;
  o.tokenizer = testing::tiny_model().tokenizer;
  o.transport = "rdma";
  auto node = Node::start(o);
  ASSERT_FALSE(node.is_ok());
  EXPECT_EQ(node.status().code(), StatusCode::kInvalidArgument);
}

// Hands the first `faulty` states to one transport (an engine with faults), every later one to another.
class SwitchingTransport final : public Transport {
 public:
  SwitchingTransport(std::shared_ptr<Transport> faulty, std::shared_ptr<Transport> clean, int faulty_sends)
      : faulty_(std::move(faulty)), clean_(std::move(clean)), faulty_left_(faulty_sends) {}
  Status send_state(const caf::actor& decode_worker, HandoffEnvelope envelope, std::vector<uint8_t> state) override {
    if (faulty_left_ > 0) {
      --faulty_left_;
      return faulty_->send_state(decode_worker, std::move(envelope), std::move(state));
    }
    return clean_->send_state(decode_worker, std::move(envelope), std::move(state));
  }

 private:
  std::shared_ptr<Transport> faulty_, clean_;
  int faulty_left_;  // only the prefill actor calls send_state
};

// Registry + router + one prefill and one decode worker in one actor system; the handoff goes over UCX
// between two (sender) engines and the decode worker's engine on loopback.
class UcxFaultCluster {
 public:
  // `faults` on the sender engine used for the first `faulty_sends` handoffs (every one when negative).
  UcxFaultCluster(const std::string& faults, int faulty_sends, bool decode_has_ucx = true) {
    auto faulty = UcxLink::create(loopback_link(faults));
    EXPECT_TRUE(faulty.is_ok()) << "fault injection must be compiled in: " << faulty.status().to_string();
    auto clean = UcxLink::create(loopback_link());
    auto receiver = UcxLink::create(loopback_link());
    if (!faulty.is_ok() || !clean.is_ok() || !receiver.is_ok()) return;
    faulty_link = *faulty;
    clean_link = *clean;
    receiver_link = *receiver;

    register_wire_types(config_);
    config_.set("logger.verbosity", caf::atom("quiet"));
    config_.set("logger.file-verbosity", caf::atom("quiet"));
    system_ = std::make_unique<caf::actor_system>(config_);
    const auto& tiny = testing::tiny_model();
    registry_ = spawn_registry(*system_);
    gauges_ = std::make_shared<RouterGauges>();
    router = spawn_router(*system_, RouterConfig{}, registry_, gauges_);
    DecodeWorkerConfig decode_config;
    decode_config.max_batch = 4;
    decode_config.heartbeat_interval = 100ms;
    if (decode_has_ucx) decode_config.ucx = receiver_link;
    decode = spawn_decode_worker(*system_, tiny.model, tiny.tokenizer, registry_, decode_config);
    PrefillWorkerConfig prefill_config;
    prefill_config.chunk_tokens = 4;
    prefill_config.heartbeat_interval = 100ms;
    auto transport = std::make_shared<SwitchingTransport>(
        make_ucx_transport(faulty_link), make_ucx_transport(clean_link), faulty_sends < 0 ? 1 << 30 : faulty_sends);
    prefill = spawn_prefill_worker(*system_, tiny.model, registry_, prefill_config, transport);
    join(WorkerInfo{"prefill-0", kPrefillRole, caf::actor_cast<caf::actor>(prefill), 4, {}, 0, {}});
    WorkerLoad load;
    load.free_slots = 4;
    join(WorkerInfo{"decode-0", kDecodeRole, caf::actor_cast<caf::actor>(decode), 4, load, 0, {}});
    service = std::make_unique<ClusterService>(
        std::unique_ptr<ClusterService::Impl>(new ClusterService::Impl{*system_, router, gauges_}));
    ok = true;
  }

  ~UcxFaultCluster() {
    service.reset();
    for (UcxLink* link : {faulty_link.get(), clean_link.get(), receiver_link.get()}) {
      if (link) link->close();
    }
    if (!system_) return;
    caf::anon_send_exit(prefill, caf::exit_reason::user_shutdown);
    caf::anon_send_exit(decode, caf::exit_reason::user_shutdown);
    caf::anon_send_exit(router, caf::exit_reason::user_shutdown);
    caf::anon_send_exit(registry_, caf::exit_reason::user_shutdown);
    prefill = nullptr;
    decode = nullptr;
    router = nullptr;
    registry_ = nullptr;
    system_.reset();
  }

  void join(const WorkerInfo& info) {
    caf::scoped_actor self{*system_};
    self->request(registry_, 5s, join_atom::value, info)
        .receive([](uint64_t) {}, [&](caf::error& e) { ADD_FAILURE() << "join: " << system_->render(e); });
  }

  RouterStats router_stats() {
    RouterStats out;
    caf::scoped_actor self{*system_};
    self->request(router, 5s, stats_atom::value).receive([&](const RouterStats& s) { out = s; }, [](caf::error&) {});
    return out;
  }

  WorkerStats decode_stats() {
    WorkerStats out;
    caf::scoped_actor self{*system_};
    self->request(decode, 5s, stats_atom::value).receive([&](const WorkerStats& s) { out = s; }, [](caf::error&) {});
    return out;
  }

  bool all_released() {
    return released(faulty_link->engine().stats()) && released(clean_link->engine().stats()) &&
           released(receiver_link->engine().stats());
  }
  std::string describe_all() {
    return "faulty: " + describe(faulty_link->engine().stats()) + "; clean: " + describe(clean_link->engine().stats()) +
           "; receiver: " + describe(receiver_link->engine().stats());
  }

  bool ok = false;
  std::shared_ptr<UcxLink> faulty_link, clean_link, receiver_link;
  std::unique_ptr<ClusterService> service;
  router_actor router;
  decode_actor decode;
  prefill_actor prefill;

 private:
  caf::actor_system_config config_;
  std::unique_ptr<caf::actor_system> system_;
  registry_actor registry_;
  std::shared_ptr<RouterGauges> gauges_;
};

const std::vector<int32_t> kPrompt{11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23};
constexpr int64_t kMaxTokens = 6;

struct FaultCase {
  const char* name;
  const char* faults;
};

class UcxFirstHandoffFaultTest : public ::testing::TestWithParam<FaultCase> {};

// The first handoff fails in transfer; the request is prefilled again and its output is the reference.
TEST_P(UcxFirstHandoffFaultTest, RePrefillCompletesWithReferenceOutput) {
  const auto& tiny = testing::tiny_model();
  ASSERT_TRUE(tiny.model);
  UcxFaultCluster cluster(GetParam().faults, 1);
  ASSERT_TRUE(cluster.ok);
  ASSERT_TRUE(wait_until([&] { return cluster.service->status().ready; }, 5s));
  auto sink = std::make_shared<CollectingSink>();
  const auto start = std::chrono::steady_clock::now();
  cluster.service->submit(testing::greedy_request("f", kPrompt, kMaxTokens), sink);
  ASSERT_TRUE(sink->wait_final(20s)) << "hang";
  const auto elapsed = std::chrono::steady_clock::now() - start;
  EXPECT_LT(elapsed, 10s);
  const auto last = sink->last();
  EXPECT_TRUE(last.error.is_ok()) << last.error.to_string();
  EXPECT_EQ(sink->tokens(), testing::reference_greedy(*tiny.model, kPrompt, kMaxTokens, 4));
  const RouterStats router = cluster.router_stats();
  EXPECT_GE(router.retried, 1);
  EXPECT_EQ(router.failed, 0);
  const WorkerStats decode = cluster.decode_stats();
  EXPECT_EQ(decode.rejected, 1);        // the failed transfer, counted, not decoded
  EXPECT_EQ(decode.handoffs, 1);        // only the good state was accepted
  EXPECT_EQ(decode.steps, kMaxTokens);  // and only it was decoded
  EXPECT_TRUE(wait_until([&] { return cluster.all_released(); }, 10s)) << cluster.describe_all();
}

INSTANTIATE_TEST_SUITE_P(Faults, UcxFirstHandoffFaultTest,
                         ::testing::Values(FaultCase{"DropPiece", "send.drop_piece:1"},
                                           FaultCase{"CorruptByte", "send.corrupt_byte:0"},
                                           FaultCase{"DelayPastDeadline", "send.delay_piece:0:2500"},
                                           FaultCase{"PeerEndpointKilled", "send.kill_endpoint:1"}),
                         [](const ::testing::TestParamInfo<FaultCase>& info) { return info.param.name; });

// Every handoff is corrupted: after the router's attempts the client gets a clean error; nothing decoded.
TEST(UcxTransportFaultTest, EveryHandoffCorruptEndsInCleanError) {
  UcxFaultCluster cluster("send.corrupt_byte:0", -1);
  ASSERT_TRUE(cluster.ok);
  ASSERT_TRUE(wait_until([&] { return cluster.service->status().ready; }, 5s));
  auto sink = std::make_shared<CollectingSink>();
  cluster.service->submit(testing::greedy_request("bad", kPrompt, kMaxTokens), sink);
  ASSERT_TRUE(sink->wait_final(20s)) << "hang";
  const auto last = sink->last();
  EXPECT_FALSE(last.error.is_ok());
  EXPECT_EQ(last.error.code(), StatusCode::kDataLoss) << last.error.to_string();
  EXPECT_TRUE(sink->tokens().empty());
  const RouterStats router = cluster.router_stats();
  EXPECT_EQ(router.failed, 1);
  EXPECT_EQ(router.retried, RouterConfig{}.max_attempts - 1);
  const WorkerStats decode = cluster.decode_stats();
  EXPECT_EQ(decode.rejected, RouterConfig{}.max_attempts);
  EXPECT_EQ(decode.handoffs, 0);
  EXPECT_EQ(decode.steps, 0);
  EXPECT_TRUE(wait_until([&] { return cluster.all_released(); }, 10s)) << cluster.describe_all();
}

// A client cancels while the state is in transfer (its first piece held back past the deadline): the
// request ends with "abort", it is not prefilled again, and the transfer's resources are released.
TEST(UcxTransportFaultTest, CancelDuringTransferAbortsAndReleases) {
  UcxFaultCluster cluster("send.delay_piece:0:2500", -1);
  ASSERT_TRUE(cluster.ok);
  ASSERT_TRUE(wait_until([&] { return cluster.service->status().ready; }, 5s));
  auto sink = std::make_shared<CollectingSink>();
  cluster.service->submit(testing::greedy_request("cx", kPrompt, kMaxTokens), sink);
  ASSERT_TRUE(wait_until([&] { return cluster.receiver_link->engine().stats().transfers_pending == 1; }, 5s));
  cluster.service->cancel("cx");
  ASSERT_TRUE(sink->wait_final(20s)) << "hang";
  EXPECT_EQ(sink->last().finish_reason.value_or(""), "abort") << sink->last().error.to_string();
  EXPECT_TRUE(sink->tokens().empty());
  EXPECT_EQ(cluster.router_stats().retried, 0);
  EXPECT_EQ(cluster.decode_stats().steps, 0);
  EXPECT_TRUE(wait_until([&] { return cluster.all_released(); }, 10s)) << cluster.describe_all();
}

// A decode worker without UCX refuses the reservation: the sender reports it, the router retries, then the
// client gets a clean error (no transfer was started).
TEST(UcxTransportFaultTest, ReceiverWithoutUcxRefusesCleanly) {
  UcxFaultCluster cluster("", -1, /*decode_has_ucx=*/false);
  ASSERT_TRUE(cluster.ok);
  ASSERT_TRUE(wait_until([&] { return cluster.service->status().ready; }, 5s));
  auto sink = std::make_shared<CollectingSink>();
  cluster.service->submit(testing::greedy_request("nox", kPrompt, kMaxTokens), sink);
  ASSERT_TRUE(sink->wait_final(20s)) << "hang";
  EXPECT_EQ(sink->last().error.code(), StatusCode::kFailedPrecondition) << sink->last().error.to_string();
  EXPECT_EQ(cluster.router_stats().failed, 1);
  EXPECT_EQ(cluster.decode_stats().steps, 0);
  EXPECT_TRUE(cluster.all_released()) << cluster.describe_all();
}

// The release transfer library refuses fault specs; this binary must not have it (see the file comment).
TEST(UcxTransportFaultTest, FaultInjectionIsCompiledIntoThisBinary) {
  auto link = UcxLink::create(loopback_link("send.drop_piece:0"));
  EXPECT_TRUE(link.is_ok()) << link.status().to_string();
}

}  // namespace
}  // namespace deltaserve::actors
