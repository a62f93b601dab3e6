#include "router/placement.hpp"

#include <vector>

#include <gtest/gtest.h>

namespace deltaserve::router {
namespace {

constexpr int64_t kBlock = 512;
const PlacementOptions kCacheAware{RoutingPolicy::kCacheAware, kBlock};
const PlacementOptions kLoadOnly{RoutingPolicy::kLoadOnly, kBlock};

PrefillCandidate prefill(std::string_view name, uint64_t epoch, int64_t queued_tokens = 0, int64_t jobs = 0,
                         int64_t queue_length = 0) {
  return {name, epoch, queued_tokens, jobs, queue_length};
}

TEST(Placement, UsableBlocksLeaveTheLastTokenToTheDecodeWorker) {
  EXPECT_EQ(usable_blocks(0, kBlock), 0);
  EXPECT_EQ(usable_blocks(1, kBlock), 0);
  EXPECT_EQ(usable_blocks(kBlock, kBlock), 0);  // prompt[0, 511) has no full block
  EXPECT_EQ(usable_blocks(kBlock + 1, kBlock), 1);
  EXPECT_EQ(usable_blocks(3 * kBlock, kBlock), 2);
  EXPECT_EQ(index_lookup_blocks(kCacheAware, 3 * kBlock + 1), 3);
  EXPECT_EQ(index_lookup_blocks(kLoadOnly, 3 * kBlock + 1), 0);
  EXPECT_EQ(index_lookup_blocks(kCacheAware, kBlock), 0);
}

TEST(Placement, CacheAwareChoosesTheCachedPrefixAndSaysWhy) {
  const int64_t prompt = 4 * kBlock + 10;  // 4 usable blocks
  const std::vector<PrefillCandidate> workers{prefill("prefill-a", 7, 100), prefill("prefill-b", 9, 300),
                                              prefill("prefill-c", 3, 0)};
  // b holds 3 blocks with a checkpoint at 3; a holds pages only (a match of 0 usable blocks).
  const std::vector<IndexMatch> matches{{"prefill-b", 9, 3}, {"prefill-a", 7, 0}};
  const PrefillChoice choice = choose_prefill(kCacheAware, prompt, workers, matches);
  ASSERT_TRUE(choice.worker.has_value());
  EXPECT_EQ(*choice.worker, 1u);
  EXPECT_EQ(choice.name, "prefill-b");
  EXPECT_EQ(choice.hit_tokens, 3 * kBlock);
  EXPECT_EQ(choice.queued_tokens, 300);
  EXPECT_EQ(choice.expected_tokens, 300 + (prompt - 1 - 3 * kBlock));
  EXPECT_EQ(choice.least_loaded, "prefill-c");
  EXPECT_EQ(choice.workers_with_hit, 2);
  EXPECT_EQ(choice.describe(), "prefill prefill-b: expected work " + std::to_string(300 + 521) +
                                   " tokens (cached 1536, queued 300); least loaded prefill-c; 2 workers with a hit");
}

TEST(Placement, AHitIsClampedToTheUsableBlocks) {
  const int64_t prompt = 2 * kBlock;  // 1 usable block: the index may know a deeper boundary of a longer prompt
  const std::vector<PrefillCandidate> workers{prefill("prefill-a", 1)};
  const std::vector<IndexMatch> matches{{"prefill-a", 1, 5}};
  const PrefillChoice choice = choose_prefill(kCacheAware, prompt, workers, matches);
  EXPECT_EQ(choice.hit_tokens, kBlock);
  EXPECT_EQ(choice.expected_tokens, prompt - 1 - kBlock);
}

TEST(Placement, AHitDoesNotOutweighMoreQueuedWork) {
  const int64_t prompt = 2 * kBlock + 1;  // 1024 tokens to compute
  const std::vector<PrefillCandidate> workers{prefill("prefill-a", 1, 0), prefill("prefill-b", 1, 2000)};
  const std::vector<IndexMatch> matches{{"prefill-b", 1, 2}};
  const PrefillChoice choice = choose_prefill(kCacheAware, prompt, workers, matches);
  EXPECT_EQ(choice.name, "prefill-a");  // 1024 < 2000 + 0
  EXPECT_EQ(choice.hit_tokens, 0);
  EXPECT_EQ(choice.workers_with_hit, 1);
}

TEST(Placement, LoadOnlyIgnoresTheIndex) {
  const int64_t prompt = 4 * kBlock + 10;
  const std::vector<PrefillCandidate> workers{prefill("prefill-a", 7, 100), prefill("prefill-b", 9, 300)};
  const std::vector<IndexMatch> matches{{"prefill-b", 9, 4}};
  const PrefillChoice choice = choose_prefill(kLoadOnly, prompt, workers, matches);
  EXPECT_EQ(choice.name, "prefill-a");
  EXPECT_EQ(choice.hit_tokens, 0);
  EXPECT_EQ(choice.expected_tokens, 100 + prompt - 1);
  EXPECT_EQ(choice.workers_with_hit, 0);
  EXPECT_EQ(choice.least_loaded, "prefill-a");
}

TEST(Placement, LoadOnlyPicksTheLeastQueuedTokens) {
  const std::vector<PrefillCandidate> workers{prefill("prefill-a", 0, 900, 1), prefill("prefill-b", 0, 40, 3),
                                              prefill("prefill-c", 0, 500, 0)};
  const PrefillChoice choice = choose_prefill(kLoadOnly, 100, workers, {});
  EXPECT_EQ(choice.name, "prefill-b");
  EXPECT_EQ(choice.expected_tokens, 40 + 99);
  EXPECT_EQ(choice.least_loaded, "prefill-b");
}

TEST(Placement, MatchesOfAnEarlierCacheEpochOrAnUnknownWorkerDoNotCount) {
  const int64_t prompt = 4 * kBlock + 10;
  const std::vector<PrefillCandidate> workers{prefill("prefill-a", 2, 100), prefill("prefill-b", 5, 0)};
  // prefill-a restarted (epoch 1 -> 2): what the index holds of epoch 1 is gone from its cache.
  const std::vector<IndexMatch> matches{{"prefill-a", 1, 4}, {"prefill-gone", 3, 4}};
  const PrefillChoice choice = choose_prefill(kCacheAware, prompt, workers, matches);
  EXPECT_EQ(choice.name, "prefill-b");
  EXPECT_EQ(choice.hit_tokens, 0);
  EXPECT_EQ(choice.workers_with_hit, 0);
  // The live epoch's entry counts, whatever else the index holds of the worker.
  const std::vector<IndexMatch> live{{"prefill-a", 1, 4}, {"prefill-a", 2, 2}};
  const PrefillChoice again = choose_prefill(kCacheAware, prompt, workers, live);
  EXPECT_EQ(again.name, "prefill-a");
  EXPECT_EQ(again.hit_tokens, 2 * kBlock);
  EXPECT_EQ(again.workers_with_hit, 1);
}

TEST(Placement, TiesBreakByJobsThenReportedQueueThenName) {
  const int64_t prompt = 10;
  {
    const std::vector<PrefillCandidate> workers{prefill("prefill-a", 0, 0, 2, 0), prefill("prefill-b", 0, 0, 1, 9)};
    EXPECT_EQ(choose_prefill(kLoadOnly, prompt, workers, {}).name, "prefill-b");  // fewer jobs
  }
  {
    const std::vector<PrefillCandidate> workers{prefill("prefill-a", 0, 0, 1, 4), prefill("prefill-b", 0, 0, 1, 3)};
    EXPECT_EQ(choose_prefill(kLoadOnly, prompt, workers, {}).name, "prefill-b");  // shorter queue
  }
  {
    // Equal in everything: the first by name, in whatever order the candidates come.
    const std::vector<PrefillCandidate> workers{prefill("prefill-b", 0), prefill("prefill-a", 0)};
    const PrefillChoice choice = choose_prefill(kLoadOnly, prompt, workers, {});
    EXPECT_EQ(choice.name, "prefill-a");
    EXPECT_EQ(*choice.worker, 1u);
    EXPECT_EQ(choice.least_loaded, "prefill-a");
  }
  {
    // A hit that equalizes the cost: the tie still goes to fewer jobs.
    const std::vector<PrefillCandidate> workers{prefill("prefill-a", 1, kBlock, 1), prefill("prefill-b", 1, 0, 2)};
    const std::vector<IndexMatch> matches{{"prefill-a", 1, 1}};
    const PrefillChoice choice = choose_prefill(kCacheAware, 2 * kBlock, workers, matches);
    EXPECT_EQ(choice.expected_tokens, 2 * kBlock - 1);
    EXPECT_EQ(choice.name, "prefill-a");
  }
}

TEST(Placement, NoPrefillWorkerNoChoice) {
  const PrefillChoice choice = choose_prefill(kCacheAware, 100, {}, {});
  EXPECT_FALSE(choice.worker.has_value());
  EXPECT_TRUE(choice.least_loaded.empty());
}

TEST(Placement, DecodeGoesToTheMostFreeSlotsTiesByNameNoneWhenFull) {
  {
    const std::vector<DecodeCandidate> workers{{"decode-a", 4, 3}, {"decode-b", 8, 2}, {"decode-c", 2, 0}};
    EXPECT_EQ(choose_decode(workers), std::optional<size_t>(1));
  }
  {
    const std::vector<DecodeCandidate> workers{{"decode-b", 4, 1}, {"decode-a", 3, 0}};
    EXPECT_EQ(choose_decode(workers), std::optional<size_t>(1));  // 3 free each: decode-a
  }
  {
    const std::vector<DecodeCandidate> workers{{"decode-a", 2, 2}, {"decode-b", 1, 3}};
    EXPECT_FALSE(choose_decode(workers).has_value());
  }
  EXPECT_FALSE(choose_decode({}).has_value());
}

}  // namespace
}  // namespace deltaserve::router
