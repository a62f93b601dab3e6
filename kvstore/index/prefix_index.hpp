// The router's prefix index: which workers hold which 512-token block boundaries of which prompts, and
// whether they hold a KDA checkpoint there. Backed by RocksDB on disk so it survives a router restart;
// after a restart it is reconciled against the live workers (entries of workers that are gone, or of an
// earlier incarnation of a worker, are dropped).
//
// The index is advisory: a lost or stale entry may cost a cache miss, never a wrong hit, because the
// worker looks the prompt's block hashes up in its own cache when the request arrives.
//
// Thread-safety: every method may be called from any thread (RocksDB is thread-safe); apply() calls are
// serialized internally so batches land in the order they were applied.
//
// Loss semantics: apply(), drop_worker() and reconcile() each write one RocksDB WriteBatch, so after a crash
// each is wholly present or wholly absent. With sync_writes=false a returned call survives a process kill
// but may be lost with the machine (a lost batch costs misses, never a wrong hit).
// Corruption: an entry read back that fails to decode (checksum over key and value, version, lengths) makes
// the call return kDataLoss naming the key; it is never matched. On-disk layout: prefix_index_codec.hpp.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.hpp"
#include "kvstore/cache/block_hasher.hpp"
#include "kvstore/cache/cache_event.hpp"

namespace deltaserve::kvstore {

struct PrefixIndexOptions {
  bool sync_writes = false;  // fsync the WAL on every batch (crash-safe against power loss, slower)
  int64_t block_cache_bytes = 64 << 20;
};

// One worker's usable prefix of a prompt.
struct WorkerPrefixMatch {
  std::string worker;
  uint64_t worker_epoch = 0;
  int64_t pages_blocks = 0;       // blocks 1..pages_blocks are all held (contiguous from the start)
  int64_t checkpoint_blocks = 0;  // deepest boundary <= pages_blocks with a checkpoint (0 = none): the usable hit
};

// The order lookup() returns: the best usable hit first (checkpoint_blocks, then pages_blocks, then name).
inline bool better_prefix_match(const WorkerPrefixMatch& a, const WorkerPrefixMatch& b) {
  if (a.checkpoint_blocks != b.checkpoint_blocks) return a.checkpoint_blocks > b.checkpoint_blocks;
  if (a.pages_blocks != b.pages_blocks) return a.pages_blocks > b.pages_blocks;
  return a.worker < b.worker;
}

struct PrefixIndexStats {
  int64_t entries = 0;         // (block, worker) entries: estimate from rocksdb.estimate-num-keys (2 keys per entry)
  int64_t sst_file_bytes = 0;  // live SST files on disk (rocksdb.live-sst-files-size), excludes WAL/memtable
  int64_t batches_written = 0;
  int64_t write_errors = 0;
  int64_t last_write_micros = 0;
  int64_t total_write_micros = 0;
};

class PrefixIndex {
 public:
  // Opens (creating if needed) the index in `directory`. Errors name the directory and RocksDB's reason
  // (kIoError; kDataLoss when RocksDB or an epoch record reports corruption). One process at a time: a second
  // open of the same directory fails on RocksDB's LOCK file.
  static Result<std::unique_ptr<PrefixIndex>> open(const std::filesystem::path& directory,
                                                   const PrefixIndexOptions& options = {});
  virtual ~PrefixIndex() = default;

  // Applies one worker's events as one atomic RocksDB WriteBatch. A batch from an epoch other than the
  // worker's current one first drops every entry of the worker's older epoch (in the same WriteBatch).
  // kStored upserts (has_checkpoint as given, last use = now); kEvicted deletes; kCheckpointEvicted clears
  // has_checkpoint of an existing entry and creates nothing for a block the index does not hold.
  // kInvalidArgument (nothing written): empty or > 1024-byte worker name, block_index outside 1..2^40,
  // namespace > 4096 bytes, unknown event kind.
  virtual Status apply(const CacheEventBatch& batch) = 0;

  // For the prompt's block hashes (in order, hashes[i] ends block i+1), every worker holding at least
  // block 1 in `cache_namespace`, best usable match first (checkpoint_blocks, then pages_blocks).
  // Entries recorded under another namespace never match.
  virtual Result<std::vector<WorkerPrefixMatch>> lookup(std::span<const BlockHash> hashes,
                                                        std::string_view cache_namespace) const = 0;

  // Drops every entry of `worker` (it left or died).
  virtual Status drop_worker(std::string_view worker) = 0;

  // Keeps only entries of the given (worker, epoch) pairs; returns how many entries were dropped.
  virtual Result<int64_t> reconcile(std::span<const std::pair<std::string, uint64_t>> live_workers) = 0;

  // (worker, epoch) pairs that have entries.
  virtual Result<std::vector<std::pair<std::string, uint64_t>>> workers() const = 0;

  virtual PrefixIndexStats stats() const = 0;
};

}  // namespace deltaserve::kvstore
