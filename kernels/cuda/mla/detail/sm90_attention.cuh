// Hopper (sm_90a) building blocks of the warpgroup attention kernels on top of sm90_ptx.cuh: pointer forms of its
// mbarrier and TMA helpers, a bounded mbarrier wait that gives up instead of trapping, named barriers, register
// reallocation and the warpgroup MMA shapes (m64n128k16, bf16 in, fp32 accumulate) that prefill_wgmma.cu uses.
// PTX ISA 8.0+ (wgmma, cp.async.bulk.tensor, mbarrier expect_tx).
//
// Shared-memory operand tiles are 128-byte swizzled, as TMA writes them with CU_TENSOR_MAP_SWIZZLE_128B: a tile of
// R rows x 64 bf16 (128 bytes a row), 1024-byte aligned, keeps 16-byte unit u of row r at r * 128 + 16 (u ^ (r % 8)).
// Register fragments of one warpgroup (warp w = 0..3 of it, lane l, g = l / 4, t = l % 4):
//   fp32 accumulator of m64nN:  d[4i + e] holds row 16w + g + 8 (e / 2), column 8i + 2t + (e % 2)
//   bf16 A operand of m64k16:   a[0] = (row 16w + g, k 2t, 2t+1), a[1] = (row 16w + g + 8, k 2t, 2t+1),
//                               a[2] = (row 16w + g, k 2t+8, 2t+9), a[3] = (row 16w + g + 8, k 2t+8, 2t+9)
//   so the accumulator columns 16k..16k+15 packed pairwise, {pack(d[8k], d[8k+1]), pack(d[8k+2], d[8k+3]),
//   pack(d[8k+4], d[8k+5]), pack(d[8k+6], d[8k+7])}, are the A operand of k-step k (no data movement).
#pragma once

#include <cstdint>

#include <cuda.h>
#include <cuda_bf16.h>

#include "kernels/cuda/common/detail/mma_sm80.cuh"
#include "kernels/cuda/common/detail/sm90_ptx.cuh"

namespace deltaserve::kernels::cuda::sm90 {

// The PTX helpers themselves live in sm90_ptx.cuh; these are pointer forms of them (the barriers and tiles are
// addressed by shared-memory pointers here) and the helpers only the attention kernels use.

// ---- mbarriers (shared::cta) ------------------------------------------------------------------------------------
__device__ __forceinline__ void mbarrier_init(uint64_t* barrier, uint32_t arrivals) {
  mbarrier_init(detail::smem_address(barrier), arrivals);
}
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* barrier, uint32_t bytes) {
  mbarrier_arrive_expect_tx(detail::smem_address(barrier), bytes);
}
__device__ __forceinline__ void mbarrier_arrive(uint64_t* barrier) {
  mbarrier_arrive(detail::smem_address(barrier));
}
// Waits for the completion of the phase with this parity (a fresh barrier counts its phase "before 0", parity 1,
// as complete). Bounded, so that a lost arrival (a bug) cannot hang the device: a wait past ~2 s of SM clocks gives
// up and sets *gave_up (a flag in shared memory, 0 at the start), and every later wait of a thread that sees the
// flag returns at once; the kernel then finishes with wrong results, which the tests report. (Not __trap() as in
// sm90_ptx.cuh's mbarrier_wait: a trap in the kernel makes ptxas ignore setmaxnreg, and the consumers of
// prefill_wgmma.cu then spill.)
__device__ __forceinline__ void mbarrier_wait(uint64_t* barrier, uint32_t parity, volatile int* gave_up) {
  const uint32_t bar = detail::smem_address(barrier);
  if (mbarrier_try_wait(bar, parity)) return;
  const long long start = clock64();
  while (!mbarrier_try_wait(bar, parity)) {
    if (*gave_up != 0) return;
    if (clock64() - start > 4'000'000'000ll) {
      *gave_up = 1;
      return;
    }
  }
}

// ---- TMA ---------------------------------------------------------------------------------------------------------
// Box at element coordinates (x = column, y = row) of a 2-D tensor map -> shared memory, completing `bytes` (the
// whole box, zero-filled where it leaves the tensor) on `barrier`.
__device__ __forceinline__ void tma_load_2d(void* smem_dst, const CUtensorMap* map, uint64_t* barrier, int x, int y) {
  tma_load_2d(detail::smem_address(smem_dst), map, detail::smem_address(barrier), x, y);
}

// ---- named barriers (id 0 is __syncthreads) ------------------------------------------------------------------------
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// ---- register reallocation between warpgroups (all 4 warps of the warpgroup execute it) ----------------------------
// Unlike sm90_ptx.cuh's warpgroup_{release,claim}_registers these carry a "memory" clobber (no shared-memory access
// moves across the hand-over); prefill_wgmma.cu's register budget was measured with it, so they stay separate.
// The warpgroup gives back registers down to kCount per thread (e.g. a TMA producer that needs few).
template <int kCount>
__device__ __forceinline__ void warpgroup_registers_decrease() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kCount) : "memory");
}
// The warpgroup takes registers up to kCount per thread from those given back (waits until they are free).
template <int kCount>
__device__ __forceinline__ void warpgroup_registers_increase() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kCount) : "memory");
}

// ---- wgmma (fences, commit and wait: sm90_ptx.cuh) ----------------------------------------------------------------
// d (64 x 128, fp32) (+)= A (64 x 16, K-major in shared memory) * B (16 x 128, K-major in shared memory: 128 rows
// of n, each holding the 16 k-values). accumulate = 0: d = A B.
__device__ __forceinline__ void wgmma_m64n128k16_ss(float (&d)[64], uint64_t a_descriptor, uint64_t b_descriptor,
                                                    int accumulate) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" DS_SM90_REGS64
      "}, %64, %65, p, 1, 1, 0, 0;\n"
      "}\n"
      : DS_SM90_ACC64("+f", d, 0)
      : "l"(a_descriptor), "l"(b_descriptor), "r"(accumulate));
}

// d (64 x 128, fp32) (+)= A (64 x 16, bf16 registers, layout above) * B (16 x 128 in shared memory, MN-major: 16
// rows of k, each holding the 128 n-values; the transpose flag set). accumulate = 0: d = A B.
__device__ __forceinline__ void wgmma_m64n128k16_rs_b_mn_major(float (&d)[64], uint32_t a0, uint32_t a1, uint32_t a2,
                                                               uint32_t a3, uint64_t b_descriptor, int accumulate) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" DS_SM90_REGS64
      "}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n"
      "}\n"
      : DS_SM90_ACC64("+f", d, 0)
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(b_descriptor), "r"(accumulate));
}

// 2^x on the special-function unit (ftz; 2^-inf = +0).
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace deltaserve::kernels::cuda::sm90
