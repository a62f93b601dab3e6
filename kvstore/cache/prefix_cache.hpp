// A worker's prefix cache for the hybrid model (product.md, "Caching rules"): MLA latent rows live in
// shared, reference-counted pages (PagePool); KDA state lives in sparse checkpoints at 512-token block
// boundaries (CheckpointStore). A boundary is a usable hit only when BOTH exist: the pages of every token
// up to it, and a KDA checkpoint exactly at it. Everything after the deepest usable boundary is recomputed.
//
// Entries are keyed by the chained block hash (BlockHasher), so a hash names a whole prefix in one tenant
// namespace. Each entry holds a share of the pages of its prefix; entries are evicted least recently used
// first, deepest first within a prompt (a lookup touches a prompt's entries from the deepest to the first),
// and evicting an entry never frees a page a running request holds (requests hold their own references).
//
// Every change the router's index should know is queued as a CacheEvent (take_events()).
//
// Not thread-safe: one cache per worker, used from that worker's actor.
#pragma once

#include <cstdint>
#include <list>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/status.hpp"
#include "kvstore/cache/block_hasher.hpp"
#include "kvstore/cache/cache_event.hpp"
#include "kvstore/cache/checkpoint_store.hpp"
#include "kvstore/cache/page_pool.hpp"

namespace deltaserve::kvstore {

struct PrefixCacheConfig {
  int64_t block_tokens = kDefaultBlockTokens;
  PagePoolConfig pages;                         // page_tokens must be a multiple of block_tokens
  int64_t checkpoint_budget_bytes = 256 << 20;  // KDA checkpoints, separate from the pages
  CheckpointPolicy policy;
};

Status validate(const PrefixCacheConfig& config);

struct PrefixCacheStats {
  int64_t entries = 0;           // block boundaries whose pages are held
  int64_t checkpoints = 0;       // KDA checkpoints held
  int64_t checkpoint_bytes = 0;  // their bytes (budget: checkpoint_budget_bytes)
  int64_t pages_total = 0;
  int64_t pages_free = 0;
  int64_t entry_evictions = 0;       // entries dropped to make room for pages
  int64_t checkpoint_evictions = 0;  // checkpoints dropped for the budget
};

class PrefixCache {
 public:
  using Bytes = CheckpointStore::Bytes;

  explicit PrefixCache(const PrefixCacheConfig& config);  // config must pass validate()
  ~PrefixCache();
  PrefixCache(const PrefixCache&) = delete;
  PrefixCache& operator=(const PrefixCache&) = delete;

  struct Hit {
    int64_t blocks = 0;  // usable depth: blocks × block_tokens tokens are served from the cache
    PageTable pages;     // the shared pages of those tokens (retained: the caller releases into pool())
    std::shared_ptr<const Bytes> checkpoint;  // the KDA state at the boundary (pinned while held); null at 0
  };

  // The deepest boundary k <= max_blocks such that hashes[0..k) all have pages and hashes[k-1] has a
  // checkpoint. Touches what it matched (most recently used).
  Hit lookup(std::span<const BlockHash> hashes, int64_t max_blocks);

  // Whether to checkpoint at boundary `block_index` (1-based) of a prompt with `full_blocks` blocks.
  bool should_checkpoint(int64_t block_index, int64_t full_blocks, const BlockHash& hash) {
    return checkpoints_.should_checkpoint(block_index, full_blocks, hash);
  }
  // Stores a KDA checkpoint (the index learns of it with the boundary's pages, at insert()).
  Status put_checkpoint(const BlockHash& hash, Bytes state);

  // Registers boundaries 1..hashes.size() of a finished prefill whose rows are in `table` (it holds at
  // least hashes.size() × block_tokens tokens). New entries share the table's pages; existing ones are
  // touched. Queues a kStored event per boundary.
  void insert(std::span<const BlockHash> hashes, const PageTable& table, std::string_view cache_namespace);

  // Appends rows to a request's table; when the pool is full, evicts cached entries (least recently used
  // first) until it fits. kResourceExhausted (nothing appended) when running requests hold the pages.
  Status append(PageTable& table, std::span<const float> rows);

  // Evicts entries until `pages` pages are free or no entry is left. True when the pages are free.
  bool make_room(int64_t pages);

  // Drops every entry and checkpoint (queues their events).
  void clear();

  std::vector<CacheEvent> take_events();

  PagePool& pool() { return pool_; }
  const PagePool& pool() const { return pool_; }
  int64_t block_tokens() const { return block_tokens_; }
  PrefixCacheStats stats() const;

 private:
  struct Entry {
    int64_t block_index = 0;
    PageTable pages;
    std::string cache_namespace;
    std::list<BlockHash>::iterator lru;  // front = most recent
  };
  using Map = std::unordered_map<BlockHash, Entry, BlockHashHasher>;

  void touch(Map::iterator it);
  void evict(Map::iterator it);
  void collect_checkpoint_evictions();

  int64_t block_tokens_;
  PagePool pool_;
  CheckpointStore checkpoints_;
  Map entries_;
  std::list<BlockHash> lru_;
  std::vector<CacheEvent> events_;
  int64_t entry_evictions_ = 0;
  int64_t checkpoint_evictions_ = 0;
};

}  // namespace deltaserve::kvstore
