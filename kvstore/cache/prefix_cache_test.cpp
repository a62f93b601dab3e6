#include "kvstore/cache/prefix_cache.hpp"

#include <algorithm>
#include <numeric>

#include <gtest/gtest.h>

#include "kvstore/cache/slot_pool.hpp"

namespace deltaserve::kvstore {
namespace {

constexpr int64_t kBlock = 512;
constexpr int64_t kRow = 3;  // values per token

PrefixCacheConfig small_config(int64_t pages, int64_t checkpoint_budget = 1 << 20) {
  PrefixCacheConfig config;
  config.block_tokens = kBlock;
  config.pages = {1024, pages, kRow};
  config.checkpoint_budget_bytes = checkpoint_budget;
  config.policy.interval_blocks = 1;
  return config;
}

std::vector<int32_t> tokens(int64_t n, int32_t seed) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) t[static_cast<size_t>(i)] = static_cast<int32_t>((i * 7919 + seed * 104729) % 50000);
  return t;
}

// Rows whose values encode (prompt seed, token position), so a wrong page shows up as a wrong value.
std::vector<float> rows_for(int32_t seed, int64_t first, int64_t n) {
  std::vector<float> rows(static_cast<size_t>(n * kRow));
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t c = 0; c < kRow; ++c) rows[static_cast<size_t>(t * kRow + c)] = seed * 1e6f + (first + t) * 4.0f + c;
  }
  return rows;
}

std::vector<BlockHash> hashes_of(const std::vector<int32_t>& prompt, std::string_view ns = "tenant-a") {
  const BlockHasher hasher(SipKey{1, 2, 3}, kBlock);
  return hasher.hash_prompt(hasher.root(ns, "model"), prompt);
}

PrefixCache::Bytes checkpoint_bytes(size_t n, uint8_t fill) {
  return PrefixCache::Bytes(n, std::byte{fill});
}

// Fills `table` with the rows of prompt `seed` for tokens [0, n).
void fill(PrefixCache& cache, PageTable& table, int32_t seed, int64_t n) {
  ASSERT_TRUE(cache.append(table, rows_for(seed, table.num_tokens(), n - table.num_tokens())).is_ok());
}

TEST(PrefixCache, HitIsTheDeepestBoundaryWithPagesAndACheckpoint) {
  PrefixCache cache(small_config(16));
  const auto prompt = tokens(4 * kBlock + 100, 1);
  const auto hashes = hashes_of(prompt);
  ASSERT_EQ(hashes.size(), 4u);

  // Checkpoints at boundaries 1 and 3 only; pages for all four blocks.
  ASSERT_TRUE(cache.put_checkpoint(hashes[0], checkpoint_bytes(10, 1)).is_ok());
  ASSERT_TRUE(cache.put_checkpoint(hashes[2], checkpoint_bytes(10, 3)).is_ok());
  PageTable table;
  fill(cache, table, 1, static_cast<int64_t>(prompt.size()));
  cache.insert(hashes, table, "tenant-a");
  table.release(cache.pool());

  auto hit = cache.lookup(hashes, 4);
  EXPECT_EQ(hit.blocks, 3);  // block 4 has pages but no checkpoint
  ASSERT_NE(hit.checkpoint, nullptr);
  EXPECT_EQ((*hit.checkpoint)[0], std::byte{3});
  ASSERT_EQ(hit.pages.num_tokens(), 3 * kBlock);
  const auto expected = rows_for(1, 0, 3 * kBlock);
  for (int64_t t = 0; t < 3 * kBlock; ++t) {
    const auto row = hit.pages.row(cache.pool(), t);
    ASSERT_TRUE(std::equal(row.begin(), row.end(), expected.begin() + t * kRow)) << "token " << t;
  }
  hit.pages.release(cache.pool());

  // Clamped by the caller's limit (e.g. N−1 tokens of the prompt).
  auto clamped = cache.lookup(hashes, 2);
  EXPECT_EQ(clamped.blocks, 1);
  clamped.pages.release(cache.pool());

  // A prompt that shares only the first block.
  auto other = tokens(3 * kBlock, 1);
  std::fill(other.begin() + kBlock, other.end(), 5);
  auto partial = cache.lookup(hashes_of(other), 3);
  EXPECT_EQ(partial.blocks, 1);
  partial.pages.release(cache.pool());

  // The same prompt in another namespace hashes differently: no hit.
  EXPECT_EQ(cache.lookup(hashes_of(prompt, "tenant-b"), 4).blocks, 0);
}

TEST(PrefixCache, NoCheckpointMeansNoHit) {
  PrefixCache cache(small_config(8));
  const auto prompt = tokens(2 * kBlock, 2);
  const auto hashes = hashes_of(prompt);
  PageTable table;
  fill(cache, table, 2, 2 * kBlock);
  cache.insert(hashes, table, "tenant-a");
  table.release(cache.pool());
  auto hit = cache.lookup(hashes, 2);
  EXPECT_EQ(hit.blocks, 0);
  EXPECT_EQ(hit.checkpoint, nullptr);
  EXPECT_EQ(hit.pages.num_tokens(), 0);
}

TEST(PrefixCache, EventsDescribeWhatIsHeld) {
  PrefixCache cache(small_config(8));
  const auto prompt = tokens(2 * kBlock + 5, 3);
  const auto hashes = hashes_of(prompt);
  ASSERT_TRUE(cache.put_checkpoint(hashes[1], checkpoint_bytes(10, 2)).is_ok());
  PageTable table;
  fill(cache, table, 3, static_cast<int64_t>(prompt.size()));
  cache.insert(hashes, table, "tenant-a");
  table.release(cache.pool());
  auto events = cache.take_events();
  ASSERT_EQ(events.size(), 2u);
  std::sort(events.begin(), events.end(), [](const auto& a, const auto& b) { return a.block_index < b.block_index; });
  EXPECT_EQ(events[0].kind, CacheEvent::Kind::kStored);
  EXPECT_EQ(events[0].hash, hashes[0]);
  EXPECT_FALSE(events[0].has_checkpoint);
  EXPECT_EQ(events[1].hash, hashes[1]);
  EXPECT_TRUE(events[1].has_checkpoint);
  EXPECT_EQ(events[1].cache_namespace, "tenant-a");
  EXPECT_TRUE(cache.take_events().empty());

  cache.clear();
  events = cache.take_events();
  ASSERT_EQ(events.size(), 2u);
  for (const auto& e : events) EXPECT_EQ(e.kind, CacheEvent::Kind::kEvicted);
  EXPECT_EQ(cache.stats().checkpoints, 0);
  EXPECT_EQ(cache.pool().free_pages(), cache.pool().num_pages());
}

TEST(PrefixCache, FullPoolEvictsLeastRecentlyUsedButNeverRunningRequests) {
  PrefixCache cache(small_config(4));  // 4 pages × 1024 tokens
  const auto a = tokens(2048, 10), b = tokens(2048, 11), c = tokens(2048, 12);
  const auto ha = hashes_of(a), hb = hashes_of(b), hc = hashes_of(c);
  for (const auto* h : {&ha, &hb}) {
    ASSERT_TRUE(cache.put_checkpoint((*h)[3], checkpoint_bytes(10, 1)).is_ok());
  }
  PageTable ta, tb;
  fill(cache, ta, 10, 2048);
  cache.insert(ha, ta, "tenant-a");
  ta.release(cache.pool());
  fill(cache, tb, 11, 2048);
  cache.insert(hb, tb, "tenant-a");
  EXPECT_EQ(cache.pool().free_pages(), 0);

  // b is still "running" (tb held); a is touched by a hit, so ... a is the most recent entry now.
  auto hit = cache.lookup(ha, 4);
  ASSERT_EQ(hit.blocks, 4);
  hit.pages.release(cache.pool());

  // c needs 2 pages: only a's pages can be freed (b's are held by tb), even though a was used last.
  PageTable tc;
  fill(cache, tc, 12, 2048);
  EXPECT_EQ(cache.lookup(ha, 4).blocks, 0);
  EXPECT_EQ(cache.stats().entry_evictions, 8);  // a's 4 boundaries and b's 4 (b's pages survive: tb holds them)
  const auto rows_b = rows_for(11, 0, 2048);
  for (int64_t t = 0; t < 2048; t += 97) {
    const auto row = tb.row(cache.pool(), t);
    ASSERT_TRUE(std::equal(row.begin(), row.end(), rows_b.begin() + t * kRow)) << "token " << t;
  }
  bool saw_eviction = false;
  for (const auto& e : cache.take_events()) saw_eviction |= e.kind == CacheEvent::Kind::kEvicted;
  EXPECT_TRUE(saw_eviction);

  // Back to baseline once every request is gone and the cache is cleared.
  tb.release(cache.pool());
  tc.release(cache.pool());
  cache.clear();
  EXPECT_EQ(cache.pool().free_pages(), cache.pool().num_pages());
}

TEST(PrefixCache, CheckpointBudgetEvictionIsReported) {
  PrefixCache cache(small_config(8, /*checkpoint_budget=*/100));
  const auto a = tokens(kBlock, 20), b = tokens(kBlock, 21);
  const auto ha = hashes_of(a), hb = hashes_of(b);
  ASSERT_TRUE(cache.put_checkpoint(ha[0], checkpoint_bytes(60, 1)).is_ok());
  PageTable ta;
  fill(cache, ta, 20, kBlock);
  cache.insert(ha, ta, "tenant-a");
  ta.release(cache.pool());
  (void)cache.take_events();
  ASSERT_TRUE(cache.put_checkpoint(hb[0], checkpoint_bytes(60, 2)).is_ok());  // evicts a's checkpoint
  const auto events = cache.take_events();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].kind, CacheEvent::Kind::kCheckpointEvicted);
  EXPECT_EQ(events[0].hash, ha[0]);
  EXPECT_EQ(cache.lookup(ha, 1).blocks, 0);  // pages alone are not a hit
  EXPECT_EQ(cache.stats().checkpoint_evictions, 1);
}

TEST(PrefixCache, ConfigValidationNamesTheField) {
  auto config = small_config(4);
  config.block_tokens = 768;
  EXPECT_NE(validate(config).message().find("block size"), std::string::npos);
  config = small_config(4);
  config.checkpoint_budget_bytes = 0;
  EXPECT_NE(validate(config).message().find("checkpoint_budget_bytes"), std::string::npos);
  config = small_config(4);
  config.policy.interval_blocks = 0;
  EXPECT_NE(validate(config).message().find("interval"), std::string::npos);
  EXPECT_TRUE(validate(small_config(4)).is_ok());
}

TEST(SlotPool, FixedSlotsAreReusedAndCounted) {
  SlotPool<std::vector<float>> pool(std::vector<std::vector<float>>(3, std::vector<float>(4, 0.0f)));
  EXPECT_EQ(pool.free_slots(), 3);
  std::vector<SlotId> taken;
  while (auto slot = pool.acquire()) taken.push_back(*slot);
  EXPECT_EQ(taken.size(), 3u);
  EXPECT_EQ(pool.used_slots(), 3);
  std::sort(taken.begin(), taken.end());
  EXPECT_EQ(taken, (std::vector<SlotId>{0, 1, 2}));
  pool.at(1)[0] = 5.0f;
  pool.release(1);
  const auto again = pool.acquire();
  ASSERT_TRUE(again.has_value());
  EXPECT_EQ(*again, 1);
  EXPECT_EQ(pool.at(*again)[0], 5.0f);  // contents are left as they were: users reset
  for (SlotId s : {0, 1, 2}) pool.release(s);
  EXPECT_EQ(pool.free_slots(), 3);
}

}  // namespace
}  // namespace deltaserve::kvstore
