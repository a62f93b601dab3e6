#include "telemetry/metrics.hpp"

#include <atomic>
#include <optional>
#include <sstream>
#include <string>

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "telemetry/metrics_listener.hpp"

namespace deltaserve::telemetry {
namespace {

// The value of the sample whose line starts with `series` (name{labels} exactly as serialized).
std::optional<double> sample(const std::string& text, const std::string& series) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(series + " ", 0) == 0) return std::stod(line.substr(series.size() + 1));
  }
  return std::nullopt;
}

MetricsOptions options(size_t max_namespaces = 16) {
  MetricsOptions o;
  o.model_name = "m";
  o.role = "serve";
  o.max_namespaces = max_namespaces;
  return o;
}

Metrics make(size_t max_namespaces = 16) {
  return Metrics(options(max_namespaces));
}

TEST(Metrics, VllmFamiliesCarryTheModelNameFromTheStart) {
  Metrics metrics = make();
  const std::string text = metrics.serialize();
  EXPECT_EQ(sample(text, R"(vllm:num_requests_running{model_name="m"})"), 0.0);
  EXPECT_EQ(sample(text, R"(vllm:generation_tokens_total{model_name="m"})"), 0.0);
  EXPECT_EQ(sample(text, R"(vllm:time_to_first_token_seconds_count{model_name="m"})"), 0.0);
  EXPECT_NE(text.find("# TYPE vllm:e2e_request_latency_seconds histogram"), std::string::npos);
  EXPECT_EQ(sample(text, "deltaserve_draining"), 0.0);
  // A labelled family has no series (and is not printed at all) until something is observed.
  EXPECT_EQ(text.find("deltaserve_http_requests_total"), std::string::npos);
  EXPECT_NE(text.find("deltaserve_build_info{"), std::string::npos);
  EXPECT_NE(text.find(R"(role="serve")"), std::string::npos);
}

TEST(Metrics, FinishedRequestsFeedTokenCountersSuccessAndCache) {
  Metrics metrics = make();
  FinishedRequest r;
  r.finished_reason = "length";
  r.cache_namespace = "acme";
  r.prompt_tokens = 10;
  r.generation_tokens = 5;
  r.cached_tokens = 4;
  r.e2e_seconds = 0.5;
  r.ttft_seconds = 0.1;
  metrics.observe_finished(r);
  r.finished_reason = "stop";
  r.cached_tokens = 99;  // clamped to the prompt
  metrics.observe_finished(r);
  r.finished_reason = "error";
  r.error_code = "UNAVAILABLE";
  r.generation_tokens = 0;
  r.cached_tokens = 0;
  metrics.observe_finished(r);
  const std::string text = metrics.serialize();
  EXPECT_EQ(sample(text, R"(vllm:prompt_tokens_total{model_name="m"})"), 30.0);
  EXPECT_EQ(sample(text, R"(vllm:generation_tokens_total{model_name="m"})"), 10.0);
  EXPECT_EQ(sample(text, R"(vllm:request_success_total{finished_reason="length",model_name="m"})"), 1.0);
  EXPECT_EQ(sample(text, R"(vllm:request_success_total{finished_reason="stop",model_name="m"})"), 1.0);
  EXPECT_EQ(sample(text, R"(deltaserve_request_errors_total{code="UNAVAILABLE"})"), 1.0);
  EXPECT_EQ(sample(text, R"(vllm:prefix_cache_queries_total{model_name="m"})"), 30.0);
  EXPECT_EQ(sample(text, R"(vllm:prefix_cache_hits_total{model_name="m"})"), 14.0);
  EXPECT_EQ(sample(text, R"(deltaserve_prefix_cache_hit_tokens_total{namespace="acme"})"), 14.0);
  EXPECT_EQ(sample(text, R"(vllm:e2e_request_latency_seconds_count{model_name="m"})"), 3.0);
  // (0.5 - 0.1) / (5 - 1) = 0.1 per output token, twice; the error choice made no token.
  EXPECT_EQ(sample(text, R"(vllm:request_time_per_output_token_seconds_count{model_name="m"})"), 2.0);
  EXPECT_NEAR(*sample(text, R"(vllm:request_time_per_output_token_seconds_sum{model_name="m"})"), 0.2, 1e-9);
}

TEST(Metrics, NamespacesBeyondTheLimitAreSummedAsOther) {
  Metrics metrics = make(2);
  for (const char* space : {"a", "b", "c", "d", "a", "other"}) {
    FinishedRequest r;
    r.finished_reason = "stop";
    r.cache_namespace = space;
    r.prompt_tokens = 1;
    metrics.observe_finished(r);
  }
  const std::string text = metrics.serialize();
  EXPECT_EQ(sample(text, R"(deltaserve_prefix_cache_query_tokens_total{namespace="a"})"), 2.0);
  EXPECT_EQ(sample(text, R"(deltaserve_prefix_cache_query_tokens_total{namespace="b"})"), 1.0);
  EXPECT_EQ(sample(text, R"(deltaserve_prefix_cache_query_tokens_total{namespace="other"})"), 3.0);
  EXPECT_EQ(text.find(R"(namespace="c")"), std::string::npos);
}

TEST(Metrics, InterTokenLatencyIsObservedOncePerToken) {
  Metrics metrics = make();
  metrics.observe_inter_token(0.03, 3);
  metrics.observe_inter_token(0.5, 0);  // no token: nothing
  const std::string text = metrics.serialize();
  EXPECT_EQ(sample(text, R"(vllm:inter_token_latency_seconds_count{model_name="m"})"), 3.0);
  EXPECT_NEAR(*sample(text, R"(vllm:inter_token_latency_seconds_sum{model_name="m"})"), 0.03, 1e-12);
  EXPECT_EQ(sample(text, R"(vllm:inter_token_latency_seconds_bucket{model_name="m",le="0.01"})"), 3.0);
  EXPECT_EQ(sample(text, R"(vllm:inter_token_latency_seconds_bucket{model_name="m",le="0.005"})"), 0.0);
}

TEST(Metrics, CumulativeWorkerTotalsBecomeMonotonicCounters) {
  Metrics metrics = make();
  WorkerGaugeSnapshot w;
  w.requests_active = 3;
  w.state_slots_total = 8;
  w.state_slots_free = 5;
  w.pages_total = 10;
  w.pages_free = 6;
  w.steps_total = 10;
  metrics.set_worker_gauges(w);
  w.steps_total = 15;
  metrics.set_worker_gauges(w);
  w.steps_total = 0;  // a failed read: ignored
  metrics.set_worker_gauges(w);
  w.steps_total = 16;
  metrics.set_worker_gauges(w);
  const std::string text = metrics.serialize();
  EXPECT_EQ(sample(text, "deltaserve_worker_steps_total"), 16.0);
  EXPECT_EQ(sample(text, R"(deltaserve_worker_requests{state="active"})"), 3.0);
  EXPECT_EQ(text.find(R"(deltaserve_worker_requests{state="queued"})"), std::string::npos);  // not known
  EXPECT_EQ(sample(text, R"(deltaserve_kda_state_slots{role="decode",state="used"})"), 3.0);
  EXPECT_EQ(text.find(R"(role="prefill")"), std::string::npos);  // not known
  EXPECT_EQ(sample(text, R"(deltaserve_mla_pages{state="free"})"), 6.0);
  EXPECT_NEAR(*sample(text, R"(vllm:kv_cache_usage_perc{model_name="m"})"), 0.4, 1e-12);
  EXPECT_EQ(text.find("deltaserve_ucx_transfers{"), std::string::npos);  // transport caf: not known
}

TEST(Metrics, UcxTransferEngineGauges) {
  Metrics metrics = make();
  WorkerGaugeSnapshot w;
  w.transfers_pending = 2;
  w.transfer_requests_in_flight = 5;
  w.transfer_region_uses = 3;
  metrics.set_worker_gauges(w);
  w.transfers_pending = 0;  // gauges follow the engine down to idle
  w.transfer_requests_in_flight = 0;
  w.transfer_region_uses = 0;
  metrics.set_worker_gauges(w);
  const std::string text = metrics.serialize();
  EXPECT_EQ(sample(text, R"(deltaserve_ucx_transfers{what="pending"})"), 0.0);
  EXPECT_EQ(sample(text, R"(deltaserve_ucx_transfers{what="requests_in_flight"})"), 0.0);
  EXPECT_EQ(sample(text, R"(deltaserve_ucx_transfers{what="region_uses"})"), 0.0);
}

TEST(Metrics, HandoffsIndexAndRouterWorkers) {
  Metrics metrics = make();
  metrics.observe_handoff("ucx", 1000, 0.002, true);
  metrics.observe_handoff("ucx", 500, 0.5, false);
  metrics.observe_index_write(0.0003);
  metrics.set_router_totals({10, 4, 2048, 7, 1});
  metrics.set_router_totals({12, 4, 2048, 9, 0});  // a failed read (lower): ignored
  metrics.set_index_stats({42, 4096});
  metrics.set_router_workers(
      {{"d0", "decode", 2, 6, true}, {"d1", "decode", 0, 8, false}, {"p0", "prefill", 1, 0, true}});
  metrics.set_router_workers({{"d0", "decode", 1, 7, true}, {"p0", "prefill", 0, 0, true}});
  const std::string text = metrics.serialize();
  EXPECT_EQ(sample(text, R"(deltaserve_handoffs_total{result="ok",transport="ucx"})"), 1.0);
  EXPECT_EQ(sample(text, R"(deltaserve_handoffs_total{result="failed",transport="ucx"})"), 1.0);
  EXPECT_EQ(sample(text, R"(deltaserve_handoff_bytes_total{transport="ucx"})"), 1000.0);
  EXPECT_EQ(sample(text, "deltaserve_prefix_index_errors_total"), 1.0);
  EXPECT_EQ(sample(text, "deltaserve_prefix_index_events_total"), 9.0);
  EXPECT_EQ(sample(text, "deltaserve_router_admitted_total"), 12.0);
  EXPECT_EQ(sample(text, "deltaserve_router_expected_cached_tokens_total"), 2048.0);
  EXPECT_EQ(sample(text, "deltaserve_prefix_index_write_duration_seconds_count"), 1.0);
  EXPECT_EQ(sample(text, "deltaserve_prefix_index_entries"), 42.0);
  EXPECT_EQ(sample(text, R"(deltaserve_router_worker_load{role="decode",worker="d0"})"), 1.0);
  EXPECT_EQ(text.find(R"(worker="d1")"), std::string::npos);  // gone from the registry, gone here
  EXPECT_EQ(sample(text, R"(deltaserve_router_workers{role="decode"})"), 1.0);
  EXPECT_EQ(sample(text, R"(deltaserve_router_workers{role="prefill"})"), 1.0);
}

TEST(Metrics, WorkersDoNotExportRequestFamilies) {
  MetricsOptions o = options();
  o.role = "decode";
  Metrics metrics(o);
  const std::string text = metrics.serialize();
  EXPECT_EQ(text.find("vllm:generation_tokens_total"), std::string::npos);
  EXPECT_EQ(text.find("vllm:num_requests_running"), std::string::npos);
  EXPECT_NE(text.find(R"(role="decode")"), std::string::npos);
}

TEST(Metrics, HttpResponsesByRouteAndCode) {
  Metrics metrics = make();
  metrics.observe_http_response("/v1/completions", 200, 0.01);
  metrics.observe_http_response("/v1/completions", 200, 0.02);
  metrics.observe_http_response("", 404, 0.0);
  const std::string text = metrics.serialize();
  EXPECT_EQ(sample(text, R"(deltaserve_http_requests_total{code="200",endpoint="/v1/completions"})"), 2.0);
  EXPECT_EQ(sample(text, R"(deltaserve_http_requests_total{code="404",endpoint="other"})"), 1.0);
}

TEST(Metrics, CollectHooksRunAtEveryScrapeUntilRemoved) {
  Metrics metrics = make();
  int runs = 0;
  const auto id = metrics.add_collect_hook([&] {
    ++runs;
    metrics.set_service_status(true, runs, 2, 8, 6);
  });
  std::string text = metrics.serialize();
  EXPECT_EQ(sample(text, R"(vllm:num_requests_running{model_name="m"})"), 1.0);
  EXPECT_EQ(sample(text, "deltaserve_ready"), 1.0);
  EXPECT_EQ(sample(text, R"(deltaserve_router_decode_slots{state="used"})"), 2.0);
  text = metrics.serialize();
  EXPECT_EQ(sample(text, R"(vllm:num_requests_running{model_name="m"})"), 2.0);
  metrics.remove_collect_hook(id);
  metrics.serialize();
  EXPECT_EQ(runs, 2);
}

std::string http_get(uint16_t port, const std::string& path) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    ::close(fd);
    return "";
  }
  const std::string request = "GET " + path + " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
  (void)!::write(fd, request.data(), request.size());
  std::string response;
  char buffer[4096];
  for (ssize_t n; (n = ::read(fd, buffer, sizeof buffer)) > 0;) response.append(buffer, static_cast<size_t>(n));
  ::close(fd);
  return response;
}

TEST(MetricsListener, ServesTheMetricsAndRunsHooks) {
  auto metrics = std::make_shared<Metrics>(options());
  std::atomic<int> runs{0};
  metrics->add_collect_hook([&] { ++runs; });
  metrics->observe_http_response("/health", 200, 0.001);
  auto listener = MetricsListener::start("127.0.0.1:0", metrics);
  ASSERT_TRUE(listener.is_ok()) << listener.status().message();
  ASSERT_GT((*listener)->port(), 0);
  const std::string response = http_get((*listener)->port(), "/metrics");
  EXPECT_NE(response.find("200 OK"), std::string::npos) << response.substr(0, 200);
  EXPECT_NE(response.find(R"(deltaserve_http_requests_total{code="200",endpoint="/health"} 1)"), std::string::npos);
  EXPECT_GE(runs.load(), 1);

  // The same port again: a clear Unavailable, not an exception.
  auto clash = MetricsListener::start("127.0.0.1:" + std::to_string((*listener)->port()), metrics);
  ASSERT_FALSE(clash.is_ok());
  EXPECT_EQ(clash.status().code(), StatusCode::kUnavailable);
}

// /health answers what the health check says, at each request; without a check it is not served.
TEST(MetricsListener, HealthFollowsTheCheck) {
  auto metrics = std::make_shared<Metrics>(options());
  std::atomic<bool> healthy{true};
  auto listener = MetricsListener::start("127.0.0.1:0", metrics, [&]() -> Status {
    return healthy ? Status::ok() : Status(StatusCode::kUnavailable, "joined to no router for 61 s");
  });
  ASSERT_TRUE(listener.is_ok()) << listener.status().message();
  std::string response = http_get((*listener)->port(), "/health");
  EXPECT_NE(response.find("200 OK"), std::string::npos) << response;
  healthy = false;
  response = http_get((*listener)->port(), "/health");
  EXPECT_NE(response.find("503 Service Unavailable"), std::string::npos) << response;
  EXPECT_NE(response.find("joined to no router for 61 s"), std::string::npos) << response;
  EXPECT_NE(http_get((*listener)->port(), "/metrics").find("200 OK"), std::string::npos);  // scrapes go on
  healthy = true;
  EXPECT_NE(http_get((*listener)->port(), "/health").find("200 OK"), std::string::npos);

  auto plain = MetricsListener::start("127.0.0.1:0", metrics);
  ASSERT_TRUE(plain.is_ok()) << plain.status().message();
  EXPECT_NE(http_get((*plain)->port(), "/health").find("404 Not Found"), std::string::npos);
}

TEST(MetricsListener, RejectsMalformedAddresses) {
  auto metrics = std::make_shared<Metrics>(options());
  for (const char* address : {"", "9464", ":9464", "127.0.0.1:", "127.0.0.1:x", "127.0.0.1:1234567"}) {
    auto listener = MetricsListener::start(address, metrics);
    ASSERT_FALSE(listener.is_ok()) << address;
    EXPECT_EQ(listener.status().code(), StatusCode::kInvalidArgument) << address;
  }
}

}  // namespace
}  // namespace deltaserve::telemetry
