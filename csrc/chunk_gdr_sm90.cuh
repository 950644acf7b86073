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
// g = -inf (a hard reset) and g ~ -1e30 give exact zeros. Prep takes g in base 2 (g log2 e, formed where
// the gates are loaded) and exponentiates its sums with exp2_f: e^x = 2^(x log2 e), one multiply a row
// there instead of one an element of E here.
//
// A policy P supplies the tiles (the rest is shared):
//   P::Frag<N>            a 64 x N fp32 tile: on the device the thread's share in the wgmma accumulator
//                         layout, on the host all of it; P::for_each(f, (row, col, value&)) visits it,
//                         P::for_each_pair(f, (row, col, v0&, v1&)) its pairs (row, col), (row, col + 1)
//                         with col even, P::for_each_pair2 / for_each2_pair two tiles' pairs, and
//                         for_each_lo_pair / hi_pair / hi2_pair those of a 64 x 128 tile's column halves
//                         (a pair's two gate columns are one 8-byte load: col2)
//   P::Op<T, KD>          a 64 x KD A operand in registers (the fp32 tile rounded to T, times a sign)
//   P::mma(acc, a, b)     acc += a B, B a [KD, N] tile in shared memory (P::Smem: K-major or MN-major);
//                         issued only: P::wait_mma(tiles...) waits for every product issued, and the
//                         tiles it names (accumulators and A operands) are not touched before it
//   P::mma2(acc1, a1, b1, acc2, a2, b2)   two such products as one group
//   P::mma_lo(acc, a, b), P::mma_hi(...)   acc's columns 0..63 / 64..127 += a B (N = 64), one group
//   P::mma_lo_hi(acc, a, b_lo, b_hi)       both, as two groups; P::wait_mma_lo(acc) waits for all but
//                         the newest group, and acc's lo columns are not touched before it
//   P::mma_grams(kk, qk, q, k)   K K^T and Q K^T from the shared q, k tiles (prep), one group
//   P::mma_block<U, N, COL0, K0, KS>(acc, a, b)   acc's columns COL0 .. COL0 + N - 1 += a's columns
//                         16 K0 .. 16 (K0 + KS) - 1 times B's rows COL0 .. there (B [n, k] K-major: n = COL0 ..,
//                         k = 16 K0 ..), one group (N = 16, 32: a block of a product known 0 elsewhere)
//   (the host policy runs a group only when a wait retires it: a read before its wait reads the old value)
//   P::row_sumsq_half(tile, i, h)    the sum of squares of row i over K-half h of a [64, K] tile
//   P::store(frag, tile, transpose)   a fragment to a shared tile of the operand type
//   P::store_diag_block<U, R0, NB>(frag, tile, transpose)   its block [R0, R0 + NB)^2 only (the rest as it was)
//   P::vt(tile)           V^T [64 v, 64 c] of the state block's 64 columns of v, as fp32
//   P::for_rows(f)        f(i) for i in 0..63, chunk rows or columns (device: threads 0..63 of prep)
//   P::for_threads(f)     f(t) for t in 0..127 (device: every thread of the warpgroup)
//   P::sync()             shared-memory writes visible to the warpgroup's generic and async (wgmma) reads
//   P::sync_generic()     shared-memory writes visible to the warpgroup's generic reads only
//   P::Sub                the four 16 x 16 diagonal blocks of a 64 x 64 tile, fp32 (device: warp w holds
//                         block w in registers, the mma.sync m16n8k16 C layout of its two n-blocks, which is
//                         also its A layout; host: all four); P::diag_sub(f, sign) takes them from a
//                         fragment, P::diag_frag(x, f) sets f to them (0 off the blocks), P::for_each_sub(x,
//                         (row, col, value&)) visits them (row, col within the block)
//   P::SubA<U>, P::SubB<U>  a block rounded to U as the A (B) operand of a 16 x 16 x 16 product (sub_a, sub_b;
//                         sub_b takes lower-triangular blocks only), P::sub_mma(acc, a, b): acc += a b, done on
//                         return (mma.sync)
// The inverse: the four 16 x 16 diagonal blocks of I + A, each by its warp in registers as the product
// (I + N)(I + N^2)(I + N^4)(I + N^8), N = -A_bb (nilpotent), then two doubling levels
// D_2b = D_b - (D_b A_b) D_b (b = 16, 32) on the tensor cores, only their nonzero blocks multiplied.
// Values rounded (bf16 / fp16 inputs; an fp32 host mirror rounds nothing): the A operands S^T, X'^T, U^T
// and (w rk) U^T of the state warpgroup (to the input dtype); Ts and M (stored in the input dtype); the
// operands of the diagonal blocks' products and of the doubling, D_b, X_b and A (to the operand type of
// the inverse, TInv); q, k, v enter exactly. Gate sums, exponentials, row norms, accumulators and the
// state are fp32.
//
// The backward's reverse dS pass (csrc/chunk_gdr_bwd_sm90.cu; the formulas and numerics of
// gdn_packed/triton/chunk_bwd.py's dS pass, which it replaces), per chunk walked from the last, with
// dS^T [64 v, K] the gradient of the state leaving the chunk (dSn^T) and prep's gate rows (GateRow):
//   dU^T  = (dS^T K^T) (w rk) + dO^T M                        dX'^T = dU^T + dU^T Ts      dv = beta dX'
//   dS^T <- e^gam_last dS^T + (dO^T (scale e^gam rq)) Q - (dX'^T (beta e^gam rk)) K
// rounded where the Triton pass rounds: dS^T, dU^T and (beta e^gam rk) dX'^T as A operands (input
// dtype); the gated dO^T as two operands, its rounded value and its rounding error.
#pragma once

#include <cmath>
#include <cstddef>

#include "dtypes.cuh"
#include "segments.cuh"

namespace gdn {
namespace sm90 {

constexpr int kC = 64;         // chunk rows
constexpr int kK = 128;        // key dim (the kernel's only K)
constexpr int kV = 128;        // value dim (the kernel's only V)
constexpr int kVB = 64;        // state rows (value columns) of a CTA: its V-block
constexpr int kVBlocks = kV / kVB;
constexpr int kSub = 16;       // the diagonal blocks of I + A inverted in registers (diag_inverse)
constexpr int kStrip = 8;      // rows of a strip of the gate sums (8 strips a chunk)
constexpr int kStrips = kC / kStrip;

// Per chunk, what prep leaves in shared memory for the state warpgroup (besides Ts and M).
struct alignas(16) Gates {   // (16: col2 reads a row's pairs as one 8-byte load)
  float beta[kC];        // beta (0 on dead rows)
  float egk[kC];         // e^gam rk
  float cq[kC];          // scale e^gam rq
  float wk[kC];          // w rk
  float eg_last;         // e^(sum of g over the chunk)
};

// Prep's scratch. The sums of g (0 on dead rows) over row ranges are built from strips of 8 rows (every
// one a sum of g, never a difference of two sums):
//   insuf[c]     over (c, end of c's strip]            sigma[j]  over strip j
//   dsum[r][p]   over (8 (r / 8) + p, r], p <= r % 8   strip[r][j] over (8 j + 7, r], j < r / 8
// (0 elsewhere), so the sum over (c, r] for c <= r is dsum[r][c % 8] in r's strip, else
// insuf[c] + strip[r][c / 8].
struct PrepScratch {
  alignas(16) float rq[kC];
  alignas(16) float rk[kC];
  float qn[2][kC];       // |q_i|^2 over the two halves of K
  float kn[kC];          // |k_i|^2: the diagonal of K K^T
  float eg[kC];          // e^gam_i
  float ew[kC];          // e^(sum of g over (i, 63])
  alignas(16) float insuf[kC];
  alignas(16) float sigma[kStrips];
  alignas(16) float dsum[kC][kStrip];
  alignas(16) float strip[kC][kStrips + 4];   // 4 floats of padding a row: the 8 rows of a store8 phase
                                           // and of A / M's loads sit in distinct banks (48-byte rows)
};

constexpr float kLog2e = 1.4426950408889634f;

// 2^x: the hardware's ex2 (2 ulp, results below 2^-126 flushed to 0) on the device, libm on the host
// (where the fp32 mirror is judged against float64)
GDN_HD float exp2_f(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return exp2f(x);
#endif
}

// 1 / sqrt(x): the hardware's rsqrt (2 ulp) on the device, libm on the host
GDN_HD float rsqrt_f(float x) {
#if defined(__CUDA_ARCH__)
  return rsqrtf(x);
#else
  return 1.f / sqrtf(x);
#endif
}

// 8 floats from a 16-byte aligned address
GDN_HD void load8(float* dst, const float* src) {
  *reinterpret_cast<float4*>(dst) = *reinterpret_cast<const float4*>(src);
  *reinterpret_cast<float4*>(dst + 4) = *reinterpret_cast<const float4*>(src + 4);
}
GDN_HD void store8(float* dst, const float* src) {
  *reinterpret_cast<float4*>(dst) = *reinterpret_cast<const float4*>(src);
  *reinterpret_cast<float4*>(dst + 4) = *reinterpret_cast<const float4*>(src + 4);
}

// float pairs at an 8-byte aligned address
GDN_HD float2 load2(const float* src) { return *reinterpret_cast<const float2*>(src); }
GDN_HD void store2(float* dst, float x, float y) { *reinterpret_cast<float2*>(dst) = float2{x, y}; }
// x, y rounded to T as one store (dst aligned to the pair: 2 sizeof(T) bytes)
template <typename T>
GDN_HD void store2(T* dst, float x, float y) {
  const float v[2] = {x, y};
  store_vec<T, 2>(dst, v);
}

// insuf[c], and sigma of c's strip when c starts it (g: the chunk's 64 rows in base 2, 16-byte aligned).
// S: a scratch with PrepScratch's decay tables (insuf, sigma, dsum, strip): prep's, or the chunk-parallel
// backward's (chunk_gdr_grads_sm90.cuh)
template <class S>
GDN_HD void strip_sums(S& s, const float* g, int c) {
  const int base = c - c % kStrip;
  float gs[kStrip];
  load8(gs, g + base);
  float sum = 0.f;
#pragma unroll
  for (int t = kStrip - 1; t > 0; --t) sum = t > c % kStrip ? sum + gs[t] : sum;
  s.insuf[c] = sum;
  if (c == base) s.sigma[c / kStrip] = gs[0] + sum;
}

// Row r's decay tables dsum[r], strip[r] (once sigma is there; S as strip_sums'), and its sums of g: returns
// gam_r, the sum over [0, r]; *suf: the sum over (r, 63] (from insuf[r]), *tot: the chunk's. Everything
// it reads is loaded first.
template <class S>
GDN_HD float decay_rows(S& s, const float* g, int r, float* suf, float* tot) {
  const int jr = r / kStrip, pr = r % kStrip;
  float gs[kStrip], sig[kStrips], d[kStrip], st[kStrips];
  load8(gs, g + jr * kStrip);
  load8(sig, s.sigma);
  float seg = 0.f;                          // sum of g over (8 jr + p, r], then over [8 j, r]
#pragma unroll
  for (int p = kStrip - 1; p >= 0; --p) {
    d[p] = p <= pr ? seg : 0.f;
    seg = p <= pr ? seg + gs[p] : seg;
  }
  float sf = s.insuf[r], tt = 0.f;
#pragma unroll
  for (int j = kStrips - 1; j >= 0; --j) {
    st[j] = j < jr ? seg : 0.f;
    seg = j < jr ? seg + sig[j] : seg;
    sf = j > jr ? sf + sig[j] : sf;
    tt += sig[j];
  }
  store8(s.dsum[r], d);
  store8(s.strip[r], st);
  *suf = sf;
  *tot = tt;
  return seg;
}

// E at (r, c) and (r, c + 1), c even: exp of the sum of g over (c, r] from the decay tables (every entry read
// is defined: the caller keeps c <= r)
template <class S>
GDN_HD float2 decay2(const S& s, int r, int c) {
  const float2 ins = load2(&s.insuf[c]), within = load2(&s.dsum[r][c % kStrip]);
  const float strip = s.strip[r][c / kStrip];
  const bool same = c / kStrip == r / kStrip;
  return float2{exp2_f(same ? within.x : ins.x + strip), exp2_f(same ? within.y : ins.y + strip)};
}

// Row r's sums of g (no Gram product needed: run while those are on the tensor cores): its dsum and
// strip rows, e^gam_r and e^(sum of g over (r, 63]), its beta, and with r = 0 the chunk's decay.
// Everything it reads is loaded first.
GDN_HD void gate_sums(PrepScratch& s, const float* g, const float* beta, int r, int length, Gates& out) {
  const float b = beta[r];
  float suf, tot;                           // suf: sum of g over (r, 63]
  const float seg = decay_rows(s, g, r, &suf, &tot);
  s.eg[r] = exp2_f(seg);                     // seg: gam_r, the sum over [0, r]
  s.ew[r] = exp2_f(suf);
  out.beta[r] = r < length ? b : 0.f;
  if (r == 0) out.eg_last = exp2_f(tot);
}

// Row r's factors once the diagonal of K K^T is in kn: rk, rq (l2norm) and its gate row.
GDN_HD void gate_factors(PrepScratch& s, int r, int length, float scale, bool l2norm, Gates& out) {
  const float rk = l2norm ? rsqrt_f(s.kn[r] + 1e-6f) : 1.f;
  const float rq = l2norm ? rsqrt_f(s.qn[0][r] + s.qn[1][r] + 1e-6f) : 1.f;
  s.rk[r] = rk;
  s.rq[r] = rq;
  const bool live = r < length;
  const float eg = s.eg[r];
  out.egk[r] = live ? eg * rk : 0.f;
  out.cq[r] = live ? scale * eg * rq : 0.f;
  out.wk[r] = live ? s.ew[r] * rk : 0.f;
}

// gate columns c, c + 1 (c even) of a row of 64 (8-byte aligned): one load where a thread's accumulator
// columns come in pairs, half the shared-memory wavefronts of two scalar loads
GDN_HD float2 col2(const float* row, int c) { return load2(row + c); }
GDN_HD void scale2(float& x0, float& x1, float2 s) {
  x0 *= s.x;
  x1 *= s.y;
}

// A and M at (r, c) and (r, c + 1), c even, in place (kk, qk: the Gram products there): with
// E_rc = exp(sum of g over (c, r]) for c <= r on live rows, else 0 (every table entry read is defined, so
// nothing is conditional but the choice), A = beta_r rk_r E_rc rk_c (k.k), strictly lower, and
// M = scale rq_r E_rc rk_c (q.k).
GDN_HD void a_and_m_pair(PrepScratch& s, const float* beta, int r, int c, int length, float scale, float& a0,
                         float& a1, float& m0, float& m1) {
  const float2 e = decay2(s, r, c), rkc = load2(&s.rk[c]);
  const bool live = r < length;
  const float e0 = e.x * rkc.x, e1 = e.y * rkc.y;
  const float fa = beta[r] * s.rk[r], fm = scale * s.rq[r];
  a0 = live && c < r ? fa * e0 * a0 : 0.f;
  a1 = live && c + 1 < r ? fa * e1 * a1 : 0.f;
  m0 = live && c <= r ? fm * e0 * m0 : 0.f;
  m1 = live && c + 1 <= r ? fm * e1 * m1 : 0.f;
}

// D_16, the inverses (I + A_bb)^-1 of the diagonal blocks of A (strictly lower), each in registers by its
// warp: with N = -A_bb (N^16 = 0), (I + A_bb)^-1 = I + N + ... + N^15 = (I + N)(I + N^2)(I + N^4)(I + N^8),
// 6 products in 4 dependent levels (N^2; N^4 and x = (I + N)(I + N^2); N^8 and x (I + N^4); x (I + N^8)).
// Every block is lower triangular, as sub_b needs.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <class P, typename TInv>
GDN_HD typename P::Sub diag_inverse(P& p, const typename P::template Frag<kC>& a) {
  typename P::Sub n = p.diag_sub(a, -1.f), x = n, n2{}, n4{}, n8{};
  P::for_each_sub(x, [](int r, int c, float& v) { if (r == c) v += 1.f; });       // I + N
  p.sub_mma(n2, p.template sub_a<TInv>(n), p.template sub_b<TInv>(n));
  const auto n2_b = p.template sub_b<TInv>(n2);
  p.sub_mma(n4, p.template sub_a<TInv>(n2), n2_b);
  p.sub_mma(x, p.template sub_a<TInv>(x), n2_b);
  const auto n4_b = p.template sub_b<TInv>(n4);
  p.sub_mma(n8, p.template sub_a<TInv>(n4), n4_b);
  p.sub_mma(x, p.template sub_a<TInv>(x), n4_b);
  p.sub_mma(x, p.template sub_a<TInv>(x), p.template sub_b<TInv>(n8));
  return x;
}

// One doubling level D_2b = D_b - X D_b, X = lower_left_b(D_b A) (the lower-left b x b block of each
// 2b x 2b diagonal block; D_b is block-diagonal at b, so X's block of 2b-block m is D_b's rows and
// columns [2bm + b, 2bm + 2b) times A's rows there and columns [2bm, 2bm + b), and X D_b's block is X's
// columns [2bm, 2bm + b) times D_b's block there): only those blocks are multiplied, each a 64 x b
// product over b of K (mma_block; the other rows of each come out exactly 0, as D_b's and X's rows there
// are). at_b: A^T, dt: D_b^T (store, B operand).
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <int B, class P, typename TInv>
GDN_HD void doubling_level(P& p, typename P::template Frag<kC>& d, const typename P::Smem& at_b,
                           const typename P::Smem& dt_store, const typename P::Smem& dt_b) {
  static_assert(B == 16 || B == 32, "the two levels: 16 -> 32, 32 -> 64");
  // D_b^T, the B operand [k, n] = D_b[k][n]: only the blocks the update reads (its diagonal b-blocks of the
  // 2b-blocks' upper halves; the rest of dt is never read)
  p.template store_diag_block<TInv, 0, B>(d, dt_store, true);
  if constexpr (B == 16) p.template store_diag_block<TInv, 2 * B, B>(d, dt_store, true);
  p.sync();
  typename P::template Frag<kC> x;
  P::zero(x);
  auto d_op = p.template op<TInv, kC>(d, 1.f);
  p.template mma_block<TInv, B, 0, B / 16, B / 16>(x, d_op, at_b);                  // 2b-block 0
  if constexpr (B == 16) p.template mma_block<TInv, B, 2 * B, 3 * B / 16, B / 16>(x, d_op, at_b);   // and 1
  p.wait_mma(x, d_op);
  auto x_op = p.template op<TInv, kC>(x, -1.f);
  p.template mma_block<TInv, B, 0, 0, B / 16>(d, x_op, dt_b);
  if constexpr (B == 16) p.template mma_block<TInv, B, 2 * B, 2 * B / 16, B / 16>(d, x_op, dt_b);
  p.wait_mma(d, x_op);
}

// ---- prep: one chunk, one value head (the prep warpgroup) ------------------------------------------
// In: the q, k tiles of the qk head (rows past `length` already 0), g and beta of the chunk's 64 rows (0
// on dead rows; 16-byte aligned). Out: gates, and the Ts and M tiles (input dtype). at / dt: the
// inverse's scratch tiles (A^T, D_b^T), each as a store destination and as a B operand.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable   // instantiated with the host policy (mirror) and the device one (kernel)
#endif
template <class P, typename T, typename TInv>
GDN_HD void prep_chunk(P& p, const typename P::Smem& q_t, const typename P::Smem& k_kmaj, PrepScratch& s,
                       const float* g, const float* beta, int length, float scale, bool l2norm, Gates& gates,
                       const typename P::Smem& at_store, const typename P::Smem& at_b,
                       const typename P::Smem& dt_store, const typename P::Smem& dt_b,
                       const typename P::Smem& ts_store, const typename P::Smem& m_store) {
  // the Gram matrices (fp32 accumulators of the exact q, k) run on the tensor cores during the sums of g
  // and |q|^2
  typename P::template Frag<kC> kk, qk;
  P::zero(kk);
  P::zero(qk);
  p.template mma_grams<T>(kk, qk, q_t, k_kmaj);
  p.for_rows([&](int c) { strip_sums(s, g, c); });
  p.for_threads([&](int t) {                // |q_i|^2 over the halves of K
    s.qn[t / kC][t % kC] = l2norm ? p.template row_sumsq_half<T>(q_t, t % kC, t / kC) : 0.f;
  });
  p.sync_generic();
  p.for_rows([&](int r) { gate_sums(s, g, beta, r, length, gates); });
  p.wait_mma(kk, qk);
  P::for_each(kk, [&](int r, int c, float& x) { if (r == c) s.kn[r] = x; });
  p.sync_generic();
  p.for_rows([&](int r) { gate_factors(s, r, length, scale, l2norm, gates); });
  p.sync_generic();
  // A = beta E (k^ k^^T), strictly lower (A^T for the doubling, its diagonal blocks for the
  // substitution); M = scale E (q^ k^^T), lower incl. diagonal, in the input dtype
  P::for_each_pair2(kk, qk, [&](int r, int c, float& a0, float& a1, float& m0, float& m1) {
    a_and_m_pair(s, beta, r, c, length, scale, a0, a1, m0, m1);
  });
  p.template store<TInv>(kk, at_store, true);        // A^T: the B operand [k, n] = A[k][n], K-major
  p.template store<T>(qk, m_store, false);           // (A^T's fence for the doubling: the sync before it)
  // D_16, the block diagonal of the 16 x 16 inverses; then D_2b = D_b - (D_b A_b) D_b (b = 16, 32),
  // where (D_b A_b) = lower_left_b(D_b A) as D_b is block-diagonal
  typename P::template Frag<kC> d;
  p.diag_frag(diag_inverse<P, TInv>(p, kk), d);
  doubling_level<16, P, TInv>(p, d, at_b, dt_store, dt_b);
  p.sync();                                          // every wgmma read of dt_b done before its rewrite
  doubling_level<32, P, TInv>(p, d, at_b, dt_store, dt_b);
  P::for_each(d, [&](int r, int c, float& v) { if (r == c) v = 0.f; });
  p.template store<T>(d, ts_store, false);           // Ts = T - I, [c][c'] (K-major B of X'^T Ts^T)
}

// ---- the state step: one chunk, the state warpgroup (the CTA's 64 value columns) -------------------
// U^T = X'^T + X'^T Ts^T in acc's columns 0..63, X'^T = beta (V^T - egk S^T K^T), once the group of S^T K^T
// (acc's lo columns, from s_op) has run; on return every group has (S^T Q^T too).
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <class P, typename T>
GDN_HD void u_of_chunk(P& p, typename P::template Frag<2 * kC>& acc, typename P::template Op<T, kK>& s_op,
                       const Gates& gt, const typename P::Smem& ts_b, const typename P::Smem& v_tile) {
  p.wait_mma_lo(acc);
  auto vt = p.vt(v_tile);                            // V^T [64 v, 64 c] fp32
  P::for_each_lo_pair(acc, vt, [&](int, int c, float& x0, float& x1, float v0, float v1) {
    const float2 b = col2(gt.beta, c), e = col2(gt.egk, c);
    x0 = b.x * (v0 - e.x * x0);
    x1 = b.y * (v1 - e.y * x1);
  });
  auto x_op = p.template op_lo<T>(acc, 1.f);
  p.mma_lo(acc, x_op, ts_b);
  p.wait_mma(acc, s_op, x_op);
}

// S: S^T [64 v, K] fp32 (accumulator layout). k_b, q_b: K and Q rows as K-major B operands of N = 64;
// k_mn: K as the MN-major B operand [c, K]; ts_b, m_b: Ts and M [c][c'] as K-major B operands; vt: the
// v tile for P::vt. o_out(frag): the caller stores O^T [64 v, 64 c] (cols 64..127 of the frag), live
// rows only.
// The recurrence's chain is S^T K^T -> X'^T -> X'^T Ts^T -> U^T -> the update U K; S^T Q^T and U^T M^T
// only feed O. S^T Q^T is its own group, issued after S^T K^T and waited for with X'^T Ts^T, so the
// tensor pipe runs it while the warps form X'^T.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <class P, typename T, class OutFn>
GDN_HD void state_step(P& p, typename P::template Frag<kK>& S, const Gates& gt,
                       const typename P::Smem& k_b, const typename P::Smem& q_b, const typename P::Smem& k_mn,
                       const typename P::Smem& ts_b, const typename P::Smem& m_b,
                       const typename P::Smem& v_tile, OutFn&& o_out) {
  typename P::template Frag<2 * kC> acc;             // [S^T K^T | S^T Q^T]
  P::zero(acc);
  auto s_op = p.template op<T, kK>(S, 1.f);
  p.mma_lo_hi(acc, s_op, k_b, q_b);                 // S^T K^T, then S^T Q^T (for O: in flight until
  u_of_chunk<P, T>(p, acc, s_op, gt, ts_b, v_tile);  // X'^T Ts^T's wait)
  // O^T = cq (S^T Q^T) + U^T M^T in columns 64..127
  P::for_each_hi_pair(acc, [&](int, int c, float& x0, float& x1) { scale2(x0, x1, col2(gt.cq, c)); });
  {
    auto u_op = p.template op_lo<T>(acc, 1.f);
    p.mma_hi(acc, u_op, m_b);
    // S^T <- e^gam_last S^T + ((w rk) U^T) K, issued before the wait of the output product
    P::for_each_lo_pair(acc, [&](int, int c, float& x0, float& x1) { scale2(x0, x1, col2(gt.wk, c)); });
    auto w_op = p.template op_lo<T>(acc, 1.f);
    P::for_each(S, [&](int, int, float& x) { x *= gt.eg_last; });
    p.mma(S, w_op, k_mn);
    p.wait_mma(acc, S, u_op, w_op);                  // both products (their A operands live until here)
  }
  o_out(acc);
}

// The state step with O's last product and store deferred into the next step (the state-only kernel:
// U^T M^T and the O store leave the chain). On entry the previous step's S update may be in flight (w, its A
// operand, the caller's so that it lives until then); o = cq (S^T Q^T) of the previous chunk and u, its
// U^T operand, are the caller's registers, m_prev its M tile: o += U^T M^T is issued first and, with prev,
// prev_out(o) stores O^T [64 v, 64 c] once it has run, while this step's first products run. Without prev
// (a sequence's first chunk) the caller passes u = 0 and any tile that nothing writes: the product is
// issued on every path, because ptxas serializes every wgmma of the loop when one is issued under a
// branch (C7514), and o is assigned below, not accumulated. On return this step's S update is in flight
// (P::wait_mma(S, w) before the caller reads S), and o, u and m_b are this chunk's for the next step (or
// state_step_last). The arithmetic is state_step's.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <class P, typename T, class PrevOut>
GDN_HD void state_step_deferred(P& p, typename P::template Frag<kK>& S, typename P::template Frag<kC>& o,
                                typename P::template Op<T, kC>& u, typename P::template Op<T, kC>& w, bool prev,
                                const typename P::Smem& m_prev, const Gates& gt, const typename P::Smem& k_b,
                                const typename P::Smem& q_b, const typename P::Smem& k_mn,
                                const typename P::Smem& ts_b, const typename P::Smem& v_tile, PrevOut&& prev_out) {
  p.wait_mma(S, w);                                  // S's update done
  p.mma(o, u, m_prev);                               // the previous chunk's O^T = cq (S^T Q^T) + U^T M^T
  typename P::template Frag<2 * kC> acc;             // [S^T K^T | S^T Q^T]
  P::zero(acc);
  auto s_op = p.template op<T, kK>(S, 1.f);
  p.mma_lo_hi(acc, s_op, k_b, q_b);                 // S^T K^T, then S^T Q^T
  p.template wait_mma_left<2>(o, u);                 // the previous O (the two just issued may run)
  if (prev) prev_out(o);
  u_of_chunk<P, T>(p, acc, s_op, gt, ts_b, v_tile);
  P::for_each_hi2_pair(acc, o, [&](int, int c, float x0, float x1, float& y0, float& y1) {
    const float2 s = col2(gt.cq, c);
    y0 = x0 * s.x;
    y1 = x1 * s.y;
  });
  u = p.template op_lo<T>(acc, 1.f);
  P::for_each_lo_pair(acc, [&](int, int c, float& x0, float& x1) { scale2(x0, x1, col2(gt.wk, c)); });
  w = p.template op_lo<T>(acc, 1.f);
  P::for_each(S, [&](int, int, float& x) { x *= gt.eg_last; });
  p.mma(S, w, k_mn);                                 // S^T <- e^gam_last S^T + ((w rk) U^T) K
}

// After a sequence's last state_step_deferred: its S update and O^T (o += U^T M^T, M the last chunk's m_b)
// done, S and o final.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <class P, typename T>
GDN_HD void state_step_last(P& p, typename P::template Frag<kK>& S, typename P::template Frag<kC>& o,
                            typename P::template Op<T, kC>& u, typename P::template Op<T, kC>& w,
                            const typename P::Smem& m_b) {
  p.mma(o, u, m_b);
  p.wait_mma(S, w, o, u);
}

// ---- the backward's dS step: one chunk, the dS warpgroup (the CTA's 64 value columns) ---------------
// The rows of prep's gates [NC, HV, kGateRows, C] fp32 (gdn_packed/triton/common.py GATE_*, which
// tests/test_cuda_chunk_bwd.py holds these to).
enum GateRow : int { kGateBeta = 0, kGateEgk = 1, kGateEgq = 2, kGateWk = 3, kGateBegk = 4, kGateRows = 5 };

// The forward's prep as the backward keeps it (gdn_packed.triton.chunk.Prep, Triton prep's values): row r of
// a chunk slot's gate rows (`gates` [kGateRows, C]) and row factors (`rn` [2, C]: rq, rk, 0 on dead rows),
// and with r = 0 its e^gam_last, from prep's gates and scratch.
GDN_HD void keep_gate_row(const Gates& g, const PrepScratch& s, int r, int length, float* gates, float* rn,
                          float* eg_last) {
  const bool live = r < length;
  gates[kGateBeta * kC + r] = g.beta[r];
  gates[kGateEgk * kC + r] = g.egk[r];
  gates[kGateEgq * kC + r] = g.cq[r];
  gates[kGateWk * kC + r] = g.wk[r];
  gates[kGateBegk * kC + r] = g.beta[r] * g.egk[r];
  rn[r] = live ? s.rq[r] : 0.f;
  rn[kC + r] = live ? s.rk[r] : 0.f;
  if (r == 0) *eg_last = g.eg_last;
}

// Gates from Triton prep's outputs of a chunk slot (the state-only kernel: rows, its gate rows [kGateRows, C];
// eg_last, its e^gam_last): rows kGateBeta .. kGateWk are Gates' first four arrays in the same order, which
// the device's producer bulk-copies as they are (kPrepGateBytes).
constexpr int kPrepGateBytes = 4 * kC * 4;
static_assert(kGateBeta == 0 && kGateEgk == 1 && kGateEgq == 2 && kGateWk == 3 &&
              offsetof(Gates, egk) == kC * 4 && offsetof(Gates, cq) == 2 * kC * 4 &&
              offsetof(Gates, wk) == 3 * kC * 4 && offsetof(Gates, eg_last) == kPrepGateBytes,
              "Gates starts with prep's gate rows beta, egk, egq, wk");
GDN_HD void load_gates(Gates& g, const float* rows, float eg_last) {
  for (int i = 0; i < kC; ++i) {
    g.beta[i] = rows[kGateBeta * kC + i];
    g.egk[i] = rows[kGateEgk * kC + i];
    g.cq[i] = rows[kGateEgq * kC + i];
    g.wk[i] = rows[kGateWk * kC + i];
  }
  g.eg_last = eg_last;
}

// The segments of the forward's Triton state pass (gdn_packed.triton.common.segment_chunks), whose entering
// states the backward's recompute starts from: a sequence's nchunks chunk slots in S consecutive segments of
// segment_slots(nchunks, S) slots, segment s from chunk min(s segment_slots, nchunks) (the last ones shorter
// or empty).
GDN_HD int segment_slots(int nchunks, int S) { return (nchunks + S - 1) / S; }

// S^T of V-block vb (fp32, the accumulator layout) as state `slot` of a [slots, K, V] fp32 tensor: the final
// state (ht) and the states entering the segments (kept_entering).
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <class P>
GDN_HD void store_state(typename P::template Frag<kK>& S, float* dst, int64_t slot, int vb) {
  P::for_each(S, [&](int r, int c, float& x) { dst[(slot * kK + c) * kV + vb * kVB + r] = x; });
}

// dS: dS^T [64 v, K] fp32 (accumulator layout), in: the gradient of the state leaving the chunk, out: that
// of the state entering it. gates: the chunk's kGateRows x 64 gate rows; eg_last: e^gam_last. k_b: K as the
// K-major B [c, K] (N = 64: dS^T K^T); k_mn, q_mn: K, Q as MN-major B operands [c, K] (N = K: the dS
// update); ts_mn, m_mn: Ts, M [c'][c] as MN-major B operands (dU^T Ts, dO^T M); do_tile: the dO tile for
// P::vt (dO^T [64 v, 64 c]). dsn_out(dS): the caller stores dSn^T (dS^T as it enters, in the input dtype);
// dx_out(dx, beta): dX'^T [64 v, 64 c] and dv = beta dX' (input dtype, live rows only); shadow(): run
// while the dS update is on the tensor cores (issued, not waited for).
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <class P, typename T, class DsnFn, class DxFn, class ShadowFn>
GDN_HD void dstate_step(P& p, typename P::template Frag<kK>& dS, const float* gates, float eg_last,
                        const typename P::Smem& k_b, const typename P::Smem& k_mn, const typename P::Smem& q_mn,
                        const typename P::Smem& ts_mn, const typename P::Smem& m_mn,
                        const typename P::Smem& do_tile, DsnFn&& dsn_out, DxFn&& dx_out, ShadowFn&& shadow) {
  const float *beta = gates + kGateBeta * kC, *egq = gates + kGateEgq * kC, *wk = gates + kGateWk * kC,
              *begk = gates + kGateBegk * kC;
  dsn_out(dS);
  typename P::template Frag<kC> du, dm;              // dS^T K^T, dO^T M
  P::zero(du);
  P::zero(dm);
  auto ds_op = p.template op<T, kK>(dS, 1.f);
  auto do_op = p.template op<T, kC>(p.vt(do_tile), 1.f);   // dO^T [64 v, 64 c] (exact: dO in the input dtype)
  p.mma2(dm, do_op, m_mn, du, ds_op, k_b);
  p.wait_mma(du, dm, ds_op, do_op);
  P::for_each(dS, [&](int, int, float& x) { x *= eg_last; });   // (its registers free once packed in ds_op)
  P::for_each2_pair(du, dm, [&](int, int c, float& x0, float& x1, float y0, float y1) {     // dU^T
    const float2 w = col2(wk, c);
    x0 = x0 * w.x + y0;
    x1 = x1 * w.y + y1;
  });
  // dX'^T = dU^T + dU^T Ts, in place; behind it on the tensor cores the dS update's products that do not
  // wait for it: dS^T <- egL dS^T + (dO^T egq) Q, the gated dO^T as its rounded value and its rounding error
  // (two operands of one K-dimension each), formed while dU^T Ts runs
  auto du_op = p.template op<T, kC>(du, 1.f);
  p.mma(du, du_op, ts_mn);
  auto gdo = p.vt(do_tile);                          // (read again: not held across the first products)
  P::for_each_pair(gdo, [&](int, int c, float& x0, float& x1) { scale2(x0, x1, col2(egq, c)); });
  auto hi = p.template op<T, kC>(gdo, 1.f);
  P::sub_op(gdo, hi);
  auto lo = p.template op<T, kC>(gdo, 1.f);
  p.mma(dS, hi, q_mn);
  p.mma(dS, lo, q_mn);
  p.template wait_mma_left<2>(du, du_op);
  dx_out(du, beta);
  // and - (dX'^T begk) K
  P::for_each_pair(du, [&](int, int c, float& x0, float& x1) { scale2(x0, x1, col2(begk, c)); });
  auto dx_op = p.template op<T, kC>(du, -1.f);
  p.mma(dS, dx_op, k_mn);
  shadow();
  p.wait_mma(dS, hi, lo, dx_op);
}

}  // namespace sm90
}  // namespace gdn
