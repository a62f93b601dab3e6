// A chain of dependent batch-1 GEMVs (x_{s+1} = bf16(W_s x_s), the shapes of o_proj and a KDA projection
// alternating: 2304 -> 4096 -> 2304 ...) run five ways, next to the device-to-device copy bandwidth measured in the
// same run (the last three, chain_ring_kernel, chain_ll_kernel and chain_ll_cta_kernel, are described above them):
//   * launches: one skinny_gemm launch per step (the engine's kernel and its programmatic dependent launch), the
//     chain captured in a CUDA graph;
//   * persistent: one launch, one CTA per SM, for the whole chain. A producer warp streams the CTA's weight rows of
//     every step, in order, through a ring of shared-memory stages (bulk copies); eight consumer warps multiply them
//     with x. Between steps the consumers wait on a grid-wide counter (the previous step's outputs), but the producer
//     does not: it runs on into the next steps' rows as ring slots free up, so the weight stream does not stop at a
//     step boundary; and the same kernel with the producer waiting on the counter too (persistence without it);
//   * persistent, cp.async ring per warp: every warp streams its own rows; the same counter between steps;
//   * persistent, LL: the ring kernel's streaming, the dependency carried in the data (each output word holds its
//     value and a tag of the step and launch, like NCCL's LL protocol): no counter, fence, atomic or CTA barrier; a
//     warp waits only for the words of x it multiplies with, read straight into registers. Measured (f50016c,
//     a077b4d) at 0.36-0.38 of copy with the dependency (0.37 with 256 ns between polls), 0.69-0.77 without, and
//     0.90-0.92 with x constant from x0's buffer (L1-resident): the streaming core is fast; every warp reading all
//     of x from L2 at every step is what holds it back;
//   * persistent, LL gathered once per CTA: the same, x read once per CTA into shared memory (8x less L2 traffic
//     of x) behind one CTA barrier a step.
// The question it answers: how much of a decode step's latency between dependent kernels does a producer that runs
// ahead across a grid-wide dependency remove, on the simplest chain (bench/gpu/engine_notes.md, eighth session:
// the case for fewer, longer-lived kernels). Correctness: every variant against a CPU reference of the first two
// steps (double sums, bf16 rounding between steps, 2^-7 relative), then the variants' final outputs against each other.
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Xcudafe=--diag_suppress=2810 -I. \
//       bench/gpu/gemv_chain_bench.cu kernels/cuda/gemm/small_batch_gemm.cu -o /tmp/gemv_chain
//   /tmp/gemv_chain [--steps N]      (JSON lines on stdout, one per variant)
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "bench/gpu/cuda_check.hpp"
#include "kernels/cuda/common/detail/bf16_stream.cuh"
#include "kernels/cuda/common/detail/mma_sm80.cuh"
#include "kernels/cuda/common/detail/sm90_ptx.cuh"
#include "kernels/cuda/gemm/small_batch.hpp"

namespace {

namespace kc = deltaserve::kernels::cuda;
namespace detail = deltaserve::kernels::cuda::detail;
namespace sm90 = deltaserve::kernels::cuda::sm90;

constexpr int kMaxSteps = 128;
constexpr int kConsumerWarps = 8;
constexpr int kThreads = 32 * (kConsumerWarps + 1);  // + the producer warp
constexpr int kStageRows = kConsumerWarps;           // a row per consumer warp
constexpr int kMaxIn = 4096;
constexpr int kStages = 3;  // 3 x 8 rows x 8 KB + x (8 KB) = 200 KB of shared memory
constexpr uint32_t kSlotBytes = kStageRows * kMaxIn * 2;
constexpr uint32_t kRingOffset = 1024;  // barriers first
constexpr uint32_t kXOffset = kRingOffset + kStages * kSlotBytes;
constexpr uint32_t kSmemBytes = kXOffset + kMaxIn * 2;

struct Chain {
  int steps;
  int in[kMaxSteps], n[kMaxSteps];
  const __nv_bfloat16* w[kMaxSteps];  // [n, in]
  __nv_bfloat16* x[kMaxSteps + 1];    // x[0] the input, x[s + 1] step s's output
};

__device__ __forceinline__ uint32_t full_barrier(uint32_t base, int slot) {
  return base + 8u * static_cast<uint32_t>(slot);
}
__device__ __forceinline__ uint32_t empty_barrier(uint32_t base, int slot) {
  return base + 8u * static_cast<uint32_t>(kStages + slot);
}

// Rows [begin, end) of step s for this CTA: an even share of n.
__device__ __forceinline__ void step_rows(const Chain& c, int s, int& begin, int& end) {
  begin = static_cast<int>(static_cast<int64_t>(c.n[s]) * blockIdx.x / gridDim.x);
  end = static_cast<int>(static_cast<int64_t>(c.n[s]) * (blockIdx.x + 1) / gridDim.x);
}

// Until every CTA has finished step s - 1 (the counter counts CTA-steps). One thread; traps after 10 s.
__device__ __forceinline__ void wait_for_step(const unsigned* counter, int s) {
  const unsigned target = static_cast<unsigned>(s) * gridDim.x;
  const uint64_t start = sm90::globaltimer_ns();
  for (;;) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(counter) : "memory");
    if (v >= target) return;
    if (sm90::globaltimer_ns() - start > sm90::kMbarrierTimeoutNs) __trap();
  }
}

__device__ __forceinline__ void consumer_sync() {
  asm volatile("bar.sync 1, %0;" ::"n"(32 * kConsumerWarps) : "memory");
}

__global__ void __launch_bounds__(kThreads, 1)
    chain_kernel(const __grid_constant__ Chain c, unsigned* counter, int mode) {
  // mode 0: the producer waits at each step too; 1: it runs ahead; 2: nobody waits (timing only: the consumers read
  // inputs that may not be written yet, so the results are wrong; what the design streams without the dependency).
  const bool run_ahead = mode >= 1, consumers_wait = mode <= 1;
  extern __shared__ __align__(1024) unsigned char smem[];
  const uint32_t base = detail::smem_address(smem);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (tid == 0) {
    for (int k = 0; k < kStages; ++k) {
      sm90::mbarrier_init(full_barrier(base, k), 1);
      sm90::mbarrier_init(empty_barrier(base, k), kConsumerWarps);
    }
    sm90::mbarrier_init_fence();
  }
  __syncthreads();

  if (warp == kConsumerWarps) {  // the producer: every step's rows in order, through the ring
    const uint64_t policy = detail::l2_evict_first_policy();
    int fill = 0;
    for (int s = 0; s < c.steps; ++s) {
      if (!run_ahead && s > 0) {
        if (lane == 0) wait_for_step(counter, s);
        __syncwarp();
      }
      int begin, end;
      step_rows(c, s, begin, end);
      const uint32_t row_bytes = static_cast<uint32_t>(c.in[s]) * 2u;
      for (int r0 = begin; r0 < end; r0 += kStageRows, ++fill) {
        const int slot = fill % kStages;
        const uint32_t phase = static_cast<uint32_t>(fill / kStages) & 1u;
        const int rows = min(kStageRows, end - r0);
        sm90::mbarrier_wait(empty_barrier(base, slot), phase ^ 1u);
        if (lane == 0)
          sm90::mbarrier_arrive_expect_tx(full_barrier(base, slot), static_cast<uint32_t>(rows) * row_bytes);
        __syncwarp();
        if (lane < rows) {
          detail::bulk_copy_to_shared(base + kRingOffset + static_cast<uint32_t>(slot) * kSlotBytes + lane * row_bytes,
                                      c.w[s] + static_cast<int64_t>(r0 + lane) * c.in[s], row_bytes,
                                      full_barrier(base, slot), policy);
        }
      }
    }
    return;
  }

  // Consumers: per step, wait for its input, stage it, then a row per warp per stage.
  const uint4* x_s = reinterpret_cast<const uint4*>(smem + kXOffset);
  int fill = 0;
  for (int s = 0; s < c.steps; ++s) {
    if (s > 0 && consumers_wait) {
      if (tid == 0) wait_for_step(counter, s);
      consumer_sync();
    }
    const int chunks = c.in[s] / 8;
    for (int i = tid; i < chunks; i += 32 * kConsumerWarps) {
      reinterpret_cast<uint4*>(smem + kXOffset)[i] = __ldcg(reinterpret_cast<const uint4*>(c.x[s]) + i);
    }
    consumer_sync();
    int begin, end;
    step_rows(c, s, begin, end);
    for (int r0 = begin; r0 < end; r0 += kStageRows, ++fill) {
      const int slot = fill % kStages;
      const uint32_t phase = static_cast<uint32_t>(fill / kStages) & 1u;
      sm90::mbarrier_wait(full_barrier(base, slot), phase);
      const int row = r0 + warp;
      if (row < end) {
        const uint4* w = reinterpret_cast<const uint4*>(smem + kRingOffset + slot * kSlotBytes) + warp * chunks;
        float acc = 0.0f;
        for (int k = lane; k < chunks; k += 32) acc = detail::dot8_bf16(w[k], x_s[k], acc);
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, offset);
        if (lane == 0) c.x[s + 1][row] = __float2bfloat16_rn(acc);  // published by the step's fence below
      }
      __syncwarp();
      if (lane == 0) sm90::mbarrier_arrive(empty_barrier(base, slot));
    }
    // Every row of this CTA written (and x_s read by all). The barrier orders the other warps' row stores before
    // thread 0's fence, which is cumulative: once the counter shows this CTA, every row of it is visible.
    consumer_sync();
    if (tid == 0) {
      __threadfence();
      atomicAdd(counter, 1u);
    }
  }
}

// ---- persistent, every warp its own cp.async ring ---------------------------------------------------------------
// The same chain with the streaming of the skinny GEMM instead of one producer warp's bulk copies (which the ninth
// session's run measured at 0.68-0.71 of copy even without the dependency, 8 bulk copies a stage from one warp):
// one CTA of 8 warps per SM; global warp g takes rows g, g + W, ... of every step (W warps in all); each warp keeps
// its next kRingRows rows (of this step and the next ones: the sequence runs on across the steps) in flight with
// 16-byte cp.async from all 32 lanes into its own slots, lane l copying and later reading only chunks l, l + 32,
// ..., so a lane's cp.async.wait_group is all it needs before reading. Per step the CTA waits for the grid-wide
// counter, stages x in shared memory, multiplies each of its rows as it lands, then publishes. While a CTA waits,
// its warps' next rows (most of the next step's bytes: ~140 KB an SM a step against 192 KB of slots) stream on.
constexpr int kRingWarps = 8;
constexpr int kRingThreads = 32 * kRingWarps;
constexpr int kRingRows = 3;                                               // row slots per warp
constexpr uint32_t kRingRowBytes = kMaxIn * 2;                             // 8 KB a slot
constexpr uint32_t kRingXOffset = kRingWarps * kRingRows * kRingRowBytes;  // 192 KB of slots, then x
constexpr uint32_t kRingSmemBytes = kRingXOffset + kMaxIn * 2;

// Rows of step s that global warp g of W takes.
__device__ __forceinline__ int ring_rows(const Chain& c, int s, int g, int warps) {
  return g < c.n[s] ? (c.n[s] - 1 - g) / warps + 1 : 0;
}

// A warp's ring of kRingRows row slots. The issue cursor walks the warp's rows of every step in order; each issue is
// one commit group (an empty one past the last row), so "the oldest kRingRows groups" always means "the next row to
// multiply". Lane l copies and reads only chunks l, l + 32, ... of a row, so its own cp.async.wait_group suffices.
struct WarpRing {
  unsigned char* slots;  // this warp's kRingRows slots
  int g, warps, lane;
  int issue_step = 0, issue_index = 0, issue_slot = 0, read_slot = 0;

  __device__ __forceinline__ WarpRing(unsigned char* slots_, int g_, int warps_, int lane_)
      : slots(slots_), g(g_), warps(warps_), lane(lane_) {}

  __device__ __forceinline__ void issue_next(const Chain& c) {
    while (issue_step < c.steps && issue_index >= ring_rows(c, issue_step, g, warps)) {
      ++issue_step;
      issue_index = 0;
    }
    if (issue_step < c.steps) {
      const int row = g + issue_index * warps;
      const int chunks = c.in[issue_step] / 8;
      const uint4* src = reinterpret_cast<const uint4*>(c.w[issue_step] + static_cast<int64_t>(row) * c.in[issue_step]);
      uint4* dst = reinterpret_cast<uint4*>(slots + static_cast<uint32_t>(issue_slot) * kRingRowBytes);
      for (int k = lane; k < chunks; k += 32) detail::cp_async16(dst + k, src + k);
      ++issue_index;
    }
    detail::cp_async_commit();
    issue_slot = issue_slot + 1 == kRingRows ? 0 : issue_slot + 1;
  }
  __device__ __forceinline__ void start(const Chain& c) {
    for (int k = 0; k < kRingRows; ++k) issue_next(c);
  }
  // The next row to multiply, once this lane's copies of it have landed.
  __device__ __forceinline__ const uint4* wait_row() const {
    detail::cp_async_wait<kRingRows - 1>();
    return reinterpret_cast<const uint4*>(slots + static_cast<uint32_t>(read_slot) * kRingRowBytes);
  }
  // Done with that row: the next one is copied into its slot (each lane overwrites only the chunks it read itself).
  __device__ __forceinline__ void release(const Chain& c) {
    issue_next(c);
    read_slot = read_slot + 1 == kRingRows ? 0 : read_slot + 1;
  }
};

__global__ void __launch_bounds__(kRingThreads, 1)
    chain_ring_kernel(const __grid_constant__ Chain c, unsigned* counter, int mode) {
  // mode 1: the consumers wait for each step's input; 2: nobody waits (timing only: wrong results).
  extern __shared__ __align__(1024) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int warps = static_cast<int>(gridDim.x) * kRingWarps, g = static_cast<int>(blockIdx.x) * kRingWarps + warp;
  const uint4* x_s = reinterpret_cast<const uint4*>(smem + kRingXOffset);
  WarpRing ring(smem + static_cast<uint32_t>(warp) * kRingRows * kRingRowBytes, g, warps, lane);
  ring.start(c);

  for (int s = 0; s < c.steps; ++s) {
    if (s > 0 && mode == 1) {
      if (tid == 0) wait_for_step(counter, s);
      __syncthreads();
    }
    const int chunks = c.in[s] / 8;
    for (int i = tid; i < chunks; i += kRingThreads) {
      reinterpret_cast<uint4*>(smem + kRingXOffset)[i] = __ldcg(reinterpret_cast<const uint4*>(c.x[s]) + i);
    }
    __syncthreads();
    const int rows = ring_rows(c, s, g, warps);
    for (int i = 0; i < rows; ++i) {
      const uint4* w = ring.wait_row();  // this lane's copies of the oldest row have landed
      float acc = 0.0f;
      for (int k = lane; k < chunks; k += 32) acc = detail::dot8_bf16(w[k], x_s[k], acc);
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, offset);
      if (lane == 0) c.x[s + 1][g + i * warps] = __float2bfloat16_rn(acc);  // published by the step's fence below
      ring.release(c);
    }
    // Every row of this CTA written and x_s read by all before thread 0's cumulative fence and the count.
    __syncthreads();
    if (tid == 0) {
      __threadfence();
      atomicAdd(counter, 1u);
    }
  }
  detail::cp_async_wait<0>();
}

// ---- persistent, cp.async ring per warp, flags in the data (LL) -------------------------------------------------
// The ring kernel's streaming with the dependency carried by the data itself, like NCCL's LL protocol: step s's
// output is a buffer of 32-bit words, one per row, the bf16 in the low half and the step's tag in the high half,
// written by one 32-bit store, so a reader sees a word either old or whole. A warp needing step s's input loads the
// words its lanes need straight from L2 (relaxed loads, which bypass L1) and loads again whatever group of four
// still carries an old tag. No counter, fence, atomic or CTA barrier: a warp waits for exactly the words it
// multiplies with, and x lives in registers (the ring kernel's shared-memory copy would need a CTA barrier).
// Step 0 reads x0 from the plain bf16 buffer, so no tag of it has to change between launches. Every launch gets a
// new epoch; the tag of step s's output is (epoch * (kMaxSteps + 1) + s + 1) mod 0xffff, never 0xffff (the
// buffers' 0xff fill), so words of an earlier launch (or never written) never match: a buffer holds only one
// step's outputs, and its tags repeat only every 21845 epochs (129 * 21845 = 43 * 0xffff).
// Lane l multiplies chunks k = l + 32 j (8 values; 32 bytes of LL words). Loading a chunk's two 16-byte halves
// with two instructions would touch every 32-byte sector twice; instead each instruction covers 512 contiguous
// bytes (lanes 0-15 the first halves of their own chunks and lanes 16-31 the second halves of lanes 0-15's, and
// the other way round for the next 512 bytes), and two 32-bit shuffles (xor 16) a chunk hand the second halves
// over. Only the chain's two widths (2304, 4096: 9 and 16 chunks a lane) are compiled. The dot products run in the
// ring kernel's order, so with the same x the two kernels' outputs are the same bits.
constexpr uint32_t kLLSmemBytes = kRingXOffset;  // the rings only

// The tag of step s's output in launch `epoch`: 0 ... 0xfffe.
__host__ __device__ __forceinline__ uint32_t ll_tag(unsigned epoch, int s) {
  return static_cast<uint32_t>((static_cast<uint64_t>(epoch) * (kMaxSteps + 1) + static_cast<uint64_t>(s) + 1u) %
                               0xffffu);
}

// 16 bytes of LL words at p + kOffset bytes, loaded from L2 into v when `load` (else v stays as it is).
template <int kOffset>
__device__ __forceinline__ void ll_load(uint4& v, const uint32_t* p, bool load) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %5, 0;\n"
      "@p ld.relaxed.gpu.global.v4.u32 {%0, %1, %2, %3}, [%4+%6];\n"
      "}\n"
      : "+r"(v.x), "+r"(v.y), "+r"(v.z), "+r"(v.w)
      : "l"(p), "r"(static_cast<uint32_t>(load)), "n"(kOffset));
}

__device__ __forceinline__ void ll_store(uint32_t* p, uint32_t word) {
  asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(word) : "memory");
}

// The bf16 (low halves) and the tags (high halves) of four LL words, two to a register.
__device__ __forceinline__ uint2 ll_values(const uint4& v) {
  return make_uint2(__byte_perm(v.x, v.y, 0x5410), __byte_perm(v.z, v.w, 0x5410));
}
__device__ __forceinline__ bool ll_tagged(const uint4& v, uint32_t tag2) {
  return __byte_perm(v.x, v.y, 0x7632) == tag2 && __byte_perm(v.z, v.w, 0x7632) == tag2;
}

// A poll loop's clock: the first call starts it, later ones trap once sm90::kMbarrierTimeoutNs have passed.
__device__ __forceinline__ void poll_deadline(uint64_t& start) {
  const uint64_t now = sm90::globaltimer_ns();
  if (start == 0) {
    start = now;
  } else if (now - start > sm90::kMbarrierTimeoutNs) {
    __trap();
  }
}

// Groups a and b of every block j < kJ (1 KB apart) that `want` asks for (bits 2j, 2j + 1), all in flight at once.
template <int... kBlocks>
__device__ __forceinline__ void ll_load_blocks(const uint32_t* pa, const uint32_t* pb, uint32_t want, uint4* ra,
                                               uint4* rb, std::integer_sequence<int, kBlocks...>) {
  (ll_load<1024 * kBlocks>(ra[kBlocks], pa, (want >> (2 * kBlocks)) & 1u), ...);
  (ll_load<1024 * kBlocks>(rb[kBlocks], pb, (want >> (2 * kBlocks + 1)) & 1u), ...);
}

// This lane's chunks l + 32 j (j < kJ) of step s's input x (s > 0) from its LL buffer `src`, once every word carries
// `tag` (wait) or as they are (!wait). Each pass issues all the loads still needed before looking at any of them; a
// group already complete keeps its words (they no longer change in this launch) and is not loaded again.
template <int kJ>
__device__ __forceinline__ void ll_gather(const uint32_t* src, uint32_t tag, bool wait, bool backoff, int lane,
                                          uint4 (&x)[16]) {
  static_assert(kJ >= 1 && kJ <= 16, "bits 2j and 2j + 1 of a 32-bit mask");
  const int h = lane & 15, hi = lane >> 4;
  // Word offsets of this lane's two 16-byte groups in each 256-word (1 KB) block: group a in the first 512 bytes,
  // b in the second. Lanes 0-15: a = their own first half, b = the second half of lane l + 16's chunk; lanes 16-31:
  // a = the second half of lane l - 16's chunk, b = their own first half.
  const uint32_t* pa = src + 8 * h + 4 * hi;
  const uint32_t* pb = src + 128 + 8 * h + 4 * (1 - hi);
  const uint32_t tag2 = tag | (tag << 16);
  uint4 ra[kJ], rb[kJ];
#pragma unroll
  for (int j = 0; j < kJ; ++j) ra[j] = rb[j] = make_uint4(0u, 0u, 0u, 0u);
  uint32_t want = 0xffffffffu >> (32 - 2 * kJ);  // bit 2j: group a of block j; 2j + 1: group b
  uint64_t start = 0;
  for (;;) {
    ll_load_blocks(pa, pb, want, ra, rb, std::make_integer_sequence<int, kJ>{});
    uint32_t missing = 0;
#pragma unroll
    for (int j = 0; j < kJ; ++j) {
      missing |= (static_cast<uint32_t>(!ll_tagged(ra[j], tag2)) << (2 * j)) |
                 (static_cast<uint32_t>(!ll_tagged(rb[j], tag2)) << (2 * j + 1));
    }
    if (!wait || !__any_sync(0xffffffffu, missing != 0)) break;
    want = missing;
    if (backoff) __nanosleep(256);  // fewer polls of lines still being written
    poll_deadline(start);
  }
#pragma unroll
  for (int j = 0; j < kJ; ++j) {
    const uint2 a = ll_values(ra[j]), b = ll_values(rb[j]);
    const uint2 own = hi ? b : a, other = hi ? a : b;
    x[j] =
        make_uint4(own.x, own.y, __shfl_xor_sync(0xffffffffu, other.x, 16), __shfl_xor_sync(0xffffffffu, other.y, 16));
  }
}

// Global warp g's rows of step s (kJ = in / 256 chunks a lane): gather x, then multiply each row as it lands.
template <int kJ>
__device__ __forceinline__ void ll_step(const Chain& c, WarpRing& ring, uint32_t* ll, unsigned epoch, int s, int mode,
                                        int rows) {
  uint4 x[16];
  if (s == 0 || mode == 3) {  // mode 3 reads every step's x from x0's buffer (L1-resident after the first step)
    const uint4* x0 = reinterpret_cast<const uint4*>(c.x[0]) + ring.lane;
#pragma unroll
    for (int j = 0; j < kJ; ++j) x[j] = __ldg(x0 + 32 * j);
  } else {
    ll_gather<kJ>(ll + static_cast<int64_t>(s) * kMaxIn, ll_tag(epoch, s - 1), mode == 1 || mode == 4, mode == 4,
                  ring.lane, x);
  }
  uint32_t* out = ll + static_cast<int64_t>(s + 1) * kMaxIn;
  const uint32_t tag = ll_tag(epoch, s) << 16;
  for (int i = 0; i < rows; ++i) {
    const uint4* w = ring.wait_row() + ring.lane;
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < kJ; ++j) acc = detail::dot8_bf16(w[32 * j], x[j], acc);
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, offset);
    if (ring.lane == 0) {
      ll_store(out + ring.g + i * ring.warps, tag | __bfloat16_as_ushort(__float2bfloat16_rn(acc)));
    }
    ring.release(c);
  }
}

__global__ void __launch_bounds__(kRingThreads, 1)
    chain_ll_kernel(const __grid_constant__ Chain c, uint32_t* ll, unsigned epoch, int mode) {
  // mode 1: each warp waits for the words of its input; 4: the same with a 256 ns sleep between polls; 2: nobody
  // waits; 3: every step's x from x0's buffer (2 and 3 timing only: wrong results). ll: buffer
  // s (kMaxIn words at ll + s * kMaxIn) holds step s's input, step s - 1's output (buffer 0 unused).
  extern __shared__ __align__(1024) unsigned char smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warps = static_cast<int>(gridDim.x) * kRingWarps, g = static_cast<int>(blockIdx.x) * kRingWarps + warp;
  WarpRing ring(smem + static_cast<uint32_t>(warp) * kRingRows * kRingRowBytes, g, warps, lane);
  ring.start(c);
  for (int s = 0; s < c.steps; ++s) {
    const int rows = ring_rows(c, s, g, warps);
    if (rows == 0) continue;  // nothing of this step's input needed
    if (c.in[s] == 4096) {
      ll_step<16>(c, ring, ll, epoch, s, mode, rows);
    } else if (c.in[s] == 2304) {
      ll_step<9>(c, ring, ll, epoch, s, mode, rows);
    } else {
      __trap();  // run_ll admits only these widths
    }
  }
  detail::cp_async_wait<0>();
}

// ---- persistent, LL words gathered once per CTA -------------------------------------------------------------------
// chain_ll_kernel reads all of x from L2 in every warp (1056 warps, up to 16 KB of LL words each a step), which holds
// it at 0.69-0.77 of copy even without the dependency, while its ring with x constant from L1 reaches 0.90-0.92
// (a077b4d). Here x is read once per CTA: each of the 256 threads polls its 16-byte groups of the LL words (at most
// four) until their tags match, writes the values into one of two shared-memory x buffers (by step parity), and
// after one CTA barrier every warp multiplies its rows with x from shared memory, in chain_ring_kernel's order (the
// same bits). The double buffer needs no second barrier: a thread writes buffer s & 1 only after the barrier of step
// s - 1, which every thread reaches only after its reads of step s - 2.
constexpr uint32_t kLLCtaSmemBytes = kRingXOffset + 2u * kMaxIn * 2u;  // the rings, then two x buffers
constexpr int kLLCtaGroups = kMaxIn / 4 / kRingThreads;                // 16-byte groups a thread polls, at most

// Step s's input (LL words at src, `groups` groups of four) into x_s as bf16, once every word carries `tag` (wait) or
// as the words are (!wait).
__device__ __forceinline__ void ll_cta_gather(const uint32_t* src, uint32_t tag, bool wait, int groups,
                                              __nv_bfloat16* x_s) {
  const int tid = threadIdx.x;
  const uint32_t tag2 = tag | (tag << 16);
  uint4 v[kLLCtaGroups];
  uint32_t want = 0;  // bit j: group tid + 256 j still to load
#pragma unroll
  for (int j = 0; j < kLLCtaGroups; ++j) {
    v[j] = make_uint4(0u, 0u, 0u, 0u);
    if (tid + kRingThreads * j < groups) want |= 1u << j;
  }
  const uint32_t mine = want;
  uint64_t start = 0;
  while (want != 0) {
#pragma unroll
    for (int j = 0; j < kLLCtaGroups; ++j) ll_load<0>(v[j], src + 4 * (tid + kRingThreads * j), (want >> j) & 1u);
    uint32_t missing = 0;
#pragma unroll
    for (int j = 0; j < kLLCtaGroups; ++j) {
      if (((want >> j) & 1u) != 0 && !ll_tagged(v[j], tag2)) missing |= 1u << j;
    }
    if (!wait) break;
    want = missing;
    if (want == 0) break;
    poll_deadline(start);
  }
#pragma unroll
  for (int j = 0; j < kLLCtaGroups; ++j) {
    if (((mine >> j) & 1u) != 0) reinterpret_cast<uint2*>(x_s)[tid + kRingThreads * j] = ll_values(v[j]);
  }
}

__global__ void __launch_bounds__(kRingThreads, 1)
    chain_ll_cta_kernel(const __grid_constant__ Chain c, uint32_t* ll, unsigned epoch, int mode) {
  // mode 1: the CTA waits for the words of its input; 2: nobody waits (timing only: wrong results). Buffers as
  // chain_ll_kernel's.
  extern __shared__ __align__(1024) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int warps = static_cast<int>(gridDim.x) * kRingWarps, g = static_cast<int>(blockIdx.x) * kRingWarps + warp;
  WarpRing ring(smem + static_cast<uint32_t>(warp) * kRingRows * kRingRowBytes, g, warps, lane);
  ring.start(c);
  for (int s = 0; s < c.steps; ++s) {
    const int chunks = c.in[s] / 8;
    auto* x_s = reinterpret_cast<__nv_bfloat16*>(smem + kRingXOffset + static_cast<uint32_t>(s & 1) * kMaxIn * 2u);
    if (s == 0) {
      for (int i = tid; i < chunks; i += kRingThreads) {
        reinterpret_cast<uint4*>(x_s)[i] = __ldg(reinterpret_cast<const uint4*>(c.x[0]) + i);
      }
    } else {
      ll_cta_gather(ll + static_cast<int64_t>(s) * kMaxIn, ll_tag(epoch, s - 1), mode == 1, c.in[s] / 4, x_s);
    }
    __syncthreads();
    const uint4* x4 = reinterpret_cast<const uint4*>(x_s);
    uint32_t* out = ll + static_cast<int64_t>(s + 1) * kMaxIn;
    const uint32_t tag = ll_tag(epoch, s) << 16;
    const int rows = ring_rows(c, s, g, warps);
    for (int i = 0; i < rows; ++i) {
      const uint4* w = ring.wait_row();
      float acc = 0.0f;
      for (int k = lane; k < chunks; k += 32) acc = detail::dot8_bf16(w[k], x4[k], acc);
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, offset);
      if (lane == 0) ll_store(out + g + i * warps, tag | __bfloat16_as_ushort(__float2bfloat16_rn(acc)));
      ring.release(c);
    }
  }
  detail::cp_async_wait<0>();
}

// ---- host -------------------------------------------------------------------------------------------------------

std::vector<__nv_bfloat16> random_bf16(size_t n, float scale, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<__nv_bfloat16> v(n);
  for (auto& e : v) e = __float2bfloat16(dist(rng));
  return v;
}

float to_float(__nv_bfloat16 v) {
  return __bfloat162float(v);
}

double copy_bandwidth() {
  const size_t bytes = size_t{1} << 30;
  void *a = nullptr, *b = nullptr;
  CHECK_CUDA(cudaMalloc(&a, bytes));
  CHECK_CUDA(cudaMalloc(&b, bytes));
  CHECK_CUDA(cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice));
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));
  CHECK_CUDA(cudaEventRecord(e0));
  for (int i = 0; i < 10; ++i) CHECK_CUDA(cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice));
  CHECK_CUDA(cudaEventRecord(e1));
  CHECK_CUDA(cudaEventSynchronize(e1));
  float ms = 0.0f;
  CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
  CHECK_CUDA(cudaFree(a));
  CHECK_CUDA(cudaFree(b));
  return 2.0 * 10.0 * static_cast<double>(bytes) / (1e-3 * ms);  // read + write
}

struct Device {
  Chain c{};
  std::vector<__nv_bfloat16*> buffers;
  unsigned* counter = nullptr;
  uint32_t* ll = nullptr;  // chain_ll_kernel's kMaxSteps + 1 buffers of kMaxIn LL words
  double weight_bytes = 0.0;
};

Device make_device(int steps, const std::vector<std::vector<__nv_bfloat16>>& w, const std::vector<__nv_bfloat16>& x0) {
  Device d;
  d.c.steps = steps;
  for (int s = 0; s < steps; ++s) {
    d.c.in[s] = s % 2 == 0 ? 2304 : 4096;
    d.c.n[s] = s % 2 == 0 ? 4096 : 2304;
    __nv_bfloat16* p = nullptr;
    CHECK_CUDA(cudaMalloc(&p, w[s].size() * 2));
    CHECK_CUDA(cudaMemcpy(p, w[s].data(), w[s].size() * 2, cudaMemcpyHostToDevice));
    d.c.w[s] = p;
    d.buffers.push_back(p);
    d.weight_bytes += static_cast<double>(w[s].size()) * 2.0;
  }
  for (int s = 0; s <= steps; ++s) {
    __nv_bfloat16* p = nullptr;
    CHECK_CUDA(cudaMalloc(&p, kMaxIn * 2));
    CHECK_CUDA(cudaMemset(p, 0xff, kMaxIn * 2));  // NaN: a row never written shows
    d.c.x[s] = p;
    d.buffers.push_back(p);
  }
  CHECK_CUDA(cudaMemcpy(d.c.x[0], x0.data(), x0.size() * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMalloc(&d.counter, sizeof(unsigned)));
  const size_t ll_bytes = size_t{kMaxSteps + 1} * kMaxIn * sizeof(uint32_t);
  CHECK_CUDA(cudaMalloc(&d.ll, ll_bytes));
  CHECK_CUDA(cudaMemset(d.ll, 0xff, ll_bytes));  // tag 0xffff: never valid
  return d;
}

void free_device(Device& d) {
  for (auto* p : d.buffers) CHECK_CUDA(cudaFree(p));
  CHECK_CUDA(cudaFree(d.counter));
  CHECK_CUDA(cudaFree(d.ll));
}

void run_launches(const Device& d, cudaStream_t stream) {
  for (int s = 0; s < d.c.steps; ++s) {
    kc::SkinnyGemmParams p;
    p.x = d.c.x[s];
    p.x_stride = d.c.in[s];
    p.rows = 1;
    p.in = d.c.in[s];
    p.outputs[0] = {d.c.w[s], d.c.n[s], d.c.x[s + 1], d.c.n[s]};
    p.num_outputs = 1;
    p.y_bf16 = true;
    CHECK_STATUS(kc::skinny_gemm(p, stream));
  }
}

void run_persistent(const Device& d, int mode, cudaStream_t stream) {
  int sms = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  CHECK_CUDA(cudaMemsetAsync(d.counter, 0, sizeof(unsigned), stream));
  void* args[] = {const_cast<Chain*>(&d.c), const_cast<unsigned**>(&d.counter), &mode};
  // Cooperative: every CTA resident at once (the grid-wide counter waits on all of them).
  CHECK_CUDA(cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(chain_kernel), dim3(sms), dim3(kThreads), args,
                                         kSmemBytes, stream));
}

// mode 1: consumers wait for each step; 2: nobody waits (timing only).
void run_ring(const Device& d, int mode, cudaStream_t stream) {
  int sms = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  CHECK_CUDA(cudaMemsetAsync(d.counter, 0, sizeof(unsigned), stream));
  void* args[] = {const_cast<Chain*>(&d.c), const_cast<unsigned**>(&d.counter), &mode};
  CHECK_CUDA(cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(chain_ring_kernel), dim3(sms),
                                         dim3(kRingThreads), args, kRingSmemBytes, stream));
}

// mode 1: each warp waits for its input's words, 4: with a sleep between polls; 2: nobody waits, 3: x constant (both
// timing only). `epoch`: new on every launch.
void run_ll(const Device& d, int mode, unsigned epoch, cudaStream_t stream) {
  for (int s = 0; s < d.c.steps; ++s) {
    if (d.c.in[s] != 2304 && d.c.in[s] != 4096) {
      std::fprintf(stderr, "gemv_chain: chain_ll_kernel takes inputs of 2304 or 4096 only\n");
      std::exit(1);
    }
  }
  int sms = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  uint32_t* ll = d.ll;
  void* args[] = {const_cast<Chain*>(&d.c), &ll, &epoch, &mode};
  // Cooperative: every CTA resident at once (warps wait on each other's words).
  CHECK_CUDA(cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(chain_ll_kernel), dim3(sms), dim3(kRingThreads),
                                         args, kLLSmemBytes, stream));
}

// mode 1: the CTA waits for its input's words; 2: nobody waits (timing only). `epoch`: new on every launch.
void run_ll_cta(const Device& d, int mode, unsigned epoch, cudaStream_t stream) {
  int sms = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  uint32_t* ll = d.ll;
  void* args[] = {const_cast<Chain*>(&d.c), &ll, &epoch, &mode};
  CHECK_CUDA(cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(chain_ll_cta_kernel), dim3(sms),
                                         dim3(kRingThreads), args, kLLCtaSmemBytes, stream));
}

std::vector<float> download(const __nv_bfloat16* p, int n) {
  std::vector<__nv_bfloat16> h(n);
  CHECK_CUDA(cudaMemcpy(h.data(), p, n * 2, cudaMemcpyDeviceToHost));
  std::vector<float> f(n);
  for (int i = 0; i < n; ++i) f[i] = to_float(h[i]);
  return f;
}

// The bf16 of n LL words; NaN where a word does not carry `tag` (not written in that launch).
std::vector<float> download_ll(const uint32_t* p, int n, uint32_t tag) {
  std::vector<uint32_t> h(n);
  CHECK_CUDA(cudaMemcpy(h.data(), p, n * sizeof(uint32_t), cudaMemcpyDeviceToHost));
  std::vector<float> f(n);
  for (int i = 0; i < n; ++i) {
    __nv_bfloat16_raw raw;
    raw.x = static_cast<unsigned short>(h[i] & 0xffffu);
    f[i] = (h[i] >> 16) == tag ? to_float(__nv_bfloat16(raw)) : NAN;
  }
  return f;
}

// The CPU chain's first `steps` outputs (double sums, bf16 rounding between steps).
std::vector<float> cpu_chain(int steps, const std::vector<std::vector<__nv_bfloat16>>& w,
                             const std::vector<__nv_bfloat16>& x0) {
  std::vector<float> x(x0.size());
  for (size_t i = 0; i < x0.size(); ++i) x[i] = to_float(x0[i]);
  for (int s = 0; s < steps; ++s) {
    const int in = s % 2 == 0 ? 2304 : 4096, n = s % 2 == 0 ? 4096 : 2304;
    std::vector<float> y(n);
    for (int r = 0; r < n; ++r) {
      double sum = 0.0;
      for (int k = 0; k < in; ++k) sum += static_cast<double>(to_float(w[s][static_cast<size_t>(r) * in + k])) * x[k];
      y[r] = to_float(__float2bfloat16(static_cast<float>(sum)));
    }
    x = y;
  }
  return x;
}

// Largest |a - b| / (|b| + 2^-7 rms(b)) over the elements: bf16 rounding of two sums of different order can differ
// by one ulp (2^-8 relative) at the last step and by a little more once it propagates through a step.
double max_rel(const std::vector<float>& a, const std::vector<float>& b) {
  double sq = 0.0;
  for (float v : b) sq += static_cast<double>(v) * v;
  const double floor_ = std::ldexp(std::sqrt(sq / static_cast<double>(b.size())), -7);
  double worst = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double err = std::fabs(static_cast<double>(a[i]) - b[i]) / (std::fabs(static_cast<double>(b[i])) + floor_);
    worst = std::isnan(err) ? INFINITY : std::max(worst, err);
  }
  return worst;
}

}  // namespace

int main(int argc, char** argv) {
  int steps = 52;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--steps") == 0 && i + 1 < argc) {
      steps = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: gemv_chain [--steps N (2..%d, even)]\n", kMaxSteps);
      return 2;
    }
  }
  if (steps < 2 || steps > kMaxSteps || steps % 2 != 0) {
    std::fprintf(stderr, "gemv_chain: --steps must be an even number in [2, %d]\n", kMaxSteps);
    return 2;
  }
  CHECK_CUDA(cudaFuncSetAttribute(reinterpret_cast<const void*>(chain_kernel),
                                  cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSmemBytes)));
  CHECK_CUDA(cudaFuncSetAttribute(reinterpret_cast<const void*>(chain_ring_kernel),
                                  cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kRingSmemBytes)));
  CHECK_CUDA(cudaFuncSetAttribute(reinterpret_cast<const void*>(chain_ll_kernel),
                                  cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kLLSmemBytes)));
  CHECK_CUDA(cudaFuncSetAttribute(reinterpret_cast<const void*>(chain_ll_cta_kernel),
                                  cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kLLCtaSmemBytes)));
  std::vector<std::vector<__nv_bfloat16>> w(steps);
  for (int s = 0; s < steps; ++s) {
    const int in = s % 2 == 0 ? 2304 : 4096, n = s % 2 == 0 ? 4096 : 2304;
    w[s] = random_bf16(static_cast<size_t>(n) * in, 1.0f / std::sqrt(static_cast<float>(in)), 100 + s);
  }
  const std::vector<__nv_bfloat16> x0 = random_bf16(2304, 1.0f, 7);
  cudaStream_t stream = nullptr;
  CHECK_CUDA(cudaStreamCreate(&stream));
  Device d = make_device(steps, w, x0);

  // Correctness: the first two steps of each variant against the CPU.
  const std::vector<float> reference = cpu_chain(2, w, x0);
  Device two = d;
  two.c.steps = 2;
  bool ok = true;
  unsigned epoch = 0;  // chain_ll_kernel's: one more for every launch
  for (int variant = 0; variant < 6; ++variant) {
    CHECK_CUDA(cudaMemset(d.c.x[2], 0xff, kMaxIn * 2));
    if (variant == 0) run_launches(two, stream);
    if (variant == 1 || variant == 2) run_persistent(two, variant == 1 ? 1 : 0, stream);
    if (variant == 3) run_ring(two, 1, stream);
    if (variant == 4) run_ll(two, 1, ++epoch, stream);
    if (variant == 5) run_ll_cta(two, 1, ++epoch, stream);
    CHECK_CUDA(cudaStreamSynchronize(stream));
    const double err = max_rel(
        variant >= 4 ? download_ll(d.ll + 2 * kMaxIn, 2304, ll_tag(epoch, 1)) : download(d.c.x[2], 2304), reference);
    const char* name = variant == 0   ? "launches"
                       : variant == 1 ? "persistent"
                       : variant == 2 ? "persistent, no run-ahead"
                       : variant == 3 ? "persistent, cp.async ring per warp"
                       : variant == 4 ? "persistent, LL flags in the data"
                                      : "persistent, LL words gathered once per CTA";
    std::fprintf(stderr, "gemv_chain: %s, two steps against the CPU: max relative error %.3g\n", name, err);
    if (!(err <= 0.02)) ok = false;
  }
  if (!ok) {
    std::fprintf(stderr, "gemv_chain: a variant disagrees with the CPU reference\n");
    return 1;
  }

  // Timing: the launches as a CUDA graph, the persistent kernel as one cooperative launch, each 20 times.
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  run_launches(d, stream);
  CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
  CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));
  const double bandwidth = copy_bandwidth();
  const double floor_us = 1e6 * d.weight_bytes / bandwidth;
  const char* names[] = {"launches (skinny_gemm, PDL, graph)",
                         "persistent (producer runs ahead)",
                         "persistent (producer waits at each step)",
                         "persistent without the dependency (timing only)",
                         "persistent, cp.async ring per warp (runs ahead)",
                         "persistent, cp.async ring per warp, without the dependency (timing only)",
                         "persistent, LL flags in the data (runs ahead)",
                         "persistent, LL flags in the data, without the dependency (timing only)",
                         "persistent, LL flags in the data, 256 ns between polls (runs ahead)",
                         "persistent, LL flags in the data, x constant from L1 (timing only)",
                         "persistent, LL words gathered once per CTA (runs ahead)",
                         "persistent, LL words gathered once per CTA, without the dependency (timing only)"};
  constexpr int kVariants = 12;
  std::vector<float> finals[kVariants];
  for (int variant = 0; variant < kVariants; ++variant) {
    constexpr int kRuns = 20;
    std::vector<float> times;
    for (int run = 0; run < kRuns + 3; ++run) {
      CHECK_CUDA(cudaEventRecord(e0, stream));
      if (variant == 0) {
        CHECK_CUDA(cudaGraphLaunch(exec, stream));
      } else if (variant <= 3) {
        run_persistent(d, variant == 1 ? 1 : variant == 2 ? 0 : 2, stream);
      } else if (variant <= 5) {
        run_ring(d, variant == 4 ? 1 : 2, stream);
      } else if (variant >= 10) {
        run_ll_cta(d, variant == 10 ? 1 : 2, ++epoch, stream);
      } else {
        const int mode = variant == 6 ? 1 : variant == 7 ? 2 : variant == 8 ? 4 : 3;
        run_ll(d, mode, ++epoch, stream);  // a new epoch: the last run's words never match
      }
      CHECK_CUDA(cudaEventRecord(e1, stream));
      CHECK_CUDA(cudaEventSynchronize(e1));
      float ms = 0.0f;
      CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
      if (run >= 3) times.push_back(1e3f * ms);
    }
    std::sort(times.begin(), times.end());
    const double median = times[times.size() / 2];
    // An even number of steps ends at width 2304.
    finals[variant] = variant >= 6
                          ? download_ll(d.ll + static_cast<size_t>(steps) * kMaxIn, 2304, ll_tag(epoch, steps - 1))
                          : download(d.c.x[steps], 2304);
    const char* name = names[variant];
    std::printf(
        "{\"bench\": \"gemv_chain\", \"case\": \"%d steps 2304->4096->2304...,batch 1,%s\", \"metric\": \"time\", "
        "\"value\": %.2f, \"unit\": \"us\", \"limit\": %.2f, \"ratio_to_limit\": %.4f, \"per_step_us\": %.3f, "
        "\"weight_bytes\": %.0f, \"copy_bytes_per_s\": %.4g}\n",
        steps, name, median, floor_us, floor_us / median, median / steps, d.weight_bytes, bandwidth);
  }
  // After many steps the two summation orders' bf16 roundings have spread through every element, so the final
  // outputs are compared as vectors (|a - b| / |b|; ~2^-8 a step adds up to a few percent over 52 steps).
  for (int variant : {1, 2, 4, 6, 8, 10}) {
    double diff = 0.0, norm = 0.0;
    for (size_t i = 0; i < finals[0].size(); ++i) {
      const double dv = static_cast<double>(finals[variant][i]) - finals[0][i];
      diff += dv * dv;
      norm += static_cast<double>(finals[0][i]) * finals[0][i];
    }
    std::fprintf(stderr, "gemv_chain: final outputs, %s against launches: relative difference %.3g (of the norm)\n",
                 names[variant], std::sqrt(diff / norm));
  }
  CHECK_CUDA(cudaGraphExecDestroy(exec));
  CHECK_CUDA(cudaGraphDestroy(graph));
  free_device(d);
  CHECK_CUDA(cudaStreamDestroy(stream));
  return 0;
}
