// One process's Prometheus metrics: a prometheus::Registry and a typed handle for every family.
//
// Names: where vLLM exports the same meaning, the exact vLLM name and its `model_name` label
// (`vllm:time_to_first_token_seconds`, ...), so dashboards and autoscalers written for vLLM work
// unchanged; everything that is ours is `deltaserve_*`. README "Operations" lists every family.
//
// Cardinality is bounded by construction: endpoints are the five routes + "other"; status codes are
// what the server sends; tenant cache namespaces get their own series for the first
// MetricsOptions::max_namespaces seen and are summed under namespace="other" after that (a counter
// series is never reassigned, so it stays monotonic); worker names are bounded by the cluster size.
//
// Thread safety: every method may be called from any thread at any time. Counter and gauge updates
// are lock-free (prometheus-cpp atomics); creating a labelled series takes the family's mutex.
// Collect hooks run one scrape at a time.
//
// Lifetime: the collectable() and registry() pointers keep the Metrics' state alive; hooks must be
// removed (remove_collect_hook) before whatever they capture dies.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "telemetry/snapshots.hpp"

namespace prometheus {
class Collectable;
class Registry;
}  // namespace prometheus

namespace deltaserve::telemetry {

struct MetricsOptions {
  std::string model_name = "unknown";  // the served model id: label model_name on vllm:* families
  std::string role = "serve";          // serve | router | prefill | decode (deltaserve_build_info)
  size_t max_namespaces = 16;          // namespaces with their own series; later ones count as "other"
};

// One choice of a generation request, at its end, as the HTTP layer saw it.
struct FinishedRequest {
  std::string_view finished_reason;  // "stop" | "length" | "abort" (client went away) | "error"
  std::string_view error_code;       // when finished_reason == "error": the Status code name
  std::string_view cache_namespace;  // the tenant's cache namespace (never from the request body)
  int64_t prompt_tokens = 0;
  int64_t generation_tokens = 0;  // tokens delivered to the client
  int64_t cached_tokens = 0;      // prompt tokens served from the prefix cache (<= prompt_tokens)
  double e2e_seconds = 0;         // arrival to the final chunk
  double ttft_seconds = -1;       // arrival to the first chunk with tokens; < 0: no token was produced
};

class Metrics {
 public:
  explicit Metrics(MetricsOptions options);
  ~Metrics();
  Metrics(const Metrics&) = delete;
  Metrics& operator=(const Metrics&) = delete;

  const MetricsOptions& options() const;

  // ---- HTTP layer ----------------------------------------------------------------------------
  // One HTTP response (or a request the client abandoned: status 499). `endpoint` is the route path
  // ("/v1/completions", ...) or "other".
  void observe_http_response(std::string_view endpoint, int status, double seconds);
  void set_http_in_flight(int64_t requests);
  void set_draining(bool draining);
  // From InferenceService::status(), typically in a collect hook.
  void set_service_status(bool ready, int64_t running, int64_t waiting, int64_t decode_slots_total,
                          int64_t decode_slots_free);
  // Time to first token of one choice.
  void observe_time_to_first_token(double seconds);
  // `tokens` tokens arrived together `seconds` after the previous ones: `tokens` observations of
  // seconds / tokens each (vLLM observes once per token too).
  void observe_inter_token(double seconds, int64_t tokens);
  // A choice ended: success counter by reason (or the error counter), token counters and histograms,
  // e2e latency, time per output token, prefix-cache queries and hits in tokens (per namespace too).
  void observe_finished(const FinishedRequest& request);

  // ---- the actors' side (plain snapshots; see snapshots.hpp) ------------------------------------
  // Fed today by cli/serve_command.cpp at each scrape: set_worker_gauges (Node::worker_stats) and
  // set_router_totals (Node::router_stats). Not called yet; where they belong (actors get the Metrics
  // through a std::shared_ptr in actors::NodeOptions):
  //   observe_queue_time     router_actor.cpp try_dispatch_one(), when a queued entry is sent to prefill:
  //                          (steady now - request.arrival_ns) / 1e9 (arrival_ns is the HTTP front's clock,
  //                          valid in the process that accepted the request)
  //   observe_prefix_lookup  router_actor.cpp pick_prefill(), after index->lookup(): usable_blocks * block
  //                          tokens looked up, the deepest usable match in tokens, namespace ns
  //   observe_index_write    router_actor.cpp cache_atom handler: the duration of index->apply(batch) when ok
  //   set_index_stats        with the router's totals (a PrefixIndex size accessor is needed)
  //   observe_handoff        router_actor.cpp prefilled_atom handler (num_bytes, micros / 1e6, ok) with
  //                          transport "caf", or kvstore/transfer per transfer with "ucx"
  //   set_router_workers     from the registry's worker list on each heartbeat / publish (name, role, load)
  // Time a request waited before its prefill started (the router/prefill queue).
  void observe_queue_time(double seconds);
  // This process's workers now. Call whenever convenient (each load report, or from a collect hook).
  void set_worker_gauges(const WorkerGaugeSnapshot& snapshot);
  // One prefill→decode handoff (pages + KDA states). `transport`: "caf" | "ucx".
  void observe_handoff(std::string_view transport, int64_t bytes, double seconds, bool ok);
  // A prefix lookup done by the router (before any request ends): prompt tokens looked up, tokens
  // the index says are usable. Counted in deltaserve_prefix_index_lookup_*; the vllm: prefix-cache
  // counters are fed by observe_finished from what the request really reused.
  void observe_prefix_lookup(std::string_view cache_namespace, int64_t query_tokens, int64_t hit_tokens);
  void set_index_stats(const IndexStats& stats);
  // One successful prefix-index write batch (failures are counted in RouterTotals::index_errors_total).
  void observe_index_write(double seconds);
  // The router's totals; call whenever convenient (cli reads Node::router_stats at each scrape).
  void set_router_totals(const RouterTotals& totals);
  // The router's current view of every worker; workers missing from `workers` lose their series.
  void set_router_workers(const std::vector<RouterWorkerView>& workers);

  // ---- scrape ---------------------------------------------------------------------------------
  // `hook` runs at the start of every scrape (serialize() or an Exposer's Collect), one scrape at a
  // time, so gauges can be refreshed from their source. It must not block for long (a scrape waits).
  using HookId = uint64_t;
  HookId add_collect_hook(std::function<void()> hook);
  // After this returns the hook is not running and will not run again.
  void remove_collect_hook(HookId id);

  // The Prometheus text exposition format 0.0.4 of every family (hooks run first).
  std::string serialize() const;
  static constexpr std::string_view kContentType = "text/plain; version=0.0.4; charset=utf-8";

  // For prometheus::Exposer::RegisterCollectable: runs the hooks, then collects the registry.
  std::shared_ptr<prometheus::Collectable> collectable() const;
  std::shared_ptr<prometheus::Registry> registry() const;

 private:
  struct State;
  std::shared_ptr<State> state_;
};

}  // namespace deltaserve::telemetry
