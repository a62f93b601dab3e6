// Sparse checkpoints of a request's KDA state (conv tails + S of every KDA layer, as encoded bytes) at
// 512-token block boundaries, keyed by the block hash that ends at the boundary. A KDA state is large
// (40 MiB per request for Kimi-Linear-48B), so checkpoints are kept only at a sparse subset of
// boundaries, under a byte budget of their own, evicted least-recently-used first. A checkpoint a
// running request is reading (a held `get` result) is never evicted.
//
// Not thread-safe: one store per worker, used from that worker's actor.
#pragma once

#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "common/status.hpp"
#include "kvstore/cache/block_hasher.hpp"

namespace deltaserve::kvstore {

struct CheckpointPolicy {
  int64_t interval_blocks = 8;      // checkpoint every N-th block boundary (>= 1)
  bool last_full_block = true;      // and at the last full block of every finished prompt
  bool only_on_second_hit = false;  // store a boundary only the second time it is seen
};

struct BlockHashHasher {
  size_t operator()(const BlockHash& h) const {
    size_t v = 0;
    for (size_t i = 0; i < sizeof(size_t); ++i) v = (v << 8) | h.bytes[i];
    return v;  // the hash is already uniformly distributed
  }
};

class CheckpointStore {
 public:
  using Bytes = std::vector<std::byte>;

  CheckpointStore(int64_t budget_bytes, CheckpointPolicy policy);

  // Whether to checkpoint at the boundary after block `block_index` (1-based) of a prompt with
  // `full_blocks` full blocks, whose hash is `hash`. With only_on_second_hit, the first call for a
  // hash records the sighting and answers false.
  bool should_checkpoint(int64_t block_index, int64_t full_blocks, const BlockHash& hash);

  // Stores (or replaces) the checkpoint; evicts unpinned entries, oldest use first, until it fits.
  // kResourceExhausted (and nothing stored) when it cannot fit even after evicting all it may.
  Status put(const BlockHash& hash, Bytes state);

  // The checkpoint, marked as most recently used; holding the pointer pins it. nullptr on a miss.
  std::shared_ptr<const Bytes> get(const BlockHash& hash);
  bool contains(const BlockHash& hash) const { return entries_.count(hash) != 0; }

  // Drops the checkpoint (a holder's copy stays valid). Not reported by take_evicted(). False on a miss.
  bool remove(const BlockHash& hash);

  // Hashes evicted since the last call (to publish to the prefix index), oldest first.
  std::vector<BlockHash> take_evicted();

  int64_t used_bytes() const { return used_bytes_; }
  int64_t budget_bytes() const { return budget_bytes_; }
  size_t size() const { return entries_.size(); }

 private:
  struct Entry {
    std::shared_ptr<const Bytes> state;
    std::list<BlockHash>::iterator lru;  // position in lru_ (front = most recent)
  };
  void erase(std::unordered_map<BlockHash, Entry, BlockHashHasher>::iterator it);

  int64_t budget_bytes_;
  CheckpointPolicy policy_;
  int64_t used_bytes_ = 0;
  std::list<BlockHash> lru_;
  std::unordered_map<BlockHash, Entry, BlockHashHasher> entries_;
  std::unordered_set<BlockHash, BlockHashHasher> seen_once_;  // second-hit policy; bounded by clearing
  std::vector<BlockHash> evicted_;
};

}  // namespace deltaserve::kvstore
