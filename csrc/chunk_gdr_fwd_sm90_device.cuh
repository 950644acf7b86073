// The device side of chunk_gdr_fwd_sm90.cu (included there once): the wgmma / TMA / ldmatrix policy of
// the tile program (chunk_gdr_sm90.cuh), the warp-specialised kernel and its launch. Shared tiles are
// 128B-swizzled (TMA's CU_TENSOR_MAP_SWIZZLE_128B, the GMMA descriptors' B128 layout): element (r, c) of
// a [rows, 64] 16-bit block at byte r * 128 + (((c / 8) ^ (r % 8)) * 16) + (c % 8) * 2, blocks 1024-aligned.
#pragma once

#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/arch/mma_sm90_desc.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>

namespace gdn {
namespace sm90 {
namespace {

constexpr int kThreads = 384;              // producer, prep, state warpgroups
constexpr int kStages = 3;                 // the TMA ring of (k, q, v) tiles: chunk j in stage j % 3
constexpr int kPrepBufs = 4;               // Ts, M, gates of chunk j in buffer j % 4 (both CTAs)
constexpr uint32_t kBlock = 8192;          // one [64 rows, 64 cols] 16-bit block
constexpr uint32_t kStageBytes = 5 * kBlock;                            // k, q: 2 blocks each; v: 1
constexpr int kRegsProducer = 40, kRegsPrep = 232, kRegsState = 240;   // 40 + 232 + 240 = 512
static_assert(kRegsProducer + kRegsPrep + kRegsState <= 65536 / 128, "register file");

struct alignas(16) GatesBuf : Gates {};    // a bulk copy's size and addresses are multiples of 16

struct alignas(1024) Shared {
  uint8_t kq[kStages][2][2 * kBlock];   // per stage and K half: [K rows 0..63 ; Q rows 0..63] x 64 cols
  uint8_t v[kStages][kBlock];           // per stage: the CTA's 64 value columns, [64 rows, 64 cols]; after
                                        // the state step has read it, O [c][v] staged for the row stores
  uint8_t ts[kPrepBufs][kBlock];        // Ts [c][c'] (input dtype)
  uint8_t mm[kPrepBufs][kBlock];        // M [c][c']
  uint8_t at[kBlock];                   // A^T (the inverse's operand type)
  uint8_t dt[kBlock];                   // D_b^T
  GatesBuf gates[kPrepBufs];
  PrepScratch scratch;
  int32_t rows[kStages][2];             // per stage: the chunk's start row and length (the producer's)
  alignas(16) float graw[kStages][2][kC];   // per stage: g and beta of the chunk's live rows (formed from the raw
                                        // a, b with raw_gates), 0 on the others; by the producer, for the
                                        // chunks prepped here
  uint64_t full[kStages], empty[kStages], prepped[kPrepBufs], prepfree[kPrepBufs];
};
constexpr uint32_t kPrepBytes = 2 * kBlock + sizeof(GatesBuf);          // what a prep sends its peer
constexpr int kSmemBytes = sizeof(Shared) + 1024;     // + the 1024-byte alignment of the base
static_assert(kSmemBytes <= 232448, "one CTA's shared memory on sm_90 (227 KB)");

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ uint32_t swz(uint32_t row, uint32_t chunk) {   // byte offset in a block
  return row * 128 + (((chunk ^ (row & 7)) & 7) << 4);
}

// ---- mbarriers and named barriers (with memory clobbers: the plain reads after a wait stay after it)
__device__ __forceinline__ void mbar_init(uint64_t* b, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(b)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* b, int phase) {
  asm volatile(
      "{\n.reg .pred p;\nWAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT_%=;\n}\n" ::"r"(smem_u32(b)), "r"(phase) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* b, uint32_t count = 1) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(b)), "r"(count) : "memory");
}

// ---- the cluster of a head's two V-block CTAs: the peer's shared memory and barriers
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ uint32_t peer_addr(const void* p, uint32_t rank) {   // shared::cluster address
  uint32_t a;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(a) : "r"(smem_u32(p)), "r"(rank));
  return a;
}
// arrivals on the peer's barriers with the default semantics (release, CTA scope), as CUTLASS's cluster
// barriers: what they order is this CTA's reads of a buffer (done: their values are used) and, for
// prep's arrival, the bytes of a bulk copy that completes on the same barrier
__device__ __forceinline__ void mbar_arrive_at(uint32_t cluster_addr) {
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(cluster_addr) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx_at(uint32_t cluster_addr, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cluster.b64 _, [%0], %1;" ::"r"(cluster_addr), "r"(bytes)
               : "memory");
}
// bytes from this CTA's shared memory to the peer's (dst, mbar: shared::cluster addresses), completing
// on the peer's barrier
__device__ __forceinline__ void copy_to_peer(uint32_t dst, const void* src, uint32_t bytes, uint32_t mbar) {
  asm volatile("cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(dst), "r"(smem_u32(src)), "r"(bytes), "r"(mbar) : "memory");
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* b, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void fence_async_smem() {        // generic-proxy smem writes -> async proxy
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
__device__ __forceinline__ void named_sync(int id) {
  asm volatile("bar.sync %0, 128;" ::"r"(id) : "memory");
}
template <int R>
__device__ __forceinline__ void set_regs() {
  if constexpr (R > 128) asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(R));
  else asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(R));
}

// ---- GMMA operand types and instructions
template <typename T> struct Gmma;
template <> struct Gmma<__nv_bfloat16> {
  template <cute::SM90::GMMA::Major B> using RS64 = cute::SM90::GMMA::MMA_64x64x16_F32BF16BF16_RS<cute::SM90::GMMA::Major::K, B>;
  template <cute::SM90::GMMA::Major B> using RS128 = cute::SM90::GMMA::MMA_64x128x16_F32BF16BF16_RS<cute::SM90::GMMA::Major::K, B>;
  using SS64 = cute::SM90::GMMA::MMA_64x64x16_F32BF16BF16_SS<cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::K>;
  static __device__ uint32_t pack(float x, float y) {
    __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  static __device__ float2 unpack(uint32_t u) {
    return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&u));
  }
};
template <> struct Gmma<__half> {
  template <cute::SM90::GMMA::Major B> using RS64 = cute::SM90::GMMA::MMA_64x64x16_F32F16F16_RS<cute::SM90::GMMA::Major::K, B>;
  template <cute::SM90::GMMA::Major B> using RS128 = cute::SM90::GMMA::MMA_64x128x16_F32F16F16_RS<cute::SM90::GMMA::Major::K, B>;
  using SS64 = cute::SM90::GMMA::MMA_64x64x16_F32F16F16_SS<cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::K>;
  static __device__ uint32_t pack(float x, float y) {
    __half2 h = __floats2half2_rn(x, y);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  static __device__ float2 unpack(uint32_t u) { return __half22float2(*reinterpret_cast<__half2*>(&u)); }
};

template <class MMA, size_t... I>
__device__ __forceinline__ void rs_fma(const uint32_t (&a)[4], uint64_t desc, float* d, std::index_sequence<I...>) {
  MMA::fma(a[0], a[1], a[2], a[3], desc, d[I]..., cute::SM90::GMMA::ScaleOut::One);
}
template <class MMA, size_t... I>
__device__ __forceinline__ void ss_fma(uint64_t da, uint64_t db, float* d, std::index_sequence<I...>) {
  MMA::fma(da, db, d[I]..., cute::SM90::GMMA::ScaleOut::One);
}

template <int NR>
__device__ __forceinline__ void fence_regs(float* d) {
#pragma unroll
  for (int i = 0; i < NR; ++i) cute::warpgroup_fence_operand(d[i]);
}
template <int NR>
__device__ __forceinline__ void fence_regs(uint32_t* d) {
#pragma unroll
  for (int i = 0; i < NR; ++i) cute::warpgroup_fence_operand(d[i]);
}

// ---- the device policy: one warpgroup, the thread's share of each tile
template <typename T>
struct DevPolicy {
  int bar;           // the warpgroup's named barrier

  template <int N>
  struct Frag {
    float d[N / 2];
  };
  template <typename U, int KD>
  struct Op {
    uint32_t r[KD / 16][4];
  };
  struct Smem {      // a tile in shared memory as a GMMA operand (B128 layout)
    uint32_t addr;   // first block
    uint32_t kstep;  // K-major: bytes between the 64-column blocks; MN-major: LBO (between the N halves)
    bool kmajor;
  };

  // the thread's element i of a fragment: the wgmma accumulator layout (row, col) of thread t
  static __device__ int tid_wg() { return static_cast<int>(threadIdx.x) & 127; }
  static __device__ int row(int i) {
    const int t = tid_wg();
    return 16 * (t >> 5) + ((t & 31) >> 2) + 8 * ((i >> 1) & 1);
  }
  static __device__ int col(int i) { return 8 * (i >> 2) + 2 * (tid_wg() & 3) + (i & 1); }

  template <int N, class F>
  static __device__ void for_each(Frag<N>& f, F&& fn) {
#pragma unroll
    for (int i = 0; i < N / 2; ++i) fn(row(i), col(i), f.d[i]);
  }
  template <int N, class F>
  static __device__ void for_each2(Frag<N>& f, Frag<N>& g, F&& fn) {
#pragma unroll
    for (int i = 0; i < N / 2; ++i) fn(row(i), col(i), f.d[i], g.d[i]);
  }
  // the accumulator layout's pairs: elements 2j, 2j + 1 are (row, col), (row, col + 1), col even
  template <int N, class F>
  static __device__ void for_each_pair(Frag<N>& f, F&& fn) {
#pragma unroll
    for (int i = 0; i < N / 2; i += 2) fn(row(i), col(i), f.d[i], f.d[i + 1]);
  }
  template <int N, class F>
  static __device__ void for_each_pair2(Frag<N>& f, Frag<N>& g, F&& fn) {
#pragma unroll
    for (int i = 0; i < N / 2; i += 2) fn(row(i), col(i), f.d[i], f.d[i + 1], g.d[i], g.d[i + 1]);
  }
  template <class F>
  static __device__ void for_each_lo(Frag<2 * kC>& f, Frag<kC>& v, F&& fn) {
#pragma unroll
    for (int i = 0; i < kC / 2; ++i) fn(row(i), col(i), f.d[i], v.d[i]);
  }
  template <class F>
  static __device__ void for_each_lo(Frag<2 * kC>& f, F&& fn) {
#pragma unroll
    for (int i = 0; i < kC / 2; ++i) fn(row(i), col(i), f.d[i]);
  }
  template <class F>
  static __device__ void for_each_hi(Frag<2 * kC>& f, F&& fn) {
#pragma unroll
    for (int i = 0; i < kC / 2; ++i) fn(row(i), col(i), f.d[kC / 2 + i]);
  }
  template <int N>
  static __device__ void zero(Frag<N>& f) {
#pragma unroll
    for (int i = 0; i < N / 2; ++i) f.d[i] = 0.f;
  }

  // the register A operand of k-steps 0 .. KD / 16 - 1: columns 16 kk .. 16 kk + 15 of the fragment
  // (the accumulator layout's pairs are the A fragment's: rows r, r + 8; columns c, c + 8)
  template <typename U, int KD, int N>
  __device__ Op<U, KD> op(const Frag<N>& f, float sign) const {
    static_assert(KD <= N, "an operand of the fragment's columns");
    Op<U, KD> o;
#pragma unroll
    for (int kk = 0; kk < KD / 16; ++kk)
#pragma unroll
      for (int j = 0; j < 4; ++j) o.r[kk][j] = Gmma<U>::pack(sign * f.d[8 * kk + 2 * j], sign * f.d[8 * kk + 2 * j + 1]);
    return o;
  }
  template <typename U>
  __device__ Op<U, kC> op_lo(const Frag<2 * kC>& f, float sign) const {
    return op<U, kC, 2 * kC>(f, sign);
  }

  static __device__ uint64_t desc(uint32_t addr, uint32_t lbo) {
    cute::GmmaDescriptor g;
    g.bitfield.start_address_ = static_cast<uint16_t>((addr & 0x3FFFF) >> 4);
    g.bitfield.leading_byte_offset_ = static_cast<uint16_t>(lbo >> 4);
    g.bitfield.stride_byte_offset_ = 1024 >> 4;      // 8 rows of 128 B
    g.bitfield.base_offset_ = 0;
    g.bitfield.layout_type_ = 1;                       // B128
    return g.desc_;
  }
  // the descriptor of k-step kk (16 rows of K): K-major: +32 B within a 128 B row, then the next block;
  // MN-major: +16 rows of 128 B
  static __device__ uint64_t desc_k(const Smem& b, int kk) {
    if (b.kmajor) return desc(b.addr + (kk >> 2) * b.kstep + (kk & 3) * 32, 16);
    return desc(b.addr + kk * 2048, b.kstep);
  }

  // issue (no wait) the KD / 16 wgmma of acc[:, :NCOL] += a B as one group
  template <typename U, int KD, int NCOL>
  __device__ void mma_n(float* d, const Op<U, KD>& a, const Smem& b) const {
    using namespace cute::SM90::GMMA;
    fence_regs<NCOL / 2>(d);
    cute::warpgroup_arrive();
#pragma unroll
    for (int kk = 0; kk < KD / 16; ++kk) {
      const uint64_t db = desc_k(b, kk);
      if constexpr (NCOL == 128) {
        if (b.kmajor) rs_fma<typename Gmma<U>::template RS128<Major::K>>(a.r[kk], db, d, std::make_index_sequence<64>{});
        else rs_fma<typename Gmma<U>::template RS128<Major::MN>>(a.r[kk], db, d, std::make_index_sequence<64>{});
      } else {
        if (b.kmajor) rs_fma<typename Gmma<U>::template RS64<Major::K>>(a.r[kk], db, d, std::make_index_sequence<32>{});
        else rs_fma<typename Gmma<U>::template RS64<Major::MN>>(a.r[kk], db, d, std::make_index_sequence<32>{});
      }
    }
    cute::warpgroup_commit_batch();
  }
  template <typename U, int KD, int N>
  __device__ void mma(Frag<N>& acc, const Op<U, KD>& a, const Smem& b) const { mma_n<U, KD, N>(acc.d, a, b); }
  template <typename U>
  __device__ void mma_lo(Frag<2 * kC>& acc, const Op<U, kC>& a, const Smem& b) const { mma_n<U, kC, kC>(acc.d, a, b); }
  template <typename U>
  __device__ void mma_hi(Frag<2 * kC>& acc, const Op<U, kC>& a, const Smem& b) const {
    mma_n<U, kC, kC>(acc.d + kC / 2, a, b);
  }
  // K K^T and Q K^T (k-step by k-step, the two products interleaved) as one group
  template <typename U>
  __device__ void mma_grams(Frag<kC>& kk, Frag<kC>& qk, const Smem& q, const Smem& k) const {
    fence_regs<kC / 2>(kk.d);
    fence_regs<kC / 2>(qk.d);
    cute::warpgroup_arrive();
#pragma unroll
    for (int s = 0; s < kK / 16; ++s) {
      const uint64_t dq = desc_k(q, s), dk = desc_k(k, s);
      ss_fma<typename Gmma<U>::SS64>(dk, dk, kk.d, std::make_index_sequence<32>{});
      ss_fma<typename Gmma<U>::SS64>(dq, dk, qk.d, std::make_index_sequence<32>{});
    }
    cute::warpgroup_commit_batch();
  }
  // wait for every issued group; the named accumulators and A operands are pinned past the wait (the
  // compiler neither reads an accumulator nor reuses an operand's registers before it)
  template <class... Tiles>
  __device__ void wait_mma(Tiles&... tiles) const {
    cute::warpgroup_wait<0>();
    (fence_tile(tiles), ...);
  }
  template <int N>
  static __device__ void fence_tile(Frag<N>& f) { fence_regs<N / 2>(f.d); }
  template <typename U, int KD>
  static __device__ void fence_tile(Op<U, KD>& o) { fence_regs<KD / 4>(&o.r[0][0]); }

  // a 64 x 64 fragment (32 floats in the accumulator layout) to a B128 block, rounded to U; with
  // transpose the block holds its transpose (stmatrix .trans)
  template <typename U>
  __device__ void stmatrix(const float* d, uint32_t dst, bool transpose) const {
    const int wtid = tid_wg(), lane = wtid & 31, w = wtid >> 5, mi = lane >> 3, j = lane & 7;
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      uint32_t r[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int h = i & 1, a = 2 * p + (i >> 1);
        r[i] = Gmma<U>::pack(d[4 * a + 2 * h], d[4 * a + 2 * h + 1]);
      }
      const int h = mi & 1, a = 2 * p + (mi >> 1);
      if (transpose) {
        const uint32_t addr = dst + swz(8 * a + j, 2 * w + h);
        asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr),
                     "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
      } else {
        const uint32_t addr = dst + swz(16 * w + 8 * h + j, a);
        asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr),
                     "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
      }
    }
  }
  template <typename U, int N>
  __device__ void store(const Frag<N>& f, const Smem& dst, bool transpose) const {
    static_assert(N == kC, "64 x 64 tiles only");
    stmatrix<U>(f.d, dst.addr, transpose);
  }
  // V^T [64 v, 64 c] of this warpgroup's 64 columns of the v tile (ldmatrix .trans)
  __device__ Frag<kC> vt(const Smem& v) const {
    Frag<kC> f;
    const int wtid = tid_wg(), lane = wtid & 31, w = wtid >> 5, mi = lane >> 3, j = lane & 7;
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const int h = mi & 1, a = 2 * p + (mi >> 1);
      const uint32_t addr = v.addr + swz(8 * a + j, 2 * w + h);
      uint32_t r[4];
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                   : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int hi = i & 1, ai = 2 * p + (i >> 1);
        const float2 x = Gmma<T>::unpack(r[i]);
        f.d[4 * ai + 2 * hi] = x.x;
        f.d[4 * ai + 2 * hi + 1] = x.y;
      }
    }
    return f;
  }
  // sum of squares of row i of a K-major [rows, 128] tile over K-half h (the block h kstep on)
  template <typename U>
  __device__ float row_sumsq_half(const Smem& t, int i, int h) const {
    uint32_t r[8][4];                       // the row's 8 pieces first, then 4 independent sums
#pragma unroll
    for (int x = 0; x < 8; ++x)
      asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(r[x][0]), "=r"(r[x][1]), "=r"(r[x][2]), "=r"(r[x][3]) : "r"(t.addr + h * t.kstep + swz(i, x))
                   : "memory");
    float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int x = 0; x < 8; ++x)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 f = Gmma<U>::unpack(r[x][e]);
        s[e] += f.x * f.x + f.y * f.y;
      }
    return (s[0] + s[1]) + (s[2] + s[3]);
  }
  template <class F>
  __device__ void for_rows(F&& fn) const {
    if (tid_wg() < kC) fn(tid_wg());
  }
  template <class F>
  __device__ void for_threads(F&& fn) const { fn(tid_wg()); }
  __device__ void sync() const {
    fence_async_smem();
    named_sync(bar);
  }
  __device__ void sync_generic() const { named_sync(bar); }
};


// ---- the kernel
__device__ __forceinline__ void zero16(uint32_t addr) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(addr), "r"(0) : "memory");
}

// Rows [length, 64) of stage st's k, q and v tiles (TMA loads rows of the next sequences there): 0.
__device__ __forceinline__ void zero_dead_rows(Shared& sm, int st, int length, int wtid) {
  for (int e = wtid; e < (kC - length) * 8; e += 128) {
    const uint32_t r = length + e / 8, x = e % 8;
    for (int half = 0; half < 2; ++half) {
      zero16(smem_u32(sm.kq[st][half]) + swz(r, x));
      zero16(smem_u32(sm.kq[st][half]) + kBlock + swz(r, x));
    }
    zero16(smem_u32(sm.v[st]) + swz(r, x));
  }
}

// grid (kVBlocks, HV, N) in clusters of the kVBlocks CTAs of a (value head, sequence): CTA rank vb owns
// value columns vb * 64 .. vb * 64 + 63 and preps the chunks j with j % 2 == vb for both. Barriers (an
// elected thread arrives for its warpgroup after the warpgroup's named barrier):
//   full[s]      the TMA of chunk j landed in stage s = j % 3: k, q (one K-half multicast by each CTA's
//                producer to both) and the CTA's v columns (1 arrival + all the bytes)
//   empty[s]     stage s read in both CTAs (the multicast writes both): by each CTA's state warpgroup,
//                whose step j follows its own prep's reads of the stage (2: one local, one remote)
//   prepped[b]   Ts, M, gates of chunk j in buffer b = j % 4: by this CTA's prep, or by the peer's
//                (its arrival with the bytes of its bulk copy) (1)
//   prepfree[b]  buffer b read by both state warpgroups (at the CTA that preps it; 2)
template <typename T>
__global__ void __cluster_dims__(kVBlocks, 1, 1) __launch_bounds__(kThreads, 1)
chunk_gdr_fwd_sm90_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                          const __grid_constant__ CUtensorMap tm_v, const __grid_constant__ CUtensorMap tm_o,
                          const Args a) {
  using P = DevPolicy<T>;
  using TInv = __half;
  extern __shared__ uint8_t smem_raw[];
  // aligned by an offset from smem_raw (not through an integer), so the compiler keeps knowing that every
  // access through `sm` is to shared memory (ld.shared, not generic loads)
  Shared& sm = *reinterpret_cast<Shared*>(smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023));
  const int tid = threadIdx.x, wg = tid >> 7, wtid = tid & 127;
  const int vb = static_cast<int>(cluster_rank());           // blockIdx.x
  const uint32_t peer = vb ^ 1;
  const int64_t hv = blockIdx.y, n = blockIdx.z, HV = a.HV;
  const int h = static_cast<int>(hv / (HV / a.H));
  const int64_t c0 = a.cu_chunks[n], c1 = a.cu_chunks[n + 1];
  const int nchunks = static_cast<int>(c1 - c0);
  if (tid == 0) {
    for (int i = 0; i < kStages; ++i) {
      mbar_init(&sm.full[i], 1);
      mbar_init(&sm.empty[i], kVBlocks);          // the state warpgroups of both CTAs
    }
    for (int i = 0; i < kPrepBufs; ++i) {
      mbar_init(&sm.prepped[i], 1);
      mbar_init(&sm.prepfree[i], 2);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  cluster_sync();                                 // both CTAs' barriers initialised before any arrival

  if (wg == 0) {                                  // ---- producer: warp 0 (the TMA from its lane 0)
    set_regs<kRegsProducer>();
    if (wtid < 32) {
      const GateFn gate = gate_fn(a, hv);
      const int4* table = reinterpret_cast<const int4*>(a.table) + c0;   // rows (seq, idx, start, length)
      int4 next = nchunks > 0 ? __ldg(table) : make_int4(0, 0, 0, 0);
      for (int it = 0; it < nchunks; ++it) {
        const int st = it % kStages;
        const int32_t start = next.z, length = next.w;
        if (it + 1 < nchunks) next = __ldg(table + it + 1);   // the next chunk's row, in flight during this one
        // g, beta (or a, b) of the lane's two rows, for the chunks prepped here; 0 on the others
        const bool mine = it % kVBlocks == vb;
        float x[2], y[2];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int i = wtid + 32 * j;
          const int64_t row = static_cast<int64_t>(start) + i;
          const bool live = mine && i < length;
          x[j] = live ? a.g[row * HV + hv] : 0.f;
          y[j] = live ? a.beta[row * HV + hv] : 0.f;
        }
        if (it >= kStages) mbar_wait(&sm.empty[st], ((it / kStages) + 1) & 1);
#pragma unroll
        for (int j = 0; j < 2; ++j) {              // the gates (from raw a, b with raw_gates), 0 on dead rows
          const int i = wtid + 32 * j;
          float g, b;
          gate(x[j], y[j], &g, &b);
          sm.graw[st][0][i] = mine && i < length ? g : 0.f;
          sm.graw[st][1][i] = mine && i < length ? b : 0.f;
        }
        if (wtid == 0) {
          sm.rows[st][0] = start;
          sm.rows[st][1] = length;
        }
        __syncwarp();                             // the lanes' stores before lane 0's arrival (release)
        if (wtid == 0) {                          // k, q: this CTA's K-half to both CTAs (multicast); its v
          constexpr uint64_t hint = static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_NORMAL);
          constexpr uint16_t both = (1u << kVBlocks) - 1;
          mbar_expect_tx(&sm.full[st], kStageBytes);   // all of the stage: the peer's K-half arrives here too
          cute::SM90_TMA_LOAD_MULTICAST_3D::copy(&tm_k, &sm.full[st], both, hint, sm.kq[st][vb], vb * 64, h, start);
          cute::SM90_TMA_LOAD_MULTICAST_3D::copy(&tm_q, &sm.full[st], both, hint, sm.kq[st][vb] + kBlock, vb * 64, h,
                                                 start);
          cute::SM90_TMA_LOAD_3D::copy(&tm_v, &sm.full[st], hint, sm.v[st], vb * kVB, static_cast<int>(hv), start);
        }
      }
    }
  } else if (wg == 1) {                           // ---- prep of this CTA's chunks, for both CTAs
    set_regs<kRegsPrep>();
    P p{1};
    const typename P::Smem at{smem_u32(sm.at), 0, true}, dt{smem_u32(sm.dt), 0, true};
    // a sequence's last chunk (the only one that can be partial: kLast) apart, so the loop of the others
    // holds no dead-row work
    auto prep_one = [&](int it, auto last) {
      constexpr bool kLast = decltype(last)::value;
      const int st = it % kStages, b = it % kPrepBufs;
      mbar_wait(&sm.full[st], (it / kStages) & 1);
      if (it >= kPrepBufs) mbar_wait(&sm.prepfree[b], ((it / kPrepBufs) + 1) & 1);
      const int length = sm.rows[st][1];
      if constexpr (kLast) {
        if (length < kC) {                        // (the Gram products read the zeroed rows: fenced)
          zero_dead_rows(sm, st, length, wtid);
          p.sync();
        }
      }
      const typename P::Smem k_t{smem_u32(sm.kq[st][0]), 2 * kBlock, true};
      const typename P::Smem q_t{smem_u32(sm.kq[st][0]) + kBlock, 2 * kBlock, true};
      const typename P::Smem ts{smem_u32(sm.ts[b]), 0, true}, m{smem_u32(sm.mm[b]), 0, true};
      prep_chunk<P, T, TInv>(p, q_t, k_t, sm.scratch, sm.graw[st][0], sm.graw[st][1], length, a.scale, a.l2norm,
                             sm.gates[b], at, at, dt, dt, ts, m);
      p.sync();                                   // (its fence: Ts, M, gates visible to the async proxy)
      if (wtid == 0) {
        mbar_arrive(&sm.prepped[b]);
        const uint32_t bar = peer_addr(&sm.prepped[b], peer);
        mbar_expect_tx_at(bar, kPrepBytes);
        copy_to_peer(peer_addr(sm.ts[b], peer), sm.ts[b], kBlock, bar);
        copy_to_peer(peer_addr(sm.mm[b], peer), sm.mm[b], kBlock, bar);
        copy_to_peer(peer_addr(&sm.gates[b], peer), &sm.gates[b], sizeof(GatesBuf), bar);
      }
    };
    int it = vb;
    for (; it + 1 < nchunks; it += kVBlocks) prep_one(it, std::false_type{});
    if (it == nchunks - 1) prep_one(it, std::true_type{});
  } else {                                        // ---- state: S^T of the CTA's 64 value columns in registers
    set_regs<kRegsState>();
    P p{2};
    typename P::template Frag<kK> S;
    const float* h0 = a.h0 ? a.h0 + (n * HV + hv) * kK * kV : nullptr;
    P::for_each(S, [&](int r, int c, float& x) { x = h0 ? h0[c * kV + vb * kVB + r] : 0.f; });
    T* o = static_cast<T*>(a.o);
    int held = -1;                                // a stage whose O tile a TMA store may still be reading
    auto release_held = [&]() {                   // (thread 0) the stage back to the producer once read
      if (held >= 0) {
        asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
        mbar_arrive(&sm.empty[held]);           // both CTAs' stage (k, q land in both by multicast)
        mbar_arrive_at(peer_addr(&sm.empty[held], peer));
        held = -1;
      }
    };
    // a sequence's last chunk (the only one that can be partial: kLast) apart, as in prep
    auto step = [&](int it, auto last) {
      constexpr bool kLast = decltype(last)::value;
      const int st = it % kStages, b = it % kPrepBufs;
      const bool mine = it % kVBlocks == vb;      // prepped here (else by the peer)
      if (wtid == 0) release_held();
      mbar_wait(&sm.full[st], (it / kStages) & 1);
      mbar_wait(&sm.prepped[b], (it / kPrepBufs) & 1);   // (filled by the peer's bulk copy when !mine)
      const int64_t start = sm.rows[st][0];
      const int length = sm.rows[st][1];
      if constexpr (kLast) {
        if (length < kC && !mine) {               // (the peer's prep zeroed its own copy only)
          zero_dead_rows(sm, st, length, wtid);
          p.sync();
        }
      }
      const uint32_t kq = smem_u32(sm.kq[st][0]), ostage = smem_u32(sm.v[st]);
      const typename P::Smem kq_b{kq, 2 * kBlock, true}, k_mn{kq, 2 * kBlock, false};
      const typename P::Smem ts{smem_u32(sm.ts[b]), 0, true}, m{smem_u32(sm.mm[b]), 0, true};
      const typename P::Smem v{smem_u32(sm.v[st]), 0, true};
      state_step<P, T>(p, S, sm.gates[b], kq_b, k_mn, ts, m, v, [&](typename P::template Frag<2 * kC>& acc) {
        // O goes into the v tile: every warp has read its V^T (ldmatrix) before issuing the X'^T Ts^T
        // wgmma, and a wgmma group completes only once all four warps have issued it
        p.template stmatrix<T>(acc.d + kC / 2, ostage, true);    // O [c][v]
        fence_async_smem();                       // for the TMA store, and before the next TMA load into it
        named_sync(p.bar);
        if (!kLast || length == kC) {             // a whole chunk: one TMA store (the box is the chunk's rows;
          if (wtid == 0) {                        // rows past T, a middle chunk's only dead rows, are clipped)
            cute::SM90_TMA_STORE_3D::copy(&tm_o, sm.v[st], vb * kVB, static_cast<int>(hv), static_cast<int>(start));
            asm volatile("cp.async.bulk.commit_group;" ::: "memory");
          }
          return;
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {             // the live rows only (the next sequence's follow them)
          const int id = wtid + 128 * i, c = id >> 3, x = id & 7;
          if (c < length) {
            uint4 val;
            asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                         : "=r"(val.x), "=r"(val.y), "=r"(val.z), "=r"(val.w) : "r"(ostage + swz(c, x)) : "memory");
            *reinterpret_cast<uint4*>(o + ((start + c) * HV + hv) * kV + vb * kVB + 8 * x) = val;
          }
        }
        named_sync(p.bar);                        // every thread's reads of the tile done
      });
      if (wtid == 0) {
        if (mine) mbar_arrive(&sm.prepfree[b]);
        else mbar_arrive_at(peer_addr(&sm.prepfree[b], peer));
        held = st;                                // released at the next chunk (or below), once read
        if (kLast && length < kC) release_held();   // (no store in flight: wait_group.read returns at once)
      }
    };
    for (int it = 0; it + 1 < nchunks; ++it) step(it, std::false_type{});
    if (nchunks > 0) step(nchunks - 1, std::true_type{});
    if (wtid == 0) {
      release_held();
      asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");   // the last stores done before exit
    }
    if (a.ht) {
      float* ht = a.ht + (n * HV + hv) * kK * kV;
      P::for_each(S, [&](int r, int c, float& x) { ht[c * kV + vb * kVB + r] = x; });
    }
    int64_t pa, pb;
    padding_after(a.table, a.cu_chunks, n, a.N, a.T, &pa, &pb);
    const int64_t first = n == 0 ? padding_before_first(a.table, a.cu_chunks, a.N, a.T) : 0;
    const uint4 zero = make_uint4(0, 0, 0, 0);
    for (int pass = 0; pass < 2; ++pass) {
      const int64_t r0 = pass ? 0 : pa, r1 = pass ? first : pb;
      for (int64_t e = wtid; e < (r1 - r0) * 8; e += 128)
        *reinterpret_cast<uint4*>(o + ((r0 + e / 8) * HV + hv) * kV + vb * kVB + 8 * (e % 8)) = zero;
    }
  }
  cluster_sync();          // neither CTA leaves while the peer may still copy to or arrive on its barriers
}

// ---- launch: TMA descriptors (driver entry point through the runtime: no libcuda link)
using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

Status encode_tiled(EncodeTiled enc, CUtensorMap* m, CUtensorMapDataType ty, const void* base, int64_t cols,
                    int64_t heads, int64_t rows) {
  if ((reinterpret_cast<std::uintptr_t>(base) & 15) != 0)
    return Status::invalid("chunk_gdr_fwd_sm90: q, k, v, o must be 16-byte aligned (TMA)");
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(heads),
                              static_cast<cuuint64_t>(rows > 0 ? rows : 1)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(cols * 2), static_cast<cuuint64_t>(heads * cols * 2)};
  const cuuint32_t box[3] = {64, 1, static_cast<cuuint32_t>(kC)};
  const cuuint32_t estr[3] = {1, 1, 1};
  const CUresult r = enc(m, ty, 3, const_cast<void*>(base), dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
                         CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                         CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    return {StatusKind::kCudaError, "chunk_gdr_fwd_sm90: cuTensorMapEncodeTiled failed (" + std::to_string(r) + ")"};
  return {};
}

template <typename T>
Status launch_t(const Args& a, CUtensorMapDataType ty, cudaStream_t stream) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q{};
  cudaError_t e = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &fn, cudaEnableDefault, &q);
  if (e != cudaSuccess || fn == nullptr) return cuda_error("chunk_gdr_fwd_sm90: cuTensorMapEncodeTiled", e);
  const auto enc = reinterpret_cast<EncodeTiled>(fn);
  CUtensorMap tq, tk, tv, to;
  Status st = encode_tiled(enc, &tq, ty, a.q, kK, a.H, a.T);
  if (st.ok()) st = encode_tiled(enc, &tk, ty, a.k, kK, a.H, a.T);
  if (st.ok()) st = encode_tiled(enc, &tv, ty, a.v, kV, a.HV, a.T);
  if (st.ok()) st = encode_tiled(enc, &to, ty, a.o, kV, a.HV, a.T);
  if (!st.ok()) return st;
  auto kernel = chunk_gdr_fwd_sm90_kernel<T>;
  e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  if (e != cudaSuccess) return cuda_error("chunk_gdr_fwd_sm90: cudaFuncSetAttribute", e);
  if (a.N > 65535 || a.HV > 65535)
    return Status::invalid("chunk_gdr_fwd_sm90: at most 65535 sequences and value heads");
  const dim3 grid(kVBlocks, static_cast<unsigned>(a.HV), static_cast<unsigned>(a.N));
  kernel<<<grid, kThreads, kSmemBytes, stream>>>(tq, tk, tv, to, a);
  return launch_status("chunk_gdr_fwd_sm90");
}

Status launch(const Args& a, int dtype, cudaStream_t stream) {
  if (a.N == 0 || a.HV == 0) return {};
  if (dtype == kF16) return launch_t<__half>(a, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, stream);
  return launch_t<__nv_bfloat16>(a, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, stream);
}

}  // namespace
}  // namespace sm90
}  // namespace gdn
