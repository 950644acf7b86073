// The device side of chunk_gdr_bwd_sm90.cu (included there once): the warp-specialised reverse dS kernel
// and its launch. The wgmma / ldmatrix / stmatrix policy, the barrier and cluster helpers and the TMA
// descriptors are chunk_gdr_sm90_device.cuh's (shared with the forward).
#pragma once

#include "chunk_gdr_sm90_device.cuh"

namespace gdn {
namespace sm90 {
namespace {

constexpr int kBwdThreads = 256;           // producer, dS warpgroups
constexpr int kBwdStages = 3;              // the TMA ring: chunk slot walked it-th in stage it % 3

struct alignas(16) GateRows {              // one chunk slot's rows of prep's gates (a bulk copy: 16-byte multiple)
  float row[kGateRows][kC];
};

struct alignas(1024) BwdShared {
  uint8_t kq[kBwdStages][2][2 * kBlock];   // per stage and K half: [K rows 0..63 ; Q rows 0..63] x 64 cols
  uint8_t tm[kBwdStages][2][kBlock];       // per stage: Ts, M [c'][c] (input dtype)
  uint8_t dO[kBwdStages][kBlock];          // per stage: the CTA's 64 columns of dO [c][v]
  uint8_t dxp[kBlock];                     // staging of the TMA stores: dX'^T [v][c], dv [c][v] (one chunk's;
                                           // rewritten once the stores have read it)
  uint8_t dv[kBlock];
  GateRows gates[kBwdStages];
  float eg_last[kBwdStages];
  int32_t rows[kBwdStages][2];             // per stage: the chunk's start row and length (the producer's)
  uint64_t full[kBwdStages], empty[kBwdStages], gone[kBwdStages];
};
// a stage's bytes in each CTA: k, q (both K-halves: the multicasts of the CTAs sharing it), Ts and M (one
// multicast by each V-block's CTA of the value head), the CTA's dO, the gate rows
constexpr uint32_t kBwdStageBytes = 7 * kBlock + sizeof(GateRows);
constexpr int kBwdSmemBytes = sizeof(BwdShared) + 1024;      // + the 1024-byte alignment of the base
static_assert(kBwdSmemBytes <= 232448, "one CTA's shared memory on sm_90 (227 KB)");

// grid (kVBlocks kPair, HV / kPair, N) in clusters of the kVBlocks kPair CTAs of a (value head, sequence),
// or with kPair = 2 of a (GVA pair of value heads, sequence): CTA rank r owns value columns vb * 64 ..
// vb * 64 + 63 (vb = r % 2) of value head kPair * blockIdx.y + r / 2. Barriers (an elected thread arrives
// for its warpgroup):
//   full[s]      the loads of the slot walked it-th landed in stage s = it % 3: k, q (each CTA's producer
//                multicasts one K-half of k and of q, with kPair = 2 one of the four, to every CTA of the
//                cluster), Ts (by V-block 0's) and M (V-block 1's) to both CTAs of the value head, the CTA's
//                dO columns and gate rows (1 arrival + all the bytes)
//   empty[s]     stage s read in this CTA: by its dS warpgroup (1 arrival)
//   gone[s]      stage s read in every CTA of the cluster (the k / q multicasts write all of them): by each
//                CTA's producer once its empty[s] completed (kVBlocks kPair: one local, the others remote
//                arrivals); the producer reloads stage s after it
// Named barrier 1: the dS warpgroup's.
template <typename T, int kPair>
__device__ __forceinline__ void bwd_cta(const CUtensorMap& tm_q, const CUtensorMap& tm_k, const CUtensorMap& tm_do,
                                        const CUtensorMap& tm_ts, const CUtensorMap& tm_mm,
                                        const CUtensorMap& tm_dxp, const CUtensorMap& tm_dv, const BwdArgs a) {
  using P = DevPolicy<T>;
  constexpr int kShare = kVBlocks * kPair;                   // the CTAs sharing each k / q stage
  extern __shared__ uint8_t smem_raw[];
  BwdShared& sm = *reinterpret_cast<BwdShared*>(smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023));
  const int tid = threadIdx.x, wg = tid >> 7, wtid = tid & 127;
  const int rank = static_cast<int>(cluster_rank());         // blockIdx.x
  const int vb = kPair == 1 ? rank : rank % kVBlocks;        // V-block
  const int hh = kPair == 1 ? 0 : rank / kVBlocks;           // value head of the pair
  const int64_t hv = kPair * static_cast<int64_t>(blockIdx.y) + hh, n = blockIdx.z, HV = a.HV;
  const int h = static_cast<int>(hv / (HV / a.H));
  const int64_t c0 = a.cu_chunks[n], c1 = a.cu_chunks[n + 1];
  const int nchunks = static_cast<int>(c1 - c0);
  if (tid == 0) {
    for (int i = 0; i < kBwdStages; ++i) {
      mbar_init(&sm.full[i], 1);
      mbar_init(&sm.empty[i], 1);                 // this CTA's dS warpgroup
      mbar_init(&sm.gone[i], kShare);             // the producers of the CTAs sharing the stage
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  cluster_sync();                                 // every CTA's barriers initialised before any arrival

  if (wg == 0) {                                  // ---- producer: lane 0 of warp 0
    if (tid == 0) {
      const int4* table = reinterpret_cast<const int4*>(a.table);   // rows (seq, idx, start, length)
      int4 next = nchunks > 0 ? __ldg(table + c1 - 1) : make_int4(0, 0, 0, 0);
      float next_eg = nchunks > 0 ? __ldg(a.eg_last + (c1 - 1) * HV + hv) : 0.f;
      constexpr uint64_t hint = static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_NORMAL);
      constexpr uint16_t all = (1u << kShare) - 1;           // the CTAs sharing k / q; those of the value head:
      const uint16_t head = kPair == 1 ? all : static_cast<uint16_t>(((1u << kVBlocks) - 1) << (kVBlocks * hh));
      for (int it = 0; it < nchunks; ++it) {
        const int st = it % kBwdStages;
        const int64_t j = c1 - 1 - it;
        const int32_t start = next.z, length = next.w;
        const float eg = next_eg;
        if (it + 1 < nchunks) {                   // the next slot's row and decay, in flight during this one
          next = __ldg(table + j - 1);
          next_eg = __ldg(a.eg_last + (j - 1) * HV + hv);
        }
        if (it >= kBwdStages) {                   // the stage released here, then in every CTA sharing it
          const uint32_t ph = ((it / kBwdStages) + 1) & 1;
          mbar_wait(&sm.empty[st], ph, "bwd producer, empty[it % 3]: the stage released by this CTA's dS", it);
          mbar_arrive(&sm.gone[st]);
#pragma unroll
          for (int d = 1; d < kShare; ++d) mbar_arrive_at(peer_addr(&sm.gone[st], rank ^ d));
          mbar_wait(&sm.gone[st], ph, "bwd producer, gone[it % 3]: the stage released in every CTA sharing it", it);
        }
        sm.rows[st][0] = start;
        sm.rows[st][1] = length;
        sm.eg_last[st] = eg;
        const int slot = static_cast<int>(j * HV + hv);
        mbar_expect_tx(&sm.full[st], kBwdStageBytes);   // all of the stage: the others' multicasts land here too
        // K-half vb of k and of q; with pairs the value head's first CTAs k's, its second's q's
        if (kPair == 1 || hh == 0)
          cute::SM90_TMA_LOAD_MULTICAST_3D::copy(&tm_k, &sm.full[st], all, hint, sm.kq[st][vb], vb * 64, h, start);
        if (kPair == 1 || hh == 1)
          cute::SM90_TMA_LOAD_MULTICAST_3D::copy(&tm_q, &sm.full[st], all, hint, sm.kq[st][vb] + kBlock, vb * 64, h,
                                                 start);
        cute::SM90_TMA_LOAD_MULTICAST_3D::copy(vb == 0 ? &tm_ts : &tm_mm, &sm.full[st], head, hint, sm.tm[st][vb],
                                               0, 0, slot);
        cute::SM90_TMA_LOAD_3D::copy(&tm_do, &sm.full[st], hint, sm.dO[st], vb * kVB, static_cast<int>(hv), start);
        bulk_load(&sm.gates[st], a.gates + static_cast<int64_t>(slot) * kGateRows * kC, sizeof(GateRows),
                  &sm.full[st]);
      }
    }
  } else {                                        // ---- dS: dS^T of the CTA's 64 value columns in registers
    P p{1};
    typename P::template Frag<kK> dS;
    const float* dht = a.dht ? a.dht + (n * HV + hv) * kK * kV : nullptr;
    P::for_each(dS, [&](int r, int c, float& x) { x = dht ? dht[c * kV + vb * kVB + r] : 0.f; });
    T* dv = static_cast<T*>(a.dv);
    const uint32_t dxp = smem_u32(sm.dxp),
                   dvs = smem_u32(sm.dv);
    // a sequence's last chunk (the first walked; the only one that can be partial: kFirst) apart, so the
    // loop of the others holds no dead-row work
    auto step = [&](int it, auto first) {
      constexpr bool kFirst = decltype(first)::value;
      const int st = it % kBwdStages;
      const int64_t j = c1 - 1 - it, slot = j * HV + hv;
      mbar_wait(&sm.full[st], (it / kBwdStages) & 1, "bwd dS, full[it % 3]: k/q/Ts/M/dO and the gate rows landed",
                it);
      const int64_t start = sm.rows[st][0];
      const int length = sm.rows[st][1];
      if constexpr (kFirst) {
        if (length < kC) {                        // the rows of other sequences in this CTA's copy: 0
          for (int half = 0; half < 2; ++half) {
            zero_rows_from(smem_u32(sm.kq[st][half]), length, wtid);
            zero_rows_from(smem_u32(sm.kq[st][half]) + kBlock, length, wtid);
          }
          zero_rows_from(smem_u32(sm.dO[st]), length, wtid);
          p.sync();
        }
      }
      const uint32_t kq = smem_u32(sm.kq[st][0]);
      const typename P::Smem k_b{kq, 2 * kBlock, true}, k_mn{kq, 2 * kBlock, false};
      const typename P::Smem q_mn{kq + kBlock, 2 * kBlock, false};
      const typename P::Smem ts_mn{smem_u32(sm.tm[st][0]), kBlock, false}, m_mn{smem_u32(sm.tm[st][1]), kBlock, false};
      const typename P::Smem do_t{smem_u32(sm.dO[st]), 0, true};
      dstate_step<P, T>(
          p, dS, sm.gates[st].row[0], sm.eg_last[st], k_b, k_mn, q_mn, ts_mn, m_mn, do_t,
          [&](typename P::template Frag<kK>& ds) {      // dSn^T from the registers, a pair of columns a store
            T* dst = static_cast<T*>(a.dsn) + (slot * kV + vb * kVB) * kK;
            P::for_each_pair(ds, [&](int r, int c, float& x0, float& x1) { store2(dst + r * kK + c, x0, x1); });
          },
          [&](typename P::template Frag<kC>& dx, const float* beta) {
            p.template stmatrix<T>(dx.d, dxp, false);
            typename P::template Frag<kC> b;             // dv = beta dX', [c][v]
            P::for_each2_pair(b, dx, [&](int, int c, float& y0, float& y1, float x0, float x1) {
              const float2 s = col2(beta, c);
              y0 = x0 * s.x;
              y1 = x1 * s.y;
            });
            p.template stmatrix<T>(b.d, dvs, true);
            fence_async_smem();                          // the staging, for the TMA stores
            named_sync(p.bar);
            if (wtid == 0) {
              const int s32 = static_cast<int>(slot);
              cute::SM90_TMA_STORE_3D::copy(&tm_dxp, sm.dxp, 0, vb * kVB, s32);
              // a whole chunk: one store (the box is the chunk's rows; rows past T, a middle chunk's only
              // dead rows, are clipped)
              if (!kFirst || length == kC)
                cute::SM90_TMA_STORE_3D::copy(&tm_dv, sm.dv, vb * kVB, static_cast<int>(hv), static_cast<int>(start));
              asm volatile("cp.async.bulk.commit_group;" ::: "memory");
            }
            if (kFirst && length < kC)                   // the live rows only (the next sequence's follow them)
              store_live_rows(dvs, dv + (start * HV + hv) * kV + vb * kVB, HV * kV, length, wtid);
          },
          [&] {                                          // in the dS update's shadow: the stores have read the
            if (wtid == 0) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");   // staging (and the
            named_sync(p.bar);                           // row stores' reads are done) before the next step
          });
      if (wtid == 0) mbar_arrive(&sm.empty[st]);        // the stage back to the producer (every warp's reads of it
                                                         // precede its wgmma of the dS update, waited for)
    };
    if (nchunks > 0) step(0, std::true_type{});
    for (int it = 1; it < nchunks; ++it) step(it, std::false_type{});
    if (wtid == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");   // the last stores done
    float* dh0 = a.dh0 + (n * HV + hv) * kK * kV;
    P::for_each(dS, [&](int r, int c, float& x) { dh0[c * kV + vb * kVB + r] = x; });
    int64_t pa, pb;
    padding_after(a.table, a.cu_chunks, n, a.N, a.T, &pa, &pb);
    const int64_t first = n == 0 ? padding_before_first(a.table, a.cu_chunks, a.N, a.T) : 0;
    zero_padding_rows(a, vb, hv, pa, pb, wtid, 128);
    zero_padding_rows(a, vb, hv, 0, first, wtid, 128);
  }
  cluster_sync();          // no CTA leaves while another may still multicast to or arrive on its barriers
}

template <typename T>
__global__ void __cluster_dims__(kVBlocks, 1, 1) __launch_bounds__(kBwdThreads, 1)
chunk_gdr_bwd_sm90_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                          const __grid_constant__ CUtensorMap tm_do, const __grid_constant__ CUtensorMap tm_ts,
                          const __grid_constant__ CUtensorMap tm_mm, const __grid_constant__ CUtensorMap tm_dxp,
                          const __grid_constant__ CUtensorMap tm_dv, const BwdArgs a) {
  bwd_cta<T, 1>(tm_q, tm_k, tm_do, tm_ts, tm_mm, tm_dxp, tm_dv, a);
}
template <typename T>
__global__ void __cluster_dims__(2 * kVBlocks, 1, 1) __launch_bounds__(kBwdThreads, 1)
chunk_gdr_bwd_sm90_pair_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                               const __grid_constant__ CUtensorMap tm_do, const __grid_constant__ CUtensorMap tm_ts,
                               const __grid_constant__ CUtensorMap tm_mm, const __grid_constant__ CUtensorMap tm_dxp,
                               const __grid_constant__ CUtensorMap tm_dv, const BwdArgs a) {
  bwd_cta<T, 2>(tm_q, tm_k, tm_do, tm_ts, tm_mm, tm_dxp, tm_dv, a);
}

template <typename T>
Status launch_bwd_t(const BwdArgs& a, CUtensorMapDataType ty, cudaStream_t stream) {
  constexpr const char* who = "chunk_gdr_bwd_sm90";
  constexpr const char* names = "q, k, do, ts, mm, dxp, dv";
  const uint32_t blk[3] = {64, 64, 1};
  const int64_t slots = a.NC * a.HV;
  EncodeTiled enc = nullptr;
  CUtensorMap tq, tk, tdo, tts, tmm, tdxp, tdv;
  Status st = encode_fn(who, &enc);
  if (st.ok()) st = encode_rows(enc, &tq, ty, a.q, kK, a.H, a.T, who, names);
  if (st.ok()) st = encode_rows(enc, &tk, ty, a.k, kK, a.H, a.T, who, names);
  if (st.ok()) st = encode_rows(enc, &tdo, ty, a.do_, kV, a.HV, a.T, who, names);
  if (st.ok()) st = encode_rows(enc, &tdv, ty, a.dv, kV, a.HV, a.T, who, names);
  if (st.ok()) st = encode_3d(enc, &tts, ty, a.ts, {kC, kC, slots}, blk, who, names);
  if (st.ok()) st = encode_3d(enc, &tmm, ty, a.mm, {kC, kC, slots}, blk, who, names);
  if (st.ok()) st = encode_3d(enc, &tdxp, ty, a.dxp, {kC, kV, slots}, blk, who, names);
  if (!st.ok()) return st;
  if (!aligned16({a.gates, a.table, a.dsn}))
    return Status::invalid("chunk_gdr_bwd_sm90: gates, table and dsn must be 16-byte aligned (bulk copies, int4 rows, "
                           "paired stores)");
  auto kernel = a.pairs ? chunk_gdr_bwd_sm90_pair_kernel<T> : chunk_gdr_bwd_sm90_kernel<T>;
  st = allow_smem(kernel, kBwdSmemBytes, who);
  if (!st.ok()) return st;
  if (a.N > 65535 || a.HV > 65535)
    return Status::invalid("chunk_gdr_bwd_sm90: at most 65535 sequences and value heads");
  const int per = a.pairs ? 2 : 1;
  const dim3 grid(kVBlocks * per, static_cast<unsigned>(a.HV / per), static_cast<unsigned>(a.N));
  kernel<<<grid, kBwdThreads, kBwdSmemBytes, stream>>>(tq, tk, tdo, tts, tmm, tdxp, tdv, a);
  return launch_status("chunk_gdr_bwd_sm90");
}

Status launch_bwd(const BwdArgs& a, int dtype, cudaStream_t stream) {
  if (a.N == 0 || a.HV == 0) return {};
  if (dtype == kF16) return launch_bwd_t<__half>(a, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, stream);
  return launch_bwd_t<__nv_bfloat16>(a, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, stream);
}

}  // namespace
}  // namespace sm90
}  // namespace gdn
