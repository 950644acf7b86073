// Plain C++ declarations of everything bindings.cpp exposes. bindings.cpp is compiled by the host
// compiler and includes no CUDA header; the implementations live in the .cu files. Every kernel entry
// point returns a Status: its kind says which Python exception the binding raises (one mapping, in
// bindings.cpp), its message what went wrong.
#pragma once

#include <cstdint>
#include <string>

namespace gdn {

enum class StatusKind : int {
  kOk = 0,
  kInvalidValue = 1,  // a size or argument the kernel cannot take      -> ValueError
  kCudaError = 2,     // the CUDA runtime refused (no driver, bad launch) -> RuntimeError
};

struct Status {
  StatusKind kind = StatusKind::kOk;
  std::string message;
  bool ok() const { return kind == StatusKind::kOk; }
  static Status invalid(std::string m) { return {StatusKind::kInvalidValue, std::move(m)}; }
};

// ---- runtime.cu -----------------------------------------------------------------------------------
int cuda_runtime_version();                   // cudaRuntimeGetVersion (the statically linked cudart)
int cuda_compiled_version();                  // CUDART_VERSION the module was compiled against
int cuda_driver_version(std::string* err);    // 0 and *err set when no driver
int cuda_device_count(std::string* err);      // 0 and *err set when no driver / no device

// Every kernel entry point below takes its pointers as integers (device pointers, or host pointers
// for the host mirror; 0 means "none"), and `host`, `device`, `stream`: host = true runs the same
// __host__ __device__ per-thread bodies over the whole grid in a CPU loop; otherwise the kernels are
// launched asynchronously on `stream` (a cudaStream_t as an integer) of `device`, no host sync.

// ---- chunk_table.cu -------------------------------------------------------------------------------
struct ChunkTableParams {
  std::uintptr_t cu_seqlens = 0, cu_seqlens_padded = 0;  // [N+1], both int32 or both int64
  bool index_int64 = false;
  int64_t N = 0, T = 0, chunk_size = 0;
  std::uintptr_t table = 0;      // int32 [T / chunk_size + N, 4]
  std::uintptr_t cu_chunks = 0;  // int32 [N+1]
};
Status chunk_table(const ChunkTableParams& p, bool host, int device, std::uintptr_t stream);

// ---- conv1d_varlen.cu -----------------------------------------------------------------------------
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
// Forward (bwd = false) or backward (bwd = true).
Status conv1d_varlen(const ConvParams& p, bool bwd, bool host, int device, std::uintptr_t stream);

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
Status recurrent_gdr(const RecurrentParams& p, bool host, int device, std::uintptr_t stream);

// ---- chunk_gdr_fwd_sm90.cu (compiled when the CuTe headers and sm_90a are there: GDN_HAVE_SM90) -------
struct ChunkSm90Params {
  std::uintptr_t q = 0, k = 0, v = 0;     // [T, H, K], [T, H, K], [T, HV, V]; 16-bit, contiguous, 16-B aligned
  std::uintptr_t g = 0, beta = 0;         // [T, HV] float32 (raw_gates: the raw a, b)
  std::uintptr_t A_log = 0, dt_bias = 0;  // [HV] float32 (raw_gates only)
  std::uintptr_t table = 0, cu_chunks = 0;             // the device chunk table (chunk_size rows)
  std::uintptr_t initial_state = 0, final_state = 0;   // [N, HV, K, V] float32, or 0
  std::uintptr_t o = 0;                   // [T, HV, V], q's dtype: every row written
  // prep's outputs of every chunk slot for the backward (gdn_packed.triton.chunk.Prep), all or none:
  // gates [NC, HV, 5, C], eg_last [NC, HV], rn [NC, HV, 2, C] float32; ts, mm [NC, HV, C, C] q's dtype
  std::uintptr_t kept_gates = 0, kept_eg_last = 0, kept_rn = 0, kept_ts = 0, kept_mm = 0;
  // the state entering each of the kept_segments segments of every sequence (the Triton state pass's:
  // gdn_packed.triton.common.segment_chunks), [N kept_segments, HV, K, V] float32, or 0
  std::uintptr_t kept_entering = 0;
  int64_t kept_segments = 0;
  // Triton prep's outputs of every chunk slot (gdn_packed.triton.chunk.Prep), all or none: with them the
  // state-only kernel runs on them (g, beta, A_log, dt_bias, scale, l2norm and raw_gates are then prep's,
  // not read here) and kept_gates .. kept_mm must be 0. gates [NC, HV, 5, C], eg_last [NC, HV] float32;
  // ts, mm [NC, HV, C, C] q's dtype (16-byte aligned: TMA and bulk copies)
  std::uintptr_t prep_gates = 0, prep_eg_last = 0, prep_ts = 0, prep_mm = 0;
  int64_t NC = 0;                         // the chunk slots of prep_* (the table's rows)
  int64_t N = 0, T = 0, H = 0, HV = 0, K = 0, V = 0, chunk_size = 0;
  int dtype = 0;                          // 1 float16, 2 bfloat16 (0 float32: host mirror only)
  float scale = 1.f;
  bool l2norm = false, raw_gates = false;
  // the split kernel (a cluster of 4 a (value head, sequence): two state CTAs fed by two prep CTAs) in
  // place of the fused one (with neither prep_* nor split); the host mirror runs the same tile program
  bool split = false;
  // the kernel's form on GVA pairs of value heads (HV / H even), the pair's CTAs sharing each k / q load:
  // the fused kernel in clusters of 4, the split kernel in clusters of 8
  bool pairs = false;
};
Status chunk_gdr_fwd_sm90(const ChunkSm90Params& p, bool host, int device, std::uintptr_t stream);
int chunk_gdr_fwd_sm90_smem_bytes();     // the kernel's dynamic shared memory per CTA (the model reads it)
int chunk_gdr_fwd_sm90_prep_arrivals();  // the arrivals that publish a prep buffer (the build's kPrepArrivals)
// the split kernel's resident clusters on device (pairs: its clusters of 8 on GVA pairs), or -1
int chunk_gdr_fwd_sm90_split_clusters(int device, bool pairs);

// ---- chunk_gdr_bwd_sm90.cu: the backward's reverse dS pass (compiled with the forward: GDN_HAVE_SM90) ----
struct ChunkBwdSm90Params {
  std::uintptr_t q = 0, k = 0, do_ = 0;   // [T, H, K], [T, H, K], [T, HV, V]; 16-bit, contiguous, 16-B aligned
  std::uintptr_t gates = 0;               // Triton prep's gate rows [NC, HV, 5, C] float32 (16-B aligned)
  std::uintptr_t eg_last = 0;             // [NC, HV] float32
  std::uintptr_t ts = 0, mm = 0;          // Ts, M [NC, HV, C, C], q's dtype
  std::uintptr_t table = 0, cu_chunks = 0;             // the device chunk table (chunk_size rows)
  std::uintptr_t dht = 0;                 // [N, HV, K, V] float32, or 0
  std::uintptr_t dsn = 0, dxp = 0;        // out: dSn^T [NC, HV, V, K], dX'^T [NC, HV, V, C], q's dtype
  std::uintptr_t dv = 0;                  // out: [T, HV, V], q's dtype: every row written
  std::uintptr_t dh0 = 0;                 // out: [N, HV, K, V] float32
  std::uintptr_t dq = 0, dk = 0;          // out: [T, H, K], q's dtype: padding rows only (zeros)
  std::uintptr_t dg = 0, dbeta = 0;       // out: [T, HV], gate_dtype: padding rows only (zeros)
  int64_t N = 0, T = 0, H = 0, HV = 0, K = 0, V = 0, NC = 0, chunk_size = 0;
  int dtype = 0;                          // 1 float16, 2 bfloat16 (0 float32: host mirror only)
  int gate_dtype = 0;                     // of dg, dbeta (0 float32, 1 float16, 2 bfloat16)
  bool pairs = false;                     // GVA pairs of value heads (clusters of 4 sharing k / q): HV / H even
};
Status chunk_gdr_bwd_sm90(const ChunkBwdSm90Params& p, bool host, int device, std::uintptr_t stream);
int chunk_gdr_bwd_sm90_smem_bytes();     // the kernel's dynamic shared memory per CTA (the model reads it)

// ---- chunk_gdr_grads_sm90.cu: the backward's chunk-parallel gradients (compiled with the forward) -------
struct ChunkGradsSm90Params {
  std::uintptr_t q = 0, k = 0;            // [T, H, K]; 16-bit, contiguous, 16-B aligned (TMA)
  std::uintptr_t v = 0, do_ = 0;          // [T, HV, V], q's dtype
  std::uintptr_t g = 0;                   // [T, HV] float32: the gates the chunked kernels took
  std::uintptr_t gates = 0, eg_last = 0, rn = 0;   // prep's: [NC, HV, 5, C], [NC, HV], [NC, HV, 2, C] float32
  std::uintptr_t st = 0, ut = 0;          // the recompute's S^T [NC, HV, V, K], U^T [NC, HV, V, C], q's dtype
  std::uintptr_t dsn = 0, dxp = 0;        // the dS pass's dSn^T [NC, HV, V, K], dX'^T [NC, HV, V, C], q's dtype
  std::uintptr_t table = 0;               // the device chunk table, int32 [NC, 4] (16-B aligned)
  std::uintptr_t dq = 0, dk = 0;          // out: [T, H, K], float32 with dqk_f32 (before the l2norm backward),
                                          // else q's dtype; the rows of the table's chunks only
  std::uintptr_t dg_part = 0, dbeta_part = 0;   // out: [2, HV, T] float32: the dq side's shares (slot 0), the dk
                                                // side's (slot 1)
  int64_t N = 0;                          // unused (the sequences are the table's; the shared size checks read it)
  int64_t T = 0, H = 0, HV = 0, K = 0, V = 0, NC = 0, chunk_size = 0;
  int dtype = 0;                          // 1 float16, 2 bfloat16 (0 float32: host mirror only)
  float scale = 1.f;
  bool dqk_f32 = false;
};
Status chunk_gdr_grads_sm90(const ChunkGradsSm90Params& p, bool host, int device, std::uintptr_t stream);
int chunk_gdr_grads_sm90_smem_bytes();   // the kernel's dynamic shared memory per CTA (the model reads it)

}  // namespace gdn
