"""The recurrent (token-by-token) gated delta rule over packed sequences in PyTorch: the CPU path of
`fused_recurrent_gated_delta_rule` and the statement csrc/recurrent_gdr.cu is checked against.

Layout: q, k [T, H, K], v [T, HV, V], g, beta [T, HV] flattened packed rows; sequence i owns rows
[base_i, base_i + len_i). All sequences advance together, one token per step (docs/DESIGN.md section 2):
    S~ = exp(g_t) S,  u = beta_t (v_t - S~^T k_t),  S = S~ + k_t u^T,  o_t = scale S^T q_t
A sequence past its end takes a step with k = 0, beta = 0, g = 0, which leaves S unchanged. GVA is a
broadcast over the value heads of a qk-head (never a copy of q/k). States are float32 (float64 for
float64 inputs); o is rounded to v's dtype at the end; padding rows are 0.

Step count (gdn_packed._runtime.host_schedule): on CPU tensors the longest sequence's length, at
most T (read on the host, which has no device to wait for); on other devices the static bound T, so
nothing reads cu_seqlens back.

Cost per token and value head: one batched product reads the state once for S^T k and S^T q, then an
in-place scale and rank-1 update write it (2 K V FLOPs each); no temporary the size of the states
(the per-token reference makes three). Measured, 64 sequences x 32 v-heads x 128 x 128, one decode
token, 1 thread: about 2x faster than naive_recurrent_gdr.
"""
import torch

from gdn_packed._runtime import compute_dtype, host_schedule
from gdn_packed.torch_ref.naive import l2norm


def _steps(lens, T):
    """The tokens the longest sequence takes, never more than the T rows that exist (corrupt
    cu_seqlens could claim a million on 20 rows)."""
    if lens.numel() == 0:
        return 0
    return min(int(lens.max()), T) if host_schedule(lens.device) else T


def recurrent_gdr_fwd_torch(q, k, v, g, beta, cu_seqlens, cu_seqlens_padded, initial_state, state_indices,
                            scale, use_qk_l2norm, o, final_state):
    """Writes o [T, HV, V] and, when given, final_state [N, HV, K, V]. With state_indices [N] the
    states come from and go back to the pool `initial_state` [P, HV, K, V] (index outside [0, P):
    zeros, no write-back); `final_state` is then the pool itself."""
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    G = HV // H
    dt = compute_dtype(q.dtype)
    cu = cu_seqlens.to(torch.int64)
    base = (cu if cu_seqlens_padded is None else cu_seqlens_padded.to(torch.int64))[:-1]
    lens = (cu[1:] - cu[:-1]).clamp_min(0)
    N = lens.numel()

    qs, ks = q.to(dt), k.to(dt)
    if use_qk_l2norm:
        qs, ks = l2norm(qs), l2norm(ks)
    zero_row = lambda x: torch.cat([x.to(dt), x.new_zeros(1, *x.shape[1:], dtype=dt)])  # noqa: E731
    qp, kp, vp, gp, bp = (zero_row(x) for x in (qs, ks, v, g, beta))    # row T reads as zeros

    if state_indices is not None:
        pool = initial_state
        P = pool.shape[0]
        slot = state_indices.to(torch.int64)
        slot = torch.where((slot >= 0) & (slot < P), slot, torch.full_like(slot, -1))  # outside: no slot
        S = pool[slot.clamp(0, max(P - 1, 0))].to(dt) if P > 0 else pool.new_zeros(N, HV, K, V, dtype=dt)
        S = torch.where((slot >= 0)[:, None, None, None], S, torch.zeros_like(S))
    elif initial_state is not None:
        S = initial_state.to(dt).clone()
    else:
        S = torch.zeros(N, HV, K, V, dtype=dt, device=q.device)
    S = S.view(N, H, G, K, V)

    # One product per step reads the state once for both S^T k and S^T q; the output then follows
    # from the state before the update, o = scale (a S^T q + (q . k) u) with a = exp(g_t), and the
    # state is updated in place: S = a S + k u^T (two passes over S per token, no temporaries of its size).
    out = torch.zeros(T + 1, HV, V, dtype=dt, device=q.device)          # row T collects idle steps
    S = S.contiguous()
    Sf = S.view(N * HV, K, V)
    for t in range(_steps(lens, T)):
        rows = base + t
        live = (t < lens) & (rows >= 0) & (rows < T)
        rows = torch.where(live, rows, torch.full_like(rows, T))
        qt, kt = qp[rows], kp[rows]                                      # [N, H, K]
        kq = torch.stack([kt, qt], 2)[:, :, None].expand(N, H, G, 2, K).reshape(N * HV, 2, K)
        Skq = torch.bmm(kq, Sf).view(N, H, G, 2, V)                      # rows: S^T k, S^T q
        decay = torch.exp(gp[rows]).view(N, H, G, 1)
        bt = bp[rows].view(N, H, G, 1)
        u = bt * (vp[rows].view(N, H, G, V) - decay * Skq[:, :, :, 0])
        qk = (qt * kt).sum(-1).view(N, H, 1, 1)
        out[rows] = (scale * (decay * Skq[:, :, :, 1] + qk * u)).reshape(N, HV, V)
        Sf.mul_(decay.view(N * HV, 1, 1))
        Sf.baddbmm_(kt[:, :, None].expand(N, H, G, K).reshape(N * HV, K, 1), u.view(N * HV, 1, V))
    o.copy_(out[:T])

    S = S.reshape(N, HV, K, V)
    if state_indices is not None:   # pool[slot] = S for slot >= 0, the last sequence on a slot wins
        owner = torch.full((P + 1,), -1, dtype=torch.int64, device=q.device)
        owner.scatter_reduce_(0, torch.where(slot >= 0, slot, torch.full_like(slot, P)),
                              torch.arange(N, device=q.device), "amax")
        owner = owner[:P]
        if N > 0:
            upd = S[owner.clamp_min(0)].to(pool.dtype)
            pool.copy_(torch.where((owner >= 0)[:, None, None, None], upd, pool))
    elif final_state is not None:
        final_state.copy_(S)
