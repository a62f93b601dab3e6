// Drives a real HttpServer on 127.0.0.1:0 with a real HTTP client (Beast, and raw sockets for the limit
// tests) against a scripted InferenceService double.
#include "router/http_server.hpp"

#include <cmath>
#include <condition_variable>
#include <filesystem>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <utility>  // before Asio (stack.md §6.9)

#include <boost/asio/connect.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <sys/resource.h>
#include <unistd.h>

#include "router/fake_inference_service.hpp"
#include "router/prompt_encoding.hpp"
#include "router/router_test_util.hpp"
#include "telemetry/metrics.hpp"
#include "tokenizer/utf8.hpp"

namespace deltaserve::router {
namespace {

using testing::FakeService;
using testing::ScriptStep;

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;
using nlohmann::json;
using namespace std::chrono_literals;

// ---- the client --------------------------------------------------------------------------------------

struct Reply {
  unsigned status = 0;
  std::map<std::string, std::string> headers;  // lower-case names
  std::string body;                            // de-chunked
  std::vector<std::string> chunks;             // each chunk's body as it came on the wire
  std::string header(const std::string& name) const {
    const auto it = headers.find(name);
    return it == headers.end() ? "" : it->second;
  }
  json json_body() const { return json::parse(body); }
};

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

Reply read_reply(tcp::socket& socket, beast::flat_buffer& buffer) {
  http::response_parser<http::string_body> parser;
  parser.body_limit(boost::none);
  Reply reply;
  std::string current, joined;  // the chunk callback consumes the body: string_body stays empty
  auto on_body = [&](std::uint64_t remain, std::string_view body, beast::error_code&) -> std::size_t {
    current.append(body);
    joined.append(body);
    if (remain == body.size()) reply.chunks.push_back(std::exchange(current, {}));
    return body.size();
  };
  parser.on_chunk_body(on_body);
  http::read(socket, buffer, parser);
  reply.status = parser.get().result_int();
  for (const auto& field : parser.get()) reply.headers[lower(field.name_string())] = std::string(field.value());
  reply.body = parser.get().chunked() ? joined : parser.get().body();
  return reply;
}

class Client {
 public:
  explicit Client(uint16_t port) : socket_(ioc_) {
    socket_.connect(tcp::endpoint(net::ip::make_address("127.0.0.1"), port));
  }

  Reply send(http::verb method, const std::string& target, const std::string& body = "",
             const std::map<std::string, std::string>& headers = {}) {
    http::request<http::string_body> request{method, target, 11};
    request.set(http::field::host, "127.0.0.1");
    for (const auto& [name, value] : headers) request.set(name, value);
    if (method == http::verb::post) request.set(http::field::content_type, "application/json");
    request.body() = body;
    request.prepare_payload();
    http::write(socket_, request);
    return read_reply(socket_, buffer_);
  }
  tcp::socket& socket() { return socket_; }

 private:
  net::io_context ioc_;
  tcp::socket socket_;
  beast::flat_buffer buffer_;
};

// Reads whatever comes until the server closes (or no byte arrives for `timeout`).
std::string read_until_closed(tcp::socket& socket, std::chrono::milliseconds timeout) {
  timeval tv{static_cast<time_t>(timeout.count() / 1000), static_cast<suseconds_t>((timeout.count() % 1000) * 1000)};
  ::setsockopt(socket.native_handle(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  std::string out;
  char buffer[4096];
  for (;;) {
    const ssize_t n = ::recv(socket.native_handle(), buffer, sizeof(buffer), 0);
    if (n <= 0) break;
    out.append(buffer, static_cast<size_t>(n));
  }
  return out;
}

// Writes raw bytes, then reads whatever comes until the server closes (or `timeout`).
std::string raw_exchange(uint16_t port, const std::string& bytes, std::chrono::milliseconds timeout = 3000ms) {
  net::io_context ioc;
  tcp::socket socket(ioc);
  socket.connect(tcp::endpoint(net::ip::make_address("127.0.0.1"), port));
  net::write(socket, net::buffer(bytes));
  return read_until_closed(socket, timeout);
}

// Data fields of an SSE body, in order.
std::vector<std::string> sse_data(const std::string& body) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at < body.size()) {
    const size_t end = body.find("\n\n", at);
    if (end == std::string::npos) break;
    const std::string event = body.substr(at, end - at);
    EXPECT_EQ(event.rfind("data: ", 0), 0u) << event;
    out.push_back(event.substr(6));
    at = end + 2;
  }
  EXPECT_EQ(at, body.size()) << "trailing bytes after the last event";
  return out;
}

// ---- fixture -----------------------------------------------------------------------------------------

constexpr int64_t kContext = 256;
const std::vector<int32_t> kEos = {1026};

class HttpServerTest : public ::testing::Test {
 protected:
  void start(ApiKeys keys = ApiKeys::open(), HttpServerConfig config = {}) {
    config.port = 0;
    config.host = "127.0.0.1";
    server_ = std::make_unique<HttpServer>(config, testing::tiny_tokenizer(), ModelInfo{"tiny", kContext, 1700000000},
                                           kEos, service_, std::move(keys));
    auto port = server_->start();
    ASSERT_TRUE(port.is_ok()) << port.status().to_string();
    port_ = *port;
  }
  void TearDown() override {
    service_.release();
    if (server_) server_->stop();
  }
  Reply post(const std::string& target, const json& body, const std::map<std::string, std::string>& headers = {}) {
    Client client(port_);
    return client.send(http::verb::post, target, body.dump(), headers);
  }
  Reply get(const std::string& target) {
    Client client(port_);
    return client.send(http::verb::get, target);
  }
  static json chat_body(bool stream = false) {
    return {{"model", "tiny"}, {"messages", {{{"role", "user"}, {"content", "hi"}}}}, {"stream", stream}};
  }

  FakeService service_{testing::tiny_tokenizer()};
  std::unique_ptr<HttpServer> server_;
  uint16_t port_ = 0;
};

TEST_F(HttpServerTest, HealthReadyAndModels) {
  start();
  EXPECT_EQ(get("/health").status, 200u);
  const Reply ready = get("/ready");
  EXPECT_EQ(ready.status, 200u);
  service_.set_ready(false);
  const Reply not_ready = get("/ready");
  EXPECT_EQ(not_ready.status, 503u);
  EXPECT_EQ(not_ready.json_body()["reason"], "no decode worker");
  EXPECT_EQ(get("/health").status, 200u);
  const Reply models = get("/v1/models");
  EXPECT_EQ(models.status, 200u);
  EXPECT_EQ(models.header("content-type"), "application/json");
  EXPECT_EQ(models.json_body()["data"][0]["id"], "tiny");
  EXPECT_EQ(models.json_body()["data"][0]["max_model_len"], kContext);
}

TEST_F(HttpServerTest, UnknownPathAndWrongMethod) {
  start();
  const Reply missing = get("/v2/nothing");
  EXPECT_EQ(missing.status, 404u);
  EXPECT_EQ(missing.json_body()["error"]["code"], "not_found");
  const Reply wrong = get("/v1/chat/completions");
  EXPECT_EQ(wrong.status, 405u);
  EXPECT_EQ(wrong.header("allow"), "POST");
  EXPECT_EQ(wrong.json_body()["error"]["type"], "invalid_request_error");
}

TEST_F(HttpServerTest, ChatNonStreaming) {
  start();
  const Reply reply = post("/v1/chat/completions", chat_body());
  ASSERT_EQ(reply.status, 200u) << reply.body;
  EXPECT_EQ(reply.header("content-type"), "application/json");
  const json body = reply.json_body();
  EXPECT_EQ(body["id"].get<std::string>().rfind("chatcmpl-", 0), 0u);
  EXPECT_EQ(body["object"], "chat.completion");
  EXPECT_EQ(body["model"], "tiny");
  EXPECT_TRUE(body["created"].is_number_integer());
  EXPECT_EQ(body["choices"][0]["index"], 0);
  EXPECT_EQ(body["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(body["choices"][0]["message"]["content"], "Hello world");
  EXPECT_EQ(body["choices"][0]["finish_reason"], "stop");
  EXPECT_TRUE(body["choices"][0]["logprobs"].is_null());

  const auto submitted = service_.submitted();
  ASSERT_EQ(submitted.size(), 1u);
  const GenerationRequest& request = submitted[0];
  EXPECT_EQ(request.request_id, body["id"].get<std::string>() + "-0");
  EXPECT_EQ(request.tenant, "default");
  const auto expected_prompt =
      encode_chat_prompt(testing::tiny_tokenizer(), std::vector<tokenizer::ChatMessage>{{"user", "hi", {}}}, true);
  EXPECT_EQ(request.prompt, *expected_prompt);
  EXPECT_EQ(request.max_tokens, kContext - static_cast<int64_t>(request.prompt.size()));
  EXPECT_EQ(request.stop_token_ids, kEos);
  EXPECT_GT(request.arrival_ns, 0);

  const int64_t completion =
      static_cast<int64_t>(testing::tiny_tokenizer().encode("Hel", tokenizer::SpecialTokens::kNone).size() +
                           testing::tiny_tokenizer().encode("lo wor", tokenizer::SpecialTokens::kNone).size() +
                           testing::tiny_tokenizer().encode("ld", tokenizer::SpecialTokens::kNone).size());
  EXPECT_EQ(body["usage"]["prompt_tokens"], request.prompt.size());
  EXPECT_EQ(body["usage"]["completion_tokens"], completion);
  EXPECT_EQ(body["usage"]["total_tokens"], static_cast<int64_t>(request.prompt.size()) + completion);
  EXPECT_EQ(body["usage"]["prompt_tokens_details"]["cached_tokens"], 3);
}

TEST_F(HttpServerTest, CompletionsNonStreamingDefaultsAndKeepAlive) {
  start();
  Client client(port_);
  for (int i = 0; i < 2; ++i) {  // two requests on one connection
    const Reply reply = client.send(http::verb::post, "/v1/completions", R"({"model": "tiny", "prompt": "Once"})");
    ASSERT_EQ(reply.status, 200u) << reply.body;
    const json body = reply.json_body();
    EXPECT_EQ(body["id"].get<std::string>().rfind("cmpl-", 0), 0u);
    EXPECT_EQ(body["object"], "text_completion");
    EXPECT_EQ(body["choices"][0]["text"], "Hello world");
  }
  const auto submitted = service_.submitted();
  ASSERT_EQ(submitted.size(), 2u);
  EXPECT_EQ(submitted[0].max_tokens, 16);
  EXPECT_EQ(submitted[0].prompt.front(), *testing::tiny_tokenizer().bos_id());
  EXPECT_NE(submitted[0].sampling.seed, submitted[1].sampling.seed);  // random per request
}

TEST_F(HttpServerTest, ChatStreamingExactBytes) {
  start();
  const Reply reply = post("/v1/chat/completions", chat_body(true));
  ASSERT_EQ(reply.status, 200u) << reply.body;
  EXPECT_EQ(reply.header("content-type"), "text/event-stream");
  EXPECT_EQ(reply.header("transfer-encoding"), "chunked");
  const auto events = sse_data(reply.body);
  ASSERT_FALSE(events.empty());
  const json first = json::parse(events[0]);
  const std::string id = first["id"];
  const std::string created = std::to_string(first["created"].get<int64_t>());
  const std::string prefix = "data: {\"id\":\"" + id +
                             "\",\"object\":\"chat.completion.chunk\",\"created\":" + created +
                             ",\"model\":\"tiny\",\"choices\":[{\"index\":0,";
  const std::string expected =
      prefix +
      "\"delta\":{\"role\":\"assistant\",\"content\":\"Hel\"},\"logprobs\":null,\"finish_reason\":null}]}\n\n" +
      prefix + "\"delta\":{\"content\":\"lo wor\"},\"logprobs\":null,\"finish_reason\":null}]}\n\n" + prefix +
      "\"delta\":{\"content\":\"ld\"},\"logprobs\":null,\"finish_reason\":\"stop\"}]}\n\n" + "data: [DONE]\n\n";
  EXPECT_EQ(reply.body, expected);
}

TEST_F(HttpServerTest, StreamingTwoChoicesInterleaved) {
  start();
  json body = chat_body(true);
  body["n"] = 2;
  body["seed"] = 41;
  const Reply reply = post("/v1/chat/completions", body);
  ASSERT_EQ(reply.status, 200u) << reply.body;
  const auto events = sse_data(reply.body);
  ASSERT_EQ(events.back(), "[DONE]");
  std::map<int, std::string> text;
  std::map<int, int> finished, roles;
  for (size_t i = 0; i + 1 < events.size(); ++i) {
    const json event = json::parse(events[i]);
    const json& choice = event["choices"][0];
    const int index = choice["index"];
    if (choice["delta"].contains("role")) {
      EXPECT_EQ(roles[index], 0) << "role only on the first chunk of a choice";
      ++roles[index];
    } else {
      EXPECT_EQ(roles[index], 1) << "the first chunk of a choice carries the role";
    }
    if (choice["delta"].contains("content")) text[index] += choice["delta"]["content"].get<std::string>();
    if (!choice["finish_reason"].is_null()) ++finished[index];
  }
  EXPECT_EQ(text[0], "Hello world");
  EXPECT_EQ(text[1], "Hello world");
  EXPECT_EQ(finished[0], 1);
  EXPECT_EQ(finished[1], 1);
  const auto submitted = service_.submitted();
  ASSERT_EQ(submitted.size(), 2u);
  std::set<uint64_t> seeds = {submitted[0].sampling.seed, submitted[1].sampling.seed};
  EXPECT_EQ(seeds, (std::set<uint64_t>{41, 42}));
  std::set<std::string> ids = {submitted[0].request_id, submitted[1].request_id};
  const std::string id = json::parse(events[0])["id"];
  EXPECT_EQ(ids, (std::set<std::string>{id + "-0", id + "-1"}));
}

TEST_F(HttpServerTest, NonStreamingTwoChoices) {
  start();
  json body = chat_body();
  body["n"] = 2;
  const Reply reply = post("/v1/chat/completions", body);
  ASSERT_EQ(reply.status, 200u) << reply.body;
  const json parsed = reply.json_body();
  ASSERT_EQ(parsed["choices"].size(), 2u);
  EXPECT_EQ(parsed["choices"][1]["index"], 1);
  EXPECT_EQ(parsed["choices"][1]["message"]["content"], "Hello world");
  const int64_t prompt = parsed["usage"]["prompt_tokens"];
  EXPECT_EQ(prompt, static_cast<int64_t>(service_.submitted()[0].prompt.size()));  // counted once
}

TEST_F(HttpServerTest, IncludeUsageChunk) {
  start();
  json body = chat_body(true);
  body["stream_options"] = {{"include_usage", true}};
  const Reply reply = post("/v1/chat/completions", body);
  const auto events = sse_data(reply.body);
  ASSERT_GE(events.size(), 3u);
  EXPECT_EQ(events.back(), "[DONE]");
  const json usage = json::parse(events[events.size() - 2]);
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_GT(usage["usage"]["completion_tokens"].get<int64_t>(), 0);
  EXPECT_EQ(usage["usage"]["prompt_tokens_details"]["cached_tokens"], 3);
  for (size_t i = 0; i + 2 < events.size(); ++i) EXPECT_TRUE(json::parse(events[i])["usage"].is_null());
}

TEST_F(HttpServerTest, LogprobShapesOverHttp) {
  start();
  json chat = chat_body(true);
  chat["logprobs"] = true;
  chat["top_logprobs"] = 2;
  const auto events = sse_data(post("/v1/chat/completions", chat).body);
  const json first = json::parse(events[0]);
  const json& content = first["choices"][0]["logprobs"]["content"];
  ASSERT_FALSE(content.empty());
  for (const char* key : {"token", "logprob", "bytes", "top_logprobs"}) EXPECT_TRUE(content[0].contains(key)) << key;
  EXPECT_EQ(content[0]["top_logprobs"].size(), 2u);
  EXPECT_EQ(service_.submitted()[0].sampling.top_logprobs, 2);

  const Reply completion =
      post("/v1/completions", {{"model", "tiny"}, {"prompt", "x"}, {"logprobs", 3}, {"max_tokens", 5}});
  ASSERT_EQ(completion.status, 200u) << completion.body;
  const json completion_body = completion.json_body();
  const json& logprobs = completion_body["choices"][0]["logprobs"];
  const size_t count = logprobs["tokens"].size();
  EXPECT_GT(count, 0u);
  EXPECT_EQ(logprobs["token_logprobs"].size(), count);
  EXPECT_EQ(logprobs["top_logprobs"].size(), count);
  EXPECT_EQ(logprobs["text_offset"].size(), count);
  EXPECT_EQ(logprobs["text_offset"][0], 0);
}

TEST_F(HttpServerTest, Utf8NeverSplitOnTheWire) {
  start();
  service_.set_script({{"При", {}}, {"вет, ", {}}, {"мир 🌍", {}}, {"!", "stop"}});
  const Reply reply = post("/v1/chat/completions", chat_body(true));
  ASSERT_GE(reply.chunks.size(), 1u);  // chunks that arrive together share one wire chunk
  std::string text;
  for (const std::string& chunk : reply.chunks) EXPECT_TRUE(tokenizer::is_valid_utf8(chunk)) << chunk;
  for (const auto& event : sse_data(reply.body)) {
    if (event == "[DONE]") continue;
    const json parsed = json::parse(event);
    if (parsed["choices"][0]["delta"].contains("content")) text += parsed["choices"][0]["delta"]["content"];
  }
  EXPECT_EQ(text, "Привет, мир 🌍!");
}

TEST_F(HttpServerTest, ValidationErrorsOverHttp) {
  start();
  struct Case {
    std::string target, body;
    unsigned status;
    std::string param, code;
  };
  const std::string msgs = R"("messages": [{"role": "user", "content": "hi"}])";
  const Case cases[] = {
      {"/v1/chat/completions", "{bad", 400, "", "invalid_json"},
      {"/v1/chat/completions", "{\"model\": \"tiny\xc3\"}", 400, "", "invalid_utf8"},
      {"/v1/chat/completions", R"({"model": "tiny", "messages": 1})", 400, "messages", "invalid_type"},
      {"/v1/chat/completions", R"({"model": "tiny", )" + msgs + R"(, "temperature": 3})", 400, "temperature",
       "invalid_value"},
      {"/v1/chat/completions", R"({"model": "tiny", )" + msgs + R"(, "top_p": 1.5})", 400, "top_p", "invalid_value"},
      {"/v1/chat/completions", R"({"model": "other", )" + msgs + "}", 404, "model", "model_not_found"},
      {"/v1/chat/completions", R"({"model": "tiny", )" + msgs + R"(, "max_tokens": 1000})", 400, "messages",
       "context_length_exceeded"},
      {"/v1/completions", R"({"model": "tiny", "prompt": "x", "max_tokens": 256})", 400, "prompt",
       "context_length_exceeded"},
      {"/v1/completions", R"({"model": "tiny", "prompt": [5, 99999]})", 400, "prompt", "invalid_value"},
      {"/v1/completions", R"({"model": "tiny", "prompt": "x", "presence_penalty": 1})", 400, "presence_penalty",
       "invalid_value"},
  };
  for (const Case& c : cases) {
    Client client(port_);
    const Reply reply = client.send(http::verb::post, c.target, c.body);
    EXPECT_EQ(reply.status, c.status) << c.body << " → " << reply.body;
    const json body = reply.json_body();
    EXPECT_EQ(body["error"]["type"], "invalid_request_error") << reply.body;
    if (c.param.empty()) {
      EXPECT_TRUE(body["error"]["param"].is_null()) << reply.body;
    } else {
      EXPECT_EQ(body["error"]["param"], c.param) << reply.body;
    }
    EXPECT_EQ(body["error"]["code"], c.code) << reply.body;
  }
  EXPECT_TRUE(service_.submitted().empty());  // no model work for bad input
}

TEST_F(HttpServerTest, BodyTooLargeDecidedFromContentLength) {
  HttpServerConfig config;
  config.max_body_bytes = 1024;
  start(ApiKeys::open(), config);
  // Only the head is sent; the answer must come without the body.
  const std::string response = raw_exchange(port_,
                                            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                                            "application/json\r\nContent-Length: 1000000000\r\n\r\n");
  EXPECT_EQ(response.rfind("HTTP/1.1 413", 0), 0u) << response;
  EXPECT_NE(response.find("request_too_large"), std::string::npos);
  // A chunked body that grows past the limit.
  const std::string chunk(800, 'x');
  const std::string chunked = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n320\r\n" +
                              chunk + "\r\n320\r\n" + chunk + "\r\n0\r\n\r\n";
  EXPECT_EQ(raw_exchange(port_, chunked).rfind("HTTP/1.1 413", 0), 0u);
}

TEST_F(HttpServerTest, HeadersTooLarge) {
  HttpServerConfig config;
  config.max_header_bytes = 2048;
  start(ApiKeys::open(), config);
  const std::string response =
      raw_exchange(port_, "GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + std::string(4096, 'a') + "\r\n\r\n");
  EXPECT_EQ(response.rfind("HTTP/1.1 431", 0), 0u) << response.substr(0, 200);
}

TEST_F(HttpServerTest, SlowlorisClosedAtHeaderTimeout) {
  HttpServerConfig config;
  config.header_timeout = 200ms;
  start(ApiKeys::open(), config);
  const auto begin = std::chrono::steady_clock::now();
  const std::string response = raw_exchange(port_, "GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: a", 5000ms);
  EXPECT_EQ(response, "");
  EXPECT_LT(std::chrono::steady_clock::now() - begin, 3000ms);
}

TEST_F(HttpServerTest, ApiKeysRequired) {
  auto keys =
      ApiKeys::parse(R"({"tenants": [{"name": "acme", "api_key_sha256": ")" + sha256_hex("sk-acme") + "\"}]}", "keys");
  ASSERT_TRUE(keys.is_ok());
  start(std::move(keys).value());
  for (const auto& headers : std::vector<std::map<std::string, std::string>>{
           {}, {{"Authorization", "Bearer sk-wrong"}}, {{"Authorization", "Basic sk-acme"}}}) {
    const Reply reply = post("/v1/chat/completions", chat_body(), headers);
    EXPECT_EQ(reply.status, 401u);
    EXPECT_EQ(reply.header("www-authenticate"), "Bearer");
    EXPECT_EQ(reply.json_body()["error"]["code"], "invalid_api_key");
    EXPECT_EQ(reply.json_body()["error"]["type"], "invalid_request_error");
    EXPECT_EQ(reply.body.find("sk-"), std::string::npos);  // the key is never echoed
  }
  EXPECT_EQ(get("/health").status, 200u);  // probes need no key
  EXPECT_EQ(get("/v1/models").status, 401u);
  const Reply ok = post("/v1/chat/completions", chat_body(), {{"Authorization", "Bearer sk-acme"}});
  EXPECT_EQ(ok.status, 200u) << ok.body;
  ASSERT_EQ(service_.submitted().size(), 1u);
  EXPECT_EQ(service_.submitted()[0].tenant, "acme");
}

// ---- admission limits -------------------------------------------------------------------------------

ApiKeys keys_with_limits(const std::string& limits) {
  auto keys = ApiKeys::parse(R"({"tenants": [{"name": "acme", "api_key_sha256": ")" + sha256_hex("sk-acme") +
                                 R"(", "limits": )" + limits + R"(}, {"name": "globex", "api_key_sha256": ")" +
                                 sha256_hex("sk-globex") + R"("}]})",
                             "keys");
  if (!keys.is_ok()) ADD_FAILURE() << keys.status().to_string();
  return std::move(keys).value();
}

const std::map<std::string, std::string> kAcme = {{"Authorization", "Bearer sk-acme"}};
const std::map<std::string, std::string> kGlobex = {{"Authorization", "Bearer sk-globex"}};

TEST_F(HttpServerTest, RequestsPerSecondOverTheLimitIs429WithRetryAfter) {
  auto now = std::make_shared<std::chrono::steady_clock::time_point>(std::chrono::hours(1));
  HttpServerConfig config;
  config.admission_clock = [now] { return *now; };
  start(keys_with_limits(R"({"requests_per_second": 0.5, "priority": "high"})"), config);
  const Reply first = post("/v1/chat/completions", chat_body(), kAcme);
  ASSERT_EQ(first.status, 200u) << first.body;
  for (const bool stream : {false, true}) {
    const Reply refused = post("/v1/chat/completions", chat_body(stream), kAcme);
    EXPECT_EQ(refused.status, 429u) << refused.body;
    EXPECT_EQ(refused.header("retry-after"), "2");  // one request per 2 s
    EXPECT_EQ(refused.header("content-type"), "application/json");
    const json error = refused.json_body()["error"];
    EXPECT_EQ(error["type"], "requests");
    EXPECT_EQ(error["code"], "rate_limit_exceeded");
    EXPECT_TRUE(error["param"].is_null());
    EXPECT_NE(error["message"].get<std::string>().find("requests per second"), std::string::npos);
    EXPECT_EQ(refused.body.find("sk-"), std::string::npos);
  }
  EXPECT_EQ(post("/v1/chat/completions", chat_body(), kGlobex).status, 200u);  // another tenant is not limited
  *now += std::chrono::seconds(2);
  EXPECT_EQ(post("/v1/chat/completions", chat_body(), kAcme).status, 200u);
  const auto submitted = service_.submitted();
  ASSERT_EQ(submitted.size(), 3u);  // refused requests never reach the service
  EXPECT_EQ(submitted[0].priority, Priority::kHigh);
  EXPECT_EQ(submitted[1].tenant, "globex");
  EXPECT_EQ(submitted[1].priority, Priority::kNormal);
}

TEST_F(HttpServerTest, TokensPerMinuteChargesWhatWasGenerated) {
  auto now = std::make_shared<std::chrono::steady_clock::time_point>(std::chrono::hours(1));
  HttpServerConfig config;
  config.admission_clock = [now] { return *now; };
  start(keys_with_limits(R"({"tokens_per_minute": 200})"), config);
  const json body = {{"model", "tiny"}, {"prompt", {5}}, {"max_tokens", 150}};  // reserves 1 + 150
  const Reply first = post("/v1/completions", body, kAcme);
  ASSERT_EQ(first.status, 200u) << first.body;
  const int64_t used = first.json_body()["usage"]["total_tokens"].get<int64_t>();
  ASSERT_LE(used, 24);  // the script is short: what it did not use comes back
  const Reply second = post("/v1/completions", body, kAcme);
  ASSERT_EQ(second.status, 200u) << second.body;  // 200 − used ≥ 151 only with the refund
  // Now 200 − 2 × used are left: a request reserving all 200 waits for the rest to refill at 200/60 per second.
  json whole = body;
  whole["max_tokens"] = 199;
  const Reply refused = post("/v1/completions", whole, kAcme);
  EXPECT_EQ(refused.status, 429u) << refused.body;
  EXPECT_EQ(refused.json_body()["error"]["type"], "tokens");
  EXPECT_EQ(refused.json_body()["error"]["code"], "rate_limit_exceeded");
  const auto expected_wait = static_cast<int64_t>(std::ceil(static_cast<double>(2 * used) / (200.0 / 60.0)));
  EXPECT_EQ(refused.header("retry-after"), std::to_string(std::max<int64_t>(expected_wait, 1)));
  EXPECT_EQ(service_.submitted().size(), 2u);
}

TEST_F(HttpServerTest, MaxConcurrentHoldsUntilTheFinalChunk) {
  start(keys_with_limits(R"({"max_concurrent": 1})"));
  service_.set_mode(FakeService::Mode::kHang);
  Client streaming(port_);
  http::request<http::string_body> request{http::verb::post, "/v1/chat/completions", 11};
  request.set(http::field::host, "x");
  request.set(http::field::authorization, "Bearer sk-acme");
  request.body() = chat_body(true).dump();
  request.prepare_payload();
  http::write(streaming.socket(), request);
  char byte;
  net::read(streaming.socket(), net::buffer(&byte, 1));  // the stream is running
  const Reply refused = post("/v1/chat/completions", chat_body(), kAcme);
  EXPECT_EQ(refused.status, 429u) << refused.body;
  EXPECT_EQ(refused.header("retry-after"), "1");
  EXPECT_EQ(refused.json_body()["error"]["type"], "requests");
  service_.release();  // the stream finishes
  beast::flat_buffer buffer;
  buffer.commit(net::buffer_copy(buffer.prepare(1), net::buffer(&byte, 1)));
  const Reply finished = read_reply(streaming.socket(), buffer);
  EXPECT_EQ(finished.status, 200u);
  service_.set_mode(FakeService::Mode::kScript);
  EXPECT_EQ(post("/v1/chat/completions", chat_body(), kAcme).status, 200u);
}

// ---- prompt size and tokenization off the I/O threads -----------------------------------------------

TEST_F(HttpServerTest, PromptOverTheByteCapIsRefusedWithoutTokenizing) {
  auto tokenized = std::make_shared<std::atomic<int>>(0);
  HttpServerConfig config;
  config.before_tokenize = [tokenized] { ++*tokenized; };
  start(ApiKeys::open(), config);  // the cap: 16 bytes × 256 tokens of context
  const std::string huge(16 * kContext + 1, 'a');
  json chat = chat_body();
  chat["messages"][0]["content"] = huge;
  const Reply refused_chat = post("/v1/chat/completions", chat);
  EXPECT_EQ(refused_chat.status, 400u) << refused_chat.body;
  EXPECT_EQ(refused_chat.json_body()["error"]["code"], "context_length_exceeded");
  EXPECT_EQ(refused_chat.json_body()["error"]["param"], "messages");
  EXPECT_EQ(refused_chat.json_body()["error"]["type"], "invalid_request_error");
  const Reply refused_completion = post("/v1/completions", {{"model", "tiny"}, {"prompt", huge}});
  EXPECT_EQ(refused_completion.status, 400u) << refused_completion.body;
  EXPECT_EQ(refused_completion.json_body()["error"]["param"], "prompt");
  EXPECT_EQ(tokenized->load(), 0);  // neither reached the tokenizer
  EXPECT_TRUE(service_.submitted().empty());
  EXPECT_EQ(post("/v1/chat/completions", chat_body()).status, 200u);
  EXPECT_EQ(tokenized->load(), 1);

  // An explicit cap replaces the derived one.
  server_->stop();
  config.max_prompt_bytes = 8;
  start(ApiKeys::open(), config);
  EXPECT_EQ(post("/v1/completions", {{"model", "tiny"}, {"prompt", "123456789"}}).status, 400u);
  EXPECT_EQ(post("/v1/completions", {{"model", "tiny"}, {"prompt", "12345678"}}).status, 200u);
}

TEST_F(HttpServerTest, HealthAnswersWhileATokenizationIsHeld) {
  // One Asio thread: were the prompt tokenized on it, /health could not be answered until it ends.
  struct Gate {
    std::mutex mutex;
    std::condition_variable cv;
    bool entered = false, open = false;
  };
  auto gate = std::make_shared<Gate>();
  HttpServerConfig config;
  config.threads = 1;
  config.before_tokenize = [gate] {
    std::unique_lock lock(gate->mutex);
    gate->entered = true;
    gate->cv.notify_all();
    gate->cv.wait(lock, [&] { return gate->open; });
  };
  start(ApiKeys::open(), config);
  Reply held;
  std::thread request([&] { held = post("/v1/chat/completions", chat_body()); });
  {
    std::unique_lock lock(gate->mutex);
    ASSERT_TRUE(gate->cv.wait_for(lock, 10s, [&] { return gate->entered; }));
  }
  // Raw recv with a receive timeout: a stalled server fails the test instead of hanging it.
  const std::string health =
      raw_exchange(port_, "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 10000ms);
  EXPECT_EQ(health.rfind("HTTP/1.1 200", 0), 0u) << health;
  {
    std::lock_guard lock(gate->mutex);
    EXPECT_TRUE(service_.submitted().empty());  // the held request is still tokenizing
    gate->open = true;
    gate->cv.notify_all();
  }
  request.join();
  EXPECT_EQ(held.status, 200u) << held.body;
  EXPECT_EQ(service_.submitted().size(), 1u);
}

TEST_F(HttpServerTest, MetricsOnTheApiPortNeedAKeyWhenKeysAreOn) {
  HttpServerConfig config;
  config.metrics = std::make_shared<telemetry::Metrics>(telemetry::MetricsOptions{"tiny", "serve", 16});
  start(keys_with_limits("{}"), config);
  ASSERT_EQ(post("/v1/chat/completions", chat_body(), kAcme).status, 200u);  // acme's traffic is in the series
  for (const auto& headers :
       std::vector<std::map<std::string, std::string>>{{}, {{"Authorization", "Bearer sk-wrong"}}}) {
    Client client(port_);
    const Reply refused = client.send(http::verb::get, "/metrics", "", headers);
    EXPECT_EQ(refused.status, 401u);
    EXPECT_EQ(refused.header("www-authenticate"), "Bearer");
    EXPECT_EQ(refused.body.find("acme"), std::string::npos);
  }
  Client client(port_);
  const Reply scraped = client.send(http::verb::get, "/metrics", "", kGlobex);
  EXPECT_EQ(scraped.status, 200u);
  EXPECT_EQ(scraped.header("content-type"), telemetry::Metrics::kContentType);
  EXPECT_NE(scraped.body.find("acme"), std::string::npos);  // a key holder (the operator's scraper) sees tenants

  // Without keys there are no tenants to hide: /metrics stays open.
  server_->stop();
  start(ApiKeys::open(), config);
  EXPECT_EQ(get("/metrics").status, 200u);
}

TEST_F(HttpServerTest, QueueFullIs503WithRetryAfter) {
  start();
  service_.set_mode(FakeService::Mode::kReject);
  for (const bool stream : {false, true}) {
    const Reply reply = post("/v1/chat/completions", chat_body(stream));
    EXPECT_EQ(reply.status, 503u) << reply.body;
    EXPECT_EQ(reply.header("retry-after"), "1");
    EXPECT_EQ(reply.header("content-type"), "application/json");
    EXPECT_EQ(reply.json_body()["error"]["type"], "server_error");
  }
}

TEST_F(HttpServerTest, FailureAfterFirstByteIsAnSseErrorEvent) {
  start();
  service_.set_mode(FakeService::Mode::kFailLater);
  Client client(port_);
  http::request<http::string_body> request{http::verb::post, "/v1/chat/completions", 11};
  request.set(http::field::host, "x");
  request.body() = chat_body(true).dump();
  request.prepare_payload();
  http::write(client.socket(), request);
  beast::flat_buffer buffer;
  http::response_parser<http::string_body> parser;
  http::read_header(client.socket(), buffer, parser);  // the head goes out with the first event
  EXPECT_EQ(parser.get().result_int(), 200u);
  service_.release();  // now the service fails
  std::string body;
  auto on_body = [&](std::uint64_t, std::string_view data, beast::error_code&) -> std::size_t {
    body.append(data);
    return data.size();
  };
  parser.on_chunk_body(on_body);
  http::read(client.socket(), buffer, parser);
  const auto events = sse_data(body);
  ASSERT_EQ(events.size(), 2u) << body;
  const json error = json::parse(events[1]);
  EXPECT_EQ(error["error"]["type"], "server_error");
  EXPECT_EQ(error["error"]["message"], "decode worker lost");
  ASSERT_EQ(service_.submitted().size(), 1u);
}

TEST_F(HttpServerTest, ClientDisconnectCancelsEveryChoice) {
  start();
  service_.set_mode(FakeService::Mode::kHang);
  for (const bool stream : {true, false}) {
    {
      Client client(port_);
      json body = chat_body(stream);
      body["n"] = 2;
      http::request<http::string_body> request{http::verb::post, "/v1/chat/completions", 11};
      request.set(http::field::host, "x");
      request.body() = body.dump();
      request.prepare_payload();
      http::write(client.socket(), request);
      if (stream) {  // wait for the first bytes of the stream, then hang up
        char byte;
        net::read(client.socket(), net::buffer(&byte, 1));
      } else {
        std::this_thread::sleep_for(100ms);
      }
    }  // closes the socket
    const auto submitted = service_.submitted();
    ASSERT_GE(submitted.size(), 2u);
    for (size_t i = submitted.size() - 2; i < submitted.size(); ++i) {
      EXPECT_TRUE(service_.wait_cancelled(submitted[i].request_id, 5000ms)) << submitted[i].request_id;
    }
  }
  const auto deadline = std::chrono::steady_clock::now() + 5s;
  while (server_->in_flight() > 0 && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(5ms);
  EXPECT_EQ(server_->in_flight(), 0);
}

TEST_F(HttpServerTest, DrainFinishesInFlightAndRefusesNew) {
  start();
  service_.set_mode(FakeService::Mode::kHang);
  Reply streamed;
  std::thread in_flight([&] { streamed = post("/v1/chat/completions", chat_body(true)); });
  const auto deadline = std::chrono::steady_clock::now() + 5s;
  while (service_.submitted().empty() && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(2ms);
  ASSERT_EQ(service_.submitted().size(), 1u);
  server_->begin_drain();
  const Reply ready = get("/ready");
  EXPECT_EQ(ready.status, 503u);
  EXPECT_EQ(ready.json_body()["reason"], "draining");
  const Reply refused = post("/v1/chat/completions", chat_body());
  EXPECT_EQ(refused.status, 503u);
  EXPECT_EQ(refused.header("retry-after"), "1");
  EXPECT_EQ(get("/health").status, 200u);
  EXPECT_FALSE(server_->wait_idle(50ms));
  service_.release();
  in_flight.join();
  EXPECT_EQ(streamed.status, 200u);
  const auto events = sse_data(streamed.body);
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events.back(), "[DONE]");
  EXPECT_TRUE(server_->wait_idle(5000ms));
  EXPECT_EQ(service_.submitted().size(), 1u);
}

TEST_F(HttpServerTest, DrainTimeoutCutsStreamsWithAnErrorEventAndOthersWith503) {
  start();
  service_.set_mode(FakeService::Mode::kHang);
  Reply streamed, plain;
  std::thread stream_thread([&] { streamed = post("/v1/chat/completions", chat_body(true)); });
  std::thread plain_thread([&] { plain = post("/v1/chat/completions", chat_body(false)); });
  const auto deadline = std::chrono::steady_clock::now() + 5s;
  while (service_.submitted().size() < 2 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(2ms);
  }
  ASSERT_EQ(service_.submitted().size(), 2u);
  server_->begin_drain();
  EXPECT_FALSE(server_->wait_idle(50ms));
  EXPECT_EQ(server_->cut_in_flight(5000ms), 2);  // both were dropped
  stream_thread.join();
  plain_thread.join();
  EXPECT_EQ(server_->in_flight(), 0);

  EXPECT_EQ(streamed.status, 200u);  // the head went out with the first event
  const auto events = sse_data(streamed.body);
  ASSERT_GE(events.size(), 3u) << streamed.body;
  const json error = json::parse(events[events.size() - 2]);
  EXPECT_EQ(error["error"]["type"], "server_error");
  EXPECT_EQ(error["error"]["code"], "unavailable");
  EXPECT_TRUE(error["error"]["param"].is_null());
  EXPECT_NE(error["error"]["message"].get<std::string>().find("drain"), std::string::npos);
  EXPECT_EQ(events.back(), "[DONE]");

  EXPECT_EQ(plain.status, 503u) << plain.body;
  EXPECT_EQ(plain.header("retry-after"), "1");
  EXPECT_EQ(plain.json_body()["error"]["code"], "unavailable");
  for (const GenerationRequest& request : service_.submitted()) {
    EXPECT_TRUE(service_.wait_cancelled(request.request_id, 5000ms)) << request.request_id;
  }
}

TEST_F(HttpServerTest, CutWithNothingInFlightDropsNothing) {
  start();
  EXPECT_EQ(post("/v1/chat/completions", chat_body()).status, 200u);
  server_->begin_drain();
  EXPECT_TRUE(server_->wait_idle(5000ms));
  EXPECT_EQ(server_->cut_in_flight(0ms), 0);
}

TEST_F(HttpServerTest, StopWithOpenStreamCancelsIt) {
  start();
  service_.set_mode(FakeService::Mode::kHang);
  Client client(port_);
  http::request<http::string_body> request{http::verb::post, "/v1/chat/completions", 11};
  request.set(http::field::host, "x");
  request.body() = chat_body(true).dump();
  request.prepare_payload();
  http::write(client.socket(), request);
  char byte;
  net::read(client.socket(), net::buffer(&byte, 1));
  server_->stop();
  ASSERT_EQ(service_.submitted().size(), 1u);
  EXPECT_TRUE(service_.was_cancelled(service_.submitted()[0].request_id));
}

TEST_F(HttpServerTest, StartFailsOnBusyPort) {
  start();
  HttpServerConfig config;
  config.port = port_;
  HttpServer second(config, testing::tiny_tokenizer(), ModelInfo{"tiny", kContext, 0}, kEos, service_, ApiKeys::open());
  const auto result = second.start();
  ASSERT_FALSE(result.is_ok());
  EXPECT_NE(result.status().message().find(std::to_string(port_)), std::string::npos);
}

}  // namespace
}  // namespace deltaserve::router

namespace deltaserve::router {
namespace {

// Open connections are capped: one over the cap is answered 503 + Retry-After and closed; when a connection
// ends, a new one is served again.
TEST_F(HttpServerTest, ConnectionsOverTheCapAreAnswered503AndClosed) {
  HttpServerConfig config;
  config.max_connections = 2;
  start(ApiKeys::open(), config);
  auto first = std::make_unique<Client>(port_);
  Client second(port_);
  ASSERT_EQ(first->send(http::verb::get, "/health").status, 200);  // both accepted and held open (keep-alive)
  ASSERT_EQ(second.send(http::verb::get, "/health").status, 200);
  const std::string refused = raw_exchange(port_, "GET /health HTTP/1.1\r\nHost: x\r\n\r\n", 10000ms);
  EXPECT_EQ(refused.rfind("HTTP/1.1 503", 0), 0u) << refused;
  EXPECT_NE(refused.find("Retry-After: 1"), std::string::npos) << refused;
  EXPECT_NE(refused.find("open connections"), std::string::npos) << refused;
  first.reset();  // the server sees the close and the session ends
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  int status = 0;
  while (std::chrono::steady_clock::now() < deadline && status != 200) {
    const std::string reply =
        raw_exchange(port_, "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 10000ms);
    status = reply.rfind("HTTP/1.1 200", 0) == 0 ? 200 : 503;
    if (status != 200) std::this_thread::sleep_for(20ms);
  }
  EXPECT_EQ(status, 200) << "a freed connection slot was never reused";
}

// Takes every free descriptor number up to the highest open one and returns them (to be closed); a limit of
// that number + 1 then leaves the process no descriptor at all.
std::vector<int> fill_descriptor_table(int& highest) {
  highest = 0;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
    highest = std::max(highest, std::stoi(entry.path().filename().string()));
  }
  std::vector<int> fillers;
  for (;;) {
    const int fd = ::open("/dev/null", O_RDONLY);
    if (fd < 0) break;
    if (fd > highest) {
      ::close(fd);
      break;
    }
    fillers.push_back(fd);
  }
  return fillers;
}

// With the file table full, accept fails at once every time. The server backs off (50 ms doubling to 1 s)
// instead of spinning, and serves the waiting connection once descriptors are free again.
TEST_F(HttpServerTest, AcceptErrorsBackOffAndRecover) {
#if defined(__SANITIZE_ADDRESS__)
  // The sanitizer runtimes open /proc/self/maps to look up types and report; in a process with no free
  // descriptor they fail themselves (seen as a bogus "invalid vptr"), not the server. The release suite runs it.
  GTEST_SKIP() << "needs a process whose descriptor table can be filled; sanitizer runtimes need descriptors";
#endif
  HttpServerConfig config;
  config.threads = 1;
  start(ApiKeys::open(), config);
  rlimit original{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &original), 0);
  net::io_context ioc;
  tcp::socket client(ioc);
  client.open(tcp::v4());  // takes its descriptor before the table is closed
  int highest = 0;
  const std::vector<int> fillers = fill_descriptor_table(highest);
  rlimit full = original;
  full.rlim_cur = static_cast<rlim_t>(highest + 1);  // no descriptor left for the server's accept
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &full), 0);
  client.connect(tcp::endpoint(net::ip::make_address("127.0.0.1"), port_));  // completes in the backlog
  const std::string request = "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
  net::write(client, net::buffer(request));
  // Wait until accept has failed a few times, then for two more seconds: a spinning loop fails thousands of
  // times a second; with the backoff there are about log2(1000/50) + 2 failures in the first two seconds.
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  while (server_->accept_errors() < 2 && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(10ms);
  ASSERT_GE(server_->accept_errors(), 2u) << "accept never failed: the descriptor limit did not bite";
  const uint64_t before = server_->accept_errors();
  std::this_thread::sleep_for(2s);
  const uint64_t during = server_->accept_errors() - before;
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &original), 0);
  for (int fd : fillers) ::close(fd);
  EXPECT_LE(during, 6u) << "accept retried without backing off";
  // Descriptors are back: the waiting connection is accepted within one backoff and answered.
  const std::string reply = read_until_closed(client, 20s);
  EXPECT_EQ(reply.rfind("HTTP/1.1 200", 0), 0u) << reply;
}

}  // namespace
}  // namespace deltaserve::router
