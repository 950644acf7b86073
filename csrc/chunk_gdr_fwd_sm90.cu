// Chunked gated delta rule forward for sm_90a (H100 / H200): one persistent, warp-specialised CTA per
// (V-block of 64 value columns, value head, sequence) walks the sequence's chunk slots of the device
// chunk table (chunk_table.cu); the two V-block CTAs of a head share the per-chunk prep as a cluster.
// Formulas, what is rounded where, and the tile program itself: chunk_gdr_sm90.cuh (written once for
// this kernel and its host mirror). Shapes: K = V = 128, C = 64, bf16 or fp16, GVA (HV = G H).
//   in   q, k [T, H, K], v [T, HV, V] (bf16 / fp16, contiguous, 16-byte aligned: TMA);
//        g, beta [T, HV] fp32 (or, with raw_gates, the raw a, b fp32 and A_log, dt_bias [HV] fp32:
//        g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b), computed here in fp32);
//        table int32 [NC, 4], cu_chunks int32 [N + 1] (the device chunk table); h0 [N, HV, K, V] fp32 or 0
//   out  o [T, HV, V] (every row: the CTAs of (hv, n) write their columns of the sequence's rows and of
//        the padding rows after them, n = 0 also those before the first sequence); ht [N, HV, K, V]
//        fp32 (or 0); kept_* (all or none): prep's outputs of the sequences' chunk slots for the backward
//        (gdn_packed.triton.chunk.Prep: gates, rn, eg_last fp32, ts, mm in q's dtype); kept_entering
//        [N kept_segments, HV, K, V] fp32 (or 0): the state entering each segment of the Triton state
//        pass (segment_slots), from which the backward's recompute starts them
// Grid (V-blocks 2, HV, N) in clusters of 2: the two V-block CTAs of a (value head, sequence). CTA
// (384 threads, 1 per SM, 214 KB shared memory):
//   warpgroup 0, producer (32 registers): one warp. Per chunk: the table row (one int4, the next one a
//        chunk ahead), g and beta of the rows for the chunks this CTA preps (plain loads: 4-byte strided
//        columns, below TMA's 16-byte granule; with raw_gates formed from a, b here), then, once both
//        CTAs have released the stage of the 3-stage ring, the TMA loads: the CTA's K-half of k and of q
//        (qk head, [64 rows, 64] each, 128B-swizzled) multicast to both CTAs of the cluster, and the
//        CTA's 64 columns of v; rows past T arrive as 0 (TMA)
//   warpgroup 1, prep (232 registers): every other chunk (j % 2 == the CTA's rank), for both CTAs, up to
//        4 chunks ahead of the state warpgroups: K K^T and Q K^T (wgmma, one group) issued first, and in
//        their shadow the gate sums from strips of 8 rows and |q|^2 (row sums over K-halves); |k|^2 from
//        the diagonal of K K^T; E, A and M in the accumulator layout; (I + A)^-1 as 16 x 16 diagonal
//        blocks in registers (mma.sync), two doubling levels (to 32 x 32, to 64 x 64) on wgmma of their
//        nonzero blocks -> Ts, M,
//        gates in shared memory (4 buffers), sent to the peer CTA's same buffer by a bulk copy over the
//        cluster's shared memory; with kept_* (the backward's), also stored to global memory once
//        handed over (Ts, M unswizzled; the gate rows, row factors and chunk decay as Triton prep's)
//   warpgroup 2, state (240 registers): S^T [64 v, 128] fp32 in registers, the chunk step of
//        chunk_gdr_sm90.cuh (wgmma with S^T, X'^T, U^T as register A operands), O through a
//        transposing stmatrix into the consumed v tile and a TMA store of the chunk
// Two more kernels of the same CTA body (chunk_gdr_fwd_sm90_device.cuh, FwdKind): the split kernel (where
// the CTAs above would leave half the SMs idle: grid (4, HV, N) in clusters of 4, the two state CTAs, prep
// warpgroup idle, fed by two prep CTAs of two prep warpgroups each over the cluster's shared memory; on GVA
// pairs, grid (8, HV / 2, N) in clusters of 8, the pair's four state CTAs sharing k / q) and the state-only
// kernel (on Triton prep's outputs in memory; forced only). The fused kernel's own form on GVA pairs (pairs:
// chunk_gdr_fwd_sm90_pair_kernel, grid (4, HV / 2, N) in clusters of 4) has the four CTAs of the pair's
// two value heads share each k / q load, each loading one of the stage's four [64, 64] blocks.
// A sequence's last chunk, the only one that can be partial, runs outside the chunk loops of prep and
// state: its rows of other sequences (loaded by TMA) are zeroed there and its live rows of o stored one
// by one.
// Synchronisation: mbarriers full / empty (TMA ring), prepped / prepfree (prep buffers, across the
// cluster: chunk_gdr_fwd_sm90_device.cuh); named barriers within a warpgroup. The host mirror
// (chunk_gdr_fwd_sm90 with host = true) runs the same tile program over every (value head, sequence) in
// a CPU loop, with plain loops in place of wgmma / TMA / ldmatrix / the cluster copies, prep once per
// chunk for both V-blocks.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "api.h"
#include "chunk_gdr_sm90.cuh"
#include "chunk_gdr_sm90_host.cuh"
#include "cuda_status.cuh"
#include "dtypes.cuh"


namespace gdn {
namespace sm90 {
namespace {

struct Args {
  const void *q, *k, *v;
  const float *g, *beta, *A_log, *dt_bias, *h0;
  const int32_t *table, *cu_chunks;
  void* o;
  float* ht;
  float *kept_gates, *kept_eg_last, *kept_rn;   // the backward's Prep (ChunkSm90Params), or all 0
  void *kept_ts, *kept_mm;
  float* kept_entering;                       // [N kept_segments, HV, K, V] (ChunkSm90Params), or 0
  int kept_segments;
  const float *prep_gates, *prep_eg_last;     // Triton prep's outputs (ChunkSm90Params): the state-only
  const void *prep_ts, *prep_mm;              // kernel's input, or all 0 (the fused kernel)
  int64_t NC, N, T, H, HV;
  float scale;
  bool l2norm, raw_gates;
  bool split, pairs;                          // the split kernel (ChunkSm90Params), not the fused one; the
                                              // fused or split kernel's form on GVA pairs
};

// softplus and sigmoid in fp32: on the device from ex2 / lg2 / rcp (2 ulp each; log1p(e) as
// log(1 + e) e / ((1 + e) - 1), exact where 1 + e rounds, and e itself where it rounds to 1), without a
// branch; on the host (the mirror, judged against float64) from libm
GDN_HD float softplus_f(float x) {
#if defined(__CUDA_ARCH__)
  float e, u, l2, r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(x * 1.4426950408889634f));
  u = 1.f + e;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(l2) : "f"(u));
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(u - 1.f));
  const float l1p = u == 1.f ? e : (l2 * 0.6931471805599453f) * (e * r);
  return x > 20.f ? x : l1p;
#else
  return x > 20.f ? x : log1pf(expf(x));
#endif
}
GDN_HD float sigmoid_f(float y) {
#if defined(__CUDA_ARCH__)
  float e, r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(-y * 1.4426950408889634f));
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(1.f + e));     // rcp(+inf) = +0
  return r;
#else
  return 1.f / (1.f + expf(-y));
#endif
}

// g log2 e (prep's base-2 gate: chunk_gdr_sm90.cuh) and beta of a row from its stored values x, y (g's and
// beta's; with raw_gates the raw a, b), for value head hv: the head's constants once, the per-row work in
// operator()
struct GateFn {
  float neg_a, dt_bias;      // -exp(A_log[hv]) log2 e, dt_bias[hv]
  bool raw;
  GDN_HD void operator()(float x, float y, float* g, float* b) const {
    *g = raw ? neg_a * softplus_f(x + dt_bias) : x * kLog2e;
    *b = raw ? sigmoid_f(y) : y;
  }
};
GDN_HD GateFn gate_fn(const Args& a, int64_t hv) {
  return a.raw_gates ? GateFn{-expf(a.A_log[hv]) * kLog2e, a.dt_bias[hv], true} : GateFn{0.f, 0.f, false};
}

// ======================================================================================== host mirror
// (the host policy: chunk_gdr_sm90_host.cuh)
// The inverse's operand type: fp16 (10-bit mantissa, as tf32) for 16-bit inputs, fp32 for the fp32
// mirror.
template <typename T> struct InvType { using type = __half; };
template <> struct InvType<float> { using type = float; };

// The kVBlocks CTAs of value head hv and sequence n (their prep is the same: run once per chunk here).
// The k / q tiles and M of consecutive chunks in two buffers each, as the kernel's ring and prep buffers
// (the state-only kernel's step reads the previous chunk's K and M: state_step_deferred).
template <typename T>
void mirror_head(const Args& a, int64_t hv, int64_t n) {
  using P = HostPolicyT<T>;
  using TInv = typename InvType<T>::type;
  P p;
  const int64_t H = a.H, HV = a.HV, h = hv / (HV / H);
  const GateFn gate = gate_fn(a, hv);
  std::vector<T> kq2(2 * 2 * kC * kK), vt(kC * kV), ts(kC * kC), mm2(2 * kC * kC), zero_tile(kC * kC);
  std::vector<TInv> at(kC * kC), dt(kC * kC);
  PrepScratch s;
  Gates gates;
  auto S = std::make_unique<typename P::template Frag<kK>[]>(kVBlocks);
  // the state-only kernel's deferred output per V-block (state_step_deferred): its own group queue, the
  // previous chunk's O^T and U^T (u = 0 before the first chunk), its S update's A operand
  const bool deferred = a.prep_ts != nullptr || a.split;   // (the state-only and split kernels)
  auto ps = std::make_unique<P[]>(kVBlocks);
  auto od = std::make_unique<typename P::template Frag<kC>[]>(kVBlocks);
  auto ud = std::make_unique<typename P::template Op<T, kC>[]>(kVBlocks);
  auto wd = std::make_unique<typename P::template Op<T, kC>[]>(kVBlocks);
  for (int wg = 0; wg < kVBlocks; ++wg) std::fill(std::begin(ud[wg].d), std::end(ud[wg].d), from_f<T>(0.f));
  int64_t prev_start = 0;
  int prev_length = 0;
  for (int wg = 0; wg < kVBlocks; ++wg)
    P::for_each(S[wg], [&](int r, int c, float& x) {
      x = a.h0 ? a.h0[((n * HV + hv) * kK + c) * kV + wg * kVB + r] : 0.f;
    });
  const T* q = static_cast<const T*>(a.q);
  const T* k = static_cast<const T*>(a.k);
  const T* v = static_cast<const T*>(a.v);
  T* o = static_cast<T*>(a.o);
  const typename P::Smem ts_s{ts.data(), kC, true};
  const typename P::Smem at_s{at.data(), kC, true}, dt_s{dt.data(), kC, true};
  auto o_rows = [&](int wg, typename P::template Frag<kC>& ot, int64_t start, int length) {   // O^T's live rows
    P::for_each(ot, [&](int r, int c, float& x) {
      if (c < length) o[((start + c) * HV + hv) * kV + wg * kVB + r] = from_f<T>(x);
    });
  };
  // the states entering the segments (the kernel's walk: chunk_gdr_fwd_sm90_device.cuh)
  const int64_t c0 = a.cu_chunks[n], c1 = a.cu_chunks[n + 1];
  const int nchunks = static_cast<int>(c1 - c0), segs = a.kept_entering ? a.kept_segments : 1;
  const int per = segment_slots(nchunks, segs);
  auto keep_entering = [&](int s) {
    for (int wg = 0; wg < kVBlocks; ++wg) {
      ps[wg].wait_mma(S[wg], wd[wg]);               // (the state-only kernel: its S update)
      if (a.kept_entering) store_state<P>(S[wg], a.kept_entering, (n * segs + s) * HV + hv, wg);
    }
  };
  for (int64_t j = c0; j < c1; ++j) {
    if ((j - c0) % per == 0) keep_entering(static_cast<int>((j - c0) / per));
    const int64_t start = a.table[j * 4 + 2];
    const int length = a.table[j * 4 + 3];
    T* const kq = kq2.data() + (j & 1) * 2 * kC * kK;
    T* const mm = mm2.data() + (j & 1) * kC * kC;
    const typename P::Smem k_b{kq, kK, true}, k_mn{kq, kK, false}, q_a{kq + kC * kK, kK, true};
    const typename P::Smem m_s{mm, kC, true};
    // the TMA boxes: rows past T are 0; then prep zeroes the rows of other sequences (dead rows)
    for (int r = 0; r < kC; ++r) {
      const int64_t row = start + r;
      const bool in = row >= 0 && row < a.T, live = r < length;
      for (int c = 0; c < kK; ++c) {
        kq[r * kK + c] = (in && live) ? k[(row * H + h) * kK + c] : from_f<T>(0.f);
        kq[(kC + r) * kK + c] = (in && live) ? q[(row * H + h) * kK + c] : from_f<T>(0.f);
        vt[r * kV + c] = (in && live) ? v[(row * HV + hv) * kV + c] : from_f<T>(0.f);
      }
    }
    const int64_t slot = j * HV + hv;
    if (a.prep_ts) {                                // the state-only kernel: Triton prep's tiles and gate rows
      std::copy_n(static_cast<const T*>(a.prep_ts) + slot * kC * kC, kC * kC, ts.begin());
      std::copy_n(static_cast<const T*>(a.prep_mm) + slot * kC * kC, kC * kC, mm);
      load_gates(gates, a.prep_gates + slot * kGateRows * kC, a.prep_eg_last[slot]);
    } else {
      alignas(16) float g[kC], beta[kC];            // the producer's: the gates of live rows, else 0
      for (int i = 0; i < kC; ++i) {
        g[i] = beta[i] = 0.f;
        if (i < length) gate(a.g[(start + i) * HV + hv], a.beta[(start + i) * HV + hv], &g[i], &beta[i]);
      }
      prep_chunk<P, T, TInv>(p, q_a, k_b, s, g, beta, length, a.scale, a.l2norm, gates,
                             at_s, at_s, dt_s, dt_s, ts_s, m_s);
    }
    if (a.kept_ts) {                                // the backward's Prep of chunk slot j
      std::copy(ts.begin(), ts.end(), static_cast<T*>(a.kept_ts) + slot * kC * kC);
      std::copy_n(mm, kC * kC, static_cast<T*>(a.kept_mm) + slot * kC * kC);
      for (int r = 0; r < kC; ++r)
        keep_gate_row(gates, s, r, length, a.kept_gates + slot * kGateRows * kC, a.kept_rn + slot * 2 * kC,
                      a.kept_eg_last + slot);
    }
    for (int wg = 0; wg < kVBlocks; ++wg) {         // the CTAs of the V-blocks (prep is the same for both)
      const typename P::Smem v_t{vt.data() + wg * kVB, kV, false};
      if (deferred) {                               // the previous chunk's O stored in this step
        const typename P::Smem m_prev{j > c0 ? mm2.data() + ((j - 1) & 1) * kC * kC : zero_tile.data(), kC, true};
        state_step_deferred<P, T>(ps[wg], S[wg], od[wg], ud[wg], wd[wg], j > c0, m_prev, gates, k_b, q_a, k_mn, ts_s,
                                  v_t, [&](typename P::template Frag<kC>& ot) { o_rows(wg, ot, prev_start, prev_length); });
        continue;
      }
      state_step<P, T>(p, S[wg], gates, k_b, q_a, k_mn, ts_s, m_s, v_t, [&](typename P::template Frag<2 * kC>& acc) {
        P::for_each_hi_pair(acc, [&](int r, int c, float& x0, float& x1) {
          if (c < length) o[((start + c) * HV + hv) * kV + wg * kVB + r] = from_f<T>(x0);
          if (c + 1 < length) o[((start + c + 1) * HV + hv) * kV + wg * kVB + r] = from_f<T>(x1);
        });
      });
    }
    prev_start = start, prev_length = length;
  }
  if (deferred && nchunks > 0)                      // the last chunk's O (state_step_last)
    for (int wg = 0; wg < kVBlocks; ++wg) {
      const typename P::Smem m_last{mm2.data() + ((c1 - 1) & 1) * kC * kC, kC, true};
      state_step_last<P, T>(ps[wg], S[wg], od[wg], ud[wg], wd[wg], m_last);
      o_rows(wg, od[wg], prev_start, prev_length);
    }
  for (int s = 0; s < segs; ++s)
    if (s * per >= nchunks) keep_entering(s);       // the empty segments: the final state
  if (a.ht)
    for (int wg = 0; wg < kVBlocks; ++wg) store_state<P>(S[wg], a.ht, n * HV + hv, wg);
  int64_t pa, pb;
  padding_after(a.table, a.cu_chunks, n, a.N, a.T, &pa, &pb);
  const int64_t first = n == 0 ? padding_before_first(a.table, a.cu_chunks, a.N, a.T) : 0;
  auto zero = [&](int64_t r0, int64_t r1) {
    for (int64_t row = r0; row < r1; ++row)
      for (int c = 0; c < kV; ++c) o[(row * HV + hv) * kV + c] = from_f<T>(0.f);
  };
  zero(pa, pb);
  zero(0, first);
}

template <typename T>
void run_mirror(const Args& a) {
  for_each_head(a.N, a.HV, [&](int64_t hv, int64_t n) { mirror_head<T>(a, hv, n); });
}

}  // namespace
}  // namespace sm90
}  // namespace gdn

#include "chunk_gdr_fwd_sm90_device.cuh"

namespace gdn {

int chunk_gdr_fwd_sm90_smem_bytes() { return sm90::kSmemBytes; }
int chunk_gdr_fwd_sm90_prep_arrivals() { return sm90::kPrepArrivals; }
int chunk_gdr_fwd_sm90_split_clusters(int device, bool pairs) { return sm90::split_clusters(device, pairs); }

Status chunk_gdr_fwd_sm90(const ChunkSm90Params& p, bool host, int device, std::uintptr_t stream) {
  auto bad = [](const std::string& m) { return Status::invalid("chunk_gdr_fwd_sm90: " + m); };
  Status st = sm90::check_sizes(p, host, "chunk_gdr_fwd_sm90");
  if (!st.ok()) return st;
  if (p.raw_gates && (p.A_log == 0 || p.dt_bias == 0)) return bad("raw_gates needs A_log and dt_bias");
  if (p.table == 0 || p.cu_chunks == 0 || (p.o == 0 && p.T > 0)) return bad("table, cu_chunks and o are required");
  const int kept = (p.kept_gates != 0) + (p.kept_eg_last != 0) + (p.kept_rn != 0) + (p.kept_ts != 0) +
                   (p.kept_mm != 0);
  if (kept != 0 && kept != 5)
    return bad("kept_gates, kept_eg_last, kept_rn, kept_ts and kept_mm come together or not at all");
  if (p.kept_entering != 0 && (p.kept_segments < 1 || p.kept_segments > kInt32Max))
    return bad("kept_entering needs kept_segments in [1, 2^31)");
  const int prep = (p.prep_gates != 0) + (p.prep_eg_last != 0) + (p.prep_ts != 0) + (p.prep_mm != 0);
  if (prep != 0 && prep != 4) return bad("prep_gates, prep_eg_last, prep_ts and prep_mm come together or not at all");
  if (prep != 0 && kept != 0)
    return bad("prep_* (the state-only kernel: Triton prep's outputs, which the backward keeps) and kept_gates .. "
               "kept_mm exclude each other");
  if (p.pairs && (prep != 0 || p.H <= 0 || (p.HV / p.H) % 2 != 0))
    return bad("pairs needs the fused or split kernel (no prep_*) and an even number of value heads a qk head "
               "(HV / H)");
  if (prep != 0 && p.split)
    return bad("split (prep in the kernel's own prep CTAs) and prep_* (Triton prep's outputs) exclude each other");
  if (prep != 0 && (p.NC < 1 || p.NC * p.HV > kInt32Max))
    return bad("prep_* need NC >= 1 chunk slots, NC HV < 2^31 (TMA coordinates)");
  if (prep != 0 && !host &&
      ((p.prep_gates | p.prep_ts | p.prep_mm) & 15) != 0)
    return bad("prep_gates, prep_ts and prep_mm must be 16-byte aligned (bulk copies, TMA)");
  sm90::Args a{};
  a.q = reinterpret_cast<const void*>(p.q);
  a.k = reinterpret_cast<const void*>(p.k);
  a.v = reinterpret_cast<const void*>(p.v);
  a.g = reinterpret_cast<const float*>(p.g);
  a.beta = reinterpret_cast<const float*>(p.beta);
  a.A_log = reinterpret_cast<const float*>(p.A_log);
  a.dt_bias = reinterpret_cast<const float*>(p.dt_bias);
  a.h0 = reinterpret_cast<const float*>(p.initial_state);
  a.table = reinterpret_cast<const int32_t*>(p.table);
  a.cu_chunks = reinterpret_cast<const int32_t*>(p.cu_chunks);
  a.o = reinterpret_cast<void*>(p.o);
  a.ht = reinterpret_cast<float*>(p.final_state);
  a.kept_gates = reinterpret_cast<float*>(p.kept_gates);
  a.kept_eg_last = reinterpret_cast<float*>(p.kept_eg_last);
  a.kept_rn = reinterpret_cast<float*>(p.kept_rn);
  a.kept_ts = reinterpret_cast<void*>(p.kept_ts);
  a.kept_mm = reinterpret_cast<void*>(p.kept_mm);
  a.kept_entering = reinterpret_cast<float*>(p.kept_entering);
  a.kept_segments = static_cast<int>(p.kept_segments);
  a.prep_gates = reinterpret_cast<const float*>(p.prep_gates);
  a.prep_eg_last = reinterpret_cast<const float*>(p.prep_eg_last);
  a.prep_ts = reinterpret_cast<const void*>(p.prep_ts);
  a.prep_mm = reinterpret_cast<const void*>(p.prep_mm);
  a.NC = p.NC;
  a.N = p.N;
  a.T = p.T;
  a.H = p.H;
  a.HV = p.HV;
  a.scale = p.scale;
  a.l2norm = p.l2norm;
  a.raw_gates = p.raw_gates;
  a.split = p.split;
  a.pairs = p.pairs;
  if (host) {
    switch (p.dtype) {
      case kF32: sm90::run_mirror<float>(a); break;
      case kF16: sm90::run_mirror<__half>(a); break;
      default: sm90::run_mirror<__nv_bfloat16>(a); break;
    }
    return {};
  }
  st = use_device(device, "chunk_gdr_fwd_sm90");
  if (!st.ok()) return st;
  return sm90::launch(a, p.dtype, reinterpret_cast<cudaStream_t>(stream));
}

}  // namespace gdn
