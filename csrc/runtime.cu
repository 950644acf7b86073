// Tiny CUDA runtime queries for gdn_packed._C (diagnostics and `cuda_available()`).
#include <cuda_runtime.h>

#include <string>

#include "api.h"
#include "cuda_status.cuh"

namespace gdn {

int cuda_runtime_version() {
  int v = 0;
  if (cudaRuntimeGetVersion(&v) != cudaSuccess) return 0;
  return v;
}

int cuda_compiled_version() { return CUDART_VERSION; }

int cuda_driver_version(std::string* err) {
  int v = 0;
  const cudaError_t e = cudaDriverGetVersion(&v);
  if (e != cudaSuccess) {
    if (err) *err = describe(e);
    return 0;
  }
  if (v == 0 && err) *err = "no CUDA driver installed";
  return v;
}

int cuda_device_count(std::string* err) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();  // clear the (non-sticky) error so later calls start clean
    if (err) *err = describe(e);
    return 0;
  }
  return n;
}

}  // namespace gdn
