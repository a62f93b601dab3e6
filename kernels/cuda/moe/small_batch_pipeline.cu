// Launches 2 and 3 of the small-batch MoE layer (contract in moe.hpp; launch 1 and the design of the whole layer in
// small_batch.cu).
//
// Both kernels stream weight rows through a ring of shared-memory stages: one producer warp issues bulk copies
// (cp.async.bulk, L2 evict-first: the weights are read once per step) of 16 weight-row segments per stage, lane r
// the copy of row r (one issuing thread cannot keep enough copies in flight), and tracks them with mbarriers (lane 0
// waits, expects the bytes and issues the activation rows); eight consumer warps split each stage's k16 steps among
// themselves and run mma.sync m16n8k16 (bf16 in, fp32 accumulators) with the weight rows as A and up to 16 token
// rows as B (one or two n tiles, rows past the item's count read a zero row), then add their partial tiles in warp
// order through shared memory (deterministic). Tensor cores rather than CUDA-core dot products: a weight row's bytes
// cost two ldmatrix and one mma per 16 k instead of 16 fma and 16 unpacks per token. Staged rows are padded to an
// odd number of 16-byte chunks (conflict-free ldmatrix); a row ending on a half k16 step has that step's upper k half
// zeroed in A and B. The rings hold 3-4 stages of 16 rows, 70-150 KB per SM, well above the bytes in flight that the
// copy rate needs at the memory latency.
//
// Launch 2 (gate/up + GLU), one CTA per SM, persistent: the work items are the shared expert's column blocks, then
// every active expert's (8 gate rows + the matching 8 up rows = one m16 tile, so a lane holds gate and up of the
// same column and applies the GLU in registers), dealt round-robin over the CTAs (item i to CTA i % grid: within
// one item of each other). x (all T rows) is staged once per CTA. The shared expert's items need nothing from
// launch 1, so they stream before the grid waits for it: with programmatic dependent launch this runs while
// launch 1 routes, followed by an L2 prefetch of the shared expert's down rows (launch 3 reads them first; the
// routed streams are evict-first, so they should stay). Then the producer warp waits, loads the routing (active
// experts, their first plan row and row count, the token of each plan row) into shared memory, and the routed
// items follow.
//
// Launch 3 (down + combine), one CTA per 16 output columns (two per SM): the items are the shared expert (its down
// rows prefetched into L2 by launch 2) and every active expert, each a stage of its 16 down rows plus its
// activation rows (contiguous plan rows), per k segment; whole 2 KB rows (I = 1024) in two stages. The routing is
// launch 1's output, complete before this grid starts (launch 2 starts its dependents only after waiting for
// launch 1), so the producer reads it and issues the first stages' weight rows before the grid waits for launch 2;
// the activation rows of those stages follow the wait. The expert outputs y[row, d] stay in shared memory until
// the combine adds them to the residual (the order of moe_combine); the routing weights, plan positions and residual
// values it needs are loaded when the CTA starts, so its tail is the store only.
#include <algorithm>
#include <cstdint>
#include <string>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kernels/cuda/common/detail/bf16_stream.cuh"
#include "kernels/cuda/common/detail/mma_sm80.cuh"
#include "kernels/cuda/common/detail/sm90_ptx.cuh"
#include "kernels/cuda/moe/detail/small_batch.cuh"

namespace deltaserve::kernels::cuda::moe_small_batch_detail {
namespace {

constexpr int kConsumerWarps = 8;
constexpr int kConsumerThreads = 32 * kConsumerWarps;
constexpr int kProducerWarp = kConsumerWarps;  // the last warp
constexpr int kPipelineThreads = kConsumerThreads + 32;
constexpr int kConsumerBarrier = 1;             // named barrier of the consumer warps (0: __syncthreads)
constexpr int kTileRows = 16;                   // weight rows per stage: one m16 tile
constexpr int kColumnsPerItem = kTileRows / 2;  // gate/up: 8 gate rows and the 8 matching up rows
constexpr int kMaxStages = 4;                   // the deepest ring
constexpr int kMinStages = 3;                   // the shallowest gate/up ring
constexpr int kDownMinStages = 2;        // the shallowest down ring: whole 2 KB rows in two stages beat halves in four
constexpr int kGateUpMaxSegment = 1152;  // k elements per staged row segment (hidden 2304: two)
constexpr int kDownMaxSegment = 1024;
constexpr size_t kGateUpSmemBudget = 180 * 1024;  // one CTA per SM, room for a launch-1 CTA beside it
constexpr size_t kDownSmemBudget = 112 * 1024;    // two CTAs per SM (144 CTAs at hidden 2304, 132 SMs)

// Launch shape and shared-memory layout of one expert launch (byte offsets from the dynamic base).
//   [barriers: full[kMaxStages], empty[kMaxStages], x_full, tables_ready] [tables] [reduce: 2 buffers]
//   [gate/up: x rows (T + 1, the last one zero) | down: ys (R + T rows of 16 floats), zero row, the routing weights
//   and plan positions (R each)] [stages]
struct Pipeline {
  int stages = 0;       // ring depth; 0: the shapes do not fit
  int segment = 0;      // k elements per staged row segment, a multiple of 16
  int row_bytes = 0;    // stride of a staged row: 2 * segment + 16 (an odd number of 16-byte chunks)
  int stage_rows = 0;   // 16 weight rows, + T activation rows (down)
  int n_tiles = 0;      // token tiles of 8 per mma: 1 (T <= 8) or 2
  int x_row_bytes = 0;  // gate/up: stride of the staged x rows (an odd number of 16-byte chunks)
  uint32_t tables = 0, reduce = 0, extra = 0, zero_row = 0, combine = 0, ring = 0;
  uint32_t smem_bytes = 0;
};

struct PipelineArgs {
  LayerArgs a;
  Pipeline pipe;
  int shared_items;   // gate/up: column blocks of the shared expert (0 without one)
  int column_blocks;  // gate/up: I / 8
};

constexpr uint32_t kBarrierBytes = (2 * kMaxStages + 2) * sizeof(uint64_t);

__host__ __device__ constexpr uint32_t align16(size_t bytes) {
  return static_cast<uint32_t>((bytes + 15) / 16 * 16);
}

// Floats of one reduce buffer: [warp][register of the n tiles][lane].
__host__ __device__ constexpr int reduce_floats(int n_tiles) {
  return kConsumerWarps * 4 * n_tiles * 32;
}

// ---- shared memory --------------------------------------------------------------------------------------------

__device__ __forceinline__ uint32_t full_barrier(uint32_t base, int stage) {
  return base + 8u * stage;
}
__device__ __forceinline__ uint32_t empty_barrier(uint32_t base, int stage) {
  return base + 8u * (kMaxStages + stage);
}
__device__ __forceinline__ uint32_t x_full_barrier(uint32_t base) {
  return base + 8u * (2 * kMaxStages);
}
__device__ __forceinline__ uint32_t tables_barrier(uint32_t base) {
  return base + 8u * (2 * kMaxStages + 1);
}

// The routing of launch 1 in shared memory, written by the producer warp and read by every warp after the
// tables barrier.
struct Tables {
  int* num_active;  // [1]
  int* expert;      // [active_capacity]: expert of active slot s
  int* first;       // [active_capacity]: its first plan row
  int* count;       // [active_capacity]: its row count
  int* token;       // [R]: token of plan row p (gate/up)
};

__device__ __forceinline__ Tables tables_at(unsigned char* smem, const PipelineArgs& p) {
  Tables t;
  t.num_active = reinterpret_cast<int*>(smem + p.pipe.tables);
  t.expert = t.num_active + 1;
  t.first = t.expert + p.a.active_capacity;
  t.count = t.first + p.a.active_capacity;
  t.token = t.count + p.a.active_capacity;
  return t;
}

// Loads the routing into the tables (the whole producer warp; one round trip: the slots are read up to the
// capacity, those past the count are never used). Launch 1 must have completed: read from L2.
__device__ void load_tables(const LayerArgs& a, const Tables& t, bool tokens) {
  const int lane = threadIdx.x & 31;
  if (lane == 0) *t.num_active = __ldcg(a.num_active);
  for (int s = lane; s < a.active_capacity; s += 32) {
    t.expert[s] = __ldcg(a.active + s);
    t.first[s] = __ldcg(a.slot_first + s);
    t.count[s] = __ldcg(a.slot_count + s);
  }
  if (tokens) {
    for (int row = lane; row < a.R; row += 32) t.token[row] = __ldcg(a.sorted + row) / a.k;
  }
  __syncwarp();
}

// Position in the stage ring: consumers wait on full[stage] with parity `phase`, the producer on empty[stage] with
// the opposite parity (a fresh barrier counts its phase before 0 as complete, so the first pass does not wait).
struct Ring {
  int stage = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void advance(int stages) {
    if (++stage == stages) {
      stage = 0;
      phase ^= 1u;
    }
  }
};

__device__ __forceinline__ uint32_t stage_address(uint32_t base, const Pipeline& pipe, int stage) {
  return base + pipe.ring + static_cast<uint32_t>(stage * pipe.stage_rows * pipe.row_bytes);
}

__device__ __forceinline__ void consumer_barrier() {
  asm volatile("bar.sync %0, %1;\n" ::"n"(kConsumerBarrier), "n"(kConsumerThreads) : "memory");
}

// ---- consumer math --------------------------------------------------------------------------------------------

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address)
               : "memory");
}

// This lane's ldmatrix address offsets at k = 0: A (16 weight rows, row stride row_bytes) and the B row it reads
// (token row n of the item; the caller maps n to an address) plus its k offset.
__device__ __forceinline__ uint32_t a_lane_offset(int row_bytes) {
  const int lane = threadIdx.x & 31;
  return static_cast<uint32_t>((lane & 15) * row_bytes + (lane >> 4) * 16);
}
__device__ __forceinline__ int b_lane_row() {
  const int lane = threadIdx.x & 31;
  return (lane & 7) + ((lane >> 4) << 3);
}
__device__ __forceinline__ uint32_t b_lane_k_offset() {
  return static_cast<uint32_t>(((threadIdx.x >> 3) & 1) * 16);
}

// c += this warp's k16 steps (s = warp, warp + 8, ...) of one staged segment `len` elements long (a multiple of 8):
// A = the 16 weight rows at a_address, B = the token rows at b_address (both this lane's ldmatrix addresses at
// k = 0). A last half step has its k 8..15 halves zeroed (whatever lies past the row is never used).
__device__ __forceinline__ void mma_segment(uint32_t a_address, uint32_t b_address, int len, int n_tiles,
                                            float (&c)[2][4]) {
  const int warp = threadIdx.x >> 5;
  const int steps = (len + 15) >> 4;
  for (int s = warp; s < steps; s += kConsumerWarps) {
    uint32_t a[4], b[4];
    ldmatrix_x4(a, a_address + 32u * s);
    ldmatrix_x4(b, b_address + 32u * s);
    if (16 * s + 8 >= len) {
      a[2] = a[3] = 0u;
      b[1] = b[3] = 0u;
    }
    detail::mma_bf16_16816(c[0], a, b[0], b[1]);
    if (n_tiles > 1) detail::mma_bf16_16816(c[1], a, b[2], b[3]);
  }
}

// Publishes this warp's partial tile into reduce buffer `buffer` and waits for the other consumer warps: after
// it, thread (lane, warp r) may add register r of every warp's tile, in warp order (reduced_register).
__device__ __forceinline__ void publish_partials(float* buffer, const float (&c)[2][4], int n_tiles) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int registers = 4 * n_tiles;
#pragma unroll
  for (int r = 0; r < 8; ++r) {
    if (r < registers) buffer[(warp * registers + r) * 32 + lane] = c[r >> 2][r & 3];
  }
  consumer_barrier();
}
__device__ __forceinline__ float reduced_register(const float* buffer, int r, int n_tiles) {
  const int lane = threadIdx.x & 31;
  const int registers = 4 * n_tiles;
  float v = buffer[r * 32 + lane];
#pragma unroll
  for (int w = 1; w < kConsumerWarps; ++w) v += buffer[(w * registers + r) * 32 + lane];
  return v;
}

// ---- launch 2: gate/up + GLU ----------------------------------------------------------------------------------

// Stages of one gate/up item: rows j0..j0+7 (gate) and inter+j0..inter+j0+7 (up) of `w` ([2 inter, hidden]), one
// stage per k segment. Called by the whole producer warp: lane r copies row r, lane 0 also waits for the stage and
// expects its bytes (the others wait on the same barriers).
__device__ void issue_gate_up_item(const PipelineArgs& p, uint32_t base, Ring& ring, const __nv_bfloat16* w, int inter,
                                   int j0, uint64_t policy) {
  const LayerArgs& a = p.a;
  const Pipeline& pipe = p.pipe;
  const int lane = threadIdx.x & 31;
  for (int k0 = 0; k0 < a.hidden; k0 += pipe.segment) {
    const uint32_t bytes = 2u * static_cast<uint32_t>(min(pipe.segment, a.hidden - k0));
    const uint32_t full = full_barrier(base, ring.stage);
    sm90::mbarrier_wait(empty_barrier(base, ring.stage), ring.phase ^ 1u);
    if (lane == 0) sm90::mbarrier_arrive_expect_tx(full, kTileRows * bytes);
    __syncwarp();
    const uint32_t dst = stage_address(base, pipe, ring.stage);
    for (int r = lane; r < kTileRows; r += 32) {
      const int row = r < kColumnsPerItem ? j0 + r : inter + j0 + r - kColumnsPerItem;
      detail::bulk_copy_to_shared(dst + r * pipe.row_bytes, w + static_cast<int64_t>(row) * a.hidden + k0, bytes, full,
                                  policy);
    }
    ring.advance(pipe.stages);
  }
}

// This CTA's share (a contiguous 1 / gridDim.x of the bytes) of the shared expert's down matrix into L2: launch 3
// reads it first, and nothing else is known to stream while launch 1 routes. (The next layer's first weights are not
// prefetched as well: that made the decode step slower.)
__device__ void prefetch_shared_down(const LayerArgs& a) {
  constexpr int64_t kPiece = 32 * 1024;
  const int64_t chunks = static_cast<int64_t>(a.hidden) * a.shared_inter / 8;  // 16-byte chunks
  const int64_t begin = chunks * blockIdx.x / gridDim.x, end = chunks * (blockIdx.x + 1) / gridDim.x;
  const char* matrix = reinterpret_cast<const char*>(a.shared_down);
  for (int64_t offset = 16 * begin; offset < 16 * end; offset += kPiece) {
    const int64_t bytes = 16 * end - offset < kPiece ? 16 * end - offset : kPiece;
    detail::bulk_prefetch_l2(matrix + offset, static_cast<uint32_t>(bytes));
  }
}

__device__ void gate_up_producer(const PipelineArgs& p, uint32_t base, const Tables& t) {
  const LayerArgs& a = p.a;
  const Pipeline& pipe = p.pipe;
  const int lane = threadIdx.x & 31;
  const int ctas = static_cast<int>(gridDim.x);
  Ring ring;
  int item = static_cast<int>(blockIdx.x);
  const uint64_t policy = detail::l2_evict_first_policy();
  if (lane == 0) {
    // x was written before launch 1 started (launch 1 starts its dependents after its own wait): complete now. With
    // the fused norm the consumers stage x themselves.
    if (a.norm_weight == nullptr) {
      const uint32_t x_bytes = 2u * static_cast<uint32_t>(a.hidden);
      sm90::mbarrier_arrive_expect_tx(x_full_barrier(base), static_cast<uint32_t>(a.T) * x_bytes);
      for (int token = 0; token < a.T; ++token) {
        detail::bulk_copy_to_shared(base + pipe.extra + token * pipe.x_row_bytes, a.x + token * a.x_stride, x_bytes,
                                    x_full_barrier(base));
      }
    }
  }
  for (; item < p.shared_items; item += ctas) {
    issue_gate_up_item(p, base, ring, a.shared_gate_up, a.shared_inter, kColumnsPerItem * item, policy);
  }
  if (lane == 0 && a.shared_down != nullptr) prefetch_shared_down(a);
  __syncwarp();
  grid_dependency_wait();  // launch 1: the routing
  if (lane == 0) allow_dependent_grids();
  load_tables(a, t, true);
  if (lane == 0) sm90::mbarrier_arrive(tables_barrier(base));
  const int items = p.shared_items + *t.num_active * p.column_blocks;
  for (; item < items; item += ctas) {
    const int routed = item - p.shared_items;
    const int slot = routed / p.column_blocks, block = routed - slot * p.column_blocks;
    const __nv_bfloat16* w = a.gate_up + static_cast<int64_t>(t.expert[slot]) * 2 * a.inter * a.hidden;
    issue_gate_up_item(p, base, ring, w, a.inter, kColumnsPerItem * block, policy);
  }
}

// One item: rows n < count are tokens token_of(n) of x (the zero row past the count); out: column j0 of the item's
// first output row, row stride out_stride.
__device__ void consume_gate_up_item(const PipelineArgs& p, uint32_t base, Ring& ring, float* reduce, int& parity,
                                     const int* tokens, int count, __nv_bfloat16* out, int64_t out_stride) {
  const LayerArgs& a = p.a;
  const Pipeline& pipe = p.pipe;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int n = b_lane_row();
  const int x_row = n < count ? (tokens != nullptr ? tokens[n] : n) : a.T;
  const uint32_t b_address = base + pipe.extra + x_row * pipe.x_row_bytes + b_lane_k_offset();
  const uint32_t a_offset = a_lane_offset(pipe.row_bytes);
  const int n_tiles = count > 8 ? 2 : 1;
  float c[2][4] = {};
  for (int k0 = 0; k0 < a.hidden; k0 += pipe.segment) {
    sm90::mbarrier_wait(full_barrier(base, ring.stage), ring.phase);
    mma_segment(stage_address(base, pipe, ring.stage) + a_offset, b_address + 2u * k0, min(pipe.segment, a.hidden - k0),
                n_tiles, c);
    __syncwarp();
    if (lane == 0) sm90::mbarrier_arrive(empty_barrier(base, ring.stage));
    ring.advance(pipe.stages);
  }
  float* buffer = reduce + parity * reduce_floats(pipe.n_tiles);
  parity ^= 1;
  publish_partials(buffer, c, pipe.n_tiles);
  // Thread (lane, r) with r a gate register (0, 1 of each n tile): registers r and r + 2 are gate and up of
  // column j0 + lane / 4 for item row 8 (r / 4) + 2 (lane % 4) + r % 2.
  const int r = warp;
  if (r < 4 * pipe.n_tiles && (r & 2) == 0) {
    const float gate = reduced_register(buffer, r, pipe.n_tiles);
    const float up = reduced_register(buffer, r + 2, pipe.n_tiles);
    const int row = (r >> 2) * 8 + 2 * (lane & 3) + (r & 1);
    if (row < count) out[row * out_stride + (lane >> 2)] = __float2bfloat16(glu(a.glu, gate, up));
  }
}

// The fused input norm (LayerArgs::norm_weight): the consumer warps write x's rows, normalised and rounded to bf16 as
// rms_norm_dual does, into the staged x rows. x_f32 was written before launch 1 started, like the unfused x. The
// reduce buffer is free until the first item ends.
__device__ void stage_normed_x(const PipelineArgs& p, unsigned char* smem, float* reduce) {
  const LayerArgs& a = p.a;
  __shared__ float inverse_rms[kMaxTokens];
  const int tid = static_cast<int>(threadIdx.x);  // consumer threads are 0 .. kConsumerThreads - 1
  rows_inverse_rms(a.x_f32, a.x_f32_stride, a.hidden, a.T, a.norm_eps, tid, reduce, inverse_rms,
                   [] { consumer_barrier(); });
  for (int t = 0; t < a.T; ++t) {
    const float* x_row = a.x_f32 + t * a.x_f32_stride;
    auto* row = reinterpret_cast<__nv_bfloat16*>(smem + p.pipe.extra + t * p.pipe.x_row_bytes);
    const float inverse = inverse_rms[t];
    for (int c = tid; c < a.hidden; c += kConsumerThreads) {
      row[c] = __float2bfloat16_rn(x_row[c] * inverse * a.norm_weight[c]);
    }
  }
  consumer_barrier();
}

__device__ void gate_up_consumer(const PipelineArgs& p, unsigned char* smem, uint32_t base, const Tables& t,
                                 float* reduce) {
  const LayerArgs& a = p.a;
  const int ctas = static_cast<int>(gridDim.x);
  Ring ring;
  int parity = 0;
  int item = static_cast<int>(blockIdx.x);
  if (a.norm_weight != nullptr) {
    stage_normed_x(p, smem, reduce);
  } else {
    sm90::mbarrier_wait(x_full_barrier(base), 0);
  }
  for (; item < p.shared_items; item += ctas) {
    const int j0 = kColumnsPerItem * item;
    consume_gate_up_item(p, base, ring, reduce, parity, nullptr, a.T, a.shared_activated + j0, a.shared_inter);
  }
  sm90::mbarrier_wait(tables_barrier(base), 0);
  const int items = p.shared_items + *t.num_active * p.column_blocks;
  for (; item < items; item += ctas) {
    const int routed = item - p.shared_items;
    const int slot = routed / p.column_blocks, block = routed - slot * p.column_blocks;
    const int first = t.first[slot];
    consume_gate_up_item(p, base, ring, reduce, parity, t.token + first, t.count[slot],
                         a.activated + static_cast<int64_t>(first) * a.inter + kColumnsPerItem * block, a.inter);
  }
}

__device__ void init_pipeline_barriers(uint32_t base, int stages) {
  for (int s = 0; s < stages; ++s) {
    sm90::mbarrier_init(full_barrier(base, s), 1);
    sm90::mbarrier_init(empty_barrier(base, s), kConsumerWarps);
  }
  sm90::mbarrier_init(x_full_barrier(base), 1);
  sm90::mbarrier_init(tables_barrier(base), 1);
  sm90::mbarrier_init_fence();
}

// Zero bytes [offset, offset + bytes) of shared memory (bytes a multiple of 16), all threads.
__device__ void zero_shared(unsigned char* smem, uint32_t offset, int bytes) {
  for (int i = threadIdx.x; i < bytes / 16; i += blockDim.x) {
    reinterpret_cast<uint4*>(smem + offset)[i] = make_uint4(0u, 0u, 0u, 0u);
  }
}

__global__ void __launch_bounds__(kPipelineThreads, 1) pipeline_gate_up_kernel(const __grid_constant__ PipelineArgs p) {
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t base = detail::smem_address(smem);
  if (threadIdx.x == 0) init_pipeline_barriers(base, p.pipe.stages);
  zero_shared(smem, p.pipe.extra + p.a.T * p.pipe.x_row_bytes, p.pipe.x_row_bytes);  // the zero x row
  __syncthreads();
  const Tables t = tables_at(smem, p);
  if (static_cast<int>(threadIdx.x >> 5) == kProducerWarp) {
    gate_up_producer(p, base, t);
  } else {
    gate_up_consumer(p, smem, base, t, reinterpret_cast<float*>(smem + p.pipe.reduce));
  }
}

// ---- launch 3: down + combine ---------------------------------------------------------------------------------

// Where the stage of fill f of a down CTA comes from: the first of its weight rows (row d0 of the expert's down
// matrix, at the segment's k) and of its activation rows, both with row stride `k_total`.
struct DownFill {
  const __nv_bfloat16* weights;
  const __nv_bfloat16* activations;
  int k_total, count;
  uint32_t bytes;  // per row
};

__device__ __forceinline__ int shared_down_segments(const PipelineArgs& p) {
  return p.a.shared_down != nullptr ? (p.a.shared_inter + p.pipe.segment - 1) / p.pipe.segment : 0;
}
__device__ __forceinline__ int routed_down_segments(const PipelineArgs& p) {
  return (p.a.inter + p.pipe.segment - 1) / p.pipe.segment;
}

// Fills: the shared expert's segments (its rows were prefetched into L2 by launch 2), then every active slot's in
// slot order.
__device__ DownFill down_fill(const PipelineArgs& p, const Tables& t, int f, int d0) {
  const LayerArgs& a = p.a;
  const int shared_fills = shared_down_segments(p);
  DownFill fill;
  int k0;
  if (f < shared_fills) {
    k0 = f * p.pipe.segment;
    fill.k_total = a.shared_inter;
    fill.count = a.T;
    fill.weights = a.shared_down + static_cast<int64_t>(d0) * a.shared_inter + k0;
    fill.activations = a.shared_activated + k0;
  } else {
    const int routed_segments = routed_down_segments(p);
    const int slot = (f - shared_fills) / routed_segments;
    k0 = (f - shared_fills - slot * routed_segments) * p.pipe.segment;
    fill.k_total = a.inter;
    fill.count = t.count[slot];
    fill.weights = a.down + (static_cast<int64_t>(t.expert[slot]) * a.hidden + d0) * a.inter + k0;
    fill.activations = a.activated + static_cast<int64_t>(t.first[slot]) * a.inter + k0;
  }
  fill.bytes = 2u * static_cast<uint32_t>(min(p.pipe.segment, fill.k_total - k0));
  return fill;
}

// The first fill of item `item` (the shared expert first when there is one, then the active slots).
__device__ __forceinline__ int down_item_first_fill(const PipelineArgs& p, int item) {
  const int has_shared = p.a.shared_down != nullptr ? 1 : 0;
  return min(item, has_shared) * shared_down_segments(p) + max(0, item - has_shared) * routed_down_segments(p);
}

// Items of a down CTA (every CTA takes all of them for its 16-column tile): the shared expert, then the active slots.
__device__ __forceinline__ int down_items(const PipelineArgs& p, int num_active) {
  return (p.a.shared_down != nullptr ? 1 : 0) + num_active;
}

__device__ void issue_down_activations(const PipelineArgs& p, uint32_t base, const DownFill& fill, int stage) {
  const uint32_t dst = stage_address(base, p.pipe, stage) + kTileRows * p.pipe.row_bytes;
  for (int n = 0; n < fill.count; ++n) {
    detail::bulk_copy_to_shared(dst + n * p.pipe.row_bytes, fill.activations + static_cast<int64_t>(n) * fill.k_total,
                                fill.bytes, full_barrier(base, stage));
  }
}

// Launch 2 complete and its activations visible to this thread's bulk copies.
__device__ __forceinline__ void wait_for_activations() {
  grid_dependency_wait();
  allow_dependent_grids();
  detail::fence_proxy_async_global();
}

__device__ void down_producer(const PipelineArgs& p, uint32_t base, const Tables& t) {
  const LayerArgs& a = p.a;
  const Pipeline& pipe = p.pipe;
  // Launch 1 completed before this grid started (launch 2 starts its dependents after waiting for it).
  load_tables(a, t, false);
  const int lane = threadIdx.x & 31;
  if (lane == 0) sm90::mbarrier_arrive(tables_barrier(base));
  const int d0 = static_cast<int>(blockIdx.x) * kTileRows, rows = min(kTileRows, a.hidden - d0);
  const uint64_t policy = detail::l2_evict_first_policy();
  const int fills = down_item_first_fill(p, down_items(p, *t.num_active));
  // The weight rows of the first `stages` fills go out before the wait, their activation rows after it.
  bool waited = false;
  Ring ring;
  for (int f = 0; f < fills; ++f) {
    if (f == pipe.stages) {
      wait_for_activations();
      if (lane == 0) {
        for (int g = 0; g < pipe.stages; ++g) issue_down_activations(p, base, down_fill(p, t, g, d0), g);
      }
      waited = true;
    }
    const DownFill fill = down_fill(p, t, f, d0);
    const uint32_t full = full_barrier(base, ring.stage);
    sm90::mbarrier_wait(empty_barrier(base, ring.stage), ring.phase ^ 1u);
    if (lane == 0) sm90::mbarrier_arrive_expect_tx(full, static_cast<uint32_t>(rows + fill.count) * fill.bytes);
    __syncwarp();
    const uint32_t dst = stage_address(base, pipe, ring.stage);
    for (int m = lane; m < rows; m += 32) {
      detail::bulk_copy_to_shared(dst + m * pipe.row_bytes, fill.weights + static_cast<int64_t>(m) * fill.k_total,
                                  fill.bytes, full, policy);
    }
    if (waited && lane == 0) issue_down_activations(p, base, fill, ring.stage);
    ring.advance(pipe.stages);
  }
  if (!waited) {
    wait_for_activations();
    if (lane == 0) {
      for (int g = 0; g < fills; ++g) issue_down_activations(p, base, down_fill(p, t, g, d0), g);
    }
  }
}

__device__ void down_consumer(const PipelineArgs& p, uint32_t base, unsigned char* smem, const Tables& t) {
  const LayerArgs& a = p.a;
  const Pipeline& pipe = p.pipe;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int d0 = static_cast<int>(blockIdx.x) * kTileRows, rows = min(kTileRows, a.hidden - d0);
  float* reduce = reinterpret_cast<float*>(smem + pipe.reduce);
  float* ys = reinterpret_cast<float*>(smem + pipe.extra);  // [R + T][16]: routed rows by plan row, then shared
  const bool has_shared = a.shared_down != nullptr;
  // What the combine needs besides ys, loaded now so that the tail only stores: the routing weights and plan
  // positions (launch 1's, complete) and this thread's residual value (written before launch 1 started).
  float* weights = reinterpret_cast<float*>(smem + pipe.combine);
  int* positions = reinterpret_cast<int*>(weights + a.R);
  for (int i = tid; i < a.R; i += kConsumerThreads) {
    weights[i] = __ldcg(a.weights + i);
    positions[i] = __ldcg(a.pos + i);
  }
  const int combine_token = tid / kTileRows, combine_m = tid % kTileRows;
  const bool combines = tid < a.T * kTileRows && combine_m < rows;
  float* residual = a.residual + combine_token * a.residual_stride + d0 + combine_m;
  const float residual_in = combines ? *residual : 0.0f;
  sm90::mbarrier_wait(tables_barrier(base), 0);
  const int items = down_items(p, *t.num_active);
  const int n = b_lane_row();
  const uint32_t a_offset = a_lane_offset(pipe.row_bytes), b_k_offset = b_lane_k_offset();
  Ring ring;
  int parity = 0;
  // Items in fill order: the shared expert (item 0 when there is one), then the active slots.
  const int first_slot_item = has_shared ? 1 : 0;
  for (int item = 0; item < items; ++item) {
    const bool routed = item >= first_slot_item;
    const int slot = item - first_slot_item;
    const int k_total = routed ? a.inter : a.shared_inter;
    const int count = routed ? t.count[slot] : a.T;
    const int row0 = routed ? t.first[slot] : a.R;
    const int n_tiles = count > 8 ? 2 : 1;
    float c[2][4] = {};
    for (int k0 = 0; k0 < k_total; k0 += pipe.segment) {
      sm90::mbarrier_wait(full_barrier(base, ring.stage), ring.phase);
      const uint32_t stage = stage_address(base, pipe, ring.stage);
      const uint32_t b_row = n < count ? stage + (kTileRows + n) * pipe.row_bytes : base + pipe.zero_row;
      mma_segment(stage + a_offset, b_row + b_k_offset, min(pipe.segment, k_total - k0), n_tiles, c);
      __syncwarp();
      if (lane == 0) sm90::mbarrier_arrive(empty_barrier(base, ring.stage));
      ring.advance(pipe.stages);
    }
    float* buffer = reduce + parity * reduce_floats(pipe.n_tiles);
    parity ^= 1;
    publish_partials(buffer, c, pipe.n_tiles);
    // Thread (lane, r): register r of the tile is y[item row 8 (r / 4) + 2 (lane % 4) + r % 2, d0 + m].
    const int r = warp;
    if (r < 4 * pipe.n_tiles) {
      const float y = reduced_register(buffer, r, pipe.n_tiles);
      const int m = (lane >> 2) + ((r & 2) != 0 ? 8 : 0);
      const int row = (r >> 2) * 8 + 2 * (lane & 3) + (r & 1);
      if (row < count && m < rows) ys[(row0 + row) * kTileRows + m] = y;
    }
  }
  consumer_barrier();  // every ys row written (and the weights and positions, long since)

  // Combine: token t, column d0 + m: (residual + Σ_j w[t, j] · y[pos[t, j]], j in order) + y_shared.
  if (combines) {
    float sum = 0.0f;
    for (int j = 0; j < a.k; ++j) {
      const int assignment = combine_token * a.k + j;
      sum = fmaf(weights[assignment], ys[positions[assignment] * kTileRows + combine_m], sum);
    }
    float v = residual_in + sum;
    if (has_shared) v = v + ys[(a.R + combine_token) * kTileRows + combine_m];
    *residual = v;
  }
}

__global__ void __launch_bounds__(kPipelineThreads, 3) pipeline_down_kernel(const __grid_constant__ PipelineArgs p) {
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t base = detail::smem_address(smem);
  if (threadIdx.x == 0) init_pipeline_barriers(base, p.pipe.stages);
  zero_shared(smem, p.pipe.zero_row, p.pipe.row_bytes);
  __syncthreads();
  const Tables t = tables_at(smem, p);
  if (static_cast<int>(threadIdx.x >> 5) == kProducerWarp) {
    down_producer(p, base, t);
  } else {
    down_consumer(p, base, smem, t);
  }
}

// ---- host side ------------------------------------------------------------------------------------------------

// The shapes the layouts depend on (shared_inter 0: no shared expert).
struct Shape {
  int T, R, active_capacity, hidden, inter, shared_inter;
};

Shape shape_of(const LayerArgs& a) {
  return {a.T, a.R, a.active_capacity, a.hidden, a.inter, a.shared_down != nullptr ? a.shared_inter : 0};
}

// The layout for `segment` and `stages`.
Pipeline layout(const Shape& a, bool down, int segment, int stages) {
  Pipeline p;
  p.stages = stages;
  p.segment = segment;
  p.row_bytes = 2 * segment + 16;
  p.stage_rows = kTileRows + (down ? a.T : 0);
  p.n_tiles = a.T > 8 ? 2 : 1;
  const int x_chunks = a.hidden / 8;
  p.x_row_bytes = 16 * (x_chunks % 2 == 1 ? x_chunks : x_chunks + 1);
  size_t offset = align16(kBarrierBytes);
  p.tables = static_cast<uint32_t>(offset);
  offset += align16((1 + 3 * static_cast<size_t>(a.active_capacity) + a.R) * sizeof(int));
  p.reduce = static_cast<uint32_t>(offset);
  offset += 2 * static_cast<size_t>(reduce_floats(p.n_tiles)) * sizeof(float);
  p.extra = static_cast<uint32_t>(offset);
  if (down) {
    offset += align16(static_cast<size_t>(a.R + a.T) * kTileRows * sizeof(float));
    p.zero_row = static_cast<uint32_t>(offset);
    offset += p.row_bytes;
    p.combine = static_cast<uint32_t>(offset);
    offset += align16(2 * static_cast<size_t>(a.R) * sizeof(float));
  } else {
    offset += static_cast<size_t>(a.T + 1) * p.x_row_bytes + 16;  // + 16: a half step reads past the last row
  }
  p.ring = static_cast<uint32_t>(offset);
  offset += static_cast<size_t>(stages) * p.stage_rows * p.row_bytes + 16;
  p.smem_bytes = static_cast<uint32_t>(std::min<size_t>(offset, UINT32_MAX));
  return p;
}

// The largest segment (<= the maximum, a multiple of 16, the k extent split into equal parts) with the most stages
// (the launch's minimum..kMaxStages) that fits the launch's shared-memory budget; stages = 0 if none does.
Pipeline plan_pipeline(const Shape& a, bool down) {
  const int k = down ? std::max(a.inter, a.shared_inter) : a.hidden;
  const int max_segment = down ? kDownMaxSegment : kGateUpMaxSegment;
  const size_t budget = down ? kDownSmemBudget : kGateUpSmemBudget;
  const int min_stages = down ? kDownMinStages : kMinStages;
  for (int parts = (k + max_segment - 1) / max_segment; parts <= k; ++parts) {
    const int segment = ((k + parts - 1) / parts + 15) / 16 * 16;
    for (int stages = kMaxStages; stages >= min_stages; --stages) {
      const Pipeline p = layout(a, down, segment, stages);
      if (p.smem_bytes <= budget) return p;
    }
    if (segment == 16) break;  // the smallest; more parts only repeat it
  }
  return Pipeline{};
}

// Of the current device; only the gate/up grid size depends on it (each item's sums do not).
int sm_count() {
  int device = 0, value = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&value, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || value < 1) {
    (void)cudaGetLastError();
    return 132;  // H200
  }
  return value;
}

Status set_smem(const void* kernel, uint32_t bytes, const char* who) {
  if (const cudaError_t e =
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
      e != cudaSuccess) {
    (void)cudaGetLastError();
    return internal_error(std::string(who) + ": cudaFuncSetAttribute: " + cudaGetErrorName(e));
  }
  return Status::ok();
}

}  // namespace

bool pipeline_fits(int tokens, int top_k, int num_experts, int hidden, int intermediate, int shared_intermediate) {
  const int R = tokens * top_k;
  const Shape shape{tokens, R, std::min(num_experts, R), hidden, intermediate, shared_intermediate};
  return plan_pipeline(shape, false).stages > 0 && plan_pipeline(shape, true).stages > 0;
}

Status launch_pipeline_experts(const LayerArgs& a, cudaStream_t stream) {
  const char* who_gate_up = "moe_small_batch_experts gate/up";
  const char* who_down = "moe_small_batch_experts down";
  const Shape shape = shape_of(a);
  PipelineArgs gate_up{a, plan_pipeline(shape, false), a.shared_down != nullptr ? a.shared_inter / kColumnsPerItem : 0,
                       a.inter / kColumnsPerItem};
  PipelineArgs down{a, plan_pipeline(shape, true), 0, 0};
  if (gate_up.pipe.stages == 0 || down.pipe.stages == 0) {
    return internal_error("moe_small_batch_experts: shapes outside the kernels (moe_small_batch_fits should say no)");
  }
  // Grid: one CTA per SM, fewer when there are fewer items than SMs even with every slot active.
  const int64_t max_items = gate_up.shared_items + static_cast<int64_t>(a.active_capacity) * gate_up.column_blocks;
  const unsigned gate_up_ctas = static_cast<unsigned>(std::min<int64_t>(sm_count(), max_items));
  const unsigned down_ctas = static_cast<unsigned>((a.hidden + kTileRows - 1) / kTileRows);  // one per 16 columns
  // Per call (the attribute is per device): a host-side call, legal during graph capture.
  DS_RETURN_IF_ERROR(
      set_smem(reinterpret_cast<const void*>(pipeline_gate_up_kernel), gate_up.pipe.smem_bytes, who_gate_up));
  DS_RETURN_IF_ERROR(set_smem(reinterpret_cast<const void*>(pipeline_down_kernel), down.pipe.smem_bytes, who_down));
  // Launch 2 starts early (programmatic dependent launch) although its streams slow launch 1's routing: started only
  // after launch 1 had ended, the layer was slower.
  DS_RETURN_IF_ERROR(launch_with_pdl(pipeline_gate_up_kernel, gate_up_ctas, kPipelineThreads, gate_up.pipe.smem_bytes,
                                     stream, who_gate_up, gate_up));
  return launch_with_pdl(pipeline_down_kernel, down_ctas, kPipelineThreads, down.pipe.smem_bytes, stream, who_down,
                         down);
}

}  // namespace deltaserve::kernels::cuda::moe_small_batch_detail
