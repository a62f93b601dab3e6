#include "engine/device_memory_plan.hpp"

#include <algorithm>

namespace deltaserve::engine {

int64_t allocator_slack(int64_t own_allocated) {
  return (int64_t{64} << 20) + std::max<int64_t>(own_allocated, 0) / 16;
}

DeviceMemoryPlan plan_device_memory(const DeviceMemoryPlanInput& in) {
  DeviceMemoryPlan plan;
  plan.used = std::min(in.device_drop, in.own_allocated + allocator_slack(in.own_allocated));
  plan.remaining = in.budget - plan.used;
  plan.has_mla = in.page_bytes > 0;
  const bool has_mla = plan.has_mla;
  const int64_t slot_bytes = std::max<int64_t>(in.slot_bytes, 1);
  plan.slots = in.state_slots;
  plan.pages = has_mla ? in.cache_pages : 0;
  if (plan.slots <= 0) {
    const int64_t for_slots = !has_mla         ? plan.remaining
                              : plan.pages > 0 ? plan.remaining - plan.pages * in.page_bytes
                                               : plan.remaining / 2;
    plan.slots = std::min(in.max_requests, for_slots / slot_bytes);
  }
  if (has_mla && plan.pages <= 0) plan.pages = (plan.remaining - plan.slots * slot_bytes) / in.page_bytes;
  return plan;
}

}  // namespace deltaserve::engine
