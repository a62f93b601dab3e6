// How a GPU backend splits its memory budget between request-state slots and MLA cache pages, as plain arithmetic
// (the CUDA backend measures, this decides; unit-tested without a GPU).
//   budget: min(free device memory at start, memory_fraction * device memory);
//   weights and scratch: what the backend allocated before the plan. It is measured as the drop in the device's
//     free memory, which on a GPU shared by several processes also holds what the others allocated meanwhile
//     (workers of one node starting together); a drop beyond this process's own allocations plus room for the
//     allocator's rounding is not all ours, and then the own allocations with that room count instead;
//   slots and pages: explicit counts win; otherwise slots take at most half of what is left (all of it without MLA
//     layers, at most max_requests), pages the rest.
#pragma once

#include <cstdint>

namespace deltaserve::engine {

struct DeviceMemoryPlanInput {
  int64_t budget = 0;
  int64_t device_drop = 0;    // free device memory before the weights minus after the scratch (device-wide)
  int64_t own_allocated = 0;  // bytes this process allocated over the same interval
  int64_t slot_bytes = 1;     // one request's state slot (> 0)
  int64_t page_bytes = 0;     // one MLA cache page; 0: no MLA layers (no pages)
  int64_t state_slots = 0;    // explicit count; <= 0: from the budget
  int64_t cache_pages = 0;    // explicit count; <= 0: from the budget
  int64_t max_requests = 0;   // upper bound on slots planned from the budget
};

struct DeviceMemoryPlan {
  int64_t used = 0;       // bytes attributed to the weights and scratch
  int64_t remaining = 0;  // budget - used (may be negative)
  int64_t slots = 0;      // < 1: no room
  int64_t pages = 0;      // < 1 with MLA layers: no room; 0 without
  bool has_mla = false;   // page_bytes > 0
  [[nodiscard]] bool fits() const { return slots >= 1 && (!has_mla || pages >= 1); }
};

// The allocator's rounding allowed on top of the own allocations: 64 MiB plus a sixteenth of them.
[[nodiscard]] int64_t allocator_slack(int64_t own_allocated);

[[nodiscard]] DeviceMemoryPlan plan_device_memory(const DeviceMemoryPlanInput& input);

}  // namespace deltaserve::engine
