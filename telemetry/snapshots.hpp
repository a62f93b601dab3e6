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
// become counter increments (Metrics keeps the highest value seen and adds the growth; a lower value is
// ignored: the workers live in the same process as the Metrics, so a lower value is a failed read).
struct WorkerGaugeSnapshot {
  std::optional<int64_t> requests_active;    // decode: requests in the batch; prefill: prompts being prefilled
  std::optional<int64_t> requests_queued;    // waiting inside the worker (handoffs without a slot, queued prompts)
  std::optional<int64_t> state_slots_total;  // KDA state slots of the decode workers (one per request in the batch)
  std::optional<int64_t> state_slots_free;
  std::optional<int64_t> prefill_slots_total;  // request state slots of the prefill workers' fixed pools
  std::optional<int64_t> prefill_slots_free;
  std::optional<int64_t> pages_total;  // MLA page groups of the prefix-cache pools
  std::optional<int64_t> pages_free;
  std::optional<int64_t> cache_entries;            // block boundaries whose pages the prefix caches hold
  std::optional<int64_t> checkpoints_stored;       // KDA checkpoints held by the checkpoint stores
  std::optional<int64_t> checkpoint_bytes;         // bytes they take
  std::optional<int64_t> checkpoint_budget_bytes;  // the stores' byte budget
  // The UCX transfer engine (transport ucx); each is 0 when the process moves nothing:
  std::optional<int64_t> transfers_pending;            // transfers not yet decided (reservations included)
  std::optional<int64_t> transfer_requests_in_flight;  // UCX requests not completed
  std::optional<int64_t> transfer_region_uses;         // transfers' uses of registered memory regions
  // Cumulative:
  std::optional<int64_t> steps_total;            // decode steps / prefill chunks run
  std::optional<int64_t> cache_evictions_total;  // prefix-cache entries + KDA checkpoints evicted
  std::optional<int64_t> handoffs_total;         // prefill: states sent; decode: states accepted
  std::optional<int64_t> handoff_bytes_total;    // bytes sent in handoffs
  std::optional<double> handoff_seconds_total;   // time spent encoding + sending them
  std::optional<int64_t> handoffs_failed_total;  // handoffs rejected or failed
};

// The router's cumulative counters (same rules as the *_total fields above).
struct RouterTotals {
  int64_t admitted_total = 0;                // requests admitted into the router queue
  int64_t routed_to_cache_total = 0;         // choices placed on a prefill worker holding a cached prefix
  int64_t expected_cached_tokens_total = 0;  // prompt tokens those placements expected to find cached
  int64_t index_events_total = 0;            // cache events applied to the prefix index
  int64_t index_errors_total = 0;            // prefix-index lookups, writes and reconciles that failed
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
