// Small host-side helpers of the CUDA backend: CUDA/cuBLAS errors as Status, owned device allocations.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "common/status.hpp"

namespace deltaserve::engine::cuda {

// A failed CUDA runtime call as a Status naming the call site and the CUDA error.
inline Status cuda_status(cudaError_t error, const char* what, const char* file, int line) {
  if (error == cudaSuccess) return Status::ok();
  return internal_error(std::string(what) + " failed at " + file + ":" + std::to_string(line) + ": " +
                        cudaGetErrorName(error) + " (" + cudaGetErrorString(error) + ")");
}
inline Status cublas_status(cublasStatus_t status, const char* what, const char* file, int line) {
  if (status == CUBLAS_STATUS_SUCCESS) return Status::ok();
  return internal_error(std::string(what) + " failed at " + file + ":" + std::to_string(line) + ": " +
                        cublasGetStatusName(status) + " (" + cublasGetStatusString(status) + ")");
}

#define DS_CUDA_RETURN(expr) \
  DS_RETURN_IF_ERROR(::deltaserve::engine::cuda::cuda_status((expr), #expr, __FILE__, __LINE__))
#define DS_CUBLAS_RETURN(expr) \
  DS_RETURN_IF_ERROR(::deltaserve::engine::cuda::cublas_status((expr), #expr, __FILE__, __LINE__))

inline constexpr size_t kDeviceAlignment = 256;
inline constexpr size_t align_up(size_t n, size_t alignment = kDeviceAlignment) {
  return (n + alignment - 1) / alignment * alignment;
}

// One cudaMalloc'ed block, freed on destruction (on the device current at that time: the backend keeps one).
class DeviceMemory {
 public:
  // Bytes held by every live DeviceMemory of this process (all devices): what this process allocated, which the
  // device-wide cudaMemGetInfo cannot tell apart from other processes' allocations on a shared GPU.
  static int64_t live_bytes() { return live_bytes_.load(std::memory_order_relaxed); }

  DeviceMemory() = default;
  ~DeviceMemory() { reset(); }
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  DeviceMemory(DeviceMemory&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}
  DeviceMemory& operator=(DeviceMemory&& other) noexcept {
    if (this != &other) {
      reset();
      data_ = std::exchange(other.data_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
    }
    return *this;
  }

  // Allocates `bytes` (0: nothing). kResourceExhausted when the device has no room, naming `what`.
  [[nodiscard]] Status allocate(size_t bytes, const std::string& what) {
    reset();
    if (bytes == 0) return Status::ok();
    void* data = nullptr;
    const cudaError_t error = cudaMalloc(&data, bytes);
    if (error != cudaSuccess) {
      (void)cudaGetLastError();  // cudaErrorMemoryAllocation is not sticky: clear it
      return Status(StatusCode::kResourceExhausted, "cannot allocate " + std::to_string(bytes) +
                                                        " bytes of device memory for " + what + ": " +
                                                        cudaGetErrorString(error));
    }
    data_ = data;
    bytes_ = bytes;
    live_bytes_.fetch_add(static_cast<int64_t>(bytes), std::memory_order_relaxed);
    return Status::ok();
  }
  void reset() {
    if (data_ != nullptr) {
      (void)cudaFree(data_);
      live_bytes_.fetch_sub(static_cast<int64_t>(bytes_), std::memory_order_relaxed);
    }
    data_ = nullptr;
    bytes_ = 0;
  }
  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  template <class T>
  T* as() const {
    return static_cast<T*>(data_);
  }

 private:
  void* data_ = nullptr;
  inline static std::atomic<int64_t> live_bytes_{0};
  size_t bytes_ = 0;
};

// Bump allocator over one device block: a layer takes its temporaries from it and resets it afterwards.
// Every piece is 256-byte aligned.
class ScratchArena {
 public:
  void assign(void* base, size_t bytes) {
    base_ = static_cast<char*>(base);
    capacity_ = bytes;
    used_ = 0;
  }
  void reset() { used_ = 0; }
  size_t capacity() const { return capacity_; }
  // nullptr when the arena is too small (the caller turns that into an internal error: the plan was wrong).
  template <class T>
  T* take(int64_t count) {
    const size_t bytes = align_up(static_cast<size_t>(count < 0 ? 0 : count) * sizeof(T));
    if (used_ + bytes > capacity_) {
      overflow_ = true;
      return nullptr;
    }
    T* result = reinterpret_cast<T*>(base_ + used_);
    used_ += bytes;
    return result;
  }
  bool overflowed() const { return overflow_; }

 private:
  char* base_ = nullptr;
  size_t capacity_ = 0;
  size_t used_ = 0;
  bool overflow_ = false;
};

}  // namespace deltaserve::engine::cuda
