// The tile program of the sm_90a chunk-parallel backward (csrc/chunk_gdr_grads_sm90.cu), written once for
// the device kernel and its host mirror: for one qk head and chunk slot, the gradients of q and k and the
// chunk's dg / dbeta shares, over the G value heads of the head's GVA group. It takes the place of the four
// chunk-parallel Triton kernels (gdn_packed/triton/chunk_bwd.py: P, dq, A, dk) and computes what they compute
// (the formulas and notation are that file's header), from the same inputs: S^T and U^T of the recompute,
// dSn^T and dX'^T of the reverse dS pass, q, k, v, dO, g, and prep's gate rows and row factors:
//   per value head (E from its g, Q^K^^T = rq rk (q.k), K^K^^T = rk rk (k.k), fp32):
//     Pm = scale (dO U^T) . E strictly lower           DA = -(dX' U^T) . E strictly lower
//     dq += (scale e^gam rq) . (dO S^T)                 dk += -(beta e^gam rk) . (dX' S^T) + (w rk) . (U dSn^T)
//     P  += Pm + diag(scale dO U^T)                     Bh += diag(beta) DA
//     dg shares:   the dq side  rev(rowsum(Pm . Q^K^^T) - colsum(Pm . Q^K^^T) + egq q.(dO S^T)) + e^gam_last <S, dSn>
//                  the dk side  rev(beta rowsum(DA . K^K^^T) - colsum(diag(beta) DA . K^K^^T) - begk k.(dX' S^T))
//                               + excl(wk k.(U dSn^T))
//     dbeta shares: the dq side dX'.v, the dk side rowsum(DA . K^K^^T) - egk k.(dX' S^T)
//   (rev: the reverse cumulative sum over the chunk's rows, excl: the exclusive forward one; egq, begk, wk,
//   egk: prep's gate rows), then once for the group:
//     dq += (P rq rk) K        dk += (B rk rk) K + (P^T rk rq) Q,   B = Bh + Bh^T
// with the row factors (.) applied to fp32 products of the exact input-dtype tiles (the Triton kernels
// round the gated dO, dX' and U to two operands instead: here each value head's product is its own
// accumulator, scaled in fp32), and P, B entering their products as the rounded value and the rounding
// error (two operands, as there). The row dots and <S, dSn> are fp32 sums of exact products: q.(dO S^T),
// k.(dX' S^T), k.(U dSn^T) of the fp32 product tiles; dX'.v and <S, dSn> the diagonals of dX' v^T and
// S^T dSn on the tensor cores (by the dq side, whose products are fewer). Two warpgroups: the dq side
// (grads_dq) and the dk side (grads_dk), which receives P from the dq side.
//
// The policy P is the forward's (chunk_gdr_sm90.cuh), with: P::mma_ss (A in shared memory too),
// P::col_block (a tile's 64-column block), P::add_row_sums / P::row_dot / p.add_col_sums / P::add_diag (row
// and column sums and the diagonal of a fragment, into shared rows / columns; add_col_sums ends with the
// warpgroup's barrier, so that its columns and every shared write before it are visible after it), P::RowVal (a value per chunk
// row, its thread's on the device), p.rev_sum / p.fwd_sum / p.sum_rows (from for_rows, r its own row: a shared
// vector's sum over the rows from r to the last, before r, all; on the device by shuffles within each of the
// two warps).
#pragma once

#include "chunk_gdr_sm90.cuh"

namespace gdn {
namespace sm90 {

// One warpgroup's scratch: the decay tables of the head's chunk (PrepScratch's fields: strip_sums,
// decay_rows, decay2 read them), the head's g, and per-row and per-column sums over the head.
struct alignas(16) GradsScratch {
  alignas(16) float insuf[kC];
  alignas(16) float sigma[kStrips];
  alignas(16) float dsum[kC][kStrip];
  alignas(16) float strip[kC][kStrips + 4];
  alignas(16) float g[kC];         // the head's g in base 2, 0 on dead rows
  alignas(16) float row[4][kC];    // per-row sums (kRow*)
  alignas(16) float col[kC];       // per-column sums
  alignas(16) float part[4][kC];   // the device's per-warp column partials
  alignas(16) float x[2][kC];      // the scans' inputs
};
// the rows of GradsScratch::row: the dq side's, the dk side's
enum GradsRowDq : int { kRowQdot = 0, kRowPm = 1, kRowDxv = 2, kRowSds = 3 };
enum GradsRowDk : int { kRowKF1 = 0, kRowKF2 = 1, kRowA = 2 };

// P (the dq side's) and Bh (the dk side's) as fp32 tiles in shared memory: row r at r * kPLd (4 floats of
// padding: the transposed reads of columns fall on distinct banks)
constexpr int kPLd = kC + 4;

// One stage: value head g's V-block vb of tiles, each as stored (row-major), as K-major operands:
template <class P>
struct GradsTiles {
  typename P::Smem dO, v;          // dO, v [c][64 v]
  typename P::Smem ut, dx;         // U^T, dX'^T [64 v][c]
  typename P::Smem st, dsn;        // S^T, dSn^T [64 v][K] (two 64-column blocks)
  const float* gates;              // the head's gate rows [kGateRows][C] (GateRow)
};

template <class S>
GDN_HD S mn_major(S t) {           // the same tile as an MN-major operand
  t.kmajor = false;
  return t;
}

// Head h's g at chunk row r (g_rows(h): its g at the chunk's rows, `stride` apart), 0 past the live rows
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <class GFn>
GDN_HD float head_g(GFn&& g_rows, int h, int r, int64_t stride, int length) {
  return r < length ? g_rows(h)[r * stride] : 0.f;
}

// A value head's start: its per-row and per-column sums zeroed (the previous head's reads of them are done:
// its last barrier), and the decay tables of its chunk into s from its g (gpre: each row's, loaded during
// the previous head), then the next head's g loaded into gpre (g_rows(h): head h's at the chunk's rows,
// `stride` apart; live rows < length), in flight while this head runs.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <class P, class GFn>
GDN_HD void grads_decay(P& p, GradsScratch& s, typename P::template RowVal<float>& gpre, int g, int G, GFn&& g_rows,
                        int64_t stride, int length) {
  p.for_rows([&](int r) {
    for (int i = 0; i < 4; ++i) s.row[i][r] = 0.f;
    s.col[r] = 0.f;
    s.g[r] = gpre[r] * kLog2e;
    gpre[r] = g + 1 < G ? head_g(g_rows, g + 1, r, stride, length) : 0.f;
  });
  p.sync_generic();
  p.for_rows([&](int c) { strip_sums(s, s.g, c); });
  p.sync_generic();
  p.for_rows([&](int r) {
    float suf, tot;
    decay_rows(s, s.g, r, &suf, &tot);
  });
  p.sync_generic();
}

// A fragment's column half kh (0: columns 0..63, 1: 64..127) of acc += rows(r) x(r, c), rows: a row factor
// per chunk row (shared), sign applied.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <class P>
GDN_HD void add_scaled_half(typename P::template Frag<kK>& acc, int kh, typename P::template Frag<kC>& x,
                            const float* rows, float sign) {
  auto add = [&](int r, int, float& a0, float& a1, float& x0, float& x1) {
    const float f = sign * rows[r];
    a0 += f * x0;
    a1 += f * x1;
  };
  if (kh == 0) P::for_each_lo_pair(acc, x, add);
  else P::for_each_hi2_pair(acc, x, add);
}

// acc += (x (.) the row factors fr (.) the column factors fc) B issued, x fp32 (64 x 64, consumed) entering as
// its rounded value hi and its rounding error lo, B a [c, K] tile as an MN-major operand (N = K); the caller's
// wait_mma names acc, hi and lo
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <class P, typename T>
GDN_HD void issue_hi_lo(P& p, typename P::template Frag<kK>& acc, typename P::template Frag<kC>& x, const float* fr,
                        const float* fc, const typename P::Smem& b, typename P::template Op<T, kC>& hi,
                        typename P::template Op<T, kC>& lo) {
  P::for_each_pair(x, [&](int r, int c, float& x0, float& x1) {
    const float2 f = col2(fc, c);
    x0 = x0 * fr[r] * f.x;
    x1 = x1 * fr[r] * f.y;
  });
  hi = p.template op<T, kC>(x, 1.f);
  P::sub_op(x, hi);
  lo = p.template op<T, kC>(x, 1.f);
  p.mma(acc, hi, mn_major(b));
  p.mma(acc, lo, mn_major(b));
}

// x.y^T of two [c][K] tiles (raw, fp32) times the row factors fx (rows) and fy (columns), to the fp32 tile
// out ([64][kPLd])
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <class P, typename T>
GDN_HD void gram(P& p, const typename P::Smem& x, const typename P::Smem& y, const float* fx, const float* fy,
                 float* out) {
  typename P::template Frag<kC> f;
  P::zero(f);
  p.template mma_ss<T, kK>(f, x, y);
  p.wait_mma(f);
  P::for_each_pair(f, [&](int r, int c, float& x0, float& x1) {     // every factor read before the first
    const float2 s = col2(fy, c);                                    // store (which may alias them)
    x0 = x0 * fx[r] * s.x;
    x1 = x1 * fx[r] * s.y;
  });
  P::for_each_pair(f, [&](int r, int c, float& x0, float& x1) { store2(out + r * kPLd + c, x0, x1); });
  p.sync_generic();
}

// f (.)= t, an fp32 [64][kPLd] tile in shared memory (the Gram matrices)
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <class P>
GDN_HD void times_tile(typename P::template Frag<kC>& f, const float* t) {
  P::for_each_pair(f, [&](int r, int c, float& x0, float& x1) {
    const float2 y = load2(t + r * kPLd + c);
    x0 *= y.x;
    x1 *= y.y;
  });
}

// A side's start: head 0's g in flight (gpre), its Gram matrix (x y^T, row factors fx, fy) into gram
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <class P, typename T, class GFn>
GDN_HD void grads_start(P& p, typename P::template RowVal<float>& gpre, GFn&& g_rows, int64_t stride,
                        int length, const typename P::Smem& x, const typename P::Smem& y, const float* fx,
                        const float* fy, float* gram_out) {
  p.for_rows([&](int r) { gpre[r] = head_g(g_rows, 0, r, stride, length); });
  gram<P, T>(p, x, y, fx, fy, gram_out);
}

// The dq side (one warpgroup). stage(g, vb) waits for and returns value head g's V-block vb (GradsTiles),
// done(g, vb) releases it; g_rows(g): that head's g at the chunk's rows (g_stride apart). q_t, k_t: the
// chunk's q, k [c][K] (dead rows 0); rq, rk: the row factors; pt: a [64][kPLd] fp32 tile, Q^K^^T's over the
// heads (the fragment's registers are the loop's), then P's; eg_last(g): head g's e^gam_last. Out: dq (its
// state products and P K^; the caller stores it), share(g, r, dg, dbeta) for rows r < length, and P in pt
// before p_out() (the dk side's).
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <class P, typename T, class StageFn, class DoneFn, class GFn, class EgFn, class ShareFn, class POut>
GDN_HD void grads_dq(P& p, int G, int length, float scale, const typename P::Smem& q_t, const typename P::Smem& k_t,
                     const float* rq, const float* rk, GradsScratch& s, float* pt, typename P::template Frag<kK>& dq,
                     int64_t g_stride, StageFn&& stage, DoneFn&& done, GFn&& g_rows, EgFn&& eg_last, ShareFn&& share,
                     POut&& p_out) {
  typename P::template Frag<kC> pacc;
  P::zero(pacc);
  P::zero(dq);
  typename P::template RowVal<float> gpre;
  grads_start<P, T>(p, gpre, g_rows, g_stride, length, q_t, k_t, rq, rk, pt);      // Q^K^^T
  for (int g = 0; g < G; ++g) {
    grads_decay(p, s, gpre, g, G, g_rows, g_stride, length);
    typename P::template Frag<kC> dm;                  // dO U^T
    P::zero(dm);
    const float* egq = nullptr;
    for (int vb = 0; vb < kVBlocks; ++vb) {
      const GradsTiles<P> t = stage(g, vb);
      egq = t.gates + kGateEgq * kC;
      typename P::template Frag<kC> x0, x1;            // dO S^T's K-halves: the second on the tensor cores
      P::zero(x0);                                     // while the first is added in
      P::zero(x1);
      p.template mma_ss<T, kVB>(dm, t.dO, mn_major(t.ut));
      p.template mma_ss<T, kVB>(x0, t.dO, mn_major(P::template col_block<T>(t.st, 0)));
      p.template mma_ss<T, kVB>(x1, t.dO, mn_major(P::template col_block<T>(t.st, 1)));
      p.template wait_mma_left<1>(dm, x0);
      add_scaled_half<P>(dq, 0, x0, egq, 1.f);
      p.template row_dot<T>(x0, P::template col_block<T>(q_t, 0), s.row[kRowQdot]);
      p.wait_mma(x1);
      add_scaled_half<P>(dq, 1, x1, egq, 1.f);
      p.template row_dot<T>(x1, P::template col_block<T>(q_t, 1), s.row[kRowQdot]);
      // and dX'.v, <S, dSn> as the diagonals of dX' v^T and S^T dSn (its rows v of the V-block), through the
      // same two fragments
      P::zero(x0);
      P::zero(x1);
      p.template mma_ss<T, kVB>(x0, mn_major(t.dx), t.v);
      p.template mma_ss<T, kK>(x1, t.st, t.dsn);
      p.template wait_mma_left<1>(x0);
      P::add_diag(x0, s.row[kRowDxv]);
      p.wait_mma(x1);
      P::add_diag(x1, s.row[kRowSds]);
      if (vb + 1 < kVBlocks) done(g, vb);
    }
    // Pm = scale dM . E strictly lower, into P with dM's scaled diagonal (E_rr = 1); then Pm . Q^K^^T
    P::for_each_pair2(dm, pacc, [&](int r, int c, float& m0, float& m1, float& a0, float& a1) {
      const float2 e = decay2(s, r, c);
      const float p0 = c < r ? scale * m0 * e.x : 0.f, p1 = c + 1 < r ? scale * m1 * e.y : 0.f;
      a0 += c == r ? scale * m0 : p0;
      a1 += c + 1 == r ? scale * m1 : p1;
      m0 = p0;
      m1 = p1;
    });
    times_tile<P>(dm, pt);                             // . Q^K^^T
    P::add_row_sums(dm, s.row[kRowPm]);
    p.add_col_sums(dm, s.col, &s.part[0][0]);          // (ends with the warpgroup's barrier)
    p.for_rows([&](int r) { s.x[0][r] = s.row[kRowPm][r] - s.col[r] + egq[r] * s.row[kRowQdot][r]; });
    p.sync_generic();
    const float eg = eg_last(g);
    p.for_rows([&](int r) {
      const float d = p.rev_sum(s.x[0], r) + eg * p.sum_rows(s.row[kRowSds]);
      if (r < length) share(g, r, d, s.row[kRowDxv][r]);
    });
    done(g, kVBlocks - 1);                           // (its barrier: every read of the sums done)
  }
  P::for_each(pacc, [&](int r, int c, float& x) { pt[r * kPLd + c] = x; });   // (every read of Q^K^^T done:
  p_out();                                                                     // the last head's barriers)
  typename P::template Op<T, kC> hi, lo;
  issue_hi_lo<P, T>(p, dq, pacc, rq, rk, k_t, hi, lo);  // (P rq rk) K
  p.wait_mma(dq, hi, lo);
}

// The dk side (one warpgroup), as grads_dq; share(g, r, dg, dbeta) for rows r < length; bt: its [64][kPLd]
// fp32 tile (K^K^^T over the heads, then Bh, B's transpose); pt: the dq side's P, read once p_wait() has
// returned.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <class P, typename T, class StageFn, class DoneFn, class GFn, class ShareFn, class PWait>
GDN_HD void grads_dk(P& p, int G, int length, const typename P::Smem& q_t, const typename P::Smem& k_t,
                     const float* rq, const float* rk, GradsScratch& s, float* bt, const float* pt,
                     typename P::template Frag<kK>& dk, int64_t g_stride, StageFn&& stage, DoneFn&& done,
                     GFn&& g_rows, ShareFn&& share, PWait&& p_wait) {
  typename P::template Frag<kC> bh;
  P::zero(bh);
  P::zero(dk);
  typename P::template RowVal<float> gpre;
  grads_start<P, T>(p, gpre, g_rows, g_stride, length, k_t, k_t, rk, rk, bt);      // K^K^^T
  for (int g = 0; g < G; ++g) {
    grads_decay(p, s, gpre, g, G, g_rows, g_stride, length);
    typename P::template Frag<kC> da;                  // dX' U^T
    P::zero(da);
    const float* gt = nullptr;
    for (int vb = 0; vb < kVBlocks; ++vb) {
      const GradsTiles<P> t = stage(g, vb);
      gt = t.gates;
      const float *begk = gt + kGateBegk * kC, *wk = gt + kGateWk * kC;
      typename P::template Frag<kC> x;
      // dX' S^T a K-half at a time into dk (-(beta e^gam rk) rows) and k.(dX' S^T); dX' U^T on the tensor
      // cores while the first half is added in
      P::zero(x);
      p.template mma_ss<T, kVB>(x, mn_major(t.dx), mn_major(P::template col_block<T>(t.st, 0)));
      p.template mma_ss<T, kVB>(da, mn_major(t.dx), mn_major(t.ut));
      p.template wait_mma_left<1>(x);
      add_scaled_half<P>(dk, 0, x, begk, -1.f);
      p.template row_dot<T>(x, P::template col_block<T>(k_t, 0), s.row[kRowKF1]);
      P::zero(x);
      p.template mma_ss<T, kVB>(x, mn_major(t.dx), mn_major(P::template col_block<T>(t.st, 1)));
      p.wait_mma(da, x);
      add_scaled_half<P>(dk, 1, x, begk, -1.f);
      p.template row_dot<T>(x, P::template col_block<T>(k_t, 1), s.row[kRowKF1]);
      // U dSn^T into dk ((w rk) rows) and k.(U dSn^T), a K-half at a time (a loop: unrolled, ptxas spills)
#pragma unroll 1
      for (int kh = 0; kh < 2; ++kh) {
        P::zero(x);
        p.template mma_ss<T, kVB>(x, mn_major(t.ut), mn_major(P::template col_block<T>(t.dsn, kh)));
        p.wait_mma(x);
        add_scaled_half<P>(dk, kh, x, wk, 1.f);
        p.template row_dot<T>(x, P::template col_block<T>(k_t, kh), s.row[kRowKF2]);
      }
      if (vb + 1 < kVBlocks) done(g, vb);
    }
    const float *beta = gt + kGateBeta * kC, *egk = gt + kGateEgk * kC, *begk = gt + kGateBegk * kC,
                *wk = gt + kGateWk * kC;
    // DA = -dX' U^T . E strictly lower, into Bh as diag(beta) DA; then DA . K^K^^T, its row sums, and the
    // column sums of diag(beta) DA . K^K^^T
    P::for_each_pair2(da, bh, [&](int r, int c, float& a0, float& a1, float& b0, float& b1) {
      const float2 e = decay2(s, r, c);
      const float d0 = c < r ? -a0 * e.x : 0.f, d1 = c + 1 < r ? -a1 * e.y : 0.f;
      b0 += beta[r] * d0;
      b1 += beta[r] * d1;
      a0 = d0;
      a1 = d1;
    });
    times_tile<P>(da, bt);                             // . K^K^^T
    P::add_row_sums(da, s.row[kRowA]);
    P::for_each_pair(da, [&](int r, int, float& a0, float& a1) {
      a0 *= beta[r];
      a1 *= beta[r];
    });
    p.add_col_sums(da, s.col, &s.part[0][0]);          // (ends with the warpgroup's barrier)
    p.for_rows([&](int r) {
      s.x[0][r] = beta[r] * s.row[kRowA][r] - s.col[r] - begk[r] * s.row[kRowKF1][r];
      s.x[1][r] = wk[r] * s.row[kRowKF2][r];
    });
    p.sync_generic();
    p.for_rows([&](int r) {
      const float d = p.rev_sum(s.x[0], r) + p.fwd_sum(s.x[1], r);
      const float db = s.row[kRowA][r] - egk[r] * s.row[kRowKF1][r];
      if (r < length) share(g, r, d, db);
    });
    done(g, kVBlocks - 1);                           // (its barrier: every read of the sums done)
  }
  // B = Bh + Bh^T (Bh's transpose through bt, every read of K^K^^T done: the last head's barriers), then
  // (B rk rk) K
  P::for_each(bh, [&](int r, int c, float& x) { bt[r * kPLd + c] = x; });
  p.sync_generic();
  P::for_each(bh, [&](int r, int c, float& x) { x += bt[c * kPLd + r]; });
  typename P::template Op<T, kC> bhi, blo, phi, plo;
  issue_hi_lo<P, T>(p, dk, bh, rk, rk, k_t, bhi, blo);
  // (P^T rk rq) Q, formed while (B rk rk) K runs
  p_wait();
  typename P::template Frag<kC> pt_f;
  P::for_each(pt_f, [&](int r, int c, float& x) { x = pt[c * kPLd + r]; });
  issue_hi_lo<P, T>(p, dk, pt_f, rk, rq, q_t, phi, plo);
  p.wait_mma(dk, bhi, blo, phi, plo);
}

}  // namespace sm90
}  // namespace gdn
