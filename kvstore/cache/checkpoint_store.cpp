#include "kvstore/cache/checkpoint_store.hpp"

#include <cassert>
#include <utility>

namespace deltaserve::kvstore {
namespace {

constexpr size_t kMaxSightings = 1 << 20;  // second-hit memory: forgotten wholesale past this many hashes

}  // namespace

CheckpointStore::CheckpointStore(int64_t budget_bytes, CheckpointPolicy policy)
    : budget_bytes_(budget_bytes), policy_(policy) {
  assert(policy_.interval_blocks >= 1);
}

bool CheckpointStore::should_checkpoint(int64_t block_index, int64_t full_blocks, const BlockHash& hash) {
  const bool on_interval = block_index % policy_.interval_blocks == 0;
  const bool last = policy_.last_full_block && block_index == full_blocks;
  if (!on_interval && !last) return false;
  if (contains(hash)) return false;  // already held
  if (!policy_.only_on_second_hit) return true;
  if (seen_once_.erase(hash) != 0) return true;
  if (seen_once_.size() >= kMaxSightings) seen_once_.clear();
  seen_once_.insert(hash);
  return false;
}

void CheckpointStore::erase(std::unordered_map<BlockHash, Entry, BlockHashHasher>::iterator it) {
  used_bytes_ -= static_cast<int64_t>(it->second.state->size());
  lru_.erase(it->second.lru);
  entries_.erase(it);
}

Status CheckpointStore::put(const BlockHash& hash, Bytes state) {
  const auto size = static_cast<int64_t>(state.size());
  if (size > budget_bytes_) {
    return Status(StatusCode::kResourceExhausted, "KDA checkpoint of " + std::to_string(size) +
                                                      " bytes exceeds the checkpoint budget of " +
                                                      std::to_string(budget_bytes_));
  }
  int64_t replaced = 0;
  if (auto it = entries_.find(hash); it != entries_.end()) {
    if (it->second.state.use_count() > 1) return Status::ok();  // pinned: the held copy stays valid and equal
    replaced = static_cast<int64_t>(it->second.state->size());
  }
  // Plan evictions first (oldest unpinned), so a failure changes nothing.
  std::vector<BlockHash> victims;
  int64_t freed = replaced;
  for (auto it = lru_.rbegin(); it != lru_.rend() && used_bytes_ - freed + size > budget_bytes_; ++it) {
    if (*it == hash) continue;
    const Entry& entry = entries_.at(*it);
    if (entry.state.use_count() > 1) continue;  // a running request reads it
    victims.push_back(*it);
    freed += static_cast<int64_t>(entry.state->size());
  }
  if (used_bytes_ - freed + size > budget_bytes_) {
    return Status(StatusCode::kResourceExhausted, "KDA checkpoint budget: the rest is pinned by running requests");
  }
  for (const BlockHash& victim : victims) {
    erase(entries_.find(victim));
    evicted_.push_back(victim);
  }
  if (auto it = entries_.find(hash); it != entries_.end()) erase(it);
  lru_.push_front(hash);
  entries_.emplace(hash, Entry{std::make_shared<const Bytes>(std::move(state)), lru_.begin()});
  used_bytes_ += size;
  return Status::ok();
}

std::shared_ptr<const CheckpointStore::Bytes> CheckpointStore::get(const BlockHash& hash) {
  auto it = entries_.find(hash);
  if (it == entries_.end()) return nullptr;
  lru_.splice(lru_.begin(), lru_, it->second.lru);
  return it->second.state;
}

bool CheckpointStore::remove(const BlockHash& hash) {
  auto it = entries_.find(hash);
  if (it == entries_.end()) return false;
  erase(it);
  return true;
}

std::vector<BlockHash> CheckpointStore::take_evicted() {
  return std::exchange(evicted_, {});
}

}  // namespace deltaserve::kvstore
