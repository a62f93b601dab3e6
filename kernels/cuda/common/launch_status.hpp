// The status of the kernel launch just made on this thread (a bad configuration, too much shared memory, a sticky
// device error), as a Status naming the launcher. Every launcher returns it after its <<<...>>>.
#pragma once

#include <string>

#include <cuda_runtime.h>

#include "common/status.hpp"

namespace deltaserve::kernels::cuda {

inline Status launch_status(const char* who) {
  const cudaError_t error = cudaGetLastError();
  if (error == cudaSuccess) return Status::ok();
  return internal_error(std::string(who) + ": launch: " + cudaGetErrorName(error) + " (" + cudaGetErrorString(error) +
                        ")");
}

// cudaLaunchKernelEx, with programmatic dependent launch (cudaLaunchAttributeProgrammaticStreamSerialization: the
// kernel's CTAs may start while the kernel before it drains; it must griddepcontrol.wait before reading what that
// kernel writes) when `programmatic`, as a plain launch otherwise. Graph-capturable. The launch's Status names `who`.
template <typename... Params, typename... Args>
Status launch_kernel_ex(bool programmatic, void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                        cudaStream_t stream, const char* who, Args... args) {
  cudaLaunchAttribute attribute[1] = {};
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attribute;
  config.numAttrs = programmatic ? 1 : 0;
  if (const cudaError_t error = cudaLaunchKernelEx(&config, kernel, args...); error != cudaSuccess) {
    (void)cudaGetLastError();  // a launch error is not sticky: later launch_status calls stay clean
    return internal_error(std::string(who) + ": launch: " + cudaGetErrorName(error) + " (" + cudaGetErrorString(error) +
                          ")");
  }
  return launch_status(who);
}

}  // namespace deltaserve::kernels::cuda
