// The chunked prefill's state passes (contract in kda.hpp; the workspace block they read in
// detail/chunk_prefill.cuh), sequential over a sequence's chunks on wgmma:
//   per slice: one CTA of two warpgroups per (64 value columns, head, sequence), the state slice [128 x 64] fp32 in
//      registers (64 keys a warpgroup): warpgroup 0 computes v_new = u - w S while warpgroup 1 computes
//      o = (q e^gc) S, then each updates its half, S = e^gc_last ⊙ S + (k e^(gc_last - gc))^T v_new, and warpgroup 1
//      adds Aqk v_new to o. The next chunk's factors land by bulk copy (one thread, mbarrier, 2 stages) during the
//      current one.
//   per head: a CTA per (head, sequence), a warpgroup per 64 value columns holding the transposed state, so H CTAs
//      make one wave; optionally overlapped with the prep (reading each chunk once the prep flags it).
#include <cstddef>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kernels/cuda/common/detail/bf16_stream.cuh"
#include "kernels/cuda/common/detail/mma_sm80.cuh"
#include "kernels/cuda/common/detail/sm90_ptx.cuh"
#include "kernels/cuda/kda/detail/chunk_prefill.cuh"

namespace deltaserve::kernels::cuda::kda_prefill {
namespace {

using namespace detail;  // NOLINT(google-build-using-namespace)

// D[64 x 64] (+)= A[64 x 16] · B[16 x 64], bf16 operands in shared memory (128-byte swizzled), fp32 accumulators.
// A is K-major (kTransA = 0: rows of k) or MN-major (1: rows of 64 m-values, one per k); B is MN-major (rows of 64
// n-values, one per k). accumulate == 0: D = A · B. Accumulator layout (warp w of the warpgroup, lane l, register
// i): row 16 w + l / 4 + 8 ((i % 4) / 2), column 8 (i / 4) + 2 (l % 4) + i % 2.
template <int kTransA>
__device__ __forceinline__ void wgmma_m64n64k16(float (&d)[32], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" DS_SM90_REGS32
      "}, %32, %33, p, 1, 1, %35, 1;\n"
      "}\n"
      : DS_SM90_ACC32("+f", d, 0)
      : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(kTransA));
}

// Descriptors of the state pass's operands (all 128-byte swizzled, 1024-byte aligned blocks of 64-element rows).
// K-major A ([64 rows][64 k] blocks): k16 step s of a 128-wide operand is block s / 4, 32 (s % 4) bytes in.
__device__ __forceinline__ uint64_t desc_k_major(uint32_t base, int step) {
  return sm90::smem_descriptor_sw128(base + (step >> 2) * static_cast<uint32_t>(kBlockBytes) + (step & 3) * 32, 16,
                                     1024);
}
// MN-major operand (rows of k, 64 m/n-values each): k16 step s starts 16 rows (2048 bytes) in.
__device__ __forceinline__ uint64_t desc_mn_major(uint32_t base, int step) {
  return sm90::smem_descriptor_sw128(base + step * 2048, static_cast<uint32_t>(kBlockBytes), 1024);
}

constexpr int kStateThreads = 256;
constexpr size_t kStageBytes = kOffU + kUSliceBytes;                 // the chunk's shared part, then this u slice
constexpr size_t kStageStride = (kStageBytes + 1023) / 1024 * 1024;  // stages start 1024-byte aligned
constexpr size_t kStateOperandBytes = size_t{kD} * kStateBv * 2;     // S as bf16, [128 keys][64 values]
constexpr size_t kVnBytes = size_t{kC} * kStateBv * 2;               // v_new as bf16, [64 tokens][64 values]
constexpr size_t kOutBytes = size_t{kC} * kStateBv * 2;  // a chunk's output slice as bf16, [64 tokens][64 values]
constexpr size_t kStateSmem =
    1024 + 2 * kStageStride + kStateOperandBytes + kVnBytes + kOutBytes + 2 * sizeof(uint64_t);

// Two warpgroups per (64 value columns, head, sequence), sequential over the sequence's chunks. Warpgroup wg holds
// keys [64 wg, +64) of the state slice S [128 keys x 64 values] in fp32 registers. A chunk: warpgroup 0 computes
// v_new = u - w S and warpgroup 1 the inter-chunk output (q e^gc) S (wgmma, S read as bf16 from shared memory); then
// each warpgroup updates its half, S = e^gc_last ⊙ S + (k e^(gc_last - gc))^T v_new (wgmma with the accumulators in
// place), and writes it back as bf16, while warpgroup 1 adds Aqk v_new to the output. Both read the chunk's factors
// from a stage that one thread fills by two bulk copies (an mbarrier a stage, two stages: the next chunk lands during
// the current one). Warpgroup 1 stages each chunk's output slice in shared memory and copies it out, 16 bytes a
// thread, during the next chunk's first product.
__global__ void __launch_bounds__(kStateThreads, 1) kda_chunk_state_kernel(StateArgs p) {
  extern __shared__ uint8_t smem_raw[];
  // 1024-byte aligned by an offset from the shared array itself, so that the compiler keeps every access through
  // `smem` a shared-memory one (LDS/STS; through an integer round trip they become generic loads and stores).
  uint8_t* smem = smem_raw + ((1024u - (smem_address(smem_raw) & 1023u)) & 1023u);
  const int H = p.num_heads;
  const int slice = blockIdx.x, h = blockIdx.y, sequence = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wg = warp >> 2, wg_warp = warp & 3;
  const SequenceEntry seq = p.sequences[sequence];
  bf16* s_b = reinterpret_cast<bf16*>(smem + 2 * kStageStride);                                  // sw128 [128][64]
  bf16* vn = reinterpret_cast<bf16*>(smem + 2 * kStageStride + kStateOperandBytes);              // sw128 [64][64]
  bf16* o_s = reinterpret_cast<bf16*>(smem + 2 * kStageStride + kStateOperandBytes + kVnBytes);  // sw128 [64][64]
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + 2 * kStageStride + kStateOperandBytes + kVnBytes + kOutBytes);
  const uint32_t s_b_address = smem_address(s_b), vn_address = smem_address(vn);
  // Warpgroup 1: the staged output slice of the chunk starting at token `first` of the sequence, its first `rows`
  // rows, to global memory: 16 bytes a thread and step, 128 bytes a row, all four loads before the stores.
  auto store_output = [&](int first, int rows) {
    const int row0 = (tid - 128) >> 3, part = tid & 7;
    uint4 value[4];
#pragma unroll
    for (int step = 0; step < 4; ++step) {
      value[step] = *reinterpret_cast<const uint4*>(o_s + sw128(16 * step + row0, part * 8));
    }
#pragma unroll
    for (int step = 0; step < 4; ++step) {
      const int row = 16 * step + row0;
      if (row < rows) {
        const size_t at =
            (static_cast<size_t>(seq.token_begin + first + row) * H + h) * kD + slice * kStateBv + part * 8;
        *reinterpret_cast<uint4*>(p.o + at) = value[step];
      }
    }
  };

  auto stage_base = [&](int stage) { return smem + stage * kStageStride; };
  // Thread 0 only: the chunk's factors into `stage` by two bulk copies (the shared part, this slice's u).
  auto load_stage = [&](int stage, int chunk) {
    const uint8_t* src = p.data + (static_cast<size_t>(chunk) * H + h) * kChunkBytes;
    const uint32_t bar = smem_address(&full[stage]);
    const uint32_t dst = smem_address(stage_base(stage));
    sm90::mbarrier_arrive_expect_tx(bar, static_cast<uint32_t>(kStageBytes));
    bulk_copy_to_shared(dst, src, static_cast<uint32_t>(kOffU), bar);
    bulk_copy_to_shared(dst + static_cast<uint32_t>(kOffU), src + kOffU + slice * kUSliceBytes,
                        static_cast<uint32_t>(kUSliceBytes), bar);
  };

  // Accumulator coordinates of this thread (wgmma layout): register i (even; i + 1 is the next column) holds row
  // acc_row(i) and column acc_col(i) of its warpgroup's m64 x n64 tile.
  const int row0 = 16 * wg_warp + (lane >> 2), col0 = 2 * (lane & 3);
  auto acc_row = [&](int i) { return row0 + 8 * ((i % 4) / 2); };
  auto acc_col = [&](int i) { return 8 * (i / 4) + col0; };
  const size_t state_offset = (static_cast<size_t>(sequence) * H + h) * kD * kD + slice * kStateBv;
  // Warpgroup wg holds the state's keys [64 wg, +64) x the slice's 64 values in fp32 registers.
  float s[32];
  auto store_state = [&](float* base) {
#pragma unroll
    for (int i = 0; i < 32; i += 2) {
      const int key = 64 * wg + acc_row(i), col = acc_col(i);
      *reinterpret_cast<float2*>(base + key * kD + col) = make_float2(s[i], s[i + 1]);
    }
  };
  auto state_to_shared = [&] {
#pragma unroll
    for (int i = 0; i < 32; i += 2) {
      const int key = 64 * wg + acc_row(i), col = acc_col(i);
      *reinterpret_cast<uint32_t*>(s_b + sw128(key, col)) = pack_bf16(s[i], s[i + 1]);
    }
    sm90::fence_proxy_async_shared();  // the bf16 state is a wgmma operand next
  };
#pragma unroll
  for (int i = 0; i < 32; i += 2) {
    const int key = 64 * wg + acc_row(i), col = acc_col(i);
    float2 value = make_float2(0.0f, 0.0f);
    if (p.initial_state != nullptr) {
      value = *reinterpret_cast<const float2*>(p.initial_state + state_offset + key * kD + col);
    }
    s[i] = value.x;
    s[i + 1] = value.y;
  }
  state_to_shared();

  if (tid == 0) {
    sm90::mbarrier_init(smem_address(&full[0]), 1);
    sm90::mbarrier_init(smem_address(&full[1]), 1);
    sm90::mbarrier_init_fence();
    fence_proxy_async_global();  // the workspace was written by the prep grid with ordinary stores
    if (seq.num_chunks > 0) load_stage(0, seq.first_chunk);
  }
  __syncthreads();

  for (int ci = 0; ci < seq.num_chunks; ++ci) {
    const int stage = ci & 1;
    // The other stage was released by the barrier at the end of the previous chunk.
    if (tid == 0 && ci + 1 < seq.num_chunks) load_stage(stage ^ 1, seq.first_chunk + ci + 1);
    const uint32_t base = smem_address(stage_base(stage));
    sm90::mbarrier_wait(smem_address(&full[stage]), static_cast<uint32_t>((ci >> 1) & 1));
    const int chunk_first = ci * kC;
    const int tokens = min(kC, seq.length - chunk_first);

    // Phase 1: w S (warpgroup 0) or (q e^gc) S (warpgroup 1), K = 128 keys.
    float acc[32];
    sm90::wgmma_fence();
    const uint32_t a_base = base + static_cast<uint32_t>(wg == 0 ? kOffW : kOffQg);
#pragma unroll
    for (int step = 0; step < kD / 16; ++step) {
      wgmma_m64n64k16<0>(acc, desc_k_major(a_base, step), desc_mn_major(s_b_address, step), step > 0 ? 1 : 0);
    }
    sm90::wgmma_commit_group();
    // The previous chunk's output slice, staged in shared memory, to global memory while the products run. (Stored
    // straight from the accumulators at the end of the chunk, the stores held the accumulator registers that the
    // next chunk's first product overwrites.)
    if (wg == 1 && ci > 0) store_output(chunk_first - kC, kC);
    sm90::wgmma_wait_group<0>();
    sm90::wgmma_fence_registers(acc);
    if (wg == 0) {
      // v_new = u - w S -> shared memory (bf16), the B operand of both products below. All u loads first: they
      // and the v_new stores are both shared memory, and the compiler cannot reorder them across each other.
      const bf16* u = reinterpret_cast<const bf16*>(stage_base(stage) + kOffU);
      __nv_bfloat162 uu[16];
#pragma unroll
      for (int i = 0; i < 32; i += 2) {
        const int row = acc_row(i), col = acc_col(i);
        uu[i / 2] = *reinterpret_cast<const __nv_bfloat162*>(u + row * kLdU + col);
      }
#pragma unroll
      for (int i = 0; i < 32; i += 2) {
        const int row = acc_row(i), col = acc_col(i);
        const float2 uf = __bfloat1622float2(uu[i / 2]);
        *reinterpret_cast<uint32_t*>(vn + sw128(row, col)) = pack_bf16(uf.x - acc[i], uf.y - acc[i + 1]);
      }
      sm90::fence_proxy_async_shared();
    }
    const float* decay = reinterpret_cast<const float*>(stage_base(stage) + kOffDecay);
    const float d0 = decay[64 * wg + acc_row(0)], d1 = decay[64 * wg + acc_row(2)];  // rows of i % 4 < 2, >= 2
    __syncthreads();  // v_new complete; both warpgroups are done reading the bf16 state

    // Both warpgroups: their half of S = e^gc_last ⊙ S + kg^T v_new (A = kg^T, MN-major: kg's rows are tokens;
    // B = v_new; K = 64 tokens). Warpgroup 1 also: o += Aqk v_new (Aqk is zero above its diagonal).
#pragma unroll
    for (int i = 0; i < 32; ++i) s[i] *= (i % 4) < 2 ? d0 : d1;
    const uint32_t kg_base = base + static_cast<uint32_t>(kOffKg) + wg * static_cast<uint32_t>(kBlockBytes);
    auto update = [&] {
      sm90::wgmma_fence();
#pragma unroll
      for (int step = 0; step < kC / 16; ++step) {
        wgmma_m64n64k16<1>(s, desc_mn_major(kg_base, step), desc_mn_major(vn_address, step), 1);
      }
    };
    // Each branch issues, commits and waits for its own wgmma (ptxas serialises wgmma issued on a divergent path
    // after common ones).
    if (wg == 0) {
      update();
      sm90::wgmma_commit_group();
      sm90::wgmma_wait_group<0>();
    } else {
      update();
      const uint32_t aqk_base = base + static_cast<uint32_t>(kOffAqk);
#pragma unroll
      for (int step = 0; step < kC / 16; ++step) {
        wgmma_m64n64k16<0>(acc, desc_k_major(aqk_base, step), desc_mn_major(vn_address, step), 1);
      }
      sm90::wgmma_commit_group();
      sm90::wgmma_wait_group<0>();
    }
    sm90::wgmma_fence_registers(s);
    sm90::wgmma_fence_registers(acc);
    state_to_shared();
    if (p.checkpoint_interval > 0 && tokens == kC && (chunk_first + kC) % p.checkpoint_interval == 0) {
      const int entry = seq.checkpoint_first + (chunk_first + kC) / p.checkpoint_interval - 1;
      store_state(p.checkpoint_states + (static_cast<size_t>(entry) * H + h) * kD * kD + slice * kStateBv);
    }
    if (wg == 1) {
      // Staged in shared memory; the next chunk (or the end) copies the rows out.
#pragma unroll
      for (int i = 0; i < 32; i += 2) {
        *reinterpret_cast<uint32_t*>(o_s + sw128(acc_row(i), acc_col(i))) = pack_bf16(acc[i], acc[i + 1]);
      }
    }
    __syncthreads();  // the new bf16 state is in place; v_new and the stage are free
  }
  if (wg == 1 && seq.num_chunks > 0) {
    const int last_first = (seq.num_chunks - 1) * kC;
    store_output(last_first, seq.length - last_first);
  }
  if (p.final_state != nullptr) store_state(p.final_state + state_offset);
}

// ---- the state pass per head ----------------------------------------------------------------------------------
//
// The same recurrence with the state held transposed, S^T [64 values x 128 keys], by one warpgroup per 64 value
// columns: every product of a chunk then has S^T or v_new^T as its A operand, and wgmma takes A from registers in
// the accumulator layout (the fp32 accumulators of columns 16 j .. 16 j + 15, paired and rounded to bf16, are k16
// step j's A fragment). So a chunk needs no shared-memory round trip of S or v_new and no barrier between the
// warpgroups, and the two warpgroups of a head share one stage of its factors:
//   X = S^T w^T                                         (A = S^T as bf16, B = w K-major, K = 128 keys)
//   v_new^T = u^T - X                                   (u read transposed from the stage)
//   S^T = S^T ⊙ e^gc_last + v_new^T (k e^(gc_last - gc))   (B MN-major over both key blocks, N = 128, K = 64 tokens)
//   o^T = S_old^T (q e^gc)^T + v_new^T Aqk^T            (B = q e^gc, Aqk K-major; S_old: the chunk's first state)
// The operands are the prep's workspace block as it is (detail/chunk_prefill.cuh, one bulk copy). o^T goes transposed
// into a shared-memory tile and out, 16 bytes a thread, during the next chunk's X.
// Against the pass per slice it makes one wave of H CTAs instead of two waves of 2 H where 2 H exceeds the SM
// count, and leaves most SMs idle where H is small (hence kAuto's choice). A CTA per value slice of this pass was
// no faster than the pass per slice, nor was leaving the output products running into the next chunk. Two chains
// on one SM take nearly twice as long a chunk as one.

// D[64 x 64] += A[64 x 16] · B, A in registers (four bf16x2: the m64k16 fragment), B K-major from shared memory.
__device__ __forceinline__ void wgmma_rs_m64n64k16(float (&d)[32], const uint32_t* a, uint64_t desc_b) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" DS_SM90_REGS32
      "}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n"
      "}\n"
      : DS_SM90_ACC32("+f", d, 0)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
}

// D[64 x 64] = A[64 x 16] · B (the first k16 step of a product), A in registers, B K-major. D is output-only
// here: with "+f" the accumulators' undefined old values would be inputs, which ptxas may place in registers of
// a running wgmma and then wait for it.
__device__ __forceinline__ void wgmma_rs_m64n64k16_first(float (&d)[32], const uint32_t* a, uint64_t desc_b) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, 0, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" DS_SM90_REGS32
      "}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n"
      "}\n"
      : DS_SM90_ACC32("=f", d, 0)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
}

// D[64 x 128] += A[64 x 16] · B, A in registers, B MN-major from shared memory (two 64-column blocks, desc_mn_major).
__device__ __forceinline__ void wgmma_rs_m64n128k16_mn(float (&d)[64], const uint32_t* a, uint64_t desc_b) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" DS_SM90_REGS64
      "}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n"
      "}\n"
      : DS_SM90_ACC64("+f", d, 0)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
}

// The pass per head: a CTA of two warpgroups per (head, sequence), warpgroup wg the value columns [64 wg, +64), both
// reading one stage of the chunk's factors (its whole workspace block, one bulk copy).
constexpr int kStateHeadThreads = 256;
constexpr size_t kStateHeadStageStride = (kChunkBytes + 1023) / 1024 * 1024;
constexpr int kStateHeadStages = 2;  // what fits: chunk c + 1 lands while c runs
constexpr int kLdO = kStateBv + 8;   // bf16 row stride of a staged output tile (conflict-free writes)
constexpr size_t kOTileBytes = size_t{kC} * kLdO * 2;
constexpr size_t kStateHeadSmem =
    1024 + kStateHeadStages * kStateHeadStageStride + 4 * kOTileBytes + kStateHeadStages * sizeof(uint64_t);
static_assert(kStateHeadSmem <= 227 * 1024, "the state pass per head must fit one SM's shared memory");

__global__ void __launch_bounds__(kStateHeadThreads, 1) kda_chunk_state_head_kernel(StateArgs p) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024u - (smem_address(smem_raw) & 1023u)) & 1023u);  // as kda_chunk_state_kernel
  const int H = p.num_heads;
  const int h = blockIdx.y, sequence = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = (tid >> 5) & 3, wg = tid >> 7;
  const int slice = wg;
  const int wg_tid = tid & 127;
  const SequenceEntry seq = p.sequences[sequence];
  // Two output tiles [64 tokens][kLdO] per warpgroup (double-buffered: chunk c's tile is copied out after the
  // barrier while chunk c + 1 writes the other one).
  bf16* o_tiles = reinterpret_cast<bf16*>(smem + kStateHeadStages * kStateHeadStageStride) + wg * 2 * (kC * kLdO);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kStateHeadStages * kStateHeadStageStride + 4 * kOTileBytes);
  auto stage_base = [&](int stage) { return smem + stage * kStateHeadStageStride; };
  const size_t cta = static_cast<size_t>(sequence) * H + h;
  if (p.rerun != 0 && p.fallback[cta] == 0) return;  // the overlapped launch did this (head, sequence)
  const unsigned int* flags = p.rerun != 0 ? nullptr : p.flags;
  // Thread 0. False only when the first chunk's flag did not come within wait_ns (nothing issued).
  auto load_stage = [&](int chunk_index) {
    const int stage = chunk_index % kStateHeadStages;
    const size_t item = static_cast<size_t>(seq.first_chunk + chunk_index) * H + h;
    const uint8_t* src = p.data + item * kChunkBytes;
    if (flags != nullptr) {
      const uint64_t deadline = chunk_index == 0 ? sm90::globaltimer_ns() + p.wait_ns : ~uint64_t{0};
      unsigned int ready = 0;
      for (;;) {
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(ready) : "l"(flags + item) : "memory");
        if (ready != 0) break;
        if (sm90::globaltimer_ns() >= deadline) return false;  // once one chunk came, the prep runs: the rest will
        __nanosleep(64);
      }
      fence_proxy_async_global();  // the block was written with ordinary stores; the bulk copy reads it
    }
    const uint32_t bar = smem_address(&full[stage]);
    const uint32_t dst = smem_address(stage_base(stage));
    sm90::mbarrier_arrive_expect_tx(bar, static_cast<uint32_t>(kChunkBytes));
    bulk_copy_to_shared(dst, src, static_cast<uint32_t>(kChunkBytes), bar);  // the whole block, both u slices
    return true;
  };
  const size_t u_offset = kOffU + slice * kUSliceBytes;
  // The staged output tile of the chunk starting at token `first`, its first `rows` rows, to global memory.
  auto store_output = [&](const bf16* tile, int first, int rows) {
    const int row0 = wg_tid >> 3, part = wg_tid & 7;
    uint4 value[4];
#pragma unroll
    for (int step = 0; step < 4; ++step) {
      value[step] = *reinterpret_cast<const uint4*>(tile + (16 * step + row0) * kLdO + part * 8);
    }
#pragma unroll
    for (int step = 0; step < 4; ++step) {
      const int row = 16 * step + row0;
      if (row < rows) {
        const size_t at =
            (static_cast<size_t>(seq.token_begin + first + row) * H + h) * kD + slice * kStateBv + part * 8;
        *reinterpret_cast<uint4*>(p.o + at) = value[step];
      }
    }
  };

  // Accumulator coordinates (wgmma layout): register i holds row acc_row(i) and column acc_col(i) of the m64 tile.
  // Rows are value columns of the slice; columns are keys (S^T) or tokens (X, Y, v_new^T).
  const int row0 = 16 * warp + (lane >> 2), col0 = 2 * (lane & 3);
  auto acc_row = [&](int i) { return row0 + 8 * ((i % 4) / 2); };
  auto acc_col = [&](int i) { return 8 * (i / 4) + col0 + (i & 1); };
  const size_t state_offset = (static_cast<size_t>(sequence) * H + h) * kD * kD + slice * kStateBv;
  float s[64];  // S^T: s[i] = S[key acc_col(i)][value acc_row(i)]
#pragma unroll
  for (int i = 0; i < 64; ++i) {
    s[i] = p.initial_state != nullptr ? p.initial_state[state_offset + acc_col(i) * kD + acc_row(i)] : 0.0f;
  }
  auto store_state = [&](float* base) {
#pragma unroll
    for (int i = 0; i < 64; ++i) base[acc_col(i) * kD + acc_row(i)] = s[i];
  };
  uint32_t sa[32];  // S^T as bf16 A fragments: k16 step j (keys 16 j ..) in sa[4 j .. 4 j + 3]
  auto pack_state = [&] {
#pragma unroll
    for (int i = 0; i < 64; i += 2) sa[i / 2] = pack_bf16(s[i], s[i + 1]);
  };
  pack_state();

  if (flags != nullptr) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");  // the prep beside it
  __shared__ int gave_up;
  if (tid == 0) {
    for (int stage = 0; stage < kStateHeadStages; ++stage) sm90::mbarrier_init(smem_address(&full[stage]), 1);
    sm90::mbarrier_init_fence();
    fence_proxy_async_global();  // the workspace was written by the prep grid with ordinary stores
    bool issued = true;
    for (int c = 0; c < min(kStateHeadStages - 1, seq.num_chunks); ++c) issued = issued && load_stage(c);
    gave_up = issued ? 0 : 1;
  }
  __syncthreads();
  if (gave_up != 0) {  // nothing read or written yet: the rerun after the prep does this (head, sequence)
    if (tid == 0) p.fallback[cta] = 1;
    return;
  }

  for (int ci = 0; ci < seq.num_chunks; ++ci) {
    const int stage = ci % kStateHeadStages;
    // The stage of chunk ci - 1 was released by the barrier at the end of it.
    if (tid == 0 && ci + kStateHeadStages - 1 < seq.num_chunks) load_stage(ci + kStateHeadStages - 1);
    const uint32_t base = smem_address(stage_base(stage));
    sm90::mbarrier_wait(smem_address(&full[stage]), static_cast<uint32_t>((ci / kStateHeadStages) & 1));
    const int chunk_first = ci * kC;
    const int tokens = min(kC, seq.length - chunk_first);

    // X = S^T w^T; meanwhile u^T and the decayed state.
    float x[32];
    sm90::wgmma_fence();
    wgmma_rs_m64n64k16_first(x, &sa[0], desc_k_major(base + static_cast<uint32_t>(kOffW), 0));
#pragma unroll
    for (int j = 1; j < kD / 16; ++j) {
      wgmma_rs_m64n64k16(x, &sa[4 * j], desc_k_major(base + static_cast<uint32_t>(kOffW), j));
    }
    sm90::wgmma_commit_group();
    if (ci > 0) store_output(o_tiles + ((ci - 1) & 1) * (kC * kLdO), chunk_first - kC, kC);
    const uint16_t* u = reinterpret_cast<const uint16_t*>(stage_base(stage) + u_offset);
    uint32_t uv[16];  // u^T (token acc_col(i), value acc_row(i)), two tokens a register
#pragma unroll
    for (int i = 0; i < 32; i += 2) {
      uv[i / 2] = static_cast<uint32_t>(u[acc_col(i) * kLdU + acc_row(i)]) |
                  (static_cast<uint32_t>(u[acc_col(i + 1) * kLdU + acc_row(i)]) << 16);
    }
    const float* decay = reinterpret_cast<const float*>(stage_base(stage) + kOffDecay);
    float2 d[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) d[i] = *reinterpret_cast<const float2*>(decay + 8 * i + col0);
    sm90::wgmma_wait_group<0>();
    sm90::wgmma_fence_registers(x);
    // S^T ⊙ e^gc_last (the keys are columns); v_new^T = u^T - X as bf16 A fragments (k16 step j: tokens 16 j ..).
    // (Touching s while X runs would make ptxas wait for X there anyway.)
#pragma unroll
    for (int i = 0; i < 64; i += 4) {
      s[i] *= d[i / 4].x;
      s[i + 1] *= d[i / 4].y;
      s[i + 2] *= d[i / 4].x;
      s[i + 3] *= d[i / 4].y;
    }
    uint32_t vn[16];
#pragma unroll
    for (int i = 0; i < 32; i += 2) {
      const __nv_bfloat162 u2 = *reinterpret_cast<const __nv_bfloat162*>(&uv[i / 2]);
      vn[i / 2] = pack_bf16(__low2float(u2) - x[i], __high2float(u2) - x[i + 1]);
    }
    // The update S^T += v_new^T (k e^(gc_last - gc)), then the output o^T = S^T (q e^gc)^T + v_new^T Aqk^T with the
    // chunk's first state (sa), one group.
    float y[32];
    sm90::wgmma_fence();
#pragma unroll
    for (int j = 0; j < kC / 16; ++j) {
      wgmma_rs_m64n128k16_mn(s, &vn[4 * j], desc_mn_major(base + static_cast<uint32_t>(kOffKg), j));
    }
    wgmma_rs_m64n64k16_first(y, &sa[0], desc_k_major(base + static_cast<uint32_t>(kOffQg), 0));
#pragma unroll
    for (int j = 1; j < kD / 16; ++j) {
      wgmma_rs_m64n64k16(y, &sa[4 * j], desc_k_major(base + static_cast<uint32_t>(kOffQg), j));
    }
#pragma unroll
    for (int j = 0; j < kC / 16; ++j) {
      wgmma_rs_m64n64k16(y, &vn[4 * j], desc_k_major(base + static_cast<uint32_t>(kOffAqk), j));
    }
    sm90::wgmma_commit_group();
    sm90::wgmma_wait_group<0>();
    sm90::wgmma_fence_registers(s);
    sm90::wgmma_fence_registers(y);
    pack_state();
    if (p.checkpoint_interval > 0 && tokens == kC && (chunk_first + kC) % p.checkpoint_interval == 0) {
      const int entry = seq.checkpoint_first + (chunk_first + kC) / p.checkpoint_interval - 1;
      store_state(p.checkpoint_states + (static_cast<size_t>(entry) * H + h) * kD * kD + slice * kStateBv);
    }
    bf16* tile = o_tiles + (ci & 1) * (kC * kLdO);
#pragma unroll
    for (int i = 0; i < 32; ++i) tile[acc_col(i) * kLdO + acc_row(i)] = __float2bfloat16_rn(y[i]);
    __syncthreads();  // the tile is complete; every product of this stage has finished (it takes a later chunk)
  }
  if (seq.num_chunks > 0) {
    const int last_first = (seq.num_chunks - 1) * kC;
    store_output(o_tiles + ((seq.num_chunks - 1) & 1) * (kC * kLdO), last_first, seq.length - last_first);
  }
  if (p.final_state != nullptr) store_state(p.final_state + state_offset);
}

}  // namespace

cudaError_t launch_chunk_state_per_slice(const StateArgs& args, int64_t sequences, cudaStream_t stream) {
  static const cudaError_t attribute = cudaFuncSetAttribute(
      kda_chunk_state_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kStateSmem));
  if (attribute != cudaSuccess) return attribute;
  const dim3 grid(kD / kStateBv, static_cast<unsigned>(args.num_heads), static_cast<unsigned>(sequences));
  kda_chunk_state_kernel<<<grid, kStateThreads, kStateSmem, stream>>>(args);
  return cudaGetLastError();
}

cudaError_t launch_chunk_state_per_head(const StateArgs& args, int64_t sequences, cudaStream_t stream) {
  static const cudaError_t attribute = cudaFuncSetAttribute(
      kda_chunk_state_head_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kStateHeadSmem));
  if (attribute != cudaSuccess) return attribute;
  const dim3 grid(1, static_cast<unsigned>(args.num_heads), static_cast<unsigned>(sequences));
  kda_chunk_state_head_kernel<<<grid, kStateHeadThreads, kStateHeadSmem, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace deltaserve::kernels::cuda::kda_prefill
