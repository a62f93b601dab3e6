#include "kvstore/transfer/cuda/cuda_device_memory.hpp"

#include <string>

#include <cuda_runtime_api.h>

#include "kvstore/transfer/cuda/sum64_kernel.hpp"
#include "kvstore/transfer/sum64.hpp"

namespace deltaserve::kvstore::transfer::cuda {
namespace {

Status cuda_status(cudaError_t e, const std::string& what) {
  return Status(StatusCode::kInternal, what + ": " + cudaGetErrorString(e));
}

cudaStream_t as_stream(void* s) {
  return static_cast<cudaStream_t>(s);
}
cudaEvent_t as_event(void* e) {
  return static_cast<cudaEvent_t>(e);
}

// A ticket is (generation << 32) | slot: a stale ticket of a reused slot never matches.
DeviceMemory::Ticket ticket_of(size_t slot, uint32_t generation) {
  return (static_cast<uint64_t>(generation) << 32) | static_cast<uint64_t>(slot);
}

}  // namespace

Result<std::shared_ptr<CudaDeviceMemory>> CudaDeviceMemory::create(CudaDeviceMemoryOptions options) {
  if (options.max_checksums <= 0) return Status(StatusCode::kInvalidArgument, "max_checksums must be positive");
  std::shared_ptr<CudaDeviceMemory> memory(new CudaDeviceMemory(options));
  DS_RETURN_IF_ERROR(memory->init());
  return memory;
}

Status CudaDeviceMemory::init() {
  int count = 0;
  if (cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess || options_.device < 0 || options_.device >= count) {
    return Status(StatusCode::kUnavailable, "CUDA device " + std::to_string(options_.device) + " not present (" +
                                                std::to_string(count) + " devices: " + cudaGetErrorString(e) + ")");
  }
  if (cudaError_t e = cudaSetDevice(options_.device); e != cudaSuccess) return cuda_status(e, "cudaSetDevice");
  if (cudaError_t e = cudaDeviceGetAttribute(&multiprocessors_, cudaDevAttrMultiProcessorCount, options_.device);
      e != cudaSuccess) {
    return cuda_status(e, "cudaDeviceGetAttribute");
  }
  cudaStream_t stream = nullptr;
  if (cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking); e != cudaSuccess) {
    return cuda_status(e, "cudaStreamCreateWithFlags");
  }
  stream_ = stream;
  const size_t n = static_cast<size_t>(options_.max_checksums);
  if (cudaError_t e = cudaMalloc(reinterpret_cast<void**>(&device_sums_), n * sizeof(unsigned long long));
      e != cudaSuccess) {
    return cuda_status(e, "cudaMalloc of the checksum slots");
  }
  if (cudaError_t e = cudaMallocHost(reinterpret_cast<void**>(&host_sums_), n * sizeof(unsigned long long));
      e != cudaSuccess) {
    return cuda_status(e, "cudaMallocHost of the checksum slots");
  }
  slots_.resize(n);
  for (Slot& slot : slots_) {
    cudaEvent_t event = nullptr;
    if (cudaError_t e = cudaEventCreateWithFlags(&event, cudaEventDisableTiming); e != cudaSuccess) {
      return cuda_status(e, "cudaEventCreate");
    }
    slot.done = event;
  }
  return Status::ok();
}

CudaDeviceMemory::~CudaDeviceMemory() {
  cudaSetDevice(options_.device);
  if (stream_ != nullptr) cudaStreamSynchronize(as_stream(stream_));
  for (Slot& slot : slots_) {
    if (slot.done != nullptr) cudaEventDestroy(as_event(slot.done));
  }
  if (host_sums_ != nullptr) cudaFreeHost(host_sums_);
  if (device_sums_ != nullptr) cudaFree(device_sums_);
  if (stream_ != nullptr) cudaStreamDestroy(as_stream(stream_));
}

bool CudaDeviceMemory::is_device(const void* address) const {
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, address) != cudaSuccess) {
    cudaGetLastError();  // not a pointer CUDA knows: host memory
    return false;
  }
  return attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged;
}

CudaDeviceMemory::Slot* CudaDeviceMemory::slot_of(Ticket ticket) {
  const size_t index = static_cast<size_t>(ticket & 0xFFFFFFFFu);
  if (index >= slots_.size()) return nullptr;
  Slot& slot = slots_[index];
  if (!slot.used || slot.generation != static_cast<uint32_t>(ticket >> 32)) return nullptr;
  return &slot;
}

Result<DeviceMemory::Ticket> CudaDeviceMemory::begin_checksum(std::span<const std::span<const std::byte>> spans) {
  std::lock_guard lock(mu_);
  std::vector<Sum64Span> launch;
  launch.reserve(spans.size());
  uint64_t word = 0, total = 0;
  for (size_t k = 0; k < spans.size(); ++k) {
    if (reinterpret_cast<uintptr_t>(spans[k].data()) % 8 != 0) {
      return Status(StatusCode::kInvalidArgument, "checksum span " + std::to_string(k) + " is not 8-byte aligned");
    }
    if (k + 1 < spans.size() && spans[k].size() % 8 != 0) {
      return Status(StatusCode::kInvalidArgument,
                    "checksum span " + std::to_string(k) + " is not the last and not a multiple of 8 bytes");
    }
    if (!spans[k].empty()) launch.push_back({spans[k].data(), spans[k].size(), word});
    word += spans[k].size() / 8;
    total += spans[k].size();
  }
  size_t index = 0;
  while (index < slots_.size() && slots_[index].used) ++index;
  if (index == slots_.size()) {
    return Status(StatusCode::kResourceExhausted,
                  "all " + std::to_string(slots_.size()) + " GPU checksum slots are in flight");
  }
  if (cudaError_t e = cudaSetDevice(options_.device); e != cudaSuccess) return cuda_status(e, "cudaSetDevice");
  cudaStream_t stream = as_stream(stream_);
  unsigned long long* sum = device_sums_ + index;
  if (cudaError_t e = cudaMemsetAsync(sum, 0, sizeof *sum, stream); e != cudaSuccess) {
    return cuda_status(e, "cudaMemsetAsync");
  }
  if (cudaError_t e = launch_sum64(launch.data(), static_cast<int>(launch.size()), multiprocessors_, sum, stream);
      e != cudaSuccess) {
    return cuda_status(e, "sum64 kernel launch");
  }
  if (cudaError_t e = cudaMemcpyAsync(host_sums_ + index, sum, sizeof *sum, cudaMemcpyDeviceToHost, stream);
      e != cudaSuccess) {
    return cuda_status(e, "cudaMemcpyAsync of a checksum");
  }
  Slot& slot = slots_[index];
  if (cudaError_t e = cudaEventRecord(as_event(slot.done), stream); e != cudaSuccess) {
    return cuda_status(e, "cudaEventRecord");
  }
  slot.used = true;
  ++slot.generation;
  slot.total_bytes = total;
  return ticket_of(index, slot.generation);
}

std::optional<Result<uint64_t>> CudaDeviceMemory::poll_checksum(Ticket ticket) {
  std::lock_guard lock(mu_);
  Slot* slot = slot_of(ticket);
  if (slot == nullptr) {
    return Result<uint64_t>(Status(StatusCode::kNotFound, "no such checksum ticket"));
  }
  const cudaError_t e = cudaEventQuery(as_event(slot->done));
  if (e == cudaErrorNotReady) return std::nullopt;
  slot->used = false;
  if (e != cudaSuccess) return Result<uint64_t>(cuda_status(e, "sum64 checksum"));
  const size_t index = static_cast<size_t>(slot - slots_.data());
  return Result<uint64_t>(sum64_terms::finish(host_sums_[index], slot->total_bytes));
}

void CudaDeviceMemory::cancel_checksum(Ticket ticket) {
  std::lock_guard lock(mu_);
  Slot* slot = slot_of(ticket);
  if (slot == nullptr) return;
  // The slot is reused only after its work is done: the stream runs in order, so a later checksum's memset
  // cannot overtake this one's kernel; waiting here keeps the pinned result slot unambiguous.
  cudaEventSynchronize(as_event(slot->done));
  slot->used = false;
}

Status CudaDeviceMemory::copy(void* destination, const void* source, uint64_t bytes) {
  std::lock_guard lock(mu_);
  if (bytes == 0) return Status::ok();
  if (cudaError_t e = cudaSetDevice(options_.device); e != cudaSuccess) return cuda_status(e, "cudaSetDevice");
  cudaStream_t stream = as_stream(stream_);
  if (cudaError_t e = cudaMemcpyAsync(destination, source, bytes, cudaMemcpyDefault, stream); e != cudaSuccess) {
    return cuda_status(e, "cudaMemcpyAsync");
  }
  if (cudaError_t e = cudaStreamSynchronize(stream); e != cudaSuccess) return cuda_status(e, "copy");
  return Status::ok();
}

}  // namespace deltaserve::kvstore::transfer::cuda
