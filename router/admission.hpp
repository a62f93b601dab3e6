// Per-tenant admission limits, applied by the HTTP front after a request is tokenized and before it
// reaches the InferenceService. Standard library only (no CAF, no Asio); the clock is injected so tests
// advance time by hand.
//
// Limits of one tenant (each optional; absent = unlimited), from the API keys file (api_keys.hpp):
//   requests_per_second   a token bucket of requests: refills at R per second, holds at most max(1, ceil(R))
//                         (the burst); a request takes one.
//   tokens_per_minute     a token bucket of model tokens: refills at T/60 per second, holds at most T. A
//                         request reserves prompt + n × max_tokens at admission; when it ends, what it did not
//                         use (max_tokens it did not generate) is given back, so the tenant pays for prompt +
//                         generated tokens. A request that reserves more than T is admitted only when the
//                         bucket is full, and leaves it in debt (otherwise it could never run).
//   max_concurrent        requests admitted and not yet ended (the final chunk of every choice) at most.
//   priority              the tenant's class in the router's waiting queue (GenerationRequest::priority).
// A refusal consumes nothing. Its retry_after is when the bucket that refused will hold enough again
// (rounded up to whole seconds, at least 1 s); for max_concurrent, whose end cannot be predicted, 1 s.
//
// Thread safety: admit() and Ticket::finish() may be called from any thread. Tickets keep their tenant's
// state alive, so they may outlive the Admission.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <variant>

#include "router/inference_service.hpp"

namespace deltaserve::router {

struct TenantLimits {
  double requests_per_second = 0;  // > 0; 0 = unlimited
  int64_t tokens_per_minute = 0;   // > 0; 0 = unlimited
  int64_t max_concurrent = 0;      // > 0; 0 = unlimited
  Priority priority = Priority::kNormal;

  bool operator==(const TenantLimits&) const = default;
  bool limits_anything() const { return requests_per_second > 0 || tokens_per_minute > 0 || max_concurrent > 0; }
};

// "high" | "normal" | "low".
std::string_view priority_name(Priority priority);

using AdmissionClock = std::function<std::chrono::steady_clock::time_point()>;

struct AdmissionRefusal {
  enum class Limit { kRequestsPerSecond, kTokensPerMinute, kConcurrency };
  Limit limit = Limit::kRequestsPerSecond;
  std::chrono::seconds retry_after{1};  // >= 1 s
  std::string message;                  // OpenAI-style, names the tenant's limit; never a key
};

class Admission {
 private:
  struct TenantState;

 public:
  // One admitted request. finish() (or the destructor) ends it.
  class Ticket {
   public:
    Ticket() = default;  // a request of an unlimited tenant: finish() does nothing
    Ticket(Ticket&& other) noexcept;
    Ticket& operator=(Ticket&& other) noexcept;
    Ticket(const Ticket&) = delete;
    Ticket& operator=(const Ticket&) = delete;
    ~Ticket();  // finish(reserved): nothing given back

    // Ends the request: frees its max_concurrent place and gives back reserved − used tokens
    // (`used_tokens`: prompt + generated tokens; clamped to [0, reserved]). Only the first call counts.
    void finish(int64_t used_tokens);

   private:
    friend class Admission;
    Ticket(std::shared_ptr<TenantState> state, int64_t reserved) : state_(std::move(state)), reserved_(reserved) {}

    std::shared_ptr<TenantState> state_;
    int64_t reserved_ = 0;
  };

  // `limits` by tenant name; tenants not named are unlimited. `clock` defaults to steady_clock::now.
  explicit Admission(const std::map<std::string, TenantLimits, std::less<>>& limits, AdmissionClock clock = {});
  ~Admission();

  // Admits one request of `tenant` that reserves `reserved_tokens` (prompt + n × max_tokens), or says
  // which limit refused it and when to retry.
  std::variant<Ticket, AdmissionRefusal> admit(std::string_view tenant, int64_t reserved_tokens);

  // The tenant's priority class (kNormal when it has no limits).
  Priority priority_of(std::string_view tenant) const;

 private:
  AdmissionClock clock_;
  std::map<std::string, std::shared_ptr<TenantState>, std::less<>> tenants_;  // fixed after construction
};

}  // namespace deltaserve::router
