// Logit comparisons shared by the CUDA backend's GPU tests.
#pragma once

#include <algorithm>
#include <cmath>
#include <span>

namespace deltaserve::engine::cuda::compare {

inline double max_abs(std::span<const float> v) {
  double m = 0;
  for (float x : v) m = std::max(m, static_cast<double>(std::fabs(x)));
  return m;
}

// max |a - b| (infinite on a size mismatch or a NaN).
inline double max_diff(std::span<const float> a, std::span<const float> b) {
  if (a.size() != b.size()) return INFINITY;
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = std::fabs(static_cast<double>(a[i]) - b[i]);
    if (std::isnan(d)) return INFINITY;
    m = std::max(m, d);
  }
  return m;
}

}  // namespace deltaserve::engine::cuda::compare
