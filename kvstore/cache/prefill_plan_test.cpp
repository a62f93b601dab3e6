#include "kvstore/cache/prefill_plan.hpp"

#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "kvstore/cache/checkpoint_store.hpp"

namespace deltaserve::kvstore {
namespace {

using Chunks = std::vector<std::pair<int64_t, int64_t>>;

// Every chunk (start, end) of a prefill that starts at `start`.
Chunks chunks(const PrefillPlan& plan, int64_t start) {
  Chunks out;
  for (int64_t position = start; position < plan.target();) {
    const int64_t end = plan.chunk_end(position);
    EXPECT_GT(end, position);
    out.emplace_back(position, end);
    position = end;
  }
  return out;
}

TEST(PrefillPlan, WithoutACacheChunksIgnoreBlocks) {
  const PrefillPlan plan(11, 4, 0);
  EXPECT_EQ(plan.target(), 10);
  EXPECT_EQ(plan.full_blocks(), 0);
  EXPECT_EQ(chunks(plan, 0), (Chunks{{0, 4}, {4, 8}, {8, 10}}));
  EXPECT_EQ(plan.boundary_at(4), 0);
}

TEST(PrefillPlan, OneTokenPromptHasNothingToCompute) {
  const PrefillPlan plan(1, 4, 4);
  EXPECT_EQ(plan.target(), 0);
  EXPECT_EQ(plan.full_blocks(), 0);
  EXPECT_TRUE(chunks(plan, 0).empty());
}

TEST(PrefillPlan, FullBlocksLeaveTheLastTokenToTheDecodeWorker) {
  EXPECT_EQ(PrefillPlan(8, 4, 4).full_blocks(), 1);  // prompt[0, 7): one full block
  EXPECT_EQ(PrefillPlan(9, 4, 4).full_blocks(), 2);
  EXPECT_EQ(PrefillPlan(512, 512, 512).full_blocks(), 0);
  EXPECT_EQ(PrefillPlan(1025, 512, 512).full_blocks(), 2);
}

TEST(PrefillPlan, ChunksThatCrossABoundaryEndOnIt) {
  // chunk 3, block 4: every boundary is a chunk end.
  const PrefillPlan plan(14, 3, 4);
  EXPECT_EQ(chunks(plan, 0), (Chunks{{0, 3}, {3, 4}, {4, 7}, {7, 8}, {8, 11}, {11, 12}, {12, 13}}));
  // Resuming from a cached boundary.
  EXPECT_EQ(chunks(plan, 8), (Chunks{{8, 11}, {11, 12}, {12, 13}}));
  // chunk == block (the defaults, 512 and 512): chunks are the blocks.
  const PrefillPlan aligned(2000, 512, 512);
  EXPECT_EQ(chunks(aligned, 0), (Chunks{{0, 512}, {512, 1024}, {1024, 1536}, {1536, 1999}}));
}

TEST(PrefillPlan, AChunkLongerThanABlockEndsOnTheLastBoundaryItReaches) {
  const PrefillPlan plan(30, 10, 4);
  EXPECT_EQ(chunks(plan, 0), (Chunks{{0, 8}, {8, 16}, {16, 24}, {24, 28}, {28, 29}}));
  EXPECT_EQ(plan.chunk_end(2), 12);  // 12 is a boundary: kept
}

TEST(PrefillPlan, BoundaryAt) {
  const PrefillPlan plan(30, 10, 4);
  EXPECT_EQ(plan.boundary_at(0), 0);
  EXPECT_EQ(plan.boundary_at(3), 0);
  EXPECT_EQ(plan.boundary_at(4), 1);
  EXPECT_EQ(plan.boundary_at(24), 6);
}

// The boundaries a whole prefill checkpoints: the chunk ends the plan gives, filtered by the cache's policy.
TEST(PrefillPlan, CheckpointsFollowThePolicyAtTheBoundariesChunksEndOn) {
  auto checkpointed = [](const PrefillPlan& plan, CheckpointPolicy policy) {
    CheckpointStore store(1 << 20, policy);
    std::vector<int64_t> taken;
    for (const auto& [start, end] : chunks(plan, 0)) {
      if (const int64_t k = plan.boundary_at(end); k > 0) {
        BlockHash hash;
        hash.bytes.fill(static_cast<uint8_t>(k));
        if (store.should_checkpoint(k, plan.full_blocks(), hash)) taken.push_back(k);
      }
    }
    return taken;
  };
  const PrefillPlan plan(4 * 11 + 1, 4, 4);  // 11 full blocks
  EXPECT_EQ(checkpointed(plan, {.interval_blocks = 4, .last_full_block = true}), (std::vector<int64_t>{4, 8, 11}));
  EXPECT_EQ(checkpointed(plan, {.interval_blocks = 4, .last_full_block = false}), (std::vector<int64_t>{4, 8}));
  EXPECT_TRUE(checkpointed(plan, {.interval_blocks = 1, .only_on_second_hit = true}).empty());  // first sighting
}

}  // namespace
}  // namespace deltaserve::kvstore
