// Hopper (sm_90a) PTX helpers: mbarriers, TMA tile loads, warpgroup MMA (wgmma) with shared-memory descriptors,
// register reallocation. Shared-memory addresses are 32-bit shared-window addresses (smem_address in mma_sm80.cuh).
// Layout the helpers assume: a K-major bf16 tile of 64 k (128 bytes) per row, written by TMA with
// CU_TENSOR_MAP_SWIZZLE_128B into a 1024-byte aligned buffer: row r at byte r * 128, its 16-byte chunk c stored at
// chunk c ^ (r % 8). wgmma reads the same layout through smem_desc_k_major_sw128.
#pragma once

#include <cstdint>

#include <cuda.h>

namespace deltaserve::kernels::cuda::sm90 {

// ---- mbarrier ------------------------------------------------------------------------------------------------
__device__ __forceinline__ void mbarrier_init(uint32_t bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(arrivals) : "memory");
}
// Releases the barrier initialisations before it (to the other threads, with a block barrier after it).
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// Orders this thread's generic-proxy shared-memory accesses before later async-proxy ones (TMA, wgmma operands).
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Makes barrier initialisations visible to the other threads and to the async proxy (TMA completions); follow
// with a block barrier.
__device__ __forceinline__ void mbarrier_init_fence() {
  fence_mbarrier_init();
  fence_proxy_async_shared();
}
// One arrival plus `bytes` expected transaction bytes (the TMA loads of the phase complete them).
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbarrier_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ bool mbarrier_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n"
      "}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}
__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t ns;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(ns));
  return ns;
}
// A pipeline wait that has not completed after this long is a bug (a lost arrival or transaction byte): the kernel
// traps (the launch fails with an error) instead of hanging the stream. Real waits last microseconds.
constexpr uint64_t kMbarrierTimeoutNs = 10'000'000'000ull;
// Waits until the phase of parity `parity` has completed. A fresh barrier is in phase 0, and waiting on parity 1
// returns at once (the phase before it counts as complete): producers start waiting on "empty" with parity 1.
__device__ __forceinline__ void mbarrier_wait(uint32_t bar, uint32_t parity) {
  if (mbarrier_try_wait(bar, parity)) return;
  const uint64_t start = globaltimer_ns();
  while (!mbarrier_try_wait(bar, parity)) {
    if (globaltimer_ns() - start > kMbarrierTimeoutNs) __trap();
  }
}

// ---- TMA -----------------------------------------------------------------------------------------------------
// `tensor_map`: the generic address of a __grid_constant__ CUtensorMap kernel parameter.
__device__ __forceinline__ void tma_prefetch_descriptor(const CUtensorMap* tensor_map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(tensor_map)) : "memory");
}
// One 2D box at element coordinates (inner, outer) into shared memory at `dst`; the box's bytes complete on `bar`.
// Out-of-range elements are written as zeros and count towards the transaction bytes like the others.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* tensor_map, uint32_t bar, int inner,
                                            int outer) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];\n"
      :
      : "r"(dst), "l"(reinterpret_cast<uint64_t>(tensor_map)), "r"(inner), "r"(outer), "r"(bar)
      : "memory");
}

// ---- register reallocation (all threads of the warpgroup execute it) -------------------------------------------
template <int kRegisters>
__device__ __forceinline__ void warpgroup_release_registers() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}
template <int kRegisters>
__device__ __forceinline__ void warpgroup_claim_registers() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

// ---- wgmma ---------------------------------------------------------------------------------------------------
// Shared-memory matrix descriptor of a 128-byte-swizzled bf16 operand starting at `address` (the tile's 1024-byte
// aligned base plus the step's offset; the swizzle is applied to the absolute address bits, so offsets need no
// base-offset field). Fields (PTX ISA, "matrix descriptor"): bits 0-13 start address >> 4; 16-29 leading-dimension
// byte offset >> 4; 32-45 stride-dimension byte offset >> 4; 49-51 base offset 0 (1024-byte aligned tiles); 62-63
// swizzle mode 1 = 128-byte swizzle.
//   K-major (rows of 64 k, the layout above): stride 1024 (from one 8-row group to the next); leading offset unused
//   while the k16 step lies within one swizzle row (16 by convention); k16 step s starts 32 s bytes in.
//   MN-major (rows of 64 m/n-values, one row per k): leading = bytes to the next 64 m/n-values, stride 1024 (next 8 k).
__device__ __forceinline__ uint64_t smem_descriptor_sw128(uint32_t address, uint32_t leading_bytes,
                                                          uint32_t stride_bytes) {
  return static_cast<uint64_t>((address & 0x3FFFFu) >> 4) | (static_cast<uint64_t>(leading_bytes >> 4) << 16) |
         (static_cast<uint64_t>(stride_bytes >> 4) << 32) | (uint64_t{1} << 62);
}
__device__ __forceinline__ uint64_t smem_desc_k_major_sw128(uint32_t address) {
  return smem_descriptor_sw128(address, 16, 1024);
}

// Orders the register and shared-memory accesses before it against the wgmma that follow (needed before the first
// wgmma and whenever other instructions touched the accumulators since).
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit_group() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// Waits until at most kPending committed wgmma groups of this warpgroup are still running.
template <int kPending>
__device__ __forceinline__ void wgmma_wait_group() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Keeps the compiler from moving accesses of an accumulator register across a wgmma wait (the asynchronous
// wgmma writes it after the issuing instruction has retired).
__device__ __forceinline__ void wgmma_fence_register(float& r) {
  asm volatile("" : "+f"(r)::"memory");
}
__device__ __forceinline__ void wgmma_fence_register(uint32_t& r) {
  asm volatile("" : "+r"(r)::"memory");
}
template <class T, int kN>
__device__ __forceinline__ void wgmma_fence_registers(T (&r)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) wgmma_fence_register(r[i]);
}

// Accumulator operand lists of the wgmma wrappers (here and in the kernels that add their own shapes): the PTX
// operand names %0 .. %(n - 1) as one string, and the n operands c(d[b]), ..., c(d[b + n - 1]) for the constraint c
// ("+f": the product accumulates, "=f": it overwrites).
#define DS_SM90_REGS16 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define DS_SM90_REGS32 DS_SM90_REGS16 ", %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define DS_SM90_REGS64                                                                 \
  DS_SM90_REGS32                                                                       \
  ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define DS_SM90_REGS128                                                                          \
  DS_SM90_REGS64                                                                                 \
  ", %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "           \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "             \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define DS_SM90_ACC8(c, d, b) \
  c(d[b]), c(d[b + 1]), c(d[b + 2]), c(d[b + 3]), c(d[b + 4]), c(d[b + 5]), c(d[b + 6]), c(d[b + 7])
#define DS_SM90_ACC16(c, d, b) DS_SM90_ACC8(c, d, b), DS_SM90_ACC8(c, d, b + 8)
#define DS_SM90_ACC32(c, d, b) DS_SM90_ACC16(c, d, b), DS_SM90_ACC16(c, d, b + 16)
#define DS_SM90_ACC64(c, d, b) DS_SM90_ACC32(c, d, b), DS_SM90_ACC32(c, d, b + 32)
#define DS_SM90_ACC128(c, d, b) DS_SM90_ACC64(c, d, b), DS_SM90_ACC64(c, d, b + 64)

// D[64 x 256] (+)= A[64 x 16] · B[256 x 16]^T, bf16 in, fp32 accumulators, both operands K-major in shared memory.
// accumulate == 0: D = A · B^T (the accumulators' old values are ignored). Accumulator layout (warp w of the
// warpgroup, lane l, register i): row 16 w + l / 4 + 8 ((i % 4) / 2), column 8 (i / 4) + 2 (l % 4) + i % 2.
__device__ __forceinline__ void wgmma_m64n256k16_bf16(float (&d)[128], uint64_t desc_a, uint64_t desc_b,
                                                      uint32_t accumulate) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {" DS_SM90_REGS128
      "}, %128, %129, p, 1, 1, 0, 0;\n"
      "}\n"
      : DS_SM90_ACC128("+f", d, 0)
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

}  // namespace deltaserve::kernels::cuda::sm90
