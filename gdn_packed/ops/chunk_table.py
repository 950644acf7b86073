"""Op `gdn_packed::chunk_table`: which rows of a packed tensor form each chunk of each sequence.

    table, cu_chunks = build_chunk_table(cu_seqlens, cu_seqlens_padded, T, chunk_size)

table int32 [T // chunk_size + N, 4] rows (seq_id, chunk_idx, start_row, length), unused slots
(-1, 0, 0, 0); cu_chunks int32 [N+1]. The full contract is in gdn_packed/torch_ref/chunk_table.py and
csrc/segments.cuh. CUDA tensors use the csrc/ kernels when gdn_packed._C can run, everything else the
torch implementation (the dispatch table, gdn_packed/ops/_dispatch.py). No path reads CUDA cu_seqlens
back to the host, so the op is CUDA-graph capturable.
The registered op checks its inputs unless called with trusted=True, which a public op passes after
checking them itself (chunk_gated_delta_rule builds its table with it: one check per call);
`make_chunk_table` is the unchecked implementation that chunk_gdr's ops call inside their own op when
they are not given a table.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from gdn_packed.ops._common import resolve_backend
from gdn_packed.ops._dispatch import backends, kernel
from gdn_packed.segments import check_cu_seqlens_meta, check_padded_meta, check_values_where_free

OP = "chunk_table"
INT32_MAX = 2**31 - 1


def chunk_slots(T: int, chunk_size: int, N: int) -> int:
    """NC = T // chunk_size + N, the rows of the table; a ValueError when it does not fit int32."""
    nc = T // chunk_size + N
    if nc > INT32_MAX:
        raise ValueError(f"T // chunk_size + N = {nc} chunk slots do not fit int32")
    return nc


def _check(cu_seqlens: Tensor, cu_seqlens_padded: Optional[Tensor], T: int, chunk_size: int) -> int:
    """Metadata-only validation (no device sync). Returns NC = T // chunk_size + N."""
    check_cu_seqlens_meta(cu_seqlens)
    if cu_seqlens_padded is not None:
        check_padded_meta(cu_seqlens, cu_seqlens_padded)
    if T < 0:
        raise ValueError(f"T must be >= 0, got {T}")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    return chunk_slots(T, chunk_size, cu_seqlens.shape[0] - 1)


def make_chunk_table(cu_seqlens: Tensor, cu_seqlens_padded: Optional[Tensor], T: int,
                     chunk_size: int) -> tuple[Tensor, Tensor]:
    """The chunk table, trusting its inputs (the caller checked them: the registered op below, or a
    public op such as chunk_gated_delta_rule, which calls this inside its own custom op). The backend
    is "auto"'s choice from the dispatch table: the csrc/ kernel for CUDA tensors when gdn_packed._C
    can run, the torch one for everything else."""
    backend = resolve_backend("auto", cu_seqlens.device, have=backends(OP))
    return kernel(OP, backend, "fwd")(cu_seqlens, cu_seqlens_padded, T, chunk_size)


@torch.library.custom_op("gdn_packed::chunk_table", mutates_args=())
def chunk_table(cu_seqlens: Tensor, cu_seqlens_padded: Optional[Tensor], T: int,
                chunk_size: int, trusted: bool = False) -> tuple[Tensor, Tensor]:
    if not trusted:
        _check(cu_seqlens, cu_seqlens_padded, T, chunk_size)
    table, cu_chunks = make_chunk_table(cu_seqlens, cu_seqlens_padded, T, chunk_size)
    # a custom op must not return a view (of its inputs or of anything else)
    if table._base is not None:
        table = table.clone()
    if cu_chunks._base is not None:
        cu_chunks = cu_chunks.clone()
    return table, cu_chunks


@chunk_table.register_fake
def _(cu_seqlens, cu_seqlens_padded, T, chunk_size, trusted=False):
    n = cu_seqlens.shape[0] - 1
    nc = chunk_slots(T, chunk_size, n) if trusted else _check(cu_seqlens, cu_seqlens_padded, T, chunk_size)
    return (cu_seqlens.new_empty((nc, 4), dtype=torch.int32),
            cu_seqlens.new_empty((n + 1,), dtype=torch.int32))


def build_chunk_table(cu_seqlens: Tensor, cu_seqlens_padded: Optional[Tensor], T: int,
                      chunk_size: int) -> tuple[Tensor, Tensor]:
    """(table int32 [T // chunk_size + N, 4], cu_chunks int32 [N+1]) for a packed tensor of T rows:
    the registered op torch.ops.gdn_packed.chunk_table, which checks its inputs (their values too
    on CPU tensors, where that is free: segments.check_values_where_free)."""
    _check(cu_seqlens, cu_seqlens_padded, T, chunk_size)
    check_values_where_free(cu_seqlens, cu_seqlens_padded, T)
    return torch.ops.gdn_packed.chunk_table(cu_seqlens, cu_seqlens_padded, T, chunk_size)
