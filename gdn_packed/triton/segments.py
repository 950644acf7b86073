"""Segment index logic shared by the Triton kernels: reading the chunk table and finding padding rows.

The chunk table (gdn_packed/torch_ref/chunk_table.py) is int32 [NC, 4] rows (seq_id, chunk_idx,
start_row, length); cu_chunks int32 [N+1] gives each sequence's slots. Real rows are exactly the union
of the chunks' [start_row, start_row + length); every other row of the packed tensor is padding.
Row indices are returned as int64 so that row * stride never overflows int32.
"""
import triton
import triton.language as tl


@triton.jit
def chunk_rows(table, j, C: tl.constexpr):
    """Chunk slot j (int64 scalar): (start row int64, real length int32). length 0 = unused slot."""
    start = tl.load(table + j * 4 + 2).to(tl.int64)
    length = tl.load(table + j * 4 + 3)
    return start, length


@triton.jit
def padding_after(table, cu_chunks, n, N, T_rows):
    """Padding rows [a, b) that follow sequence n's last real row, up to the first real row of the next
    sequence that has one (or T_rows). Empty (a == b) when sequence n has no chunks."""
    c0 = tl.load(cu_chunks + n)
    c1 = tl.load(cu_chunks + n + 1)
    total = tl.load(cu_chunks + N)
    last = tl.maximum(c1 - 1, 0).to(tl.int64)
    end = tl.load(table + last * 4 + 2).to(tl.int64) + tl.load(table + last * 4 + 3)
    nxt = tl.maximum(tl.minimum(c1, total - 1), 0).to(tl.int64)
    b = tl.where(c1 < total, tl.load(table + nxt * 4 + 2).to(tl.int64), T_rows.to(tl.int64))
    a = tl.where(c1 > c0, end, b)
    return a, b


@triton.jit
def padding_before_first(table, cu_chunks, N, T_rows):
    """Padding rows [0, b) before the first real row of the whole packed tensor (b = T_rows if none)."""
    total = tl.load(cu_chunks + N)
    return tl.where(total > 0, tl.load(table + 2).to(tl.int64), T_rows.to(tl.int64))
