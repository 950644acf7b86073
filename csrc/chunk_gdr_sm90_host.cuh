// The host policy of the sm_90a chunked kernels' tile programs (chunk_gdr_sm90.cuh), shared by the host
// mirrors of the forward (chunk_gdr_fwd_sm90.cu) and the backward (chunk_gdr_bwd_sm90.cu): one "thread"
// holds a whole 64 x N tile; shared tiles are row-major arrays without swizzle; the products are plain
// loops in fp32 over operands rounded as the device's (an fp32 mirror rounds nothing).
// The products are asynchronous as wgmma's are: each mma call is one group (mma2 / mma_lo_hi as the
// device's), queued with its A operand's values, and runs (reading its B tile and accumulator then) only
// when a wait retires it: wait_mma every group, wait_mma_lo all but the newest (wgmma.wait_group 1). A
// tile program that reads an accumulator before the wait that covers its product reads the value before
// the product, and the mirror's results are wrong: the wait counts are checked here too.
#pragma once

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "api.h"
#include "chunk_gdr_sm90.cuh"
#include "dtypes.cuh"

namespace gdn {
namespace sm90 {
namespace {

struct HostPolicy {
  template <int N>
  struct Frag {
    float d[kC * N];
  };
  template <typename T, int KD>
  struct Op {
    T d[kC * KD];
  };
  struct Smem {       // element (row, col) at base[row * ld + col]; as a B operand [k, n]: K-major
    void* base;       // reads base[n * ld + k], MN-major base[k * ld + n]
    int ld;
    bool kmajor;
  };

  template <typename U>
  struct RowVal {      // a value per chunk row (the device: the row's thread holds its own)
    U v[kC];
    GDN_HD U& operator[](int r) { return v[r]; }   // (__host__ __device__: the tile programs' lambdas call it)
  };
  template <int N, class F>
  static void for_each(Frag<N>& f, F&& fn) {
    for (int i = 0; i < kC * N; ++i) fn(i / N, i % N, f.d[i]);
  }
  template <int N, class F>
  static void for_each_pair(Frag<N>& f, F&& fn) {
    for (int i = 0; i < kC * N; i += 2) fn(i / N, i % N, f.d[i], f.d[i + 1]);
  }
  template <int N, class F>
  static void for_each_pair2(Frag<N>& f, Frag<N>& g, F&& fn) {
    for (int i = 0; i < kC * N; i += 2) fn(i / N, i % N, f.d[i], f.d[i + 1], g.d[i], g.d[i + 1]);
  }
  template <int N, class F>
  static void for_each2_pair(Frag<N>& f, Frag<N>& g, F&& fn) {
    for (int i = 0; i < kC * N; i += 2) fn(i / N, i % N, f.d[i], f.d[i + 1], g.d[i], g.d[i + 1]);
  }
  template <class F>
  static void for_each_lo_pair(Frag<2 * kC>& f, Frag<kC>& v, F&& fn) {
    for (int r = 0; r < kC; ++r)
      for (int c = 0; c < kC; c += 2)
        fn(r, c, f.d[r * 2 * kC + c], f.d[r * 2 * kC + c + 1], v.d[r * kC + c], v.d[r * kC + c + 1]);
  }
  template <class F>
  static void for_each_lo_pair(Frag<2 * kC>& f, F&& fn) {
    for (int r = 0; r < kC; ++r)
      for (int c = 0; c < kC; c += 2) fn(r, c, f.d[r * 2 * kC + c], f.d[r * 2 * kC + c + 1]);
  }
  template <class F>
  static void for_each_hi_pair(Frag<2 * kC>& f, F&& fn) {
    for (int r = 0; r < kC; ++r)
      for (int c = 0; c < kC; c += 2) fn(r, c, f.d[r * 2 * kC + kC + c], f.d[r * 2 * kC + kC + c + 1]);
  }
  template <class F>
  static void for_each_hi2_pair(Frag<2 * kC>& f, Frag<kC>& g, F&& fn) {
    for (int r = 0; r < kC; ++r)
      for (int c = 0; c < kC; c += 2)
        fn(r, c, f.d[r * 2 * kC + kC + c], f.d[r * 2 * kC + kC + c + 1], g.d[r * kC + c], g.d[r * kC + c + 1]);
  }
  template <int N>
  static void zero(Frag<N>& f) {
    for (float& x : f.d) x = 0.f;
  }
  template <typename T, int KD, int N>
  static void round_into(Op<T, KD>& o, const Frag<N>& f, int col0, float sign) {
    for (int r = 0; r < kC; ++r)
      for (int c = 0; c < KD; ++c) o.d[r * KD + c] = from_f<T>(sign * f.d[r * N + col0 + c]);
  }
  template <typename T, int KD, int N>
  Op<T, KD> op(const Frag<N>& f, float sign) {
    Op<T, KD> o;
    round_into(o, f, 0, sign);
    return o;
  }
  template <typename T>
  Op<T, kC> op_lo(const Frag<2 * kC>& f, float sign) {
    Op<T, kC> o;
    round_into(o, f, 0, sign);
    return o;
  }
  // f -= o's values, o = op<T, KD>(f, 1.f): f's first KD columns keep their rounding error
  template <typename T, int KD, int N>
  static void sub_op(Frag<N>& f, const Op<T, KD>& o) {
    for (int r = 0; r < kC; ++r)
      for (int c = 0; c < KD; ++c) f.d[r * N + c] -= to_f(o.d[r * KD + c]);
  }
  // the products in fp32 from operands widened once (exact: the same sums as widening every term)
  static void gemm_nt(float* acc, int ldc, const std::vector<float>& a, const std::vector<float>& b, int m, int n,
                      int kd) {
    for (int r = 0; r < m; ++r)
      for (int c = 0; c < n; ++c) {
        float s = 0.f;
        for (int k = 0; k < kd; ++k) s += a[r * kd + k] * b[c * kd + k];
        acc[r * ldc + c] += s;
      }
  }
  template <typename T>
  static std::vector<float> widen_b(const Smem& b, int ncols, int kd) {   // B as [n][k]
    const T* bb = static_cast<const T*>(b.base);
    std::vector<float> out(static_cast<size_t>(ncols) * kd);
    for (int n = 0; n < ncols; ++n)
      for (int k = 0; k < kd; ++k) out[n * kd + k] = to_f(b.kmajor ? bb[n * b.ld + k] : bb[k * b.ld + n]);
    return out;
  }
  // the issued groups not yet retired, oldest first: each a list of products
  std::vector<std::vector<std::function<void()>>> groups;
  // acc[:, col0 .. col0 + ncols) += a B, queued into a new group (or, with open false, the newest one)
  template <typename T, int KD, int N>
  void mma_cols(Frag<N>& acc, int col0, int ncols, const Op<T, KD>& a, const Smem& b, bool open = true) {
    std::vector<float> af(kC * KD);            // A's values as issued
    for (int i = 0; i < kC * KD; ++i) af[i] = to_f(a.d[i]);
    if (open || groups.empty()) groups.emplace_back();
    groups.back().push_back([&acc, col0, ncols, b, af = std::move(af)] {
      gemm_nt(acc.d + col0, N, af, widen_b<T>(b, ncols, KD), kC, ncols, KD);
    });
  }
  template <typename T, int KD, int N>
  void mma(Frag<N>& acc, const Op<T, KD>& a, const Smem& b) { mma_cols(acc, 0, N, a, b); }
  // acc[:, COL0 .. COL0 + N) += a[:, 16 K0 .. 16 (K0 + KS)) B, B [n, k] = b's rows COL0 .., columns 16 K0 ..
  // (K-major, as the device's takes it), one group
  template <typename T, int N, int COL0, int K0, int KS>
  void mma_block(Frag<kC>& acc, const Op<T, kC>& a, const Smem& b) {
    constexpr int kd = 16 * KS;
    std::vector<float> af(kC * kd);
    for (int r = 0; r < kC; ++r)
      for (int k = 0; k < kd; ++k) af[r * kd + k] = to_f(a.d[r * kC + 16 * K0 + k]);
    groups.emplace_back();
    groups.back().push_back([&acc, b, af = std::move(af)] {
      const T* bb = static_cast<const T*>(b.base);
      std::vector<float> bf(N * kd);
      for (int n = 0; n < N; ++n)
        for (int k = 0; k < kd; ++k)
          bf[n * kd + k] = to_f(bb[(COL0 + n) * b.ld + 16 * K0 + k]);
      gemm_nt(acc.d + COL0, kC, af, bf, kC, N, kd);
    });
  }
  template <typename T, int KD1, int N1, int KD2, int N2>
  void mma2(Frag<N1>& acc1, const Op<T, KD1>& a1, const Smem& b1, Frag<N2>& acc2, const Op<T, KD2>& a2, const Smem& b2) {
    mma_cols(acc1, 0, N1, a1, b1);
    mma_cols(acc2, 0, N2, a2, b2, false);       // one group
  }
  template <typename T, int KD>
  void mma_lo(Frag<2 * kC>& acc, const Op<T, KD>& a, const Smem& b) { mma_cols(acc, 0, kC, a, b); }
  template <typename T, int KD>
  void mma_hi(Frag<2 * kC>& acc, const Op<T, KD>& a, const Smem& b) { mma_cols(acc, kC, kC, a, b); }
  template <typename T, int KD>
  void mma_lo_hi(Frag<2 * kC>& acc, const Op<T, KD>& a, const Smem& b_lo, const Smem& b_hi) {
    mma_lo(acc, a, b_lo);
    mma_hi(acc, a, b_hi);                       // two groups
  }
  template <typename T>
  void mma_grams(Frag<kC>& kk, Frag<kC>& qk, const Smem& q, const Smem& k) {   // one group, K = kK
    groups.emplace_back();
    groups.back().push_back([&kk, &qk, q, k] {
      const std::vector<float> kb = widen_b<T>(k, kC, kK);
      gemm_nt(kk.d, kC, kb, kb, kC, kC, kK);
      gemm_nt(qk.d, kC, widen_b<T>(q, kC, kK), kb, kC, kC, kK);
    });
  }
  // acc += A B with A in shared memory too ([64, KD]: K-major base[m * ld + k], MN-major base[k * ld + m]),
  // one group (the chunk-parallel backward's products, chunk_gdr_grads_sm90.cuh)
  template <typename T>
  static std::vector<float> widen_a(const Smem& a, int kd) {
    const T* aa = static_cast<const T*>(a.base);
    std::vector<float> out(static_cast<size_t>(kC) * kd);
    for (int m = 0; m < kC; ++m)
      for (int k = 0; k < kd; ++k) out[m * kd + k] = to_f(a.kmajor ? aa[m * a.ld + k] : aa[k * a.ld + m]);
    return out;
  }
  template <typename T, int KD, int N>
  void mma_ss(Frag<N>& acc, const Smem& a, const Smem& b) {
    groups.emplace_back();
    groups.back().push_back([&acc, a, b] { gemm_nt(acc.d, N, widen_a<T>(a, KD), widen_b<T>(b, N, KD), kC, N, KD); });
  }
  // the 64-column block kb of a tile (its columns 64 kb .. 64 kb + 63 as stored)
  template <typename T>
  static Smem col_block(const Smem& t, int kb) { return Smem{static_cast<T*>(t.base) + kb * 64, t.ld, t.kmajor}; }
  // rows[r] += sum over c of f(r, c) (times tile(r, c), a [64, >= N] tile as stored, with row_dot)
  template <int N>
  static void add_row_sums(const Frag<N>& f, float* rows) {
    for (int r = 0; r < kC; ++r) {
      float s = 0.f;
      for (int c = 0; c < N; ++c) s += f.d[r * N + c];
      rows[r] += s;
    }
  }
  template <typename T, int N>
  static void row_dot(const Frag<N>& f, const Smem& t, float* rows) {
    const T* tt = static_cast<const T*>(t.base);
    for (int r = 0; r < kC; ++r) {
      float s = 0.f;
      for (int c = 0; c < N; ++c) s += f.d[r * N + c] * to_f(tt[r * t.ld + c]);
      rows[r] += s;
    }
  }
  // the sum of x (a vector of the chunk's rows) over all rows, over rows c >= r, over rows c < r
  // (__host__ __device__ only because the tile programs call them from a lambda; host only)
  static GDN_HD float sum_rows(const float* x) { return rev_sum(x, 0); }
  static GDN_HD float rev_sum(const float* x, int r) {
    float s = 0.f;
    for (int c = kC - 1; c >= r; --c) s += x[c];
    return s;
  }
  static GDN_HD float fwd_sum(const float* x, int r) {
    float s = 0.f;
    for (int c = 0; c < r; ++c) s += x[c];
    return s;
  }
  static void add_diag(const Frag<kC>& f, float* rows) {     // rows[r] += f(r, r)
    for (int r = 0; r < kC; ++r) rows[r] += f.d[r * kC + r];
  }
  // cols[c] += sum over r of f(r, c) (part: the device's per-warp scratch, unused here)
  static void add_col_sums(const Frag<kC>& f, float* cols, float*) {
    for (int c = 0; c < kC; ++c) {
      float s = 0.f;
      for (int r = 0; r < kC; ++r) s += f.d[r * kC + c];
      cols[c] += s;
    }
  }
  // run the oldest groups until `left` remain (wgmma.wait_group left)
  void retire(size_t left) {
    while (groups.size() > left) {
      for (auto& f : groups.front()) f();
      groups.erase(groups.begin());
    }
  }
  template <typename T>   // __host__ __device__ only because prep_chunk calls it from a lambda (host only)
  GDN_HD float row_sumsq_half(const Smem& t, int i, int h) const {
    const T* p = static_cast<const T*>(t.base) + i * t.ld + h * (kK / 2);
    float s = 0.f;
    for (int c = 0; c < kK / 2; ++c) s += to_f(p[c]) * to_f(p[c]);
    return s;
  }
  template <typename T, int N>
  void store(const Frag<N>& f, const Smem& dst, bool transpose) {
    T* p = static_cast<T*>(dst.base);
    for (int r = 0; r < kC; ++r)
      for (int c = 0; c < N; ++c) p[transpose ? c * dst.ld + r : r * dst.ld + c] = from_f<T>(f.d[r * N + c]);
  }
  template <typename T, int R0, int NB>
  void store_diag_block(const Frag<kC>& f, const Smem& dst, bool transpose) {
    T* p = static_cast<T*>(dst.base);
    for (int r = R0; r < R0 + NB; ++r)
      for (int c = R0; c < R0 + NB; ++c) p[transpose ? c * dst.ld + r : r * dst.ld + c] = from_f<T>(f.d[r * kC + c]);
  }
  template <typename T>
  Frag<kC> vt_as(const Smem& v) {
    Frag<kC> f;
    const T* p = static_cast<const T*>(v.base);
    for (int r = 0; r < kC; ++r)
      for (int c = 0; c < kC; ++c) f.d[r * kC + c] = to_f(p[c * v.ld + r]);
    return f;
  }
  // the four 16 x 16 diagonal blocks of a 64 x 64 tile (the device: warp w's block w in registers)
  struct Sub {
    float d[kC / kSub][kSub][kSub];
  };
  template <typename U>
  struct SubA {       // a block's values rounded to U (an A or a B operand: the same values on the host)
    U d[kC / kSub][kSub][kSub];
  };
  template <typename U>
  using SubB = SubA<U>;
  Sub diag_sub(const Frag<kC>& f, float sign) const {
    Sub x;
    for (int b = 0; b < kC / kSub; ++b)
      for (int r = 0; r < kSub; ++r)
        for (int c = 0; c < kSub; ++c) x.d[b][r][c] = sign * f.d[(kSub * b + r) * kC + kSub * b + c];
    return x;
  }
  void diag_frag(const Sub& x, Frag<kC>& f) const {
    zero(f);
    for (int b = 0; b < kC / kSub; ++b)
      for (int r = 0; r < kSub; ++r)
        for (int c = 0; c < kSub; ++c) f.d[(kSub * b + r) * kC + kSub * b + c] = x.d[b][r][c];
  }
  template <class F>
  static void for_each_sub(Sub& x, F&& fn) {
    for (auto& blk : x.d)
      for (int r = 0; r < kSub; ++r)
        for (int c = 0; c < kSub; ++c) fn(r, c, blk[r][c]);
  }
  template <typename U>
  SubA<U> sub_a(const Sub& x) const {
    SubA<U> o;
    for (int b = 0; b < kC / kSub; ++b)
      for (int r = 0; r < kSub; ++r)
        for (int c = 0; c < kSub; ++c) o.d[b][r][c] = from_f<U>(x.d[b][r][c]);
    return o;
  }
  template <typename U>
  SubB<U> sub_b(const Sub& x) const { return sub_a<U>(x); }
  template <typename U>
  void sub_mma(Sub& acc, const SubA<U>& a, const SubB<U>& b) const {
    for (int k = 0; k < kC / kSub; ++k)
      for (int r = 0; r < kSub; ++r)
        for (int c = 0; c < kSub; ++c) {
          float s = 0.f;
          for (int i = 0; i < kSub; ++i) s += to_f(a.d[k][r][i]) * to_f(b.d[k][i][c]);
          acc.d[k][r][c] += s;
        }
  }
  template <class F>
  void for_rows(F&& fn) {
    for (int i = 0; i < kC; ++i) fn(i);
  }
  template <class F>
  void for_threads(F&& fn) {
    for (int t = 0; t < 128; ++t) fn(t);
  }
  void sync() {}
  void sync_generic() {}
  template <class... Tiles>
  void wait_mma(const Tiles&...) { retire(0); }
  void wait_mma_lo(const Frag<2 * kC>&) { retire(1); }
  template <int LEFT, class... Tiles>
  void wait_mma_left(const Tiles&...) { retire(LEFT); }
};

// The checks both entry points make (P: ChunkSm90Params or ChunkBwdSm90Params; `who` names the entry point).
template <class P>
Status check_sizes(const P& p, bool host, const char* who) {
  auto bad = [who](const std::string& m) { return Status::invalid(std::string(who) + ": " + m); };
  if (p.K != kK || p.V != kV) return bad("K and V must be 128");
  if (p.chunk_size != kC) return bad("chunk_size must be 64");
  if (p.N < 0 || p.T < 0 || p.H < 1 || p.HV < 1 || p.HV % p.H != 0) return bad("sizes out of range");
  if (p.T > kInt32Max) return bad("T must fit int32 (TMA coordinates)");
  if (p.dtype != kF16 && p.dtype != kBF16 && !(host && p.dtype == kF32))
    return bad("dtype must be float16 or bfloat16 (float32: host mirror only)");
  return {};
}

// A host mirror's CTAs: fn(hv, n) for every value head and sequence, one after the other.
template <class F>
void for_each_head(int64_t N, int64_t HV, F&& fn) {
  for (int64_t n = 0; n < N; ++n)
    for (int64_t hv = 0; hv < HV; ++hv) fn(hv, n);
}

// The host policy with the input dtype bound (vt reads v of that type).
template <typename T>
struct HostPolicyT : HostPolicy {
  Frag<kC> vt(const Smem& v) { return vt_as<T>(v); }
};

}  // namespace
}  // namespace sm90
}  // namespace gdn
