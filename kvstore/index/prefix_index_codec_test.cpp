#include "kvstore/index/prefix_index_codec.hpp"

#include <random>

#include <gtest/gtest.h>

namespace deltaserve::kvstore::index_format {
namespace {

BlockHash hash_of(uint8_t n) {
  BlockHash h;
  for (size_t i = 0; i < h.bytes.size(); ++i) h.bytes[i] = static_cast<uint8_t>(n + i);
  return h;
}

TEST(PrefixIndexCodec, Crc32cKnownAnswer) {
  EXPECT_EQ(crc32c("123456789"), 0xE3069283u);  // the CRC-32C check value
  EXPECT_EQ(crc32c(""), 0u);
  EXPECT_EQ(crc32c("6789", crc32c("12345")), crc32c("123456789"));
}

TEST(PrefixIndexCodec, KeysRoundTripAndGroup) {
  const std::string entry = entry_key(hash_of(7), "worker-a");
  EXPECT_EQ(entry.substr(0, kEntryPrefixBytes), entry_prefix(hash_of(7)));
  auto decoded = decode_entry_key(entry);
  ASSERT_TRUE(decoded.is_ok()) << decoded.status().to_string();
  EXPECT_EQ(decoded->hash, hash_of(7));
  EXPECT_EQ(decoded->worker, "worker-a");

  const std::string by_worker = worker_key("worker-a", hash_of(9));
  EXPECT_EQ(by_worker.substr(0, worker_prefix("worker-a").size()), worker_prefix("worker-a"));
  auto w = decode_worker_key(by_worker);
  ASSERT_TRUE(w.is_ok()) << w.status().to_string();
  EXPECT_EQ(w->worker, "worker-a");
  EXPECT_EQ(w->hash, hash_of(9));
  // A worker whose name extends another's has a different range (the length is in the prefix).
  EXPECT_NE(worker_key("worker-ab", hash_of(9)).substr(0, worker_prefix("worker-a").size()), worker_prefix("worker-a"));

  const std::string epoch = epoch_key("w");
  auto e = decode_epoch_key(epoch);  // views into `epoch`
  ASSERT_TRUE(e.is_ok());
  EXPECT_EQ(*e, "w");
}

TEST(PrefixIndexCodec, PrefixSuccessor) {
  EXPECT_EQ(prefix_successor("ab"), "ac");
  EXPECT_EQ(prefix_successor(std::string("a\xff", 2)), "b");
  EXPECT_EQ(prefix_successor(std::string("\xff\xff", 2)), "");
}

TEST(PrefixIndexCodec, EntryValueRoundTrip) {
  const std::string key = entry_key(hash_of(1), "w");
  const std::string value = encode_entry_value(
      key, {.epoch = 42, .block_index = 7, .has_checkpoint = true, .last_use_ms = 1234, .cache_namespace = "t"});
  auto decoded = decode_entry_value(key, value);
  ASSERT_TRUE(decoded.is_ok()) << decoded.status().to_string();
  EXPECT_EQ(decoded->epoch, 42u);
  EXPECT_EQ(decoded->block_index, 7);
  EXPECT_TRUE(decoded->has_checkpoint);
  EXPECT_EQ(decoded->last_use_ms, 1234);
  EXPECT_EQ(decoded->cache_namespace, "t");

  auto epoch = decode_epoch_value(epoch_key("w"), encode_epoch_value(epoch_key("w"), 99));
  ASSERT_TRUE(epoch.is_ok());
  EXPECT_EQ(*epoch, 99u);
}

TEST(PrefixIndexCodec, EveryTruncationAndBitFlipIsRejected) {
  const std::string key = entry_key(hash_of(1), "w");
  const std::string value = encode_entry_value(
      key, {.epoch = 3, .block_index = 2, .has_checkpoint = false, .last_use_ms = 5, .cache_namespace = "tenant"});
  for (size_t n = 0; n < value.size(); ++n) {
    EXPECT_EQ(decode_entry_value(key, value.substr(0, n)).status().code(), StatusCode::kDataLoss) << n;
  }
  for (size_t i = 0; i < value.size(); ++i) {
    for (int bit = 0; bit < 8; ++bit) {
      std::string flipped = value;
      flipped[i] = static_cast<char>(flipped[i] ^ (1 << bit));
      EXPECT_FALSE(decode_entry_value(key, flipped).is_ok()) << i << ":" << bit;
    }
  }
  // The same value under another key (another worker or block) does not decode: no wrong hit.
  EXPECT_FALSE(decode_entry_value(entry_key(hash_of(1), "x"), value).is_ok());
  EXPECT_FALSE(decode_entry_value(entry_key(hash_of(2), "w"), value).is_ok());
  EXPECT_FALSE(decode_epoch_value(epoch_key("w"), "short").is_ok());
  EXPECT_FALSE(decode_epoch_value(epoch_key("x"), encode_epoch_value(epoch_key("w"), 1)).is_ok());
}

TEST(PrefixIndexCodec, MalformedKeysAreErrorsWithPrintableNames) {
  EXPECT_FALSE(decode_entry_key("b").is_ok());
  EXPECT_FALSE(decode_entry_key(std::string(17, 'b')).is_ok());  // no worker
  EXPECT_FALSE(decode_worker_key(std::string("w\x00\x05"
                                             "abc",
                                             6))
                   .is_ok());
  std::string bad_length = worker_key("abc", hash_of(1));
  bad_length[2] = 9;
  EXPECT_FALSE(decode_worker_key(bad_length).is_ok());
  EXPECT_FALSE(decode_epoch_key("e").is_ok());
  EXPECT_EQ(describe_key(entry_key(hash_of(0), "w\n")), "b:" + hash_of(0).hex() + "/w\\x0a");
  EXPECT_EQ(describe_key(epoch_key("w")), "e:w");
  EXPECT_EQ(describe_key(std::string("z\x01", 2)), "0x7a01");
}

// A libFuzzer-style loop over the decoders: mutated keys and values never crash, and whatever decodes is
// canonical (encoding it again gives the same bytes), so no two stored forms mean the same entry.
TEST(PrefixIndexCodec, MutatedKeysAndValuesNeverCrashAndDecodeCanonically) {
  const std::string entry = entry_key(hash_of(3), "worker-1");
  const std::string seeds[] = {
      entry,
      worker_key("worker-1", hash_of(3)),
      epoch_key("worker-1"),
      encode_entry_value(
          entry,
          {.epoch = 9, .block_index = 4, .has_checkpoint = true, .last_use_ms = 77, .cache_namespace = "tenant-a"}),
      encode_epoch_value(epoch_key("worker-1"), 9),
  };
  std::mt19937_64 rng(20261201);
  int decoded_keys = 0;
  for (int iteration = 0; iteration < 20000; ++iteration) {
    std::string bytes = seeds[rng() % std::size(seeds)];
    const int mutations = static_cast<int>(rng() % 4);
    for (int m = 0; m < mutations && !bytes.empty(); ++m) {
      const size_t at = rng() % bytes.size();
      switch (rng() % 4) {
        case 0:
          bytes[at] = static_cast<char>(rng());
          break;
        case 1:
          bytes.insert(at, 1, static_cast<char>(rng()));
          break;
        case 2:
          bytes.erase(at, 1 + rng() % 4);
          break;
        default:
          bytes.insert(at, bytes.substr(rng() % bytes.size(), rng() % 16));
          break;
      }
    }
    if (auto k = decode_entry_key(bytes); k.is_ok()) {
      EXPECT_EQ(entry_key(k->hash, k->worker), bytes);
      ++decoded_keys;
    }
    if (auto k = decode_worker_key(bytes); k.is_ok()) {
      EXPECT_EQ(worker_key(k->worker, k->hash), bytes);
    }
    if (auto k = decode_epoch_key(bytes); k.is_ok()) {
      EXPECT_EQ(epoch_key(*k), bytes);
    }
    if (auto v = decode_entry_value(entry, bytes); v.is_ok()) {
      EXPECT_EQ(encode_entry_value(entry, *v), bytes);
    }
    if (auto v = decode_epoch_value(epoch_key("worker-1"), bytes); v.is_ok()) {
      EXPECT_EQ(encode_epoch_value(epoch_key("worker-1"), *v), bytes);
    }
    (void)describe_key(bytes);
  }
  EXPECT_GT(decoded_keys, 0);
}

}  // namespace
}  // namespace deltaserve::kvstore::index_format
