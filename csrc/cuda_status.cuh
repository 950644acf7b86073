// The one place that turns a cudaError_t into a gdn::Status (api.h): describe() writes its name and
// text, use_device() makes a device current for this module's own static cudart, launch_status()
// reads (and clears) the error of the launches just made. Included by every .cu file.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "api.h"

namespace gdn {

// "cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime version"
inline std::string describe(cudaError_t e) {
  return std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
}

// Status kCudaError "<what>: <describe(e)>" (clears a non-sticky error so later calls start clean).
inline Status cuda_error(const char* what, cudaError_t e) {
  (void)cudaGetLastError();
  return {StatusKind::kCudaError, std::string(what) + ": " + describe(e)};
}

// Make `device` current for this module's (static) cudart, whose current device is independent of
// torch's.
inline Status use_device(int device, const char* what) {
  int cur = -1;
  cudaError_t e = cudaGetDevice(&cur);
  if (e == cudaSuccess && cur != device) e = cudaSetDevice(device);
  return e == cudaSuccess ? Status{} : cuda_error(what, e);
}

// The status of the launches made so far on this thread.
inline Status launch_status(const char* what) {
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? Status{} : cuda_error(what, e);
}

}  // namespace gdn
