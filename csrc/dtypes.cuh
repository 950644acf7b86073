// Element types, 16-byte vector packs and launch helpers shared by the elementwise-style kernel files
// (conv1d_varlen.cu, recurrent_gdr.cu). All conversions are `__host__ __device__` (cuda_fp16/bf16
// provide host versions), so the host mirrors of the kernels run the exact per-thread bodies.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>

#include "cuda_status.cuh"
#include "segments.cuh"

namespace gdn {

// dtype codes used by the Python side: 0 float32, 1 float16, 2 bfloat16
enum DType : int { kF32 = 0, kF16 = 1, kBF16 = 2 };

GDN_HD float to_f(float x) { return x; }
GDN_HD float to_f(__half x) { return __half2float(x); }
GDN_HD float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> GDN_HD T from_f(float x);
template <> GDN_HD float from_f<float>(float x) { return x; }
template <> GDN_HD __half from_f<__half>(float x) { return __float2half_rn(x); }
template <> GDN_HD __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// VEC consecutive elements, aligned to their size: one LDG/STG of up to 16 bytes.
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

template <typename T, int VEC>
GDN_HD void load_vec(const T* p, float (&out)[VEC]) {
  const Pack<T, VEC> pk = *reinterpret_cast<const Pack<T, VEC>*>(p);
#pragma unroll
  for (int i = 0; i < VEC; ++i) out[i] = to_f(pk.v[i]);
}

// (16-bit types a pair at a time: one packing conversion, the same rounding)
GDN_HD void from_f2(float x, float y, float* out) {
  out[0] = x;
  out[1] = y;
}
GDN_HD void from_f2(float x, float y, __half* out) { *reinterpret_cast<__half2*>(out) = __floats2half2_rn(x, y); }
GDN_HD void from_f2(float x, float y, __nv_bfloat16* out) {
  *reinterpret_cast<__nv_bfloat162*>(out) = __floats2bfloat162_rn(x, y);
}

template <typename T, int VEC>
GDN_HD void store_vec(T* p, const float (&in)[VEC]) {
  Pack<T, VEC> pk;
  if constexpr (VEC % 2 == 0) {
#pragma unroll
    for (int i = 0; i < VEC; i += 2) from_f2(in[i], in[i + 1], &pk.v[i]);
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) pk.v[i] = from_f<T>(in[i]);
  }
  *reinterpret_cast<Pack<T, VEC>*>(p) = pk;
}

GDN_HD bool aligned16(const void* p) { return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0; }

inline unsigned blocks_for(int64_t threads, int block) {
  return static_cast<unsigned>((threads + block - 1) / block);
}

}  // namespace gdn
