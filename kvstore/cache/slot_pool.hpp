// A fixed pool of preallocated state slots (KDA recurrent states + conv tails of one request each, or
// whatever T a backend keeps per request). Slots are made once at start-up: a request that needs state
// memory takes a free slot and gives it back when it leaves, so state memory never grows with load and
// "how many requests fit" is a number the worker can report.
//
// Not thread-safe: one pool per worker, used from that worker's actor.
#pragma once

#include <cassert>
#include <cstdint>
#include <optional>
#include <vector>

namespace deltaserve::kvstore {

using SlotId = int32_t;

template <class T>
class SlotPool {
 public:
  explicit SlotPool(std::vector<T> slots) : slots_(std::move(slots)), in_use_(slots_.size(), false) {
    for (auto s = static_cast<SlotId>(slots_.size()) - 1; s >= 0; --s) free_.push_back(s);
  }

  // A free slot (its contents are whatever the last user left: reset before use); nullopt when all are taken.
  std::optional<SlotId> acquire() {
    if (free_.empty()) return std::nullopt;
    const SlotId slot = free_.back();
    free_.pop_back();
    in_use_[static_cast<size_t>(slot)] = true;
    return slot;
  }

  void release(SlotId slot) {
    assert(in_use_[static_cast<size_t>(slot)]);
    in_use_[static_cast<size_t>(slot)] = false;
    free_.push_back(slot);
  }

  T& at(SlotId slot) { return slots_[static_cast<size_t>(slot)]; }
  const T& at(SlotId slot) const { return slots_[static_cast<size_t>(slot)]; }

  int64_t size() const { return static_cast<int64_t>(slots_.size()); }
  int64_t free_slots() const { return static_cast<int64_t>(free_.size()); }
  int64_t used_slots() const { return size() - free_slots(); }

 private:
  std::vector<T> slots_;
  std::vector<bool> in_use_;
  std::vector<SlotId> free_;  // LIFO: the most recently used slot is reused first (warm in cache)
};

}  // namespace deltaserve::kvstore
