// Chunked gated delta rule backward for sm_90a, its chunk-parallel gradients: one warp-specialised CTA per
// (chunk slot, qk head) computes dq, dk (before the l2norm backward) and the slot's dg / dbeta shares over
// the G value heads of the head's GVA group, in place of the Triton backward's P, dq, A and dk kernels
// (gdn_packed/triton/chunk.py, _bwd_heads; their finalize kernel sums the shares and runs the l2norm
// backward, with two dg slots and two dbeta slots here). It reads what the recompute (S^T, U^T) and the
// reverse dS pass (dSn^T, dX'^T) wrote, and prep's gate rows and row factors. Formulas, what is rounded
// where, and the two warpgroups' tile programs: chunk_gdr_grads_sm90.cuh (grads_dq, grads_dk, written once
// for this kernel and its host mirror). Shapes: K = V = 128, C = 64, bf16 or fp16 (fp32: host mirror only),
// GVA (HV = G H).
//   in   q, k [T, H, K], v, do [T, HV, V] (16-bit, contiguous, 16-byte aligned: TMA); g [T, HV] fp32;
//        gates [NC, HV, 5, C], eg_last [NC, HV], rn [NC, HV, 2, C] fp32 (prep's: of slot j HV + h G the row
//        factors rq, rk of qk head h); st, dsn [NC, HV, V, K], ut, dxp [NC, HV, V, C] (q's dtype); table
//        int32 [NC, 4]
//   out  dq, dk [T, H, K] (fp32 with dqk_f32, else q's dtype) on the rows of the table's chunks; dg_part,
//        dbeta_part [2, HV, T] fp32 (slot 0 the dq side's shares, slot 1 the dk side's) on the same rows
// Grid (NC, H). CTA (384 threads, 1 per SM, ~215 KB shared memory):
//   warpgroup 0, producer: one warp, its lane 0: the slot's q, k (both K-halves) and row factors, then per
//        (value head g, V-block vb), into the 2-stage ring by TMA: the 64 value columns of dO and v, the
//        V-block's rows of U^T, dX'^T, S^T, dSn^T, and the head's gate rows (a bulk copy); rows past T
//        arrive 0
//   warpgroup 1, the dq side (grads_dq): dO U^T, dO S^T, dX' v^T, S^T dSn, P; dq
//   warpgroup 2, the dk side (grads_dk): dX' U^T, dX' S^T, U dSn^T; dk (P from the dq side)
// A partial chunk (its rows past the chunk's length belong to the next sequence) has those rows of q, k,
// dO, v zeroed in shared memory before use (by the dq side). The host mirror (chunk_gdr_grads_sm90 with
// host = true) runs both tile programs over every (slot, qk head) in a CPU loop, with plain loops in place of
// wgmma / TMA and of the warp's shuffles.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "api.h"
#include "chunk_gdr_grads_sm90.cuh"
#include "chunk_gdr_sm90_host.cuh"
#include "cuda_status.cuh"
#include "dtypes.cuh"

namespace gdn {
namespace sm90 {
namespace {

struct GradsArgs {
  const void *q, *k, *v, *do_, *st, *ut, *dsn, *dxp;
  const float *g, *gates, *eg_last, *rn;
  const int32_t* table;
  void *dq, *dk;
  float *dg_part, *dbeta_part;
  int64_t T, H, HV, NC;
  float scale;
  bool dqk_f32;
};

// row `row`'s columns c, c + 1 (c even) of dq or dk (fp32 or the input dtype T) as one store
template <typename T>
GDN_HD void store_grad_pair(const GradsArgs& a, void* out, int64_t row, int64_t h, int c, float x0, float x1) {
  const int64_t at = (row * a.H + h) * kK + c;
  if (a.dqk_f32) store2(static_cast<float*>(out) + at, x0, x1);
  else store2(static_cast<T*>(out) + at, x0, x1);
}

// ======================================================================================== host mirror
// The CTA of chunk slot j and qk head h: both warpgroups' tile programs one after the other, each staging
// its tiles again (the dq side's P handed over in pt).
template <typename T>
void mirror_tile(const GradsArgs& a, int64_t j, int64_t h) {
  using P = HostPolicyT<T>;
  const int64_t start = a.table[j * 4 + 2], HV = a.HV, G = HV / a.H;
  const int length = a.table[j * 4 + 3];
  if (length <= 0 || start < 0 || start + std::min(length, kC) > a.T) return;     // (the kernel's guard)
  std::vector<T> q(kC * kK), k(kC * kK), dO(kC * kVB), v(kC * kVB), ut(kVB * kC), dx(kVB * kC), st(kVB * kK),
      dsn(kVB * kK);
  const T *qg = static_cast<const T*>(a.q), *kg = static_cast<const T*>(a.k), *vg = static_cast<const T*>(a.v),
          *dog = static_cast<const T*>(a.do_);
  for (int r = 0; r < kC; ++r)          // the TMA boxes with the dead rows zeroed
    for (int c = 0; c < kK; ++c) {
      q[r * kK + c] = r < length ? qg[((start + r) * a.H + h) * kK + c] : from_f<T>(0.f);
      k[r * kK + c] = r < length ? kg[((start + r) * a.H + h) * kK + c] : from_f<T>(0.f);
    }
  const typename P::Smem q_t{q.data(), kK, true}, k_t{k.data(), kK, true};
  const float* rn = a.rn + (j * HV + h * G) * 2 * kC;
  auto stage = [&](int g, int vb) {
    const int64_t hv = h * G + g, slot = j * HV + hv;
    for (int r = 0; r < kC; ++r)
      for (int c = 0; c < kVB; ++c) {
        const int64_t at = ((start + r) * HV + hv) * kV + vb * kVB + c;
        dO[r * kVB + c] = r < length ? dog[at] : from_f<T>(0.f);
        v[r * kVB + c] = r < length ? vg[at] : from_f<T>(0.f);
      }
    const int64_t rows = slot * kV + vb * kVB;   // the V-block's first row of st, dsn, ut, dxp
    for (int r = 0; r < kVB; ++r) {
      for (int c = 0; c < kC; ++c) {
        ut[r * kC + c] = static_cast<const T*>(a.ut)[(rows + r) * kC + c];
        dx[r * kC + c] = static_cast<const T*>(a.dxp)[(rows + r) * kC + c];
      }
      for (int c = 0; c < kK; ++c) {
        st[r * kK + c] = static_cast<const T*>(a.st)[(rows + r) * kK + c];
        dsn[r * kK + c] = static_cast<const T*>(a.dsn)[(rows + r) * kK + c];
      }
    }
    return GradsTiles<P>{{dO.data(), kVB, true}, {v.data(), kVB, true}, {ut.data(), kC, true},
                         {dx.data(), kC, true},  {st.data(), kK, true}, {dsn.data(), kK, true},
                         a.gates + slot * kGateRows * kC};
  };
  auto done = [](int, int) {};
  auto g_rows = [&](int g) { return a.g + start * HV + h * G + g; };
  auto eg_last = [&](int g) { return a.eg_last[j * HV + h * G + g]; };
  auto share = [&](int side, int g, int r, float d, float db) {     // slot `side` of dg_part, dbeta_part
    const int64_t at = (side * HV + h * G + g) * a.T + start + r;
    a.dg_part[at] = d;
    a.dbeta_part[at] = db;
  };
  P p;
  auto s = std::make_unique<GradsScratch>();
  std::vector<float> pt(kC * kPLd), bt(kC * kPLd);
  auto dq = std::make_unique<typename P::template Frag<kK>>(), dk = std::make_unique<typename P::template Frag<kK>>();
  grads_dq<P, T>(
      p, static_cast<int>(G), length, a.scale, q_t, k_t, rn, rn + kC, *s, pt.data(), *dq, HV, stage, done, g_rows,
      eg_last, [&](int g, int r, float d, float db) { share(0, g, r, d, db); }, [] {});
  grads_dk<P, T>(
      p, static_cast<int>(G), length, q_t, k_t, rn, rn + kC, *s, bt.data(), pt.data(), *dk, HV, stage, done, g_rows,
      [&](int g, int r, float d, float db) { share(1, g, r, d, db); }, [] {});
  P::for_each_pair(*dq, [&](int r, int c, float& x0, float& x1) {
    if (r < length) store_grad_pair<T>(a, a.dq, start + r, h, c, x0, x1);
  });
  P::for_each_pair(*dk, [&](int r, int c, float& x0, float& x1) {
    if (r < length) store_grad_pair<T>(a, a.dk, start + r, h, c, x0, x1);
  });
}

template <typename T>
void run_grads_mirror(const GradsArgs& a) {
  for (int64_t j = 0; j < a.NC; ++j)
    for (int64_t h = 0; h < a.H; ++h) mirror_tile<T>(a, j, h);
}

}  // namespace
}  // namespace sm90
}  // namespace gdn

#include "chunk_gdr_grads_sm90_device.cuh"

namespace gdn {

int chunk_gdr_grads_sm90_smem_bytes() { return sm90::kGradsSmemBytes; }

Status chunk_gdr_grads_sm90(const ChunkGradsSm90Params& p, bool host, int device, std::uintptr_t stream) {
  auto bad = [](const std::string& m) { return Status::invalid("chunk_gdr_grads_sm90: " + m); };
  Status st = sm90::check_sizes(p, host, "chunk_gdr_grads_sm90");
  if (!st.ok()) return st;
  if (p.NC < 0 || p.NC * p.HV > kInt32Max) return bad("NC * HV must fit int32 (TMA coordinates)");
  if (p.H > 65535) return bad("at most 65535 qk heads");
  sm90::GradsArgs a{};
  a.q = reinterpret_cast<const void*>(p.q);
  a.k = reinterpret_cast<const void*>(p.k);
  a.v = reinterpret_cast<const void*>(p.v);
  a.do_ = reinterpret_cast<const void*>(p.do_);
  a.st = reinterpret_cast<const void*>(p.st);
  a.ut = reinterpret_cast<const void*>(p.ut);
  a.dsn = reinterpret_cast<const void*>(p.dsn);
  a.dxp = reinterpret_cast<const void*>(p.dxp);
  a.g = reinterpret_cast<const float*>(p.g);
  a.gates = reinterpret_cast<const float*>(p.gates);
  a.eg_last = reinterpret_cast<const float*>(p.eg_last);
  a.rn = reinterpret_cast<const float*>(p.rn);
  a.table = reinterpret_cast<const int32_t*>(p.table);
  a.dq = reinterpret_cast<void*>(p.dq);
  a.dk = reinterpret_cast<void*>(p.dk);
  a.dg_part = reinterpret_cast<float*>(p.dg_part);
  a.dbeta_part = reinterpret_cast<float*>(p.dbeta_part);
  a.T = p.T;
  a.H = p.H;
  a.HV = p.HV;
  a.NC = p.NC;
  a.scale = p.scale;
  a.dqk_f32 = p.dqk_f32;
  if (host) {
    switch (p.dtype) {
      case kF32: sm90::run_grads_mirror<float>(a); break;
      case kF16: sm90::run_grads_mirror<__half>(a); break;
      default: sm90::run_grads_mirror<__nv_bfloat16>(a); break;
    }
    return {};
  }
  st = use_device(device, "chunk_gdr_grads_sm90");
  if (!st.ok()) return st;
  return sm90::launch_grads(a, p.dtype, reinterpret_cast<cudaStream_t>(stream));
}

}  // namespace gdn
