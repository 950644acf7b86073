// The device side shared by the sm_90a chunked kernels (csrc/chunk_gdr_fwd_sm90.cu, chunk_gdr_bwd_sm90.cu),
// written once: the wgmma / ldmatrix / stmatrix policy of their tile programs (chunk_gdr_sm90.cuh), the
// mbarrier, cluster and named-barrier helpers, and the TMA descriptors. Shared tiles are 128B-swizzled
// (TMA's CU_TENSOR_MAP_SWIZZLE_128B, the GMMA descriptors' B128 layout): element (r, c) of a [rows, 64]
// 16-bit block at byte r * 128 + (((c / 8) ^ (r % 8)) * 16) + (c % 8) * 2, blocks 1024-aligned.
#pragma once

#include <cuda.h>

#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/arch/mma_sm90_desc.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>

#include <initializer_list>
#include <string>
#include <type_traits>
#include <utility>
#if defined(GDN_SM90_WATCHDOG)
#include <cstdio>
#endif

#include "api.h"
#include "chunk_gdr_sm90.cuh"
#include "cuda_status.cuh"

namespace gdn {
namespace sm90 {
namespace {

constexpr uint32_t kBlock = 8192;          // one [64 rows, 64 cols] 16-bit block

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
#if defined(GDN_SM90_WATCHDOG)
// The barrier watchdog, a debug build only (-DGDN_SM90_WATCHDOG=<spins>; setup.py passes it from
// GDN_PACKED_SM90_WATCHDOG): a wait that has failed <spins> try_waits prints one line (the lowest waiting
// lane of each warp) naming the CTA, its cluster rank, the thread and warp, the barrier's shared address,
// the parity waited for, the call site's tag and chunk step, and how long it has waited; after as many
// failed try_waits again it traps, so that every stuck warp has printed before the first trap ends the
// grid. What one failed try_wait costs in time is the hardware's suspend limit (the line reports it).
// What it changes (ptxas 13.0): printf is a call, so the wgmma are serialized (C7510) and values live
// across the call spill on its cold path; the barrier protocol and the setmaxnreg split stay (the report
// is inlined: as a __noinline__ function it made ptxas ignore setmaxnreg, C7507, in the producer's 32).
static_assert(GDN_SM90_WATCHDOG >= 1000, "GDN_SM90_WATCHDOG=<spins>: a bare -DGDN_SM90_WATCHDOG defines 1");
__device__ __forceinline__ void mbar_stuck(uint32_t addr, int phase, const char* tag, int it, uint64_t t0) {
  const unsigned lanes = __activemask();
  if ((threadIdx.x & 31) != static_cast<unsigned>(__ffs(lanes) - 1)) return;
  uint32_t rank;
  uint64_t t1;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
  printf("GDN_SM90_WATCHDOG: %s, it %d: block (%d,%d,%d) cluster rank %u thread %d warp %d lanes 0x%08x: "
         "mbarrier smem 0x%x parity %d not complete after %lld try_waits (%.3f ms)\n",
         tag, it, static_cast<int>(blockIdx.x), static_cast<int>(blockIdx.y), static_cast<int>(blockIdx.z), rank,
         static_cast<int>(threadIdx.x), static_cast<int>(threadIdx.x >> 5), lanes, addr, phase,
         static_cast<long long>(GDN_SM90_WATCHDOG), static_cast<double>(t1 - t0) * 1e-6);
}
#endif
// wait for the phase of parity `phase` of barrier b; tag and it (the waiter's chunk step) name the call
// site in the watchdog build's report and are unused otherwise (the default build's code is the bare loop)
__device__ __forceinline__ void mbar_wait(uint64_t* b, int phase, const char* tag = "mbarrier", int it = -1) {
#if defined(GDN_SM90_WATCHDOG)
  const uint32_t addr = smem_u32(b);
  uint64_t t0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  for (long long spins = 1;; ++spins) {
    uint32_t done;
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n" : "=r"(done) : "r"(addr), "r"(phase) : "memory");
    if (done) return;
    if (spins == GDN_SM90_WATCHDOG) mbar_stuck(addr, phase, tag, it, t0);
    if (spins == 2LL * GDN_SM90_WATCHDOG) __trap();
  }
#else
  (void)tag;
  (void)it;
  asm volatile(
      "{\n.reg .pred p;\nWAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT_%=;\n}\n" ::"r"(smem_u32(b)), "r"(phase) : "memory");
#endif
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
// bytes from global memory to this CTA's shared memory, completing on its mbarrier
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* mbar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(mbar)) : "memory");
}

// rows c < length of a staged [64 rows, 64 columns] 16-bit tile (128B-swizzled, at shared address tile) to
// dst (row c at dst + c * ld elements, 64 contiguous columns), by a warpgroup's 128 threads, 16 bytes at a
// time: a partial chunk's live rows (the next sequence's follow them)
template <typename T>
__device__ __forceinline__ void store_live_rows(uint32_t tile, T* dst, int64_t ld, int length, int wtid) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int id = wtid + 128 * i, c = id >> 3, x = id & 7;
    if (c < length) {
      uint4 val;
      asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(val.x), "=r"(val.y), "=r"(val.z), "=r"(val.w) : "r"(tile + swz(c, x)) : "memory");
      *reinterpret_cast<uint4*>(dst + c * ld + 8 * x) = val;
    }
  }
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* b, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void fence_async_smem() {        // generic-proxy smem writes -> async proxy
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
__device__ __forceinline__ void named_sync(int id) {
#if defined(GDN_LANE_SHIM)   // the host's 128 emulated lanes (tests/lanes_sm90.cpp)
  lane_shim::bar_sync(id, 128);
#else
  asm volatile("bar.sync %0, 128;" ::"r"(id) : "memory");
#endif
}
// setmaxnreg to R registers from the launch count `From`: an increase above it, a decrease below it (the
// sum over the CTA's warpgroups must fit the launch allocation; the caller static_asserts that)
template <int R, int From>
__device__ __forceinline__ void set_regs() {
  static_assert(R != From && R % 8 == 0 && R >= 24 && R <= 256, "setmaxnreg: a multiple of 8 in [24, 256]");
  if constexpr (R > From) asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(R));
  else asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(R));
}

// ---- GMMA operand types and instructions
template <typename T> struct Gmma;
template <> struct Gmma<__nv_bfloat16> {
  template <cute::SM90::GMMA::Major B> using RS64 = cute::SM90::GMMA::MMA_64x64x16_F32BF16BF16_RS<cute::SM90::GMMA::Major::K, B>;
  template <cute::SM90::GMMA::Major B> using RS128 = cute::SM90::GMMA::MMA_64x128x16_F32BF16BF16_RS<cute::SM90::GMMA::Major::K, B>;
  template <cute::SM90::GMMA::Major A, cute::SM90::GMMA::Major B> using SS64 = cute::SM90::GMMA::MMA_64x64x16_F32BF16BF16_SS<A, B>;
  template <cute::SM90::GMMA::Major A, cute::SM90::GMMA::Major B> using SS128 = cute::SM90::GMMA::MMA_64x128x16_F32BF16BF16_SS<A, B>;
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
  template <cute::SM90::GMMA::Major A, cute::SM90::GMMA::Major B> using SS64 = cute::SM90::GMMA::MMA_64x64x16_F32F16F16_SS<A, B>;
  template <cute::SM90::GMMA::Major A, cute::SM90::GMMA::Major B> using SS128 = cute::SM90::GMMA::MMA_64x128x16_F32F16F16_SS<A, B>;
  static __device__ uint32_t pack(float x, float y) {
    __half2 h = __floats2half2_rn(x, y);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  static __device__ float2 unpack(uint32_t u) { return __half22float2(*reinterpret_cast<__half2*>(&u)); }
  // N = 16, 32 (mma_block: the doubling's blocks)
  template <int N, cute::SM90::GMMA::Major B>
  using RSN = std::conditional_t<N == 16, cute::SM90::GMMA::MMA_64x16x16_F32F16F16_RS<cute::SM90::GMMA::Major::K, B>,
                                 cute::SM90::GMMA::MMA_64x32x16_F32F16F16_RS<cute::SM90::GMMA::Major::K, B>>;
};

template <class MMA, size_t... I>
__device__ __forceinline__ void rs_fma(const uint32_t (&a)[4], uint64_t desc, float* d, std::index_sequence<I...>) {
  MMA::fma(a[0], a[1], a[2], a[3], desc, d[I]..., cute::SM90::GMMA::ScaleOut::One);
}
template <class MMA, size_t... I>
__device__ __forceinline__ void ss_fma(uint64_t da, uint64_t db, float* d, std::index_sequence<I...>) {
  MMA::fma(da, db, d[I]..., cute::SM90::GMMA::ScaleOut::One);
}

// mma.sync m16n8k16 of fp16 operands, fp32 accumulators: d += A B for the warp's A (16 x 16, row) in a's
// four registers and B (16 x 8, col) in b0, b1 (the PTX ISA's fragments)
__device__ __forceinline__ void hmma_16816_f16(float* d, const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(GDN_LANE_SHIM)   // the host's emulated lanes (tests/lanes_sm90.cpp)
  lane_shim::mma_m16n8k16_f16(d, a, b0, b1);
#else
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%0, %1, %2, %3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}
// the warp's 8 x 8 16-bit matrix transposed in registers (movmatrix .trans): lane l holds elements
// (l / 4, 2 (l % 4) + k), k = 0 in the low half, before; elements (2 (l % 4) + k, l / 4) after
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
#if defined(GDN_LANE_SHIM)
  return lane_shim::movmatrix_trans(x);
#else
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
  return y;
#endif
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
  template <typename U>
  struct RowVal {    // a value per chunk row: the row's thread (for_rows) holds its own
    U v;
    __device__ U& operator[](int) { return v; }
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
  template <int N, class F>
  static __device__ void for_each2_pair(Frag<N>& f, Frag<N>& g, F&& fn) {
#pragma unroll
    for (int i = 0; i < N / 2; i += 2) fn(row(i), col(i), f.d[i], f.d[i + 1], g.d[i], g.d[i + 1]);
  }
  // the pairs of a [64, 128] fragment's lo (hi) 64 columns, col relative to them
  template <class F>
  static __device__ void for_each_lo_pair(Frag<2 * kC>& f, Frag<kC>& v, F&& fn) {
#pragma unroll
    for (int i = 0; i < kC / 2; i += 2) fn(row(i), col(i), f.d[i], f.d[i + 1], v.d[i], v.d[i + 1]);
  }
  template <class F>
  static __device__ void for_each_lo_pair(Frag<2 * kC>& f, F&& fn) {
#pragma unroll
    for (int i = 0; i < kC / 2; i += 2) fn(row(i), col(i), f.d[i], f.d[i + 1]);
  }
  template <class F>
  static __device__ void for_each_hi_pair(Frag<2 * kC>& f, F&& fn) {
#pragma unroll
    for (int i = 0; i < kC / 2; i += 2) fn(row(i), col(i), f.d[kC / 2 + i], f.d[kC / 2 + i + 1]);
  }
  // f's hi columns beside a 64-column tile g of the same rows and columns: fn(row, col, f0, f1, g0&, g1&)
  template <class F>
  static __device__ void for_each_hi2_pair(Frag<2 * kC>& f, Frag<kC>& g, F&& fn) {
#pragma unroll
    for (int i = 0; i < kC / 2; i += 2) fn(row(i), col(i), f.d[kC / 2 + i], f.d[kC / 2 + i + 1], g.d[i], g.d[i + 1]);
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
  // f -= o's values, o = op<U, KD>(f, 1.f): f's first KD columns keep their rounding error (the packed
  // registers unpacked: no second rounding)
  template <typename U, int KD, int N>
  static __device__ void sub_op(Frag<N>& f, const Op<U, KD>& o) {
#pragma unroll
    for (int kk = 0; kk < KD / 16; ++kk)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 x = Gmma<U>::unpack(o.r[kk][j]);
        f.d[8 * kk + 2 * j] -= x.x;
        f.d[8 * kk + 2 * j + 1] -= x.y;
      }
  }

  // ---- the diagonal 16 x 16 blocks of a 64 x 64 fragment (diag_inverse): warp w holds rows 16 w .. 16 w + 15,
  // so block w is its elements 8 w .. 8 w + 7 (column blocks 2 w, 2 w + 1); element k at row
  // lane / 4 + 8 (bit 1 of k), column 8 (k / 4) + 2 (lane % 4) + (bit 0 of k) of the block: the C fragments
  // of mma.sync m16n8k16's n-blocks 0 (k < 4) and 1, and as pairs its A fragment
  struct Sub {
    float d[8];
  };
  template <typename U>
  struct SubA {
    uint32_t r[4];      // pieces (rows 0-7 | 8-15, columns 0-7 | 8-15): (0, 0), (1, 0), (0, 1), (1, 1)
  };
  template <typename U>
  struct SubB {
    uint32_t r[4];      // n-block 0 (columns 0-7): r[0], r[1]; n-block 1: r[2], r[3]
  };
  __device__ Sub diag_sub(const Frag<kC>& f, float sign) const {
    const int w = tid_wg() >> 5;
    Sub x;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      float v = f.d[k];
#pragma unroll
      for (int b = 1; b < kC / kSub; ++b) v = w == b ? f.d[8 * b + k] : v;   // (selects: no local memory)
      x.d[k] = sign * v;
    }
    return x;
  }
  __device__ void diag_frag(const Sub& x, Frag<kC>& f) const {
    const int w = tid_wg() >> 5;
#pragma unroll
    for (int b = 0; b < kC / kSub; ++b)
#pragma unroll
      for (int k = 0; k < 8; ++k) f.d[8 * b + k] = w == b ? x.d[k] : 0.f;
  }
  template <class F>
  static __device__ void for_each_sub(Sub& x, F&& fn) {
    const int l = tid_wg() & 31;
#pragma unroll
    for (int k = 0; k < 8; ++k) fn(l / 4 + 8 * ((k >> 1) & 1), 8 * (k >> 2) + 2 * (l & 3) + (k & 1), x.d[k]);
  }
  template <typename U>
  __device__ SubA<U> sub_a(const Sub& x) const {
    SubA<U> a;
#pragma unroll
    for (int j = 0; j < 4; ++j) a.r[j] = Gmma<U>::pack(x.d[2 * j], x.d[2 * j + 1]);
    return a;
  }
  // B [k, n] = the block: n-block nb's registers are its pieces (0, nb) and (1, nb) transposed; piece (0, 1)
  // of a lower-triangular block is 0
  template <typename U>
  __device__ SubB<U> sub_b(const Sub& x) const {
    const SubA<U> a = sub_a<U>(x);
    return SubB<U>{{movmatrix_trans(a.r[0]), movmatrix_trans(a.r[1]), 0u, movmatrix_trans(a.r[3])}};
  }
  template <typename U>
  __device__ void sub_mma(Sub& acc, const SubA<U>& a, const SubB<U>& b) const {
    static_assert(std::is_same_v<U, __half>, "the diagonal blocks' mma.sync takes fp16 operands");
    hmma_16816_f16(acc.d, a.r, b.r[0], b.r[1]);
    hmma_16816_f16(acc.d + 4, a.r, b.r[2], b.r[3]);
  }

  // The B128 descriptor of the tile at shared address addr: the start address (addr / 16, 14 bits) and the
  // leading byte offset / 16 in the low word, the stride (8 rows of 128 B) and the layout in the high one.
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
  // MN-major: +16 rows of 128 B. The tile's descriptor plus the step's offset / 16 in the start address
  // field: shared addresses stay below 2^18, so the field (addr / 16 < 2^14) never carries, and the
  // descriptor is desc(addr + offset) built once per tile and one add per step.
  static __device__ uint64_t desc_k(const Smem& b, int kk) {
    const uint64_t base = desc(b.addr, b.kmajor ? 16 : b.kstep);
    const uint32_t off = b.kmajor ? (kk >> 2) * b.kstep + (kk & 3) * 32 : kk * 2048;
    const uint32_t lo = static_cast<uint32_t>(base) + (off >> 4);
    return (base & 0xFFFFFFFF00000000ull) | lo;
  }

  // issue (no wait) the KD / 16 wgmma of acc[:, :NCOL] += a B as one group
  // (kCommit / kArrive false: mma2's halves, one group)
  template <typename U, int KD, int NCOL, bool kCommit = true, bool kArrive = true>
  __device__ void mma_n(float* d, const Op<U, KD>& a, const Smem& b) const {
    using namespace cute::SM90::GMMA;
    fence_regs<NCOL / 2>(d);
    if constexpr (kArrive) cute::warpgroup_arrive();
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
    if constexpr (kCommit) cute::warpgroup_commit_batch();
  }
  template <typename U, int KD, int N>
  __device__ void mma(Frag<N>& acc, const Op<U, KD>& a, const Smem& b) const { mma_n<U, KD, N>(acc.d, a, b); }
  // two products into two accumulators as one group: both accumulators fenced before either is issued
  // (as two groups ptxas may read the first's in-flight registers to form the second's, and waits)
  template <typename U, int KD1, int N1, int KD2, int N2>
  __device__ void mma2(Frag<N1>& acc1, const Op<U, KD1>& a1, const Smem& b1, Frag<N2>& acc2, const Op<U, KD2>& a2,
                       const Smem& b2) const {
    fence_regs<N2 / 2>(acc2.d);
    mma_n<U, KD1, N1, false>(acc1.d, a1, b1);
    mma_n<U, KD2, N2, true, false>(acc2.d, a2, b2);
  }
  // acc's columns 0 .. 63 (lo) or 64 .. 127 (hi) += a B (N = 64), as one group
  template <typename U, int KD>
  __device__ void mma_lo(Frag<2 * kC>& acc, const Op<U, KD>& a, const Smem& b) const { mma_n<U, KD, kC>(acc.d, a, b); }
  template <typename U, int KD>
  __device__ void mma_hi(Frag<2 * kC>& acc, const Op<U, KD>& a, const Smem& b) const {
    mma_n<U, KD, kC>(acc.d + kC / 2, a, b);
  }
  // acc's lo columns += a B_lo, then its hi columns += a B_hi, as two groups (wait_mma_lo waits for the
  // first only); the whole accumulator fenced before either is issued (as mma2: otherwise ptxas may form
  // the second's registers while the first is in flight, and inject a wait)
  template <typename U, int KD>
  __device__ void mma_lo_hi(Frag<2 * kC>& acc, const Op<U, KD>& a, const Smem& b_lo, const Smem& b_hi) const {
    fence_regs<kC>(acc.d);
    mma_n<U, KD, kC>(acc.d, a, b_lo);
    mma_n<U, KD, kC>(acc.d + kC / 2, a, b_hi);
  }
  // acc's columns COL0 .. COL0 + N - 1 += a's k-steps K0 .. K0 + KS - 1 times B's rows COL0 .. COL0 + N - 1
  // (B K-major, as the doubling's A^T and D_b^T: row n at n x 128 B, COL0 a multiple of 8, so the 8-row
  // swizzle atoms stay whole), one group;
  // the accumulator's columns from COL0 are its elements from COL0 / 2 (the layout's 8-column pieces)
  template <typename U, int N, int COL0, int K0, int KS>
  __device__ void mma_block(Frag<kC>& acc, const Op<U, kC>& a, const Smem& b) const {
    static_assert(std::is_same_v<U, __half> && (N == 16 || N == 32) && COL0 % 8 == 0 && COL0 + N <= kC &&
                  K0 + KS <= kC / 16, "mma_block: fp16 blocks of 16 or 32 columns within a 64 x 64 product");
    using namespace cute::SM90::GMMA;
    float* d = acc.d + COL0 / 2;
    fence_regs<N / 2>(d);
    cute::warpgroup_arrive();
    const Smem rows{b.addr + COL0 * 128u, b.kstep, b.kmajor};
#pragma unroll
    for (int kk = 0; kk < KS; ++kk)
      rs_fma<typename Gmma<U>::template RSN<N, Major::K>>(a.r[K0 + kk], desc_k(rows, K0 + kk), d,
                                                          std::make_index_sequence<N / 2>{});
    cute::warpgroup_commit_batch();
  }
  // K K^T and Q K^T (k-step by k-step, the two products interleaved) as one group
  template <typename U>
  __device__ void mma_grams(Frag<kC>& kk, Frag<kC>& qk, const Smem& q, const Smem& k) const {
    using namespace cute::SM90::GMMA;
    fence_regs<kC / 2>(kk.d);
    fence_regs<kC / 2>(qk.d);
    cute::warpgroup_arrive();
#pragma unroll
    for (int s = 0; s < kK / 16; ++s) {
      const uint64_t dq = desc_k(q, s), dk = desc_k(k, s);
      ss_fma<typename Gmma<U>::template SS64<Major::K, Major::K>>(dk, dk, kk.d, std::make_index_sequence<32>{});
      ss_fma<typename Gmma<U>::template SS64<Major::K, Major::K>>(dq, dk, qk.d, std::make_index_sequence<32>{});
    }
    cute::warpgroup_commit_batch();
  }
  // acc += A B with A in shared memory too (K- or MN-major, as B), the KD / 16 wgmma as one group (the
  // chunk-parallel backward's products, chunk_gdr_grads_sm90.cuh)
  template <typename U, int KD, int N>
  __device__ void mma_ss(Frag<N>& acc, const Smem& a, const Smem& b) const {
    using namespace cute::SM90::GMMA;
    fence_regs<N / 2>(acc.d);
    cute::warpgroup_arrive();
#pragma unroll
    for (int kk = 0; kk < KD / 16; ++kk) {
      const uint64_t da = desc_k(a, kk), db = desc_k(b, kk);
      if constexpr (N == 128) {
        if (a.kmajor && b.kmajor) ss_fma<typename Gmma<U>::template SS128<Major::K, Major::K>>(da, db, acc.d, std::make_index_sequence<64>{});
        else if (a.kmajor) ss_fma<typename Gmma<U>::template SS128<Major::K, Major::MN>>(da, db, acc.d, std::make_index_sequence<64>{});
        else if (b.kmajor) ss_fma<typename Gmma<U>::template SS128<Major::MN, Major::K>>(da, db, acc.d, std::make_index_sequence<64>{});
        else ss_fma<typename Gmma<U>::template SS128<Major::MN, Major::MN>>(da, db, acc.d, std::make_index_sequence<64>{});
      } else {
        static_assert(N == 64, "N = 64 or 128");
        if (a.kmajor && b.kmajor) ss_fma<typename Gmma<U>::template SS64<Major::K, Major::K>>(da, db, acc.d, std::make_index_sequence<32>{});
        else if (a.kmajor) ss_fma<typename Gmma<U>::template SS64<Major::K, Major::MN>>(da, db, acc.d, std::make_index_sequence<32>{});
        else if (b.kmajor) ss_fma<typename Gmma<U>::template SS64<Major::MN, Major::K>>(da, db, acc.d, std::make_index_sequence<32>{});
        else ss_fma<typename Gmma<U>::template SS64<Major::MN, Major::MN>>(da, db, acc.d, std::make_index_sequence<32>{});
      }
    }
    cute::warpgroup_commit_batch();
  }
  // the 64-column block kb of a tile whose blocks are kstep apart
  template <typename U>
  static __device__ Smem col_block(const Smem& t, int kb) { return Smem{t.addr + kb * t.kstep, t.kstep, t.kmajor}; }
  // the accumulator layout's rows: thread t holds rows row(0) and row(0) + 8 (elements i with (i >> 1) & 1 = 0,
  // 1), the four lanes of a quad the same rows; rows[r] += its sum over the quad (one lane writes it)
  static __device__ void quad_rows_add(float s0, float s1, float* rows) {
    s0 += __shfl_xor_sync(0xffffffffu, s0, 1);
    s1 += __shfl_xor_sync(0xffffffffu, s1, 1);
    s0 += __shfl_xor_sync(0xffffffffu, s0, 2);
    s1 += __shfl_xor_sync(0xffffffffu, s1, 2);
    if ((tid_wg() & 3) == 0) {
      rows[row(0)] += s0;
      rows[row(0) + 8] += s1;
    }
  }
  // rows[r] += sum over c of f(r, c)
  template <int N>
  static __device__ void add_row_sums(const Frag<N>& f, float* rows) {
    float s[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < N / 2; ++i) s[(i >> 1) & 1] += f.d[i];
    quad_rows_add(s[0], s[1], rows);
  }
  // rows[r] += sum over c of f(r, c) t(r, c), t a [64, 64] block of U (B128 layout)
  template <typename U, int N>
  static __device__ void row_dot(const Frag<N>& f, const Smem& t, float* rows) {
    static_assert(N == kC, "one block");
    float s[2] = {0.f, 0.f};
#pragma unroll
    for (int h = 0; h < N / 2; h += N / 4) {   // half the thread's pairs of t at a time: loads first, then sums
      uint32_t u[N / 8];
#pragma unroll
      for (int i = 0; i < N / 4; i += 2) {
        const int c = col(h + i);
#if defined(GDN_LANE_SHIM)
        u[i / 2] = lane_shim::ld_shared_u32(t.addr + swz(row(h + i), c >> 3) + (c & 7) * 2);
#else
        asm volatile("ld.shared.u32 %0, [%1];" : "=r"(u[i / 2]) : "r"(t.addr + swz(row(h + i), c >> 3) + (c & 7) * 2)
                     : "memory");
#endif
      }
#pragma unroll
      for (int i = 0; i < N / 4; i += 2) {
        const float2 x = Gmma<U>::unpack(u[i / 2]);
        s[((h + i) >> 1) & 1] += f.d[h + i] * x.x + f.d[h + i + 1] * x.y;
      }
    }
    quad_rows_add(s[0], s[1], rows);
  }
  // rows[r] += f(r, r) of a 64 x 64 fragment: the lanes l with l % 4 == l / 8 hold the diagonal of their two
  // rows (elements 8 w + b and 8 w + 6 + b of warp w, b = (l / 4) % 2), selected by the warp (no dynamic
  // register index), one shared add a row
  static __device__ void add_diag(const Frag<kC>& f, float* rows) {
    const int t = tid_wg(), w = t >> 5, l = t & 31;
    if ((l & 3) != (l >> 3)) return;
    const bool b = (l >> 2) & 1;
    float d0 = 0.f, d1 = 0.f;
#pragma unroll
    for (int x = 0; x < 4; ++x)
      if (w == x) {
        d0 = b ? f.d[8 * x + 1] : f.d[8 * x];
        d1 = b ? f.d[8 * x + 7] : f.d[8 * x + 6];
      }
    rows[row(0)] += d0;
    rows[row(0) + 8] += d1;
  }
  // From for_rows (threads 0..63: two whole warps), r the thread's own row (for_rows's argument), x a vector of
  // the chunk's rows (8-byte aligned): its sum over rows c >= r (rev_sum), c < r (fwd_sum) or all (sum_rows).
  // Each warp scans all 64 rows, lane l holding rows 2 l, 2 l + 1 (a shuffle scan of the pair sums, log
  // steps), then takes row r's pair from its lane; no difference of two sums is formed (a pair's other row is
  // added, never subtracted).
  __device__ float sum_rows(const float* x) const {
    const int lane = tid_wg() & 31;
    const float2 v = *reinterpret_cast<const float2*>(x + 2 * lane);
    float s = v.x + v.y;
#pragma unroll
    for (int m = 16; m >= 1; m /= 2) s += __shfl_xor_sync(0xffffffffu, s, m);
    return s;
  }
  __device__ float rev_sum(const float* x, int r) const {
    const int lane = tid_wg() & 31;
    const float2 v = *reinterpret_cast<const float2*>(x + 2 * lane);
    float s = v.x + v.y;                                      // rows 2 lane .. 63, after the scan
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const float t = __shfl_down_sync(0xffffffffu, s, d);
      if (lane + d < 32) s += t;
    }
    float after = __shfl_down_sync(0xffffffffu, s, 1);      // rows 2 lane + 2 .. 63
    if (lane == 31) after = 0.f;
    const float a = __shfl_sync(0xffffffffu, after, r >> 1);
    return ((r & 1) ? x[r] : x[r] + x[r + 1]) + a;
  }
  __device__ float fwd_sum(const float* x, int r) const {
    const int lane = tid_wg() & 31;
    const float2 v = *reinterpret_cast<const float2*>(x + 2 * lane);
    float s = v.x + v.y;                                      // rows 0 .. 2 lane + 1, after the scan
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const float t = __shfl_up_sync(0xffffffffu, s, d);
      if (lane >= d) s += t;
    }
    float before = __shfl_up_sync(0xffffffffu, s, 1);       // rows 0 .. 2 lane - 1
    if (lane == 0) before = 0.f;
    const float b = __shfl_sync(0xffffffffu, before, r >> 1);
    return (r & 1) ? b + x[r - 1] : b;
  }
  // cols[c] += sum over r of f(r, c): over the warp's rows by shuffles (lanes of one lane % 4 hold the same
  // columns), then the four warps' partials (part [4][64]) in a fixed order; every thread of the warpgroup
  // calls it (two named barriers)
  __device__ void add_col_sums(const Frag<kC>& f, float* cols, float* part) const {
    float s[kC / 4];                        // columns 8 (j / 2) + 2 (lane % 4) + j % 2
#pragma unroll
    for (int j = 0; j < kC / 4; ++j) s[j] = f.d[2 * (j >> 1) * 2 + (j & 1)] + f.d[2 * (j >> 1) * 2 + 2 + (j & 1)];
#pragma unroll
    for (int m = 4; m < 32; m *= 2)
#pragma unroll
      for (int j = 0; j < kC / 4; ++j) s[j] += __shfl_xor_sync(0xffffffffu, s[j], m);
    const int wtid = tid_wg(), lane = wtid & 31;
    if (lane < 4)
#pragma unroll
      for (int j = 0; j < kC / 4; ++j) part[(wtid >> 5) * kC + 8 * (j >> 1) + 2 * lane + (j & 1)] = s[j];
    named_sync(bar);
    if (wtid < kC) cols[wtid] += ((part[wtid] + part[kC + wtid]) + part[2 * kC + wtid]) + part[3 * kC + wtid];
    named_sync(bar);
  }
  // wait for every issued group; the named accumulators and A operands are pinned past the wait (the
  // compiler neither reads an accumulator nor reuses an operand's registers before it)
  template <class... Tiles>
  __device__ void wait_mma(Tiles&... tiles) const {
    cute::warpgroup_wait<0>();
    (fence_tile(tiles), ...);
  }
  // wait for every issued group but the last (the newest may still run): acc's lo columns, which an
  // earlier group wrote, are pinned past the wait (its hi columns, the newest group's, are not touched)
  __device__ void wait_mma_lo(Frag<2 * kC>& acc) const {
    cute::warpgroup_wait<1>();
    fence_regs<kC / 2>(acc.d);
  }
  // wait for every issued group but the LEFT newest; the named tiles pinned past the wait (as wait_mma)
  template <int LEFT, class... Tiles>
  __device__ void wait_mma_left(Tiles&... tiles) const {
    cute::warpgroup_wait<LEFT>();
    (fence_tile(tiles), ...);
  }
  template <int N>
  static __device__ void fence_tile(Frag<N>& f) { fence_regs<N / 2>(f.d); }
  template <typename U, int KD>
  static __device__ void fence_tile(Op<U, KD>& o) { fence_regs<KD / 4>(&o.r[0][0]); }

  // a 64 x 64 fragment (32 floats in the accumulator layout) to a B128 block, rounded to U; with
  // transpose the block holds its transpose (stmatrix .trans); its columns 16 P0 .. 16 (P0 + NP) - 1 only
  // where NP < 4 (the warp's rows of those columns)
  template <typename U, int P0 = 0, int NP = 4>
  __device__ void stmatrix(const float* d, uint32_t dst, bool transpose) const {
    const int wtid = tid_wg(), lane = wtid & 31, w = wtid >> 5, mi = lane >> 3, j = lane & 7;
#pragma unroll
    for (int p = P0; p < P0 + NP; ++p) {
      uint32_t r[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int h = i & 1, a = 2 * p + (i >> 1);
        r[i] = Gmma<U>::pack(d[4 * a + 2 * h], d[4 * a + 2 * h + 1]);
      }
      const int h = mi & 1, a = 2 * p + (mi >> 1);
      if (transpose) {
        const uint32_t addr = dst + swz(8 * a + j, 2 * w + h);
#if defined(GDN_LANE_SHIM)
        lane_shim::stmatrix_x4(addr, r, true);
#else
        asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr),
                     "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
#endif
      } else {
        const uint32_t addr = dst + swz(16 * w + 8 * h + j, a);
#if defined(GDN_LANE_SHIM)
        lane_shim::stmatrix_x4(addr, r, false);
#else
        asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr),
                     "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
#endif
      }
    }
  }
  template <typename U, int N>
  __device__ void store(const Frag<N>& f, const Smem& dst, bool transpose) const {
    static_assert(N == kC, "64 x 64 tiles only");
    stmatrix<U>(f.d, dst.addr, transpose);
  }
  // the block [R0, R0 + NB) x [R0, R0 + NB) of a 64 x 64 fragment only (the rest of the tile as it was): the
  // warps holding its rows store its columns (a warp-uniform branch)
  template <typename U, int R0, int NB>
  __device__ void store_diag_block(const Frag<kC>& f, const Smem& dst, bool transpose) const {
    static_assert(R0 % 16 == 0 && NB % 16 == 0 && R0 + NB <= kC, "blocks of whole warps' 16 rows");
    const int w = tid_wg() >> 5;
    if (w >= R0 / 16 && w < (R0 + NB) / 16) stmatrix<U, R0 / 16, NB / 16>(f.d, dst.addr, transpose);
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
#if defined(GDN_LANE_SHIM)
      lane_shim::ldmatrix_x4_trans(r, addr);
#else
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                   : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
#endif
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

__device__ __forceinline__ void zero16(uint32_t addr) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(addr), "r"(0) : "memory");
}

// Rows [length, 64) of the block at `block` (shared address): 0; by the 128 threads of a warpgroup.
__device__ __forceinline__ void zero_rows_from(uint32_t block, int length, int wtid) {
  for (int e = wtid; e < (kC - length) * 8; e += 128) zero16(block + swz(length + e / 8, e % 8));
}

// ---- TMA descriptors (the driver's cuTensorMapEncodeTiled through the runtime: no libcuda link)
using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

Status encode_fn(const char* who, EncodeTiled* enc) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q{};
  const cudaError_t e = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &fn, cudaEnableDefault, &q);
  if (e != cudaSuccess || fn == nullptr) return cuda_error((std::string(who) + ": cuTensorMapEncodeTiled").c_str(), e);
  *enc = reinterpret_cast<EncodeTiled>(fn);
  return {};
}

// A contiguous 16-bit tensor of dims (innermost first) as a 128B-swizzled TMA map with box `box`.
Status encode_3d(EncodeTiled enc, CUtensorMap* m, CUtensorMapDataType ty, const void* base, const int64_t (&dims)[3],
                 const uint32_t (&box)[3], const char* who, const char* names) {
  if ((reinterpret_cast<std::uintptr_t>(base) & 15) != 0)
    return Status::invalid(std::string(who) + ": " + names + " must be 16-byte aligned (TMA)");
  const cuuint64_t d[3] = {static_cast<cuuint64_t>(dims[0]), static_cast<cuuint64_t>(dims[1]),
                           static_cast<cuuint64_t>(dims[2] > 0 ? dims[2] : 1)};
  const cuuint64_t strides[2] = {d[0] * 2, d[0] * d[1] * 2};
  const cuuint32_t b[3] = {box[0], box[1], box[2]}, estr[3] = {1, 1, 1};
  const CUresult r = enc(m, ty, 3, const_cast<void*>(base), d, strides, b, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
                         CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                         CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    return {StatusKind::kCudaError, std::string(who) + ": cuTensorMapEncodeTiled failed (" + std::to_string(r) + ")"};
  return {};
}

// A kernel's dynamic shared memory above the 48 KB default (every sm_90a kernel here: one CTA per SM).
template <class K>
Status allow_smem(K kernel, int bytes, const char* who) {
  const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  return e == cudaSuccess ? Status{} : cuda_error((std::string(who) + ": cudaFuncSetAttribute").c_str(), e);
}

// Whether every pointer is 16-byte aligned (bulk copies, int4 table rows).
inline bool aligned16(std::initializer_list<const void*> ptrs) {
  for (const void* p : ptrs)
    if ((reinterpret_cast<std::uintptr_t>(p) & 15) != 0) return false;
  return true;
}

// [rows, heads, cols] rows of a packed tensor (q, k, v, o, ...): boxes of 64 columns of one head, 64 rows.
Status encode_rows(EncodeTiled enc, CUtensorMap* m, CUtensorMapDataType ty, const void* base, int64_t cols,
                   int64_t heads, int64_t rows, const char* who, const char* names) {
  return encode_3d(enc, m, ty, base, {cols, heads, rows}, {64, 1, static_cast<uint32_t>(kC)}, who, names);
}

}  // namespace
}  // namespace sm90
}  // namespace gdn
