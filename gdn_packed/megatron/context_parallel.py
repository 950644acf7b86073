"""Context parallelism of the Megatron GDN block, in megatron-core's layout (0.18+).

Sequence-sharded layout (what each CP rank holds on entry and returns): every sequence of storage
length P (its `cu_seqlens_q_padded` segment, else its `cu_seqlens_q` one; P % (2 cp) == 0) is cut
into 2 cp equal chunks and rank r holds chunks r and 2 cp - 1 - r (Megatron's attention load
balancing), sequences one after another: rank r's rows are
[seq 0 chunk r | seq 0 chunk 2cp-1-r | seq 1 chunk r | ...], seq i starting at row cu[i] / cp.
SBHD input is the one-sequence case (P = S), the same for every batch column.

Head-sharded layout (what the kernels see): all S rows of every sequence in their natural order and
1/cp of the heads: rank r keeps the r-th share of every in_proj section (q, k, v, z, b, a heads).
One all-to-all goes each way (Megatron's all_to_all_sp2hp / all_to_all_hp2sp); the feature and row
permutations around it are index tables built on the device, without reading cu_seqlens back.
"""
import torch

from megatron.core.tensor_parallel.mappings import all_to_all_hp2sp, all_to_all_sp2hp


def rank_share(t: torch.Tensor, sections, rank: int, cp: int) -> torch.Tensor:
    """Rank `rank`'s 1/cp share of each of the dim-0 `sections` of t, concatenated (a view when one
    section). Used for the in_proj output features, conv1d channels, A_log and dt_bias."""
    if cp == 1:
        return t
    parts = [s.narrow(0, rank * (s.shape[0] // cp), s.shape[0] // cp) for s in torch.split(t, sections)]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def feature_order(sections, cp: int, device) -> torch.Tensor:
    """Feature permutation that puts rank 0's share of every section first, then rank 1's, ...:
    after it a single all-to-all of equal feature blocks hands each rank its heads of every section."""
    index = torch.arange(sum(sections), device=device)
    return torch.cat([rank_share(index, list(sections), r, cp) for r in range(cp)])


def natural_row_order(cu_storage, cp: int, rows: int, device):
    """(gather, scatter) [rows] int64 for `rows` = S storage rows in total.

    gather[p] is the row of the all-to-all output (the ranks' rows one rank after another, rank r's
    at [r S/cp, (r+1) S/cp)) that holds natural row p; scatter is its inverse. cu_storage [N+1] are
    the storage offsets of the sequences (None: one sequence of S rows). Values out of contract
    (a length not a multiple of 2 cp, cu_storage[-1] != S) give a wrong order, never an index out
    of range; the block checks them when validating."""
    p = torch.arange(rows, device=device)
    if cu_storage is None:
        start, length = torch.zeros_like(p), torch.full_like(p, rows)
    else:
        cu = cu_storage.to(device=device, dtype=torch.long)
        seq = torch.searchsorted(cu[1:], p, right=True).clamp_(max=cu.numel() - 2)
        start, length = cu[seq], cu[seq + 1] - cu[seq]
    half = (length // (2 * cp)).clamp_(min=1)                # chunk length of the row's sequence
    k = p - start
    chunk = (k // half).clamp_(0, 2 * cp - 1)
    first = chunk < cp                                         # chunks 0..cp-1: rank = chunk, slot 0
    rank = torch.where(first, chunk, 2 * cp - 1 - chunk)
    slot = k - chunk * half + torch.where(first, 0, half)
    gather = (rank * (rows // cp) + start // cp + slot).clamp_(0, rows - 1)
    scatter = torch.empty_like(gather).scatter_(0, gather, p)
    return gather, scatter


def cp_to_hp(x, features, gather, cp_group):
    """[S/cp, B, D] sequence-sharded -> [S, B, D/cp] natural row order, this rank's heads."""
    s_local, batch, dim = x.shape
    cp = cp_group.size()
    x = all_to_all_sp2hp(x.index_select(-1, features), cp_group).view(s_local * cp, batch, dim // cp)
    return x.index_select(0, gather)


def hp_to_cp(y, scatter, cp_group):
    """[S, B, E/cp] natural row order, this rank's heads -> [S/cp, B, E] sequence-sharded (heads in
    rank order, which is their natural order)."""
    rows, batch, dim = y.shape
    cp = cp_group.size()
    return all_to_all_hp2sp(y.index_select(0, scatter), cp_group).view(rows // cp, batch, dim * cp)
