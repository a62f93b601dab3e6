// The RocksDB implementation of PrefixIndex. Layout: prefix_index_codec.hpp.
//
// Loss semantics: every apply() / drop_worker() / reconcile() is one WriteBatch, so after a crash each
// one is either wholly present or wholly absent. With sync_writes=false a batch survives a process kill
// (it is in the OS page cache once Write returns) but may be lost with the machine; the index is
// advisory, so a lost batch costs cache misses, never a wrong hit.
#include "kvstore/index/prefix_index.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <unordered_set>

#include <rocksdb/db.h>
#include <rocksdb/filter_policy.h>
#include <rocksdb/slice_transform.h>
#include <rocksdb/table.h>
#include <rocksdb/write_batch.h>

#include "kvstore/index/prefix_index_codec.hpp"

namespace deltaserve::kvstore {
namespace {

namespace codec = index_format;

std::string_view view(const rocksdb::Slice& s) {
  return {s.data(), s.size()};
}

int64_t now_unix_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

class RocksPrefixIndex final : public PrefixIndex {
 public:
  RocksPrefixIndex(std::filesystem::path directory, const PrefixIndexOptions& options, rocksdb::DB* db)
      : directory_(std::move(directory)), db_(db) {
    write_options_.sync = options.sync_writes;
  }

  ~RocksPrefixIndex() override {
    // Close flushes nothing we rely on (the WAL already holds every batch); its status only matters to
    // tests that reopen, and they do reopen successfully or fail loudly there.
    (void)db_->Close();
    delete db_;
  }

  Status load_epochs() {
    std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(total_order_read()));
    const std::string start(1, codec::kEpochTag);
    for (it->Seek(start); it->Valid() && it->key().starts_with(start); it->Next()) {
      const std::string_view key = view(it->key());
      auto worker = codec::decode_epoch_key(key);
      if (!worker.is_ok()) return corrupt(key, worker.status());
      auto epoch = codec::decode_epoch_value(key, view(it->value()));
      if (!epoch.is_ok()) return corrupt(key, epoch.status());
      epochs_[std::string(*worker)] = *epoch;
    }
    return rocks_status("read epochs", it->status());
  }

  Status apply(const CacheEventBatch& batch) override {
    if (batch.worker.empty() || batch.worker.size() > codec::kMaxWorkerNameBytes) {
      return invalid_argument("prefix index: worker name must have 1.." + std::to_string(codec::kMaxWorkerNameBytes) +
                              " bytes (got " + std::to_string(batch.worker.size()) + ")");
    }
    for (const CacheEvent& event : batch.events) {
      if (event.block_index < 1 || event.block_index > codec::kMaxBlockIndex) {
        return invalid_argument("prefix index: worker " + batch.worker + ": block index " +
                                std::to_string(event.block_index) + " out of range");
      }
      if (event.cache_namespace.size() > codec::kMaxNamespaceBytes) {
        return invalid_argument("prefix index: worker " + batch.worker + ": cache namespace longer than " +
                                std::to_string(codec::kMaxNamespaceBytes) + " bytes");
      }
    }

    std::lock_guard lock(write_mutex_);
    const auto start = std::chrono::steady_clock::now();
    rocksdb::WriteBatch write_batch;
    // What this batch has already decided for an entry key (nullopt = deleted), so that a later event of
    // the same batch (a checkpoint eviction) sees the earlier ones.
    std::unordered_map<std::string, std::optional<std::string>> pending;

    const auto known = epochs_.find(batch.worker);
    if (known == epochs_.end() || known->second != batch.worker_epoch) {
      if (known != epochs_.end()) {
        auto dropped = drop_worker_entries(batch.worker, write_batch, &pending);
        if (!dropped.is_ok()) return dropped.status();
      }
      const std::string key = codec::epoch_key(batch.worker);
      write_batch.Put(key, codec::encode_epoch_value(key, batch.worker_epoch));
    }

    const int64_t now_ms = now_unix_ms();
    for (const CacheEvent& event : batch.events) {
      std::string key = codec::entry_key(event.hash, batch.worker);
      switch (event.kind) {
        case CacheEvent::Kind::kStored: {
          std::string value = codec::encode_entry_value(key, {.epoch = batch.worker_epoch,
                                                              .block_index = event.block_index,
                                                              .has_checkpoint = event.has_checkpoint,
                                                              .last_use_ms = now_ms,
                                                              .cache_namespace = event.cache_namespace});
          write_batch.Put(key, value);
          write_batch.Put(codec::worker_key(batch.worker, event.hash), rocksdb::Slice());
          pending[std::move(key)] = std::move(value);
          break;
        }
        case CacheEvent::Kind::kEvicted:
          write_batch.Delete(key);
          write_batch.Delete(codec::worker_key(batch.worker, event.hash));
          pending[std::move(key)] = std::nullopt;
          break;
        case CacheEvent::Kind::kCheckpointEvicted: {
          // Only an entry that exists changes; an eviction for a block we never heard of creates nothing.
          std::optional<std::string> current;
          if (auto it = pending.find(key); it != pending.end()) {
            current = it->second;
          } else {
            std::string stored;
            const rocksdb::Status s = db_->Get(rocksdb::ReadOptions(), key, &stored);
            if (s.ok()) {
              current = std::move(stored);
            } else if (!s.IsNotFound()) {
              return rocks_status("read " + codec::describe_key(key), s);
            }
          }
          if (!current) break;
          auto decoded = codec::decode_entry_value(key, *current);
          if (!decoded.is_ok()) return corrupt(key, decoded.status());
          codec::EntryValue updated = *decoded;
          updated.has_checkpoint = false;
          std::string value = codec::encode_entry_value(key, updated);
          write_batch.Put(key, value);
          pending[std::move(key)] = std::move(value);
          break;
        }
        default:
          return invalid_argument("prefix index: worker " + batch.worker + ": unknown event kind " +
                                  std::to_string(static_cast<int>(event.kind)));
      }
    }

    DS_RETURN_IF_ERROR(write(write_batch, "apply batch of worker " + batch.worker, start));
    epochs_[batch.worker] = batch.worker_epoch;
    return Status::ok();
  }

  Result<std::vector<WorkerPrefixMatch>> lookup(std::span<const BlockHash> hashes,
                                                std::string_view cache_namespace) const override {
    std::vector<WorkerPrefixMatch> matches;
    if (hashes.empty()) return matches;
    rocksdb::ReadOptions read;
    read.prefix_same_as_start = true;  // stay within "b" ‖ hash; lets the prefix bloom filters skip files
    // One iterator for the whole walk: it reads one consistent version of the index.
    std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(read));
    std::map<std::string, size_t, std::less<>> by_worker;  // worker → index into matches
    for (size_t i = 0; i < hashes.size(); ++i) {
      const auto depth = static_cast<int64_t>(i + 1);
      const std::string prefix = codec::entry_prefix(hashes[i]);
      bool continued = false;
      for (it->Seek(prefix); it->Valid() && it->key().starts_with(prefix); it->Next()) {
        const std::string_view key = view(it->key());
        auto value = codec::decode_entry_value(key, view(it->value()));
        if (!value.is_ok()) return corrupt(key, value.status());
        // Defense in depth: the chain is rooted in the namespace, and a hash names one depth only.
        if (value->cache_namespace != cache_namespace || value->block_index != depth) continue;
        const std::string_view worker = key.substr(codec::kEntryPrefixBytes);
        WorkerPrefixMatch* match = nullptr;
        if (depth == 1) {
          by_worker.emplace(std::string(worker), matches.size());
          match = &matches.emplace_back();
          match->worker = std::string(worker);
          match->worker_epoch = value->epoch;
        } else if (auto found = by_worker.find(worker); found != by_worker.end()) {
          match = &matches[found->second];
          if (match->pages_blocks != depth - 1 || match->worker_epoch != value->epoch) continue;
        } else {
          continue;
        }
        match->pages_blocks = depth;
        if (value->has_checkpoint) match->checkpoint_blocks = depth;
        continued = true;
      }
      if (!it->status().ok()) return rocks_status("lookup", it->status());
      if (!continued) break;
    }
    std::sort(matches.begin(), matches.end(), better_prefix_match);
    return matches;
  }

  Status drop_worker(std::string_view worker) override {
    if (worker.empty() || worker.size() > codec::kMaxWorkerNameBytes) return Status::ok();  // cannot have entries
    std::lock_guard lock(write_mutex_);
    const auto start = std::chrono::steady_clock::now();
    rocksdb::WriteBatch write_batch;
    auto dropped = drop_worker_entries(worker, write_batch, nullptr);
    if (!dropped.is_ok()) return dropped.status();
    write_batch.Delete(codec::epoch_key(worker));
    DS_RETURN_IF_ERROR(write(write_batch, "drop worker " + std::string(worker), start));
    epochs_.erase(std::string(worker));
    return Status::ok();
  }

  Result<int64_t> reconcile(std::span<const std::pair<std::string, uint64_t>> live_workers) override {
    std::lock_guard lock(write_mutex_);
    const auto start = std::chrono::steady_clock::now();
    std::unordered_map<std::string_view, uint64_t> live;
    for (const auto& [worker, epoch] : live_workers) live[worker] = epoch;
    auto is_live = [&](std::string_view worker) {
      const auto l = live.find(worker);
      const auto e = epochs_.find(std::string(worker));
      return l != live.end() && e != epochs_.end() && l->second == e->second;
    };

    rocksdb::WriteBatch write_batch;
    int64_t dropped_entries = 0;
    std::vector<std::string> dropped_workers;
    // Every worker with an epoch record, and every worker with by-worker keys (an epoch record is always
    // written with them, but reconcile must not depend on that).
    for (const auto& [worker, epoch] : epochs_) {
      if (!is_live(worker)) dropped_workers.push_back(worker);
    }
    {
      std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(total_order_read()));
      const std::string start_key(1, codec::kWorkerTag);
      it->Seek(start_key);
      while (it->Valid() && it->key().starts_with(start_key)) {
        const std::string_view key = view(it->key());
        auto decoded = codec::decode_worker_key(key);
        if (!decoded.is_ok()) return corrupt(key, decoded.status());
        const std::string worker(decoded->worker);
        if (!is_live(worker) && !epochs_.contains(worker)) dropped_workers.push_back(worker);
        it->Seek(codec::prefix_successor(codec::worker_prefix(worker)));  // next worker
      }
      if (!it->status().ok()) return rocks_status("reconcile", it->status());
    }
    for (const std::string& worker : dropped_workers) {
      auto count = drop_worker_entries(worker, write_batch, nullptr);
      if (!count.is_ok()) return count.status();
      dropped_entries += *count;
      write_batch.Delete(codec::epoch_key(worker));
    }
    if (dropped_workers.empty()) return dropped_entries;
    DS_RETURN_IF_ERROR(write(write_batch, "reconcile", start));
    for (const std::string& worker : dropped_workers) epochs_.erase(worker);
    return dropped_entries;
  }

  Result<std::vector<std::pair<std::string, uint64_t>>> workers() const override {
    std::map<std::string, uint64_t> epochs;
    {
      std::lock_guard lock(write_mutex_);
      epochs.insert(epochs_.begin(), epochs_.end());
    }
    std::vector<std::pair<std::string, uint64_t>> out;
    std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(total_order_read()));
    for (const auto& [worker, epoch] : epochs) {
      const std::string prefix = codec::worker_prefix(worker);
      it->Seek(prefix);
      if (it->Valid() && it->key().starts_with(prefix)) out.emplace_back(worker, epoch);
      if (!it->status().ok()) return rocks_status("list workers", it->status());
    }
    return out;
  }

  PrefixIndexStats stats() const override {
    PrefixIndexStats out;
    uint64_t keys = 0;
    if (db_->GetIntProperty("rocksdb.estimate-num-keys", &keys)) {
      size_t workers = 0;
      {
        std::lock_guard lock(write_mutex_);
        workers = epochs_.size();
      }
      // Each entry is two keys (entry + by-worker), each worker one more (its epoch).
      out.entries = keys > workers ? static_cast<int64_t>((keys - workers) / 2) : 0;
    }
    uint64_t sst_bytes = 0;
    if (db_->GetIntProperty("rocksdb.live-sst-files-size", &sst_bytes))
      out.sst_file_bytes = static_cast<int64_t>(sst_bytes);
    out.batches_written = batches_written_.load();
    out.write_errors = write_errors_.load();
    out.last_write_micros = last_write_micros_.load();
    out.total_write_micros = total_write_micros_.load();
    return out;
  }

 private:
  static rocksdb::ReadOptions total_order_read() {
    rocksdb::ReadOptions read;
    read.total_order_seek = true;  // by-worker and epoch keys are not "b" ‖ hash prefixes
    return read;
  }

  Status rocks_status(const std::string& what, const rocksdb::Status& s) const {
    if (s.ok()) return Status::ok();
    const StatusCode code = s.IsCorruption() ? StatusCode::kDataLoss : StatusCode::kIoError;
    return Status(code, "prefix index " + directory_.string() + ": " + what + ": " + s.ToString());
  }

  Status corrupt(std::string_view key, const Status& why) const {
    return data_loss("prefix index " + directory_.string() + ": key " + codec::describe_key(key) + ": " +
                     why.message());
  }

  // Adds deletes of every entry of `worker` (both keys) to `batch`; returns how many entries.
  Result<int64_t> drop_worker_entries(std::string_view worker, rocksdb::WriteBatch& batch,
                                      std::unordered_map<std::string, std::optional<std::string>>* pending) {
    const std::string prefix = codec::worker_prefix(worker);
    const std::string end = codec::prefix_successor(prefix);
    const rocksdb::Slice upper(end);
    rocksdb::ReadOptions read = total_order_read();
    read.iterate_upper_bound = &upper;
    std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(read));
    int64_t count = 0;
    for (it->Seek(prefix); it->Valid(); it->Next()) {
      const std::string_view key = view(it->key());
      auto decoded = codec::decode_worker_key(key);
      if (!decoded.is_ok()) return corrupt(key, decoded.status());
      std::string entry = codec::entry_key(decoded->hash, worker);
      batch.Delete(entry);
      batch.Delete(it->key());
      if (pending) (*pending)[std::move(entry)] = std::nullopt;
      ++count;
    }
    if (!it->status().ok()) return rocks_status("scan worker " + std::string(worker), it->status());
    return count;
  }

  Status write(rocksdb::WriteBatch& batch, const std::string& what, std::chrono::steady_clock::time_point start) {
    const rocksdb::Status s = db_->Write(write_options_, &batch);
    const auto micros =
        std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - start).count();
    if (!s.ok()) {
      write_errors_.fetch_add(1);
      return rocks_status(what, s);
    }
    batches_written_.fetch_add(1);
    last_write_micros_.store(micros);
    total_write_micros_.fetch_add(micros);
    return Status::ok();
  }

  const std::filesystem::path directory_;
  rocksdb::DB* const db_;
  rocksdb::WriteOptions write_options_;
  mutable std::mutex write_mutex_;                       // serializes writers; guards epochs_
  std::map<std::string, uint64_t, std::less<>> epochs_;  // worker → current epoch (mirrors the "e" keys)
  std::atomic<int64_t> batches_written_{0};
  std::atomic<int64_t> write_errors_{0};
  std::atomic<int64_t> last_write_micros_{0};
  std::atomic<int64_t> total_write_micros_{0};
};

}  // namespace

Result<std::unique_ptr<PrefixIndex>> PrefixIndex::open(const std::filesystem::path& directory,
                                                       const PrefixIndexOptions& options) {
  rocksdb::Options db_options;
  db_options.create_if_missing = true;
  db_options.prefix_extractor.reset(rocksdb::NewCappedPrefixTransform(index_format::kEntryPrefixBytes));
  db_options.memtable_prefix_bloom_size_ratio = 0.1;
  db_options.max_open_files = 256;
  rocksdb::BlockBasedTableOptions table;
  table.filter_policy.reset(rocksdb::NewBloomFilterPolicy(10));
  table.block_cache = rocksdb::NewLRUCache(static_cast<size_t>(std::max<int64_t>(options.block_cache_bytes, 1 << 20)));
  db_options.table_factory.reset(rocksdb::NewBlockBasedTableFactory(table));

  std::error_code ec;
  std::filesystem::create_directories(directory, ec);
  if (ec) return io_error("prefix index " + directory.string() + ": create directory: " + ec.message());

  rocksdb::DB* db = nullptr;
  const rocksdb::Status s = rocksdb::DB::Open(db_options, directory.string(), &db);
  if (!s.ok()) {
    const StatusCode code = s.IsCorruption() ? StatusCode::kDataLoss : StatusCode::kIoError;
    return Status(code, "prefix index " + directory.string() + ": open: " + s.ToString());
  }
  auto index = std::make_unique<RocksPrefixIndex>(directory, options, db);
  DS_RETURN_IF_ERROR(index->load_epochs());
  return std::unique_ptr<PrefixIndex>(std::move(index));
}

}  // namespace deltaserve::kvstore
