// Helpers of the GPU KDA tests: device buffers, bf16 rounding, NaN poison and error norms.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

namespace deltaserve::kernels::cuda::test {

#define DS_CUDA_OK(expr)                                                                 \
  do {                                                                                   \
    cudaError_t ds_error_ = (expr);                                                      \
    ASSERT_EQ(ds_error_, cudaSuccess) << #expr << ": " << cudaGetErrorString(ds_error_); \
  } while (0)

// Owning device buffer of n elements of T.
template <class T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t n) : size_(n) {
    if (n > 0 && cudaMalloc(&data_, n * sizeof(T)) != cudaSuccess) data_ = nullptr;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& other) noexcept : data_(other.data_), size_(other.size_) { other.data_ = nullptr; }
  ~DeviceBuffer() {
    if (data_ != nullptr) cudaFree(data_);
  }
  T* get() const { return data_; }
  size_t size() const { return size_; }
  void upload(const std::vector<T>& host) const {
    ASSERT_LE(host.size(), size_);
    ASSERT_EQ(cudaMemcpy(data_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  std::vector<T> download() const {
    std::vector<T> host(size_);
    EXPECT_EQ(cudaMemcpy(host.data(), data_, size_ * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return host;
  }

 private:
  T* data_ = nullptr;
  size_t size_ = 0;
};

inline float bf16_round(float x) {
  return __bfloat162float(__float2bfloat16(x));
}

inline std::vector<__nv_bfloat16> to_bf16(const std::vector<float>& x) {
  std::vector<__nv_bfloat16> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = __float2bfloat16(x[i]);
  return out;
}

inline std::vector<float> to_float(const std::vector<__nv_bfloat16>& x, size_t n) {
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = __bfloat162float(x[i]);
  return out;
}

inline __nv_bfloat16 bf16_nan() {
  __nv_bfloat16_raw raw;
  raw.x = 0x7fc1;
  return __nv_bfloat16(raw);
}

inline std::vector<float> normal_vector(std::mt19937& rng, size_t n, float mean = 0.0f, float stddev = 1.0f) {
  std::normal_distribution<float> normal(mean, stddev);
  std::vector<float> out(n);
  for (float& x : out) x = normal(rng);
  return out;
}

// ||a - b|| / ||b|| over n elements; +inf when a holds a non-finite value.
inline double relative_error(const float* a, const float* b, size_t n) {
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    diff += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    norm += static_cast<double>(b[i]) * b[i];
  }
  return norm == 0.0 ? std::sqrt(diff) : std::sqrt(diff / norm);
}

}  // namespace deltaserve::kernels::cuda::test
