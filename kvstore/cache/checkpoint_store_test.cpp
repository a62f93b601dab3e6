#include "kvstore/cache/checkpoint_store.hpp"

#include <gtest/gtest.h>

namespace deltaserve::kvstore {
namespace {

BlockHash hash_of(uint8_t n) {
  BlockHash h;
  h.bytes.fill(n);
  return h;
}

CheckpointStore::Bytes bytes(size_t n, uint8_t fill) {
  return CheckpointStore::Bytes(n, std::byte{fill});
}

TEST(CheckpointStore, PolicyTakesIntervalAndLastFullBlock) {
  CheckpointStore store(1000, {.interval_blocks = 4, .last_full_block = true, .only_on_second_hit = false});
  std::vector<int64_t> taken;
  for (int64_t b = 1; b <= 10; ++b) {
    if (store.should_checkpoint(b, 10, hash_of(static_cast<uint8_t>(b)))) taken.push_back(b);
  }
  EXPECT_EQ(taken, (std::vector<int64_t>{4, 8, 10}));
  ASSERT_TRUE(store.put(hash_of(4), bytes(10, 4)).is_ok());
  EXPECT_FALSE(store.should_checkpoint(4, 10, hash_of(4)));  // already held

  CheckpointStore no_last(1000, {.interval_blocks = 4, .last_full_block = false, .only_on_second_hit = false});
  EXPECT_FALSE(no_last.should_checkpoint(10, 10, hash_of(10)));
}

TEST(CheckpointStore, SecondHitPolicy) {
  CheckpointStore store(1000, {.interval_blocks = 1, .last_full_block = true, .only_on_second_hit = true});
  EXPECT_FALSE(store.should_checkpoint(1, 3, hash_of(1)));
  EXPECT_FALSE(store.should_checkpoint(1, 3, hash_of(2)));
  EXPECT_TRUE(store.should_checkpoint(1, 3, hash_of(1)));
  EXPECT_FALSE(store.should_checkpoint(1, 3, hash_of(1)));  // counted again from the start
}

TEST(CheckpointStore, EvictsLeastRecentlyUsedWithinTheBudget) {
  CheckpointStore store(300, {});
  ASSERT_TRUE(store.put(hash_of(1), bytes(100, 1)).is_ok());
  ASSERT_TRUE(store.put(hash_of(2), bytes(100, 2)).is_ok());
  ASSERT_TRUE(store.put(hash_of(3), bytes(100, 3)).is_ok());
  ASSERT_NE(store.get(hash_of(1)), nullptr);                  // 1 becomes the most recent; 2 is now the oldest
  ASSERT_TRUE(store.put(hash_of(4), bytes(150, 4)).is_ok());  // needs 150: evicts 2 then 3
  EXPECT_EQ(store.take_evicted(), (std::vector<BlockHash>{hash_of(2), hash_of(3)}));
  EXPECT_TRUE(store.take_evicted().empty());
  EXPECT_TRUE(store.contains(hash_of(1)));
  EXPECT_TRUE(store.contains(hash_of(4)));
  EXPECT_EQ(store.used_bytes(), 250);
  EXPECT_EQ(*store.get(hash_of(4)), bytes(150, 4));
}

TEST(CheckpointStore, NeverEvictsWhatARunningRequestReads) {
  CheckpointStore store(200, {});
  ASSERT_TRUE(store.put(hash_of(1), bytes(100, 1)).is_ok());
  ASSERT_TRUE(store.put(hash_of(2), bytes(100, 2)).is_ok());
  auto pinned_1 = store.get(hash_of(1));
  auto pinned_2 = store.get(hash_of(2));
  const Status full = store.put(hash_of(3), bytes(50, 3));
  EXPECT_EQ(full.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(store.size(), 2u);
  EXPECT_EQ(store.used_bytes(), 200);
  pinned_1.reset();
  ASSERT_TRUE(store.put(hash_of(3), bytes(50, 3)).is_ok());  // now 1 may go
  EXPECT_EQ(store.take_evicted(), (std::vector<BlockHash>{hash_of(1)}));
  EXPECT_EQ(*pinned_2, bytes(100, 2));  // untouched while held
}

TEST(CheckpointStore, ReplacesAndRejectsOversized) {
  CheckpointStore store(100, {});
  ASSERT_TRUE(store.put(hash_of(1), bytes(60, 1)).is_ok());
  ASSERT_TRUE(store.put(hash_of(1), bytes(90, 7)).is_ok());  // replacement frees the old bytes first
  EXPECT_EQ(store.used_bytes(), 90);
  EXPECT_EQ(*store.get(hash_of(1)), bytes(90, 7));
  EXPECT_TRUE(store.take_evicted().empty());
  EXPECT_EQ(store.put(hash_of(2), bytes(101, 2)).code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(store.get(hash_of(9)), nullptr);
}

}  // namespace
}  // namespace deltaserve::kvstore
