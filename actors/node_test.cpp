// Whole-cluster tests through ClusterService: an in-process Node (serve roles), and the remote path
// (registry published on a loopback port, workers in other actor systems of this process).
#include "actors/node.hpp"

#include <gtest/gtest.h>

#include "actors/test_model.hpp"
#include "actors/test_sink.hpp"

namespace deltaserve::actors {
namespace {

using namespace std::chrono_literals;

using testing::CollectingSink;
using testing::wait_until;

NodeOptions serve_options() {
  return testing::tiny_serve_options();
}

TEST(ClusterNodeTest, ServeGreedyMatchesDirectEngineLoop) {
  const auto& tiny = testing::tiny_model();
  ASSERT_TRUE(tiny.model);
  auto node = Node::start(serve_options());
  ASSERT_TRUE(node.is_ok()) << node.status().to_string();
  router::InferenceService& service = *(*node)->service();
  ASSERT_TRUE(wait_until([&] { return service.status().ready; }, 5s));

  const std::vector<std::vector<int32_t>> prompts{{5, 6, 7, 8, 9, 10, 11, 12, 13, 14}, {42}, {3, 1, 4, 1, 5}};
  std::vector<std::shared_ptr<CollectingSink>> sinks;
  for (size_t i = 0; i < prompts.size(); ++i) {
    sinks.push_back(std::make_shared<CollectingSink>());
    service.submit(testing::greedy_request("g" + std::to_string(i), prompts[i], 8), sinks.back());
  }
  for (size_t i = 0; i < prompts.size(); ++i) {
    ASSERT_TRUE(sinks[i]->wait_final(10s));
    const auto last = sinks[i]->last();
    EXPECT_TRUE(last.error.is_ok()) << last.error.to_string();
    EXPECT_EQ(last.finish_reason.value_or(""), "length");
    EXPECT_EQ(last.completion_tokens, 8);
    EXPECT_EQ(last.prompt_tokens, static_cast<int64_t>(prompts[i].size()));
    EXPECT_EQ(sinks[i]->tokens(), testing::reference_greedy(*tiny.model, prompts[i], 8, 4)) << "request " << i;
  }
  const NodeWorkerStats stats = (*node)->worker_stats();
  EXPECT_EQ(stats.handoffs, 2 * 3);  // sent by the prefill worker + accepted by the decode worker
  EXPECT_GT(stats.handoff_bytes, 0);
  EXPECT_TRUE(wait_until([&] { return service.status().running == 0; }, 5s));
  (*node)->shutdown();
}

TEST(ClusterNodeTest, CancelFreesSlots) {
  auto node = Node::start(serve_options());
  ASSERT_TRUE(node.is_ok()) << node.status().to_string();
  router::InferenceService& service = *(*node)->service();
  ASSERT_TRUE(wait_until([&] { return service.status().ready; }, 5s));
  std::vector<std::shared_ptr<CollectingSink>> sinks;
  for (int i = 0; i < 4; ++i) {  // fill every slot with long requests
    sinks.push_back(std::make_shared<CollectingSink>());
    service.submit(testing::greedy_request("long" + std::to_string(i), {7, 8, 9}, 100000), sinks.back());
  }
  for (auto& s : sinks) ASSERT_TRUE(s->wait_chunks(2, 10s));
  for (int i = 0; i < 4; ++i) service.cancel("long" + std::to_string(i));
  for (auto& s : sinks) {
    ASSERT_TRUE(s->wait_final(10s));
    EXPECT_EQ(s->last().finish_reason.value_or(""), "abort");
  }
  EXPECT_TRUE(wait_until([&] { return (*node)->worker_stats().free_slots == 4; }, 5s));
  EXPECT_TRUE(wait_until([&] { return service.status().running == 0; }, 5s));
  // The slots serve new requests.
  auto after = std::make_shared<CollectingSink>();
  service.submit(testing::greedy_request("after", {1, 2, 3}, 3), after);
  ASSERT_TRUE(after->wait_final(10s));
  EXPECT_EQ(after->last().finish_reason.value_or(""), "length");
  service.cancel("unknown-id");  // ignored
  (*node)->shutdown();
}

TEST(ClusterNodeTest, RemoteWorkersJoinOverLoopback) {
  const auto& tiny = testing::tiny_model();
  ASSERT_TRUE(tiny.model);
  NodeOptions router_options = testing::remote_router_options();
  auto router_node = Node::start(router_options);
  ASSERT_TRUE(router_node.is_ok()) << router_node.status().to_string();
  const uint16_t port = (*router_node)->cluster_port();
  ASSERT_NE(port, 0);
  router::InferenceService& service = *(*router_node)->service();
  EXPECT_FALSE(service.status().ready);

  NodeOptions worker = serve_options();
  worker.join = {{"127.0.0.1", port}};
  worker.join_timeout = 5s;
  worker.role = NodeRole::kPrefill;
  auto prefill = Node::start(worker);
  ASSERT_TRUE(prefill.is_ok()) << prefill.status().to_string();
  worker.role = NodeRole::kDecode;
  auto decode = Node::start(worker);
  ASSERT_TRUE(decode.is_ok()) << decode.status().to_string();
  ASSERT_TRUE(wait_until([&] { return service.status().ready; }, 5s));

  const std::vector<int32_t> prompt{9, 8, 7, 6, 5, 4, 3};
  auto sink = std::make_shared<CollectingSink>();
  service.submit(testing::greedy_request("remote", prompt, 6), sink);
  ASSERT_TRUE(sink->wait_final(10s));
  EXPECT_TRUE(sink->last().error.is_ok()) << sink->last().error.to_string();
  EXPECT_EQ(sink->tokens(), testing::reference_greedy(*tiny.model, prompt, 6, 4));

  // A decode worker that goes away is noticed: readiness drops.
  (*decode)->shutdown();
  EXPECT_TRUE(wait_until([&] { return !service.status().ready; }, 5s));
  (*prefill)->shutdown();
  (*router_node)->shutdown();
}

// A worker node of the tiny model that joins the routers at `ports` and joins a lost one again quickly.
NodeOptions joining_worker(NodeRole role, const std::vector<uint16_t>& ports) {
  NodeOptions o = serve_options();
  o.role = role;
  for (uint16_t port : ports) o.join.push_back({"127.0.0.1", port});
  o.join_timeout = 30s;
  o.rejoin_backoff_initial = 20ms;
  o.rejoin_backoff_max = 200ms;
  return o;
}

// One greedy request through `service`: it completes with the reference tokens.
void expect_completes(router::InferenceService& service, const std::string& id) {
  const std::vector<int32_t> prompt{9, 8, 7, 6, 5, 4, 3};
  auto sink = std::make_shared<CollectingSink>();
  service.submit(testing::greedy_request(id, prompt, 6), sink);
  ASSERT_TRUE(sink->wait_final(30s)) << id;
  EXPECT_TRUE(sink->last().error.is_ok()) << id << ": " << sink->last().error.to_string();
  EXPECT_EQ(sink->tokens(), testing::reference_greedy(*testing::tiny_model().model, prompt, 6, 4)) << id;
}

// A router that crashes and is started again on the same cluster port gets its workers back: they notice the
// lost connection, join the new registry (backoff), and serve its requests. Before, they stayed joined to the
// dead registry and the new router never became ready.
// The handoff goes over the prefill node's direct connection to the decode node (actors/decode_peers.hpp), so
// the restarted router's requests are served although the router that introduced the two nodes is gone.
TEST(ClusterNodeTest, WorkersJoinARestartedRouterAgain) {
  ASSERT_TRUE(testing::tiny_model().model);
  auto router_node = Node::start(testing::remote_router_options());
  ASSERT_TRUE(router_node.is_ok()) << router_node.status().to_string();
  const uint16_t port = (*router_node)->cluster_port();
  auto prefill = Node::start(joining_worker(NodeRole::kPrefill, {port}));
  ASSERT_TRUE(prefill.is_ok()) << prefill.status().to_string();
  auto decode = Node::start(joining_worker(NodeRole::kDecode, {port}));
  ASSERT_TRUE(decode.is_ok()) << decode.status().to_string();
  ASSERT_TRUE(wait_until([&] { return (*router_node)->service()->status().ready; }, 30s));
  EXPECT_EQ((*decode)->routers_joined(), 1);
  expect_completes(*(*router_node)->service(), "before");

  (*router_node)->shutdown();  // the router process is gone: its connections close
  ASSERT_TRUE(wait_until([&] { return (*prefill)->routers_joined() == 0 && (*decode)->routers_joined() == 0; }, 30s));
  // Orphaned for less than orphan_timeout (60 s): still live.
  EXPECT_TRUE((*decode)->liveness(10s).is_ok());

  NodeOptions again = testing::remote_router_options();
  again.cluster_port = port;
  auto restarted = Node::start(again);
  ASSERT_TRUE(restarted.is_ok()) << restarted.status().to_string();
  ASSERT_TRUE(wait_until([&] { return (*restarted)->service()->status().ready; }, 30s))
      << (*restarted)->service()->status().reason;
  ASSERT_TRUE(wait_until([&] { return (*prefill)->routers_joined() == 1 && (*decode)->routers_joined() == 1; }, 30s));
  expect_completes(*(*restarted)->service(), "after");

  (*decode)->shutdown();
  (*prefill)->shutdown();
  (*restarted)->shutdown();
}

// One prefill and one decode worker joined to two routers, each with its own registry: both routers serve; one
// router crashing with a stream in flight ends only that stream (the decode worker frees its slot), and the
// other router keeps serving.
// The handoffs after the loss go over the workers' direct connection, as in WorkersJoinARestartedRouterAgain.
TEST(ClusterNodeTest, WorkersServeTwoRoutersAndOutliveOne) {
  ASSERT_TRUE(testing::tiny_model().model);
  auto first = Node::start(testing::remote_router_options());
  ASSERT_TRUE(first.is_ok()) << first.status().to_string();
  auto second = Node::start(testing::remote_router_options());
  ASSERT_TRUE(second.is_ok()) << second.status().to_string();
  const std::vector<uint16_t> ports{(*first)->cluster_port(), (*second)->cluster_port()};
  auto prefill = Node::start(joining_worker(NodeRole::kPrefill, ports));
  ASSERT_TRUE(prefill.is_ok()) << prefill.status().to_string();
  auto decode = Node::start(joining_worker(NodeRole::kDecode, ports));
  ASSERT_TRUE(decode.is_ok()) << decode.status().to_string();
  ASSERT_TRUE(wait_until([&] { return (*prefill)->routers_joined() == 2 && (*decode)->routers_joined() == 2; }, 30s));
  ASSERT_TRUE(wait_until([&] { return (*first)->service()->status().ready; }, 30s));
  ASSERT_TRUE(wait_until([&] { return (*second)->service()->status().ready; }, 30s));
  expect_completes(*(*first)->service(), "via-first");
  expect_completes(*(*second)->service(), "via-second");

  // A long stream through the first router, then that router goes away.
  auto held = std::make_shared<CollectingSink>();
  (*first)->service()->submit(testing::greedy_request("held", {7, 8, 9}, 100000), held);
  ASSERT_TRUE(held->wait_chunks(2, 30s));
  (*first)->shutdown();
  ASSERT_TRUE(wait_until([&] { return (*decode)->routers_joined() == 1; }, 30s));
  EXPECT_TRUE(wait_until([&] { return (*decode)->worker_stats().free_slots == 4; }, 30s))
      << "the dropped stream's decode slot is freed";
  expect_completes(*(*second)->service(), "via-second-after");

  (*decode)->shutdown();
  (*prefill)->shutdown();
  (*second)->shutdown();
}

// Liveness of a worker node: OK while joined; Unavailable once joined to no router for longer than
// orphan_timeout; OK again once it has joined a router again.
TEST(ClusterNodeTest, OrphanedWorkerFailsLivenessUntilItJoinsAgain) {
  auto router_node = Node::start(testing::remote_router_options());
  ASSERT_TRUE(router_node.is_ok()) << router_node.status().to_string();
  const uint16_t port = (*router_node)->cluster_port();
  NodeOptions o = joining_worker(NodeRole::kDecode, {port});
  o.orphan_timeout = 200ms;
  auto decode = Node::start(o);
  ASSERT_TRUE(decode.is_ok()) << decode.status().to_string();
  EXPECT_TRUE((*decode)->liveness(10s).is_ok());

  (*router_node)->shutdown();
  Status live = Status::ok();
  ASSERT_TRUE(wait_until(
      [&] {
        live = (*decode)->liveness(10s);
        return !live.is_ok();
      },
      30s));
  EXPECT_EQ(live.code(), StatusCode::kUnavailable);
  EXPECT_NE(live.message().find("joined to no router"), std::string::npos) << live.to_string();

  NodeOptions again = testing::remote_router_options();
  again.cluster_port = port;
  auto restarted = Node::start(again);
  ASSERT_TRUE(restarted.is_ok()) << restarted.status().to_string();
  EXPECT_TRUE(wait_until([&] { return (*decode)->liveness(10s).is_ok(); }, 30s));
  EXPECT_EQ((*decode)->routers_joined(), 1);
  (*decode)->shutdown();
  (*restarted)->shutdown();
}

TEST(ClusterNodeTest, JoinFailsAtDeadlineWithoutRegistry) {
  NodeOptions o = serve_options();
  o.role = NodeRole::kDecode;
  o.join = {{"127.0.0.1", 1}};  // nothing listens there
  o.join_timeout = 300ms;
  auto node = Node::start(o);
  ASSERT_FALSE(node.is_ok());
  EXPECT_EQ(node.status().code(), StatusCode::kDeadlineExceeded);
}

}  // namespace
}  // namespace deltaserve::actors
