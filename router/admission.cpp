#include "router/admission.hpp"

#include <algorithm>
#include <cmath>
#include <mutex>

namespace deltaserve::router {
namespace {

using Clock = std::chrono::steady_clock;

// A bucket that refills continuously at `rate` per second up to `capacity`. `level` may be negative (debt).
struct Bucket {
  double rate = 0;  // per second; 0 = this limit is off
  double capacity = 0;
  double level = 0;
  Clock::time_point refilled;

  bool on() const { return rate > 0; }
  void refill(Clock::time_point now) {
    if (now > refilled) {
      level = std::min(capacity, level + rate * std::chrono::duration<double>(now - refilled).count());
      refilled = now;
    }
  }
  // Whole seconds until the bucket holds `need` (at least 1).
  std::chrono::seconds wait_for(double need) const {
    const double seconds = std::ceil((need - level) / rate);
    return std::chrono::seconds(std::max<int64_t>(1, static_cast<int64_t>(std::min(seconds, 1e9))));
  }
};

std::string format_rate(double value) {
  std::string text = std::to_string(value);
  text.erase(text.find_last_not_of('0') + 1);
  if (!text.empty() && text.back() == '.') text.pop_back();
  return text;
}

}  // namespace

struct Admission::TenantState {
  std::string name;
  TenantLimits limits;
  std::mutex mutex;
  Bucket requests;  // of requests_per_second
  Bucket tokens;    // of tokens_per_minute
  int64_t running = 0;
};

std::string_view priority_name(Priority priority) {
  switch (priority) {
    case Priority::kHigh:
      return "high";
    case Priority::kLow:
      return "low";
    case Priority::kNormal:
      break;
  }
  return "normal";
}

Admission::Ticket::Ticket(Ticket&& other) noexcept
    : state_(std::move(other.state_)), reserved_(std::exchange(other.reserved_, 0)) {}

Admission::Ticket& Admission::Ticket::operator=(Ticket&& other) noexcept {
  if (this != &other) {
    finish(reserved_);
    state_ = std::move(other.state_);
    reserved_ = std::exchange(other.reserved_, 0);
  }
  return *this;
}

Admission::Ticket::~Ticket() {
  finish(reserved_);
}

void Admission::Ticket::finish(int64_t used_tokens) {
  if (!state_) return;
  TenantState& s = *state_;
  {
    std::lock_guard lock(s.mutex);
    if (s.limits.max_concurrent > 0) --s.running;
    if (s.tokens.on()) {
      const int64_t unused = reserved_ - std::clamp<int64_t>(used_tokens, 0, reserved_);
      s.tokens.level = std::min(s.tokens.capacity, s.tokens.level + static_cast<double>(unused));
    }
  }
  state_.reset();
}

Admission::Admission(const std::map<std::string, TenantLimits, std::less<>>& limits, AdmissionClock clock)
    : clock_(clock ? std::move(clock) : AdmissionClock([] { return Clock::now(); })) {
  const Clock::time_point now = clock_();
  for (const auto& [name, l] : limits) {
    auto state = std::make_shared<TenantState>();
    state->name = name;
    state->limits = l;
    if (l.requests_per_second > 0) {
      const double burst = std::max(1.0, std::ceil(l.requests_per_second));
      state->requests = Bucket{l.requests_per_second, burst, burst, now};
    }
    if (l.tokens_per_minute > 0) {
      const auto per_minute = static_cast<double>(l.tokens_per_minute);
      state->tokens = Bucket{per_minute / 60.0, per_minute, per_minute, now};
    }
    tenants_.emplace(name, std::move(state));
  }
}

Admission::~Admission() = default;

std::variant<Admission::Ticket, AdmissionRefusal> Admission::admit(std::string_view tenant, int64_t reserved_tokens) {
  const auto it = tenants_.find(tenant);
  if (it == tenants_.end() || !it->second->limits.limits_anything()) return Ticket();
  TenantState& s = *it->second;
  const Clock::time_point now = clock_();
  std::lock_guard lock(s.mutex);
  const TenantLimits& l = s.limits;
  AdmissionRefusal refusal;
  if (l.max_concurrent > 0 && s.running >= l.max_concurrent) {
    refusal.limit = AdmissionRefusal::Limit::kConcurrency;
    refusal.retry_after = std::chrono::seconds(1);
    refusal.message = "Rate limit reached for tenant '" + s.name + "' on concurrent requests: limit " +
                      std::to_string(l.max_concurrent) + ". Please try again when a request has finished.";
    return refusal;
  }
  if (s.requests.on()) {
    s.requests.refill(now);
    if (s.requests.level < 1.0) {
      refusal.limit = AdmissionRefusal::Limit::kRequestsPerSecond;
      refusal.retry_after = s.requests.wait_for(1.0);
      refusal.message = "Rate limit reached for tenant '" + s.name + "' on requests per second (RPS): limit " +
                        format_rate(l.requests_per_second) + ". Please try again in " +
                        std::to_string(refusal.retry_after.count()) + "s.";
      return refusal;
    }
  }
  const int64_t reserved = std::max<int64_t>(reserved_tokens, 0);
  if (s.tokens.on()) {
    s.tokens.refill(now);
    const double need = std::min(static_cast<double>(reserved), s.tokens.capacity);
    if (s.tokens.level < need) {
      refusal.limit = AdmissionRefusal::Limit::kTokensPerMinute;
      refusal.retry_after = s.tokens.wait_for(need);
      refusal.message = "Rate limit reached for tenant '" + s.name + "' on tokens per min (TPM): limit " +
                        std::to_string(l.tokens_per_minute) + ", requested " + std::to_string(reserved) +
                        " (prompt + max_tokens). Please try again in " + std::to_string(refusal.retry_after.count()) +
                        "s.";
      return refusal;
    }
  }
  // Every limit agrees: take from each.
  if (s.requests.on()) s.requests.level -= 1.0;
  if (s.tokens.on()) s.tokens.level -= static_cast<double>(reserved);
  if (l.max_concurrent > 0) ++s.running;
  return Ticket(it->second, s.tokens.on() ? reserved : 0);
}

Priority Admission::priority_of(std::string_view tenant) const {
  const auto it = tenants_.find(tenant);
  return it == tenants_.end() ? Priority::kNormal : it->second->limits.priority;
}

}  // namespace deltaserve::router
