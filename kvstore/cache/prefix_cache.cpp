#include "kvstore/cache/prefix_cache.hpp"

#include <algorithm>

namespace deltaserve::kvstore {

Status validate(const PrefixCacheConfig& config) {
  if (config.block_tokens <= 0) return invalid_argument("block_tokens: must be positive");
  DS_RETURN_IF_ERROR(validate(config.pages));
  if (config.pages.page_tokens % config.block_tokens != 0) {
    return invalid_argument("page_tokens: " + std::to_string(config.pages.page_tokens) +
                            " is not a multiple of the block size " + std::to_string(config.block_tokens));
  }
  if (config.checkpoint_budget_bytes <= 0) return invalid_argument("checkpoint_budget_bytes: must be positive");
  if (config.policy.interval_blocks < 1) {
    return invalid_argument("checkpoint interval: " + std::to_string(config.policy.interval_blocks) +
                            " blocks; must be >= 1");
  }
  return Status::ok();
}

PrefixCache::PrefixCache(const PrefixCacheConfig& config)
    : block_tokens_(config.block_tokens),
      pool_(config.pages),
      checkpoints_(config.checkpoint_budget_bytes, config.policy) {}

PrefixCache::~PrefixCache() {
  for (auto& [hash, entry] : entries_) entry.pages.release(pool_);
}

void PrefixCache::touch(Map::iterator it) {
  lru_.splice(lru_.begin(), lru_, it->second.lru);
}

void PrefixCache::evict(Map::iterator it) {
  CacheEvent event;
  event.kind = CacheEvent::Kind::kEvicted;
  event.hash = it->first;
  event.block_index = it->second.block_index;
  event.cache_namespace = it->second.cache_namespace;
  events_.push_back(std::move(event));
  checkpoints_.remove(it->first);  // a checkpoint without the pages before it can never be a hit
  it->second.pages.release(pool_);
  lru_.erase(it->second.lru);
  entries_.erase(it);
}

void PrefixCache::collect_checkpoint_evictions() {
  for (const BlockHash& hash : checkpoints_.take_evicted()) {
    ++checkpoint_evictions_;
    auto it = entries_.find(hash);
    if (it == entries_.end()) continue;  // the index never heard of it
    CacheEvent event;
    event.kind = CacheEvent::Kind::kCheckpointEvicted;
    event.hash = hash;
    event.block_index = it->second.block_index;
    event.cache_namespace = it->second.cache_namespace;
    events_.push_back(std::move(event));
  }
}

PrefixCache::Hit PrefixCache::lookup(std::span<const BlockHash> hashes, int64_t max_blocks) {
  Hit hit;
  const int64_t limit = std::min<int64_t>(max_blocks, static_cast<int64_t>(hashes.size()));
  std::vector<Map::iterator> matched;
  for (int64_t b = 0; b < limit; ++b) {
    auto it = entries_.find(hashes[static_cast<size_t>(b)]);
    if (it == entries_.end()) break;
    matched.push_back(it);
  }
  // Deepest first, so the first blocks of a prompt end up most recent (evicted last).
  for (auto it = matched.rbegin(); it != matched.rend(); ++it) touch(*it);
  for (auto k = static_cast<int64_t>(matched.size()); k > 0; --k) {
    auto checkpoint = checkpoints_.get(hashes[static_cast<size_t>(k - 1)]);
    if (!checkpoint) continue;
    const Entry& entry = matched[static_cast<size_t>(k - 1)]->second;
    hit.blocks = k;
    hit.pages = PageTable::share_prefix(pool_, entry.pages, k * block_tokens_);
    hit.checkpoint = std::move(checkpoint);
    break;
  }
  return hit;
}

Status PrefixCache::put_checkpoint(const BlockHash& hash, Bytes state) {
  Status status = checkpoints_.put(hash, std::move(state));
  collect_checkpoint_evictions();
  return status;
}

void PrefixCache::insert(std::span<const BlockHash> hashes, const PageTable& table, std::string_view cache_namespace) {
  const auto blocks = std::min<int64_t>(static_cast<int64_t>(hashes.size()), table.num_tokens() / block_tokens_);
  for (int64_t b = blocks; b >= 1; --b) {  // deepest first: block 1 ends up most recent
    const BlockHash& hash = hashes[static_cast<size_t>(b - 1)];
    auto it = entries_.find(hash);
    if (it == entries_.end()) {
      lru_.push_front(hash);
      Entry entry{b, PageTable::share_prefix(pool_, table, b * block_tokens_), std::string(cache_namespace),
                  lru_.begin()};
      it = entries_.emplace(hash, std::move(entry)).first;
    } else {
      touch(it);
    }
    CacheEvent event;
    event.kind = CacheEvent::Kind::kStored;
    event.hash = hash;
    event.block_index = b;
    event.has_checkpoint = checkpoints_.contains(hash);
    event.cache_namespace = std::string(cache_namespace);
    events_.push_back(std::move(event));
  }
}

bool PrefixCache::make_room(int64_t pages) {
  while (pool_.free_pages() < pages && !lru_.empty()) {
    evict(entries_.find(lru_.back()));
    ++entry_evictions_;
  }
  return pool_.free_pages() >= pages;
}

Status PrefixCache::append(PageTable& table, std::span<const float> rows) {
  Status status = table.append(pool_, rows);
  // Evict least recently used entries until a page comes free, then try again; stop when nothing is left.
  while (status.code() == StatusCode::kResourceExhausted && !lru_.empty()) {
    const int64_t before = pool_.free_pages();
    while (pool_.free_pages() == before && !lru_.empty()) {
      evict(entries_.find(lru_.back()));
      ++entry_evictions_;
    }
    status = table.append(pool_, rows);
  }
  return status;
}

void PrefixCache::clear() {
  while (!lru_.empty()) evict(entries_.find(lru_.back()));
}

std::vector<CacheEvent> PrefixCache::take_events() {
  collect_checkpoint_evictions();
  return std::exchange(events_, {});
}

PrefixCacheStats PrefixCache::stats() const {
  PrefixCacheStats s;
  s.entries = static_cast<int64_t>(entries_.size());
  s.checkpoints = static_cast<int64_t>(checkpoints_.size());
  s.checkpoint_bytes = checkpoints_.used_bytes();
  s.pages_total = pool_.num_pages();
  s.pages_free = pool_.free_pages();
  s.entry_evictions = entry_evictions_;
  s.checkpoint_evictions = checkpoint_evictions_;
  return s;
}

}  // namespace deltaserve::kvstore
