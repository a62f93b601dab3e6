// Warp-level bf16 tensor-core helpers (mma.sync m16n8k16, ldmatrix), fp32 accumulation.
// Fragment layouts (lane l, group g = l / 4, thread-in-group t = l % 4):
//   A 16x16: a0 (g, 2t..2t+1), a1 (g+8, 2t..), a2 (g, 2t+8..), a3 (g+8, 2t+8..)
//   B 16x8:  b0 (k 2t..2t+1, n g), b1 (k 2t+8.., n g)
//   C 16x8:  c0,c1 (g, 2t..2t+1), c2,c3 (g+8, 2t..2t+1)
#pragma once

#include <cstdint>

#include <cuda_bf16.h>

namespace deltaserve::kernels::cuda::detail {

__device__ __forceinline__ uint32_t smem_address(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* pointer) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(pointer)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* pointer) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(pointer)));
}

__device__ __forceinline__ void mma_bf16_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// A fragment (16 x 16 at m0, k0) of a row-major [m][k] tile with row stride `ld` elements.
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const __nv_bfloat16* base, int ld, int m0, int k0) {
  const int lane = threadIdx.x & 31;
  ldmatrix_x4(a, base + (m0 + (lane & 15)) * ld + k0 + (lane >> 4) * 8);
}

// A fragment of A = X^T where X is row-major [k][m] (stride ld).
__device__ __forceinline__ void load_a_trans(uint32_t (&a)[4], const __nv_bfloat16* base, int ld, int m0, int k0) {
  const int lane = threadIdx.x & 31;
  ldmatrix_x4_trans(a, base + (k0 + (lane & 7) + ((lane >> 4) << 3)) * ld + m0 + ((lane >> 3) & 1) * 8);
}

// B fragments of two n-tiles (n0, n0 + 8) x k-step k0, from a row-major [n][k] tile (k contiguous):
// b[0], b[1] for n-tile n0; b[2], b[3] for n-tile n0 + 8.
__device__ __forceinline__ void load_b_nk(uint32_t (&b)[4], const __nv_bfloat16* base, int ld, int n0, int k0) {
  const int lane = threadIdx.x & 31;
  ldmatrix_x4(b, base + (n0 + (lane & 7) + ((lane >> 4) << 3)) * ld + k0 + ((lane >> 3) & 1) * 8);
}

// Same from a row-major [k][n] tile (n contiguous).
__device__ __forceinline__ void load_b_kn(uint32_t (&b)[4], const __nv_bfloat16* base, int ld, int n0, int k0) {
  const int lane = threadIdx.x & 31;
  ldmatrix_x4_trans(b, base + (k0 + (lane & 7) + ((lane >> 3) & 1) * 8) * ld + n0 + (lane >> 4) * 8);
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

__device__ __forceinline__ void cp_async16(void* smem, const void* global) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_address(smem)), "l"(global));
}
// 16 bytes, or 16 zero bytes without reading global memory when !valid.
__device__ __forceinline__ void cp_async16_zfill(void* smem, const void* global, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_address(smem)), "l"(global),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::);
}
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

}  // namespace deltaserve::kernels::cuda::detail
