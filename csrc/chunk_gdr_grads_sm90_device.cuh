// The device side of chunk_gdr_grads_sm90.cu (included there once): the warp-specialised chunk-parallel
// gradient kernel and its launch. The wgmma / ldmatrix / stmatrix policy, the barrier helpers and the TMA
// descriptors are chunk_gdr_sm90_device.cuh's (shared with the forward and the dS pass).
#pragma once

#include "chunk_gdr_sm90_device.cuh"

namespace gdn {
namespace sm90 {
namespace {

constexpr int kGradsThreads = 384;         // producer, dq side, dk side
constexpr int kGradsStages = 2;            // the TMA ring: (value head g, V-block vb) it = 2 g + vb in stage it % 2
constexpr int kGradsRegsLaunch = (65536 / kGradsThreads) / 8 * 8;
constexpr int kGradsRegsProducer = 24, kGradsRegsWork = 240;      // 24 + 240 + 240 = 504
static_assert(kGradsRegsProducer + 2 * kGradsRegsWork <= (kGradsThreads / 128) * kGradsRegsLaunch,
              "setmaxnreg pool");
// named barriers: 1, 2 the dq / dk warpgroup's own (P::bar), 3 both after the dead rows of q, k are zeroed,
// 4 the dq side's P written (it arrives, the dk side waits)
constexpr int kBarQK = 3, kBarP = 4;
enum GradsTile : int { kTileDo = 0, kTileV, kTileUt, kTileDx, kTileSt, kTileDsn = kTileSt + 2, kGradsTiles = kTileDsn + 2 };

struct alignas(16) GradsGates {            // a head's gate rows (a bulk copy: 16-byte multiple)
  float row[kGateRows][kC];
};

struct alignas(1024) GradsShared {
  uint8_t qk[2][2][kBlock];                // q, k: [c][K] as two K-half blocks each
  uint8_t tiles[kGradsStages][kGradsTiles][kBlock];   // per stage: dO, v [c][v]; U^T, dX'^T [v][c]; S^T, dSn^T
                                                      // [v][K] (two blocks each)
  GradsGates gates[kGradsStages];
  alignas(16) float rn[2][kC];             // rq, rk of the qk head
  float pt[kC][kPLd];                      // the dq side's Q^K^^T, then its P (for the dk side)
  float bt[kC][kPLd];                      // the dk side's K^K^^T, then its Bh (B's transpose)
  GradsScratch scratch[2];                 // the dq side's, the dk side's
  uint64_t tile_full, full[kGradsStages], empty[kGradsStages];
};
constexpr uint32_t kGradsTileBytes = 4 * kBlock + sizeof(float) * 2 * kC;     // q, k, rn
constexpr uint32_t kGradsStageBytes = kGradsTiles * kBlock + sizeof(GradsGates);
constexpr int kGradsSmemBytes = sizeof(GradsShared) + 1024;   // + the 1024-byte alignment of the base
static_assert(kGradsSmemBytes <= 232448, "one CTA's shared memory on sm_90 (227 KB)");

__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_sync_n(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// grid (NC, H): CTA (j, h) for chunk slot j and qk head h; a slot outside every sequence (length 0) exits
// at once. Barriers (the producer's lane 0 arrives with the bytes; a side arrives by its thread 0 after a
// barrier of its warpgroup):
//   tile_full   q, k, rn landed (1 arrival + bytes)
//   full[s]     stage s's tiles and gate rows landed (1 arrival + bytes)
//   empty[s]    stage s read by both sides (2 arrivals)
template <typename T>
__global__ void __launch_bounds__(kGradsThreads, 1)
chunk_gdr_grads_sm90_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                            const __grid_constant__ CUtensorMap tm_v, const __grid_constant__ CUtensorMap tm_do,
                            const __grid_constant__ CUtensorMap tm_st, const __grid_constant__ CUtensorMap tm_ut,
                            const __grid_constant__ CUtensorMap tm_dsn, const __grid_constant__ CUtensorMap tm_dxp,
                            const GradsArgs a) {
  using P = DevPolicy<T>;
  extern __shared__ uint8_t smem_raw[];
  GradsShared& sm = *reinterpret_cast<GradsShared*>(smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023));
  const int tid = threadIdx.x, wg = tid >> 7, wtid = tid & 127;
  const int64_t j = blockIdx.x, h = blockIdx.y, HV = a.HV, G = HV / a.H;
  const int4 row = __ldg(reinterpret_cast<const int4*>(a.table) + j);   // (seq, idx, start, length)
  const int64_t start = row.z;
  const int length = row.w;
  // the whole CTA, before any barrier: an empty slot, or a row range outside the tensors (the table builder
  // never makes one; a guard, as every read and write below is at rows start + r, r < min(length, 64))
  if (length <= 0 || start < 0 || start + (length < kC ? length : kC) > a.T) return;
  const int nstages = static_cast<int>(kVBlocks * G);
  if (tid == 0) {
    mbar_init(&sm.tile_full, 1);
    for (int i = 0; i < kGradsStages; ++i) {
      mbar_init(&sm.full[i], 1);
      mbar_init(&sm.empty[i], 2);                 // the dq and dk sides
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (wg == 0) {                                  // ---- producer: lane 0 of warp 0
    set_regs<kGradsRegsProducer, kGradsRegsLaunch>();
    if (tid == 0) {
      constexpr uint64_t hint = static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_FIRST);
      const int s32 = static_cast<int>(start), h32 = static_cast<int>(h);
      mbar_expect_tx(&sm.tile_full, kGradsTileBytes);
      for (int kh = 0; kh < 2; ++kh) {
        cute::SM90_TMA_LOAD_3D::copy(&tm_q, &sm.tile_full, hint, sm.qk[0][kh], kh * 64, h32, s32);
        cute::SM90_TMA_LOAD_3D::copy(&tm_k, &sm.tile_full, hint, sm.qk[1][kh], kh * 64, h32, s32);
      }
      bulk_load(&sm.rn[0][0], a.rn + (j * HV + h * G) * 2 * kC, sizeof(float) * 2 * kC, &sm.tile_full);
      for (int it = 0; it < nstages; ++it) {
        const int st = it % kGradsStages, vb = it % kVBlocks;
        const int hv = static_cast<int>(h * G + it / kVBlocks), slot = static_cast<int>(j * HV + hv);
        if (it >= kGradsStages)
          mbar_wait(&sm.empty[st], ((it / kGradsStages) + 1) & 1, "grads producer, empty[it % 2]: both sides released", it);
        mbar_expect_tx(&sm.full[st], kGradsStageBytes);
        uint8_t(*t)[kBlock] = sm.tiles[st];
        cute::SM90_TMA_LOAD_3D::copy(&tm_do, &sm.full[st], hint, t[kTileDo], vb * kVB, hv, s32);
        cute::SM90_TMA_LOAD_3D::copy(&tm_v, &sm.full[st], hint, t[kTileV], vb * kVB, hv, s32);
        cute::SM90_TMA_LOAD_3D::copy(&tm_ut, &sm.full[st], hint, t[kTileUt], 0, vb * kVB, slot);
        cute::SM90_TMA_LOAD_3D::copy(&tm_dxp, &sm.full[st], hint, t[kTileDx], 0, vb * kVB, slot);
        for (int kh = 0; kh < 2; ++kh) {
          cute::SM90_TMA_LOAD_3D::copy(&tm_st, &sm.full[st], hint, t[kTileSt + kh], kh * 64, vb * kVB, slot);
          cute::SM90_TMA_LOAD_3D::copy(&tm_dsn, &sm.full[st], hint, t[kTileDsn + kh], kh * 64, vb * kVB, slot);
        }
        bulk_load(&sm.gates[st], a.gates + static_cast<int64_t>(slot) * kGateRows * kC, sizeof(GradsGates),
                  &sm.full[st]);
      }
    }
    return;
  }
  // ---- the dq side (wg 1) and the dk side (wg 2)
  set_regs<kGradsRegsWork, kGradsRegsLaunch>();
  P p{wg};
  GradsScratch& s = sm.scratch[wg - 1];
  mbar_wait(&sm.tile_full, 0, "grads, tile_full: q, k, rn landed");
  if (length < kC) {                              // the next sequence's rows of q, k: 0 (the dq side zeroes)
    if (wg == 1)
      for (int b = 0; b < 4; ++b) zero_rows_from(smem_u32(sm.qk[b / 2][b % 2]), length, wtid);
    fence_async_smem();
  }
  named_sync_n(kBarQK, 256);
  const typename P::Smem q_t{smem_u32(sm.qk[0][0]), kBlock, true}, k_t{smem_u32(sm.qk[1][0]), kBlock, true};
  auto stage = [&](int g, int vb) {
    const int it = kVBlocks * g + vb, st = it % kGradsStages;
    mbar_wait(&sm.full[st], (it / kGradsStages) & 1, "grads, full[it % 2]: the stage landed", it);
    uint8_t(*t)[kBlock] = sm.tiles[st];
    if (length < kC && wg == 1) {                 // the row tiles (dO, v; both the dq side's): the next
      zero_rows_from(smem_u32(t[kTileDo]), length, wtid);    // sequence's rows 0
      zero_rows_from(smem_u32(t[kTileV]), length, wtid);
      p.sync();
    }
    return GradsTiles<P>{{smem_u32(t[kTileDo]), kBlock, true}, {smem_u32(t[kTileV]), kBlock, true},
                         {smem_u32(t[kTileUt]), kBlock, true}, {smem_u32(t[kTileDx]), kBlock, true},
                         {smem_u32(t[kTileSt]), kBlock, true}, {smem_u32(t[kTileDsn]), kBlock, true},
                         sm.gates[st].row[0]};
  };
  auto done = [&](int g, int vb) {                // every thread's reads of the stage precede the release
    named_sync(p.bar);
    if (wtid == 0) mbar_arrive(&sm.empty[(kVBlocks * g + vb) % kGradsStages]);
  };
  auto g_rows = [&](int g) { return a.g + start * HV + h * G + g; };
  auto share = [&](int side, int g, int r, float d, float db) {     // slot `side` of dg_part, dbeta_part
    const int64_t at = (side * HV + h * G + g) * a.T + start + r;
    a.dg_part[at] = d;
    a.dbeta_part[at] = db;
  };
  typename P::template Frag<kK> acc;
  if (wg == 1) {
    grads_dq<P, T>(
        p, static_cast<int>(G), length, a.scale, q_t, k_t, sm.rn[0], sm.rn[1], s, &sm.pt[0][0], acc, HV, stage, done,
        g_rows, [&](int g) { return __ldg(a.eg_last + j * HV + h * G + g); },
        [&](int g, int r, float d, float db) { share(0, g, r, d, db); },
        [&] { named_arrive(kBarP, 256); });     // P written (the dk side reads it after its bar.sync)
  } else {
    grads_dk<P, T>(
        p, static_cast<int>(G), length, q_t, k_t, sm.rn[0], sm.rn[1], s, &sm.bt[0][0], &sm.pt[0][0], acc, HV, stage,
        done, g_rows, [&](int g, int r, float d, float db) { share(1, g, r, d, db); },
        [&] { named_sync_n(kBarP, 256); });
  }
  void* out = wg == 1 ? a.dq : a.dk;
  P::for_each_pair(acc, [&](int r, int c, float& x0, float& x1) {
    if (r < length) store_grad_pair<T>(a, out, start + r, h, c, x0, x1);
  });
}

template <typename T>
Status launch_grads_t(const GradsArgs& a, CUtensorMapDataType ty, cudaStream_t stream) {
  constexpr const char* who = "chunk_gdr_grads_sm90";
  constexpr const char* names = "q, k, v, do, st, ut, dsn, dxp";
  const uint32_t blk[3] = {64, 64, 1};
  const int64_t slots = a.NC * a.HV;
  EncodeTiled enc = nullptr;
  CUtensorMap tq, tk, tv, tdo, tst, tut, tdsn, tdxp;
  Status st = encode_fn(who, &enc);
  if (st.ok()) st = encode_rows(enc, &tq, ty, a.q, kK, a.H, a.T, who, names);
  if (st.ok()) st = encode_rows(enc, &tk, ty, a.k, kK, a.H, a.T, who, names);
  if (st.ok()) st = encode_rows(enc, &tv, ty, a.v, kV, a.HV, a.T, who, names);
  if (st.ok()) st = encode_rows(enc, &tdo, ty, a.do_, kV, a.HV, a.T, who, names);
  if (st.ok()) st = encode_3d(enc, &tst, ty, a.st, {kK, kV, slots}, blk, who, names);
  if (st.ok()) st = encode_3d(enc, &tut, ty, a.ut, {kC, kV, slots}, blk, who, names);
  if (st.ok()) st = encode_3d(enc, &tdsn, ty, a.dsn, {kK, kV, slots}, blk, who, names);
  if (st.ok()) st = encode_3d(enc, &tdxp, ty, a.dxp, {kC, kV, slots}, blk, who, names);
  if (!st.ok()) return st;
  if (!aligned16({a.gates, a.rn, a.table, a.dq, a.dk}))
    return Status::invalid("chunk_gdr_grads_sm90: gates, rn, table, dq and dk must be 16-byte aligned (bulk copies, "
                           "int4 rows, paired stores)");
  auto kernel = chunk_gdr_grads_sm90_kernel<T>;
  st = allow_smem(kernel, kGradsSmemBytes, who);
  if (!st.ok()) return st;
  const dim3 grid(static_cast<unsigned>(a.NC), static_cast<unsigned>(a.H), 1);
  kernel<<<grid, kGradsThreads, kGradsSmemBytes, stream>>>(tq, tk, tv, tdo, tst, tut, tdsn, tdxp, a);
  return launch_status("chunk_gdr_grads_sm90");
}

Status launch_grads(const GradsArgs& a, int dtype, cudaStream_t stream) {
  if (a.NC == 0 || a.H == 0) return {};
  if (dtype == kF16) return launch_grads_t<__half>(a, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, stream);
  return launch_grads_t<__nv_bfloat16>(a, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, stream);
}

}  // namespace
}  // namespace sm90
}  // namespace gdn
