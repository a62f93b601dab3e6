// Beast/Asio stay in this translation unit (and the test's client): they are slow to compile.
#include "router/http_server.hpp"

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <random>
#include <thread>
#include <unordered_map>
#include <utility>  // before Asio: Boost 1.74 awaitable.hpp needs std::exchange (stack.md §6.9)
#include <variant>

#include <boost/asio/bind_executor.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/thread_pool.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <spdlog/spdlog.h>

#include "router/chunk_channel.hpp"
#include "router/openai_request.hpp"
#include "telemetry/metrics.hpp"

namespace deltaserve::router {
namespace {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;
using boost::system::error_code;

int64_t now_unix_seconds() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

int64_t now_steady_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

struct Connection {
  explicit Connection(tcp::socket socket) : stream(std::move(socket)), wake(stream.get_executor()) {}

  beast::tcp_stream stream;
  beast::flat_buffer buffer;
  net::steady_timer wake;    // a generation waits on it; cancelled when chunks arrive or the client leaves
  bool client_gone = false;  // connection context only
  uint64_t watch_epoch = 0;  // connection context only; bumps invalidate a pending disconnect watch
  bool watching = false;
  // The request being answered (connection context only), for metrics.
  std::string_view route = "other";  // a route path (static storage) or "other"
  unsigned status = 0;               // status of the response head written; 0 = none yet

  // Strand only: ends the connection (stop()).
  void abort() {
    client_gone = true;
    error_code ignored;
    stream.socket().shutdown(tcp::socket::shutdown_both, ignored);
    stream.socket().close(ignored);
    wake.cancel();
  }
};

using ConnectionPtr = std::shared_ptr<Connection>;

// Bytes of prompt text the tokenizer would read (token-id prompts are not tokenized: 0).
size_t prompt_bytes(const OpenAiRequest& request) {
  size_t bytes = request.prompt_text ? request.prompt_text->size() : 0;
  for (const tokenizer::ChatMessage& message : request.messages) {
    bytes += message.role.size() + message.content.size() + (message.name ? message.name->size() : 0);
  }
  return bytes;
}

constexpr auto kTryAwait = net::use_awaitable;

}  // namespace

class HttpServer::Impl {
 public:
  Impl(HttpServerConfig config, const tokenizer::Tokenizer& tokenizer, ModelInfo model,
       std::vector<int32_t> eos_token_ids, InferenceService& service, ApiKeys keys)
      : tokenize_pool_(static_cast<size_t>(std::max(1, config.tokenize_threads))),
        config_(std::move(config)),
        tokenizer_(tokenizer),
        model_(std::move(model)),
        eos_token_ids_(std::move(eos_token_ids)),
        service_(service),
        keys_(std::move(keys)),
        admission_(keys_.limits(), config_.admission_clock),
        acceptor_(ioc_),
        rng_(std::random_device{}()) {}

  ~Impl() { stop(); }

  Result<uint16_t> start();
  void stop();
  void begin_drain() {
    draining_ = true;
    if (metrics_) metrics_->set_draining(true);
  }
  bool wait_idle(std::chrono::milliseconds timeout) {
    std::unique_lock lock(idle_mutex_);
    return idle_cv_.wait_for(lock, timeout, [&] { return in_flight_.load() == 0; });
  }
  int64_t in_flight() const { return in_flight_.load(); }
  int64_t cut_in_flight(std::chrono::milliseconds grace) {
    cutting_ = true;  // before the wake-ups: a generation checks it on its own context before each wait
    {
      std::lock_guard lock(connections_mutex_);
      for (auto& [id, weak] : connections_) {
        if (auto connection = weak.lock())
          net::post(connection->stream.get_executor(), [connection] { connection->wake.cancel(); });
      }
    }
    wait_idle(grace);
    // Those that answered with the cut error, and those still not done (stop() will close them).
    return cut_requests_.load() + in_flight_.load();
  }

  uint64_t accept_errors() const { return accept_errors_.load(); }

 private:
  // Counts a request in flight for its lifetime.
  class InFlight {
   public:
    explicit InFlight(Impl& impl) : impl_(impl) { impl_.in_flight_.fetch_add(1); }
    ~InFlight() {
      std::lock_guard lock(impl_.idle_mutex_);
      if (impl_.in_flight_.fetch_sub(1) == 1) impl_.idle_cv_.notify_all();
    }
    InFlight(const InFlight&) = delete;
    InFlight& operator=(const InFlight&) = delete;

   private:
    Impl& impl_;
  };

  using Request = http::request<http::string_body>;
  using Headers = std::vector<std::pair<std::string, std::string>>;

  net::awaitable<void> accept_loop();
  net::awaitable<void> session(ConnectionPtr connection);
  net::awaitable<void> refuse(ConnectionPtr connection);  // over max_connections: 503, then close
  // Handles one request whose head is in `parser`; returns whether the connection may be reused.
  net::awaitable<bool> handle(ConnectionPtr connection, http::request_parser<http::string_body>& parser,
                              bool keep_alive);
  net::awaitable<bool> generate(ConnectionPtr connection, Endpoint endpoint, const Request& request, std::string tenant,
                                bool keep_alive, int64_t arrival_ns);
  net::awaitable<bool> write_response(const ConnectionPtr& connection, unsigned status, std::string body,
                                      std::string_view content_type, const Headers& headers, bool keep_alive);
  net::awaitable<bool> write_error(const ConnectionPtr& connection, const ApiError& error, bool keep_alive);
  net::awaitable<bool> write_raw(const ConnectionPtr& connection, std::string data, bool last_chunk);

  // Counts the response of the request that started at `started_ns` (499 when none was sent).
  void record_response(const ConnectionPtr& connection, int64_t started_ns);

  void start_watch(const ConnectionPtr& connection);
  void stop_watch(const ConnectionPtr& connection);
  std::string random_id();
  uint64_t random_seed();

  // Runs plan_generation (tokenization) off the Asio threads. Declared first so it outlives the io_contexts:
  // a coroutine frame they destroy may still hold work on it.
  net::thread_pool tokenize_pool_;
  HttpServerConfig config_;
  const tokenizer::Tokenizer& tokenizer_;
  ModelInfo model_;
  std::vector<int32_t> eos_token_ids_;
  InferenceService& service_;
  ApiKeys keys_;
  Admission admission_;
  telemetry::Metrics* const metrics_ = config_.metrics.get();  // null: not measured
  telemetry::Metrics::HookId metrics_hook_ = 0;

  // One io_context per thread, each run by exactly one thread: a connection lives on one context, so
  // its handlers never run concurrently and no strand is needed. (Boost 1.74 strands driven from
  // coroutines lost wake-ups posted from service threads: a chunk could sit unseen until the next
  // socket event.) ioc_ also runs the acceptor; extra_ holds contexts 1..threads-1.
  // Declared before ioc_ so they outlive it: ioc_'s shutdown destroys a pending accept whose socket
  // belongs to one of them.
  std::vector<std::unique_ptr<net::io_context>> extra_;
  net::io_context ioc_;
  std::vector<net::executor_work_guard<net::io_context::executor_type>> guards_;
  std::atomic<uint64_t> next_context_{0};
  tcp::acceptor acceptor_;
  std::vector<std::thread> threads_;
  std::atomic<bool> started_{false};
  std::atomic<bool> stopped_{false};
  std::atomic<uint64_t> accept_errors_{0};
  std::atomic<size_t> open_connections_{0};  // sessions accepted and not yet ended
  std::atomic<bool> draining_{false};
  std::atomic<bool> cutting_{false};      // cut_in_flight: generations end with an error now
  std::atomic<int64_t> cut_requests_{0};  // generations ended by cut_in_flight
  std::atomic<int64_t> in_flight_{0};
  std::mutex idle_mutex_;
  std::condition_variable idle_cv_;

  std::mutex connections_mutex_;
  uint64_t next_connection_ = 0;
  std::unordered_map<uint64_t, std::weak_ptr<Connection>> connections_;
  std::unordered_map<ChunkChannel*, std::weak_ptr<ChunkChannel>> channels_;

  std::mutex rng_mutex_;
  std::mt19937_64 rng_;
};

Result<uint16_t> HttpServer::Impl::start() {
  if (started_.exchange(true)) return failed_precondition("HttpServer::start called twice");
  const std::string where = config_.host + ":" + std::to_string(config_.port);
  error_code ec;
  const auto address = net::ip::make_address(config_.host, ec);
  if (ec) return invalid_argument("listen address " + where + ": " + ec.message());
  const tcp::endpoint endpoint(address, config_.port);
  acceptor_.open(endpoint.protocol(), ec);
  if (!ec) acceptor_.set_option(net::socket_base::reuse_address(true), ec);
  if (!ec) acceptor_.bind(endpoint, ec);
  if (!ec) acceptor_.listen(net::socket_base::max_listen_connections, ec);
  if (ec) return io_error("listen on " + where + ": " + ec.message());
  const uint16_t port = acceptor_.local_endpoint(ec).port();
  const int threads = std::max(1, config_.threads);
  guards_.push_back(net::make_work_guard(ioc_));
  for (int i = 1; i < threads; ++i) {
    extra_.push_back(std::make_unique<net::io_context>());
    guards_.push_back(net::make_work_guard(*extra_.back()));
  }
  net::co_spawn(ioc_, accept_loop(), net::detached);
  threads_.emplace_back([this] { ioc_.run(); });
  for (auto& context : extra_) threads_.emplace_back([&context] { context->run(); });
  if (metrics_) {
    // Gauges that have a source of truth are read at scrape time.
    metrics_hook_ = metrics_->add_collect_hook([this] {
      const ServiceStatus status = service_.status();
      metrics_->set_service_status(status.ready && !draining_, status.running, status.waiting,
                                   status.decode_slots_total, status.decode_slots_free);
      metrics_->set_draining(draining_);
      metrics_->set_http_in_flight(in_flight_.load());
    });
  }
  spdlog::info("http: listening on {}:{} ({} threads)", config_.host, port, threads);
  return port;
}

void HttpServer::Impl::stop() {
  if (stopped_.exchange(true)) return;
  if (metrics_ && metrics_hook_ != 0) metrics_->remove_collect_hook(metrics_hook_);
  net::post(ioc_, [this] {
    error_code ignored;
    acceptor_.close(ignored);
  });
  {
    std::lock_guard lock(connections_mutex_);
    for (auto& [id, weak] : connections_) {
      if (auto connection = weak.lock())
        net::post(connection->stream.get_executor(), [connection] { connection->abort(); });
    }
  }
  // Sessions end as their sockets fail; give them a moment to cancel their requests, then stop.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  while (std::chrono::steady_clock::now() < deadline) {
    {
      std::lock_guard lock(connections_mutex_);
      if (connections_.empty()) break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  guards_.clear();
  ioc_.stop();
  for (auto& context : extra_) context->stop();
  for (std::thread& thread : threads_) thread.join();
  tokenize_pool_.stop();  // a finished tokenization's hop back to a stopped context must not keep it waiting
  tokenize_pool_.join();
  threads_.clear();
  std::lock_guard lock(connections_mutex_);
  for (auto& [raw, weak] : channels_) {
    if (auto channel = weak.lock()) channel->close();
  }
  channels_.clear();
}

net::awaitable<void> HttpServer::Impl::accept_loop() {
  // A failing accept (typically a full file table) fails again at once: retrying in a loop would spin a core
  // and flood the log. Back off instead, and log at most once per second with the count of failures since.
  constexpr auto kFirstBackoff = std::chrono::milliseconds(50), kMaxBackoff = std::chrono::milliseconds(1000);
  auto backoff = kFirstBackoff;
  auto last_log = std::chrono::steady_clock::time_point{};
  uint64_t unlogged = 0;
  net::steady_timer pause(ioc_);
  for (;;) {
    error_code ec;
    const uint64_t pick = next_context_++ % (extra_.size() + 1);
    net::io_context& context = pick == 0 ? ioc_ : *extra_[pick - 1];
    tcp::socket socket = co_await acceptor_.async_accept(net::any_io_executor(context.get_executor()),
                                                         net::redirect_error(kTryAwait, ec));
    if (ec) {
      if (!acceptor_.is_open() || stopped_) co_return;
      ++accept_errors_;
      ++unlogged;
      if (const auto now = std::chrono::steady_clock::now(); now - last_log >= std::chrono::seconds(1)) {
        spdlog::warn("http: accept failed {} time(s): {}; retrying in {} ms", unlogged, ec.message(), backoff.count());
        last_log = now;
        unlogged = 0;
      }
      pause.expires_after(backoff);
      co_await pause.async_wait(net::redirect_error(kTryAwait, ec));
      backoff = std::min(backoff * 2, kMaxBackoff);
      continue;
    }
    backoff = kFirstBackoff;
    socket.set_option(tcp::no_delay(true), ec);
    auto connection = std::make_shared<Connection>(std::move(socket));
    // Counted here, not when the session registers, so a burst of accepts cannot overshoot the cap.
    if (open_connections_.fetch_add(1) >= config_.max_connections) {
      --open_connections_;
      net::co_spawn(connection->stream.get_executor(), refuse(connection), net::detached);
      continue;
    }
    net::co_spawn(connection->stream.get_executor(), session(connection), net::detached);
  }
}

net::awaitable<void> HttpServer::Impl::refuse(ConnectionPtr connection) {
  co_await write_error(connection,
                       ApiError::from_status(Status(StatusCode::kUnavailable,
                                                    "The server is at its limit of open connections; retry later.")),
                       false);
  error_code ignored;
  connection->stream.socket().shutdown(tcp::socket::shutdown_send, ignored);
  connection->stream.close();
}

net::awaitable<void> HttpServer::Impl::session(ConnectionPtr connection) {
  uint64_t id = 0;
  {
    std::lock_guard lock(connections_mutex_);
    id = next_connection_++;
    connections_.emplace(id, connection);
  }
  if (stopped_) connection->abort();
  bool first = true;
  for (;;) {
    error_code ec;
    // Wait for the next request's first bytes (idle), then give its head header_timeout.
    if (connection->buffer.size() == 0) {
      connection->stream.expires_after(first ? config_.header_timeout : config_.idle_timeout);
      const size_t n = co_await connection->stream.async_read_some(connection->buffer.prepare(4096),
                                                                   net::redirect_error(kTryAwait, ec));
      if (ec) break;
      connection->buffer.commit(n);
    }
    first = false;
    http::request_parser<http::string_body> parser;
    parser.header_limit(static_cast<std::uint32_t>(std::min<size_t>(config_.max_header_bytes, UINT32_MAX)));
    parser.body_limit(config_.max_body_bytes);
    connection->stream.expires_after(config_.header_timeout);
    co_await http::async_read_header(connection->stream, connection->buffer, parser,
                                     net::redirect_error(kTryAwait, ec));
    connection->stream.expires_never();
    const int64_t started_ns = now_steady_ns();
    connection->route = "other";
    connection->status = 0;
    if (ec == http::error::header_limit) {
      InFlight counted(*this);
      co_await write_error(
          connection,
          ApiError::of_kind(ApiError::Kind::kHeaderTooLarge,
                            "Request headers exceed " + std::to_string(config_.max_header_bytes) + " bytes."),
          false);
      record_response(connection, started_ns);
      break;
    }
    if (ec == http::error::body_limit) {
      InFlight counted(*this);
      co_await write_error(
          connection,
          ApiError::of_kind(ApiError::Kind::kBodyTooLarge,
                            "Request body exceeds " + std::to_string(config_.max_body_bytes) + " bytes."),
          false);
      record_response(connection, started_ns);
      break;
    }
    if (ec == beast::error::timeout || ec == http::error::end_of_stream || ec == net::error::eof) break;
    if (ec) {
      if (connection->client_gone || !connection->stream.socket().is_open()) break;
      InFlight counted(*this);
      co_await write_error(connection, ApiError::invalid("", "Malformed HTTP request: " + ec.message()), false);
      record_response(connection, started_ns);
      break;
    }
    InFlight counted(*this);
    const bool keep_alive = parser.get().keep_alive() && !draining_;
    const bool reuse = co_await handle(connection, parser, keep_alive);
    record_response(connection, started_ns);
    if (!reuse) break;
  }
  error_code ignored;
  connection->stream.socket().shutdown(tcp::socket::shutdown_send, ignored);
  connection->stream.close();
  --open_connections_;
  std::lock_guard lock(connections_mutex_);
  connections_.erase(id);
}

net::awaitable<bool> HttpServer::Impl::handle(ConnectionPtr connection, http::request_parser<http::string_body>& parser,
                                              bool keep_alive) {
  const int64_t arrival_ns = now_steady_ns();
  const auto& head = parser.get();
  std::string_view target = head.target();
  if (const size_t query = target.find('?'); query != std::string_view::npos) target = target.substr(0, query);
  const http::verb method = head.method();
  // The body of a request answered without reading it stays unread: such answers close the connection.
  const bool body_pending = !parser.is_done();
  const bool reusable = keep_alive && !body_pending;

  struct Route {
    std::string_view path;
    http::verb method;
    bool authenticated;
  };
  static constexpr Route kRoutes[] = {
      {"/health", http::verb::get, false},
      {"/ready", http::verb::get, false},
      {"/v1/models", http::verb::get, true},
      {"/v1/completions", http::verb::post, true},
      {"/v1/chat/completions", http::verb::post, true},
      {"/metrics", http::verb::get, true},  // with keys on: its series name tenants (cache namespaces)
  };
  const bool serve_metrics = metrics_ != nullptr && config_.metrics_endpoint;
  const Route* route = nullptr;
  for (const Route& candidate : kRoutes) {
    if (candidate.path == "/metrics" && !serve_metrics) continue;
    if (candidate.path == target) route = &candidate;
  }
  if (route == nullptr) {
    co_return co_await write_error(
        connection, ApiError::of_kind(ApiError::Kind::kRouteNotFound, "Unknown path " + std::string(target) + "."),
        reusable);
  }
  if (method != route->method) {
    ApiError error = ApiError::of_kind(
        ApiError::Kind::kMethodNotAllowed,
        "Method " + std::string(head.method_string()) + " is not allowed on " + std::string(route->path) + ".");
    error.allow = std::string(http::to_string(route->method));
    co_return co_await write_error(connection, error, reusable);
  }
  connection->route = route->path;
  if (route->path == "/health") {
    co_return co_await write_response(connection, 200, R"({"status":"ok"})", "application/json", {}, reusable);
  }
  if (route->path == "/ready") {
    const ServiceStatus status = service_.status();
    if (draining_) {
      co_return co_await write_response(connection, 503, R"({"status":"not_ready","reason":"draining"})",
                                        "application/json", {}, reusable);
    }
    if (!status.ready) {
      std::string reason;
      for (const char c : status.reason) {  // a JSON string without a JSON library in this TU
        if (c == '"' || c == '\\') reason += '\\';
        if (static_cast<unsigned char>(c) < 0x20) continue;
        reason += c;
      }
      co_return co_await write_response(connection, 503, R"({"status":"not_ready","reason":")" + reason + "\"}",
                                        "application/json", {}, reusable);
    }
    // Load figures for probes and tests (e.g. every slot free again after a load).
    const std::string body = R"({"status":"ready","running":)" + std::to_string(status.running) + R"(,"waiting":)" +
                             std::to_string(status.waiting) + R"(,"decode_slots_total":)" +
                             std::to_string(status.decode_slots_total) + R"(,"decode_slots_free":)" +
                             std::to_string(status.decode_slots_free) + R"(,"worker_requests":)" +
                             std::to_string(status.worker_requests) + "}";
    co_return co_await write_response(connection, 200, body, "application/json", {}, reusable);
  }

  std::string tenant(kDefaultTenant);
  if (keys_.enabled()) {
    const auto authorization = head.find(http::field::authorization);
    std::optional<std::string_view> key;
    if (authorization != head.end()) key = parse_bearer(authorization->value());
    std::optional<std::string> found;
    if (key) found = keys_.tenant_for(*key);
    if (!found) {
      const char* message = key ? "Incorrect API key provided."
                                : "You didn't provide an API key. Provide it in the Authorization header "
                                  "(Authorization: Bearer YOUR_KEY).";
      co_return co_await write_error(connection, ApiError::of_kind(ApiError::Kind::kUnauthorized, message), reusable);
    }
    tenant = std::move(*found);
  }
  if (route->path == "/metrics") {
    co_return co_await write_response(connection, 200, metrics_->serialize(), telemetry::Metrics::kContentType, {},
                                      reusable);
  }
  if (route->path == "/v1/models") {
    co_return co_await write_response(connection, 200, models_json(model_), "application/json", {}, reusable);
  }

  // A generation request: read its body (the parser enforces max_body_bytes, also for chunked bodies).
  if (body_pending) {
    error_code ec;
    const auto expect = head.find(http::field::expect);
    if (expect != head.end() && beast::iequals(expect->value(), "100-continue")) {
      http::response<http::empty_body> go_on{http::status::continue_, head.version()};
      connection->stream.expires_after(config_.write_timeout);
      co_await http::async_write(connection->stream, go_on, net::redirect_error(kTryAwait, ec));
      if (ec) co_return false;
    }
    connection->stream.expires_after(config_.idle_timeout);
    co_await http::async_read(connection->stream, connection->buffer, parser, net::redirect_error(kTryAwait, ec));
    connection->stream.expires_never();
    if (ec == http::error::body_limit) {
      co_return co_await write_error(
          connection,
          ApiError::of_kind(ApiError::Kind::kBodyTooLarge,
                            "Request body exceeds " + std::to_string(config_.max_body_bytes) + " bytes."),
          false);
    }
    if (ec) co_return false;
  }
  const Endpoint endpoint = route->path == "/v1/completions" ? Endpoint::kCompletions : Endpoint::kChatCompletions;
  co_return co_await generate(connection, endpoint, parser.get(), std::move(tenant), keep_alive, arrival_ns);
}

net::awaitable<bool> HttpServer::Impl::generate(ConnectionPtr connection, Endpoint endpoint, const Request& request,
                                                std::string tenant, bool keep_alive, int64_t arrival_ns) {
  if (draining_) {
    co_return co_await write_error(
        connection, ApiError::from_status({StatusCode::kUnavailable, "The server is shutting down; retry elsewhere."}),
        false);
  }
  OpenAiRequest parsed;
  if (auto error = parse_openai_request(endpoint, request.body(), parsed)) {
    co_return co_await write_error(connection, *error, keep_alive);
  }
  if (parsed.model != model_.id) {
    co_return co_await write_error(connection,
                                   ApiError::from_status(not_found("The model '" + parsed.model + "' does not exist."),
                                                         "model", "model_not_found"),
                                   keep_alive);
  }
  const bool chat = endpoint == Endpoint::kChatCompletions;
  const std::string response_id = (chat ? "chatcmpl-" : "cmpl-") + random_id();
  PlanOptions options;
  options.context_length = model_.context_length;
  options.response_id = response_id;
  options.tenant = tenant;
  options.cache_namespace = keys_.cache_namespace_of(tenant);
  options.random_seed = random_seed();
  options.stop_token_ids = eos_token_ids_;
  options.arrival_ns = arrival_ns;
  // A cheap bound before the costly step: tokenizing tens of MB would hold a pool thread for seconds.
  const size_t max_prompt_bytes = config_.max_prompt_bytes > 0
                                      ? config_.max_prompt_bytes
                                      : static_cast<size_t>(std::max<int64_t>(model_.context_length, 1)) * 16;
  if (const size_t bytes = prompt_bytes(parsed); bytes > max_prompt_bytes) {
    const std::string param = endpoint == Endpoint::kChatCompletions ? "messages" : "prompt";
    co_return co_await write_error(
        connection,
        ApiError::invalid(param,
                          "The " + param + " is " + std::to_string(bytes) + " bytes; this server accepts at most " +
                              std::to_string(max_prompt_bytes) +
                              " bytes of prompt text (this model's maximum context " + "length is " +
                              std::to_string(model_.context_length) + " tokens). Please reduce the length of the " +
                              param + ".",
                          "context_length_exceeded"),
        keep_alive);
  }
  // Tokenize on the pool; the coroutine resumes on this connection's context (co_spawn's completion).
  GenerationPlan plan;
  std::optional<ApiError> plan_error = co_await net::co_spawn(
      tokenize_pool_.get_executor(),
      [&]() -> net::awaitable<std::optional<ApiError>> {
        if (config_.before_tokenize) config_.before_tokenize();
        co_return plan_generation(parsed, tokenizer_, options, plan);
      },
      kTryAwait);
  if (plan_error) co_return co_await write_error(connection, *plan_error, keep_alive);

  const int n = static_cast<int>(plan.choices.size());
  // Charged prompt + every choice's max_tokens now; corrected to what was generated when the request ends.
  const auto prompt_tokens = static_cast<int64_t>(plan.prompt.size());
  auto admitted = admission_.admit(tenant, prompt_tokens + n * plan.max_tokens);
  if (const auto* refusal = std::get_if<AdmissionRefusal>(&admitted)) {
    const bool tokens = refusal->limit == AdmissionRefusal::Limit::kTokensPerMinute;
    co_return co_await write_error(
        connection,
        ApiError::rate_limited(refusal->message, tokens ? "tokens" : "requests", refusal->retry_after.count()),
        keep_alive);
  }
  Admission::Ticket ticket = std::move(std::get<Admission::Ticket>(admitted));
  const Priority priority = admission_.priority_of(tenant);
  for (GenerationRequest& choice : plan.choices) choice.priority = priority;
  std::vector<std::string> request_ids;
  for (const GenerationRequest& choice : plan.choices) request_ids.push_back(choice.request_id);
  auto channel = std::make_shared<ChunkChannel>(
      [connection] { net::post(connection->stream.get_executor(), [connection] { connection->wake.cancel(); }); });
  {
    std::lock_guard lock(connections_mutex_);
    channels_.emplace(channel.get(), channel);
  }
  std::vector<bool> finished(static_cast<size_t>(n), false);
  int remaining = n;
  auto cancel_unfinished = [&] {
    for (int i = 0; i < n; ++i) {
      if (!finished[static_cast<size_t>(i)]) service_.cancel(request_ids[static_cast<size_t>(i)]);
    }
  };
  auto release = [&] {
    channel->close();
    std::lock_guard lock(connections_mutex_);
    channels_.erase(channel.get());
  };
  spdlog::debug("http: {} tenant={} n={} prompt_tokens={} max_tokens={} stream={}", response_id, tenant, n,
                plan.prompt.size(), plan.max_tokens, parsed.stream);

  connection->client_gone = false;
  for (int i = 0; i < n; ++i) {
    service_.submit(std::move(plan.choices[static_cast<size_t>(i)]), std::make_shared<ChannelSink>(channel, i));
  }
  start_watch(connection);

  ResponseContext context;
  context.endpoint = endpoint;
  context.id = response_id;
  context.created = now_unix_seconds();
  context.model = model_.id;
  context.logprobs = parsed.logprobs;
  context.include_usage = parsed.include_usage;
  context.tokenizer = &tokenizer_;
  Usage usage;
  usage.prompt_tokens = static_cast<int64_t>(plan.prompt.size());
  std::vector<ChoiceOutput> outputs(static_cast<size_t>(n));
  StreamFormatter formatter(context, n);
  bool head_sent = false;
  std::optional<ApiError> failure;

  // Per choice, for metrics: when its last tokens arrived, how many, and its time to first token.
  struct ChoiceTiming {
    int64_t last_ns = 0;
    int64_t tokens = 0;
    int64_t ttft_ns = -1;
  };
  std::vector<ChoiceTiming> timing(static_cast<size_t>(n));
  auto seconds = [](int64_t ns) { return static_cast<double>(ns) * 1e-9; };
  auto observe_tokens = [&](size_t at, size_t count) {
    if (!metrics_ || count == 0) return;
    const int64_t now = now_steady_ns();
    ChoiceTiming& t = timing[at];
    if (t.tokens == 0) {
      t.ttft_ns = now - arrival_ns;
      metrics_->observe_time_to_first_token(seconds(t.ttft_ns));
    } else {
      metrics_->observe_inter_token(seconds(now - t.last_ns), static_cast<int64_t>(count));
    }
    t.last_ns = now;
    t.tokens += static_cast<int64_t>(count);
  };
  auto observe_finished = [&](size_t at, std::string_view reason, std::string_view error_code, int64_t cached) {
    if (!metrics_) return;
    telemetry::FinishedRequest finished;
    finished.finished_reason = reason;
    finished.error_code = error_code;
    finished.cache_namespace = options.cache_namespace;  // the tenant's prefix-cache namespace
    finished.prompt_tokens = usage.prompt_tokens;
    finished.generation_tokens = timing[at].tokens;
    finished.cached_tokens = std::min(cached, usage.prompt_tokens);
    finished.e2e_seconds = seconds(now_steady_ns() - arrival_ns);
    finished.ttft_seconds = timing[at].ttft_ns < 0 ? -1.0 : seconds(timing[at].ttft_ns);
    metrics_->observe_finished(finished);
  };
  auto observe_unfinished_as_aborted = [&] {
    for (int i = 0; i < n; ++i) {
      if (!finished[static_cast<size_t>(i)]) observe_finished(static_cast<size_t>(i), "abort", "", 0);
    }
  };

  bool cut = false;
  while (remaining > 0 && !failure) {
    if (cutting_) {
      cut = true;
      ++cut_requests_;
      failure = ApiError::from_status(
          {StatusCode::kUnavailable, "The server shut down before this request finished (drain timeout); retry."});
      break;
    }
    std::deque<ChunkChannel::Item> batch = channel->drain();
    if (batch.empty()) {
      if (connection->client_gone) break;
      connection->wake.expires_at(std::chrono::steady_clock::time_point::max());
      error_code ignored;
      co_await connection->wake.async_wait(net::redirect_error(kTryAwait, ignored));
      continue;
    }
    std::string events;
    for (auto& [index, chunk] : batch) {
      const auto at = static_cast<size_t>(index);
      if (index < 0 || index >= n || finished[at]) continue;  // nothing follows a final chunk
      if (!chunk.error.is_ok()) {
        finished[at] = true;
        --remaining;
        failure = ApiError::from_status(chunk.error);
        observe_finished(at, "error", status_code_name(chunk.error.code()), 0);
        break;
      }
      usage.completion_tokens += static_cast<int64_t>(chunk.tokens.size());
      observe_tokens(at, chunk.tokens.size());
      if (parsed.stream) {
        events += formatter.on_chunk(index, chunk);
      } else {
        ChoiceOutput& output = outputs[at];
        output.text += chunk.text;
        if (parsed.logprobs) {
          output.logprobs.insert(output.logprobs.end(), std::make_move_iterator(chunk.logprobs.begin()),
                                 std::make_move_iterator(chunk.logprobs.end()));
        }
      }
      if (chunk.is_final()) {
        finished[at] = true;
        --remaining;
        outputs[at].finish_reason = *chunk.finish_reason;
        usage.cached_tokens = std::max(usage.cached_tokens, std::min(chunk.cached_tokens, usage.prompt_tokens));
        observe_finished(at, *chunk.finish_reason, "", chunk.cached_tokens);
      }
    }
    // The tenant's concurrency place is held until the last final chunk arrives, not until it is written.
    if (remaining == 0) ticket.finish(prompt_tokens + usage.completion_tokens);
    if (!parsed.stream || failure) continue;
    if (remaining == 0) {
      if (parsed.include_usage) events += formatter.usage_event(usage);
      events += StreamFormatter::done_event();
    }
    if (events.empty()) continue;
    if (!head_sent) {
      http::response<http::empty_body> head{http::status::ok, request.version()};
      head.set(http::field::server, "deltaserve");
      head.set(http::field::content_type, "text/event-stream");
      head.set(http::field::cache_control, "no-cache");
      head.keep_alive(keep_alive);
      head.chunked(true);
      http::response_serializer<http::empty_body> serializer{head};
      connection->status = 200;
      error_code ec;
      connection->stream.expires_after(config_.write_timeout);
      co_await http::async_write_header(connection->stream, serializer, net::redirect_error(kTryAwait, ec));
      connection->stream.expires_never();
      head_sent = true;
      if (ec) {
        connection->client_gone = true;
        break;
      }
    }
    if (!co_await write_raw(connection, std::move(events), remaining == 0)) {
      connection->client_gone = true;
      break;
    }
  }
  stop_watch(connection);
  ticket.finish(prompt_tokens + usage.completion_tokens);  // failed or cut short: charged what was generated

  if (connection->client_gone && remaining > 0) {
    spdlog::debug("http: {} client went away; cancelling", response_id);
    observe_unfinished_as_aborted();
    cancel_unfinished();
    release();
    co_return false;
  }
  if (failure) {
    observe_unfinished_as_aborted();
    cancel_unfinished();
    release();
    spdlog::debug("http: {} failed: {}", response_id, failure->status.to_string());
    if (head_sent) {
      // A cut stream also ends with [DONE], so clients that wait for it do not hang on a closed socket.
      std::string events = StreamFormatter::error_event(*failure);
      if (cut) events += StreamFormatter::done_event();
      co_await write_raw(connection, std::move(events), true);
      co_return false;
    }
    co_return co_await write_error(connection, *failure, keep_alive);
  }
  release();
  if (parsed.stream) co_return keep_alive && !connection->client_gone;
  co_return co_await write_response(connection, 200, completion_json(context, outputs, usage), "application/json", {},
                                    keep_alive);
}

net::awaitable<bool> HttpServer::Impl::write_response(const ConnectionPtr& connection, unsigned status,
                                                      std::string body, std::string_view content_type,
                                                      const Headers& headers, bool keep_alive) {
  connection->status = status;
  http::response<http::string_body> response{static_cast<http::status>(status), 11};
  response.set(http::field::server, "deltaserve");
  response.set(http::field::content_type, content_type);
  for (const auto& [name, value] : headers) response.set(name, value);
  response.keep_alive(keep_alive && !draining_);
  response.body() = std::move(body);
  response.prepare_payload();
  error_code ec;
  connection->stream.expires_after(config_.write_timeout);
  co_await http::async_write(connection->stream, response, net::redirect_error(kTryAwait, ec));
  connection->stream.expires_never();
  co_return !ec && keep_alive && !draining_;
}

net::awaitable<bool> HttpServer::Impl::write_error(const ConnectionPtr& connection, const ApiError& error,
                                                   bool keep_alive) {
  HttpError http_error = to_http_error(error);
  co_return co_await write_response(connection, http_error.status, std::move(http_error.body), "application/json",
                                    http_error.headers, keep_alive);
}

net::awaitable<bool> HttpServer::Impl::write_raw(const ConnectionPtr& connection, std::string data, bool last_chunk) {
  error_code ec;
  connection->stream.expires_after(config_.write_timeout);
  if (!data.empty()) {
    co_await net::async_write(connection->stream, http::make_chunk(net::buffer(data)),
                              net::redirect_error(kTryAwait, ec));
  }
  if (!ec && last_chunk) {
    co_await net::async_write(connection->stream, http::make_chunk_last(), net::redirect_error(kTryAwait, ec));
  }
  connection->stream.expires_never();
  co_return !ec;
}

void HttpServer::Impl::record_response(const ConnectionPtr& connection, int64_t started_ns) {
  if (!metrics_) return;
  const int status = connection->status == 0 ? 499 : static_cast<int>(connection->status);
  metrics_->observe_http_response(connection->route, status, static_cast<double>(now_steady_ns() - started_ns) * 1e-9);
}

// Watches the idle read side during a generation: EOF or an error means the client is gone. Data
// (a pipelined request) is left in the socket and ends the watch.
void HttpServer::Impl::start_watch(const ConnectionPtr& connection) {
  const uint64_t epoch = ++connection->watch_epoch;
  connection->watching = true;
  connection->stream.socket().async_wait(
      tcp::socket::wait_read,
      net::bind_executor(connection->stream.get_executor(), [this, connection, epoch](error_code ec) {
        if (epoch != connection->watch_epoch || !connection->watching) return;
        connection->watching = false;
        if (ec == net::error::operation_aborted && connection->stream.socket().is_open()) return;
        if (!ec) {
          char byte = 0;
          const size_t n = connection->stream.socket().receive(net::buffer(&byte, 1), tcp::socket::message_peek, ec);
          if (!ec && n > 0) return;
          // The reactor may report a readiness that has no data behind it (edge-triggered epoll keeps
          // readiness from earlier reads): that is not a disconnect, watch again.
          if (ec == net::error::would_block || ec == net::error::try_again) {
            start_watch(connection);
            return;
          }
        }
        connection->client_gone = true;
        connection->wake.cancel();
      }));
}

void HttpServer::Impl::stop_watch(const ConnectionPtr& connection) {
  ++connection->watch_epoch;
  if (connection->watching) {
    connection->watching = false;
    error_code ignored;
    connection->stream.socket().cancel(ignored);
  }
}

std::string HttpServer::Impl::random_id() {
  static constexpr char kHex[] = "0123456789abcdef";
  std::lock_guard lock(rng_mutex_);
  std::string id(24, '0');
  for (char& c : id) c = kHex[rng_() & 0xF];
  return id;
}

uint64_t HttpServer::Impl::random_seed() {
  std::lock_guard lock(rng_mutex_);
  return rng_();
}

uint64_t HttpServer::accept_errors() const {
  return impl_->accept_errors();
}

HttpServer::HttpServer(HttpServerConfig config, const tokenizer::Tokenizer& tokenizer, ModelInfo model,
                       std::vector<int32_t> eos_token_ids, InferenceService& service, ApiKeys keys)
    : impl_(std::make_unique<Impl>(std::move(config), tokenizer, std::move(model), std::move(eos_token_ids), service,
                                   std::move(keys))) {}

HttpServer::~HttpServer() = default;

Result<uint16_t> HttpServer::start() {
  return impl_->start();
}
void HttpServer::begin_drain() {
  impl_->begin_drain();
}
bool HttpServer::wait_idle(std::chrono::milliseconds timeout) {
  return impl_->wait_idle(timeout);
}
int64_t HttpServer::cut_in_flight(std::chrono::milliseconds grace) {
  return impl_->cut_in_flight(grace);
}
void HttpServer::stop() {
  impl_->stop();
}
int64_t HttpServer::in_flight() const {
  return impl_->in_flight();
}

}  // namespace deltaserve::router
