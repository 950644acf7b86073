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

// ---- conv1d_varlen.cu -----------------------------------------------------------------------------
// Pointers are device pointers (host pointers for the host mirror) as integers; 0 means "none".
struct ConvParams {
  std::uintptr_t x = 0, weight = 0, bias = 0, initial_state = 0, cu_seqlens = 0, cu_seqlens_padded = 0;
  int64_t N = 0, T = 0, D = 0;
  int W = 0;
  int dtype = 0;          // 0 float32, 1 float16, 2 bfloat16 (x, y, states, dy, dx)
  bool silu = false;
  int64_t tile_rows = 0;  // rows per thread; the backward's partial sums are per tile
  std::uintptr_t y = 0, final_state = 0;                                    // forward outputs
  std::uintptr_t dy = 0, dfinal = 0, dx = 0, partial = 0, dweight_bias = 0, dinitial_state = 0;  // backward
};
// Forward (bwd = false) or backward (bwd = true); host = true runs the per-thread bodies in a CPU
// loop instead of launching on `stream` of `device`.
std::string conv1d_varlen(const ConvParams& p, bool bwd, bool host, int device, std::uintptr_t stream);
std::string conv1d_varlen_check(const ConvParams& p, bool bwd);

// ---- recurrent_gdr.cu -----------------------------------------------------------------------------
struct RecurrentParams {
  std::uintptr_t q = 0, k = 0, v = 0, g = 0, beta = 0, cu_seqlens = 0, cu_seqlens_padded = 0;
  std::uintptr_t initial_state = 0;  // [N, HV, K, V] float32, or the state pool [P, HV, K, V]
  std::uintptr_t final_state = 0;    // [N, HV, K, V] float32 (0: not written); the pool in pool mode
  std::uintptr_t state_indices = 0;  // int64 [N] (0: per-sequence states)
  int64_t pool_size = 0;             // P; an index outside [0, P) starts from zeros, writes nothing
  std::uintptr_t slot_roles = 0;     // int32 [N] in pool mode (kSlot* in recurrent_gdr.cu), or 0: every
                                     // valid index is distinct
  std::uintptr_t o = 0;
  int64_t N = 0, T = 0, H = 0, HV = 0, K = 0, V = 0;
  int dtype = 0;                     // of q, k, v, o; g and beta are float32
  float scale = 1.f;
  bool l2norm = false;
};
std::string recurrent_gdr(const RecurrentParams& p, bool host, int device, std::uintptr_t stream);

}  // namespace gdn
