"""Jit helpers shared by the Triton kernels: the chunk table, padding rows, gate sums, the gate rows prep
stores, masks and block offsets.

The chunk table (gdn_packed/torch_ref/chunk_table.py) is int32 [NC, 4] rows (seq_id, chunk_idx,
start_row, length); cu_chunks int32 [N+1] gives each sequence's slots. Real rows are exactly the union
of the chunks' [start_row, start_row + length); every other row of the packed tensor is padding.
Row indices are int64 so that row * stride never overflows int32. Rows of a chunk at or past its
length ("dead" rows) belong to another sequence or to padding: they are read only through masked
loads with other=0 and every per-row factor is selected to 0 there, never multiplied by 0.
"""
import triton
import triton.language as tl

# The rows of `gates` [NC, HV, GATE_ROWS, C] fp32 that prep (chunk_fwd_prep_kernel) stores per chunk slot
# and value head, 0 on dead rows (gam = in-chunk cumsum of g, w_i = exp(sum of g over (i, last]), rq, rk
# the l2norm row factors, 1 without l2norm); read with gate_row.
GATE_BETA = tl.constexpr(0)     # beta
GATE_EGK = tl.constexpr(1)      # e^gam rk
GATE_EGQ = tl.constexpr(2)      # scale e^gam rq
GATE_WK = tl.constexpr(3)       # w rk
GATE_BEGK = tl.constexpr(4)     # beta e^gam rk
GATE_ROWS = tl.constexpr(5)


@triton.jit
def chunk_rows(table, j, C: tl.constexpr):
    """Chunk slot j (int64 scalar): (start row int64, real length int32). length 0 = unused slot."""
    start = tl.load(table + j * 4 + 2).to(tl.int64)
    length = tl.load(table + j * 4 + 3)
    return start, length


@triton.jit
def run_rows(table, lo, hi, T_rows):
    """The rows of the consecutive chunk slots [lo, hi) of one sequence (a segment of it), read from the
    table once: (start row of slot lo, end) int64, for chunk_at. Slot lo + i starts at the first slot's
    start_row + i C (the table's start_row = base + chunk_idx C); end is where the real rows stop:
    min(base + len, T) when the sequence's last slot here has a real row (its start_row + length), else
    T_rows (its start_row is outside [0, T): at or past T, or every start before it is negative). No
    slot is read when hi <= lo."""
    some = hi > lo
    first = tl.load(table + lo.to(tl.int64) * 4 + 2, mask=some, other=0).to(tl.int64)
    last = tl.maximum(hi - 1, lo).to(tl.int64)
    s_last = tl.load(table + last * 4 + 2, mask=some, other=0).to(tl.int64)
    n_last = tl.load(table + last * 4 + 3, mask=some, other=0)
    return first, tl.where(n_last > 0, s_last + n_last, T_rows.to(tl.int64))


@triton.jit
def chunk_at(first, end, i, T_rows, C: tl.constexpr):
    """(start row int64, length int32) of slot lo + i of run_rows(table, lo, hi): the table's row
    without a load in the loop (so a pipelined loop's tile addresses depend on its index alone):
    start = first + i C, length = clamp(min(C, end - start), 0, C), 0 where start is outside [0, T)."""
    start = first + i * C
    n = tl.minimum(tl.maximum(end - start, 0), C)
    return start, tl.where((start >= 0) & (start < T_rows), n, 0).to(tl.int32)


@triton.jit
def gate_row(gates, p_slot, r: tl.constexpr, C: tl.constexpr):
    """Gate row r (GATE_*) [C] of `gates` at p_slot = chunk slot * HV + value head."""
    return tl.load(gates + p_slot * (GATE_ROWS * C) + tl.arange(0, C) + r * C)     # (a common base: CSE)


@triton.jit
def padding_after(table, cu_chunks, n, N, T_rows):
    """Padding rows [a, b) that follow sequence n's last real row, up to the first real row of the next
    sequence that has one (or T_rows). Empty (a == b) when sequence n has no chunks. Clamped to
    [0, T_rows]: a corrupt cu_seqlens gives zero-length chunks whose start_row may lie outside the rows."""
    c0 = tl.load(cu_chunks + n)
    c1 = tl.load(cu_chunks + n + 1)
    total = tl.load(cu_chunks + N)
    last = tl.maximum(c1 - 1, 0).to(tl.int64)
    end = tl.load(table + last * 4 + 2).to(tl.int64) + tl.load(table + last * 4 + 3)
    nxt = tl.maximum(tl.minimum(c1, total - 1), 0).to(tl.int64)
    b = tl.where(c1 < total, tl.load(table + nxt * 4 + 2).to(tl.int64), T_rows.to(tl.int64))
    a = tl.where(c1 > c0, end, b)
    b = tl.minimum(tl.maximum(b, 0), T_rows.to(tl.int64))
    a = tl.minimum(tl.maximum(a, 0), b)
    return a, b


@triton.jit
def padding_before_first(table, cu_chunks, N, T_rows):
    """Padding rows [0, b) before the first real row of the whole packed tensor (b = T_rows if none)."""
    total = tl.load(cu_chunks + N)
    b = tl.where(total > 0, tl.load(table + 2).to(tl.int64), T_rows.to(tl.int64))
    return tl.minimum(tl.maximum(b, 0), T_rows.to(tl.int64))


@triton.jit
def segment_chunks(cu_chunks, n, s, S):
    """Chunk slots [lo, hi) of segment s of sequence n when every sequence's slots are split into S
    consecutive segments of cdiv(slots, S) (the last ones shorter or empty)."""
    c0 = tl.load(cu_chunks + n)
    c1 = tl.load(cu_chunks + n + 1)
    per = tl.cdiv(c1 - c0, S)
    lo = tl.minimum(c0 + s * per, c1)
    return lo, tl.minimum(lo + per, c1)


@triton.jit
def zero_rows(p, a, b, col0, ncols, stride, BW: tl.constexpr, C: tl.constexpr):
    """p[r * stride + col0 + c] = 0 for rows a <= r < b (int64) and columns c < ncols (ncols <= BW)."""
    o_c = tl.arange(0, C)
    o_w = tl.arange(0, BW)
    zeros = tl.zeros([C, BW], dtype=p.dtype.element_ty)
    for it in range(0, tl.cdiv(b - a, C)):
        rows = a + it * C + o_c
        tl.store(p + rows[:, None] * stride + col0 + o_w[None, :], zeros,
                 mask=(rows < b)[:, None] & (o_w < ncols)[None, :])


@triton.jit
def group_rows(x, rows, length, hv0, G: tl.constexpr, S_G, C: tl.constexpr, NEXT: tl.constexpr):
    """[C, GP] fp32 (GP = G padded to a power of two): x of value heads hv0 .. hv0 + G - 1 (columns) at a
    chunk's rows (x's rows S_G apart; NEXT: at each row's next row), 0 on and past the dead rows: one load
    for the G heads of a group, not one per head that the head's work waits for (head_of takes a head's
    column)."""
    o_c = tl.arange(0, C)
    o_g = tl.arange(0, triton.next_power_of_2(G))
    m = (o_g < G)[None, :] & (o_c + NEXT < length)[:, None]
    return tl.load(x + (rows + NEXT)[:, None] * S_G + (hv0 + o_g)[None, :], mask=m, other=0.0).to(tl.float32)


@triton.jit
def head_of(x, i):
    """Column i of x [C, GP] (group_rows) as [C]: halved by tl.split on the bits of i, in registers (a
    masked sum over the columns took shuffles and layout conversions)."""
    tl.static_assert(x.shape[1] <= 128)
    for b in tl.static_range(7):
        if x.shape[1] > 1:
            lo, hi = tl.split(tl.reshape(x, [x.shape[0], x.shape[1] // 2, 2]))
            x = tl.where(((i >> b) & 1) == 1, hi, lo)
    return tl.reshape(x, [x.shape[0]])


@triton.jit
def segment_decay(g_next, C: tl.constexpr):
    """E [C, C] of one chunk from g_next [C] fp32 (g_next[t] = g of row t + 1, 0 on and past the dead
    rows: group_rows with NEXT): E_ij = exp(sum of g over rows (j, i]) for j <= i, else 0, as a
    row-wise reverse scan of g_next (seg[i, t] = g_next[t] for t < i; row i's scan over t >= j is the
    sum over (j, i]): never a difference of two cumulative sums, so a g = -inf row (decay 0, a hard
    reset) or rows of g ~ -1e30 give exact zeros, never inf - inf."""
    rc = tl.arange(0, C)
    seg = tl.cumsum(tl.where(rc[None, :] < rc[:, None], g_next[None, :], 0.0), axis=1, reverse=True)
    return tl.where(rc[:, None] >= rc[None, :], tl.exp(seg), 0.0)


@triton.jit
def chunk_row_sums(b_g, g_next):
    """gam, suf, tot of chunk_gate_sums (its row sums, without the C x C decay)."""
    return tl.cumsum(b_g, axis=0), tl.cumsum(g_next, axis=0, reverse=True), tl.sum(b_g, axis=0)


@triton.jit
def chunk_gate_sums(b_g, g_next, C: tl.constexpr):
    """Gate sums of one chunk from its g [C] and g_next [C] (fp32; g of row i, of row i + 1; 0 on and
    past the chunk's dead rows: masked loads), none formed as a difference of cumulative sums (so
    g = -inf and g ~ -1e30 rows give exact zeros):
      gam [C]  sum of g over rows [0, i]            (eg_i = exp(gam_i))
      suf [C]  sum of g over rows (i, length)       (w_i = exp(suf_i), the state-update row weights)
      tot      sum of g over the chunk               (exp(tot) = decay of the whole chunk)
      dec [C, C] segment_decay (E)."""
    gam, suf, tot = chunk_row_sums(b_g, g_next)
    return gam, suf, tot, segment_decay(g_next, C)


@triton.jit
def block_offsets(M: tl.constexpr, N: tl.constexpr):
    """Offsets [M, N] of a contiguous row-major M x N block, as rows x N + columns: the form Triton's
    axis analysis reads (N contiguous, 16-byte aligned runs), so loads and stores through it are
    vectorised. (It was tl.reshape(tl.arange(0, M * N), [M, N]) to save offset registers; the analysis
    does not see through the reshape, so every access was element-wise: 2-byte STG / LDG in the SASS of
    prep, the recompute, dq and dk, the kernels the H200 ran at 7-12x the model; how much of that this
    was is not measured yet, bench/NOTES.md.)"""
    return tl.arange(0, M)[:, None] * N + tl.arange(0, N)[None, :]
