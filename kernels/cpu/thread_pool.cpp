#include "kernels/cpu/thread_pool.hpp"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

namespace deltaserve::kernels::cpu {
namespace {

// True on pool workers (always) and on a caller while it runs its share of a parallel_for:
// a parallel_for issued from such a thread runs serially.
thread_local bool t_inside_parallel_for = false;

// Upper bound on ranges per worker, so that threads slowed by other load can be balanced out.
constexpr int64_t kRangesPerThread = 4;

// One parallel_for call. Lives on the caller's stack; workers only touch it while attached
// (attached_workers > 0), and the caller returns only after detaching it and seeing no attached worker.
struct Job {
  const std::function<void(int64_t, int64_t)>* fn = nullptr;
  int64_t begin = 0;
  int64_t count = 0;       // items in [begin, begin + count)
  int64_t num_ranges = 0;  // ranges are [begin + i * count / num_ranges, begin + (i + 1) * count / num_ranges)
  std::atomic<int64_t> next_range{0};
  int attached_workers = 0;  // guarded by Pool::mutex_

  // Claims and runs ranges until none is left.
  void run_ranges() {
    for (;;) {
      const int64_t range = next_range.fetch_add(1, std::memory_order_relaxed);
      if (range >= num_ranges) return;
      const int64_t range_begin = begin + range * count / num_ranges;
      const int64_t range_end = begin + (range + 1) * count / num_ranges;
      (*fn)(range_begin, range_end);
    }
  }
};

class Pool {
 public:
  Pool() { resize(0); }
  ~Pool() { stop_workers(); }
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  // num_threads counts the caller; 0 = hardware concurrency.
  void resize(int num_threads) {
    std::lock_guard submit_lock(submit_mutex_);
    if (num_threads <= 0) num_threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    if (num_threads == num_threads_) return;
    stop_workers();
    num_threads_ = num_threads;
    stop_ = false;
    workers_.reserve(static_cast<size_t>(num_threads - 1));
    for (int i = 0; i + 1 < num_threads; ++i) workers_.emplace_back([this] { worker_loop(); });
  }

  int num_threads() const { return num_threads_.load(std::memory_order_relaxed); }

  void run(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
    const int64_t count = end - begin;
    if (count <= 0) return;
    grain = std::max<int64_t>(grain, 1);
    const int threads = num_threads();
    const int64_t num_ranges = std::min(count / grain, threads * kRangesPerThread);
    if (t_inside_parallel_for || threads == 1 || num_ranges <= 1) {
      fn(begin, end);
      return;
    }
    // One job at a time; a second caller thread waits here for the pool.
    std::lock_guard submit_lock(submit_mutex_);
    Job job;
    job.fn = &fn;
    job.begin = begin;
    job.count = count;
    job.num_ranges = num_ranges;
    {
      std::lock_guard lock(mutex_);
      current_job_ = &job;
      ++generation_;
    }
    wake_cv_.notify_all();

    t_inside_parallel_for = true;
    job.run_ranges();
    t_inside_parallel_for = false;

    // Every range has been claimed: no new worker may attach; wait for the attached ones to finish.
    std::unique_lock lock(mutex_);
    current_job_ = nullptr;
    done_cv_.wait(lock, [&] { return job.attached_workers == 0; });
  }

 private:
  void worker_loop() {
    t_inside_parallel_for = true;
    uint64_t seen_generation = 0;
    std::unique_lock lock(mutex_);
    for (;;) {
      wake_cv_.wait(lock, [&] { return stop_ || (current_job_ != nullptr && generation_ != seen_generation); });
      if (stop_) return;
      seen_generation = generation_;
      Job* job = current_job_;
      ++job->attached_workers;
      lock.unlock();
      job->run_ranges();
      lock.lock();
      if (--job->attached_workers == 0) done_cv_.notify_all();
    }
  }

  // Requires submit_mutex_ held (or the destructor).
  void stop_workers() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    wake_cv_.notify_all();
    for (std::thread& worker : workers_) worker.join();
    workers_.clear();
  }

  std::mutex submit_mutex_;  // serialises jobs and resizes
  std::mutex mutex_;         // guards current_job_, generation_, stop_, Job::attached_workers
  std::condition_variable wake_cv_;
  std::condition_variable done_cv_;
  Job* current_job_ = nullptr;
  uint64_t generation_ = 0;
  bool stop_ = false;
  std::atomic<int> num_threads_{0};
  std::vector<std::thread> workers_;
};

Pool& pool() {
  static Pool instance;
  return instance;
}

}  // namespace

void set_num_threads(int num_threads) {
  // Resizing from inside a parallel_for would wait on itself: ignored there.
  if (t_inside_parallel_for) return;
  pool().resize(num_threads);
}

int num_threads() {
  return pool().num_threads();
}

void parallel_for(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  pool().run(begin, end, grain, fn);
}

}  // namespace deltaserve::kernels::cpu
