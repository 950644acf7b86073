// Plain C++ declarations of everything bindings.cpp exposes. bindings.cpp is compiled by the host
// compiler and includes no CUDA header; the implementations live in the .cu files. Every function
// reports failure through its std::string return value ("" = success) or an `err` out-parameter.
#pragma once

#include <cstdint>
#include <string>

namespace gdn {

// ---- runtime.cu -----------------------------------------------------------------------------------
int cuda_runtime_version();                   // cudaRuntimeGetVersion (the statically linked cudart)
int cuda_compiled_version();                  // CUDART_VERSION the module was compiled against
int cuda_driver_version(std::string* err);    // 0 and *err set when no driver
int cuda_device_count(std::string* err);      // 0 and *err set when no driver / no device

// ---- chunk_table.cu -------------------------------------------------------------------------------
// Device build: two kernels on `stream` (cudaStream_t as an integer), no host synchronisation.
//   cu [N+1], padded [N+1] or 0 (both int32, or both int64 when index_int64), table [T/C+N, 4] int32,
//   cu_chunks [N+1] int32, all device pointers on `device`.
std::string chunk_table_cuda(std::uintptr_t cu, std::uintptr_t padded, bool index_int64, int64_t N,
                             int64_t T, int64_t C, std::uintptr_t table, std::uintptr_t cu_chunks,
                             int device, std::uintptr_t stream);
// Host mirror: the same __host__ __device__ bodies run over the whole grid in a CPU loop.
std::string chunk_table_host(std::uintptr_t cu, std::uintptr_t padded, bool index_int64, int64_t N,
                             int64_t T, int64_t C, std::uintptr_t table, std::uintptr_t cu_chunks);
// Size checks shared by both ("" when the sizes are valid).
std::string chunk_table_check_sizes(int64_t N, int64_t T, int64_t C);

}  // namespace gdn
