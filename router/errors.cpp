#include "router/errors.hpp"

#include <algorithm>

#include <nlohmann/json.hpp>

namespace deltaserve::router {
namespace {

struct Mapping {
  unsigned status;
  const char* type;
  const char* default_code;  // nullptr = null
};

Mapping map(const ApiError& error) {
  using Kind = ApiError::Kind;
  switch (error.kind) {
    case Kind::kUnauthorized:
      return {401, "invalid_request_error", "invalid_api_key"};
    case Kind::kRouteNotFound:
      return {404, "invalid_request_error", "not_found"};
    case Kind::kMethodNotAllowed:
      return {405, "invalid_request_error", "method_not_allowed"};
    case Kind::kBodyTooLarge:
      return {413, "invalid_request_error", "request_too_large"};
    case Kind::kHeaderTooLarge:
      return {431, "invalid_request_error", "request_header_fields_too_large"};
    case Kind::kRateLimited:
      return {429, "requests", "rate_limit_exceeded"};
    case Kind::kStatus:
      break;
  }
  switch (error.status.code()) {
    case StatusCode::kInvalidArgument:
    case StatusCode::kOutOfRange:
    case StatusCode::kFailedPrecondition:
      return {400, "invalid_request_error", nullptr};
    case StatusCode::kNotFound:
      return {404, "invalid_request_error", "not_found"};
    case StatusCode::kResourceExhausted:
      return {503, "server_error", "overloaded"};
    case StatusCode::kUnavailable:
      return {503, "server_error", "unavailable"};
    case StatusCode::kDeadlineExceeded:
      return {504, "server_error", "timeout"};
    case StatusCode::kUnimplemented:
      return {501, "server_error", "unimplemented"};
    case StatusCode::kOk:  // an error built from OK is a bug in the caller; still answer sanely
    case StatusCode::kCancelled:
    case StatusCode::kDataLoss:
    case StatusCode::kIoError:
    case StatusCode::kInternal:
      break;
  }
  return {500, "server_error", "internal_error"};
}

nlohmann::json error_object(const ApiError& error, const Mapping& mapping) {
  nlohmann::json inner;
  inner["message"] =
      error.status.message().empty() ? std::string(status_code_name(error.status.code())) : error.status.message();
  inner["type"] = error.type.empty() ? std::string(mapping.type) : error.type;
  inner["param"] = error.param.empty() ? nlohmann::json(nullptr) : nlohmann::json(error.param);
  if (!error.code.empty()) {
    inner["code"] = error.code;
  } else if (mapping.default_code != nullptr) {
    inner["code"] = mapping.default_code;
  } else {
    inner["code"] = nullptr;
  }
  nlohmann::json outer;
  outer["error"] = std::move(inner);
  return outer;
}

}  // namespace

ApiError ApiError::invalid(std::string param, std::string message, std::string code) {
  ApiError error;
  error.status = invalid_argument(std::move(message));
  error.param = std::move(param);
  error.code = std::move(code);
  return error;
}

ApiError ApiError::from_status(Status status, std::string param, std::string code) {
  ApiError error;
  error.status = std::move(status);
  error.param = std::move(param);
  error.code = std::move(code);
  return error;
}

ApiError ApiError::of_kind(Kind kind, std::string message) {
  ApiError error;
  error.kind = kind;
  error.status = invalid_argument(std::move(message));
  return error;
}

ApiError ApiError::rate_limited(std::string message, std::string type, int64_t retry_after_seconds) {
  ApiError error;
  error.kind = Kind::kRateLimited;
  error.status = Status(StatusCode::kResourceExhausted, std::move(message));
  error.type = std::move(type);
  error.retry_after_seconds = std::max<int64_t>(retry_after_seconds, 1);
  return error;
}

HttpError to_http_error(const ApiError& error) {
  const Mapping mapping = map(error);
  HttpError out;
  out.status = mapping.status;
  out.body = error_object(error, mapping).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  if (error.kind == ApiError::Kind::kUnauthorized) out.headers.emplace_back("WWW-Authenticate", "Bearer");
  if (error.kind == ApiError::Kind::kMethodNotAllowed && !error.allow.empty()) {
    out.headers.emplace_back("Allow", error.allow);
  }
  if (error.retry_after_seconds > 0) {
    out.headers.emplace_back("Retry-After", std::to_string(error.retry_after_seconds));
  } else if (mapping.status == 503 || mapping.status == 429) {
    out.headers.emplace_back("Retry-After", "1");
  }
  return out;
}

std::string error_json(const ApiError& error) {
  return to_http_error(error).body;
}

}  // namespace deltaserve::router
