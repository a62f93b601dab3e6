// A fixed pool of worker threads for the CPU reference backend. parallel_for splits [begin, end)
// into contiguous ranges of at least `grain` items; the calling thread takes part. Nested calls
// from inside a worker (or from the caller's own share) run serially (no deadlock, no oversubscription).
// Calls from several outside threads are safe: they take the pool one at a time.
#pragma once

#include <cstdint>
#include <functional>

namespace deltaserve::kernels::cpu {

// Number of threads used by parallel_for (workers + caller). Set once before first use, e.g. from
// --threads; 0 = std::thread::hardware_concurrency(). Later calls resize the pool (joining the old
// workers); a call from inside parallel_for is ignored. Default: hardware concurrency.
void set_num_threads(int num_threads);
int num_threads();

// Calls fn(range_begin, range_end) for disjoint ranges covering [begin, end), each of at least
// max(grain, 1) items (a single range when end - begin < 2 * grain). Returns when all are done.
// fn must not throw (the pool has no exception path: a throw from a worker terminates).
void parallel_for(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

}  // namespace deltaserve::kernels::cpu
