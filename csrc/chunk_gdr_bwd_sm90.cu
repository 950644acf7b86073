// Chunked gated delta rule backward for sm_90a, its reverse dS pass: one warp-specialised CTA per (V-block
// of 64 value columns, value head, sequence) walks the sequence's chunk slots of the device chunk table
// from the last to the first holding dS^T in registers, the two V-block CTAs of a head a cluster. It
// replaces the Triton backward's chunk_bwd_dstate (gdn_packed/triton/chunk.py: pass A, combine, pass),
// reading what Triton prep wrote and writing what the Triton dq / dk kernels read. Formulas, what is
// rounded where, and the step itself: chunk_gdr_sm90.cuh (dstate_step, written once for this kernel and
// its host mirror). Shapes: K = V = 128, C = 64, bf16 or fp16 (fp32: host mirror only), GVA (HV = G H).
//   in   q, k [T, H, K], do [T, HV, V] (16-bit, contiguous, 16-byte aligned: TMA); Triton prep's outputs:
//        gates [NC, HV, 5, C] fp32 (beta, e^gam rk, scale e^gam rq, w rk, beta e^gam rk), eg_last
//        [NC, HV] fp32, ts (Ts = T - I), mm (M) [NC, HV, C, C] (input dtype); table int32 [NC, 4],
//        cu_chunks int32 [N + 1] (the device chunk table); dht [N, HV, K, V] fp32 or 0
//   out  dsn [NC, HV, V, K] (dSn^T: dS^T leaving each chunk slot, as it enters the chunk's step),
//        dxp [NC, HV, V, C] (dX'^T), dv [T, HV, V] (all in the input dtype; dsn, dxp in the slots of
//        the sequences' chunks only), dh0 [N, HV, K, V] fp32; exact zeros on every padding row of dv and
//        of dq, dk [T, H, K] (q's dtype), dg, dbeta [T, HV] (gate_bytes a value: 4 or 2), as the Triton
//        pass writes them (dq, dk, dg, dbeta's real rows are the Triton dq / dk / finalize kernels')
// Grid (V-blocks 2, HV, N) in clusters of 2; with pairs (GVA pairs of value heads: HV / H even) grid (4,
// HV / 2, N) in clusters of 4, the two value heads of a qk head sharing its k / q loads. CTA (256 threads,
// 1 per SM, ~189 KB shared memory):
//   warpgroup 0, producer: one warp, its lane 0. Per chunk slot (last first): the table row and egL (the
//        next ones a chunk ahead), then, once every CTA of the cluster has released the stage of the
//        3-stage ring, the TMA loads: its K-half of k and of q (with pairs: one of the four K-halves of k
//        and q) multicast to every CTA of the cluster, Ts (V-block 0) or M (V-block 1) multicast to both
//        CTAs of its value head; its 64 columns of dO; the slot's gate rows (a bulk copy); rows past T
//        arrive 0
//   warpgroup 1, dS: dS^T [64 v, 128] fp32 in registers (from dht), the step of chunk_gdr_sm90.cuh
//        (wgmma with dS^T, dO^T, dU^T, the gated dO^T and (beta e^gam rk) dX'^T as register A operands);
//        dSn^T stored from its registers (a pair of columns a store: no staging, no shared memory), dX'^T
//        by a TMA store from swizzled staging (stmatrix), dv by a transposing stmatrix and a TMA store of
//        the chunk's rows; then dh0 and the padding rows' zeros
// A sequence's last chunk, the only one that can be partial and the first walked, runs outside the
// chunk loop: its rows of other sequences (loaded by TMA) are zeroed in the CTA's copy of the stage and
// its live rows of dv stored one by one. Synchronisation: mbarriers full / empty / gone (the ring; gone
// across the cluster), named barriers within the dS warpgroup (chunk_gdr_bwd_sm90_device.cuh). The host mirror
// (chunk_gdr_bwd_sm90 with host = true) runs the same step over every (value head, sequence, V-block) in
// a CPU loop, with plain loops in place of wgmma / TMA / ldmatrix / stmatrix.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "api.h"
#include "chunk_gdr_sm90.cuh"
#include "chunk_gdr_sm90_host.cuh"
#include "cuda_status.cuh"
#include "dtypes.cuh"

namespace gdn {
namespace sm90 {
namespace {

struct BwdArgs {
  const void *q, *k, *do_, *ts, *mm;
  const float *gates, *eg_last, *dht;
  const int32_t *table, *cu_chunks;
  void *dsn, *dxp, *dv, *dq, *dk, *dg, *dbeta;
  float* dh0;
  int64_t N, T, H, HV, NC;
  int esize, gate_bytes;     // bytes of an element of q (dq, dk, dv, ...) and of dg / dbeta
  bool pairs;                // the kernel on GVA pairs of value heads (clusters of 4 sharing k / q)
};

// Padding rows [r0, r1) of the tensors the CTA of (V-block vb, value head hv) zeroes, as the Triton dS
// pass: dv's 64 columns of the V-block; with vb = 0 dg, dbeta of hv; with vb = 0 and hv the first value
// head of its group dq, dk of the qk head. Element by element over `lane` of `lanes` (host: 0 of 1).
GDN_HD void zero_padding_rows(const BwdArgs& a, int vb, int64_t hv, int64_t r0, int64_t r1, int lane, int lanes) {
  const int64_t H = a.H, HV = a.HV, G = HV / H;
  auto zero = [](void* p, int bytes) {
    if (bytes == 4) *static_cast<uint32_t*>(p) = 0u;
    else *static_cast<uint16_t*>(p) = 0u;
  };
  uint8_t* dv = static_cast<uint8_t*>(a.dv);
  for (int64_t e = lane; e < (r1 - r0) * kVB; e += lanes)
    zero(dv + ((r0 + e / kVB) * HV * kV + hv * kV + vb * kVB + e % kVB) * a.esize, a.esize);
  if (vb != 0) return;
  for (int64_t e = lane; e < r1 - r0; e += lanes) {
    zero(static_cast<uint8_t*>(a.dg) + ((r0 + e) * HV + hv) * a.gate_bytes, a.gate_bytes);
    zero(static_cast<uint8_t*>(a.dbeta) + ((r0 + e) * HV + hv) * a.gate_bytes, a.gate_bytes);
  }
  if (hv % G != 0) return;
  for (int64_t e = lane; e < (r1 - r0) * kK; e += lanes) {
    const int64_t at = ((r0 + e / kK) * H + hv / G) * kK + e % kK;
    zero(static_cast<uint8_t*>(a.dq) + at * a.esize, a.esize);
    zero(static_cast<uint8_t*>(a.dk) + at * a.esize, a.esize);
  }
}

// ======================================================================================== host mirror
// The kVBlocks CTAs of value head hv and sequence n, one after the other over the same staged tiles.
template <typename T>
void mirror_head(const BwdArgs& a, int64_t hv, int64_t n) {
  using P = HostPolicyT<T>;
  P p;
  const int64_t H = a.H, HV = a.HV, h = hv / (HV / H);
  std::vector<T> kq(2 * kC * kK), dot(kC * kV), ts(kC * kC), mm(kC * kC);
  auto dS = std::make_unique<typename P::template Frag<kK>[]>(kVBlocks);
  for (int wg = 0; wg < kVBlocks; ++wg)
    P::for_each(dS[wg], [&](int r, int c, float& x) {
      x = a.dht ? a.dht[((n * HV + hv) * kK + c) * kV + wg * kVB + r] : 0.f;
    });
  const T* q = static_cast<const T*>(a.q);
  const T* k = static_cast<const T*>(a.k);
  const T* dO = static_cast<const T*>(a.do_);
  T* dsn = static_cast<T*>(a.dsn);
  T* dxp = static_cast<T*>(a.dxp);
  T* dv = static_cast<T*>(a.dv);
  const typename P::Smem k_b{kq.data(), kK, true}, k_mn{kq.data(), kK, false};
  const typename P::Smem q_mn{kq.data() + kC * kK, kK, false};
  const typename P::Smem ts_mn{ts.data(), kC, false}, m_mn{mm.data(), kC, false};
  for (int64_t j = a.cu_chunks[n + 1] - 1; j >= a.cu_chunks[n]; --j) {
    const int64_t start = a.table[j * 4 + 2], slot = j * HV + hv;
    const int length = a.table[j * 4 + 3];
    // the TMA boxes: rows past T are 0; then the dS warpgroup zeroes the rows of other sequences
    for (int r = 0; r < kC; ++r) {
      const int64_t row = start + r;
      const bool in = row >= 0 && row < a.T && r < length;
      for (int c = 0; c < kK; ++c) {
        kq[r * kK + c] = in ? k[(row * H + h) * kK + c] : from_f<T>(0.f);
        kq[(kC + r) * kK + c] = in ? q[(row * H + h) * kK + c] : from_f<T>(0.f);
        dot[r * kV + c] = in ? dO[(row * HV + hv) * kV + c] : from_f<T>(0.f);
      }
    }
    std::memcpy(ts.data(), static_cast<const T*>(a.ts) + slot * kC * kC, sizeof(T) * kC * kC);
    std::memcpy(mm.data(), static_cast<const T*>(a.mm) + slot * kC * kC, sizeof(T) * kC * kC);
    const float* gates = a.gates + slot * kGateRows * kC;
    for (int wg = 0; wg < kVBlocks; ++wg) {
      const typename P::Smem do_t{dot.data() + wg * kVB, kV, false};
      const int64_t vt0 = slot * kV + wg * kVB;       // the V-block's first row of dsn / dxp
      dstate_step<P, T>(
          p, dS[wg], gates, a.eg_last[slot], k_b, k_mn, q_mn, ts_mn, m_mn, do_t,
          [&](typename P::template Frag<kK>& ds) {
            P::for_each(ds, [&](int r, int c, float& x) { dsn[(vt0 + r) * kK + c] = from_f<T>(x); });
          },
          [&](typename P::template Frag<kC>& dx, const float* beta) {
            P::for_each(dx, [&](int r, int c, float& x) {
              dxp[(vt0 + r) * kC + c] = from_f<T>(x);
              if (c < length) dv[((start + c) * HV + hv) * kV + wg * kVB + r] = from_f<T>(x * beta[c]);
            });
          },
          [] {});
    }
  }
  for (int wg = 0; wg < kVBlocks; ++wg)
    P::for_each(dS[wg], [&](int r, int c, float& x) { a.dh0[((n * HV + hv) * kK + c) * kV + wg * kVB + r] = x; });
  int64_t pa, pb;
  padding_after(a.table, a.cu_chunks, n, a.N, a.T, &pa, &pb);
  const int64_t first = n == 0 ? padding_before_first(a.table, a.cu_chunks, a.N, a.T) : 0;
  for (int wg = 0; wg < kVBlocks; ++wg) {
    zero_padding_rows(a, wg, hv, pa, pb, 0, 1);
    zero_padding_rows(a, wg, hv, 0, first, 0, 1);
  }
}

template <typename T>
void run_mirror(const BwdArgs& a) {
  for_each_head(a.N, a.HV, [&](int64_t hv, int64_t n) { mirror_head<T>(a, hv, n); });
}

}  // namespace
}  // namespace sm90
}  // namespace gdn

#include "chunk_gdr_bwd_sm90_device.cuh"

namespace gdn {

int chunk_gdr_bwd_sm90_smem_bytes() { return sm90::kBwdSmemBytes; }

Status chunk_gdr_bwd_sm90(const ChunkBwdSm90Params& p, bool host, int device, std::uintptr_t stream) {
  auto bad = [](const std::string& m) { return Status::invalid("chunk_gdr_bwd_sm90: " + m); };
  Status st = sm90::check_sizes(p, host, "chunk_gdr_bwd_sm90");
  if (!st.ok()) return st;
  if (p.NC < 0 || p.NC * p.HV > kInt32Max) return bad("NC * HV must fit int32 (TMA coordinates)");
  if (p.gate_dtype != kF32 && p.gate_dtype != kF16 && p.gate_dtype != kBF16) return bad("gate_dtype out of range");
  if (p.pairs && (p.H <= 0 || (p.HV / p.H) % 2 != 0))
    return bad("pairs needs an even number of value heads a qk head (HV / H)");
  sm90::BwdArgs a{};
  a.q = reinterpret_cast<const void*>(p.q);
  a.k = reinterpret_cast<const void*>(p.k);
  a.do_ = reinterpret_cast<const void*>(p.do_);
  a.ts = reinterpret_cast<const void*>(p.ts);
  a.mm = reinterpret_cast<const void*>(p.mm);
  a.gates = reinterpret_cast<const float*>(p.gates);
  a.eg_last = reinterpret_cast<const float*>(p.eg_last);
  a.dht = reinterpret_cast<const float*>(p.dht);
  a.table = reinterpret_cast<const int32_t*>(p.table);
  a.cu_chunks = reinterpret_cast<const int32_t*>(p.cu_chunks);
  a.dsn = reinterpret_cast<void*>(p.dsn);
  a.dxp = reinterpret_cast<void*>(p.dxp);
  a.dv = reinterpret_cast<void*>(p.dv);
  a.dq = reinterpret_cast<void*>(p.dq);
  a.dk = reinterpret_cast<void*>(p.dk);
  a.dg = reinterpret_cast<void*>(p.dg);
  a.dbeta = reinterpret_cast<void*>(p.dbeta);
  a.dh0 = reinterpret_cast<float*>(p.dh0);
  a.N = p.N;
  a.T = p.T;
  a.H = p.H;
  a.HV = p.HV;
  a.NC = p.NC;
  a.esize = p.dtype == kF32 ? 4 : 2;
  a.gate_bytes = p.gate_dtype == kF32 ? 4 : 2;
  a.pairs = p.pairs;
  if (host) {
    switch (p.dtype) {
      case kF32: sm90::run_mirror<float>(a); break;
      case kF16: sm90::run_mirror<__half>(a); break;
      default: sm90::run_mirror<__nv_bfloat16>(a); break;
    }
    return {};
  }
  st = use_device(device, "chunk_gdr_bwd_sm90");
  if (!st.ok()) return st;
  return sm90::launch_bwd(a, p.dtype, reinterpret_cast<cudaStream_t>(stream));
}

}  // namespace gdn
