// The device side of chunk_gdr_fwd_sm90.cu (included there once): the warp-specialised kernel and its
// launch. The wgmma / ldmatrix / stmatrix policy of the tile program (chunk_gdr_sm90.cuh), the barrier and
// cluster helpers and the TMA descriptors are chunk_gdr_sm90_device.cuh's (shared with the backward).
#pragma once

#include "chunk_gdr_sm90_device.cuh"

namespace gdn {
namespace sm90 {
namespace {

constexpr int kThreads = 384;              // producer, prep, state warpgroups
constexpr int kStages = 3;                 // the TMA ring of (k, q, v) tiles: chunk j in stage j % 3
constexpr int kPrepBufs = 4;               // Ts, M, gates of chunk j in buffer j % 4 (both CTAs)
constexpr uint32_t kStageBytes = 5 * kBlock;                            // k, q: 2 blocks each; v: 1
// full[s]'s arrivals: every lane of the producer warp, after its own stores of the stage's gates (lane 0's
// with the stage's bytes). One arrival by lane 0 after a __syncwarp orders them too in PTX's memory model,
// but compute-sanitizer's racecheck does not follow that chain: with it, RAW hazards on graw (H200,
// 2026-12-04, bench/NOTES.md "The second H200 session"); with the per-lane arrivals, none. The prep's
// gates (one arrival on prepped[b] after the warpgroup's named barrier) still show the same kind (24288).
constexpr int kFullArrivals = 32;
// prepped[b]'s arrivals at the CTA that preps buffer b: one, thread 0's after the warpgroup's named barrier
// (what ran on the H200), or, in the build with -DGDN_SM90_PREP_ARRIVALS (setup.py:
// GDN_PACKED_SM90_PREP_ARRIVALS=1), every prep thread's after its own stores of the gates and the dead rows
// it zeroes, the pattern racecheck follows (the producer's full[s] above); that build waits for a GPU's
// racecheck before it becomes the default. At the peer: one, the peer prep's, with its bulk copy's bytes.
#if defined(GDN_SM90_PREP_ARRIVALS)
constexpr int kPrepArrivals = 128;
#else
constexpr int kPrepArrivals = 1;
#endif
static_assert(kPrepBufs % kVBlocks == 0, "buffer b is prepped by CTA b % kVBlocks");
// setmaxnreg moves registers only within the CTA's pool, the launch allocation: kThreads x 168 (65536 /
// 384 = 170, allocated in 8s), i.e. 3 x 168 = 504 a thread across the three warpgroups - not 65536 / 128
// = 512. 40 + 232 + 240 = 512 leaves one warp of prep or state retrying setmaxnreg.inc forever: the likely
// cause of the hang on the H200 (2026-12-04; bench/NOTES.md "The hang of the sm_90a forward").
constexpr int kRegsLaunch = (65536 / kThreads) / 8 * 8;
constexpr int kRegsProducer = 32, kRegsPrep = 232, kRegsState = 240;   // 32 + 232 + 240 = 504
static_assert(kRegsProducer + kRegsPrep + kRegsState <= (kThreads / 128) * kRegsLaunch, "setmaxnreg pool");
// the state-only kernel: its prep warpgroup idles at kRegsProducer, its state warpgroup takes the most
// setmaxnreg gives (its deferred output keeps O^T and U^T across the step boundary)
constexpr int kRegsStateOnly = 256;
static_assert(2 * kRegsProducer + kRegsStateOnly <= (kThreads / 128) * kRegsLaunch, "setmaxnreg pool");
static_assert(kRegsProducer < kRegsLaunch && kRegsPrep > kRegsLaunch && kRegsState > kRegsLaunch,
              "set_regs decreases the producer's registers and increases the consumers'");

struct alignas(16) GatesBuf : Gates {};    // a bulk copy's size and addresses are multiples of 16

// The forward's kernels (one CTA body, fwd_cta, for the state CTAs of all three):
//   kFused      chunk_gdr_fwd_sm90_kernel: each CTA of the cluster of 2 preps every other chunk for both
//   kStateOnly  chunk_gdr_fwd_sm90_state_kernel: Triton prep's outputs loaded from global memory
//   kSplit      chunk_gdr_fwd_sm90_split_kernel: a cluster of 4, the two state CTAs (ranks 0, 1) fed by two
//               prep CTAs (ranks 2, 3: prep_cta) over the cluster's shared memory; on GVA pairs (kPair = 2,
//               chunk_gdr_fwd_sm90_split_pair_kernel) a cluster of 8, each value head's two of each
enum class FwdKind { kFused, kStateOnly, kSplit };

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
  alignas(16) float graw[kStages][2][kC];   // per stage: g log2 e and beta of the chunk's live rows (formed
                                        // from the raw a, b with raw_gates; GateFn), 0 on the others; by the
                                        // producer, for the chunks prepped here
  uint64_t full[kStages], empty[kStages], prepped[kPrepBufs], prepfree[kPrepBufs];
};
constexpr uint32_t kPrepBytes = 2 * kBlock + sizeof(GatesBuf);          // what a prep sends its peer
// the state-only kernel's prep buffer, as it lands in each CTA: Ts (rank 0's multicast), M (rank 1's) and
// the gate rows (each CTA's own bulk copy)
constexpr uint32_t kPrepInBytes = 2 * kBlock + kPrepGateBytes;

// The split kernel's prep CTA (ranks 2 and 3 of its cluster of 4, rank 2 + r prepping the chunks j with
// j % 2 == r; in the pair form ranks 4 + 2 hh + r, for value head hh of the pair): two prep warpgroups, w = 0, 1, take its chunks in turn (chunk j: w = (j / 2) % 2, so prep
// buffer j % 4 = 2 w + r of the state CTAs is always the same warpgroup's), each with its own ring stage
// (the producer loads the warpgroup's next chunk once it released the stage) and two staging buffers of
// Ts, M and gates (by the parity of the warpgroup's chunk count), which its bulk copies send to both state CTAs.
constexpr int kPrepWgs = 2;
struct alignas(1024) PrepWg {
  uint8_t ts[2][kBlock];                // Ts [c][c'] (input dtype), by parity: the bulk copies' source
  uint8_t mm[2][kBlock];                // M [c][c']
  uint8_t at[kBlock];                   // A^T (the inverse's operand type)
  uint8_t dt[kBlock];                   // D_b^T
  GatesBuf gates[2];
  PrepScratch scratch;
};
struct alignas(1024) PrepShared {
  uint8_t kq[kPrepWgs][2][2 * kBlock];  // per prep warpgroup and K half: [K rows 0..63 ; Q rows 0..63] x 64 cols
  PrepWg wg[kPrepWgs];
  int32_t rows[kPrepWgs][2];            // the chunk's start row and length (the producer's)
  alignas(16) float graw[kPrepWgs][2][kC];   // g log2 e and beta of the chunk's live rows, 0 on the others
  uint64_t full[kPrepWgs], empty[kPrepWgs], prepfree[kPrepBufs];
};
// the prep CTA's producer and two prep warpgroups: 32 + 232 + 232 <= 504
static_assert(kRegsProducer + 2 * kRegsPrep <= (kThreads / 128) * kRegsLaunch, "setmaxnreg pool");
constexpr int kSmemBytes = (sizeof(Shared) > sizeof(PrepShared) ? sizeof(Shared) : sizeof(PrepShared)) + 1024;
static_assert(kSmemBytes <= 232448, "one CTA's shared memory on sm_90 (227 KB)");

// The 1024-byte aligned base of the dynamic shared memory (the same offset in every CTA of a launch), as
// the layout L: aligned by an offset from smem_raw (not through an integer), so the compiler keeps knowing
// that every access through it is to shared memory (ld.shared, not generic loads)
template <class L>
__device__ __forceinline__ L& smem_as() {
  extern __shared__ uint8_t smem_raw[];
  return *reinterpret_cast<L*>(smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023));
}

// ---- the kernel
// Rows [length, 64) of stage st's k, q and v tiles (TMA loads rows of the next sequences there): 0.
__device__ __forceinline__ void zero_dead_rows(Shared& sm, int st, int length, int wtid) {
  for (int half = 0; half < 2; ++half) {
    zero_rows_from(smem_u32(sm.kq[st][half]), length, wtid);
    zero_rows_from(smem_u32(sm.kq[st][half]) + kBlock, length, wtid);
  }
  zero_rows_from(smem_u32(sm.v[st]), length, wtid);
}

// A [64, 64] 16-bit tile of shared memory (128B-swizzled, as prep's stmatrix left Ts and M) to dst [64][64]
// row major (16-byte aligned: Prep's ts and mm lead its layout), by the 128 threads of a warpgroup: a
// thread half a row, 16 bytes at a time
template <typename T>
__device__ __forceinline__ void keep_tile(const uint8_t* tile, T* dst, int wtid) {
  const int r = wtid >> 1, x0 = (wtid & 1) * 4;
#pragma unroll
  for (int x = x0; x < x0 + 4; ++x)
    *reinterpret_cast<uint4*>(dst + r * kC + x * 8) = *reinterpret_cast<const uint4*>(tile + swz(r, x));
}

// Ts, M and gates of a prepped chunk (tiles ts, mm and gates of this CTA) into prep buffer b of cluster CTA
// `dst`, completing on its prepped[b] (one arrival with the bytes): the hand-over of the fused kernel's prep
// to its peer and of the split kernel's prep CTA to its state CTAs (whose layout, Shared, locates them)
__device__ __forceinline__ void send_prep(uint32_t dst, int b, const uint8_t* ts, const uint8_t* mm,
                                          const GatesBuf* gates) {
  Shared& sv = smem_as<Shared>();
  const uint32_t bar = peer_addr(&sv.prepped[b], dst);
  mbar_expect_tx_at(bar, kPrepBytes);
  copy_to_peer(peer_addr(sv.ts[b], dst), ts, kBlock, bar);
  copy_to_peer(peer_addr(sv.mm[b], dst), mm, kBlock, bar);
  copy_to_peer(peer_addr(&sv.gates[b], dst), gates, sizeof(GatesBuf), bar);
}

// The backward's Prep of chunk slot `slot` (a.kept_*) from a prepped chunk's tiles, gates and prep scratch,
// by a warpgroup's plain global stores
template <typename T>
__device__ __forceinline__ void keep_prep(const Args& a, int64_t slot, const uint8_t* ts, const uint8_t* mm,
                                          const GatesBuf& gates, const PrepScratch& s, int length, int wtid) {
  keep_tile(ts, static_cast<T*>(a.kept_ts) + slot * kC * kC, wtid);
  keep_tile(mm, static_cast<T*>(a.kept_mm) + slot * kC * kC, wtid);
  if (wtid < kC)
    keep_gate_row(gates, s, wtid, length, a.kept_gates + slot * kGateRows * kC, a.kept_rn + slot * 2 * kC,
                  a.kept_eg_last + slot);
}

// grid (kVBlocks, HV, N) in clusters of the kVBlocks CTAs of a (value head, sequence): CTA rank vb owns
// value columns vb * 64 .. vb * 64 + 63 and preps the chunks j with j % 2 == vb for both. Barriers (an
// elected thread arrives for its warpgroup after the warpgroup's named barrier; full's are the producer's lanes):
//   full[s]      the TMA of chunk j landed in stage s = j % 3: k, q (one K-half multicast by each CTA's
//                producer to both) and the CTA's v columns, and the producer's gates (32 arrivals, one
//                per producer lane, + all the bytes)
//   empty[s]     stage s read in both CTAs (the multicast writes both): by each CTA's state warpgroup,
//                whose step j follows its own prep's reads of the stage (2: one local, one remote; on GVA
//                pairs, chunk_gdr_fwd_sm90_pair_kernel's clusters of 4 (rank 2 hh + vb: value head hh of
//                the pair), all four share the stage, each loading one k / q block: 4)
//   prepped[b]   Ts, M, gates of chunk j in buffer b = j % 4: by this CTA's prep (kPrepArrivals), or by
//                the peer's (its arrival with the bytes of its bulk copy) (1)
//   prepfree[b]  buffer b read by both state warpgroups (at the CTA that preps it; 2)
// kStateOnly (chunk_gdr_fwd_sm90_state_kernel): no prep here; the prep warpgroup idles and the producer
// also loads Triton prep's outputs of each chunk slot (a.prep_*) into its prep buffer:
//   prepped[b]   Ts (multicast by rank 0's producer), M (by rank 1's) and the gate rows (each CTA's bulk
//                copy) landed, e^gam_last stored (1: the producer's arrival + the bytes)
//   prepfree[b]  buffer b read by both state warpgroups (the multicasts write both CTAs: at each CTA; 2)
// kSplit (chunk_gdr_fwd_sm90_split_kernel, ranks 0 and 1 of its cluster of 4): no prep here either (it
// idles); prep CTA 2 + b % 2 (pair form: 4 + 2 hh + b % 2; prep_cta) sends Ts, M and gates (e^gam_last
// with them) of buffer b:
//   prepped[b]   its bulk copies landed (1: its arrival + the bytes)
//   prepfree[b]  at that prep CTA: buffer b read by both state warpgroups (2)
// The state warpgroup of kStateOnly and kSplit stores a chunk's O a step later (state_step_deferred).
template <typename T, FwdKind kKind, int kPair = 1>
__device__ __forceinline__ void fwd_cta(const CUtensorMap& tm_q, const CUtensorMap& tm_k, const CUtensorMap& tm_v,
                                        const CUtensorMap& tm_o, const CUtensorMap& tm_ts, const CUtensorMap& tm_mm,
                                        const Args a) {
  using P = DevPolicy<T>;
  using TInv = __half;
  constexpr bool kPrepIn = kKind != FwdKind::kFused;            // no prep here: Ts, M, gates arrive
  constexpr bool kFromGlobal = kKind == FwdKind::kStateOnly;     // (by TMA from Triton prep's outputs)
  // the state CTAs that share each k / q stage (their multicasts write all of them): the two V-blocks of
  // the value head, or (kPair = 2, the fused or split kernel on GVA pairs) of both value heads of a qk head
  constexpr int kShare = kVBlocks * kPair;
  static_assert(kPair == 1 || kKind != FwdKind::kStateOnly, "value-head pairs: the fused and split kernels");
  Shared& sm = smem_as<Shared>();
  const int tid = threadIdx.x, wg = tid >> 7, wtid = tid & 127;
  const int rank = static_cast<int>(cluster_rank());           // blockIdx.x
  const int vb = rank % kVBlocks, hh = rank / kVBlocks;          // V-block, value head of the pair
  const uint32_t peer = rank ^ 1;
  const int64_t hv = kPair * static_cast<int64_t>(blockIdx.y) + hh, n = blockIdx.z, HV = a.HV;
  const int h = static_cast<int>(hv / (HV / a.H));
  const int64_t c0 = a.cu_chunks[n], c1 = a.cu_chunks[n + 1];
  const int nchunks = static_cast<int>(c1 - c0);
  if (tid == 0) {
    for (int i = 0; i < kStages; ++i) {
      mbar_init(&sm.full[i], kFullArrivals);      // the producer warp's lanes
      mbar_init(&sm.empty[i], kShare);            // the state warpgroups of the CTAs sharing the stage
    }
    for (int i = 0; i < kPrepBufs; ++i) {         // buffer i is prepped by CTA i % 2 (chunk j: j % 4, j % 2)
      mbar_init(&sm.prepped[i], !kPrepIn && i % kVBlocks == vb ? kPrepArrivals : 1);
      mbar_init(&sm.prepfree[i], 2);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  if constexpr (kPrepIn) {                        // the state's dummy B tile before its first chunk: 0
    for (int i = tid; i < static_cast<int>(kBlock / 16); i += kThreads)
      reinterpret_cast<uint4*>(sm.at)[i] = make_uint4(0, 0, 0, 0);
    fence_async_smem();
  }
  cluster_sync();                                 // both CTAs' barriers initialised before any arrival

  if (wg == 0) {                                  // ---- producer: warp 0 (the TMA from its lane 0)
    set_regs<kRegsProducer, kRegsLaunch>();
    if (wtid < 32) {
      const GateFn gate = gate_fn(a, hv);
      const int4* table = reinterpret_cast<const int4*>(a.table) + c0;   // rows (seq, idx, start, length)
      int4 next = nchunks > 0 ? __ldg(table) : make_int4(0, 0, 0, 0);
      // kFromGlobal: e^gam_last of the next chunk slot (lane 0), in flight as the table row is
      float next_eg = kFromGlobal && wtid == 0 && nchunks > 0 ? __ldg(a.prep_eg_last + c0 * HV + hv) : 0.f;
      for (int it = 0; it < nchunks; ++it) {
        const int st = it % kStages;
        const int32_t start = next.z, length = next.w;
        const float eg = next_eg;
        if (it + 1 < nchunks) {                   // the next chunk's row, in flight during this one
          next = __ldg(table + it + 1);
          if (kFromGlobal && wtid == 0) next_eg = __ldg(a.prep_eg_last + (c0 + it + 1) * HV + hv);
        }
        // g, beta (or a, b) of the lane's two rows, for the chunks prepped here; 0 on the others (kPrepIn: none)
        const bool mine = !kPrepIn && it % kVBlocks == vb;
        float x[2], y[2];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int i = wtid + 32 * j;
          const int64_t row = static_cast<int64_t>(start) + i;
          const bool live = mine && i < length;
          x[j] = live ? a.g[row * HV + hv] : 0.f;
          y[j] = live ? a.beta[row * HV + hv] : 0.f;
        }
        if (it >= kStages)
          mbar_wait(&sm.empty[st], ((it / kStages) + 1) & 1,
                    "fwd producer, empty[it % 3]: the k/q/v stage released by both CTAs' state", it);
        if constexpr (!kPrepIn) {
#pragma unroll
          for (int j = 0; j < 2; ++j) {            // the gates (from raw a, b with raw_gates), 0 on dead rows
            const int i = wtid + 32 * j;
            float g, b;
            gate(x[j], y[j], &g, &b);
            sm.graw[st][0][i] = mine && i < length ? g : 0.f;
            sm.graw[st][1][i] = mine && i < length ? b : 0.f;
          }
        }
        if (wtid == 0) {
          sm.rows[st][0] = start;
          sm.rows[st][1] = length;
        }
        if (wtid != 0) mbar_arrive(&sm.full[st]);   // each lane releases its own gate stores (kFullArrivals)
        if (wtid == 0) {                          // k, q: this CTA's share to all kShare CTAs (multicast); its v
          constexpr uint64_t hint = static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_NORMAL);
          constexpr uint16_t both = (1u << kVBlocks) - 1, share = (1u << kShare) - 1;
          mbar_expect_tx(&sm.full[st], kStageBytes);   // all of the stage: the others' blocks arrive here too
          // the stage's four [64, 64] blocks (k and q, K-halves 0 and 1): each CTA its K-half vb of both, or
          // on pairs (4 CTAs) one block, k's (hh = 0) or q's (hh = 1) K-half vb
          if constexpr (kShare == kVBlocks) {
            cute::SM90_TMA_LOAD_MULTICAST_3D::copy(&tm_k, &sm.full[st], share, hint, sm.kq[st][vb], vb * 64, h, start);
            cute::SM90_TMA_LOAD_MULTICAST_3D::copy(&tm_q, &sm.full[st], share, hint, sm.kq[st][vb] + kBlock, vb * 64,
                                                   h, start);
          } else {
            cute::SM90_TMA_LOAD_MULTICAST_3D::copy(hh == 0 ? &tm_k : &tm_q, &sm.full[st], share, hint,
                                                   sm.kq[st][vb] + hh * kBlock, vb * 64, h, start);
          }
          cute::SM90_TMA_LOAD_3D::copy(&tm_v, &sm.full[st], hint, sm.v[st], vb * kVB, static_cast<int>(hv), start);
          if constexpr (kFromGlobal) {            // Triton prep's outputs of the slot into prep buffer it % 4,
            const int b = it % kPrepBufs;         // once both CTAs' state read it (chunk it - 4)
            const int slot = static_cast<int>((c0 + it) * HV + hv);
            if (it >= kPrepBufs)
              mbar_wait(&sm.prepfree[b], ((it / kPrepBufs) + 1) & 1,
                        "fwd state-only producer, prepfree[it % 4]: the prep buffer read by both CTAs' state", it);
            sm.gates[b].eg_last = eg;             // (released by the arrival below)
            mbar_expect_tx(&sm.prepped[b], kPrepInBytes);   // the peer's multicast lands here too
            cute::SM90_TMA_LOAD_MULTICAST_3D::copy(vb == 0 ? &tm_ts : &tm_mm, &sm.prepped[b], both, hint,
                                                   vb == 0 ? sm.ts[b] : sm.mm[b], 0, 0, slot);
            bulk_load(&sm.gates[b], a.prep_gates + static_cast<int64_t>(slot) * kGateRows * kC, kPrepGateBytes,
                      &sm.prepped[b]);
          }
        }
      }
    }
  } else if (wg == 1 && kPrepIn) {                // ---- (the state-only and split kernels: no prep here)
    set_regs<kRegsProducer, kRegsLaunch>();
  } else if (wg == 1) {                           // ---- prep of this CTA's chunks, for both CTAs
    set_regs<kRegsPrep, kRegsLaunch>();
    P p{1};
    const typename P::Smem at{smem_u32(sm.at), 0, true}, dt{smem_u32(sm.dt), 0, true};
    // a sequence's last chunk (the only one that can be partial: kLast) apart, so the loop of the others
    // holds no dead-row work
    auto prep_one = [&](int it, auto last) {
      constexpr bool kLast = decltype(last)::value;
      const int st = it % kStages, b = it % kPrepBufs;
      // this prep sees every other chunk, so full[st]'s phase before chunk it's (chunk it - 3's, the peer
      // prep's) was never waited here: a parity wait while that phase is still open would return at once.
      // The producer's wait first (chunk it - 3 released by both CTAs' state, so its phase completed):
      // full[st] is then in chunk it's phase or past it, where the parity wait is exact
      if (it >= kStages)
        mbar_wait(&sm.empty[st], ((it / kStages) + 1) & 1, "fwd prep, empty[it % 3]: chunk it - 3's stage released",
                  it);
      mbar_wait(&sm.full[st], (it / kStages) & 1, "fwd prep, full[it % 3]: the TMA of k/q/v landed", it);
      if (it >= kPrepBufs)
        mbar_wait(&sm.prepfree[b], ((it / kPrepBufs) + 1) & 1,
                  "fwd prep, prepfree[it % 4]: the prep buffer read by both CTAs' state", it);
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
      if (kPrepArrivals > 1 || wtid == 0) mbar_arrive(&sm.prepped[b]);     // (kPrepArrivals of them)
      if (wtid == 0) send_prep(peer, b, sm.ts[b], sm.mm[b], &sm.gates[b]);
      // the backward's Prep of this chunk slot by plain global stores, after the hand-over (whose
      // arrivals would wait for them) and long before prep's next fence; buffer b is not prepped again
      // before both state warpgroups have released it (prepfree[b]), after these reads
      if (a.kept_ts) keep_prep<T>(a, (c0 + it) * HV + hv, sm.ts[b], sm.mm[b], sm.gates[b], sm.scratch, length, wtid);
    };
    int it = vb;
    for (; it + 1 < nchunks; it += kVBlocks) prep_one(it, std::false_type{});
    if (it == nchunks - 1) prep_one(it, std::true_type{});
  } else {                                        // ---- state: S^T of the CTA's 64 value columns in registers
    set_regs<kPrepIn ? kRegsStateOnly : kRegsState, kRegsLaunch>();
    P p{2};
    typename P::template Frag<kK> S;
    const float* h0 = a.h0 ? a.h0 + (n * HV + hv) * kK * kV : nullptr;
    P::for_each(S, [&](int r, int c, float& x) { x = h0 ? h0[c * kV + vb * kVB + r] : 0.f; });
    T* o = static_cast<T*>(a.o);
    int held = -1;                                // a stage whose O tile a TMA store may still be reading
    auto release_held = [&]() {                   // (thread 0) the stage back to the producer once read
      if (held >= 0) {
        asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
        mbar_arrive(&sm.empty[held]);           // every sharing CTA's stage (k, q land in all by multicast)
        mbar_arrive_at(peer_addr(&sm.empty[held], peer));
        if constexpr (kShare > kVBlocks) {      // (pairs: the other value head's two CTAs too)
          mbar_arrive_at(peer_addr(&sm.empty[held], rank ^ 2));
          mbar_arrive_at(peer_addr(&sm.empty[held], rank ^ 3));
        }
        held = -1;
      }
    };
    // O [c][v] of a chunk from its fragment into its consumed v tile (stage st), then to o: one TMA store of
    // a whole chunk (the box is the chunk's rows; rows past T, a middle chunk's only dead rows, are
    // clipped), or a partial one's live rows one by one (the next sequence's follow them). Every warp has
    // read the stage's V^T (ldmatrix) before the fragment's last group was issued.
    auto store_o = [&](const float* frag, int st, int64_t start, int length) {
      const uint32_t ostage = smem_u32(sm.v[st]);
      p.template stmatrix<T>(frag, ostage, true);
      fence_async_smem();                         // for the TMA store, and before the next TMA load into it
      named_sync(p.bar);
      if (length == kC) {
        if (wtid == 0) {
          cute::SM90_TMA_STORE_3D::copy(&tm_o, sm.v[st], vb * kVB, static_cast<int>(hv), static_cast<int>(start));
          asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        }
        return;
      }
      store_live_rows(ostage, o + (start * HV + hv) * kV + vb * kVB, HV * kV, length, wtid);
      named_sync(p.bar);                          // every thread's reads of the tile done
    };
    // the state-only kernel's chunk j - 1 finished in step j (state_step_deferred): its O^T and U^T (the
    // next step's first product), the A operand of its S update (in flight across the step boundary), and
    // where its O goes
    typename P::template Frag<kC> od{};
    typename P::template Op<T, kC> ud{}, wd{};          // (ud = 0 before the first chunk)
    int prev_st = 0, prev_b = 0, prev_length = 0;
    int64_t prev_start = 0;
    auto release_prep = [&](int b, bool mine) {   // (thread 0) prep buffer b read by this state warpgroup
      if constexpr (kKind == FwdKind::kSplit) {   // at the prep CTA that fills it (its layout's barrier)
        mbar_arrive_at(peer_addr(&smem_as<PrepShared>().prepfree[b], kShare + kVBlocks * hh + b % kVBlocks));
        return;
      }
      if (kPrepIn || mine) mbar_arrive(&sm.prepfree[b]);
      if (kPrepIn || !mine) mbar_arrive_at(peer_addr(&sm.prepfree[b], peer));
    };
    // a sequence's last chunk (the only one that can be partial: kLast) apart, as in prep
    auto step = [&](int it, auto last) {
      constexpr bool kLast = decltype(last)::value;
      const int st = it % kStages, b = it % kPrepBufs;
      const bool mine = it % kVBlocks == vb;      // prepped here (else by the peer)
      if (wtid == 0) release_held();
      mbar_wait(&sm.full[st], (it / kStages) & 1, "fwd state, full[it % 3]: the TMA of k/q/v landed", it);
      mbar_wait(&sm.prepped[b], (it / kPrepBufs) & 1,      // (filled by the peer's bulk copy when !mine)
                mine ? "fwd state, prepped[it % 4]: Ts/M/gates from this CTA's prep"
                     : "fwd state, prepped[it % 4]: Ts/M/gates by the peer prep's bulk copy", it);
      const int64_t start = sm.rows[st][0];
      const int length = sm.rows[st][1];
      if constexpr (kLast) {
        if (length < kC && (kPrepIn || !mine)) {  // (the peer's prep zeroed its own copy only)
          zero_dead_rows(sm, st, length, wtid);
          p.sync();
        }
      }
      const uint32_t kq = smem_u32(sm.kq[st][0]);
      const typename P::Smem k_b{kq, 2 * kBlock, true}, q_b{kq + kBlock, 2 * kBlock, true};
      const typename P::Smem k_mn{kq, 2 * kBlock, false};
      const typename P::Smem ts{smem_u32(sm.ts[b]), 0, true}, m{smem_u32(sm.mm[b]), 0, true};
      const typename P::Smem v{smem_u32(sm.v[st]), 0, true};
      if constexpr (kPrepIn) {
        // chunk it - 1's O stored here, once its group has run; its stage is released at the next step
        // (its TMA store read), its prep buffer now (U^T M^T, the last read of M, done)
        // (the first chunk: sm.at, zeroed at the start and never written in this kernel)
        const typename P::Smem m_prev{smem_u32(it > 0 ? sm.mm[prev_b] : sm.at), 0, true};
        state_step_deferred<P, T>(p, S, od, ud, wd, it > 0, m_prev, sm.gates[b], k_b, q_b, k_mn, ts, v,
                                  [&](typename P::template Frag<kC>& prev) {     // (a middle chunk)
                                    store_o(prev.d, prev_st, prev_start, kC);
                                    if (wtid == 0) {
                                      release_prep(prev_b, false);
                                      held = prev_st;
                                    }
                                  });
        prev_st = st, prev_b = b, prev_start = start, prev_length = length;
        return;
      }
      state_step<P, T>(p, S, sm.gates[b], k_b, q_b, k_mn, ts, m, v, [&](typename P::template Frag<2 * kC>& acc) {
        store_o(acc.d + kC / 2, st, start, kLast ? length : kC);
      });
      if (wtid == 0) {
        release_prep(b, mine);
        held = st;                                // released at the next chunk (or below), once read
        if (kLast && length < kC) release_held();   // (no store in flight: wait_group.read returns at once)
      }
    };
    // the state-only kernel: the last chunk's O (S final too)
    auto flush = [&]() {
      if constexpr (kPrepIn) {
        p.wait_mma(S, wd);                        // (every path: S read below only after a wait)
        if (nchunks > 0) {
          state_step_last<P, T>(p, S, od, ud, wd, typename P::Smem{smem_u32(sm.mm[prev_b]), 0, true});
          if (wtid == 0) release_held();          // (chunk nchunks - 2's stage: its store read)
          store_o(od.d, prev_st, prev_start, prev_length);
          if (wtid == 0) {
            release_prep(prev_b, false);
            held = prev_st;
            if (prev_length < kC) release_held();
          }
        }
      }
    };
    // the chunks segment by segment (one segment unless the backward keeps their entering states: then
    // S^T is stored as each one starts, and the final state for the empty ones)
    const int segs = a.kept_entering ? a.kept_segments : 1, per = segment_slots(nchunks, segs);
    auto keep_entering = [&](int s) {
      if constexpr (kPrepIn) p.wait_mma(S, wd);           // S's update done
      if (!a.kept_entering) return;
      store_state<P>(S, a.kept_entering, (n * segs + s) * HV + hv, vb);
    };
    int it = 0, s = 0;
    for (; s < segs && s * per < nchunks; ++s) {
      keep_entering(s);
      const int end = s * per + per < nchunks ? s * per + per : nchunks - 1;    // (the last chunk: below)
      for (; it < end; ++it) step(it, std::false_type{});
    }
    if (nchunks > 0) step(nchunks - 1, std::true_type{});
    flush();
    for (; s < segs; ++s) keep_entering(s);
    if (wtid == 0) {
      release_held();
      asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");   // the last stores done before exit
    }
    if (a.ht) store_state<P>(S, a.ht, n * HV + hv, vb);
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

// Rows [length, 64) of a prep warpgroup's k and q tiles: 0 (as zero_dead_rows).
__device__ __forceinline__ void zero_dead_kq(PrepShared& ps, int w, int length, int wtid) {
  for (int half = 0; half < 2; ++half) {
    zero_rows_from(smem_u32(ps.kq[w][half]), length, wtid);
    zero_rows_from(smem_u32(ps.kq[w][half]) + kBlock, length, wtid);
  }
}

// The split kernel's prep CTA (cluster rank 2 kPair + 2 hh + r): the prep of chunks j with j % 2 == r of
// value head hh's sequence for its two state CTAs (ranks 2 hh, 2 hh + 1; PrepShared). Barriers:
//   full[w]      chunk j of prep warpgroup w landed in its stage: k, q (both K-halves, this CTA's own TMA)
//                and the producer's gates (32 arrivals, one per producer lane, + the bytes)
//   empty[w]     stage w read by prep warpgroup w (1)
//   prepfree[b]  the state CTAs' prep buffer b (= 2 w + r) read by both of their state warpgroups (2)
// and at the state CTAs, prepped[b] (fwd_cta, kSplit).
template <typename T, int kPair>
__device__ __forceinline__ void prep_cta(const CUtensorMap& tm_q, const CUtensorMap& tm_k, const Args a) {
  using P = DevPolicy<T>;
  using TInv = __half;
  PrepShared& ps = smem_as<PrepShared>();
  const int tid = threadIdx.x, wg = tid >> 7, wtid = tid & 127;
  const int p = static_cast<int>(cluster_rank()) - kVBlocks * kPair;    // among the prep CTAs
  const int r = p % kVBlocks, hh = p / kVBlocks;                          // its chunks' parity, its value head
  const int64_t hv = kPair * static_cast<int64_t>(blockIdx.y) + hh, n = blockIdx.z, HV = a.HV;
  const int h = static_cast<int>(hv / (HV / a.H));
  const int64_t c0 = a.cu_chunks[n], c1 = a.cu_chunks[n + 1];
  const int nchunks = static_cast<int>(c1 - c0);
  if (tid == 0) {
    for (int w = 0; w < kPrepWgs; ++w) {
      mbar_init(&ps.full[w], kFullArrivals);
      mbar_init(&ps.empty[w], 1);
    }
    for (int i = 0; i < kPrepBufs; ++i) mbar_init(&ps.prepfree[i], kVBlocks);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  cluster_sync();                                 // every CTA's barriers initialised before any arrival

  if (wg == 0) {                                  // ---- producer: warp 0 (the TMA from its lane 0)
    set_regs<kRegsProducer, kRegsLaunch>();
    if (wtid < 32) {
      const GateFn gate = gate_fn(a, hv);
      const int4* table = reinterpret_cast<const int4*>(a.table) + c0;   // rows (seq, idx, start, length)
      int4 next = r < nchunks ? __ldg(table + r) : make_int4(0, 0, 0, 0);
      for (int i = 0, j = r; j < nchunks; ++i, j += kVBlocks) {   // this CTA's i-th chunk, j
        const int w = i % kPrepWgs, u = i / kPrepWgs;
        const int32_t start = next.z, length = next.w;
        if (j + kVBlocks < nchunks) next = __ldg(table + j + kVBlocks);   // in flight during this one
        float x[2], y[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int c = wtid + 32 * e;
          const int64_t t = static_cast<int64_t>(start) + c;
          x[e] = c < length ? a.g[t * HV + hv] : 0.f;
          y[e] = c < length ? a.beta[t * HV + hv] : 0.f;
        }
        if (u > 0) mbar_wait(&ps.empty[w], (u + 1) & 1, "split producer, empty[w]: the stage read by prep w", j);
#pragma unroll
        for (int e = 0; e < 2; ++e) {              // the gates (from raw a, b with raw_gates), 0 on dead rows
          const int c = wtid + 32 * e;
          float gg, bb;
          gate(x[e], y[e], &gg, &bb);
          ps.graw[w][0][c] = c < length ? gg : 0.f;
          ps.graw[w][1][c] = c < length ? bb : 0.f;
        }
        if (wtid == 0) {
          ps.rows[w][0] = start;
          ps.rows[w][1] = length;
        }
        if (wtid != 0) mbar_arrive(&ps.full[w]);  // each lane releases its own gate stores (kFullArrivals)
        if (wtid == 0) {                          // both K-halves of k and q (rows past T arrive as 0)
          constexpr uint64_t hint = static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_NORMAL);
          mbar_expect_tx(&ps.full[w], 4 * kBlock);
          for (int half = 0; half < 2; ++half) {
            cute::SM90_TMA_LOAD_3D::copy(&tm_k, &ps.full[w], hint, ps.kq[w][half], half * 64, h, start);
            cute::SM90_TMA_LOAD_3D::copy(&tm_q, &ps.full[w], hint, ps.kq[w][half] + kBlock, half * 64, h, start);
          }
        }
      }
    }
  } else {                                        // ---- prep warpgroups w = wg - 1
    set_regs<kRegsPrep, kRegsLaunch>();
    const int w = wg - 1;
    P p{wg};
    PrepWg& x = ps.wg[w];
    const typename P::Smem at{smem_u32(x.at), 0, true}, dt{smem_u32(x.dt), 0, true};
    const typename P::Smem k_t{smem_u32(ps.kq[w][0]), 2 * kBlock, true};
    const typename P::Smem q_t{smem_u32(ps.kq[w][0]) + kBlock, 2 * kBlock, true};
    // a sequence's last chunk (the only one that can be partial: kLast) apart, as in fwd_cta
    auto prep_one = [&](int j, int u, auto last) {
      constexpr bool kLast = decltype(last)::value;
      const int sb = u & 1, b = j % kPrepBufs;
      mbar_wait(&ps.full[w], u & 1, "split prep, full[w]: the TMA of k/q landed", j);
      const int length = ps.rows[w][1];
      if constexpr (kLast) {
        if (length < kC) {                        // (the Gram products read the zeroed rows: fenced)
          zero_dead_kq(ps, w, length, wtid);
          p.sync();
        }
      }
      const typename P::Smem ts{smem_u32(x.ts[sb]), 0, true}, m{smem_u32(x.mm[sb]), 0, true};
      // (staging sb was last sent for chunk j - 8: its copies read it before the state CTAs released
      // buffer b for chunk j - 8, which thread 0 waited for before sending chunk j - 4, before the first
      // named barrier of this prep, which precedes its first write of the staging)
      prep_chunk<P, T, TInv>(p, q_t, k_t, x.scratch, ps.graw[w][0], ps.graw[w][1], length, a.scale, a.l2norm,
                             x.gates[sb], at, at, dt, dt, ts, m);
      p.sync();                                   // (its fence: Ts, M, gates visible to the async proxy)
      if (wtid == 0) {
        mbar_arrive(&ps.empty[w]);                // the stage back to the producer (every read of it done)
        if (j >= kPrepBufs)
          mbar_wait(&ps.prepfree[b], ((j / kPrepBufs) + 1) & 1,
                    "split prep, prepfree[j % 4]: the state CTAs' buffer read by both state warpgroups", j);
        for (uint32_t dst = kVBlocks * hh; dst < kVBlocks * (hh + 1); ++dst)   // to both state CTAs' buffer b
          send_prep(dst, b, x.ts[sb], x.mm[sb], &x.gates[sb]);
      }
      if (a.kept_ts)                              // the backward's Prep of this chunk slot (as fwd_cta's prep)
        keep_prep<T>(a, (c0 + j) * HV + hv, x.ts[sb], x.mm[sb], x.gates[sb], x.scratch, length, wtid);
    };
    int j = r + kVBlocks * w, u = 0;              // this warpgroup's chunks: every 4th from r + 2 w
    for (; j + 1 < nchunks; j += kVBlocks * kPrepWgs, ++u) prep_one(j, u, std::false_type{});
    if (j == nchunks - 1) prep_one(j, u, std::true_type{});
  }
  cluster_sync();          // no CTA leaves while another may still copy to or arrive on its barriers
}

// The fused kernel (its prep warpgroup preps every chunk), the state-only kernel (on Triton prep's outputs)
// and the split kernel (state CTAs and prep CTAs in a cluster of 4: FwdKind)
template <typename T>
__global__ void __cluster_dims__(kVBlocks, 1, 1) __launch_bounds__(kThreads, 1)
chunk_gdr_fwd_sm90_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                          const __grid_constant__ CUtensorMap tm_v, const __grid_constant__ CUtensorMap tm_o,
                          const Args a) {
  fwd_cta<T, FwdKind::kFused>(tm_q, tm_k, tm_v, tm_o, tm_q, tm_q, a);
}
// the same on GVA pairs: a cluster of 4 a (pair, sequence), ranks 2 hh + vb value head 2 y + hh's V-block vb,
// the four sharing every k / q stage (each loading one of its four blocks); prep within a value head's two
template <typename T>
__global__ void __cluster_dims__(2 * kVBlocks, 1, 1) __launch_bounds__(kThreads, 1)
chunk_gdr_fwd_sm90_pair_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                               const __grid_constant__ CUtensorMap tm_v, const __grid_constant__ CUtensorMap tm_o,
                               const Args a) {
  fwd_cta<T, FwdKind::kFused, 2>(tm_q, tm_k, tm_v, tm_o, tm_q, tm_q, a);
}
template <typename T, int kPair>
__device__ __forceinline__ void split_cta(const CUtensorMap& tm_q, const CUtensorMap& tm_k, const CUtensorMap& tm_v,
                                          const CUtensorMap& tm_o, const Args& a) {
  if (cluster_rank() < kVBlocks * kPair) fwd_cta<T, FwdKind::kSplit, kPair>(tm_q, tm_k, tm_v, tm_o, tm_q, tm_q, a);
  else prep_cta<T, kPair>(tm_q, tm_k, a);
}
// the split kernel, a cluster of 4 per (value head, sequence): ranks 0, 1 state, 2, 3 prep; and on GVA pairs
// (value heads 2 y and 2 y + 1 of one qk head), a cluster of 8 per (pair, sequence): ranks 2 hh + vb the
// state CTAs of value head 2 y + hh (all four sharing each k / q stage: one block loaded by each), 4 + 2 hh + r
// its prep CTAs
template <typename T>
__global__ void __cluster_dims__(2 * kVBlocks, 1, 1) __launch_bounds__(kThreads, 1)
chunk_gdr_fwd_sm90_split_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                                const __grid_constant__ CUtensorMap tm_v, const __grid_constant__ CUtensorMap tm_o,
                                const Args a) {
  split_cta<T, 1>(tm_q, tm_k, tm_v, tm_o, a);
}
template <typename T>
__global__ void __cluster_dims__(4 * kVBlocks, 1, 1) __launch_bounds__(kThreads, 1)
chunk_gdr_fwd_sm90_split_pair_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                                     const __grid_constant__ CUtensorMap tm_v, const __grid_constant__ CUtensorMap tm_o,
                                     const Args a) {
  split_cta<T, 2>(tm_q, tm_k, tm_v, tm_o, a);
}
template <typename T>
__global__ void __cluster_dims__(kVBlocks, 1, 1) __launch_bounds__(kThreads, 1)
chunk_gdr_fwd_sm90_state_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                                const __grid_constant__ CUtensorMap tm_v, const __grid_constant__ CUtensorMap tm_o,
                                const __grid_constant__ CUtensorMap tm_ts, const __grid_constant__ CUtensorMap tm_mm,
                                const Args a) {
  fwd_cta<T, FwdKind::kStateOnly>(tm_q, tm_k, tm_v, tm_o, tm_ts, tm_mm, a);
}

template <typename T>
Status launch_t(const Args& a, CUtensorMapDataType ty, cudaStream_t stream) {
  constexpr const char* who = "chunk_gdr_fwd_sm90";
  constexpr const char* names = "q, k, v, o";
  EncodeTiled enc = nullptr;
  CUtensorMap tq, tk, tv, to;
  Status st = encode_fn(who, &enc);
  if (st.ok()) st = encode_rows(enc, &tq, ty, a.q, kK, a.H, a.T, who, names);
  if (st.ok()) st = encode_rows(enc, &tk, ty, a.k, kK, a.H, a.T, who, names);
  if (st.ok()) st = encode_rows(enc, &tv, ty, a.v, kV, a.HV, a.T, who, names);
  if (st.ok()) st = encode_rows(enc, &to, ty, a.o, kV, a.HV, a.T, who, names);
  if (!st.ok()) return st;
  if (a.N > 65535 || a.HV > 65535)
    return Status::invalid("chunk_gdr_fwd_sm90: at most 65535 sequences and value heads");
  const dim3 grid(kVBlocks, static_cast<unsigned>(a.HV), static_cast<unsigned>(a.N));
  if (a.split) {       // state CTAs and prep CTAs, a cluster of 4 a (head, sequence), or of 8 a (GVA pair, sequence)
    const bool pairs = a.pairs;                   // (gdn_packed/cuda/chunk.py: where its clusters of 8 fit)
    auto kernel = pairs ? chunk_gdr_fwd_sm90_split_pair_kernel<T> : chunk_gdr_fwd_sm90_split_kernel<T>;
    st = allow_smem(kernel, kSmemBytes, who);
    if (!st.ok()) return st;
    const int per = pairs ? 2 : 1;
    kernel<<<dim3(2 * kVBlocks * per, grid.y / per, grid.z), kThreads, kSmemBytes, stream>>>(tq, tk, tv, to, a);
    return launch_status("chunk_gdr_fwd_sm90 (split)");
  }
  if (a.prep_ts) {                                // the state-only kernel on Triton prep's Ts, M
    const uint32_t blk[3] = {kC, kC, 1};
    const int64_t slots = a.NC * a.HV;
    CUtensorMap tts, tmm;
    st = encode_3d(enc, &tts, ty, a.prep_ts, {kC, kC, slots}, blk, who, "prep_ts, prep_mm");
    if (st.ok()) st = encode_3d(enc, &tmm, ty, a.prep_mm, {kC, kC, slots}, blk, who, "prep_ts, prep_mm");
    if (!st.ok()) return st;
    auto kernel = chunk_gdr_fwd_sm90_state_kernel<T>;
    st = allow_smem(kernel, kSmemBytes, who);
    if (!st.ok()) return st;
    kernel<<<grid, kThreads, kSmemBytes, stream>>>(tq, tk, tv, to, tts, tmm, a);
    return launch_status("chunk_gdr_fwd_sm90 (state-only)");
  }
  auto kernel = a.pairs ? chunk_gdr_fwd_sm90_pair_kernel<T> : chunk_gdr_fwd_sm90_kernel<T>;
  st = allow_smem(kernel, kSmemBytes, who);
  if (!st.ok()) return st;
  const int per = a.pairs ? 2 : 1;                // (pairs: a cluster of 4 a (GVA pair, sequence))
  kernel<<<dim3(kVBlocks * per, grid.y / per, grid.z), kThreads, kSmemBytes, stream>>>(tq, tk, tv, to, a);
  return launch_status("chunk_gdr_fwd_sm90");
}

// The split kernel's clusters (of 4, or with pairs of 8) that can be resident at once on `device` (a
// cluster's CTAs share one GPC, whose SM count need not be a multiple of the cluster's: fewer than SMs / 4
// (/ 8) where some is not), or -1 where the runtime cannot say (gdn_packed/cuda/chunk.py:forward_kernel
// then takes SMs / 4 (/ 8))
template <class K>
int resident_clusters(K kernel, int size) {
  if (!allow_smem(kernel, kSmemBytes, "chunk_gdr_fwd_sm90_split_clusters").ok()) return -1;   // (error cleared)
  cudaLaunchAttribute cluster{};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = size;
  cluster.val.clusterDim.y = cluster.val.clusterDim.z = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(size, 1, 1);
  cfg.blockDim = dim3(kThreads, 1, 1);
  cfg.dynamicSmemBytes = kSmemBytes;
  cfg.attrs = &cluster;
  cfg.numAttrs = 1;
  int n = 0;
  if (cudaOccupancyMaxActiveClusters(&n, kernel, &cfg) != cudaSuccess) {
    (void)cudaGetLastError();
    return -1;
  }
  return n;
}
int split_clusters(int device, bool pairs) {
  if (!use_device(device, "chunk_gdr_fwd_sm90_split_clusters").ok()) return -1;
  return pairs ? resident_clusters(chunk_gdr_fwd_sm90_split_pair_kernel<__nv_bfloat16>, 4 * kVBlocks)
               : resident_clusters(chunk_gdr_fwd_sm90_split_kernel<__nv_bfloat16>, 2 * kVBlocks);
}

Status launch(const Args& a, int dtype, cudaStream_t stream) {
  if (a.N == 0 || a.HV == 0) return {};
  if (dtype == kF16) return launch_t<__half>(a, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, stream);
  return launch_t<__nv_bfloat16>(a, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, stream);
}

}  // namespace
}  // namespace sm90
}  // namespace gdn
