"""Host side of csrc/chunk_table.cu: the chunk table of a packed tensor (contract in
gdn_packed/torch_ref/chunk_table.py), two kernels on the current stream, no host sync."""
import torch

from gdn_packed.cuda.launch import check_offsets, launch


def chunk_table_cuda(cu_seqlens, cu_seqlens_padded, T, chunk_size, *, host=False):
    """(table int32 [T // chunk_size + N, 4], cu_chunks int32 [N+1]) on cu_seqlens' device;
    cu_seqlens_padded (or None) has cu_seqlens' dtype, int32 or int64."""
    n = check_offsets(cu_seqlens, cu_seqlens_padded)
    table = torch.empty((T // chunk_size + n, 4), dtype=torch.int32, device=cu_seqlens.device)
    cu_chunks = torch.empty((n + 1,), dtype=torch.int32, device=cu_seqlens.device)
    launch("chunk_table", cu_seqlens.device, host=host,
           reads=dict(cu_seqlens=cu_seqlens, cu_seqlens_padded=cu_seqlens_padded),
           writes=dict(table=table, cu_chunks=cu_chunks),
           index_int64=cu_seqlens.dtype == torch.int64, N=n, T=T, chunk_size=chunk_size)
    return table, cu_chunks
