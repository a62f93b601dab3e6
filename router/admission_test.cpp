#include "router/admission.hpp"

#include <gtest/gtest.h>

namespace deltaserve::router {
namespace {

using namespace std::chrono_literals;

// A clock that moves only when the test says so.
struct FakeClock {
  std::chrono::steady_clock::time_point now{std::chrono::hours(1)};
  AdmissionClock function() {
    return [this] { return now; };
  }
};

bool admitted(const std::variant<Admission::Ticket, AdmissionRefusal>& result) {
  return std::holds_alternative<Admission::Ticket>(result);
}
const AdmissionRefusal& refusal(const std::variant<Admission::Ticket, AdmissionRefusal>& result) {
  return std::get<AdmissionRefusal>(result);
}

TEST(AdmissionTest, UnlimitedTenantsAreAlwaysAdmitted) {
  FakeClock clock;
  Admission admission({{"acme", TenantLimits{1, 0, 0, Priority::kHigh}}}, clock.function());
  for (int i = 0; i < 100; ++i) EXPECT_TRUE(admitted(admission.admit("globex", 1'000'000)));
  EXPECT_EQ(admission.priority_of("globex"), Priority::kNormal);
  EXPECT_EQ(admission.priority_of("acme"), Priority::kHigh);
}

TEST(AdmissionTest, RequestsPerSecondIsATokenBucketWithItsBurst) {
  FakeClock clock;
  Admission admission({{"acme", TenantLimits{2, 0, 0}}}, clock.function());
  EXPECT_TRUE(admitted(admission.admit("acme", 10)));
  EXPECT_TRUE(admitted(admission.admit("acme", 10)));  // burst of 2
  auto third = admission.admit("acme", 10);
  ASSERT_FALSE(admitted(third));
  EXPECT_EQ(refusal(third).limit, AdmissionRefusal::Limit::kRequestsPerSecond);
  EXPECT_EQ(refusal(third).retry_after, 1s);  // 0.5 s to one more request, rounded up
  EXPECT_NE(refusal(third).message.find("acme"), std::string::npos);
  clock.now += 499ms;
  EXPECT_FALSE(admitted(admission.admit("acme", 10)));  // a refusal takes nothing
  clock.now += 1ms;
  EXPECT_TRUE(admitted(admission.admit("acme", 10)));
  EXPECT_FALSE(admitted(admission.admit("acme", 10)));
  clock.now += 1h;  // refills to the burst, no further
  EXPECT_TRUE(admitted(admission.admit("acme", 10)));
  EXPECT_TRUE(admitted(admission.admit("acme", 10)));
  EXPECT_FALSE(admitted(admission.admit("acme", 10)));
}

TEST(AdmissionTest, SlowRateRetryAfterComesFromTheBucket) {
  FakeClock clock;
  Admission admission({{"acme", TenantLimits{0.1, 0, 0}}}, clock.function());  // one per 10 s
  EXPECT_TRUE(admitted(admission.admit("acme", 1)));
  clock.now += 2500ms;
  auto refused = admission.admit("acme", 1);
  ASSERT_FALSE(admitted(refused));
  EXPECT_EQ(refusal(refused).retry_after, 8s);  // 7.5 s left, rounded up
}

TEST(AdmissionTest, TokensPerMinuteReservesMaxTokensAndRefundsWhatWasNotGenerated) {
  FakeClock clock;
  Admission admission({{"acme", TenantLimits{0, 600, 0}}}, clock.function());  // 10 tokens/s
  auto first = admission.admit("acme", 500);                                   // e.g. 100 prompt + 400 max_tokens
  ASSERT_TRUE(admitted(first));
  auto second = admission.admit("acme", 200);
  ASSERT_FALSE(admitted(second));
  EXPECT_EQ(refusal(second).limit, AdmissionRefusal::Limit::kTokensPerMinute);
  EXPECT_EQ(refusal(second).retry_after, 10s);  // 100 more tokens at 10/s
  // The first request generated 20 of its 400: 380 come back, so 480 are free.
  std::get<Admission::Ticket>(first).finish(120);
  EXPECT_TRUE(admitted(admission.admit("acme", 480)));
  EXPECT_FALSE(admitted(admission.admit("acme", 1)));
}

TEST(AdmissionTest, ARequestLargerThanTheMinuteBudgetRunsOnlyOnAFullBucket) {
  FakeClock clock;
  Admission admission({{"acme", TenantLimits{0, 60, 0}}}, clock.function());  // 1 token/s
  auto big = admission.admit("acme", 100);
  ASSERT_TRUE(admitted(big));  // full bucket: admitted, 40 tokens in debt
  std::get<Admission::Ticket>(big).finish(100);
  auto next = admission.admit("acme", 100);
  ASSERT_FALSE(admitted(next));
  EXPECT_EQ(refusal(next).retry_after, 100s);  // from -40 back to the full 60
  clock.now += 100s;
  EXPECT_TRUE(admitted(admission.admit("acme", 100)));
}

TEST(AdmissionTest, ConcurrencyIsHeldUntilTheTicketEnds) {
  FakeClock clock;
  Admission admission({{"acme", TenantLimits{0, 0, 2}}}, clock.function());
  auto a = admission.admit("acme", 1);
  auto b = admission.admit("acme", 1);
  ASSERT_TRUE(admitted(a));
  ASSERT_TRUE(admitted(b));
  auto c = admission.admit("acme", 1);
  ASSERT_FALSE(admitted(c));
  EXPECT_EQ(refusal(c).limit, AdmissionRefusal::Limit::kConcurrency);
  EXPECT_EQ(refusal(c).retry_after, 1s);
  std::get<Admission::Ticket>(a).finish(1);
  std::get<Admission::Ticket>(a).finish(1);                                 // only the first finish counts
  EXPECT_TRUE(admitted(admission.admit("acme", 1)));                        // its ticket ends at once (a temporary)
  { Admission::Ticket moved = std::move(std::get<Admission::Ticket>(b)); }  // destroyed: ended
  auto d = admission.admit("acme", 1);
  auto e = admission.admit("acme", 1);
  EXPECT_TRUE(admitted(d));
  EXPECT_TRUE(admitted(e));
  EXPECT_FALSE(admitted(admission.admit("acme", 1)));
}

TEST(AdmissionTest, ARefusalByOneLimitTakesNothingFromTheOthers) {
  FakeClock clock;
  Admission admission({{"acme", TenantLimits{0.1, 600, 0}}}, clock.function());  // 1 request / 10 s, 10 tokens/s
  EXPECT_TRUE(admitted(admission.admit("acme", 700)));  // on the full bucket: 100 tokens in debt
  clock.now += 10s;                                     // 1 request, 0 tokens
  auto refused = admission.admit("acme", 50);
  ASSERT_FALSE(admitted(refused));
  EXPECT_EQ(refusal(refused).limit, AdmissionRefusal::Limit::kTokensPerMinute);
  EXPECT_EQ(refusal(refused).retry_after, 5s);
  clock.now += 5s;  // had the refusal taken the request, the request bucket would hold 0.5 now
  EXPECT_TRUE(admitted(admission.admit("acme", 50)));
}

}  // namespace
}  // namespace deltaserve::router
