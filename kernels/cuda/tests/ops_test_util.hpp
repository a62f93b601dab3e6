// Helpers of the GPU ops/sampling/generic-KDA tests: elementwise closeness with a diagnostic naming the worst
// element, NaN-poison checks and a CUDA stream holder. Builds on kda_test_util.hpp (DeviceBuffer, bf16 helpers).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "kernels/cuda/tests/kda_test_util.hpp"

namespace deltaserve::kernels::cuda::test {

// Passes when every |actual[i] - expected[i]| <= atol + rtol * |expected[i]| (NaN only where expected is NaN).
// On failure names the count of bad elements, the worst one (index, expected, actual, abs and rel error) and the
// max abs / rel error and the relative L2 error over all elements.
inline ::testing::AssertionResult all_close(const float* actual, const float* expected, size_t n, double atol,
                                            double rtol, const std::string& what = "") {
  size_t bad = 0, worst = 0;
  double worst_excess = -1.0, max_abs = 0.0, max_rel = 0.0, diff2 = 0.0, norm2 = 0.0;
  for (size_t i = 0; i < n; ++i) {
    const double a = actual[i], e = expected[i];
    if (std::isnan(e) || std::isnan(a) || std::isinf(e) || std::isinf(a)) {
      // Non-finite values must match exactly (NaN with NaN, inf with the same inf).
      const bool same = (std::isnan(e) && std::isnan(a)) || a == e;
      if (!same) {
        ++bad;
        if (worst_excess < INFINITY) worst = i, worst_excess = INFINITY;
      }
      continue;
    }
    const double err = std::fabs(a - e);
    max_abs = std::max(max_abs, err);
    if (e != 0.0) max_rel = std::max(max_rel, err / std::fabs(e));
    diff2 += err * err;
    norm2 += e * e;
    const double excess = err - (atol + rtol * std::fabs(e));
    if (excess > 0.0) {
      ++bad;
      if (excess > worst_excess) worst = i, worst_excess = excess;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  std::ostringstream out;
  out.precision(9);
  out << what << ": " << bad << " of " << n << " elements outside atol " << atol << " + rtol " << rtol
      << "; worst at index " << worst << ": expected " << expected[worst] << ", actual " << actual[worst]
      << "; max abs err " << max_abs << ", max rel err " << max_rel << ", rel L2 err "
      << (norm2 > 0.0 ? std::sqrt(diff2 / norm2) : std::sqrt(diff2));
  return ::testing::AssertionFailure() << out.str();
}

inline ::testing::AssertionResult all_close(const std::vector<float>& actual, const std::vector<float>& expected,
                                            double atol, double rtol, const std::string& what = "") {
  if (actual.size() != expected.size()) {
    return ::testing::AssertionFailure() << what << ": size " << actual.size() << " vs " << expected.size();
  }
  return all_close(actual.data(), expected.data(), actual.size(), atol, rtol, what);
}

// Bitwise equality of two float ranges; the message names the first difference.
inline ::testing::AssertionResult bit_equal(const float* actual, const float* expected, size_t n,
                                            const std::string& what = "") {
  for (size_t i = 0; i < n; ++i) {
    if (std::memcmp(actual + i, expected + i, sizeof(float)) != 0) {
      std::ostringstream out;
      out.precision(9);
      out << what << ": first difference at index " << i << " of " << n << ": expected " << expected[i] << ", actual "
          << actual[i];
      return ::testing::AssertionFailure() << out.str();
    }
  }
  return ::testing::AssertionSuccess();
}

// Every element NaN (poison left untouched); the message names the first that is not.
inline ::testing::AssertionResult all_nan(const float* x, size_t n, const std::string& what = "") {
  for (size_t i = 0; i < n; ++i) {
    if (!std::isnan(x[i])) return ::testing::AssertionFailure() << what << ": index " << i << " is " << x[i];
  }
  return ::testing::AssertionSuccess();
}

class Stream {
 public:
  Stream() { cudaStreamCreate(&stream_); }
  ~Stream() { cudaStreamDestroy(stream_); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t get() const { return stream_; }
  void sync() const { ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess) << "stream sync / kernel error"; }

 private:
  cudaStream_t stream_ = nullptr;
};

inline std::vector<float> nan_vector(size_t n) {
  return std::vector<float>(n, NAN);
}

}  // namespace deltaserve::kernels::cuda::test
