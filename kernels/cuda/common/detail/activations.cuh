// Scalar device functions shared by the kernels: the same formulas as kernels/cpu/basic_ops.hpp, in fp32,
// numerically safe for large |x| (no overflow to inf/NaN in intermediate exponentials).
#pragma once

#include <cuda_runtime.h>

namespace deltaserve::kernels::cuda {

__device__ __forceinline__ float sigmoid_f(float x) {
  // e^{-|x|} never overflows; both branches are exact forms of 1 / (1 + e^{-x}).
  const float e = __expf(-fabsf(x));
  return x >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
}

__device__ __forceinline__ float softplus_f(float x) {  // log(1 + e^x)
  return fmaxf(x, 0.0f) + log1pf(__expf(-fabsf(x)));
}

__device__ __forceinline__ float silu_f(float x) {
  return x * sigmoid_f(x);
}

// SwiGLU of one (gate, up) pair.
__device__ __forceinline__ float swiglu_f(float gate, float up) {
  return silu_f(gate) * up;
}

// SiTU-GLU of one (gate, up) pair: [beta·tanh(g/beta)·sigmoid(g)] · [beta_linear·tanh(u/beta_linear)].
__device__ __forceinline__ float situ_glu_f(float gate, float up, float beta, float beta_linear) {
  return beta * tanhf(gate / beta) * sigmoid_f(gate) * (beta_linear * tanhf(up / beta_linear));
}

}  // namespace deltaserve::kernels::cuda
