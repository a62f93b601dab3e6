#include "kernels/cpu/thread_pool.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <set>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

namespace deltaserve::kernels::cpu {
namespace {

// Restores the pool size a test changed.
class ThreadPoolTest : public ::testing::Test {
 protected:
  void SetUp() override { saved_threads_ = num_threads(); }
  void TearDown() override { set_num_threads(saved_threads_); }

 private:
  int saved_threads_ = 0;
};

TEST_F(ThreadPoolTest, CoversEveryIndexExactlyOnce) {
  for (int threads : {1, 2, 3, 5}) {
    set_num_threads(threads);
    ASSERT_EQ(num_threads(), threads);
    for (auto [begin, end, grain] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
             {0, 1, 1}, {0, 10, 1}, {5, 1005, 7}, {-20, 20, 3}, {0, 100, 1000}, {3, 1000, 0}}) {
      std::vector<std::atomic<int>> hits(static_cast<size_t>(end - begin));
      parallel_for(begin, end, grain, [&](int64_t range_begin, int64_t range_end) {
        for (int64_t i = range_begin; i < range_end; ++i) hits[static_cast<size_t>(i - begin)].fetch_add(1);
      });
      for (size_t i = 0; i < hits.size(); ++i) ASSERT_EQ(hits[i].load(), 1) << "threads " << threads << " index " << i;
    }
  }
}

TEST_F(ThreadPoolTest, RangesAreContiguousAndAtLeastGrain) {
  set_num_threads(4);
  for (int64_t grain : {1, 3, 10, 64}) {
    std::mutex mutex;
    std::vector<std::pair<int64_t, int64_t>> ranges;
    parallel_for(0, 200, grain, [&](int64_t range_begin, int64_t range_end) {
      std::lock_guard lock(mutex);
      ranges.emplace_back(range_begin, range_end);
    });
    std::sort(ranges.begin(), ranges.end());
    ASSERT_FALSE(ranges.empty());
    EXPECT_EQ(ranges.front().first, 0);
    EXPECT_EQ(ranges.back().second, 200);
    for (size_t i = 0; i < ranges.size(); ++i) {
      EXPECT_GE(ranges[i].second - ranges[i].first, grain);
      if (i > 0) {
        EXPECT_EQ(ranges[i].first, ranges[i - 1].second);
      }
    }
  }
}

TEST_F(ThreadPoolTest, EmptyOrReversedRangeCallsNothing) {
  int calls = 0;
  parallel_for(5, 5, 1, [&](int64_t, int64_t) { ++calls; });
  parallel_for(7, 3, 1, [&](int64_t, int64_t) { ++calls; });
  EXPECT_EQ(calls, 0);
}

TEST_F(ThreadPoolTest, WorkersTakePart) {
  set_num_threads(4);
  std::mutex mutex;
  std::set<std::thread::id> seen;
  // Each range waits (bounded) until a second thread has entered, so a lone caller would show up as one id.
  parallel_for(0, 4, 1, [&](int64_t, int64_t) {
    {
      std::lock_guard lock(mutex);
      seen.insert(std::this_thread::get_id());
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (std::chrono::steady_clock::now() < deadline) {
      {
        std::lock_guard lock(mutex);
        if (seen.size() >= 2) return;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  });
  EXPECT_GE(seen.size(), 2u);
}

TEST_F(ThreadPoolTest, NestedCallsRunSeriallyOnTheCallingThread) {
  set_num_threads(3);
  std::atomic<int64_t> total{0};
  std::atomic<int> inner_ranges_elsewhere{0};
  parallel_for(0, 12, 1, [&](int64_t outer_begin, int64_t outer_end) {
    for (int64_t i = outer_begin; i < outer_end; ++i) {
      const std::thread::id outer_thread = std::this_thread::get_id();
      int inner_calls = 0;
      parallel_for(0, 100, 1, [&](int64_t inner_begin, int64_t inner_end) {
        ++inner_calls;
        if (std::this_thread::get_id() != outer_thread) inner_ranges_elsewhere.fetch_add(1);
        total.fetch_add(inner_end - inner_begin);
      });
      EXPECT_EQ(inner_calls, 1);
    }
  });
  EXPECT_EQ(total.load(), 12 * 100);
  EXPECT_EQ(inner_ranges_elsewhere.load(), 0);
}

TEST_F(ThreadPoolTest, ConcurrentOutsideCallersGetCorrectResults) {
  set_num_threads(3);
  constexpr int kCallers = 3;
  constexpr int kRepeats = 200;
  std::vector<int64_t> sums(kCallers, 0);
  std::vector<std::thread> callers;
  for (int caller = 0; caller < kCallers; ++caller) {
    callers.emplace_back([&, caller] {
      for (int repeat = 0; repeat < kRepeats; ++repeat) {
        std::atomic<int64_t> sum{0};
        parallel_for(0, 1000, 10, [&](int64_t begin, int64_t end) {
          int64_t local = 0;
          for (int64_t i = begin; i < end; ++i) local += i;
          sum.fetch_add(local);
        });
        sums[static_cast<size_t>(caller)] += sum.load();
      }
    });
  }
  for (std::thread& caller : callers) caller.join();
  for (int64_t sum : sums) EXPECT_EQ(sum, int64_t{kRepeats} * 999 * 1000 / 2);
}

TEST_F(ThreadPoolTest, ResizeAndHardwareDefault) {
  set_num_threads(2);
  EXPECT_EQ(num_threads(), 2);
  set_num_threads(1);
  EXPECT_EQ(num_threads(), 1);
  set_num_threads(0);
  EXPECT_EQ(num_threads(), static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  // Ignored from inside a parallel region.
  set_num_threads(2);
  parallel_for(0, 8, 1, [&](int64_t, int64_t) { set_num_threads(7); });
  EXPECT_EQ(num_threads(), 2);
}

}  // namespace
}  // namespace deltaserve::kernels::cpu
