// On-disk layout of the prefix index (one RocksDB column family, three key ranges). Kept apart from the
// RocksDB code so the format can be tested and fuzzed alone; every decoder treats its input as untrusted
// (a torn or corrupted file) and returns an error instead of asserting.
//
//   entry      "b" ‖ hash (16 bytes) ‖ worker                → EntryValue   (one per held (block, worker))
//   by worker  "w" ‖ u16 BE len(worker) ‖ worker ‖ hash (16)  → ""           (one per entry: drop/reconcile)
//   epoch      "e" ‖ worker                                   → EpochValue   (the worker's current epoch)
//
// A prefix seek on "b" ‖ hash finds every worker holding that block; a prefix seek on "w" ‖ len ‖ worker
// finds every block of a worker. Entry and by-worker keys are always written and deleted together in one
// WriteBatch, so after any crash each exists exactly when the other does.
//
// EntryValue (version 1, integers little-endian):
//   u8 version=1 ‖ u8 flags (bit 0: has_checkpoint; others 0) ‖ u64 epoch ‖ u64 block_index (≥ 1)
//   ‖ u64 last_use_ms (Unix ms) ‖ u16 len ‖ namespace ‖ u32 CRC-32C(key ‖ all preceding value bytes)
// EpochValue (version 1): u8 version=1 ‖ u64 epoch ‖ u32 CRC-32C(key ‖ preceding bytes).
// The checksum covers the key, so a value that lands under another key never decodes (no wrong hit).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "common/status.hpp"
#include "kvstore/cache/block_hasher.hpp"

namespace deltaserve::kvstore::index_format {

inline constexpr char kEntryTag = 'b';
inline constexpr char kWorkerTag = 'w';
inline constexpr char kEpochTag = 'e';
inline constexpr size_t kHashBytes = 16;
inline constexpr size_t kEntryPrefixBytes = 1 + kHashBytes;  // "b" ‖ hash: the RocksDB prefix-extractor length
inline constexpr size_t kMaxWorkerNameBytes = 1024;
inline constexpr size_t kMaxNamespaceBytes = 4096;
inline constexpr int64_t kMaxBlockIndex = int64_t{1} << 40;

// CRC-32C (Castagnoli, reflected 0x82F63B78), continuing from `crc` (0 to start).
uint32_t crc32c(std::string_view bytes, uint32_t crc = 0);

std::string entry_prefix(const BlockHash& hash);  // "b" ‖ hash
std::string entry_key(const BlockHash& hash, std::string_view worker);
std::string worker_prefix(std::string_view worker);  // "w" ‖ len ‖ worker
std::string worker_key(std::string_view worker, const BlockHash& hash);
std::string epoch_key(std::string_view worker);

// The first key after every key that starts with `prefix` ("" when there is none: prefix all 0xff).
std::string prefix_successor(std::string_view prefix);

struct EntryKey {
  BlockHash hash;
  std::string_view worker;  // points into the decoded key
};
struct WorkerKey {
  std::string_view worker;  // points into the decoded key
  BlockHash hash;
};

Result<EntryKey> decode_entry_key(std::string_view key);
Result<WorkerKey> decode_worker_key(std::string_view key);
Result<std::string_view> decode_epoch_key(std::string_view key);  // the worker name

struct EntryValue {
  uint64_t epoch = 0;
  int64_t block_index = 0;
  bool has_checkpoint = false;
  int64_t last_use_ms = 0;
  std::string_view cache_namespace;  // points into the decoded value (or the caller's string when encoding)
};

std::string encode_entry_value(std::string_view key, const EntryValue& value);
// Errors say what is wrong, not where: the caller adds the key (see describe_key).
Result<EntryValue> decode_entry_value(std::string_view key, std::string_view value);

std::string encode_epoch_value(std::string_view key, uint64_t epoch);
Result<uint64_t> decode_epoch_value(std::string_view key, std::string_view value);

// A printable name for any key: "b:<hash hex>/<worker>", "w:<worker>/<hash hex>", "e:<worker>", or hex.
std::string describe_key(std::string_view key);

}  // namespace deltaserve::kvstore::index_format
