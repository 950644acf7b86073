// The tile program of the sm_90a chunked gated delta rule forward (csrc/chunk_gdr_fwd_sm90.cu), written
// once for the device kernel and its host mirror. Formulas (docs/DESIGN.md section 2; the same as
// gdn_packed/triton/chunk_fwd.py, whose numerics it keeps): per chunk of C = 64 rows, q^ = rq q,
// k^ = rk k (l2norm row factors, 1 without l2norm), gam_i = sum of g over rows [0, i],
// E_ij = exp(sum of g over (j, i]) for j <= i, w_i = exp(sum of g over (i, last]):
//   A   = strictly lower, A_ij = beta_i E_ij k^_i.k^_j          T = (I + A)^-1, Ts = T - I
//   M   = lower incl. diagonal, M_ij = scale E_ij q^_i.k^_j
//   X'^T = beta (V^T - (e^gam rk) (S^T K^T))                  (S^T: the state block, [64 v, K])
//   U^T  = X'^T + X'^T Ts^T
//   O^T  = (scale e^gam rq) (S^T Q^T) + U^T M^T
//   S^T <- e^gam_last S^T + ((w rk) U^T) K
// Only sums of g over row ranges are exponentiated (never a difference of two cumulative sums), so
// g = -inf (a hard reset) and g ~ -1e30 give exact zeros.
//
// A policy P supplies the tiles (the rest is shared):
//   P::Frag<N>            a 64 x N fp32 tile: on the device the thread's share in the wgmma accumulator
//                         layout, on the host all of it; P::for_each(f, (row, col, value&)) visits it
//   P::Op<T, KD>          a 64 x KD A operand in registers (the fp32 tile rounded to T, times a sign)
//   P::mma(acc, a, b)     acc += a B, B a [KD, N] tile in shared memory (P::Smem: K-major or MN-major)
//   P::mma_ss(acc, a, b)  acc += A B, both in shared memory (prep's Gram matrices)
//   P::store(frag, tile, transpose)   a fragment to a shared tile of the operand type
//   P::vt(tile)           V^T [64 v, 64 c] of the state block's 64 columns of v, as fp32
//   P::for_rows(f)        f(i) for the 64 chunk rows (device: threads 0..63 of the prep warpgroup)
//   P::sync()             shared-memory writes visible to the warpgroup's generic and async (wgmma) reads
// Values rounded (bf16 / fp16 inputs; an fp32 host mirror rounds nothing): the A operands S^T, X'^T, U^T
// and (w rk) U^T of the state warpgroup (to the input dtype); Ts and M (stored in the input dtype); the
// inverse's doubling operands D_b, X_b and A (to the operand type of the inverse, kInvT); q, k, v
// enter exactly. Gate sums, exponentials, row norms, accumulators and the state are fp32.
#pragma once

#include <cmath>

#include "segments.cuh"

namespace gdn {
namespace sm90 {

constexpr int kC = 64;         // chunk rows
constexpr int kK = 128;        // key dim (the kernel's only K)
constexpr int kV = 128;        // value dim (the kernel's only V)
constexpr int kVB = 64;        // state rows (value columns) per state warpgroup
constexpr int kStateWGs = kV / kVB;
constexpr float kLog2e = 1.4426950408889634f;

// Per chunk, what prep leaves in shared memory for the state warpgroups (besides Ts and M).
struct Gates {
  float beta[kC];        // beta (0 on dead rows)
  float egk[kC];         // e^gam rk
  float cq[kC];          // scale e^gam rq
  float wk[kC];          // w rk
  float eg_last;         // e^(sum of g over the chunk)
};

// Prep's row scratch: g, beta of the chunk (0 on dead rows), the row factors and E (fp32 [C, C]).
struct PrepScratch {
  float g[kC];
  float beta[kC];
  float rq[kC];
  float rk[kC];
  float e[kC][kC];       // E_ij for j <= i (0 above the diagonal and on dead rows / columns)
};

GDN_HD float exp_f(float x) { return expf(x); }

// Row i of the chunk's gate sums and of E (a reverse scan of g over (j, i]); g is 0 on dead rows.
GDN_HD void gate_row(const PrepScratch& s, int i, int length, float scale, Gates& out, float* e_row) {
  float gam = 0.f, suf = 0.f, tot = 0.f;
  for (int t = 0; t < kC; ++t) {
    const float gt = s.g[t];
    if (t <= i) gam += gt;
    if (t > i) suf += gt;
    tot += gt;
  }
  const bool live = i < length;
  const float eg = exp_f(gam);
  out.beta[i] = live ? s.beta[i] : 0.f;
  out.egk[i] = live ? eg * s.rk[i] : 0.f;
  out.cq[i] = live ? scale * eg * s.rq[i] : 0.f;
  out.wk[i] = live ? exp_f(suf) * s.rk[i] : 0.f;
  if (i == 0) out.eg_last = exp_f(tot);
  float seg = 0.f;                          // sum of g over (j, i]
  for (int j = kC - 1; j >= 0; --j) {
    if (j < i) seg += s.g[j + 1];
    e_row[j] = (j <= i && live) ? exp_f(seg) : 0.f;
  }
}

// The doubling step's mask: the lower-left b x b block of each 2b x 2b diagonal block.
GDN_HD bool lower_left(int r, int c, int b) {
  return (r / (2 * b)) == (c / (2 * b)) && ((r / b) & 1) && !((c / b) & 1);
}

// ---- prep: one chunk, one value head (the prep warpgroup) ------------------------------------------
// In: the q, k tiles of the qk head (rows past `length` already 0), load_gate(i, &g, &beta) for the
// chunk's live rows. Out: gates, and the Ts and M tiles (input dtype). at / dt: the inverse's scratch
// tiles (A^T, D_b^T), each as a store destination and as a B operand.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable   // instantiated with the host policy (mirror) and the device one (kernel)
#endif
template <class P, typename T, typename TInv, class LoadGate>
GDN_HD void prep_chunk(P& p, const typename P::Smem& q_t, const typename P::Smem& k_kmaj, PrepScratch& s,
                       int length, float scale, bool l2norm, LoadGate&& load_gate, Gates& gates,
                       const typename P::Smem& at_store, const typename P::Smem& at_b,
                       const typename P::Smem& dt_store, const typename P::Smem& dt_b,
                       const typename P::Smem& ts_store, const typename P::Smem& m_store) {
  p.for_rows([&](int i) {
    float g = 0.f, b = 0.f;
    if (i < length) load_gate(i, &g, &b);
    s.g[i] = g;
    s.beta[i] = b;
    s.rk[i] = l2norm ? 1.f / sqrtf(p.template row_sumsq<T>(k_kmaj, i) + 1e-6f) : 1.f;
    s.rq[i] = l2norm ? 1.f / sqrtf(p.template row_sumsq<T>(q_t, i) + 1e-6f) : 1.f;
  });
  p.sync();
  p.for_rows([&](int i) { gate_row(s, i, length, scale, gates, s.e[i]); });
  p.sync();
  // Gram matrices (fp32 accumulators of the exact q, k): K K^T first, A and D_2 from it, then Q K^T
  typename P::template Frag<kC> kk, d;
  P::zero(kk);
  p.template mma_ss<T>(kk, k_kmaj, k_kmaj);
  p.wait_mma();
  // A = beta E (k^ k^^T), strictly lower; D_2 = I - A_1 (the 1 x 1 lower-left blocks)
  P::for_each(kk, [&](int r, int c, float& x) {
    x = (c < r) ? s.beta[r] * s.rk[r] * s.rk[c] * x * s.e[r][c] : 0.f;
  });
  P::for_each2(d, kk, [&](int r, int c, float& dv, float av) {
    dv = (r == c) ? 1.f : (lower_left(r, c, 1) ? -av : 0.f);
  });
  p.template store<TInv>(kk, at_store, true);        // A^T: the B operand [k, n] = A[k][n], K-major
  {
    // M = scale E (q^ k^^T), lower incl. diagonal, stored in the input dtype
    typename P::template Frag<kC> qk;
    P::zero(qk);
    p.template mma_ss<T>(qk, q_t, k_kmaj);
    p.wait_mma();
    P::for_each(qk, [&](int r, int c, float& x) {
      x = (c <= r) ? scale * s.rq[r] * s.rk[c] * x * s.e[r][c] : 0.f;
    });
    p.template store<T>(qk, m_store, false);
  }
  // block doubling: D_2b = D_b - (D_b A_b) D_b, (D_b A_b) = lower_left_b(D_b A) as D_b is block-diagonal
  for (int b = 2; b < kC; b *= 2) {
    p.template store<TInv>(d, dt_store, true);       // D_b^T: the B operand [k, n] = D_b[k][n]
    p.sync();
    typename P::template Frag<kC> x;
    P::zero(x);
    auto d_op = p.template op<TInv, kC>(d, 1.f);
    p.mma(x, d_op, at_b);
    p.wait_mma();
    P::for_each(x, [&](int r, int c, float& v) { if (!lower_left(r, c, b)) v = 0.f; });
    auto x_op = p.template op<TInv, kC>(x, -1.f);
    p.mma(d, x_op, dt_b);
    p.wait_mma();
    p.sync();                                        // every wgmma read of dt_b done before its rewrite
  }
  P::for_each(d, [&](int r, int c, float& v) { if (r == c) v = 0.f; });
  p.template store<T>(d, ts_store, false);           // Ts = T - I, [c][c'] (K-major B of X'^T Ts^T)
}

// ---- the state step: one chunk, one state warpgroup (64 value columns) -----------------------------
// S: S^T [64 v, K] fp32 (accumulator layout). kq_b: [K; Q] rows as the K-major B operand of N = 128
// (columns 0..63 of the product are S^T K^T, 64..127 S^T Q^T); k_mn: K as the MN-major B operand
// [c, K]; ts_b, m_b: Ts and M [c][c'] as K-major B operands; vt: the v tile for P::vt.
// o_out(frag): the caller stores O^T [64 v, 64 c] (cols 64..127 of the frag), live rows only.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <class P, typename T, class OutFn>
GDN_HD void state_step(P& p, typename P::template Frag<kK>& S, const Gates& gt,
                       const typename P::Smem& kq_b, const typename P::Smem& k_mn,
                       const typename P::Smem& ts_b, const typename P::Smem& m_b,
                       const typename P::Smem& v_tile, OutFn&& o_out) {
  typename P::template Frag<2 * kC> acc;             // [S^T K^T | S^T Q^T]
  P::zero(acc);
  {
    auto s_op = p.template op<T, kK>(S, 1.f);
    p.mma(acc, s_op, kq_b);
    p.wait_mma();
  }
  auto vt = p.vt(v_tile);                            // V^T [64 v, 64 c] fp32
  // X'^T in columns 0..63, then U^T = X'^T + X'^T Ts^T accumulated in place
  P::for_each_lo(acc, vt, [&](int, int c, float& x, float v) {
    x = gt.beta[c] * (v - gt.egk[c] * x);
  });
  {
    auto x_op = p.template op_lo<T>(acc, 1.f);
    p.mma_lo(acc, x_op, ts_b);
    p.wait_mma();
  }
  // O^T = cq (S^T Q^T) + U^T M^T in columns 64..127
  P::for_each_hi(acc, [&](int, int c, float& x) { x *= gt.cq[c]; });
  {
    auto u_op = p.template op_lo<T>(acc, 1.f);
    p.mma_hi(acc, u_op, m_b);
    // S^T <- e^gam_last S^T + ((w rk) U^T) K, issued before the wait of the output product
    P::for_each_lo(acc, [&](int, int c, float& x) { x *= gt.wk[c]; });
    auto w_op = p.template op_lo<T>(acc, 1.f);
    P::for_each(S, [&](int, int, float& x) { x *= gt.eg_last; });
    p.mma(S, w_op, k_mn);
    p.wait_mma();
  }
  o_out(acc);
}

}  // namespace sm90
}  // namespace gdn
