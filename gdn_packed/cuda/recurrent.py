"""Host side of csrc/recurrent_gdr.cu: the recurrent gated delta rule forward (K <= 128), per-sequence
states or a state pool updated in place."""
import torch

from gdn_packed.cuda.launch import launch

SLOT_OWN, SLOT_READ_ONLY, SLOT_LAST_WRITER = 0, 1, 2     # kSlot* in csrc/recurrent_gdr.cu


def slot_roles(state_indices, P):
    """int32 [N]: the role of each sequence on its pool slot (csrc/recurrent_gdr.cu), built on the
    device without a host sync: SLOT_OWN when no other sequence has its index (or the index is outside
    [0, P)), SLOT_LAST_WRITER for the highest-numbered of several sequences on one slot, SLOT_READ_ONLY
    for the others. Every sequence reads the slot's state from before the call; the last writer wins."""
    idx = state_indices.to(torch.int64)
    n = torch.arange(idx.numel(), device=idx.device)
    key = torch.where((idx >= 0) & (idx < P), idx, torch.full_like(idx, P))    # P: no slot
    last = torch.full((P + 1,), -1, dtype=torch.int64, device=idx.device).scatter_reduce(
        0, key, n, "amax")
    count = torch.zeros(P + 1, dtype=torch.int64, device=idx.device).scatter_add(0, key, torch.ones_like(n))
    shared = (key < P) & (count[key] > 1)
    role = torch.where(last[key] == n, SLOT_LAST_WRITER, SLOT_READ_ONLY)
    return torch.where(shared, role, SLOT_OWN).to(torch.int32)


def recurrent_fwd_cuda(q, k, v, g, beta, cu_seqlens, cu_seqlens_padded, initial_state, state_indices, scale,
                       use_qk_l2norm, o, final_state, *, host=False):
    """The csrc/ kernel on rows q, k [T, H, K], v [T, HV, V] of the sequences cu_seqlens [N+1] (an
    unpacked batch passes its row offsets); host=True runs the same per-thread body
    in a CPU loop (CPU tensors). Pool mode: state_indices given, initial_state = final_state = pool,
    updated in place (so it must be contiguous)."""
    T, H, K = q.shape
    HV, Vd = v.shape[1], v.shape[2]
    cu = cu_seqlens.to(torch.int64)
    pool = state_indices is not None
    if pool and not initial_state.is_contiguous():
        raise ValueError("the state pool must be contiguous")
    idx = None if not pool else state_indices.to(torch.int64)
    reads = dict(q=q, k=k, v=v, g=g.to(torch.float32), beta=beta.to(torch.float32), cu_seqlens=cu,
                 cu_seqlens_padded=None if cu_seqlens_padded is None else cu_seqlens_padded.to(torch.int64),
                 state_indices=idx, slot_roles=None if idx is None else slot_roles(idx, initial_state.shape[0]))
    if pool:
        writes = dict(initial_state=initial_state, final_state=initial_state)
    else:
        reads["initial_state"] = initial_state
        writes = dict(final_state=final_state)
    if cu.shape[0] == 1:   # no sequence: every row is padding
        o.zero_()
    launch("recurrent_gdr_fwd", q.device, host=host, reads=reads, writes=dict(writes, o=o),
           pool_size=initial_state.shape[0] if pool else 0, N=cu.shape[0] - 1, T=T, H=H, HV=HV, K=K, V=Vd,
           dtype=q.dtype, scale=float(scale), l2norm=bool(use_qk_l2norm))
