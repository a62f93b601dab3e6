// Every way an HTTP request can fail, and THE one function that turns a failure into an HTTP status
// and an OpenAI error object:
//   {"error": {"message": "...", "type": "...", "param": "..." | null, "code": "..." | null}}
//
// Mapping (to_http_error):
//   kStatus + kInvalidArgument / kOutOfRange / kFailedPrecondition   400 invalid_request_error
//   kStatus + kNotFound                                              404 invalid_request_error
//   kStatus + kResourceExhausted / kUnavailable                      503 server_error, Retry-After: 1
//   kStatus + kDeadlineExceeded                                      504 server_error
//   kStatus + kUnimplemented                                         501 server_error
//   kStatus + anything else (kInternal, kIoError, kDataLoss, ...)    500 server_error
//   kUnauthorized       401 invalid_request_error, code invalid_api_key, WWW-Authenticate: Bearer
//   kRouteNotFound      404 invalid_request_error, code not_found
//   kMethodNotAllowed   405 invalid_request_error, code method_not_allowed, Allow: <allowed>
//   kBodyTooLarge       413 invalid_request_error, code request_too_large
//   kHeaderTooLarge     431 invalid_request_error, code request_header_fields_too_large
//   kRateLimited        429, type "requests" (or `type`: "tokens" for a tokens-per-minute limit, as OpenAI),
//                       code rate_limit_exceeded, Retry-After: retry_after_seconds
// `param`, `code` and `type` given on the ApiError override the defaults; retry_after_seconds > 0 overrides
// the 503s' Retry-After: 1. Messages never echo keys.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "common/status.hpp"

namespace deltaserve::router {

struct ApiError {
  enum class Kind {
    kStatus,
    kUnauthorized,
    kRouteNotFound,
    kMethodNotAllowed,
    kBodyTooLarge,
    kHeaderTooLarge,
    kRateLimited
  };

  Kind kind = Kind::kStatus;
  Status status;      // the cause; its message is the error message (for every kind)
  std::string param;  // the offending request field ("messages", "temperature", ...); empty = null
  std::string code;   // a machine-readable code ("context_length_exceeded", ...); empty = the kind's default
  std::string allow;  // kMethodNotAllowed: the Allow header value
  std::string type;   // the error object's type; empty = the kind's default
  int64_t retry_after_seconds = 0;  // the Retry-After of a 429/503; 0 = the default (1 s for 503, none otherwise)

  // A 400 naming the field.
  static ApiError invalid(std::string param, std::string message, std::string code = {});
  static ApiError from_status(Status status, std::string param = {}, std::string code = {});
  static ApiError of_kind(Kind kind, std::string message);
  // A 429: the tenant is over a limit; retry after `retry_after_seconds` (>= 1).
  static ApiError rate_limited(std::string message, std::string type, int64_t retry_after_seconds);
};

struct HttpError {
  unsigned status = 500;
  std::string body;                                          // the JSON error object, serialized
  std::vector<std::pair<std::string, std::string>> headers;  // extra headers (WWW-Authenticate, Retry-After, Allow)
};

// The one mapping from a failure to HTTP (see the table above).
HttpError to_http_error(const ApiError& error);

// The JSON error object alone ({"error": {...}}), e.g. for an SSE error event mid-stream.
std::string error_json(const ApiError& error);

}  // namespace deltaserve::router
