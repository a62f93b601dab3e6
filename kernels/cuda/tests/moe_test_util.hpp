// Helpers shared by the GPU MoE tests (moe_*_test.cpp): error reports with the worst element, NaN/sentinel poison
// values, fast bf16 weight fills, cached expert weights, the device buffers of a plan, and the cuBLAS reference of
// the expert FFN.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include "kernels/cpu/basic_ops.hpp"
#include "kernels/cuda/moe/moe.hpp"
#include "kernels/cuda/ops/ops.hpp"
#include "kernels/cuda/tests/kda_test_util.hpp"

namespace deltaserve::kernels::cuda::test {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr int32_t kSentinel = -12345;

inline bool same_float(float a, float b, float rel) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  if (std::isinf(a) || std::isinf(b)) return a == b;
  return std::fabs(a - b) <= rel * std::max(1.0f, std::fabs(b));
}

// Error summary of actual vs expected over n values, with the worst index.
struct ErrorReport {
  double rel_l2 = 0.0, max_abs = 0.0, rms_ref = 0.0;
  size_t worst = 0;
  float worst_expected = 0.0f, worst_actual = 0.0f;
  bool non_finite = false;
  size_t first_non_finite = 0;
};

inline ErrorReport compare(const float* actual, const float* expected, size_t n) {
  ErrorReport r;
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(actual[i]) && !r.non_finite) {
      r.non_finite = true;
      r.first_non_finite = i;
    }
    const double d = static_cast<double>(actual[i]) - expected[i];
    diff += d * d;
    norm += static_cast<double>(expected[i]) * expected[i];
    if (std::fabs(d) > r.max_abs || (std::isnan(d) && !std::isnan(r.max_abs))) {
      r.max_abs = std::fabs(d);
      r.worst = i;
      r.worst_expected = expected[i];
      r.worst_actual = actual[i];
    }
  }
  r.rel_l2 = norm == 0.0 ? std::sqrt(diff) : std::sqrt(diff / norm);
  r.rms_ref = n == 0 ? 0.0 : std::sqrt(norm / static_cast<double>(n));
  return r;
}

inline std::string describe(const ErrorReport& r, int64_t width) {
  char buffer[512];
  std::snprintf(
      buffer, sizeof(buffer),
      "rel_l2=%.3e max_abs=%.3e (rms_ref=%.3e) at index %zu (row %lld, col %lld): expected %.8g actual %.8g%s",
      r.rel_l2, r.max_abs, r.rms_ref, r.worst, static_cast<long long>(r.worst / width),
      static_cast<long long>(r.worst % width), r.worst_expected, r.worst_actual,
      r.non_finite ? (" NON-FINITE first at " + std::to_string(r.first_non_finite)).c_str() : "");
  return buffer;
}

inline void expect_close(const float* actual, const float* expected, size_t n, int64_t width, double rel_l2_tol,
                         double max_abs_rms_tol, const std::string& what) {
  const ErrorReport r = compare(actual, expected, n);
  EXPECT_FALSE(r.non_finite) << what << ": " << describe(r, width);
  EXPECT_LE(r.rel_l2, rel_l2_tol) << what << ": " << describe(r, width);
  EXPECT_LE(r.max_abs, max_abs_rms_tol * std::max(r.rms_ref, 1e-30)) << what << ": " << describe(r, width);
}

// Fast deterministic uniform fill for the large expert weights (xorshift64*), bf16-rounded.
inline void fill_uniform_bf16(std::vector<__nv_bfloat16>& out, uint64_t seed, float scale) {
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  for (auto& v : out) {
    s ^= s >> 12;
    s ^= s << 25;
    s ^= s >> 27;
    const uint64_t r = s * 0x2545F4914F6CDD1Dull;
    const float u = static_cast<float>(r >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    v = __float2bfloat16((2.0f * u - 1.0f) * scale);
  }
}

// Expert weights of one shape, bf16 (deterministic; the last shape is kept, so the big cases generate them once).
struct ExpertWeightsHost {
  int E = 0;
  int64_t W = 0, I = 0;
  std::vector<__nv_bfloat16> gate_up, down;  // [E, 2 I, W], [E, W, I]
};

inline const ExpertWeightsHost& expert_weights_host(int E, int64_t W, int64_t I) {
  static ExpertWeightsHost cache;
  if (cache.E != E || cache.W != W || cache.I != I) {
    cache = {};
    cache.E = E;
    cache.W = W;
    cache.I = I;
    cache.gate_up.resize(static_cast<size_t>(E) * 2 * I * W);
    cache.down.resize(static_cast<size_t>(E) * W * I);
    const auto seed = static_cast<uint64_t>(E * 131 + W * 7 + I);
    fill_uniform_bf16(cache.gate_up, seed, std::sqrt(3.0f / static_cast<float>(W)));
    fill_uniform_bf16(cache.down, seed + 1, std::sqrt(3.0f / static_cast<float>(I)) * 2.0f);
  }
  return cache;
}

struct PlanBuffers {
  DeviceBuffer<int32_t> offsets, sorted, pos;
  DeviceBuffer<unsigned char> workspace;
  MoePlan plan;
  size_t workspace_bytes = 0;
  PlanBuffers(int64_t T, int k, int E, int pad)
      : offsets(E + 1 + pad),
        sorted(T * k + pad),
        pos(T * k + pad),
        workspace(moe_plan_workspace_bytes(T, k, E)),
        workspace_bytes(moe_plan_workspace_bytes(T, k, E)) {
    plan.expert_offsets = offsets.get();
    plan.sorted_assignments = sorted.get();
    plan.assignment_pos = pos.get();
  }
};

// The expert FFN through cuBLAS, the reference the GPU paths are compared with on every row: per expert with rows,
// H = x_sorted · gate_up_e^T (cublasGemmEx, bf16 in, fp32 compute and out), the GLU by kernels::cuda::glu (fp32,
// rounded once to bf16 into `activated`), y_sorted = activated · down_e^T (fp32 out).
// host_offsets: the plan's expert offsets [E + 1] (read back by the caller). Row-major data in column-major cuBLAS:
// a row-major [m, n] matrix is the column-major [n, m] one, so H^T (2I x n_e) = op_T(GU as W x 2I) · X^T (W x n_e)
// and Y^T (W x n_e) = op_T(D as I x W) · A^T (I x n_e). Synchronises `stream`; writes rows [0, offsets[E]) only.
inline Status cublas_reference_ffn(const MoeFfnParams& p, const std::vector<int32_t>& host_offsets,
                                   cublasHandle_t handle, cudaStream_t stream) {
  const MoeExpertWeights& w = p.weights;
  const int64_t W = w.width, I = w.intermediate;
  const int E = w.num_experts;
  const int64_t used = host_offsets[E];
  if (used == 0) return Status::ok();
  auto check = [](const char* what, cublasStatus_t status) {
    return status == CUBLAS_STATUS_SUCCESS
               ? Status::ok()
               : internal_error(std::string("cublas_reference_ffn: ") + what + ": cuBLAS status " +
                                std::to_string(static_cast<int>(status)));
  };
  DS_RETURN_IF_ERROR(check("set stream", cublasSetStream(handle, stream)));
  DS_RETURN_IF_ERROR(check("set pointer mode", cublasSetPointerMode(handle, CUBLAS_POINTER_MODE_HOST)));
  DeviceBuffer<float> h(static_cast<size_t>(used * 2 * I));
  if (h.get() == nullptr) return internal_error("cublas_reference_ffn: no device memory for the gate/up product");
  const float one = 1.0f, zero = 0.0f;
  const int w32 = static_cast<int>(W), i32 = static_cast<int>(I), gu32 = static_cast<int>(2 * I);
  for (int e = 0; e < E; ++e) {
    const int begin = host_offsets[e], n = host_offsets[e + 1] - begin;
    if (n == 0) continue;
    DS_RETURN_IF_ERROR(check("gate/up GEMM", cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, gu32, n, w32, &one,
                                                          w.gate_up + static_cast<int64_t>(e) * 2 * I * W, CUDA_R_16BF,
                                                          w32, p.x_sorted + static_cast<int64_t>(begin) * W,
                                                          CUDA_R_16BF, w32, &zero, h.get() + int64_t{begin} * 2 * I,
                                                          CUDA_R_32F, gu32, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)));
  }
  // The GLU by the ops kernel (tested against cpu::swiglu / cpu::situ_glu in ops_test), so the reference stays on
  // the device: a host round trip of R x 2I floats made the large cases take seconds.
  DS_RETURN_IF_ERROR(glu(h.get(), used, I, p.glu, p.situ_beta, p.situ_linear_beta, p.activated, stream));
  for (int e = 0; e < E; ++e) {
    const int begin = host_offsets[e], n = host_offsets[e + 1] - begin;
    if (n == 0) continue;
    DS_RETURN_IF_ERROR(check("down GEMM", cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, w32, n, i32, &one,
                                                       w.down + static_cast<int64_t>(e) * W * I, CUDA_R_16BF, i32,
                                                       p.activated + static_cast<int64_t>(begin) * I, CUDA_R_16BF, i32,
                                                       &zero, p.y_sorted + static_cast<int64_t>(begin) * W, CUDA_R_32F,
                                                       w32, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)));
  }
  return cudaStreamSynchronize(stream) == cudaSuccess ? Status::ok()
                                                      : internal_error("cublas_reference_ffn: down GEMMs failed");
}

}  // namespace deltaserve::kernels::cuda::test
