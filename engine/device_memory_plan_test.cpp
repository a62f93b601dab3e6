// The GPU backend's memory plan: what counts as the backend's own use, and how the rest is split.
#include "engine/device_memory_plan.hpp"

#include <gtest/gtest.h>

namespace deltaserve::engine {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;
constexpr int64_t kGiB = int64_t{1} << 30;

TEST(DeviceMemoryPlan, AloneTheMeasuredDropCounts) {
  // The driver's rounding and the context's own growth make the drop a little larger than the allocations.
  DeviceMemoryPlanInput in{.budget = 10 * kGiB,
                           .device_drop = 2 * kGiB + 40 * kMiB,
                           .own_allocated = 2 * kGiB,
                           .slot_bytes = kMiB,
                           .page_bytes = 0,
                           .max_requests = 1'000'000};
  const DeviceMemoryPlan plan = plan_device_memory(in);
  EXPECT_EQ(plan.used, in.device_drop);
  EXPECT_EQ(plan.remaining, 8 * kGiB - 40 * kMiB);
  EXPECT_EQ(plan.slots, (8 * kGiB - 40 * kMiB) / kMiB);
  EXPECT_EQ(plan.pages, 0);
  EXPECT_TRUE(plan.fits());
}

TEST(DeviceMemoryPlan, OtherProcessesAllocationsAreNotCountedAsOurs) {
  // Workers sharing one GPU: a tiny-model decode worker (1194176 bytes of weights, ~188 MB of scratch) started with
  // three other workers, one of which allocated its ~14 GB of pools in between; the budget is a tenth of the GPU.
  const int64_t own = 1'194'176 + 188 * kMiB;
  DeviceMemoryPlanInput in{.budget = 14 * kGiB,
                           .device_drop = own + 14 * kGiB,
                           .own_allocated = own,
                           .slot_bytes = 41'984,
                           .page_bytes = 10'240,
                           .max_requests = 256};
  const DeviceMemoryPlan plan = plan_device_memory(in);
  EXPECT_EQ(plan.used, own + allocator_slack(own));
  EXPECT_EQ(plan.remaining, 14 * kGiB - plan.used);
  EXPECT_EQ(plan.slots, 256);
  EXPECT_EQ(plan.pages, (plan.remaining - 256 * 41'984) / 10'240);
  EXPECT_TRUE(plan.fits());
  // Counting the drop itself (what the plan did before) leaves nothing.
  EXPECT_LT(in.budget - in.device_drop, 0);
}

TEST(DeviceMemoryPlan, SlotsTakeHalfAndPagesTheRest) {
  DeviceMemoryPlanInput in{.budget = 1000 * kMiB,
                           .device_drop = 200 * kMiB,
                           .own_allocated = 200 * kMiB,
                           .slot_bytes = 10 * kMiB,
                           .page_bytes = kMiB,
                           .max_requests = 1000};
  DeviceMemoryPlan plan = plan_device_memory(in);
  EXPECT_EQ(plan.slots, 40);  // 400 MiB of 800
  EXPECT_EQ(plan.pages, 400);
  in.max_requests = 8;  // the cap on slots hands the rest to pages
  plan = plan_device_memory(in);
  EXPECT_EQ(plan.slots, 8);
  EXPECT_EQ(plan.pages, 720);
}

TEST(DeviceMemoryPlan, ExplicitCountsWin) {
  DeviceMemoryPlanInput in{.budget = 1000 * kMiB,
                           .device_drop = 200 * kMiB,
                           .own_allocated = 200 * kMiB,
                           .slot_bytes = 10 * kMiB,
                           .page_bytes = kMiB,
                           .cache_pages = 100,
                           .max_requests = 1000};
  DeviceMemoryPlan plan = plan_device_memory(in);
  EXPECT_EQ(plan.pages, 100);
  EXPECT_EQ(plan.slots, 70);  // (800 - 100) MiB of 10 MiB slots
  in.cache_pages = 0;
  in.state_slots = 5;
  plan = plan_device_memory(in);
  EXPECT_EQ(plan.slots, 5);
  EXPECT_EQ(plan.pages, 750);
}

TEST(DeviceMemoryPlan, NoRoomIsReported) {
  DeviceMemoryPlanInput in{.budget = 100 * kMiB,
                           .device_drop = 99 * kMiB,
                           .own_allocated = 99 * kMiB,
                           .slot_bytes = 10 * kMiB,
                           .page_bytes = kMiB,
                           .max_requests = 1000};
  const DeviceMemoryPlan plan = plan_device_memory(in);
  EXPECT_EQ(plan.slots, 0);
  EXPECT_FALSE(plan.fits());
  // Without MLA layers the whole 1 MiB goes to slots: still less than one.
  in.page_bytes = 0;
  const DeviceMemoryPlan no_mla = plan_device_memory(in);
  EXPECT_EQ(no_mla.slots, 0);
  EXPECT_EQ(no_mla.pages, 0);
  EXPECT_FALSE(no_mla.fits());
  // Pages are what is short: one slot fits, no page does.
  in.page_bytes = 2 * kMiB;
  in.slot_bytes = kMiB / 4;
  in.state_slots = 4;
  const DeviceMemoryPlan no_pages = plan_device_memory(in);
  EXPECT_EQ(no_pages.slots, 4);
  EXPECT_EQ(no_pages.pages, 0);
  EXPECT_FALSE(no_pages.fits());
}

}  // namespace
}  // namespace deltaserve::engine
