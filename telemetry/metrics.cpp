#include "telemetry/metrics.hpp"

#include <algorithm>
#include <map>
#include <mutex>
#include <sstream>
#include <unordered_set>

#include <prometheus/collectable.h>
#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include "telemetry/build_info.hpp"

namespace deltaserve::telemetry {
namespace {

using prometheus::Counter;
using prometheus::Family;
using prometheus::Gauge;
using prometheus::Histogram;

// Bucket upper bounds, seconds or tokens. Latencies start well below a millisecond: the CPU tiny
// model decodes a token in about a millisecond, a GPU in tens of them.
const Histogram::BucketBoundaries kTtftBuckets = {0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1,  0.25,
                                                  0.5,   0.75,   1.0,   2.5,  5.0,  7.5,  10.0, 20.0, 40.0, 80.0};
const Histogram::BucketBoundaries kTokenLatencyBuckets = {
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0};
const Histogram::BucketBoundaries kRequestBuckets = {0.005, 0.01, 0.025, 0.05, 0.1,  0.25, 0.5,  1.0,   2.5,
                                                     5.0,   10.0, 20.0,  40.0, 60.0, 120., 300., 600.0, 1800.0};
const Histogram::BucketBoundaries kTokenCountBuckets = {
    1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000, 200000, 500000, 1e6};
const Histogram::BucketBoundaries kTransferBuckets = {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                                                      0.05,   0.1,     0.25,   0.5,   1.0,    2.5,   5.0,  10.0};
const Histogram::BucketBoundaries kIndexWriteBuckets = {0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005,
                                                        0.01,    0.025,  0.05,    0.1,    0.25,  0.5,    1.0};

constexpr std::string_view kOther = "other";

// A counter fed from a cumulative total read elsewhere: adds the growth since the last value seen.
class CumulativeCounter {
 public:
  explicit CumulativeCounter(Counter& counter) : counter_(counter) {}
  void update(double total) {
    if (total <= last_) return;  // same-process sources never go down: a lower value is a failed read
    counter_.Increment(total - last_);
    last_ = total;
  }

 private:
  Counter& counter_;
  double last_ = 0;
};

}  // namespace

struct Metrics::State : prometheus::Collectable {
  explicit State(MetricsOptions o)
      : options(std::move(o)),
        registry(std::make_shared<prometheus::Registry>()),
        model({{"model_name", options.model_name}}),
        // ---- vLLM-compatible families ----
        running(prometheus::BuildGauge()
                    .Name("vllm:num_requests_running")
                    .Help("Requests admitted and not finished (router view).")
                    .Register(*registry)),
        waiting(prometheus::BuildGauge()
                    .Name("vllm:num_requests_waiting")
                    .Help("Requests waiting before prefill (router queue).")
                    .Register(*registry)),
        kv_cache_usage(prometheus::BuildGauge()
                           .Name("vllm:kv_cache_usage_perc")
                           .Help("Fraction of MLA page groups in use, 0 to 1.")
                           .Register(*registry)),
        ttft(prometheus::BuildHistogram()
                 .Name("vllm:time_to_first_token_seconds")
                 .Help("Time from request arrival to the first generated token, per choice.")
                 .Register(*registry)),
        inter_token(prometheus::BuildHistogram()
                        .Name("vllm:inter_token_latency_seconds")
                        .Help("Time between consecutive generated tokens, one observation per token.")
                        .Register(*registry)),
        time_per_output_token(prometheus::BuildHistogram()
                                  .Name("vllm:request_time_per_output_token_seconds")
                                  .Help("Per choice: (e2e - ttft) / (generated tokens - 1).")
                                  .Register(*registry)),
        e2e(prometheus::BuildHistogram()
                .Name("vllm:e2e_request_latency_seconds")
                .Help("Time from request arrival to the final chunk, per choice.")
                .Register(*registry)),
        queue_time(prometheus::BuildHistogram()
                       .Name("vllm:request_queue_time_seconds")
                       .Help("Time a request waited before its prefill started.")
                       .Register(*registry)),
        prompt_tokens_hist(prometheus::BuildHistogram()
                               .Name("vllm:request_prompt_tokens")
                               .Help("Prompt tokens per choice.")
                               .Register(*registry)),
        generation_tokens_hist(prometheus::BuildHistogram()
                                   .Name("vllm:request_generation_tokens")
                                   .Help("Generated tokens per choice.")
                                   .Register(*registry)),
        prompt_tokens(prometheus::BuildCounter()
                          .Name("vllm:prompt_tokens_total")
                          .Help("Prompt tokens of finished choices.")
                          .Register(*registry)),
        generation_tokens(prometheus::BuildCounter()
                              .Name("vllm:generation_tokens_total")
                              .Help("Generated tokens delivered to clients.")
                              .Register(*registry)),
        success(prometheus::BuildCounter()
                    .Name("vllm:request_success_total")
                    .Help("Finished choices by finish reason (stop, length, abort).")
                    .Register(*registry)),
        prefix_queries(prometheus::BuildCounter()
                           .Name("vllm:prefix_cache_queries_total")
                           .Help("Prefix cache queries, in prompt tokens looked up.")
                           .Register(*registry)),
        prefix_hits(prometheus::BuildCounter()
                        .Name("vllm:prefix_cache_hits_total")
                        .Help("Prefix cache hits, in prompt tokens served from the cache.")
                        .Register(*registry)),
        // ---- ours ----
        build_info(prometheus::BuildGauge()
                       .Name("deltaserve_build_info")
                       .Help("Always 1; the labels name the build and the process role.")
                       .Register(*registry)),
        http_requests(prometheus::BuildCounter()
                          .Name("deltaserve_http_requests_total")
                          .Help("HTTP responses by route and status code (499: the client left first).")
                          .Register(*registry)),
        http_duration(prometheus::BuildHistogram()
                          .Name("deltaserve_http_request_duration_seconds")
                          .Help("Time from the request head to the end of the response, by route.")
                          .Register(*registry)),
        http_in_flight(prometheus::BuildGauge()
                           .Name("deltaserve_http_requests_in_flight")
                           .Help("HTTP requests read and not yet answered.")
                           .Register(*registry)
                           .Add({})),
        draining(prometheus::BuildGauge()
                     .Name("deltaserve_draining")
                     .Help("1 after SIGTERM: readiness is false and new requests get 503.")
                     .Register(*registry)
                     .Add({})),
        ready(prometheus::BuildGauge()
                  .Name("deltaserve_ready")
                  .Help("1 when the service can serve (model loaded, prefill and decode workers reachable).")
                  .Register(*registry)),
        router_decode_slots(prometheus::BuildGauge()
                                .Name("deltaserve_router_decode_slots")
                                .Help("Decode state slots over every live decode worker, as the router sees them.")
                                .Register(*registry)),
        request_errors(prometheus::BuildCounter()
                           .Name("deltaserve_request_errors_total")
                           .Help("Choices that failed in the service, by status code name.")
                           .Register(*registry)),
        namespace_queries(prometheus::BuildCounter()
                              .Name("deltaserve_prefix_cache_query_tokens_total")
                              .Help("Prompt tokens of finished choices, by tenant cache namespace.")
                              .Register(*registry)),
        namespace_hits(prometheus::BuildCounter()
                           .Name("deltaserve_prefix_cache_hit_tokens_total")
                           .Help("Prompt tokens served from the prefix cache, by tenant cache namespace.")
                           .Register(*registry)),
        lookup_tokens(prometheus::BuildCounter()
                          .Name("deltaserve_prefix_index_lookup_tokens_total")
                          .Help("Router prefix-index lookups in tokens: result=query (looked up) or hit (usable).")
                          .Register(*registry)),
        worker_requests(prometheus::BuildGauge()
                            .Name("deltaserve_worker_requests")
                            .Help("Requests held by this process's workers: state=active or queued.")
                            .Register(*registry)),
        state_slots(prometheus::BuildGauge()
                        .Name("deltaserve_kda_state_slots")
                        .Help("Request state slots of this process's workers by role (decode: KDA batch slots; "
                              "prefill: the fixed pool): state=used or free.")
                        .Register(*registry)),
        pages(prometheus::BuildGauge()
                  .Name("deltaserve_mla_pages")
                  .Help("MLA page groups of this process's prefix-cache pools: state=used or free.")
                  .Register(*registry)),
        ucx_transfers(prometheus::BuildGauge()
                          .Name("deltaserve_ucx_transfers")
                          .Help("This process's UCX transfer engine: what=pending (transfers not yet decided, "
                                "reservations included), requests_in_flight (UCX requests not completed) or "
                                "region_uses (transfers' uses of registered memory). Each is 0 when idle.")
                          .Register(*registry)),
        cache_entries(prometheus::BuildGauge()
                          .Name("deltaserve_prefix_cache_entries")
                          .Help("Block boundaries whose MLA pages this process's prefix caches hold.")
                          .Register(*registry)),
        checkpoints(prometheus::BuildGauge()
                        .Name("deltaserve_kda_checkpoints")
                        .Help("KDA checkpoints held by the checkpoint store.")
                        .Register(*registry)),
        checkpoint_bytes(prometheus::BuildGauge()
                             .Name("deltaserve_kda_checkpoint_bytes")
                             .Help("Bytes of KDA checkpoints held.")
                             .Register(*registry)),
        checkpoint_budget_bytes(prometheus::BuildGauge()
                                    .Name("deltaserve_kda_checkpoint_budget_bytes")
                                    .Help("The checkpoint store's byte budget.")
                                    .Register(*registry)),
        cache_evictions(prometheus::BuildCounter()
                            .Name("deltaserve_prefix_cache_evictions_total")
                            .Help("Prefix-cache entries and KDA checkpoints evicted by the LRU.")
                            .Register(*registry)),
        worker_steps(prometheus::BuildCounter()
                         .Name("deltaserve_worker_steps_total")
                         .Help("Decode steps and prefill chunks run by this process's workers.")
                         .Register(*registry)),
        handoffs(prometheus::BuildCounter()
                     .Name("deltaserve_handoffs_total")
                     .Help("Prefill-to-decode handoffs (MLA pages + KDA states) by transport and result.")
                     .Register(*registry)),
        handoff_bytes(prometheus::BuildCounter()
                          .Name("deltaserve_handoff_bytes_total")
                          .Help("Bytes moved in handoffs, by transport.")
                          .Register(*registry)),
        handoff_seconds_total(prometheus::BuildCounter()
                                  .Name("deltaserve_handoff_seconds_total")
                                  .Help("Seconds spent encoding and sending handoffs, by transport.")
                                  .Register(*registry)),
        handoff_duration(prometheus::BuildHistogram()
                             .Name("deltaserve_handoff_duration_seconds")
                             .Help("Duration of one handoff, by transport.")
                             .Register(*registry)),
        index_entries(prometheus::BuildGauge()
                          .Name("deltaserve_prefix_index_entries")
                          .Help("Block-hash keys in the RocksDB prefix index.")
                          .Register(*registry)),
        index_bytes(prometheus::BuildGauge()
                        .Name("deltaserve_prefix_index_bytes")
                        .Help("Bytes of the RocksDB prefix index on disk.")
                        .Register(*registry)),
        index_write_duration(prometheus::BuildHistogram()
                                 .Name("deltaserve_prefix_index_write_duration_seconds")
                                 .Help("Duration of one synced prefix-index write batch.")
                                 .Register(*registry)),
        index_errors(prometheus::BuildCounter()
                         .Name("deltaserve_prefix_index_errors_total")
                         .Help("Prefix-index lookups, writes and reconciles that failed.")
                         .Register(*registry)),
        index_events(prometheus::BuildCounter()
                         .Name("deltaserve_prefix_index_events_total")
                         .Help("Cache events (blocks stored or evicted on a worker) applied to the prefix index.")
                         .Register(*registry)),
        router_admitted(prometheus::BuildCounter()
                            .Name("deltaserve_router_admitted_total")
                            .Help("Requests admitted into the router queue.")
                            .Register(*registry)),
        router_routed_to_cache(prometheus::BuildCounter()
                                   .Name("deltaserve_router_routed_to_cache_total")
                                   .Help("Choices placed on a prefill worker that holds a cached prefix of them.")
                                   .Register(*registry)),
        router_expected_cached_tokens(prometheus::BuildCounter()
                                          .Name("deltaserve_router_expected_cached_tokens_total")
                                          .Help("Prompt tokens those placements expected to find cached.")
                                          .Register(*registry)),
        router_worker_load(prometheus::BuildGauge()
                               .Name("deltaserve_router_worker_load")
                               .Help("Requests active + queued on each worker, from its latest load report.")
                               .Register(*registry)),
        router_worker_free_slots(prometheus::BuildGauge()
                                     .Name("deltaserve_router_worker_free_slots")
                                     .Help("Free state slots of each worker, from its latest load report.")
                                     .Register(*registry)),
        router_workers(prometheus::BuildGauge()
                           .Name("deltaserve_router_workers")
                           .Help("Workers in the router's registry with live heartbeats, by role.")
                           .Register(*registry)) {
    build_info
        .Add({{"version", kVersion},
              {"revision", kRevision},
              {"role", options.role},
              {"model_name", options.model_name}})
        .Set(1);
    // A process with an HTTP front exports its request families from the start (at 0, as vLLM does);
    // workers see no requests and do not export them at all.
    if (options.role == "serve" || options.role == "router") {
      of(running);
      of(waiting);
      of(ttft, kTtftBuckets);
      of(inter_token, kTokenLatencyBuckets);
      of(time_per_output_token, kTokenLatencyBuckets);
      of(e2e, kRequestBuckets);
      of(prompt_tokens_hist, kTokenCountBuckets);
      of(generation_tokens_hist, kTokenCountBuckets);
      of(prompt_tokens);
      of(generation_tokens);
      of(prefix_queries);
      of(prefix_hits);
    }
  }

  // The model_name series of a vLLM-compatible family (created on first use).
  Gauge& of(Family<Gauge>& family) { return family.Add(model); }
  Counter& of(Family<Counter>& family) { return family.Add(model); }
  Histogram& of(Family<Histogram>& family, const Histogram::BucketBoundaries& buckets) {
    return family.Add(model, buckets);
  }

  std::vector<prometheus::MetricFamily> Collect() const override {
    {
      std::lock_guard lock(hooks_mutex);
      for (const auto& [id, hook] : hooks) hook();
    }
    return registry->Collect();
  }

  // The label value for a cache namespace: itself while fewer than max_namespaces are admitted.
  std::string namespace_label(std::string_view name) {
    std::string key(name.empty() ? "default" : name);
    std::lock_guard lock(namespaces_mutex);
    if (admitted_namespaces.count(key) != 0) return key;
    if (key != kOther && admitted_namespaces.size() < options.max_namespaces) {
      admitted_namespaces.insert(key);
      return key;
    }
    return std::string(kOther);
  }

  const MetricsOptions options;
  const std::shared_ptr<prometheus::Registry> registry;
  const prometheus::Labels model;

  Family<Gauge>& running;
  Family<Gauge>& waiting;
  Family<Gauge>& kv_cache_usage;
  Family<Histogram>& ttft;
  Family<Histogram>& inter_token;
  Family<Histogram>& time_per_output_token;
  Family<Histogram>& e2e;
  Family<Histogram>& queue_time;
  Family<Histogram>& prompt_tokens_hist;
  Family<Histogram>& generation_tokens_hist;
  Family<Counter>& prompt_tokens;
  Family<Counter>& generation_tokens;
  Family<Counter>& success;
  Family<Counter>& prefix_queries;
  Family<Counter>& prefix_hits;

  Family<Gauge>& build_info;
  Family<Counter>& http_requests;
  Family<Histogram>& http_duration;
  Gauge& http_in_flight;
  Gauge& draining;
  Family<Gauge>& ready;
  Family<Gauge>& router_decode_slots;
  Family<Counter>& request_errors;
  Family<Counter>& namespace_queries;
  Family<Counter>& namespace_hits;
  Family<Counter>& lookup_tokens;
  Family<Gauge>& worker_requests;
  Family<Gauge>& state_slots;
  Family<Gauge>& pages;
  Family<Gauge>& ucx_transfers;
  Family<Gauge>& cache_entries;
  Family<Gauge>& checkpoints;
  Family<Gauge>& checkpoint_bytes;
  Family<Gauge>& checkpoint_budget_bytes;
  Family<Counter>& cache_evictions;
  Family<Counter>& worker_steps;
  Family<Counter>& handoffs;
  Family<Counter>& handoff_bytes;
  Family<Counter>& handoff_seconds_total;
  Family<Histogram>& handoff_duration;
  Family<Gauge>& index_entries;
  Family<Gauge>& index_bytes;
  Family<Histogram>& index_write_duration;
  Family<Counter>& index_errors;
  Family<Counter>& index_events;
  Family<Counter>& router_admitted;
  Family<Counter>& router_routed_to_cache;
  Family<Counter>& router_expected_cached_tokens;
  Family<Gauge>& router_worker_load;
  Family<Gauge>& router_worker_free_slots;
  Family<Gauge>& router_workers;

  mutable std::mutex hooks_mutex;
  std::map<HookId, std::function<void()>> hooks;
  HookId next_hook = 1;

  std::mutex namespaces_mutex;
  std::unordered_set<std::string> admitted_namespaces;

  // Cumulative worker totals (set_worker_gauges); created on first use.
  std::mutex cumulative_mutex;
  std::map<std::string, CumulativeCounter> cumulative;
  CumulativeCounter& cumulative_counter(const std::string& key, Counter& counter) {
    return cumulative.try_emplace(key, counter).first->second;
  }

  std::mutex router_workers_mutex;
  std::vector<prometheus::Labels> router_worker_labels;  // series set by the last set_router_workers
};

Metrics::Metrics(MetricsOptions options) : state_(std::make_shared<State>(std::move(options))) {}
Metrics::~Metrics() = default;

const MetricsOptions& Metrics::options() const {
  return state_->options;
}

void Metrics::observe_http_response(std::string_view endpoint, int status, double seconds) {
  const std::string route(endpoint.empty() ? kOther : endpoint);
  state_->http_requests.Add({{"endpoint", route}, {"code", std::to_string(status)}}).Increment();
  state_->http_duration.Add({{"endpoint", route}}, kRequestBuckets).Observe(std::max(0.0, seconds));
}

void Metrics::set_http_in_flight(int64_t requests) {
  state_->http_in_flight.Set(static_cast<double>(requests));
}

void Metrics::set_draining(bool draining) {
  state_->draining.Set(draining ? 1 : 0);
}

void Metrics::set_service_status(bool ready, int64_t running, int64_t waiting, int64_t decode_slots_total,
                                 int64_t decode_slots_free) {
  State& s = *state_;
  s.ready.Add({}).Set(ready ? 1 : 0);
  s.of(s.running).Set(static_cast<double>(running));
  s.of(s.waiting).Set(static_cast<double>(waiting));
  s.router_decode_slots.Add({{"state", "free"}}).Set(static_cast<double>(decode_slots_free));
  s.router_decode_slots.Add({{"state", "used"}})
      .Set(static_cast<double>(std::max<int64_t>(0, decode_slots_total - decode_slots_free)));
}

void Metrics::observe_time_to_first_token(double seconds) {
  state_->of(state_->ttft, kTtftBuckets).Observe(std::max(0.0, seconds));
}

void Metrics::observe_inter_token(double seconds, int64_t tokens) {
  if (tokens <= 0) return;
  const double each = std::max(0.0, seconds) / static_cast<double>(tokens);
  Histogram& histogram = state_->of(state_->inter_token, kTokenLatencyBuckets);
  for (int64_t i = 0; i < tokens; ++i) histogram.Observe(each);
}

void Metrics::observe_finished(const FinishedRequest& r) {
  State& s = *state_;
  const int64_t prompt = std::max<int64_t>(0, r.prompt_tokens);
  const int64_t generated = std::max<int64_t>(0, r.generation_tokens);
  const int64_t cached = std::clamp<int64_t>(r.cached_tokens, 0, prompt);
  if (r.finished_reason == "error") {
    s.request_errors.Add({{"code", std::string(r.error_code.empty() ? "unknown" : r.error_code)}}).Increment();
  } else {
    prometheus::Labels labels = s.model;
    labels.emplace("finished_reason", std::string(r.finished_reason));
    s.success.Add(labels).Increment();
  }
  s.of(s.prompt_tokens).Increment(static_cast<double>(prompt));
  s.of(s.generation_tokens).Increment(static_cast<double>(generated));
  s.of(s.prompt_tokens_hist, kTokenCountBuckets).Observe(static_cast<double>(prompt));
  s.of(s.generation_tokens_hist, kTokenCountBuckets).Observe(static_cast<double>(generated));
  s.of(s.e2e, kRequestBuckets).Observe(std::max(0.0, r.e2e_seconds));
  if (r.ttft_seconds >= 0 && generated > 1) {
    s.of(s.time_per_output_token, kTokenLatencyBuckets)
        .Observe(std::max(0.0, r.e2e_seconds - r.ttft_seconds) / static_cast<double>(generated - 1));
  }
  s.of(s.prefix_queries).Increment(static_cast<double>(prompt));
  s.of(s.prefix_hits).Increment(static_cast<double>(cached));
  const std::string space = s.namespace_label(r.cache_namespace);
  s.namespace_queries.Add({{"namespace", space}}).Increment(static_cast<double>(prompt));
  s.namespace_hits.Add({{"namespace", space}}).Increment(static_cast<double>(cached));
}

void Metrics::observe_queue_time(double seconds) {
  state_->of(state_->queue_time, kRequestBuckets).Observe(std::max(0.0, seconds));
}

void Metrics::set_worker_gauges(const WorkerGaugeSnapshot& w) {
  State& s = *state_;
  auto set = [](Family<Gauge>& family, const prometheus::Labels& labels, const std::optional<int64_t>& value) {
    if (value) family.Add(labels).Set(static_cast<double>(*value));
  };
  set(s.worker_requests, {{"state", "active"}}, w.requests_active);
  set(s.worker_requests, {{"state", "queued"}}, w.requests_queued);
  auto set_slots = [&](const char* role, const std::optional<int64_t>& total, const std::optional<int64_t>& free) {
    if (!total || !free) return;
    s.state_slots.Add({{"role", role}, {"state", "free"}}).Set(static_cast<double>(*free));
    s.state_slots.Add({{"role", role}, {"state", "used"}})
        .Set(static_cast<double>(std::max<int64_t>(0, *total - *free)));
  };
  set_slots("decode", w.state_slots_total, w.state_slots_free);
  set_slots("prefill", w.prefill_slots_total, w.prefill_slots_free);
  if (w.pages_total && w.pages_free) {
    const int64_t used = std::max<int64_t>(0, *w.pages_total - *w.pages_free);
    s.pages.Add({{"state", "free"}}).Set(static_cast<double>(*w.pages_free));
    s.pages.Add({{"state", "used"}}).Set(static_cast<double>(used));
    s.kv_cache_usage.Add(s.model).Set(*w.pages_total > 0 ? static_cast<double>(used) / *w.pages_total : 0.0);
  }
  set(s.cache_entries, {}, w.cache_entries);
  set(s.ucx_transfers, {{"what", "pending"}}, w.transfers_pending);
  set(s.ucx_transfers, {{"what", "requests_in_flight"}}, w.transfer_requests_in_flight);
  set(s.ucx_transfers, {{"what", "region_uses"}}, w.transfer_region_uses);
  set(s.checkpoints, {}, w.checkpoints_stored);
  set(s.checkpoint_bytes, {}, w.checkpoint_bytes);
  set(s.checkpoint_budget_bytes, {}, w.checkpoint_budget_bytes);

  std::lock_guard lock(s.cumulative_mutex);
  auto update = [&](const char* key, Family<Counter>& family, const prometheus::Labels& labels, auto value) {
    if (value) s.cumulative_counter(key, family.Add(labels)).update(static_cast<double>(*value));
  };
  update("steps", s.worker_steps, {}, w.steps_total);
  update("evictions", s.cache_evictions, {}, w.cache_evictions_total);
  update("handoffs_ok", s.handoffs, {{"transport", "caf"}, {"result", "ok"}}, w.handoffs_total);
  update("handoffs_failed", s.handoffs, {{"transport", "caf"}, {"result", "failed"}}, w.handoffs_failed_total);
  update("handoff_bytes", s.handoff_bytes, {{"transport", "caf"}}, w.handoff_bytes_total);
  update("handoff_seconds", s.handoff_seconds_total, {{"transport", "caf"}}, w.handoff_seconds_total);
}

void Metrics::observe_handoff(std::string_view transport, int64_t bytes, double seconds, bool ok) {
  State& s = *state_;
  const std::string t(transport);
  s.handoffs.Add({{"transport", t}, {"result", ok ? "ok" : "failed"}}).Increment();
  if (!ok) return;
  s.handoff_bytes.Add({{"transport", t}}).Increment(static_cast<double>(std::max<int64_t>(0, bytes)));
  s.handoff_seconds_total.Add({{"transport", t}}).Increment(std::max(0.0, seconds));
  s.handoff_duration.Add({{"transport", t}}, kTransferBuckets).Observe(std::max(0.0, seconds));
}

void Metrics::observe_prefix_lookup(std::string_view cache_namespace, int64_t query_tokens, int64_t hit_tokens) {
  State& s = *state_;
  const std::string space = s.namespace_label(cache_namespace);
  const int64_t query = std::max<int64_t>(0, query_tokens);
  s.lookup_tokens.Add({{"namespace", space}, {"result", "query"}}).Increment(static_cast<double>(query));
  s.lookup_tokens.Add({{"namespace", space}, {"result", "hit"}})
      .Increment(static_cast<double>(std::clamp<int64_t>(hit_tokens, 0, query)));
}

void Metrics::set_index_stats(const IndexStats& stats) {
  state_->index_entries.Add({}).Set(static_cast<double>(stats.entries));
  state_->index_bytes.Add({}).Set(static_cast<double>(stats.bytes_on_disk));
}

void Metrics::observe_index_write(double seconds) {
  state_->index_write_duration.Add({}, kIndexWriteBuckets).Observe(std::max(0.0, seconds));
}

void Metrics::set_router_totals(const RouterTotals& t) {
  State& s = *state_;
  std::lock_guard lock(s.cumulative_mutex);
  s.cumulative_counter("router_admitted", s.router_admitted.Add({})).update(static_cast<double>(t.admitted_total));
  s.cumulative_counter("router_routed_to_cache", s.router_routed_to_cache.Add({}))
      .update(static_cast<double>(t.routed_to_cache_total));
  s.cumulative_counter("router_expected_cached_tokens", s.router_expected_cached_tokens.Add({}))
      .update(static_cast<double>(t.expected_cached_tokens_total));
  s.cumulative_counter("index_events", s.index_events.Add({})).update(static_cast<double>(t.index_events_total));
  s.cumulative_counter("index_errors", s.index_errors.Add({})).update(static_cast<double>(t.index_errors_total));
}

void Metrics::set_router_workers(const std::vector<RouterWorkerView>& workers) {
  State& s = *state_;
  std::lock_guard lock(s.router_workers_mutex);
  std::vector<prometheus::Labels> now;
  std::map<std::string, int64_t> live_by_role = {{"prefill", 0}, {"decode", 0}};
  for (const RouterWorkerView& w : workers) {
    prometheus::Labels labels = {{"worker", w.name}, {"role", w.role}};
    s.router_worker_load.Add(labels).Set(static_cast<double>(w.load));
    s.router_worker_free_slots.Add(labels).Set(static_cast<double>(w.free_slots));
    if (w.live) ++live_by_role[w.role];
    now.push_back(std::move(labels));
  }
  for (const prometheus::Labels& old : s.router_worker_labels) {
    if (std::find(now.begin(), now.end(), old) != now.end()) continue;
    s.router_worker_load.Remove(&s.router_worker_load.Add(old));
    s.router_worker_free_slots.Remove(&s.router_worker_free_slots.Add(old));
  }
  s.router_worker_labels = std::move(now);
  for (const auto& [role, count] : live_by_role) s.router_workers.Add({{"role", role}}).Set(static_cast<double>(count));
}

Metrics::HookId Metrics::add_collect_hook(std::function<void()> hook) {
  std::lock_guard lock(state_->hooks_mutex);
  const HookId id = state_->next_hook++;
  state_->hooks.emplace(id, std::move(hook));
  return id;
}

void Metrics::remove_collect_hook(HookId id) {
  std::lock_guard lock(state_->hooks_mutex);
  state_->hooks.erase(id);
}

std::string Metrics::serialize() const {
  std::ostringstream out;
  prometheus::TextSerializer().Serialize(out, state_->Collect());
  return out.str();
}

std::shared_ptr<prometheus::Collectable> Metrics::collectable() const {
  return state_;
}

std::shared_ptr<prometheus::Registry> Metrics::registry() const {
  return state_->registry;
}

}  // namespace deltaserve::telemetry
