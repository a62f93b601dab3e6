// The prefix cache through the whole in-process cluster (router → prefill worker → decode worker), against
// independent references: greedy output of a cached request equals the direct engine loop that computes
// everything (cold); cached_tokens equals the depth an independent model of the policy predicts; pages
// and state slots come back to the same level when idle; tenants never share.
#include <random>
#include <set>

#include <gtest/gtest.h>

#include "actors/node.hpp"
#include "actors/test_model.hpp"
#include "actors/test_sink.hpp"
#include "common/temp_dir.hpp"

namespace deltaserve::actors {
namespace {

using namespace std::chrono_literals;
using testing::CollectingSink;
using testing::wait_until;

constexpr int64_t kBlock = 512;
constexpr int64_t kMaxTokens = 6;

NodeOptions cache_options(int64_t checkpoint_interval) {
  NodeOptions o = testing::tiny_serve_options();
  o.prefill_chunk = 512;
  // Expiry after ten missed reports (20 s). A prefill worker reports between chunks, and under ASan on a 2-core CI
  // machine, beside other cluster tests, one 512-token chunk over a 4k context has taken more than the 5 s that a
  // 500 ms interval allowed: the workers were dropped as lost and the request failed after its retries.
  o.heartbeat_interval = 2s;
  o.cache_page_tokens = 1024;
  o.checkpoint_interval_blocks = checkpoint_interval;
  o.model_id = "tiny-linear-test";
  return o;
}

std::vector<int32_t> random_prompt(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> out(static_cast<size_t>(n));
  const auto vocab = static_cast<uint32_t>(testing::tiny_model().model->config().vocab_size);
  for (auto& t : out) t = static_cast<int32_t>(rng() % vocab);
  return out;
}

// `prefix` tokens of `base`, then a tail of its own.
std::vector<int32_t> fork_prompt(const std::vector<int32_t>& base, int64_t prefix, int64_t total, uint32_t seed) {
  std::vector<int32_t> out(base.begin(), base.begin() + prefix);
  const auto tail = random_prompt(total - prefix, seed);
  out.insert(out.end(), tail.begin(), tail.end());
  return out;
}

struct Outcome {
  std::vector<int32_t> tokens;
  int64_t cached_tokens = -1;
};

Outcome run(router::InferenceService& service, const std::string& id, const std::vector<int32_t>& prompt,
            const std::string& cache_namespace = "default") {
  auto sink = std::make_shared<CollectingSink>();
  auto request = testing::greedy_request(id, prompt, kMaxTokens);
  request.tenant = cache_namespace;
  request.cache_namespace = cache_namespace;
  service.submit(std::move(request), sink);
  EXPECT_TRUE(sink->wait_final(30s)) << id;
  const auto last = sink->last();
  EXPECT_TRUE(last.error.is_ok()) << id << ": " << last.error.to_string();
  EXPECT_EQ(last.prompt_tokens, static_cast<int64_t>(prompt.size()));
  return {sink->tokens(), last.cached_tokens};
}

// An independent model of the worker's policy: which boundaries hold a checkpoint after the prompts seen
// so far (every `interval`-th boundary and each prompt's last full block of its first N−1 tokens), and the
// usable depth of a new prompt = the deepest checkpointed boundary it shares, within its first N−1 tokens.
class PolicyModel {
 public:
  explicit PolicyModel(int64_t interval) : interval_(interval) {}
  int64_t expected_hit(const std::vector<int32_t>& prompt) const {
    const int64_t usable = (static_cast<int64_t>(prompt.size()) - 1) / kBlock;
    int64_t best = 0;
    for (int64_t k = 1; k <= usable; ++k) {
      const std::vector<int32_t> prefix(prompt.begin(), prompt.begin() + k * kBlock);
      if (checkpointed_.count(prefix)) best = k;
    }
    return best * kBlock;
  }
  void record(const std::vector<int32_t>& prompt) {
    const int64_t full = (static_cast<int64_t>(prompt.size()) - 1) / kBlock;
    for (int64_t k = 1; k <= full; ++k) {
      if (k % interval_ == 0 || k == full) checkpointed_.insert({prompt.begin(), prompt.begin() + k * kBlock});
    }
  }

 private:
  int64_t interval_;
  std::set<std::vector<int32_t>> checkpointed_;
};

class PrefixCacheCluster : public ::testing::TestWithParam<int64_t> {};

TEST_P(PrefixCacheCluster, CachedOutputEqualsColdAndCachedTokensEqualTheClampedDepth) {
  const auto& tiny = testing::tiny_model();
  ASSERT_TRUE(tiny.model);
  const int64_t interval = GetParam();
  auto node = Node::start(cache_options(interval));
  ASSERT_TRUE(node.is_ok()) << node.status().to_string();
  router::InferenceService& service = *(*node)->service();
  ASSERT_TRUE(wait_until([&] { return service.status().ready; }, 5s));

  const auto base = random_prompt(4 * kBlock + 77, 1);
  const std::vector<std::vector<int32_t>> prompts{
      base,                                                           // cold
      base,                                                           // the same again: deepest usable boundary
      fork_prompt(base, 2 * kBlock + 13, 3 * kBlock, 2),              // shares 2 blocks (+13 tokens)
      fork_prompt(base, 3 * kBlock, 3 * kBlock + 1, 3),               // shares exactly 3 blocks; N−1 = 3 blocks
      std::vector<int32_t>(base.begin(), base.begin() + 2 * kBlock),  // N−1 = 1023: only block 1 usable
      random_prompt(300, 4),                                          // shorter than a block
      fork_prompt(base, kBlock - 1, 2 * kBlock + 5, 5),               // differs inside block 1
      base,                                                           // again, after the others
  };
  PolicyModel policy(interval);
  int64_t hits = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    const std::string id = "p" + std::to_string(i);
    const int64_t expected = policy.expected_hit(prompts[i]);
    const Outcome got = run(service, id, prompts[i]);
    EXPECT_EQ(got.tokens, testing::reference_greedy(*tiny.model, prompts[i], kMaxTokens, 512)) << id;
    EXPECT_EQ(got.cached_tokens, expected) << id;
    hits += expected > 0;
    policy.record(prompts[i]);
  }
  EXPECT_GE(hits, interval == 1 ? 4 : 3);  // the workload really exercises hits at several depths

  // Idle: every state slot is free; repeating the workload (all hits now) holds no more pages afterwards.
  ASSERT_TRUE(wait_until([&] { return service.status().running == 0; }, 5s));
  const NodeWorkerStats before = (*node)->worker_stats();
  EXPECT_EQ(before.slots_free, before.slots_total);
  EXPECT_GT(before.cache_entries, 0);
  EXPECT_LT(before.pages_free, before.pages_total);
  for (size_t i = 0; i < prompts.size(); ++i) {
    const Outcome again = run(service, "again" + std::to_string(i), prompts[i]);
    EXPECT_EQ(again.cached_tokens, policy.expected_hit(prompts[i])) << i;
  }
  ASSERT_TRUE(wait_until([&] { return service.status().running == 0; }, 5s));
  const NodeWorkerStats after = (*node)->worker_stats();
  EXPECT_EQ(after.slots_free, after.slots_total);
  EXPECT_EQ(after.pages_free, before.pages_free);
  EXPECT_EQ(after.cache_entries, before.cache_entries);
  EXPECT_EQ(after.cached_tokens - before.cached_tokens, [&] {
    int64_t sum = 0;
    for (const auto& p : prompts) sum += policy.expected_hit(p);
    return sum;
  }());
  (*node)->shutdown();
}

INSTANTIATE_TEST_SUITE_P(CheckpointIntervals, PrefixCacheCluster, ::testing::Values(1, 4));

TEST(PrefixCacheCluster, TenantNamespacesNeverShare) {
  const auto& tiny = testing::tiny_model();
  ASSERT_TRUE(tiny.model);
  auto node = Node::start(cache_options(1));
  ASSERT_TRUE(node.is_ok()) << node.status().to_string();
  router::InferenceService& service = *(*node)->service();
  ASSERT_TRUE(wait_until([&] { return service.status().ready; }, 5s));
  const auto prompt = random_prompt(3 * kBlock + 9, 9);
  const auto cold = testing::reference_greedy(*tiny.model, prompt, kMaxTokens, 512);

  EXPECT_EQ(run(service, "a1", prompt, "tenant-a").cached_tokens, 0);
  const Outcome a2 = run(service, "a2", prompt, "tenant-a");
  EXPECT_EQ(a2.cached_tokens, 3 * kBlock);  // paired: the same prompt does hit for its own tenant
  EXPECT_EQ(a2.tokens, cold);
  const Outcome b1 = run(service, "b1", prompt, "tenant-b");
  EXPECT_EQ(b1.cached_tokens, 0);
  EXPECT_EQ(b1.tokens, cold);
  EXPECT_EQ(run(service, "b2", prompt, "tenant-b").cached_tokens, 3 * kBlock);  // b's own entry now
  EXPECT_EQ(run(service, "c1", prompt, "tenant-c").cached_tokens, 0);
  (*node)->shutdown();
}

TEST(PrefixCacheCluster, CacheOffComputesEverything) {
  const auto& tiny = testing::tiny_model();
  ASSERT_TRUE(tiny.model);
  NodeOptions o = cache_options(1);
  o.prefix_cache = false;
  auto node = Node::start(o);
  ASSERT_TRUE(node.is_ok()) << node.status().to_string();
  router::InferenceService& service = *(*node)->service();
  ASSERT_TRUE(wait_until([&] { return service.status().ready; }, 5s));
  const auto prompt = random_prompt(2 * kBlock + 3, 11);
  EXPECT_EQ(run(service, "x1", prompt).cached_tokens, 0);
  EXPECT_EQ(run(service, "x2", prompt).cached_tokens, 0);
  const NodeWorkerStats stats = (*node)->worker_stats();
  EXPECT_EQ(stats.pages_total, 0);
  EXPECT_EQ(stats.cached_tokens, 0);
  (*node)->shutdown();
}

TEST(PrefixCacheCluster, BadCacheSettingsNameTheField) {
  NodeOptions o = cache_options(1);
  o.cache_page_tokens = 1000;
  auto node = Node::start(o);
  ASSERT_FALSE(node.is_ok());
  EXPECT_NE(node.status().message().find("page_tokens"), std::string::npos) << node.status().to_string();
  o = cache_options(1);
  o.cache_key_hex = "xyz";
  node = Node::start(o);
  ASSERT_FALSE(node.is_ok());
  EXPECT_NE(node.status().message().find("cache key"), std::string::npos) << node.status().to_string();
  o = cache_options(1);
  o.routing_policy = "random";
  node = Node::start(o);
  ASSERT_FALSE(node.is_ok());
  EXPECT_NE(node.status().message().find("routing policy"), std::string::npos) << node.status().to_string();
}

}  // namespace
}  // namespace deltaserve::actors

namespace deltaserve::actors {
namespace {

// Two prefill workers; prompt P (8 blocks + 1) is cached on the first. Then a cold request X (6 blocks,
// long enough to still be prefilling when the next submit is placed) is queued on the first worker, and
// P comes again: load-only placement sends P to the idle second worker (a miss), cache-aware placement
// keeps it with its cached prefix (expected work: X's 3071 tokens < all 4096 of P on the other worker).
int64_t cached_tokens_of_repeat(const std::string& policy, const std::filesystem::path& index_dir) {
  NodeOptions o = cache_options(1);
  o.prefill_workers = 2;
  o.index_dir = index_dir;
  o.routing_policy = policy;
  auto node = Node::start(o);
  EXPECT_TRUE(node.is_ok()) << node.status().to_string();
  if (!node.is_ok()) return -1;
  router::InferenceService& service = *(*node)->service();
  EXPECT_TRUE(wait_until([&] { return service.status().ready; }, 5s));
  const auto p = random_prompt(8 * kBlock + 1, 21);
  EXPECT_EQ(run(service, "p-cold", p).cached_tokens, 0);
  // The index hears of P's blocks through the registry.
  EXPECT_TRUE(wait_until([&] { return (*node)->router_stats().index_events >= 8; }, 20s));

  auto x = std::make_shared<CollectingSink>();
  auto again = std::make_shared<CollectingSink>();
  service.submit(testing::greedy_request("x", random_prompt(6 * kBlock, 22), kMaxTokens), x);
  service.submit(testing::greedy_request("p-again", p, kMaxTokens), again);
  EXPECT_TRUE(x->wait_final(30s));
  EXPECT_TRUE(again->wait_final(30s));
  EXPECT_EQ(again->tokens(), testing::reference_greedy(*testing::tiny_model().model, p, kMaxTokens, 512));
  const NodeRouterStats stats = (*node)->router_stats();
  EXPECT_EQ(stats.index_errors, 0);
  if (policy == "cache-aware") {
    EXPECT_EQ(stats.routed_to_hit, 1);
    EXPECT_EQ(stats.expected_cached_tokens, 8 * kBlock);
  } else {
    EXPECT_EQ(stats.routed_to_hit, 0);
  }
  (*node)->shutdown();
  return again->last().cached_tokens;
}

TEST(PrefixCacheRouting, CacheAwarePlacementFollowsTheCachedPrefixLoadOnlyDoesNot) {
  ASSERT_TRUE(testing::tiny_model().model);
  TempDir dir;
  EXPECT_EQ(cached_tokens_of_repeat("cache-aware", dir.path() / "aware"), 8 * kBlock);
  EXPECT_EQ(cached_tokens_of_repeat("load", dir.path() / "load"), 0);
}

}  // namespace
}  // namespace deltaserve::actors
