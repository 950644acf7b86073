// Device-side chunk-table builder (contract in segments.cuh and gdn_packed/torch_ref/chunk_table.py).
//
// Launch sequence, fixed for given (T, N, C) and therefore CUDA-graph capturable, no host sync:
//   1. chunk_count_scan_kernel: one block; loops over the N sequences in tiles of kScanThreads,
//      computes nchunks_i and a block-wide inclusive scan, writes cu_chunks (clamped to NC).
//   2. chunk_table_fill_kernel: one thread per slot j < NC; binary search of j in cu_chunks, then
//      the shared per-slot body `gdn::chunk_table_slot`.
// Both kernels are templated on the index type so an int64 cu_seqlens is read with 64-bit loads.
#include <cuda_runtime.h>

#include <string>

#include "api.h"
#include "cuda_status.cuh"
#include "segments.cuh"

namespace gdn {
namespace {

constexpr int kScanThreads = 512;
constexpr int kScanWarps = kScanThreads / 32;
constexpr int kFillThreads = 256;
constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ int64_t warp_inclusive_scan(int64_t v, int lane) {
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int64_t n = __shfl_up_sync(kFullMask, v, o);
    if (lane >= o) v += n;
  }
  return v;
}

template <typename I>
__global__ void __launch_bounds__(kScanThreads)
chunk_count_scan_kernel(const I* __restrict__ cu, int64_t N, int64_t C, int64_t nc,
                        int32_t* __restrict__ cu_chunks) {
  __shared__ int64_t warp_sums[kScanWarps];
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  if (tid == 0) cu_chunks[0] = 0;
  int64_t carry = 0;  // saturated prefix of all previous tiles, <= nc
  for (int64_t tile = 0; tile < N; tile += kScanThreads) {
    const int64_t i = tile + tid;
    // each term <= nc < 2^31 and a tile has 512 terms: partial sums stay below 2^40
    int64_t v = i < N ? seq_nchunks(cu, i, C, nc) : 0;
    v = warp_inclusive_scan(v, lane);
    if (lane == 31) warp_sums[warp] = v;
    __syncthreads();
    if (warp == 0) {
      int64_t w = lane < kScanWarps ? warp_sums[lane] : 0;
      w = warp_inclusive_scan(w, lane);
      if (lane < kScanWarps) warp_sums[lane] = w;
    }
    __syncthreads();
    const int64_t incl = v + (warp > 0 ? warp_sums[warp - 1] : 0);
    if (i < N) cu_chunks[i + 1] = static_cast<int32_t>(sat_add(carry, incl, nc));
    carry = sat_add(carry, warp_sums[kScanWarps - 1], nc);
    __syncthreads();  // warp_sums is rewritten by the next tile
  }
}

template <typename I>
__global__ void __launch_bounds__(kFillThreads)
chunk_table_fill_kernel(const I* __restrict__ cu, const I* __restrict__ padded,
                        const int32_t* __restrict__ cu_chunks, int64_t N, int64_t T, int64_t C,
                        int64_t nc, int32_t* __restrict__ table) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kFillThreads + threadIdx.x;
  if (j >= nc) return;
  int32_t row[4];
  chunk_table_slot(cu, padded, cu_chunks, N, T, C, j, row);
  int32_t* out = table + 4 * j;
  out[0] = row[0];
  out[1] = row[1];
  out[2] = row[2];
  out[3] = row[3];
}

template <typename I>
Status launch(const I* cu, const I* padded, int64_t N, int64_t T, int64_t C, int32_t* table,
              int32_t* cu_chunks, cudaStream_t stream) {
  const int64_t nc = T / C + N;
  chunk_count_scan_kernel<I><<<1, kScanThreads, 0, stream>>>(cu, N, C, nc, cu_chunks);
  Status st = launch_status("chunk_table");
  if (!st.ok() || nc == 0) return st;
  const int64_t blocks = (nc + kFillThreads - 1) / kFillThreads;
  chunk_table_fill_kernel<I><<<static_cast<unsigned>(blocks), kFillThreads, 0, stream>>>(
      cu, padded, cu_chunks, N, T, C, nc, table);
  return launch_status("chunk_table");
}

template <typename I>
void host_build(const I* cu, const I* padded, int64_t N, int64_t T, int64_t C, int32_t* table,
                int32_t* cu_chunks) {
  const int64_t nc = T / C + N;
  // kernel 1 (sequentially): same per-sequence count and the same saturating combine
  int64_t carry = 0;
  cu_chunks[0] = 0;
  for (int64_t i = 0; i < N; ++i) {
    carry = sat_add(carry, seq_nchunks(cu, i, C, nc), nc);
    cu_chunks[i + 1] = static_cast<int32_t>(carry);
  }
  // kernel 2: every thread of the grid, one after the other
  for (int64_t j = 0; j < nc; ++j) chunk_table_slot(cu, padded, cu_chunks, N, T, C, j, table + 4 * j);
}

// The size checks of both paths.
Status check_sizes(int64_t N, int64_t T, int64_t C) {
  if (C <= 0) return Status::invalid("chunk_table: chunk_size must be positive, got " + std::to_string(C));
  if (N < 0) return Status::invalid("chunk_table: N must be >= 0, got " + std::to_string(N));
  if (T < 0) return Status::invalid("chunk_table: T must be >= 0, got " + std::to_string(T));
  if (T / C + N > kInt32Max)
    return Status::invalid("chunk_table: T // chunk_size + N = " + std::to_string(T / C + N) +
                           " does not fit int32");
  return {};
}

template <typename I>
Status run(const ChunkTableParams& p, bool host, cudaStream_t stream) {
  const auto* cu = reinterpret_cast<const I*>(p.cu_seqlens);
  const auto* padded = reinterpret_cast<const I*>(p.cu_seqlens_padded);
  auto* table = reinterpret_cast<int32_t*>(p.table);
  auto* cu_chunks = reinterpret_cast<int32_t*>(p.cu_chunks);
  if (host) {
    host_build(cu, padded, p.N, p.T, p.chunk_size, table, cu_chunks);
    return {};
  }
  return launch(cu, padded, p.N, p.T, p.chunk_size, table, cu_chunks, stream);
}

}  // namespace

Status chunk_table(const ChunkTableParams& p, bool host, int device, std::uintptr_t stream) {
  Status st = check_sizes(p.N, p.T, p.chunk_size);
  if (!st.ok()) return st;
  if (p.cu_seqlens == 0 || p.cu_chunks == 0 || (p.table == 0 && p.T / p.chunk_size + p.N > 0))
    return Status::invalid("chunk_table: cu_seqlens, table and cu_chunks are required");
  if (!host) {
    st = use_device(device, "chunk_table");
    if (!st.ok()) return st;
  }
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  return p.index_int64 ? run<int64_t>(p, host, s) : run<int32_t>(p, host, s);
}

}  // namespace gdn
