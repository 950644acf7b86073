// The warp-cooperative code of the sm_90a device policy (DevPolicy, csrc/chunk_gdr_sm90_device.cuh), compiled
// by the host compiler unchanged and run by one emulated warpgroup: 128 threads (4 warps of 32 lanes), each
// a std::thread with its own threadIdx. Judged against float64 math of the same inputs: the claimed
// accumulator layout (row, col) against the PTX ISA's wgmma D fragment, and quad_rows_add, add_row_sums,
// row_dot, add_diag, sum_rows / rev_sum / fwd_sum and add_col_sums against row sums, row dots, the diagonal,
// scans and column sums; vt (ldmatrix .trans) and store (stmatrix, .trans or not) against the tiles they
// read and write (store_diag_block: its block only); diag_inverse (prep's 16 x 16 diagonal inverses,
// mma.sync and movmatrix in registers)
// against the same products in double and the exact inverse; shared memory outside a function's outputs
// must keep its guard bytes.
// What nvcc would provide is emulated here: threadIdx, the warp shuffles (__shfl*_sync of full warps, width
// 32, CUDA's out-of-range rules), shared memory (one array; __cvta_generic_to_shared gives offsets into it),
// and, through the header's GDN_LANE_SHIM hooks, bar.sync (named_sync), row_dot's ld.shared.u32,
// ldmatrix / stmatrix .x4 (from the PTX ISA's description of their m8n8 fragments), movmatrix .trans and
// mma.sync m16n8k16 of fp16 operands (from its description of their fragments).
// Every lane of a warp must reach every shuffle (and ldmatrix / stmatrix) and all 128 threads every bar.sync,
// at the same call: a lane that returns early, or waits at another one, fails the run naming the check and
// the lanes.
// lanes_sm90 [seeds]: prints "lanes_sm90: ok, ..." and exits 0, or FAIL lines and exits 1.
#include <cuda_runtime.h>   // uint3, and __device__ / __forceinline__ as a host compile defines them
#include <cuda_fp16.h>      // __half (mma.sync's emulated operands)

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <mutex>
#include <random>
#include <source_location>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

thread_local uint3 threadIdx;

namespace lane_shim {

constexpr int kThreads = 128;
constexpr uint32_t kSmemBytes = 48 * 1024;
alignas(1024) unsigned char smem[kSmemBytes];
std::string check = "setup";                 // the check running (failure messages)
thread_local int tid;                        // the emulated thread, 0 .. 127 (threadIdx.x & 127)
thread_local long shfl_count, bar_count;     // its shuffles and bar.syncs so far in this launch

[[noreturn]] void fail(const std::string& msg) {
  std::fprintf(stdout, "FAIL %s: %s\n", check.c_str(), msg.c_str());
  std::fflush(stdout);
  std::_Exit(1);
}

// Where a member waits: the operation (shuffle kind and call site, or bar.sync and its id) and the
// member's count of such operations in this launch.
struct Site {
  std::string op;
  long n = -1;
  bool operator==(const Site&) const = default;
  std::string str() const { return op + " #" + std::to_string(n); }
};

// A barrier of `size` members (a warp's 32 lanes, or bar.sync's 128 threads) that fails the run where the
// members wait at different sites, where a member has returned while others wait, or after 60 s.
struct Barrier {
  std::mutex m;
  std::condition_variable cv;
  std::string name;
  int size = 0, arrived = 0;
  unsigned long gen = 0;
  Site at[kThreads];
  bool in[kThreads] = {}, gone[kThreads] = {};

  void reset(std::string nm, int n) {
    name = std::move(nm);
    size = n;
    arrived = 0;
    std::fill(in, in + kThreads, false);
    std::fill(gone, gone + kThreads, false);
  }
  std::string members(bool want_in, bool want_gone) const {
    std::string s;
    for (int k = 0; k < size; ++k)
      if (in[k] == want_in && gone[k] == want_gone) s += (s.empty() ? "" : ",") + std::to_string(k);
    return s.empty() ? "none" : s;
  }
  void arrive(int k, const Site& site) {
    std::unique_lock lk(m);
    at[k] = site;
    in[k] = true;
    if (++arrived == size) {
      for (int j = 0; j < size; ++j)
        if (!(at[j] == at[0]))
          fail(name + ": member " + std::to_string(j) + " at " + at[j].str() + ", member 0 at " + at[0].str());
      arrived = 0;
      std::fill(in, in + size, false);
      ++gen;
      cv.notify_all();
      return;
    }
    const unsigned long g = gen;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (gen == g) {
      if (std::any_of(gone, gone + size, [](bool b) { return b; }))
        fail(name + ": members " + members(false, true) + " returned while members " + members(true, false) +
             " wait at " + site.str());
      if (cv.wait_until(lk, deadline) == std::cv_status::timeout && gen == g)
        fail(name + ": 60 s at " + site.str() + ", members " + members(true, false) + " waiting, " +
             members(false, false) + " neither waiting nor returned");
    }
  }
  void leave(int k) {
    std::lock_guard lk(m);
    gone[k] = true;
    cv.notify_all();
  }
};

struct Warp {
  Barrier bar;
  uint64_t slot[32];       // the lanes' shuffle operands
  uint32_t row_addr[32];   // the lanes' row addresses of an ldmatrix / stmatrix
  uint32_t mma[32][6];     // the lanes' registers of an mma.sync (a0..a3, b0, b1) or a movmatrix (mma[l][0])
};
Warp warps[kThreads / 32];
Barrier named[16];      // bar.sync 0 .. 15

// A shuffle of the calling lane's warp: every lane posts its value, then reads its source lane's.
enum class Shfl { kIdx, kUp, kDown, kXor };
template <class V>
V shfl(Shfl kind, unsigned mask, V v, int arg, int width, const std::source_location& loc) {
  static_assert(std::is_trivially_copyable_v<V> && sizeof(V) <= 8, "a 32- or 64-bit shuffle");
  static const char* names[] = {"__shfl_sync", "__shfl_up_sync", "__shfl_down_sync", "__shfl_xor_sync"};
  const Site site{std::string(names[static_cast<int>(kind)]) + " at line " + std::to_string(loc.line()) + ":" +
                      std::to_string(loc.column()), shfl_count++};
  if (mask != 0xffffffffu || width != 32)
    fail(site.str() + ": only full-warp shuffles of width 32 are emulated");
  const int lane = tid & 31;
  Warp& w = warps[tid >> 5];
  std::memcpy(&w.slot[lane], &v, sizeof(V));
  w.bar.arrive(lane, site);
  int src = lane;                       // CUDA: a source lane outside the warp gives the caller's own value
  switch (kind) {
    case Shfl::kIdx: src = arg & 31; break;                       // srcLane modulo the width
    case Shfl::kUp: if (arg >= 0 && arg <= lane) src = lane - arg; break;
    case Shfl::kDown: if (arg >= 0 && lane + arg < 32) src = lane + arg; break;
    case Shfl::kXor: if ((lane ^ arg) >= 0 && (lane ^ arg) < 32) src = lane ^ arg; break;
  }
  V r;
  std::memcpy(&r, &w.slot[src], sizeof(V));
  w.bar.arrive(lane, site);             // no lane posts its next value before every lane has read
  return r;
}

// bar.sync id, count (named_sync's hook): the warpgroup's 128 threads
inline void bar_sync(int id, int count) {
  const Site site{"bar.sync " + std::to_string(id), bar_count++};
  if (count != kThreads || id < 0 || id >= 16) fail(site.str() + ": bar.sync of 128 threads, ids 0 .. 15 only");
  named[id].arrive(tid, site);
}

// ld.shared.u32 (row_dot's hook)
inline uint32_t ld_shared_u32(uint32_t addr) {
  if (addr % 4 != 0 || addr + 4 > kSmemBytes) fail("ld.shared.u32 at " + std::to_string(addr));
  uint32_t u;
  std::memcpy(&u, smem + addr, 4);
  return u;
}

// ldmatrix / stmatrix .m8n8.x4 .b16 (vt's and stmatrix's hooks), as the PTX ISA describes them: lanes
// 8 i .. 8 i + 7 give the shared addresses of rows 0 .. 7 of matrix i (16 bytes each, 16-byte aligned); lane
// l's register i holds elements (l / 4, 2 (l % 4) + k), k = 0, 1 (k = 0 in the low half) of matrix i, with
// .trans elements (2 (l % 4) + k, l / 4) of the matrix in memory.
Site post_rows(const char* op, uint32_t addr, const std::source_location& loc) {
  const Site site{std::string(op) + " at line " + std::to_string(loc.line()), shfl_count++};
  if (addr % 16 != 0 || addr + 16 > kSmemBytes) fail(site.str() + ": a row at " + std::to_string(addr));
  Warp& w = warps[tid >> 5];
  w.row_addr[tid & 31] = addr;
  w.bar.arrive(tid & 31, site);
  return site;
}
uint32_t element_addr(int i, int row, int col) { return warps[tid >> 5].row_addr[8 * i + row] + 2 * col; }

inline void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr,
                              std::source_location loc = std::source_location::current()) {
  const int l = tid & 31;
  const Site site = post_rows("ldmatrix.x4.trans", addr, loc);
  for (int i = 0; i < 4; ++i) {
    uint16_t e[2];
    for (int k = 0; k < 2; ++k) std::memcpy(&e[k], smem + element_addr(i, 2 * (l % 4) + k, l / 4), 2);
    r[i] = e[0] | static_cast<uint32_t>(e[1]) << 16;
  }
  warps[tid >> 5].bar.arrive(l, site);   // no lane posts its next rows before every lane is done
}
inline void stmatrix_x4(uint32_t addr, const uint32_t (&r)[4], bool trans,
                        std::source_location loc = std::source_location::current()) {
  const int l = tid & 31;
  const Site site = post_rows(trans ? "stmatrix.x4.trans" : "stmatrix.x4", addr, loc);
  for (int i = 0; i < 4; ++i)
    for (int k = 0; k < 2; ++k) {
      const uint16_t e = static_cast<uint16_t>(r[i] >> 16 * k);
      std::memcpy(smem + (trans ? element_addr(i, 2 * (l % 4) + k, l / 4) : element_addr(i, l / 4, 2 * (l % 4) + k)),
                  &e, 2);
    }
  warps[tid >> 5].bar.arrive(l, site);
}

// movmatrix.sync.aligned.m8n8.trans.b16 (movmatrix_trans's hook), as the PTX ISA describes it: lane l holds
// elements (l / 4, 2 (l % 4) + k), k = 0 in the low half, of the 8 x 8 matrix before, and the same elements
// of its transpose after, i.e. elements (2 (l % 4) + k, l / 4) of the matrix before.
uint16_t half_of(uint32_t u, int k) { return static_cast<uint16_t>(u >> 16 * k); }
inline uint32_t movmatrix_trans(uint32_t x, std::source_location loc = std::source_location::current()) {
  const int l = tid & 31;
  const Site site{"movmatrix.trans at line " + std::to_string(loc.line()), shfl_count++};
  Warp& w = warps[tid >> 5];
  w.mma[l][0] = x;
  w.bar.arrive(l, site);
  uint32_t y = 0;
  for (int k = 0; k < 2; ++k) {                     // element (2 (l % 4) + k, l / 4) of the matrix
    const int r = 2 * (l % 4) + k, c = l / 4;
    y |= static_cast<uint32_t>(half_of(w.mma[4 * r + c / 2][0], c % 2)) << 16 * k;
  }
  w.bar.arrive(l, site);
  return y;
}

// mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 with C = D (hmma_16816_f16's hook), as the PTX ISA's
// fragments describe it (groupID g = l / 4, threadID_in_group t = l % 4): A's ai (a[i / 2], half i % 2) at
// row g + 8 (bit 1 of i), column 2 t + (bit 0 of i) + 8 (bit 2 of i); B's bi (b[i / 2], half i % 2) at
// row 2 t + (bit 0 of i) + 8 (bit 1 of i), column g; C / D's ci at row g + 8 (bit 1 of i), column
// 2 t + (bit 0 of i). The products of fp16 values are exact; their sum here in double, added in fp32.
inline void mma_m16n8k16_f16(float* d, const uint32_t (&a)[4], uint32_t b0, uint32_t b1,
                             std::source_location loc = std::source_location::current()) {
  const int l = tid & 31;
  const Site site{"mma.sync.m16n8k16 at line " + std::to_string(loc.line()), shfl_count++};
  Warp& w = warps[tid >> 5];
  for (int i = 0; i < 4; ++i) w.mma[l][i] = a[i];
  w.mma[l][4] = b0;
  w.mma[l][5] = b1;
  w.bar.arrive(l, site);
  auto h = [](uint16_t u) {
    __half x;
    std::memcpy(&x, &u, 2);
    return static_cast<double>(__half2float(x));
  };
  double A[16][16], B[16][8];
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane / 4, t = lane % 4;
    for (int i = 0; i < 8; ++i) A[g + 8 * ((i >> 1) & 1)][2 * t + (i & 1) + 8 * ((i >> 2) & 1)] = h(half_of(w.mma[lane][i / 2], i % 2));
    for (int i = 0; i < 4; ++i) B[2 * t + (i & 1) + 8 * ((i >> 1) & 1)][g] = h(half_of(w.mma[lane][4 + i / 2], i % 2));
  }
  w.bar.arrive(l, site);                            // every lane has read the others' registers
  const int g = l / 4, t = l % 4;
  for (int i = 0; i < 4; ++i) {
    const int r = g + 8 * ((i >> 1) & 1), c = 2 * t + (i & 1);
    double s = 0;
    for (int k = 0; k < 16; ++k) s += A[r][k] * B[k][c];
    d[i] += static_cast<float>(s);
  }
}

}  // namespace lane_shim

inline size_t __cvta_generic_to_shared(const void* p) {
  const auto* b = static_cast<const unsigned char*>(p);
  if (b < lane_shim::smem || b >= lane_shim::smem + lane_shim::kSmemBytes)
    lane_shim::fail("__cvta_generic_to_shared of an address outside shared memory");
  return static_cast<size_t>(b - lane_shim::smem);
}

template <class V>
V __shfl_sync(unsigned mask, V v, int src, int width = 32, std::source_location loc = std::source_location::current()) {
  return lane_shim::shfl(lane_shim::Shfl::kIdx, mask, v, src, width, loc);
}
template <class V>
V __shfl_up_sync(unsigned mask, V v, unsigned delta, int width = 32,
                 std::source_location loc = std::source_location::current()) {
  return lane_shim::shfl(lane_shim::Shfl::kUp, mask, v, static_cast<int>(delta), width, loc);
}
template <class V>
V __shfl_down_sync(unsigned mask, V v, unsigned delta, int width = 32,
                   std::source_location loc = std::source_location::current()) {
  return lane_shim::shfl(lane_shim::Shfl::kDown, mask, v, static_cast<int>(delta), width, loc);
}
template <class V>
V __shfl_xor_sync(unsigned mask, V v, int lane_mask, int width = 32,
                  std::source_location loc = std::source_location::current()) {
  return lane_shim::shfl(lane_shim::Shfl::kXor, mask, v, lane_mask, width, loc);
}

#include "chunk_gdr_sm90_device.cuh"

namespace {

using lane_shim::kThreads;
using lane_shim::smem;
using P = gdn::sm90::DevPolicy<__nv_bfloat16>;
constexpr int kC = gdn::sm90::kC;

// ---- the emulated warpgroup: 128 worker threads, one launch at a time
struct Group {
  std::mutex m;
  std::condition_variable cv;
  std::function<void(int)> body;
  unsigned long gen = 0;
  int done = 0;
  int base = 0;                         // threadIdx.x of thread 0: 128 x the warpgroup's index in its CTA
  std::vector<std::thread> threads;

  Group() {
    for (int t = 0; t < kThreads; ++t) threads.emplace_back([this, t] { work(t); });
  }
  void work(int t) {
    unsigned long seen = 0;
    for (;;) {
      std::function<void(int)> fn;
      {
        std::unique_lock lk(m);
        cv.wait(lk, [&] { return gen != seen; });
        seen = gen;
        if (!body) return;
        fn = body;
        threadIdx = uint3{static_cast<unsigned>(base + t), 0, 0};
      }
      lane_shim::tid = t;
      lane_shim::shfl_count = lane_shim::bar_count = 0;
      fn(t);
      lane_shim::warps[t >> 5].bar.leave(t & 31);
      for (auto& b : lane_shim::named) b.leave(t);
      std::lock_guard lk(m);
      if (++done == kThreads) cv.notify_all();
    }
  }
  // body(t) on the 128 threads (threadIdx.x = base + t), returning when every one has returned
  void launch(int wg, std::function<void(int)> fn) {
    for (int w = 0; w < kThreads / 32; ++w)
      lane_shim::warps[w].bar.reset("warp " + std::to_string(w) + " (lanes)", 32);
    for (int id = 0; id < 16; ++id)
      lane_shim::named[id].reset("bar.sync " + std::to_string(id) + " (threads)", kThreads);
    std::unique_lock lk(m);
    body = std::move(fn);
    base = 128 * wg;
    done = 0;
    ++gen;
    cv.notify_all();
    cv.wait(lk, [&] { return done == kThreads; });
  }
  ~Group() {
    {
      std::lock_guard lk(m);
      body = nullptr;
      ++gen;
      cv.notify_all();
    }
    for (auto& th : threads) th.join();
  }
};

// ---- the PTX ISA's wgmma .m64nNk16 D fragment (f32 accumulator): thread t of the warpgroup, warp t / 32,
// lane t % 32, holds N / 2 floats; element i at row 16 warp + lane / 4 + 8 (bit 1 of i), column
// 8 (i / 4) + 2 (lane % 4) + (bit 0 of i)
int ptx_row(int t, int i) { return 16 * (t / 32) + (t % 32) / 4 + 8 * ((i / 2) % 2); }
int ptx_col(int t, int i) { return 8 * (i / 4) + 2 * ((t % 32) % 4) + i % 2; }

template <int N>
P::Frag<N> frag_of(const std::vector<float>& m, int t) {   // m: [64, N] row-major
  P::Frag<N> f;
  for (int i = 0; i < N / 2; ++i) f.d[i] = m[ptx_row(t, i) * N + ptx_col(t, i)];
  return f;
}

// ---- results
long n_values = 0, n_launches = 0, n_failures = 0;
std::string where;   // check, seed and warpgroup of the launch judged

void report(const std::string& msg) {
  if (++n_failures <= 40) std::printf("FAIL %s: %s\n", where.c_str(), msg.c_str());
}
// got against float64 `want` within 1e-5 of `mag` (the sum of the terms' magnitudes: fp32 summation of up to
// 130 terms errs by at most 130 x 2^-24 of it); an infinite want exactly
void expect(const char* what, int idx, float got, double want, double mag) {
  ++n_values;
  const bool ok = std::isinf(want) ? static_cast<double>(got) == want
                                   : std::fabs(static_cast<double>(got) - want) <= 1e-5 * mag;
  if (!ok) report(std::string(what) + "[" + std::to_string(idx) + "] = " + std::to_string(got) + ", want " +
                  std::to_string(want) + " (tolerance " + std::to_string(1e-5 * mag) + ")");
}
void expect_int(const std::string& what, int got, int want) {
  ++n_values;
  if (got != want) report(what + " = " + std::to_string(got) + ", want " + std::to_string(want));
}

// ---- shared memory: guard words everywhere, the inputs and outputs at fixed offsets
constexpr uint32_t kGuard = 0x7fa5a5a5u;   // a NaN: an add into it changes it
constexpr uint32_t kTile = 8192;           // a [64, 64] 16-bit tile (1024-aligned)
constexpr uint32_t kRows = 24576;          // rows / cols: 64 floats
constexpr uint32_t kCols2 = 25088;         // add_col_sums' second vector
constexpr uint32_t kX = 25608;             // the scans' vector: 8-byte but not 16-byte aligned
constexpr uint32_t kPart = 26624;          // add_col_sums' scratch part[4 * 64]

float* at(uint32_t off) { return reinterpret_cast<float*>(smem + off); }
void guard_all() {
  for (uint32_t o = 0; o < lane_shim::kSmemBytes; o += 4) std::memcpy(smem + o, &kGuard, 4);
}
struct Range {
  uint32_t lo, hi;
};
// shared memory outside `writable` unchanged since `before`
void expect_untouched(const std::vector<unsigned char>& before, std::initializer_list<Range> writable) {
  for (uint32_t o = 0; o < lane_shim::kSmemBytes; o += 4) {
    bool w = false;
    for (const Range& r : writable) w |= r.lo <= o && o < r.hi;
    if (!w && std::memcmp(smem + o, before.data() + o, 4) != 0) {
      report("shared byte " + std::to_string(o) + " written (outside the function's outputs)");
      return;
    }
  }
}
std::vector<unsigned char> snapshot() { return {smem, smem + lane_shim::kSmemBytes}; }

// ---- inputs
struct Inputs {
  std::mt19937_64 rng;
  int kind;   // 0: uniform in [-1, 1]; 1: sign x 10^[-3, 3]; 2: 1000 row + col (exact sums; a wrong lane map is large)
  float value(int r, int c) {
    if (kind == 2) return 1000.f * r + c;
    std::uniform_real_distribution<double> u(-1, 1), e(-3, 3);
    if (kind == 0) return static_cast<float>(u(rng));
    return static_cast<float>((u(rng) < 0 ? -1 : 1) * std::pow(10.0, e(rng)));
  }
  std::vector<float> matrix(int n) {
    std::vector<float> m(kC * n);
    for (int r = 0; r < kC; ++r)
      for (int c = 0; c < n; ++c) m[r * n + c] = value(r, c);
    return m;
  }
  std::vector<float> vec() {
    std::vector<float> v(kC);
    for (int r = 0; r < kC; ++r) v[r] = kind == 2 ? 0.5f * r : value(r, 0);
    return v;
  }
};

Group* group;
int launch_wg = 0;   // the warpgroup index (threadIdx.x / 128) of the launches, varied by seed
int launch_bar = 1;  // the policy's named barrier id, varied by seed

void run(const std::function<void(int)>& body) {
  ++n_launches;
  group->launch(launch_wg, body);
}

// ---- the checks
void check_layout() {
  int rows[kThreads][64], cols[kThreads][64];
  run([&](int t) {
    for (int i = 0; i < 64; ++i) {
      rows[t][i] = P::row(i);
      cols[t][i] = P::col(i);
    }
  });
  int tids[kThreads];
  run([&](int t) { tids[t] = P::tid_wg(); });
  for (int n : {64, 128}) {
    std::vector<int> seen(kC * n, 0);
    for (int t = 0; t < kThreads; ++t) {
      expect_int("tid_wg() of thread " + std::to_string(t), tids[t], t);
      for (int i = 0; i < n / 2; ++i) {
        const std::string e =
            "(" + std::to_string(i) + ") of thread " + std::to_string(t) + " (N " + std::to_string(n) + ")";
        expect_int("row" + e, rows[t][i], ptx_row(t, i));
        expect_int("col" + e, cols[t][i], ptx_col(t, i));
        ++seen[ptx_row(t, i) * n + ptx_col(t, i)];
      }
    }
    for (int k = 0; k < kC * n; ++k)
      expect_int("threads holding element (" + std::to_string(k / n) + ", " + std::to_string(k % n) +
                     ") of the PTX layout (N " + std::to_string(n) + ")", seen[k], 1);
  }
}

void check_quad_rows_add(Inputs& in) {
  const std::vector<float> s = in.matrix(2 * kThreads / kC), rows0 = in.vec();   // s0, s1 of each thread
  guard_all();
  std::memcpy(at(kRows), rows0.data(), 4 * kC);
  const auto before = snapshot();
  run([&](int t) { P::quad_rows_add(s[2 * t], s[2 * t + 1], at(kRows)); });
  std::vector<double> want(rows0.begin(), rows0.end()), mag(kC);
  for (int r = 0; r < kC; ++r) mag[r] = std::fabs(rows0[r]);
  for (int t = 0; t < kThreads; ++t)
    for (int h = 0; h < 2; ++h) {   // the thread's rows: those of its elements 0 and 2
      want[ptx_row(t, 2 * h)] += s[2 * t + h];
      mag[ptx_row(t, 2 * h)] += std::fabs(s[2 * t + h]);
    }
  for (int r = 0; r < kC; ++r) expect("rows", r, at(kRows)[r], want[r], mag[r]);
  expect_untouched(before, {{kRows, kRows + 4 * kC}});
}

template <int N>
void check_add_row_sums(Inputs& in) {
  const std::vector<float> m = in.matrix(N), rows0 = in.vec();
  guard_all();
  std::memcpy(at(kRows), rows0.data(), 4 * kC);
  const auto before = snapshot();
  run([&](int t) { P::add_row_sums<N>(frag_of<N>(m, t), at(kRows)); });
  for (int r = 0; r < kC; ++r) {
    double want = rows0[r], mag = std::fabs(rows0[r]);
    for (int c = 0; c < N; ++c) want += m[r * N + c], mag += std::fabs(m[r * N + c]);
    expect("rows", r, at(kRows)[r], want, mag);
  }
  expect_untouched(before, {{kRows, kRows + 4 * kC}});
}

// the tile element (r, c) of a [64, 64] 16-bit tile in the 128B-swizzled layout: byte
// r * 128 + (((c / 8) ^ (r % 8)) * 16) + (c % 8) * 2
template <typename U>
U* tile_at(uint32_t tile, int r, int c) {
  return reinterpret_cast<U*>(smem + tile + r * 128 + (((c / 8) ^ (r % 8)) * 16) + (c % 8) * 2);
}
float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
float to_float(__half x) { return __half2float(x); }
template <typename U>
U from_float(float x) {
  if constexpr (std::is_same_v<U, __half>) return __float2half_rn(x);
  else return __float2bfloat16_rn(x);
}

template <typename U>
void check_row_dot(Inputs& in) {
  const std::vector<float> m = in.matrix(kC), rows0 = in.vec();
  Inputs tv{std::mt19937_64(in.rng()), in.kind == 2 ? 0 : in.kind};   // (1000 r + c overflows fp16)
  std::vector<float> tile(kC * kC);
  guard_all();
  for (int r = 0; r < kC; ++r)
    for (int c = 0; c < kC; ++c) {
      const U u = from_float<U>(tv.value(r, c) / (in.kind == 1 ? 100.f : 1.f));   // (fp16's range)
      *tile_at<U>(kTile, r, c) = u;
      tile[r * kC + c] = to_float(u);
    }
  std::memcpy(at(kRows), rows0.data(), 4 * kC);
  const auto before = snapshot();
  run([&](int t) {
    P::row_dot<U, kC>(frag_of<kC>(m, t), P::Smem{gdn::sm90::smem_u32(smem + kTile), 0, true}, at(kRows));
  });
  for (int r = 0; r < kC; ++r) {
    double want = rows0[r], mag = std::fabs(rows0[r]);
    for (int c = 0; c < kC; ++c) {
      const double p = static_cast<double>(m[r * kC + c]) * tile[r * kC + c];
      want += p, mag += std::fabs(p);
    }
    expect("rows", r, at(kRows)[r], want, mag);
  }
  expect_untouched(before, {{kRows, kRows + 4 * kC}});
}

void check_add_diag(Inputs& in) {
  const std::vector<float> m = in.matrix(kC), rows0 = in.vec();
  guard_all();
  std::memcpy(at(kRows), rows0.data(), 4 * kC);
  const auto before = snapshot();
  run([&](int t) { P::add_diag(frag_of<kC>(m, t), at(kRows)); });
  for (int r = 0; r < kC; ++r)
    expect("rows", r, at(kRows)[r], static_cast<double>(rows0[r]) + m[r * kC + r],
           std::fabs(rows0[r]) + std::fabs(m[r * kC + r]));
  expect_untouched(before, {{kRows, kRows + 4 * kC}});
}

// x with, by `extreme`, one row of -inf (a hard reset's gate sum) or of 1e30 (a difference of two sums
// would lose the other rows)
void check_scans(Inputs& in, int extreme) {
  std::vector<float> x = in.vec();
  const int k = static_cast<int>(in.rng() % kC);
  if (extreme == 1) x[k] = -INFINITY;
  if (extreme == 2) x[k] = 1e30f;
  guard_all();
  std::memcpy(at(kX), x.data(), 4 * kC);
  const auto before = snapshot();
  float all[kC], rev[kC], fwd[kC];
  std::fill(all, all + kC, NAN);
  std::fill(rev, rev + kC, NAN);
  std::fill(fwd, fwd + kC, NAN);
  const P p{launch_bar};
  run([&](int) {
    p.for_rows([&](int r) {   // threads 0 .. 63, r their own row
      all[r] = p.sum_rows(at(kX));
      rev[r] = p.rev_sum(at(kX), r);
      fwd[r] = p.fwd_sum(at(kX), r);
    });
  });
  for (int r = 0; r < kC; ++r) {
    double a = 0, ma = 0, b = 0, mb = 0;
    for (int c = 0; c < kC; ++c) (c >= r ? a : b) += x[c], (c >= r ? ma : mb) += std::fabs(x[c]);
    expect("sum_rows", r, all[r], a + b, ma + mb);
    expect("rev_sum", r, rev[r], a, ma);
    expect("fwd_sum", r, fwd[r], b, mb);
  }
  expect_untouched(before, {});
}

// two calls in a row into cols and cols2 (the second reuses part right after the first: its closing barrier),
// then every thread reads both vectors (the closing barrier orders the threads' adds before those reads)
void check_add_col_sums(Inputs& in) {
  const std::vector<float> m = in.matrix(kC), m2 = in.matrix(kC), cols0 = in.vec(), cols20 = in.vec();
  guard_all();
  std::memcpy(at(kRows), cols0.data(), 4 * kC);
  std::memcpy(at(kCols2), cols20.data(), 4 * kC);
  const auto before = snapshot();
  float seen[kThreads][2];
  const P p{launch_bar};
  run([&](int t) {
    p.add_col_sums(frag_of<kC>(m, t), at(kRows), at(kPart));
    p.add_col_sums(frag_of<kC>(m2, t), at(kCols2), at(kPart));
    seen[t][0] = at(kRows)[(5 * t + 3) % kC];
    seen[t][1] = at(kCols2)[(7 * t + 1) % kC];
  });
  for (int c = 0; c < kC; ++c) {
    double w = cols0[c], mw = std::fabs(cols0[c]), w2 = cols20[c], mw2 = std::fabs(cols20[c]);
    for (int r = 0; r < kC; ++r) {
      w += m[r * kC + c], mw += std::fabs(m[r * kC + c]);
      w2 += m2[r * kC + c], mw2 += std::fabs(m2[r * kC + c]);
    }
    expect("cols", c, at(kRows)[c], w, mw);
    expect("cols (second call)", c, at(kCols2)[c], w2, mw2);
  }
  for (int t = 0; t < kThreads; ++t) {
    expect("cols read after the call by thread", t, seen[t][0], at(kRows)[(5 * t + 3) % kC], 0);
    expect("cols (second call) read after it by thread", t, seen[t][1], at(kCols2)[(7 * t + 1) % kC], 0);
  }
  expect_untouched(before, {{kRows, kRows + 4 * kC}, {kCols2, kCols2 + 4 * kC}, {kPart, kPart + 4 * 4 * kC}});
}

// unique values exact in U by element: bf16 (1 + c / 128) 2^(r - 32), fp16 (1 + (16 (r % 16) + c) / 1024) 2^(r / 16)
template <typename U>
float code16(int r, int c) {
  if constexpr (std::is_same_v<U, __half>) return std::ldexp(1.f + ((r % 16) * 64 + c) / 1024.f, r / 16);
  else return std::ldexp(1.f + c / 128.f, r - 32);
}

// V^T in the accumulator layout from a [64 c, 64 v] tile of T (ldmatrix .trans): element (v, c) = V(c, v)
template <typename T>
void check_vt(Inputs& in) {
  guard_all();
  std::vector<float> v(kC * kC);
  for (int r = 0; r < kC; ++r)
    for (int c = 0; c < kC; ++c) {
      const T u = from_float<T>(in.kind == 2 ? code16<T>(r, c) : in.value(r, c));
      *tile_at<T>(kTile, r, c) = u;
      v[r * kC + c] = to_float(u);
    }
  const auto before = snapshot();
  float got[kThreads][kC / 2];
  const gdn::sm90::DevPolicy<T> p{launch_bar};
  run([&](int t) {
    const auto f = p.vt({gdn::sm90::smem_u32(smem + kTile), 0, true});
    std::copy(f.d, f.d + kC / 2, got[t]);
  });
  for (int t = 0; t < kThreads; ++t)
    for (int i = 0; i < kC / 2; ++i)
      expect(("vt: thread " + std::to_string(t) + ", d").c_str(), i, got[t][i], v[ptx_col(t, i) * kC + ptx_row(t, i)],
             0);
  expect_untouched(before, {});
}

// the stores' 64 x 64 input: the seed's values, or (kind 2) the values exact in U by element (code16)
template <typename U>
std::vector<float> store_input(Inputs& in) {
  std::vector<float> m = in.matrix(kC);
  if (in.kind == 2)
    for (int r = 0; r < kC; ++r)
      for (int c = 0; c < kC; ++c) m[r * kC + c] = code16<U>(r, c);
  return m;
}

// a fragment stored to a tile of U, transposed or not (stmatrix): the tile's element (r, c) is the fragment's
// (r, c) (or (c, r)) rounded to U
template <typename U>
void check_store(Inputs& in, bool transpose) {
  const std::vector<float> m = store_input<U>(in);
  guard_all();
  const auto before = snapshot();
  const P p{launch_bar};
  run([&](int t) { p.store<U, kC>(frag_of<kC>(m, t), {gdn::sm90::smem_u32(smem + kTile), 0, true}, transpose); });
  for (int r = 0; r < kC; ++r)
    for (int c = 0; c < kC; ++c) {
      const U want = from_float<U>(transpose ? m[c * kC + r] : m[r * kC + c]);
      ++n_values;
      if (std::memcmp(tile_at<U>(kTile, r, c), &want, 2) != 0)
        report("tile(" + std::to_string(r) + ", " + std::to_string(c) + ") = " +
               std::to_string(to_float(*tile_at<U>(kTile, r, c))) + ", want " + std::to_string(to_float(want)));
    }
  expect_untouched(before, {{kTile, kTile + 8192}});
}

// store_diag_block<U, R0, NB> (the doubling's D_b^T blocks): the tile's block [R0, R0 + NB)^2 is the
// fragment's (transposed or not) rounded to U, every other byte of shared memory keeps its guard
template <typename U, int R0, int NB>
void check_store_diag_block(Inputs& in, bool transpose) {
  const std::vector<float> m = store_input<U>(in);
  guard_all();
  const auto before = snapshot();
  const P p{launch_bar};
  run([&](int t) {
    p.store_diag_block<U, R0, NB>(frag_of<kC>(m, t), {gdn::sm90::smem_u32(smem + kTile), 0, true}, transpose);
  });
  std::vector<unsigned char> want = before;
  for (int r = R0; r < R0 + NB; ++r)
    for (int c = R0; c < R0 + NB; ++c) {
      const U u = from_float<U>(transpose ? m[c * kC + r] : m[r * kC + c]);
      std::memcpy(want.data() + (reinterpret_cast<unsigned char*>(tile_at<U>(kTile, r, c)) - smem), &u, 2);
    }
  for (uint32_t o = 0; o < lane_shim::kSmemBytes; o += 2) {
    ++n_values;
    if (std::memcmp(smem + o, want.data() + o, 2) != 0) {
      report("shared byte " + std::to_string(o) + " (tile byte " + std::to_string(o - kTile) + ")" +
             (o >= kTile && o < kTile + 8192 ? "" : ", outside the tile") + " not as the block's store leaves it");
      return;
    }
  }
}

// diag_inverse on a 64 x 64 fragment whose 16 x 16 diagonal blocks are strictly lower (the rest random, to be
// ignored), then diag_frag: the blocks' inverses (I + A_bb)^-1 at the fragment's positions, 0 elsewhere.
// Judged against the same products in double with the operands rounded to fp16 where the tile program
// rounds them (the host mirror's sub_mma), within 1e-5, and against the exact float64 inverse within
// 1e-2 (1 + |x|) (fp16 operands); a wrong piece of an A or B fragment, a wrong block or a wrong identity
// position is off by the size of the entries.
void check_diag_inverse(Inputs& in) {
  std::uniform_real_distribution<double> u(-1, 1);
  const double scale = in.kind == 1 ? 0.6 : 0.3;
  std::vector<float> m(kC * kC);
  for (int r = 0; r < kC; ++r)
    for (int c = 0; c < kC; ++c) m[r * kC + c] = r / 16 == c / 16 && c >= r ? 0.f : static_cast<float>(scale * u(in.rng));
  float got[kThreads][kC / 2];
  guard_all();
  const auto before = snapshot();
  run([&](int t) {
    P p{launch_bar};
    auto f = frag_of<kC>(m, t);
    p.diag_frag(gdn::sm90::diag_inverse<P, __half>(p, f), f);
    std::copy(f.d, f.d + kC / 2, got[t]);
  });
  using Mat = std::vector<double>;          // 16 x 16, row-major
  auto r16 = [](double x) { return static_cast<double>(__half2float(__float2half_rn(static_cast<float>(x)))); };
  auto mul = [&](const Mat& x, const Mat& y, Mat acc) {   // acc + fp16(x) fp16(y), each sum added in fp32
    for (int r = 0; r < 16; ++r)
      for (int c = 0; c < 16; ++c) {
        double s = 0;
        for (int k = 0; k < 16; ++k) s += r16(x[r * 16 + k]) * r16(y[k * 16 + c]);
        acc[r * 16 + c] = static_cast<float>(acc[r * 16 + c] + static_cast<float>(s));
      }
    return acc;
  };
  for (int b = 0; b < 4; ++b) {
    Mat n(256), x(256), zero(256, 0.0), exact(256, 0.0);
    for (int r = 0; r < 16; ++r)
      for (int c = 0; c < 16; ++c) {
        n[r * 16 + c] = -m[(16 * b + r) * kC + 16 * b + c];
        x[r * 16 + c] = n[r * 16 + c] + (r == c);
      }
    const Mat n2 = mul(n, n, zero), n4 = mul(n2, n2, zero);
    x = mul(x, n2, x);
    const Mat n8 = mul(n4, n4, zero);
    x = mul(x, n4, x);
    x = mul(x, n8, x);
    for (int c = 0; c < 16; ++c)            // the exact inverse, column by column (forward substitution)
      for (int r = 0; r < 16; ++r) {
        double v = r == c;
        for (int k = 0; k < r; ++k) v -= m[(16 * b + r) * kC + 16 * b + k] * exact[k * 16 + c];
        exact[r * 16 + c] = v;
      }
    for (int t = 0; t < kThreads; ++t)
      for (int i = 0; i < kC / 2; ++i) {
        const int r = ptx_row(t, i), c = ptx_col(t, i);
        if (r / 16 != b) continue;
        const std::string e = "diag_inverse: thread " + std::to_string(t) + ", d";
        if (c / 16 != b) {
          expect(e.c_str(), i, got[t][i], 0.0, 0.0);
          continue;
        }
        const double want = x[(r % 16) * 16 + c % 16], ex = exact[(r % 16) * 16 + c % 16];
        expect(e.c_str(), i, got[t][i], want, 1.0 + std::fabs(want));
        ++n_values;
        if (std::fabs(got[t][i] - ex) > 1e-2 * (1.0 + std::fabs(ex)))
          report(e + "[" + std::to_string(i) + "] = " + std::to_string(got[t][i]) + ", the exact inverse " +
                 std::to_string(ex));
      }
  }
  expect_untouched(before, {});
}

}  // namespace

int main(int argc, char** argv) {
  const int seeds = argc > 1 ? std::atoi(argv[1]) : 6;
  Group g;
  group = &g;
  int checks = 0;
  auto named = [&](const std::string& name, int seed, auto&& fn) {
    lane_shim::check = where = name + " (seed " + std::to_string(seed) + ", warpgroup " + std::to_string(launch_wg) +
                               ", bar " + std::to_string(launch_bar) + ")";
    fn();
    ++checks;
  };
  for (int seed = 0; seed < seeds; ++seed) {
    Inputs in{std::mt19937_64(1234 + seed), seed % 3};
    launch_wg = seed % 3;
    launch_bar = 1 + seed % 15;
    if (seed < 2) named("tid_wg / row / col: the wgmma D layout", seed, [&] { check_layout(); });
    named("quad_rows_add", seed, [&] { check_quad_rows_add(in); });
    named("add_row_sums<64>", seed, [&] { check_add_row_sums<64>(in); });
    named("add_row_sums<128>", seed, [&] { check_add_row_sums<128>(in); });
    named("row_dot<bf16, 64>", seed, [&] { check_row_dot<__nv_bfloat16>(in); });
    named("row_dot<fp16, 64>", seed, [&] { check_row_dot<__half>(in); });
    named("add_diag", seed, [&] { check_add_diag(in); });
    for (int extreme = 0; extreme < 3; ++extreme)
      named(std::string("sum_rows / rev_sum / fwd_sum") +
                (extreme == 1 ? ", a row of -inf" : extreme == 2 ? ", a row of 1e30" : ""),
            seed, [&] { check_scans(in, extreme); });
    named("add_col_sums", seed, [&] { check_add_col_sums(in); });
    named("diag_inverse / diag_frag (mma.sync, movmatrix)", seed, [&] { check_diag_inverse(in); });
    for (bool transpose : {true, false}) {
      const std::string how = transpose ? ", transposed" : "";
      named("store_diag_block<fp16, 0, 16>" + how, seed, [&] { check_store_diag_block<__half, 0, 16>(in, transpose); });
      named("store_diag_block<fp16, 32, 16>" + how, seed, [&] { check_store_diag_block<__half, 32, 16>(in, transpose); });
      named("store_diag_block<bf16, 0, 32>" + how, seed, [&] { check_store_diag_block<__nv_bfloat16, 0, 32>(in, transpose); });
    }
    named("vt<bf16>", seed, [&] { check_vt<__nv_bfloat16>(in); });
    named("vt<fp16>", seed, [&] { check_vt<__half>(in); });
    for (bool transpose : {false, true}) {
      const std::string how = transpose ? ", transposed" : "";
      named("store<bf16>" + how, seed, [&] { check_store<__nv_bfloat16>(in, transpose); });
      named("store<fp16>" + how, seed, [&] { check_store<__half>(in, transpose); });
    }
  }
  if (n_failures) {
    std::printf("lanes_sm90: %ld FAILED values in %d checks\n", n_failures, checks);
    return 1;
  }
  std::printf("lanes_sm90: ok, %d checks, %ld launches of 128 threads, %ld values\n", checks, n_launches, n_values);
  return 0;
}
