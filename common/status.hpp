// One error vocabulary for every module: a Status (code + message) and Result<T>.
// Returned, never thrown, across module borders. Context is prepended at each hop with
// `with_context`, so a message reads outermost-first: "load model /m: config.json: field 'x': ...".
// Header-only, standard library only, so engine/ and kernels/ stay buildable with nvcc alone.
#pragma once

#include <cassert>
#include <optional>
#include <string>
#include <utility>
#include <variant>

namespace deltaserve {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,     // caller input is malformed (maps to HTTP 400)
  kNotFound,            // a named thing does not exist (404)
  kFailedPrecondition,  // the system is not in a state to do this
  kOutOfRange,          // a value exceeds a limit (e.g. context length)
  kResourceExhausted,   // capacity or quota (429 / 503)
  kUnimplemented,       // recognised but not supported (e.g. MXFP4 experts)
  kDataLoss,            // stored data is corrupt (checkpoint, index)
  kIoError,             // the OS refused a read/write/mmap
  kInternal,            // a bug: an impossible state reached
  kUnavailable,         // a peer is gone or not ready
  kDeadlineExceeded,
  kCancelled,
};

const char* status_code_name(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status ok() { return {}; }
  bool is_ok() const { return code_ == StatusCode::kOk; }
  explicit operator bool() const { return is_ok(); }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

  // Prepends "context: " to the message; no-op on OK.
  Status with_context(const std::string& context) const& {
    if (is_ok()) return *this;
    return Status(code_, context + ": " + message_);
  }

  std::string to_string() const {
    if (is_ok()) return "OK";
    return std::string(status_code_name(code_)) + ": " + message_;
  }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status invalid_argument(std::string m) {
  return {StatusCode::kInvalidArgument, std::move(m)};
}
inline Status not_found(std::string m) {
  return {StatusCode::kNotFound, std::move(m)};
}
inline Status failed_precondition(std::string m) {
  return {StatusCode::kFailedPrecondition, std::move(m)};
}
inline Status out_of_range(std::string m) {
  return {StatusCode::kOutOfRange, std::move(m)};
}
inline Status unimplemented(std::string m) {
  return {StatusCode::kUnimplemented, std::move(m)};
}
inline Status data_loss(std::string m) {
  return {StatusCode::kDataLoss, std::move(m)};
}
inline Status io_error(std::string m) {
  return {StatusCode::kIoError, std::move(m)};
}
inline Status internal_error(std::string m) {
  return {StatusCode::kInternal, std::move(m)};
}

inline const char* status_code_name(StatusCode code) {
  switch (code) {
    case StatusCode::kOk:
      return "OK";
    case StatusCode::kInvalidArgument:
      return "INVALID_ARGUMENT";
    case StatusCode::kNotFound:
      return "NOT_FOUND";
    case StatusCode::kFailedPrecondition:
      return "FAILED_PRECONDITION";
    case StatusCode::kOutOfRange:
      return "OUT_OF_RANGE";
    case StatusCode::kResourceExhausted:
      return "RESOURCE_EXHAUSTED";
    case StatusCode::kUnimplemented:
      return "UNIMPLEMENTED";
    case StatusCode::kDataLoss:
      return "DATA_LOSS";
    case StatusCode::kIoError:
      return "IO_ERROR";
    case StatusCode::kInternal:
      return "INTERNAL";
    case StatusCode::kUnavailable:
      return "UNAVAILABLE";
    case StatusCode::kDeadlineExceeded:
      return "DEADLINE_EXCEEDED";
    case StatusCode::kCancelled:
      return "CANCELLED";
  }
  return "UNKNOWN";
}

// Either a value or a non-OK Status.
template <class T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}         // NOLINT(google-explicit-constructor)
  Result(Status status) : status_(std::move(status)) {  // NOLINT(google-explicit-constructor)
    assert(!status_.is_ok() && "Result<T> built from an OK status carries no value");
    if (status_.is_ok()) status_ = internal_error("Result built from OK status without a value");
  }

  bool is_ok() const { return value_.has_value(); }
  explicit operator bool() const { return is_ok(); }
  const Status& status() const { return status_; }

  T& value() & {
    assert(is_ok());
    return *value_;
  }
  const T& value() const& {
    assert(is_ok());
    return *value_;
  }
  T&& value() && {
    assert(is_ok());
    return std::move(*value_);
  }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  std::optional<T> value_;
  Status status_;
};

}  // namespace deltaserve

// Early-return helpers. `ctx` is a std::string expression evaluated only on error.
#define DS_RETURN_IF_ERROR(expr)                \
  do {                                          \
    ::deltaserve::Status ds_status_ = (expr);   \
    if (!ds_status_.is_ok()) return ds_status_; \
  } while (0)

#define DS_RETURN_IF_ERROR_CTX(expr, ctx)                         \
  do {                                                            \
    ::deltaserve::Status ds_status_ = (expr);                     \
    if (!ds_status_.is_ok()) return ds_status_.with_context(ctx); \
  } while (0)

#define DS_CONCAT_INNER_(a, b) a##b
#define DS_CONCAT_(a, b) DS_CONCAT_INNER_(a, b)

// DS_ASSIGN_OR_RETURN(auto x, make_x()); declares x from the Result's value or returns its Status.
#define DS_ASSIGN_OR_RETURN(lhs, expr) DS_ASSIGN_OR_RETURN_IMPL_(DS_CONCAT_(ds_result_, __LINE__), lhs, expr, "")
#define DS_ASSIGN_OR_RETURN_CTX(lhs, expr, ctx) \
  DS_ASSIGN_OR_RETURN_IMPL_CTX_(DS_CONCAT_(ds_result_, __LINE__), lhs, expr, ctx)
#define DS_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr, unused) \
  auto tmp = (expr);                                      \
  if (!tmp.is_ok()) return tmp.status();                  \
  lhs = std::move(tmp).value()
#define DS_ASSIGN_OR_RETURN_IMPL_CTX_(tmp, lhs, expr, ctx) \
  auto tmp = (expr);                                       \
  if (!tmp.is_ok()) return tmp.status().with_context(ctx); \
  lhs = std::move(tmp).value()
