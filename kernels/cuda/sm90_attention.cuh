// Hopper (sm_90a) building blocks of the warpgroup attention kernels: mbarriers, TMA tile loads, named barriers,
// shared-memory matrix descriptors and the warpgroup MMA shape (m64n128k16, bf16 in, fp32 accumulate) that
// mla_prefill_wgmma.cu uses. PTX ISA 8.0+ (wgmma, cp.async.bulk.tensor, mbarrier expect_tx).
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

namespace deltaserve::kernels::cuda::sm90 {

__device__ __forceinline__ uint32_t smem_u32(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

// ---- mbarriers (shared::cta) ------------------------------------------------------------------------------------
__device__ __forceinline__ void mbarrier_init(uint64_t* barrier, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(barrier)), "r"(arrivals) : "memory");
}
// Makes the initialisations visible to the async proxy (TMA) and the other threads (with a barrier after it).
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// One arrival that also expects `bytes` of asynchronous transactions (the TMA loads completing on it).
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* barrier, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(barrier)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbarrier_arrive(uint64_t* barrier) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(barrier)) : "memory");
}
__device__ __forceinline__ bool mbarrier_try_wait(uint64_t* barrier, uint32_t parity) {
  uint32_t done = 0;
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n"
      "}\n"
      : "=r"(done)
      : "r"(smem_u32(barrier)), "r"(parity)
      : "memory");
  return done != 0;
}
// Waits for the completion of the phase with this parity (a fresh barrier counts its phase "before 0", parity 1,
// as complete). Bounded, so that a lost arrival (a bug) cannot hang the device: a wait past ~2 s of SM clocks gives
// up and sets *gave_up (a flag in shared memory, 0 at the start), and every later wait of a thread that sees the
// flag returns at once; the kernel then finishes with wrong results, which the tests report. (Not __trap(): a trap
// in the kernel makes ptxas ignore setmaxnreg, and the consumers of mla_prefill_wgmma.cu then spill.)
__device__ __forceinline__ void mbarrier_wait(uint64_t* barrier, uint32_t parity, volatile int* gave_up) {
  if (mbarrier_try_wait(barrier, parity)) return;
  const long long start = clock64();
  while (!mbarrier_try_wait(barrier, parity)) {
    if (*gave_up != 0) return;
    if (clock64() - start > 4'000'000'000ll) {
      *gave_up = 1;
      return;
    }
  }
}

// ---- TMA ---------------------------------------------------------------------------------------------------------
__device__ __forceinline__ void prefetch_tensor_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}
// Box at element coordinates (x = column, y = row) of a 2-D tensor map -> shared memory, completing `bytes` (the
// whole box, zero-filled where it leaves the tensor) on `barrier`.
__device__ __forceinline__ void tma_load_2d(void* smem_dst, const CUtensorMap* map, uint64_t* barrier, int x, int y) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n" ::"r"(
          smem_u32(smem_dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(barrier)), "r"(x), "r"(y)
      : "memory");
}
// Orders this thread's generic-proxy shared-memory writes before later async-proxy reads (wgmma operands).
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// ---- named barriers (id 0 is __syncthreads) ------------------------------------------------------------------------
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// ---- register reallocation between warpgroups (all 4 warps of the warpgroup execute it) ----------------------------
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

// ---- wgmma --------------------------------------------------------------------------------------------------------
// Shared-memory matrix descriptor of a 128-byte-swizzled operand (start address, leading / stride byte offsets; all
// in 16-byte units; bits 62-63 = 1: 128-byte swizzle; base offset 0: tiles are 1024-byte aligned).
//   K-major (rows of 64 k-values): SBO = 1024 (next 8 rows), LBO unused (16); k-step s of 16 starts 32 s bytes in.
//   MN-major (rows of 64 m/n-values, one row per k): LBO = bytes to the next 64 m/n-values, SBO = 1024 (next 8 k).
__device__ __forceinline__ uint64_t smem_descriptor_sw128(uint32_t smem_address, uint32_t leading_bytes,
                                                          uint32_t stride_bytes) {
  return static_cast<uint64_t>((smem_address & 0x3FFFFu) >> 4) | (static_cast<uint64_t>(leading_bytes >> 4) << 16) |
         (static_cast<uint64_t>(stride_bytes >> 4) << 32) | (1ull << 62);
}

// Orders the register accesses before it with the wgmma instructions after it (required before a wgmma reads or
// writes registers that ordinary instructions touched).
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// Waits until at most kPending of this thread's committed wgmma groups are still running.
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Keeps the compiler from moving accesses of a wgmma operand register across the fence/wait instructions (which do
// not name the registers themselves).
__device__ __forceinline__ void fence_register(float& x) {
  asm volatile("" : "+f"(x)::"memory");
}
__device__ __forceinline__ void fence_register(uint32_t& x) {
  asm volatile("" : "+r"(x)::"memory");
}
template <class T, int kN>
__device__ __forceinline__ void fence_registers(T (&x)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) fence_register(x[i]);
}

#define DS_SM90_D64_REGS                                                             \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "           \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define DS_SM90_D64_OPERANDS(d)                                                                               \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), \
      "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),  \
      "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), \
      "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), \
      "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), \
      "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), \
      "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), \
      "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

// d (64 x 128, fp32) (+)= A (64 x 16, K-major in shared memory) * B (16 x 128, K-major in shared memory: 128 rows
// of n, each holding the 16 k-values). accumulate = 0: d = A B.
__device__ __forceinline__ void wgmma_m64n128k16_ss(float (&d)[64], uint64_t a_descriptor, uint64_t b_descriptor,
                                                    int accumulate) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" DS_SM90_D64_REGS
      "}, %64, %65, p, 1, 1, 0, 0;\n"
      "}\n"
      : DS_SM90_D64_OPERANDS(d)
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
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" DS_SM90_D64_REGS
      "}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n"
      "}\n"
      : DS_SM90_D64_OPERANDS(d)
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(b_descriptor), "r"(accumulate));
}

#undef DS_SM90_D64_REGS
#undef DS_SM90_D64_OPERANDS

// 2^x on the special-function unit (ftz; 2^-inf = +0).
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace deltaserve::kernels::cuda::sm90
