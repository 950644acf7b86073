"""Host side of csrc/recurrent_gdr.cu: the recurrent gated delta rule forward (K <= 128), per-sequence
states or a state pool updated in place."""
import torch

from gdn_packed.cuda.launch import KERNEL_DTYPES, as_dtype, check_tensors, launch, offsets64

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
    check_tensors(q=(q, (None,) * 3, KERNEL_DTYPES), v=(v, (None,) * 3, q.dtype))
    T, H, K = q.shape
    HV, Vd = v.shape[1:]
    if H == 0 or HV % H:
        raise ValueError(f"the value heads of v (v.shape[1] = {HV}) must be a multiple of the qk heads of q "
                         f"(q.shape[1] = {H})")
    cu, pad, N = offsets64(cu_seqlens, cu_seqlens_padded)
    pool = state_indices is not None
    states = (initial_state.shape[0] if pool and initial_state is not None else N, HV, K, Vd)
    check_tensors(q=(q, (T, H, K), KERNEL_DTYPES), k=(k, (T, H, K), q.dtype), v=(v, (T, HV, Vd), q.dtype),
                  g=(g, (T, HV), None), beta=(beta, (T, HV), None), o=(o, (T, HV, Vd), q.dtype),
                  initial_state=(initial_state, states, torch.float32),
                  final_state=(final_state, states, torch.float32),
                  state_indices=(state_indices, (N,), (torch.int32, torch.int64)))
    if pool and initial_state is None:
        raise ValueError("state_indices needs the state pool as initial_state")
    if pool and not initial_state.is_contiguous():
        raise ValueError("the state pool must be contiguous")
    idx = as_dtype(state_indices, torch.int64)
    reads = dict(q=q, k=k, v=v, g=g.to(torch.float32), beta=beta.to(torch.float32), cu_seqlens=cu,
                 cu_seqlens_padded=pad, state_indices=idx,
                 slot_roles=None if idx is None else slot_roles(idx, initial_state.shape[0]))
    if pool:
        writes = dict(initial_state=initial_state, final_state=initial_state)
    else:
        reads["initial_state"] = initial_state
        writes = dict(final_state=final_state)
    if N == 0:   # no sequence: every row is padding
        o.zero_()
    launch("recurrent_gdr_fwd", q.device, host=host, reads=reads, writes=dict(writes, o=o),
           pool_size=initial_state.shape[0] if pool else 0, N=N, T=T, H=H, HV=HV, K=K, V=Vd,
           dtype=q.dtype, scale=float(scale), l2norm=bool(use_qk_l2norm))
