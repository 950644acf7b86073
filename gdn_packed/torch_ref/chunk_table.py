"""The chunk table in PyTorch: which rows of a packed tensor form each chunk of each real sequence.

This is the one piece of index logic every backend uses (the CUDA twin lives in csrc/chunk_table.cu
and must produce identical arrays). Contract, for `cu_seqlens` [N+1] (real lengths), optional
`cu_seqlens_padded` [N+1] (storage offsets, default `cu_seqlens`), `T` rows and chunk size `C`:

    NC          = T // C + N                      static upper bound on the number of chunks
    len_i       = max(cu[i+1] - cu[i], 0),  base_i = padded[i],  nchunks_i = ceil(len_i / C)
    cu_chunks   = min([0, cumsum(nchunks)], NC)   int32 [N+1]
    table[j]    = (seq_id, chunk_idx, start_row, length)   int32 [NC, 4]
                  start_row = base_i + chunk_idx * C
                  length    = clamp(min(C, len_i - chunk_idx*C, T - start_row), 0, C), 0 if start_row
                              is outside [0, T)
                  slots j >= cu_chunks[N] are (-1, 0, 0, 0)

Nothing reads cu_seqlens back to the host, so the table can be built inside a CUDA graph; a corrupt
cu_seqlens yields zero-length chunks, never a row outside [0, T).
"""
import torch

INT32_MAX = 2**31 - 1


def chunk_table_torch(cu_seqlens, cu_seqlens_padded, T: int, chunk_size: int):
    C = chunk_size
    N = cu_seqlens.numel() - 1
    NC = T // C + N
    dev = cu_seqlens.device
    cu = cu_seqlens.to(torch.int64)
    base = cu[:-1] if cu_seqlens_padded is None else cu_seqlens_padded.to(torch.int64)[:-1]
    lens = (cu[1:] - cu[:-1]).clamp_min(0)
    nchunks = torch.div(lens + C - 1, C, rounding_mode="floor")
    cu_chunks = torch.zeros(N + 1, dtype=torch.int64, device=dev)
    cu_chunks[1:] = torch.cumsum(nchunks, 0)
    cu_chunks = cu_chunks.clamp_max(NC)

    slot = torch.arange(NC, dtype=torch.int64, device=dev)
    seq = torch.searchsorted(cu_chunks[1:], slot, right=True)          # first i with cu_chunks[i+1] > j
    valid = slot < cu_chunks[-1]
    seq_c = seq.clamp_max(max(N - 1, 0))
    if N == 0:
        valid = torch.zeros_like(valid)
        chunk_idx = torch.zeros_like(slot)
        start = torch.zeros_like(slot)
        length = torch.zeros_like(slot)
    else:
        chunk_idx = slot - cu_chunks[seq_c]
        start = base[seq_c] + chunk_idx * C
        length = torch.minimum(lens[seq_c] - chunk_idx * C, T - start).clamp(0, C)
        length = torch.where((start >= 0) & (start < T), length, torch.zeros_like(length))
    table = torch.stack([
        torch.where(valid, seq_c, torch.full_like(seq_c, -1)),
        torch.where(valid, chunk_idx, torch.zeros_like(chunk_idx)),
        torch.where(valid, start.clamp(-INT32_MAX, INT32_MAX), torch.zeros_like(start)),
        torch.where(valid, length, torch.zeros_like(length)),
    ], dim=1).to(torch.int32)
    return table, cu_chunks.to(torch.int32)
