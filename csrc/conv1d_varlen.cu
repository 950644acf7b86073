// Varlen depthwise causal conv1d, forward and backward (semantics: gdn_packed/torch_ref/conv1d.py).
//
//   z[t] = bias + sum_{w<W} weight[c, w] * xin(pos_t - (W-1) + w),   y[t] = silu(z[t]) or z[t]
//   xin(p): x row base + p of the row's own sequence for p >= 0, initial_state[seq, c, W-1+p] for
//           p < 0 (0 without one); padding rows: y = 0, dx = 0.
// Inputs: x, dy [T, D] (float32 / float16 / bfloat16, contiguous), weight [D, W] float32, bias [D]
// float32 or null, initial_state/dfinal [N, D, W-1] in x's dtype or null, cu_seqlens (+ padded) int64
// [N+1]. Outputs: y, dx [T, D]; final_state, dinitial_state [N, D, W-1] (x's dtype);
// dweight|dbias [D, W+1] float32. Arithmetic is float32; only the stored outputs are rounded.
//
// Kernels (no thread cooperates with another: every body below is `__host__ __device__` and the host
// mirror runs it over the whole grid in a CPU loop):
//   conv1d_fwd_kernel        thread = (row tile of R rows, VEC channels). Slides a W-row window of
//                            16-byte loads down its rows; a window is reloaded at a sequence start.
//   conv1d_final_state_kernel thread = (sequence, channel): the last W-1 inputs.
//   conv1d_bwd_kernel        thread = (row tile, VEC channels): dz = dy * act'(z) for rows
//                            [r0, r1 + MAXW - 1) (the look-ahead recomputes the next tile's first
//                            rows), scatters it into a ring of dx partial sums (row r - (MAXW-1) is
//                            complete after row r) and accumulates per-tile dweight/dbias partials.
//   conv1d_bwd_state_kernel  thread = (sequence, channel): d initial_state (recomputes dz of the
//                            first W-1 rows once each and scatters it to the W-1 columns).
//   conv1d_wgrad_reduce_kernel thread = (channel, tap): sums the per-tile partials in tile order,
//                            so dweight/dbias are bit-identical run to run (no atomics).
// Templates: MAXW (4 or 8) bounds the window so every array index is a compile-time constant
// (registers, no stack frame); W <= MAXW is a runtime value. VEC = 16 bytes / sizeof(T) (at most 4
// elements when MAXW = 8, to stay in registers) when D % VEC == 0 and the rows are 16-byte aligned,
// else 1 (scalar loads).
#include "api.h"
#include "dtypes.cuh"
#include "segments.cuh"

namespace gdn {
namespace {

constexpr int kThreads = 128;

template <typename T>
struct ConvArgs {
  const T* x;
  const float* w;
  const float* bias;
  const T* h0;
  const int64_t* cu;
  const int64_t* padded;
  int64_t N, T_, D;
  int W;
  bool silu;
  int64_t tile_rows;
  T* y;
  T* final_state;
  const T* dy;
  const T* dfinal;
  T* dx;
  float* partial;  // [tiles, D, W+1]
  float* dwb;      // [D, W+1]: dweight | dbias
  T* dh0;
};

GDN_HD float act(float z, bool silu) { return silu ? z / (1.f + expf(-z)) : z; }

// d act(z) / dz * g
GDN_HD float act_grad(float z, float g, bool silu) {
  if (!silu) return g;
  const float s = 1.f / (1.f + expf(-z));
  return g * s * (1.f + z * (1.f - s));
}

// xin(p) of sequence L for channels c0..c0+VEC.
template <typename T, int VEC>
GDN_HD void load_xin(const ConvArgs<T>& a, const RowLoc& L, int64_t p, int64_t c0, float (&out)[VEC]) {
  if (p >= 0) {
    const int64_t row = L.base + p;
    if (p < L.len && row >= 0 && row < a.T_) {
      load_vec<T, VEC>(a.x + row * a.D + c0, out);
      return;
    }
  } else if (a.h0 != nullptr && p >= -(a.W - 1)) {
#pragma unroll
    for (int v = 0; v < VEC; ++v) out[v] = to_f(a.h0[(L.seq * a.D + c0 + v) * (a.W - 1) + (a.W - 1 + p)]);
    return;
  }
#pragma unroll
  for (int v = 0; v < VEC; ++v) out[v] = 0.f;
}

// Taps aligned to the end of a MAXW window: wt[m] = weight[:, m - (MAXW - W)], 0 for m < MAXW - W.
template <int VEC, int MAXW, typename T>
GDN_HD void load_taps(const ConvArgs<T>& a, int64_t c0, float (&wt)[MAXW][VEC], float (&b)[VEC]) {
#pragma unroll
  for (int m = 0; m < MAXW; ++m)
#pragma unroll
    for (int v = 0; v < VEC; ++v)
      wt[m][v] = m >= MAXW - a.W ? a.w[(c0 + v) * a.W + (m - MAXW + a.W)] : 0.f;
#pragma unroll
  for (int v = 0; v < VEC; ++v) b[v] = a.bias != nullptr ? a.bias[c0 + v] : 0.f;
}

// win[m] = xin(pos - (MAXW-1-m)) for the row at L: a shift plus one load when L continues the
// previous row's sequence, else a full reload (which never reads another sequence's rows).
template <int VEC, int MAXW, typename T>
GDN_HD void slide_window(const ConvArgs<T>& a, const RowLoc& L, bool continues, int64_t c0,
                         float (&win)[MAXW][VEC]) {
  if (continues) {
#pragma unroll
    for (int m = 0; m < MAXW - 1; ++m)
#pragma unroll
      for (int v = 0; v < VEC; ++v) win[m][v] = win[m + 1][v];
    load_xin<T, VEC>(a, L, L.pos, c0, win[MAXW - 1]);
    return;
  }
#pragma unroll
  for (int m = 0; m < MAXW; ++m) {
    if (MAXW - 1 - m < a.W) {
      load_xin<T, VEC>(a, L, L.pos - (MAXW - 1 - m), c0, win[m]);
    } else {
#pragma unroll
      for (int v = 0; v < VEC; ++v) win[m][v] = 0.f;
    }
  }
}

template <int VEC, int MAXW>
GDN_HD void preact(const float (&wt)[MAXW][VEC], const float (&b)[VEC], const float (&win)[MAXW][VEC],
                   int W, float (&z)[VEC]) {
#pragma unroll
  for (int v = 0; v < VEC; ++v) {
    float acc = b[v];
#pragma unroll
    for (int m = 0; m < MAXW; ++m)
      if (m >= MAXW - W) acc += wt[m][v] * win[m][v];  // skipped taps never touch a value (Inf * 0)
    z[v] = acc;
  }
}

template <typename T, int VEC, int MAXW>
GDN_HD void conv_fwd_thread(const ConvArgs<T>& a, int64_t tile, int64_t cg) {
  const int64_t c0 = cg * VEC;
  if (c0 >= a.D) return;
  float wt[MAXW][VEC], b[VEC], win[MAXW][VEC];
  load_taps<VEC, MAXW>(a, c0, wt, b);
  const int64_t r0 = tile * a.tile_rows, r1 = min64(r0 + a.tile_rows, a.T_);
  RowLoc L = padding_row();
  int64_t prev_seq = -1, prev_pos = 0;
  for (int64_t r = r0; r < r1; ++r) {
    L = r == r0 ? locate_row(a.cu, a.padded, a.N, r) : next_row(L, a.cu, a.padded, a.N, r);
    float out[VEC];
    if (L.seq < 0) {
#pragma unroll
      for (int v = 0; v < VEC; ++v) out[v] = 0.f;
      prev_seq = -1;
    } else {
      slide_window<VEC, MAXW>(a, L, L.seq == prev_seq && L.pos == prev_pos + 1, c0, win);
      prev_seq = L.seq;
      prev_pos = L.pos;
      preact<VEC, MAXW>(wt, b, win, a.W, out);
#pragma unroll
      for (int v = 0; v < VEC; ++v) out[v] = act(out[v], a.silu);
    }
    store_vec<T, VEC>(a.y + r * a.D + c0, out);
  }
}

template <typename T>
GDN_HD void conv_final_state_thread(const ConvArgs<T>& a, int64_t n, int64_t c) {
  if (n >= a.N || c >= a.D) return;
  const RowLoc L = seq_start(a.cu, a.padded, n);
  for (int j = 0; j < a.W - 1; ++j) {
    float v[1];
    load_xin<T, 1>(a, L, L.len - (a.W - 1) + j, c, v);
    a.final_state[(n * a.D + c) * (a.W - 1) + j] = from_f<T>(v[0]);
  }
}

template <typename T, int VEC, int MAXW>
GDN_HD void conv_bwd_thread(const ConvArgs<T>& a, int64_t tile, int64_t cg) {
  const int64_t c0 = cg * VEC;
  if (c0 >= a.D) return;
  const int W = a.W;
  float wt[MAXW][VEC], b[VEC], win[MAXW][VEC];
  float dxa[MAXW][VEC];    // dx partial sums of rows r - (MAXW-1) .. r
  int64_t seqr[MAXW];      // their sequences (-1: padding)
  float dw[MAXW][VEC], db[VEC];
  load_taps<VEC, MAXW>(a, c0, wt, b);
#pragma unroll
  for (int m = 0; m < MAXW; ++m) {
    seqr[m] = -1;
#pragma unroll
    for (int v = 0; v < VEC; ++v) dxa[m][v] = dw[m][v] = win[m][v] = 0.f;
  }
#pragma unroll
  for (int v = 0; v < VEC; ++v) db[v] = 0.f;
  const int64_t r0 = tile * a.tile_rows, r1 = min64(r0 + a.tile_rows, a.T_);
  RowLoc L = padding_row();
  int64_t prev_seq = -1, prev_pos = 0;
  for (int64_t r = r0; r < r1 + MAXW - 1; ++r) {
#pragma unroll
    for (int m = 0; m < MAXW - 1; ++m) {
      seqr[m] = seqr[m + 1];
#pragma unroll
      for (int v = 0; v < VEC; ++v) dxa[m][v] = dxa[m + 1][v];
    }
    seqr[MAXW - 1] = -1;
#pragma unroll
    for (int v = 0; v < VEC; ++v) dxa[MAXW - 1][v] = 0.f;
    if (r < a.T_) {
      L = r == r0 ? locate_row(a.cu, a.padded, a.N, r) : next_row(L, a.cu, a.padded, a.N, r);
    } else {
      L = padding_row();
    }
    if (L.seq >= 0) {
      slide_window<VEC, MAXW>(a, L, L.seq == prev_seq && L.pos == prev_pos + 1, c0, win);
      prev_seq = L.seq;
      prev_pos = L.pos;
      float z[VEC], g[VEC];
      preact<VEC, MAXW>(wt, b, win, W, z);
      load_vec<T, VEC>(a.dy + r * a.D + c0, g);
#pragma unroll
      for (int v = 0; v < VEC; ++v) g[v] = act_grad(z[v], g[v], a.silu);   // g = dz
      if (r < r1) {
#pragma unroll
        for (int v = 0; v < VEC; ++v) {
          db[v] += g[v];
#pragma unroll
          for (int m = 0; m < MAXW; ++m)
            if (m >= MAXW - W) dw[m][v] += g[v] * win[m][v];
        }
      }
      // row r - s (same sequence when pos >= s) reads x[r - s] through tap W-1-s = slot MAXW-1-s
#pragma unroll
      for (int m = 0; m < MAXW; ++m)
        if (m >= MAXW - W && L.pos >= MAXW - 1 - m)
#pragma unroll
          for (int v = 0; v < VEC; ++v) dxa[m][v] += wt[m][v] * g[v];
      seqr[MAXW - 1] = L.seq;
    } else {
      prev_seq = -1;
    }
    const int64_t q = r - (MAXW - 1);  // every dz that reaches row q is in by now
    if (q >= r0 && q < r1) {
      float out[VEC];
#pragma unroll
      for (int v = 0; v < VEC; ++v) out[v] = dxa[0][v];
      if (seqr[0] >= 0 && a.dfinal != nullptr) {  // x[q] is final-state column pos - len + W - 1
        const RowLoc S = seq_start(a.cu, a.padded, seqr[0]);
        const int64_t j = (q - S.base) - S.len + W - 1;
        if (j >= 0)
#pragma unroll
          for (int v = 0; v < VEC; ++v) out[v] += to_f(a.dfinal[(S.seq * a.D + c0 + v) * (W - 1) + j]);
      }
      store_vec<T, VEC>(a.dx + q * a.D + c0, out);
    }
  }
#pragma unroll
  for (int v = 0; v < VEC; ++v) {
    float* p = a.partial + (tile * a.D + c0 + v) * (W + 1);
#pragma unroll
    for (int m = 0; m < MAXW; ++m)
      if (m >= MAXW - W) p[m - MAXW + W] = dw[m][v];
    p[W] = db[v];
  }
}

// dz at position q of sequence L, channel c (scalar; the same formula as the tile body).
template <typename T>
GDN_HD float dz_at(const ConvArgs<T>& a, const RowLoc& L, int64_t q, int64_t c) {
  float z = a.bias != nullptr ? a.bias[c] : 0.f;
  for (int w = 0; w < a.W; ++w) {
    float xv[1];
    load_xin<T, 1>(a, L, q - (a.W - 1) + w, c, xv);
    z += a.w[c * a.W + w] * xv[0];
  }
  return act_grad(z, to_f(a.dy[(L.base + q) * a.D + c]), a.silu);
}

template <typename T>
GDN_HD void conv_bwd_state_thread(const ConvArgs<T>& a, int64_t n, int64_t c) {
  if (n >= a.N || c >= a.D) return;
  constexpr int kMaxCols = 7;  // W - 1 <= 7 columns, compile-time indexed (registers)
  const RowLoc L = seq_start(a.cu, a.padded, n);
  const int W = a.W;
  float acc[kMaxCols];
#pragma unroll
  for (int j = 0; j < kMaxCols; ++j) {  // a sequence shorter than W-1 passes column j to final j - len
    const bool pass = a.dfinal != nullptr && j < W - 1 && j >= L.len;
    acc[j] = pass ? to_f(a.dfinal[(n * a.D + c) * (W - 1) + (j - L.len)]) : 0.f;
  }
  // column j (virtual position j - (W-1)) reaches output q through tap j - q: q < W - 1 only
  for (int64_t q = 0; q < min64(L.len, W - 1); ++q) {
    const int64_t row = L.base + q;
    if (row < 0 || row >= a.T_) continue;
    const float dz = dz_at(a, L, q, c);
#pragma unroll
    for (int j = 0; j < kMaxCols; ++j)
      if (j < W - 1 && j >= q) acc[j] += a.w[c * W + (j - q)] * dz;
  }
#pragma unroll
  for (int j = 0; j < kMaxCols; ++j)
    if (j < W - 1) a.dh0[(n * a.D + c) * (W - 1) + j] = from_f<T>(acc[j]);
}

GDN_HD void wgrad_reduce_thread(const float* partial, int64_t tiles, int64_t cols, int64_t i, float* out) {
  if (i >= cols) return;
  float acc = 0.f;
  for (int64_t t = 0; t < tiles; ++t) acc += partial[t * cols + i];  // fixed order: tile 0, 1, ...
  out[i] = acc;
}

// ---- kernels: thread index -> the bodies above ---------------------------------------------------
template <typename T, int VEC, int MAXW>
__global__ void __launch_bounds__(kThreads) conv1d_fwd_kernel(ConvArgs<T> a, int64_t groups, int64_t total) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i < total) conv_fwd_thread<T, VEC, MAXW>(a, i / groups, i % groups);
}

template <typename T, int VEC, int MAXW>
__global__ void __launch_bounds__(kThreads) conv1d_bwd_kernel(ConvArgs<T> a, int64_t groups, int64_t total) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i < total) conv_bwd_thread<T, VEC, MAXW>(a, i / groups, i % groups);
}

template <typename T>
__global__ void __launch_bounds__(kThreads) conv1d_final_state_kernel(ConvArgs<T> a) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i < a.N * a.D) conv_final_state_thread<T>(a, i / a.D, i % a.D);
}

template <typename T>
__global__ void __launch_bounds__(kThreads) conv1d_bwd_state_kernel(ConvArgs<T> a) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i < a.N * a.D) conv_bwd_state_thread<T>(a, i / a.D, i % a.D);
}

__global__ void __launch_bounds__(kThreads)
conv1d_wgrad_reduce_kernel(const float* __restrict__ partial, int64_t tiles, int64_t cols, float* __restrict__ out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  wgrad_reduce_thread(partial, tiles, cols, i, out);
}

// ---- dispatch -------------------------------------------------------------------------------------
template <typename T>
ConvArgs<T> make_args(const ConvParams& p) {
  ConvArgs<T> a{};
  a.x = reinterpret_cast<const T*>(p.x);
  a.w = reinterpret_cast<const float*>(p.weight);
  a.bias = reinterpret_cast<const float*>(p.bias);
  a.h0 = reinterpret_cast<const T*>(p.initial_state);
  a.cu = reinterpret_cast<const int64_t*>(p.cu_seqlens);
  a.padded = reinterpret_cast<const int64_t*>(p.cu_seqlens_padded);
  a.N = p.N;
  a.T_ = p.T;
  a.D = p.D;
  a.W = p.W;
  a.silu = p.silu;
  a.tile_rows = p.tile_rows;
  a.y = reinterpret_cast<T*>(p.y);
  a.final_state = reinterpret_cast<T*>(p.final_state);
  a.dy = reinterpret_cast<const T*>(p.dy);
  a.dfinal = reinterpret_cast<const T*>(p.dfinal);
  a.dx = reinterpret_cast<T*>(p.dx);
  a.partial = reinterpret_cast<float*>(p.partial);
  a.dwb = reinterpret_cast<float*>(p.dweight_bias);
  a.dh0 = reinterpret_cast<T*>(p.dinitial_state);
  return a;
}

template <typename T, int VEC, int MAXW>
void run_tiles(const ConvArgs<T>& a, bool bwd, bool host, cudaStream_t stream) {
  const int64_t groups = a.D / VEC, tiles = (a.T_ + a.tile_rows - 1) / a.tile_rows;
  const int64_t total = groups * tiles;
  if (host) {
    for (int64_t i = 0; i < total; ++i) {
      if (bwd) conv_bwd_thread<T, VEC, MAXW>(a, i / groups, i % groups);
      else conv_fwd_thread<T, VEC, MAXW>(a, i / groups, i % groups);
    }
  } else if (total > 0) {
    if (bwd) conv1d_bwd_kernel<T, VEC, MAXW><<<blocks_for(total, kThreads), kThreads, 0, stream>>>(a, groups, total);
    else conv1d_fwd_kernel<T, VEC, MAXW><<<blocks_for(total, kThreads), kThreads, 0, stream>>>(a, groups, total);
  }
}

template <typename T, int MAXW>
void run_tiles_vec(const ConvArgs<T>& a, bool bwd, bool host, cudaStream_t stream) {
  constexpr int kVec16 = static_cast<int>(16 / sizeof(T));
  constexpr int VEC = MAXW > 4 && kVec16 > 4 ? 4 : kVec16;
  const void* ptrs[] = {a.x, bwd ? static_cast<const void*>(a.dy) : static_cast<const void*>(a.y),
                        bwd ? static_cast<const void*>(a.dx) : nullptr};
  bool vec = a.D % VEC == 0;
  for (const void* p : ptrs) vec = vec && (p == nullptr || reinterpret_cast<std::uintptr_t>(p) % (VEC * sizeof(T)) == 0);
  if (vec) run_tiles<T, VEC, MAXW>(a, bwd, host, stream);
  else run_tiles<T, 1, MAXW>(a, bwd, host, stream);
}

template <typename T>
Status run(const ConvParams& p, bool bwd, bool host, cudaStream_t stream) {
  const ConvArgs<T> a = make_args<T>(p);
  if (a.W <= 4) run_tiles_vec<T, 4>(a, bwd, host, stream);
  else run_tiles_vec<T, 8>(a, bwd, host, stream);
  const int64_t nd = a.N * a.D;
  if (host) {
    for (int64_t i = 0; i < nd; ++i) {
      if (bwd) conv_bwd_state_thread<T>(a, i / a.D, i % a.D);
      else conv_final_state_thread<T>(a, i / a.D, i % a.D);
    }
  } else if (nd > 0 && a.W > 1) {
    if (bwd) conv1d_bwd_state_kernel<T><<<blocks_for(nd, kThreads), kThreads, 0, stream>>>(a);
    else conv1d_final_state_kernel<T><<<blocks_for(nd, kThreads), kThreads, 0, stream>>>(a);
  }
  if (bwd) {
    const int64_t tiles = (a.T_ + a.tile_rows - 1) / a.tile_rows, cols = a.D * (a.W + 1);
    if (host) {
      for (int64_t i = 0; i < cols; ++i) wgrad_reduce_thread(a.partial, tiles, cols, i, a.dwb);
    } else if (cols > 0) {
      conv1d_wgrad_reduce_kernel<<<blocks_for(cols, kThreads), kThreads, 0, stream>>>(a.partial, tiles, cols, a.dwb);
    }
  }
  return host ? Status{} : launch_status(bwd ? "conv1d_varlen_bwd" : "conv1d_varlen_fwd");
}

Status check(const ConvParams& p, bool bwd) {
  auto bad = [](const std::string& m) { return Status::invalid("conv1d_varlen: " + m); };
  if (p.W < 1 || p.W > 8) return bad("W must be in 1..8, got " + std::to_string(p.W));
  if (p.N < 0 || p.T < 0 || p.D < 0) return bad("N, T and D must be >= 0");
  if (p.tile_rows <= 0) return bad("tile_rows must be positive");
  if (p.dtype < kF32 || p.dtype > kBF16) return bad("dtype code must be 0, 1 or 2");
  if (p.x == 0 && p.T * p.D > 0) return bad("x is null");
  if (p.weight == 0 || p.cu_seqlens == 0) return bad("weight and cu_seqlens are required");
  // an empty tensor may have a null pointer: rows and states are required only when there are any
  const bool rows = p.T * p.D > 0, states = p.N * p.D * (p.W - 1) > 0;
  if (!bwd && ((p.y == 0 && rows) || (p.final_state == 0 && states)))
    return bad("y and final_state are required");
  if (bwd && (((p.dy == 0 || p.dx == 0 || p.partial == 0) && rows) || (p.dweight_bias == 0 && p.D > 0) ||
              (p.dinitial_state == 0 && states)))
    return bad("dy, dx, partial, dweight_bias and dinitial_state are required");
  return {};
}

}  // namespace

Status conv1d_varlen(const ConvParams& p, bool bwd, bool host, int device, std::uintptr_t stream) {
  Status st = check(p, bwd);
  if (!st.ok()) return st;
  if (!host) {
    st = use_device(device, "conv1d_varlen");
    if (!st.ok()) return st;
  }
  auto s = reinterpret_cast<cudaStream_t>(stream);
  switch (p.dtype) {
    case kF32: return run<float>(p, bwd, host, s);
    case kF16: return run<__half>(p, bwd, host, s);
    default: return run<__nv_bfloat16>(p, bwd, host, s);
  }
}

}  // namespace gdn
