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
  worker.join_host = "127.0.0.1";
  worker.join_port = port;
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

TEST(ClusterNodeTest, JoinFailsAtDeadlineWithoutRegistry) {
  NodeOptions o = serve_options();
  o.role = NodeRole::kDecode;
  o.join_port = 1;  // nothing listens there
  o.join_timeout = 300ms;
  auto node = Node::start(o);
  ASSERT_FALSE(node.is_ok());
  EXPECT_EQ(node.status().code(), StatusCode::kDeadlineExceeded);
}

}  // namespace
}  // namespace deltaserve::actors
