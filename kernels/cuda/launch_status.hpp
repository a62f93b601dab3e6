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

}  // namespace deltaserve::kernels::cuda
