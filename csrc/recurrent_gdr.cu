// Recurrent (token-by-token) gated delta rule forward over cu_seqlens segments: the decode / verify /
// short-prefill path. Per v-head and sequence, with S [K, V] float32 (docs/DESIGN.md section 2):
//   S~ = exp(g_t) S,  u_t = beta_t (v_t - S~^T k_t),  S = S~ + k_t u_t^T,  o_t = scale S^T q_t
// (q_t, k_t l2-normalised first with l2norm: x / sqrt(sum x^2 + 1e-6)).
// Inputs: q, k [T, H, K], v [T, HV, V] (float32 / float16 / bfloat16, contiguous), g, beta [T, HV]
// float32, cu_seqlens (+ padded) int64 [N+1]. GVA: v-head h reads qk-head h / (HV / H).
// States: per sequence (initial_state [N, HV, K, V] in, final_state [N, HV, K, V] out, both optional)
// or a pool [P, HV, K, V] updated in place through state_indices [N] (an index outside [0, P): start
// from zeros, no write-back).
// Repeated indices (several sequences of one call on one slot) behave as in the torch backend: every
// such sequence starts from the slot's state before the call, and the last of them (highest n) writes
// it back. slot_roles [N] int32 (built on the device by the Python op) says which sequence does what:
//   kSlotOwn        the only sequence on its slot: reads and writes it in the first launch
//   kSlotReadOnly   a later sequence shares the slot: reads it in the first launch, writes nothing
//   kSlotLastWriter the last of several on the slot: reads and writes it in the second launch
// so in the first launch nobody writes a shared slot, and in the second only its last writer touches it
// (stream order separates them: no race, no extra state memory). Without slot_roles: one launch.
// Output o [T, HV, V] in q's dtype: every row is written (padding rows with 0).
//
// Grid: one thread per (sequence, v-head, state column j); j is the fastest index, so a warp reads a
// state row and a row of v/o contiguously and broadcasts q/k. A thread keeps its column S[:, j] in
// registers (KMAX = 32/64/128 bounds K so the array is compile-time indexed) and owns it: threads never
// cooperate, and the host mirror runs the same body over the whole grid in a CPU loop. The thread of
// sequence n also zeroes the padding rows between its last real row and the next sequence's base
// (sequence 0 also the rows before its base). Arithmetic is float32; only o is rounded.
#include "api.h"
#include "dtypes.cuh"
#include "segments.cuh"

namespace gdn {
namespace {

constexpr int kThreads = 128;
constexpr int32_t kSlotOwn = 0, kSlotReadOnly = 1, kSlotLastWriter = 2;   // slot_roles values

template <typename T>
struct RecArgs {
  const T* q;
  const T* k;
  const T* v;
  const float* g;
  const float* beta;
  const int64_t* cu;
  const int64_t* padded;
  const float* h0;
  float* ht;
  const int64_t* idx;
  const int32_t* roles;   // slot_roles [N] or nullptr
  int phase;              // 0: first launch, 1: second launch (kSlotLastWriter only)
  int64_t P;
  T* o;
  int64_t N, T_, H, HV, K, V;
  float scale;
  bool l2norm;
};

GDN_HD float inv_norm(float sumsq) { return 1.f / sqrtf(sumsq + 1e-6f); }

template <typename T, int KMAX>
GDN_HD void recurrent_thread(const RecArgs<T>& a, int64_t n, int64_t hv, int64_t j) {
  const int32_t role = a.roles != nullptr ? a.roles[n] : kSlotOwn;
  if ((role == kSlotLastWriter) != (a.phase == 1)) return;  // this sequence runs in the other launch
  const int64_t K = a.K, V = a.V, HV = a.HV;
  const int64_t state_size = HV * K * V;
  const float* src = nullptr;
  float* dst = nullptr;
  if (a.idx != nullptr) {
    const int64_t slot = a.idx[n];
    if (slot >= 0 && slot < a.P) {
      src = a.h0 + slot * state_size;
      if (role != kSlotReadOnly) dst = a.ht + slot * state_size;
    }
  } else {
    if (a.h0 != nullptr) src = a.h0 + n * state_size;
    if (a.ht != nullptr) dst = a.ht + n * state_size;
  }
  const int64_t col = hv * K * V + j;  // S[hv][i][j] at col + i * V
  float S[KMAX];
#pragma unroll
  for (int i = 0; i < KMAX; ++i) S[i] = (i < K && src != nullptr) ? src[col + i * V] : 0.f;

  int64_t begin, end, pad_end;
  seq_rows(a.cu, a.padded, a.N, a.T_, n, &begin, &end, &pad_end);
  const int64_t h = hv / (HV / a.H);
  for (int64_t row = begin; row < end; ++row) {
    const T* kp = a.k + (row * a.H + h) * K;
    const T* qp = a.q + (row * a.H + h) * K;
    float rk = 1.f, rq = 1.f;
    if (a.l2norm) {
      float sk = 0.f, sq = 0.f;
#pragma unroll
      for (int i = 0; i < KMAX; ++i) {
        if (i < K) {
          const float kv = to_f(kp[i]), qv = to_f(qp[i]);
          sk += kv * kv;
          sq += qv * qv;
        }
      }
      rk = inv_norm(sk);
      rq = inv_norm(sq);
    }
    const float decay = expf(a.g[row * HV + hv]);
    const float b = a.beta[row * HV + hv];
    float kS = 0.f;
#pragma unroll
    for (int i = 0; i < KMAX; ++i) {
      if (i < K) {
        S[i] *= decay;
        kS += S[i] * (to_f(kp[i]) * rk);
      }
    }
    const float u = b * (to_f(a.v[(row * HV + hv) * V + j]) - kS);
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < KMAX; ++i) {
      if (i < K) {
        S[i] += (to_f(kp[i]) * rk) * u;
        acc += S[i] * (to_f(qp[i]) * rq);
      }
    }
    a.o[(row * HV + hv) * V + j] = from_f<T>(a.scale * acc);
  }
  // padding rows owned by this sequence
  const T zero = from_f<T>(0.f);
  for (int64_t row = end; row < pad_end; ++row) a.o[(row * HV + hv) * V + j] = zero;
  if (n == 0) {
    const int64_t first = clamp64(seq_base(a.cu, a.padded, 0), 0, a.T_);
    for (int64_t row = 0; row < first; ++row) a.o[(row * HV + hv) * V + j] = zero;
  }
  if (dst != nullptr) {
#pragma unroll
    for (int i = 0; i < KMAX; ++i)
      if (i < K) dst[col + i * V] = S[i];
  }
}

template <typename T, int KMAX>
__global__ void __launch_bounds__(kThreads) recurrent_gdr_fwd_kernel(RecArgs<T> a, int64_t total) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= total) return;
  const int64_t j = i % a.V, nh = i / a.V;
  recurrent_thread<T, KMAX>(a, nh / a.HV, nh % a.HV, j);
}

template <typename T, int KMAX>
void run_k(RecArgs<T> a, bool host, cudaStream_t stream) {
  const int64_t total = a.N * a.HV * a.V;
  for (a.phase = 0; a.phase < (a.roles != nullptr ? 2 : 1); ++a.phase) {
    if (host) {
      for (int64_t i = 0; i < total; ++i) {
        const int64_t j = i % a.V, nh = i / a.V;
        recurrent_thread<T, KMAX>(a, nh / a.HV, nh % a.HV, j);
      }
    } else if (total > 0) {
      recurrent_gdr_fwd_kernel<T, KMAX><<<blocks_for(total, kThreads), kThreads, 0, stream>>>(a, total);
    }
  }
}

template <typename T>
Status run(const RecurrentParams& p, bool host, cudaStream_t stream) {
  RecArgs<T> a{};
  a.q = reinterpret_cast<const T*>(p.q);
  a.k = reinterpret_cast<const T*>(p.k);
  a.v = reinterpret_cast<const T*>(p.v);
  a.g = reinterpret_cast<const float*>(p.g);
  a.beta = reinterpret_cast<const float*>(p.beta);
  a.cu = reinterpret_cast<const int64_t*>(p.cu_seqlens);
  a.padded = reinterpret_cast<const int64_t*>(p.cu_seqlens_padded);
  a.h0 = reinterpret_cast<const float*>(p.initial_state);
  a.ht = reinterpret_cast<float*>(p.final_state);
  a.idx = reinterpret_cast<const int64_t*>(p.state_indices);
  a.roles = reinterpret_cast<const int32_t*>(p.slot_roles);
  a.P = p.pool_size;
  a.o = reinterpret_cast<T*>(p.o);
  a.N = p.N;
  a.T_ = p.T;
  a.H = p.H;
  a.HV = p.HV;
  a.K = p.K;
  a.V = p.V;
  a.scale = p.scale;
  a.l2norm = p.l2norm;
  if (a.K <= 32) run_k<T, 32>(a, host, stream);
  else if (a.K <= 64) run_k<T, 64>(a, host, stream);
  else run_k<T, 128>(a, host, stream);
  return host ? Status{} : launch_status("recurrent_gdr_fwd");
}

}  // namespace

Status recurrent_gdr(const RecurrentParams& p, bool host, int device, std::uintptr_t stream) {
  auto bad = [](const std::string& m) { return Status::invalid("recurrent_gdr: " + m); };
  if (p.K < 1 || p.K > 128) return bad("K must be in 1..128, got " + std::to_string(p.K));
  if (p.N < 0 || p.T < 0 || p.V < 0) return bad("N, T and V must be >= 0");
  if (p.H < 1 || p.HV < 1 || p.HV % p.H != 0) return bad("HV must be a positive multiple of H");
  if (p.dtype < kF32 || p.dtype > kBF16) return bad("dtype code must be 0, 1 or 2");
  if (p.cu_seqlens == 0 || (p.o == 0 && p.T > 0)) return bad("cu_seqlens and o are required");
  if (p.state_indices != 0 && (p.initial_state == 0 || p.final_state == 0))
    return bad("state_indices needs the state pool as initial_state and final_state");
  if (p.slot_roles != 0 && p.state_indices == 0) return bad("slot_roles needs state_indices");
  if (!host) {
    Status st = use_device(device, "recurrent_gdr");
    if (!st.ok()) return st;
  }
  auto s = reinterpret_cast<cudaStream_t>(stream);
  switch (p.dtype) {
    case kF32: return run<float>(p, host, s);
    case kF16: return run<__half>(p, host, s);
    default: return run<__nv_bfloat16>(p, host, s);
  }
}

}  // namespace gdn
