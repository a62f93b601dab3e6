// Dense CPU reference ops: fp32 in, fp32 out, row-major, multithreaded over rows/outputs.
// Every device kernel in kernels/cuda is tested against these with an explicit tolerance.
#pragma once

#include <cstdint>

namespace deltaserve::kernels::cpu {

// y[r, :] = x[r, :] * rsqrt(mean(x[r, :]^2) + eps) * weight (sum of squares in fp64).   x, y: [rows, dim]; weight:
// [dim] or nullptr (= 1). x == y is allowed.
void rms_norm(const float* x, const float* weight, float* y, int64_t rows, int64_t dim, float eps);

// y[rows, out] = x[rows, in] · weight[out, in]^T, or y += ... when accumulate. x and y must not alias.
// Parallel over output features when rows is small (decode), over row tiles otherwise. Each output is
// a fp32 sum in a fixed order (independent of the thread count), so results are reproducible.
void linear(const float* x, const float* weight, float* y, int64_t rows, int64_t in, int64_t out,
            bool accumulate = false);

// sum_i a[i] * b[i] in fp32 (eight partial sums, then the tail).
float dot(const float* a, const float* b, int64_t n);

// Elementwise, in place over n values.
void silu_inplace(float* x, int64_t n);
void sigmoid_inplace(float* x, int64_t n);

// SwiGLU: out[i] = silu(gate[i]) * up[i].
void swiglu(const float* gate, const float* up, float* out, int64_t n);

// SiTU-GLU: out[i] = [beta·tanh(g/beta)·sigmoid(g)] · [beta_linear·tanh(u/beta_linear)], fp32.
void situ_glu(const float* gate, const float* up, float* out, int64_t n, float beta, float beta_linear);

// Scalar helpers used by several ops (numerically safe for large |x|).
float sigmoid(float x);
float softplus(float x);  // log(1 + e^x)
float silu(float x);

}  // namespace deltaserve::kernels::cpu
