// What a worker's prefix cache tells the router's prefix index: a block boundary (named by its chained
// block hash) is now held — MLA pages for every token up to it, and maybe a KDA checkpoint exactly at it —
// or is no longer held. Events are published in batches, in the order they happened on the worker.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvstore/cache/block_hasher.hpp"

namespace deltaserve::kvstore {

struct CacheEvent {
  enum class Kind : uint8_t {
    kStored = 0,             // pages up to the boundary are held; has_checkpoint says whether a KDA checkpoint is too
    kEvicted = 1,            // nothing is held at the boundary any more (pages and checkpoint)
    kCheckpointEvicted = 2,  // the pages stay, the checkpoint at the boundary is gone
  };
  Kind kind = Kind::kStored;
  BlockHash hash;
  int64_t block_index = 0;      // 1-based: the boundary after block_index full blocks (depth = index × 512)
  bool has_checkpoint = false;  // kStored only
  std::string cache_namespace;  // the tenant namespace the hash chain is rooted in
};

// One worker's batch. `worker_epoch` changes whenever the worker's cache starts empty (process start),
// so entries of an earlier incarnation under the same name can be told apart and dropped.
struct CacheEventBatch {
  std::string worker;
  uint64_t worker_epoch = 0;
  std::vector<CacheEvent> events;
};

}  // namespace deltaserve::kvstore
