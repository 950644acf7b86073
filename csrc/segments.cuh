// Segment / chunk index logic shared by every CUDA kernel of gdn_packed and by the host mirrors
// used in the CPU tests. Everything here is `__host__ __device__` and header-only, so the exact same
// arithmetic runs on the GPU and, through `chunk_table_host`, in a plain CPU loop.
//
// Chunk table contract (identical in gdn_packed/torch_ref/chunk_table.py):
//   NC          = T / C + N                          (static upper bound on the number of chunks)
//   len_i       = max(cu[i+1] - cu[i], 0), base_i = padded[i] (padded defaults to cu)
//   nchunks_i   = ceil(len_i / C)
//   cu_chunks   = min([0, cumsum(nchunks)], NC)      int32 [N+1]
//   table[j]    = (seq_id, chunk_idx, start_row, length) int32 [NC, 4]
//       start_row = base_i + chunk_idx * C           (stored clamped to [-INT32_MAX, INT32_MAX])
//       length    = clamp(min(C, len_i - chunk_idx*C, T - start_row), 0, C); 0 if start_row
//                   is outside [0, T)
//   slots j >= cu_chunks[N] hold (-1, 0, 0, 0).
// A corrupt cu_seqlens (decreasing, negative, past T) never yields a row outside [0, T).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define GDN_HD __host__ __device__ __forceinline__
#else
#define GDN_HD inline
#endif

namespace gdn {

constexpr int64_t kInt32Max = 2147483647LL;

GDN_HD int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
GDN_HD int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }
GDN_HD int64_t clamp64(int64_t x, int64_t lo, int64_t hi) { return min64(max64(x, lo), hi); }

// Saturating add of two non-negative values bounded by `cap` (no overflow for any cap < 2^62).
GDN_HD int64_t sat_add(int64_t a, int64_t b, int64_t cap) { return min64(a + b, cap); }

// Real length of sequence i: max(cu[i+1] - cu[i], 0). Differences are formed in 64 bits, so an
// int32 cu_seqlens cannot overflow; an absurd int64 difference is clamped to [0, 2^62].
template <typename I>
GDN_HD int64_t seq_len(const I* cu, int64_t i) {
  const int64_t a = static_cast<int64_t>(cu[i]);
  const int64_t b = static_cast<int64_t>(cu[i + 1]);
  if (b <= a) return 0;
  // b - a can overflow int64 only when a < 0 < b with huge magnitudes: guard it.
  if (a < 0 && b > INT64_MAX + a) return (int64_t)1 << 62;
  return min64(b - a, (int64_t)1 << 62);
}

// Storage offset of sequence i: padded[i], or cu[i] when no padded layout is given.
template <typename I>
GDN_HD int64_t seq_base(const I* cu, const I* padded, int64_t i) {
  return static_cast<int64_t>(padded != nullptr ? padded[i] : cu[i]);
}

// Number of chunks of sequence i, already clamped to `nc` (so partial sums stay small).
template <typename I>
GDN_HD int64_t seq_nchunks(const I* cu, int64_t i, int64_t C, int64_t nc) {
  const int64_t len = seq_len(cu, i);
  return min64(len / C + (len % C != 0 ? 1 : 0), nc);
}

// Largest i in [0, n) with cc[i] <= j, for non-decreasing cc with cc[0] <= j.
GDN_HD int64_t find_segment(const int32_t* cc, int64_t n, int64_t j) {
  int64_t lo = 0, hi = n;  // invariant: cc[lo] <= j, answer in [lo, hi)
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (static_cast<int64_t>(cc[mid]) <= j) lo = mid; else hi = mid;
  }
  return lo;
}

// ---- Row-level segment lookup (conv1d_varlen.cu, recurrent_gdr.cu) ---------------------------------
// Which sequence a packed row belongs to: the same rule as gdn_packed.segments.locate_rows. Sequence i
// owns rows [base_i, base_i + len_i); every other row is padding (seq = -1). For a valid layout
// (non-decreasing bases, base_{i+1} >= base_i + len_i) this is exact; for a corrupt one the answer is
// some sequence with base <= row < base + len (callers still bound every row they read to [0, T)).
struct RowLoc {
  int64_t seq;   // sequence index, -1 for a padding row
  int64_t pos;   // position within the sequence
  int64_t len;   // real length of the sequence
  int64_t base;  // storage offset of the sequence
};

GDN_HD RowLoc padding_row() { return RowLoc{-1, 0, 0, 0}; }

// The last i in [0, N] with base_i <= r (so a zero-length sequence never hides the next one).
template <typename I>
GDN_HD RowLoc locate_row(const I* cu, const I* padded, int64_t N, int64_t r) {
  if (N <= 0 || seq_base(cu, padded, 0) > r) return padding_row();
  int64_t lo = 0, hi = N + 1;  // invariant: base_lo <= r, answer in [lo, hi)
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (seq_base(cu, padded, mid) <= r) lo = mid; else hi = mid;
  }
  if (lo >= N) return padding_row();
  const int64_t base = seq_base(cu, padded, lo);
  const int64_t len = seq_len(cu, lo);
  if (r - base >= len) return padding_row();
  return RowLoc{lo, r - base, len, base};
}

// Row r given the location of row r - 1: a step within the sequence, else a fresh lookup.
template <typename I>
GDN_HD RowLoc next_row(const RowLoc& prev, const I* cu, const I* padded, int64_t N, int64_t r) {
  if (prev.seq >= 0 && prev.pos + 1 < prev.len) return RowLoc{prev.seq, prev.pos + 1, prev.len, prev.base};
  return locate_row(cu, padded, N, r);
}

// Sequence i's location record at position 0 (its base and length), without a search.
template <typename I>
GDN_HD RowLoc seq_start(const I* cu, const I* padded, int64_t i) {
  return RowLoc{i, 0, seq_len(cu, i), seq_base(cu, padded, i)};
}

// Rows [begin, end) of sequence i clamped to the tensor: a corrupt layout never yields a row outside
// [0, T). `pad_end` is where the padding that follows the sequence stops (the next base, or T).
template <typename I>
GDN_HD void seq_rows(const I* cu, const I* padded, int64_t N, int64_t T, int64_t i, int64_t* begin,
                     int64_t* end, int64_t* pad_end) {
  const int64_t base = seq_base(cu, padded, i);
  const int64_t b = clamp64(base, 0, T);
  const int64_t e = base >= T ? T : clamp64(base + min64(seq_len(cu, i), T), b, T);  // no overflow
  *begin = b;
  *end = e;
  *pad_end = i + 1 < N ? clamp64(seq_base(cu, padded, i + 1), e, T) : T;
}

// One slot of the chunk table: writes row j (4 int32) from cu_chunks [N+1] (already built).
template <typename I>
GDN_HD void chunk_table_slot(const I* cu, const I* padded, const int32_t* cu_chunks, int64_t N,
                             int64_t T, int64_t C, int64_t j, int32_t* row) {
  const int64_t total = N > 0 ? static_cast<int64_t>(cu_chunks[N]) : 0;
  if (j >= total) {
    row[0] = -1; row[1] = 0; row[2] = 0; row[3] = 0;
    return;
  }
  const int64_t i = find_segment(cu_chunks, N, j);
  const int64_t chunk_idx = j - static_cast<int64_t>(cu_chunks[i]);
  const int64_t len = seq_len(cu, i);
  const int64_t base = seq_base(cu, padded, i);
  const int64_t off = chunk_idx * C;  // < 2^31 * 2^31: fits int64
  // base + off: base is an int64 storage offset, off < 2^62: saturate instead of overflowing.
  int64_t start;
  if (base > 0 && off > INT64_MAX - base) start = INT64_MAX; else start = base + off;
  int64_t length = 0;
  if (start >= 0 && start < T) {
    length = clamp64(min64(min64(C, len - off), T - start), 0, C);
  }
  row[0] = static_cast<int32_t>(i);
  row[1] = static_cast<int32_t>(chunk_idx);
  row[2] = static_cast<int32_t>(clamp64(start, -kInt32Max, kInt32Max));
  row[3] = static_cast<int32_t>(length);
}

// ---- Padding rows around the chunk table's sequences (the chunked kernels; the same rule as
// gdn_packed/triton/common.py padding_after / padding_before_first) ------------------------------------
// Padding rows [a, b) that follow sequence n's last real row, up to the first real row of the next
// sequence that has one (or T). Empty (a == b) when sequence n has no chunks. Clamped to [0, T]: a
// corrupt cu_seqlens gives zero-length chunks whose start row may lie outside the rows.
GDN_HD void padding_after(const int32_t* table, const int32_t* cu_chunks, int64_t n, int64_t N, int64_t T,
                          int64_t* a, int64_t* b) {
  const int64_t c0 = cu_chunks[n], c1 = cu_chunks[n + 1], total = cu_chunks[N];
  const int64_t last = max64(c1 - 1, 0);
  const int64_t end = static_cast<int64_t>(table[last * 4 + 2]) + table[last * 4 + 3];
  const int64_t nxt = max64(min64(c1, total - 1), 0);
  const int64_t bb = clamp64(c1 < total ? static_cast<int64_t>(table[nxt * 4 + 2]) : T, 0, T);
  *a = clamp64(c1 > c0 ? end : bb, 0, bb);
  *b = bb;
}

// Padding rows [0, b) before the first real row of the packed tensor (b = T when there is none).
GDN_HD int64_t padding_before_first(const int32_t* table, const int32_t* cu_chunks, int64_t N, int64_t T) {
  return clamp64(cu_chunks[N] > 0 ? static_cast<int64_t>(table[2]) : T, 0, T);
}

}  // namespace gdn
