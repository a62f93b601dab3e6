#include "kvstore/index/prefix_index.hpp"

#include <algorithm>
#include <fstream>
#include <random>
#include <thread>

#include <gtest/gtest.h>
#include <rocksdb/db.h>

#include "common/temp_dir.hpp"
#include "kvstore/index/prefix_index_codec.hpp"

namespace deltaserve::kvstore {
namespace {

constexpr int64_t kBlock = 8;  // tokens per block: small, the index does not care

// A prompt of `blocks` full blocks whose tokens come from `seed`, hashed under `cache_namespace`.
std::vector<BlockHash> chain(std::string_view cache_namespace, int seed, int blocks) {
  const BlockHasher hasher(SipKey{1, 2, 3}, kBlock);
  std::vector<int32_t> tokens(static_cast<size_t>(blocks * kBlock));
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>(seed * 100000 + i);
  return hasher.hash_prompt(hasher.root(cache_namespace, "model"), tokens);
}

CacheEvent stored(const std::vector<BlockHash>& hashes, int64_t block, bool checkpoint,
                  std::string cache_namespace = "tenant-a") {
  return {.kind = CacheEvent::Kind::kStored,
          .hash = hashes[static_cast<size_t>(block - 1)],
          .block_index = block,
          .has_checkpoint = checkpoint,
          .cache_namespace = std::move(cache_namespace)};
}

CacheEvent evicted(const std::vector<BlockHash>& hashes, int64_t block, CacheEvent::Kind kind) {
  return {.kind = kind,
          .hash = hashes[static_cast<size_t>(block - 1)],
          .block_index = block,
          .cache_namespace = "tenant-a"};
}

// Stores blocks [first, last] of `hashes` for `worker`, with checkpoints at the listed blocks.
CacheEventBatch store_run(std::string worker, uint64_t epoch, const std::vector<BlockHash>& hashes, int64_t first,
                          int64_t last, std::vector<int64_t> checkpoints,
                          const std::string& cache_namespace = "tenant-a") {
  CacheEventBatch batch{.worker = std::move(worker), .worker_epoch = epoch, .events = {}};
  for (int64_t b = first; b <= last; ++b) {
    const bool checkpoint = std::find(checkpoints.begin(), checkpoints.end(), b) != checkpoints.end();
    batch.events.push_back(stored(hashes, b, checkpoint, cache_namespace));
  }
  return batch;
}

struct Expected {
  std::string worker;
  uint64_t epoch;
  int64_t pages;
  int64_t checkpoint;
};

void expect_matches(const Result<std::vector<WorkerPrefixMatch>>& got, const std::vector<Expected>& want) {
  ASSERT_TRUE(got.is_ok()) << got.status().to_string();
  ASSERT_EQ(got->size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ((*got)[i].worker, want[i].worker);
    EXPECT_EQ((*got)[i].worker_epoch, want[i].epoch);
    EXPECT_EQ((*got)[i].pages_blocks, want[i].pages);
    EXPECT_EQ((*got)[i].checkpoint_blocks, want[i].checkpoint);
  }
}

std::unique_ptr<PrefixIndex> open_index(const std::filesystem::path& dir) {
  auto index = PrefixIndex::open(dir);
  EXPECT_TRUE(index.is_ok()) << index.status().to_string();
  return index.is_ok() ? std::move(index).value() : nullptr;
}

class PrefixIndexTest : public ::testing::Test {
 protected:
  void SetUp() override {
    index_ = open_index(dir_.path() / "index");
    ASSERT_NE(index_, nullptr);
  }
  std::span<const BlockHash> first(const std::vector<BlockHash>& hashes, size_t n) { return {hashes.data(), n}; }

  TempDir dir_{"prefix_index_test"};
  std::unique_ptr<PrefixIndex> index_;
};

TEST_F(PrefixIndexTest, LookupAtSeveralDepthsWithAndWithoutCheckpoints) {
  const auto prompt = chain("tenant-a", 1, 8);
  ASSERT_TRUE(index_->apply(store_run("a", 1, prompt, 1, 8, {4, 8})).is_ok());
  ASSERT_TRUE(index_->apply(store_run("b", 1, prompt, 1, 5, {2})).is_ok());
  ASSERT_TRUE(index_->apply(store_run("c", 1, prompt, 1, 3, {})).is_ok());

  expect_matches(index_->lookup(prompt, "tenant-a"), {{"a", 1, 8, 8}, {"b", 1, 5, 2}, {"c", 1, 3, 0}});
  expect_matches(index_->lookup(first(prompt, 7), "tenant-a"), {{"a", 1, 7, 4}, {"b", 1, 5, 2}, {"c", 1, 3, 0}});
  expect_matches(index_->lookup(first(prompt, 3), "tenant-a"), {{"b", 1, 3, 2}, {"a", 1, 3, 0}, {"c", 1, 3, 0}});
  expect_matches(index_->lookup(first(prompt, 1), "tenant-a"), {{"a", 1, 1, 0}, {"b", 1, 1, 0}, {"c", 1, 1, 0}});

  // A prompt that shares the first 2 blocks and then diverges stops there.
  auto diverged = chain("tenant-a", 2, 8);
  std::copy(prompt.begin(), prompt.begin() + 2, diverged.begin());
  expect_matches(index_->lookup(diverged, "tenant-a"), {{"b", 1, 2, 2}, {"a", 1, 2, 0}, {"c", 1, 2, 0}});
}

TEST_F(PrefixIndexTest, GapEndsTheUsablePrefix) {
  const auto prompt = chain("tenant-a", 1, 6);
  auto batch = store_run("a", 1, prompt, 1, 6, {2, 6});
  batch.events.erase(batch.events.begin() + 2);  // block 3 missing
  ASSERT_TRUE(index_->apply(batch).is_ok());
  expect_matches(index_->lookup(prompt, "tenant-a"), {{"a", 1, 2, 2}});

  // A worker holding blocks 2.. but not block 1 holds no usable prefix at all.
  ASSERT_TRUE(index_->apply(store_run("b", 1, prompt, 2, 6, {2, 6})).is_ok());
  expect_matches(index_->lookup(prompt, "tenant-a"), {{"a", 1, 2, 2}});
}

TEST_F(PrefixIndexTest, PromptWithoutFullBlocksFindsNothing) {
  const auto prompt = chain("tenant-a", 1, 4);
  ASSERT_TRUE(index_->apply(store_run("a", 1, prompt, 1, 4, {4})).is_ok());
  EXPECT_TRUE(chain("tenant-a", 1, 0).empty());
  expect_matches(index_->lookup({}, "tenant-a"), {});
  expect_matches(index_->lookup(chain("tenant-a", 9, 4), "tenant-a"), {});  // unknown prompt
}

TEST_F(PrefixIndexTest, NamespacesNeverCross) {
  const auto a = chain("tenant-a", 1, 4);
  const auto b = chain("tenant-b", 1, 4);  // same tokens, another tenant
  ASSERT_NE(a[0], b[0]);
  ASSERT_TRUE(index_->apply(store_run("w", 1, a, 1, 4, {4}, "tenant-a")).is_ok());
  expect_matches(index_->lookup(a, "tenant-a"), {{"w", 1, 4, 4}});
  expect_matches(index_->lookup(a, "tenant-b"), {});
  expect_matches(index_->lookup(b, "tenant-b"), {});

  // An entry recorded under another namespace than the query's never matches, even for the same hash.
  ASSERT_TRUE(index_->apply(store_run("x", 1, b, 1, 4, {4}, "tenant-a")).is_ok());
  expect_matches(index_->lookup(b, "tenant-b"), {});
  expect_matches(index_->lookup(b, "tenant-a"), {{"x", 1, 4, 4}});
}

TEST_F(PrefixIndexTest, EvictionsAndCheckpointEvictions) {
  const auto prompt = chain("tenant-a", 1, 8);
  ASSERT_TRUE(index_->apply(store_run("a", 1, prompt, 1, 8, {2, 4, 8})).is_ok());

  CacheEventBatch batch{.worker = "a", .worker_epoch = 1, .events = {}};
  batch.events.push_back(evicted(prompt, 8, CacheEvent::Kind::kCheckpointEvicted));
  batch.events.push_back(evicted(prompt, 7, CacheEvent::Kind::kEvicted));
  ASSERT_TRUE(index_->apply(batch).is_ok());
  expect_matches(index_->lookup(prompt, "tenant-a"), {{"a", 1, 6, 4}});

  // A checkpoint eviction of a block that is not held creates nothing.
  batch.events = {evicted(prompt, 7, CacheEvent::Kind::kCheckpointEvicted)};
  ASSERT_TRUE(index_->apply(batch).is_ok());
  expect_matches(index_->lookup(prompt, "tenant-a"), {{"a", 1, 6, 4}});

  // Within one batch: stored with a checkpoint, then the checkpoint evicted, then stored again without.
  batch.events = {stored(prompt, 7, true), evicted(prompt, 7, CacheEvent::Kind::kCheckpointEvicted),
                  evicted(prompt, 4, CacheEvent::Kind::kCheckpointEvicted)};
  ASSERT_TRUE(index_->apply(batch).is_ok());
  expect_matches(index_->lookup(prompt, "tenant-a"), {{"a", 1, 8, 2}});

  batch.events = {evicted(prompt, 1, CacheEvent::Kind::kEvicted)};
  ASSERT_TRUE(index_->apply(batch).is_ok());
  expect_matches(index_->lookup(prompt, "tenant-a"), {});
}

TEST_F(PrefixIndexTest, EpochChangeDropsTheOldIncarnation) {
  const auto old_prompt = chain("tenant-a", 1, 4);
  const auto new_prompt = chain("tenant-a", 2, 4);
  ASSERT_TRUE(index_->apply(store_run("a", 1, old_prompt, 1, 4, {4})).is_ok());
  ASSERT_TRUE(index_->apply(store_run("b", 1, old_prompt, 1, 2, {2})).is_ok());
  ASSERT_TRUE(index_->apply(store_run("a", 2, new_prompt, 1, 3, {3})).is_ok());

  expect_matches(index_->lookup(old_prompt, "tenant-a"), {{"b", 1, 2, 2}});
  expect_matches(index_->lookup(new_prompt, "tenant-a"), {{"a", 2, 3, 3}});
  auto workers = index_->workers();
  ASSERT_TRUE(workers.is_ok());
  EXPECT_EQ(*workers, (std::vector<std::pair<std::string, uint64_t>>{{"a", 2}, {"b", 1}}));

  // An epoch change whose batch also re-stores an old block keeps only the new one.
  ASSERT_TRUE(index_->apply(store_run("a", 3, old_prompt, 1, 1, {})).is_ok());
  expect_matches(index_->lookup(new_prompt, "tenant-a"), {});
  expect_matches(index_->lookup(old_prompt, "tenant-a"), {{"b", 1, 2, 2}, {"a", 3, 1, 0}});
}

TEST_F(PrefixIndexTest, DropWorker) {
  const auto prompt = chain("tenant-a", 1, 4);
  ASSERT_TRUE(index_->apply(store_run("a", 1, prompt, 1, 4, {4})).is_ok());
  ASSERT_TRUE(index_->apply(store_run("ab", 5, prompt, 1, 2, {})).is_ok());  // name extends "a"
  ASSERT_TRUE(index_->drop_worker("a").is_ok());
  expect_matches(index_->lookup(prompt, "tenant-a"), {{"ab", 5, 2, 0}});
  auto workers = index_->workers();
  ASSERT_TRUE(workers.is_ok());
  EXPECT_EQ(*workers, (std::vector<std::pair<std::string, uint64_t>>{{"ab", 5}}));
  EXPECT_TRUE(index_->drop_worker("never-seen").is_ok());
  // A dropped worker coming back under the same epoch starts from nothing.
  ASSERT_TRUE(index_->apply(store_run("a", 1, prompt, 1, 1, {})).is_ok());
  expect_matches(index_->lookup(prompt, "tenant-a"), {{"ab", 5, 2, 0}, {"a", 1, 1, 0}});
}

TEST_F(PrefixIndexTest, ReconcileKeepsOnlyLiveIncarnations) {
  const auto prompt = chain("tenant-a", 1, 4);
  ASSERT_TRUE(index_->apply(store_run("a", 1, prompt, 1, 4, {4})).is_ok());
  ASSERT_TRUE(index_->apply(store_run("b", 1, prompt, 1, 3, {})).is_ok());
  ASSERT_TRUE(index_->apply(store_run("c", 1, prompt, 1, 2, {})).is_ok());
  const std::vector<std::pair<std::string, uint64_t>> live = {{"a", 1}, {"b", 2}, {"d", 1}};
  auto dropped = index_->reconcile(live);
  ASSERT_TRUE(dropped.is_ok()) << dropped.status().to_string();
  EXPECT_EQ(*dropped, 5);  // b (other epoch): 3, c (gone): 2
  expect_matches(index_->lookup(prompt, "tenant-a"), {{"a", 1, 4, 4}});
  auto workers = index_->workers();
  ASSERT_TRUE(workers.is_ok());
  EXPECT_EQ(*workers, (std::vector<std::pair<std::string, uint64_t>>{{"a", 1}}));
  auto again = index_->reconcile(live);
  ASSERT_TRUE(again.is_ok());
  EXPECT_EQ(*again, 0);
  // "b" returns under epoch 2 with an empty cache.
  ASSERT_TRUE(index_->apply(store_run("b", 2, prompt, 1, 1, {1})).is_ok());
  expect_matches(index_->lookup(prompt, "tenant-a"), {{"a", 1, 4, 4}, {"b", 2, 1, 1}});
}

TEST_F(PrefixIndexTest, ReopenAfterCleanCloseKeepsEverything) {
  const auto prompt = chain("tenant-a", 1, 6);
  ASSERT_TRUE(index_->apply(store_run("a", 7, prompt, 1, 6, {3, 6})).is_ok());
  ASSERT_TRUE(index_->apply(store_run("b", 9, prompt, 1, 2, {1})).is_ok());
  index_.reset();
  index_ = open_index(dir_.path() / "index");
  ASSERT_NE(index_, nullptr);
  expect_matches(index_->lookup(prompt, "tenant-a"), {{"a", 7, 6, 6}, {"b", 9, 2, 1}});
  EXPECT_GT(index_->stats().sst_file_bytes, 0);  // the recovered log was flushed into a table file
  auto workers = index_->workers();
  ASSERT_TRUE(workers.is_ok());
  EXPECT_EQ(*workers, (std::vector<std::pair<std::string, uint64_t>>{{"a", 7}, {"b", 9}}));
  // The epochs survived too: a batch of the same incarnation keeps, a new one drops.
  ASSERT_TRUE(index_->apply(store_run("a", 7, prompt, 1, 1, {})).is_ok());
  ASSERT_TRUE(index_->apply(store_run("b", 10, prompt, 1, 1, {})).is_ok());
  expect_matches(index_->lookup(prompt, "tenant-a"), {{"a", 7, 6, 6}, {"b", 10, 1, 0}});
}

TEST_F(PrefixIndexTest, StatsCountBatches) {
  const auto prompt = chain("tenant-a", 1, 8);
  for (int w = 0; w < 4; ++w) {
    ASSERT_TRUE(index_->apply(store_run("w" + std::to_string(w), 1, prompt, 1, 8, {8})).is_ok());
  }
  const PrefixIndexStats stats = index_->stats();
  EXPECT_EQ(stats.batches_written, 4);
  EXPECT_EQ(stats.write_errors, 0);
  EXPECT_GE(stats.total_write_micros, stats.last_write_micros);
  EXPECT_GT(stats.entries, 0);
  EXPECT_LE(stats.entries, 64);  // an estimate, but never more than the keys written
}

TEST_F(PrefixIndexTest, RejectsMalformedBatches) {
  const auto prompt = chain("tenant-a", 1, 2);
  EXPECT_EQ(index_->apply(store_run("", 1, prompt, 1, 1, {})).code(), StatusCode::kInvalidArgument);
  auto batch = store_run("a", 1, prompt, 1, 2, {});
  batch.events[1].block_index = 0;
  EXPECT_EQ(index_->apply(batch).code(), StatusCode::kInvalidArgument);
  expect_matches(index_->lookup(prompt, "tenant-a"), {});  // nothing of the rejected batch landed
  EXPECT_EQ(index_->stats().batches_written, 0);
}

TEST_F(PrefixIndexTest, ConcurrentApplyAndLookup) {
  const auto prompt = chain("tenant-a", 1, 16);
  std::atomic<bool> done{false};
  std::atomic<int> errors{0};
  std::thread writer([&] {
    for (int i = 0; i < 200; ++i) {
      const int64_t depth = 1 + i % 16;
      if (!index_->apply(store_run("w" + std::to_string(i % 3), 1, prompt, 1, depth, {depth})).is_ok()) ++errors;
    }
    done = true;
  });
  while (!done) {
    auto got = index_->lookup(prompt, "tenant-a");
    if (!got.is_ok()) {
      ++errors;
      continue;
    }
    for (const auto& match : *got) {
      if (match.checkpoint_blocks > match.pages_blocks || match.pages_blocks > 16) ++errors;
    }
  }
  writer.join();
  EXPECT_EQ(errors, 0);
}

TEST(PrefixIndexErrors, OpenFailuresNameTheDirectoryAndRocksDbReason) {
  TempDir dir("prefix_index_errors");
  const auto file = dir.path() / "not-a-directory";
  std::ofstream(file) << "x";
  auto on_file = PrefixIndex::open(file / "index");
  ASSERT_FALSE(on_file.is_ok());
  EXPECT_NE(on_file.status().message().find((file / "index").string()), std::string::npos)
      << on_file.status().to_string();

  auto held = PrefixIndex::open(dir.path() / "index");
  ASSERT_TRUE(held.is_ok()) << held.status().to_string();
  auto second = PrefixIndex::open(dir.path() / "index");  // RocksDB's LOCK is held by `held`
  ASSERT_FALSE(second.is_ok());
  EXPECT_EQ(second.status().code(), StatusCode::kIoError);
  EXPECT_NE(second.status().message().find((dir.path() / "index").string()), std::string::npos);
  EXPECT_NE(second.status().message().find("lock"), std::string::npos) << second.status().to_string();
}

// Writes `value` under `key` with plain RocksDB, bypassing the index (the index must be closed).
void put_raw(const std::filesystem::path& dir, const std::string& key, const std::string& value) {
  rocksdb::DB* db = nullptr;
  rocksdb::Options options;
  ASSERT_TRUE(rocksdb::DB::Open(options, dir.string(), &db).ok());
  EXPECT_TRUE(db->Put(rocksdb::WriteOptions(), key, value).ok());
  EXPECT_TRUE(db->Close().ok());
  delete db;
}

TEST(PrefixIndexErrors, CorruptValuesAreErrorsNamingTheKey) {
  TempDir dir("prefix_index_corrupt");
  const auto path = dir.path() / "index";
  const auto prompt = chain("tenant-a", 1, 3);
  {
    auto index = open_index(path);
    ASSERT_NE(index, nullptr);
    ASSERT_TRUE(index->apply(store_run("a", 1, prompt, 1, 3, {3})).is_ok());
  }
  const std::string key = index_format::entry_key(prompt[1], "a");
  put_raw(path, key, "garbage that is long enough to look like a value");
  {
    auto index = open_index(path);
    ASSERT_NE(index, nullptr);
    auto got = index->lookup(prompt, "tenant-a");
    ASSERT_FALSE(got.is_ok());
    EXPECT_EQ(got.status().code(), StatusCode::kDataLoss);
    EXPECT_NE(got.status().message().find("b:" + prompt[1].hex() + "/a"), std::string::npos)
        << got.status().to_string();
    EXPECT_NE(got.status().message().find(path.string()), std::string::npos);
    // A checkpoint eviction that has to read the corrupt value fails the same way, writing nothing.
    CacheEventBatch batch{.worker = "a", .worker_epoch = 1, .events = {}};
    batch.events = {evicted(prompt, 2, CacheEvent::Kind::kCheckpointEvicted)};
    EXPECT_EQ(index->apply(batch).code(), StatusCode::kDataLoss);
    // The worker's next incarnation replaces the corrupt entry.
    ASSERT_TRUE(index->apply(store_run("a", 2, prompt, 1, 3, {2})).is_ok());
    expect_matches(index->lookup(prompt, "tenant-a"), {{"a", 2, 3, 2}});
  }
  // A value copied under another key (another worker) fails its checksum: no wrong hit.
  {
    rocksdb::DB* db = nullptr;
    ASSERT_TRUE(rocksdb::DB::Open(rocksdb::Options(), path.string(), &db).ok());
    std::string value;
    ASSERT_TRUE(db->Get(rocksdb::ReadOptions(), index_format::entry_key(prompt[0], "a"), &value).ok());
    ASSERT_TRUE(db->Put(rocksdb::WriteOptions(), index_format::entry_key(prompt[0], "z"), value).ok());
    ASSERT_TRUE(db->Close().ok());
    delete db;
    auto index = open_index(path);
    ASSERT_NE(index, nullptr);
    auto got = index->lookup(prompt, "tenant-a");
    ASSERT_FALSE(got.is_ok());
    EXPECT_NE(got.status().message().find("b:" + prompt[0].hex() + "/z"), std::string::npos)
        << got.status().to_string();
  }
  put_raw(path, index_format::epoch_key("a"), "bad");
  auto reopened = PrefixIndex::open(path);
  ASSERT_FALSE(reopened.is_ok());
  EXPECT_EQ(reopened.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(reopened.status().message().find("e:a"), std::string::npos) << reopened.status().to_string();
}

// Garbage written straight into every key range (as a torn disk or a bug might leave it): the index opens
// or reports kDataLoss, and every call either succeeds or reports kDataLoss; nothing crashes, nothing matches
// a prompt that was never stored.
TEST(PrefixIndexErrors, GarbageInEveryKeyRangeNeverCrashes) {
  std::mt19937_64 rng(7);
  const auto prompt = chain("tenant-a", 1, 4);
  const auto never_stored = chain("tenant-a", 2, 4);
  int opened = 0;
  int garbage_read = 0;  // lookups that met a garbage entry of the prompt's own blocks
  for (int round = 0; round < 12; ++round) {
    SCOPED_TRACE(round);
    TempDir dir("prefix_index_garbage");
    const auto path = dir.path() / "index";
    {
      auto index = open_index(path);
      ASSERT_NE(index, nullptr);
      ASSERT_TRUE(index->apply(store_run("a", 1, prompt, 1, 4, {2})).is_ok());
    }
    {
      rocksdb::DB* raw = nullptr;
      ASSERT_TRUE(rocksdb::DB::Open(rocksdb::Options(), path.string(), &raw).ok());
      const char tags[] = {index_format::kEntryTag, index_format::kWorkerTag, index_format::kEpochTag};
      for (int k = 0; k < 8; ++k) {
        std::string key(1, tags[round % 3]);  // one range per round: epoch garbage fails the open
        // Often aimed at the prompt's own blocks, so lookups do read the garbage.
        if (key[0] == index_format::kEntryTag && rng() % 2 == 0) key = index_format::entry_prefix(prompt[rng() % 4]);
        for (uint64_t n = rng() % 24; n > 0; --n) key.push_back(static_cast<char>(rng()));
        std::string value;
        for (uint64_t n = rng() % 48; n > 0; --n) value.push_back(static_cast<char>(rng()));
        EXPECT_TRUE(raw->Put(rocksdb::WriteOptions(), key, value).ok());
      }
      EXPECT_TRUE(raw->Close().ok());
      delete raw;
    }
    auto index = PrefixIndex::open(path);
    if (!index.is_ok()) {
      EXPECT_EQ(index.status().code(), StatusCode::kDataLoss) << index.status().to_string();
      continue;
    }
    ++opened;
    auto is_ok_or_data_loss = [](const Status& s) { return s.is_ok() || s.code() == StatusCode::kDataLoss; };
    auto hit = (*index)->lookup(prompt, "tenant-a");
    EXPECT_TRUE(is_ok_or_data_loss(hit.status())) << hit.status().to_string();
    if (hit.status().code() == StatusCode::kDataLoss) ++garbage_read;
    auto miss = (*index)->lookup(never_stored, "tenant-a");
    ASSERT_TRUE(is_ok_or_data_loss(miss.status())) << miss.status().to_string();
    if (miss.is_ok()) {
      EXPECT_TRUE(miss->empty());
    }
    auto other = (*index)->lookup(prompt, "tenant-b");
    ASSERT_TRUE(is_ok_or_data_loss(other.status())) << other.status().to_string();
    if (other.is_ok()) {
      EXPECT_TRUE(other->empty());
    }
    EXPECT_TRUE((*index)->workers().is_ok());
    const std::vector<std::pair<std::string, uint64_t>> live = {{"a", 1}};
    auto reconciled = (*index)->reconcile(live);
    EXPECT_TRUE(is_ok_or_data_loss(reconciled.status())) << reconciled.status().to_string();
    EXPECT_TRUE(is_ok_or_data_loss((*index)->drop_worker("a"))) << round;
  }
  EXPECT_GT(opened, 0);
  EXPECT_GT(garbage_read, 0);
}

}  // namespace
}  // namespace deltaserve::kvstore
