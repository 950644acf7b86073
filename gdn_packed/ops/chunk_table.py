"""Op `gdn_packed::chunk_table`: which rows of a packed tensor form each chunk of each sequence.

    table, cu_chunks = build_chunk_table(cu_seqlens, cu_seqlens_padded, T, chunk_size)

table int32 [T // chunk_size + N, 4] rows (seq_id, chunk_idx, start_row, length), unused slots
(-1, 0, 0, 0); cu_chunks int32 [N+1]. The full contract is in gdn_packed/torch_ref/chunk_table.py and
csrc/segments.cuh. CUDA tensors use the csrc/ kernels when gdn_packed._C can run, everything else the
torch implementation. No path reads cu_seqlens back to the host, so the op is CUDA-graph capturable.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from gdn_packed._validate import check_cu_seqlens_meta, check_padded_meta
from gdn_packed.cuda import chunk_table_cuda

INT32_MAX = 2**31 - 1


def _check(cu_seqlens: Tensor, cu_seqlens_padded: Optional[Tensor], T: int, chunk_size: int) -> int:
    """Metadata-only validation (no device sync). Returns NC = T // chunk_size + N."""
    check_cu_seqlens_meta(cu_seqlens)
    if cu_seqlens_padded is not None:
        check_padded_meta(cu_seqlens, cu_seqlens_padded, "cu_seqlens", "cu_seqlens_padded")
    if T < 0:
        raise ValueError(f"T must be >= 0, got {T}")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    nc = T // chunk_size + cu_seqlens.shape[0] - 1
    if nc > INT32_MAX:
        raise ValueError(f"T // chunk_size + N = {nc} chunk slots do not fit int32")
    return nc


@torch.library.custom_op("gdn_packed::chunk_table", mutates_args=())
def chunk_table(cu_seqlens: Tensor, cu_seqlens_padded: Optional[Tensor], T: int,
                chunk_size: int) -> tuple[Tensor, Tensor]:
    _check(cu_seqlens, cu_seqlens_padded, T, chunk_size)
    if cu_seqlens.device.type == "cuda":
        from gdn_packed._cext import cuda_available

        if cuda_available():
            return chunk_table_cuda(cu_seqlens, cu_seqlens_padded, T, chunk_size)
    from gdn_packed.torch_ref.chunk_table import chunk_table_torch

    table, cu_chunks = chunk_table_torch(cu_seqlens, cu_seqlens_padded, T, chunk_size)
    # a custom op must not return a view (of its inputs or of anything else)
    if table._base is not None:
        table = table.clone()
    if cu_chunks._base is not None:
        cu_chunks = cu_chunks.clone()
    return table, cu_chunks


@chunk_table.register_fake
def _(cu_seqlens, cu_seqlens_padded, T, chunk_size):
    nc = _check(cu_seqlens, cu_seqlens_padded, T, chunk_size)
    n = cu_seqlens.shape[0] - 1
    return (cu_seqlens.new_empty((nc, 4), dtype=torch.int32),
            cu_seqlens.new_empty((n + 1,), dtype=torch.int32))


def build_chunk_table(cu_seqlens: Tensor, cu_seqlens_padded: Optional[Tensor], T: int,
                      chunk_size: int) -> tuple[Tensor, Tensor]:
    """(table int32 [T // chunk_size + N, 4], cu_chunks int32 [N+1]) for a packed tensor of T rows."""
    _check(cu_seqlens, cu_seqlens_padded, T, chunk_size)
    return torch.ops.gdn_packed.chunk_table(cu_seqlens, cu_seqlens_padded, T, chunk_size)
