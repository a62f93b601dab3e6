// The driver's cuTensorMapEncodeTiled, reached through the runtime's driver entry point so that the kernels library
// does not link libcuda, and the check for a compute capability 9.x device. Shared by the TMA kernels
// (mla/prefill_wgmma.cu, mla/decode_wgmma.cu, moe/ffn_wgmma.cu).
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

namespace deltaserve::kernels::cuda::detail {

// Looked up once per process; null where the driver does not provide it (the lookup's error is cleared).
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encoder = [] {
    void* function = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &function, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      return static_cast<PFN_cuTensorMapEncodeTiled_v12000>(nullptr);
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(function);
  }();
  return encoder;
}

// Whether the current device is compute capability 9.x, which the TMA / warpgroup-MMA kernels are built for; a failed
// query counts as no (its error is cleared).
inline bool current_device_is_sm90() {
  int device = 0, major = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return major == 9;
}

}  // namespace deltaserve::kernels::cuda::detail
