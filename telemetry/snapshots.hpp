// Plain structs that the parts of a process fill and hand to telemetry::Metrics. No Prometheus types:
// actors/, kvstore/ and cli/ can build them without including prometheus-cpp.
//
// Units are in the field names (bytes, seconds); counts are plain numbers. Every std::optional left
// empty means "this process does not know": the matching series is neither created nor changed.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace deltaserve::telemetry {

// What one process's workers hold now (a prefill or decode process, or every worker of `serve`).
// Gauges are set to these values; the *_total fields are cumulative since the worker started and
// become counter increments (Metrics keeps the last value seen; a value that goes down is taken as a
// restart and counted from zero).
struct WorkerGaugeSnapshot {
  std::optional<int64_t> requests_active;    // decode: requests in the batch; prefill: prompts being prefilled
  std::optional<int64_t> requests_queued;    // waiting inside the worker (handoffs without a slot, queued prompts)
  std::optional<int64_t> state_slots_total;  // KDA state slots (decode)
  std::optional<int64_t> state_slots_free;
  std::optional<int64_t> pages_total;  // MLA page groups in the pool
  std::optional<int64_t> pages_free;
  std::optional<int64_t> checkpoints_stored;       // KDA checkpoints held by the checkpoint store
  std::optional<int64_t> checkpoint_bytes;         // bytes they take
  std::optional<int64_t> checkpoint_budget_bytes;  // the store's byte budget
  // Cumulative:
  std::optional<int64_t> steps_total;                 // decode steps / prefill chunks run
  std::optional<int64_t> checkpoint_evictions_total;  // checkpoints evicted by the store's LRU
  std::optional<int64_t> handoffs_total;              // prefill: states sent; decode: states accepted
  std::optional<int64_t> handoff_bytes_total;         // bytes sent in handoffs
  std::optional<double> handoff_seconds_total;        // time spent encoding + sending them
  std::optional<int64_t> handoffs_failed_total;       // handoffs rejected or failed
};

// The prefix index (RocksDB) as one process sees it.
struct IndexStats {
  int64_t entries = 0;        // block-hash keys in the index
  int64_t bytes_on_disk = 0;  // SST + WAL bytes (RocksDB "rocksdb.total-sst-files-size" + live WAL)
};

// One worker as the router sees it from its load reports (the router's routing input).
struct RouterWorkerView {
  std::string name;  // registry name, e.g. "decode@host:pid"; bounded by the cluster size
  std::string role;  // "prefill" | "decode"
  int64_t load = 0;  // requests active + queued on it
  int64_t free_slots = 0;
  bool live = true;  // heartbeats arriving
};

}  // namespace deltaserve::telemetry
