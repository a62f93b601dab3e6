#include "router/errors.hpp"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace deltaserve::router {
namespace {

TEST(ErrorsTest, MapsEveryKindAndStatus) {
  struct Case {
    ApiError error;
    unsigned status;
    std::string type;
    nlohmann::json code;
  };
  using Kind = ApiError::Kind;
  const Case cases[] = {
      {ApiError::invalid("temperature", "bad"), 400, "invalid_request_error", nullptr},
      {ApiError::from_status(out_of_range("x"), "prompt", "context_length_exceeded"), 400, "invalid_request_error",
       "context_length_exceeded"},
      {ApiError::from_status(not_found("m"), "model", "model_not_found"), 404, "invalid_request_error",
       "model_not_found"},
      {ApiError::from_status({StatusCode::kResourceExhausted, "full"}), 503, "server_error", "overloaded"},
      {ApiError::from_status({StatusCode::kUnavailable, "gone"}), 503, "server_error", "unavailable"},
      {ApiError::from_status(internal_error("bug")), 500, "server_error", "internal_error"},
      {ApiError::from_status({StatusCode::kDeadlineExceeded, "slow"}), 504, "server_error", "timeout"},
      {ApiError::of_kind(Kind::kUnauthorized, "no"), 401, "invalid_request_error", "invalid_api_key"},
      {ApiError::of_kind(Kind::kRouteNotFound, "no"), 404, "invalid_request_error", "not_found"},
      {ApiError::of_kind(Kind::kMethodNotAllowed, "no"), 405, "invalid_request_error", "method_not_allowed"},
      {ApiError::of_kind(Kind::kBodyTooLarge, "no"), 413, "invalid_request_error", "request_too_large"},
      {ApiError::of_kind(Kind::kHeaderTooLarge, "no"), 431, "invalid_request_error", "request_header_fields_too_large"},
  };
  for (const Case& c : cases) {
    const HttpError http = to_http_error(c.error);
    EXPECT_EQ(http.status, c.status) << http.body;
    const auto body = nlohmann::json::parse(http.body);
    ASSERT_TRUE(body.contains("error"));
    const auto& error = body["error"];
    EXPECT_EQ(error["type"], c.type) << http.body;
    EXPECT_EQ(error["code"], c.code) << http.body;
    EXPECT_TRUE(error["message"].is_string());
    EXPECT_TRUE(error.contains("param"));
  }
}

TEST(ErrorsTest, ExtraHeaders) {
  const HttpError unauthorized = to_http_error(ApiError::of_kind(ApiError::Kind::kUnauthorized, "no"));
  ASSERT_EQ(unauthorized.headers.size(), 1u);
  EXPECT_EQ(unauthorized.headers[0], (std::pair<std::string, std::string>{"WWW-Authenticate", "Bearer"}));
  const HttpError full = to_http_error(ApiError::from_status({StatusCode::kResourceExhausted, "full"}));
  ASSERT_EQ(full.headers.size(), 1u);
  EXPECT_EQ(full.headers[0], (std::pair<std::string, std::string>{"Retry-After", "1"}));
  ApiError method = ApiError::of_kind(ApiError::Kind::kMethodNotAllowed, "no");
  method.allow = "POST";
  EXPECT_EQ(to_http_error(method).headers[0], (std::pair<std::string, std::string>{"Allow", "POST"}));
  const auto body = nlohmann::json::parse(to_http_error(ApiError::invalid("stop", "bad", "invalid_type")).body);
  EXPECT_EQ(body["error"]["param"], "stop");
  EXPECT_EQ(body["error"]["code"], "invalid_type");
  EXPECT_EQ(body["error"]["message"], "bad");
}

TEST(ErrorsTest, InvalidUtf8InMessageStillSerializes) {
  const HttpError http = to_http_error(ApiError::invalid("", "bad \xff byte"));
  EXPECT_TRUE(nlohmann::json::accept(http.body));
}

}  // namespace
}  // namespace deltaserve::router
