"""Host side of the Triton chunked gated delta rule: the launchers of the forward and backward kernels
and the backend entry points that gdn_packed.ops.chunk_gdr dispatches to (same signatures as
gdn_packed.torch_ref.chunk). Launch configs: gdn_packed/triton/configs.py. Grids depend only on T, N,
the number of chunk slots and the shapes, never on the values of cu_seqlens (no host sync).
"""
import torch
import triton

from gdn_packed.triton.chunk_fwd import chunk_fwd_prep_kernel, chunk_fwd_state_kernel
from gdn_packed.triton.configs import CHUNK, prep_config, smem_kb, state_config


def _check_chunk(C):
    if C != CHUNK:
        raise ValueError(f"the Triton kernels are written for chunk size {CHUNK}, got {C}")


def stored_dtype(dtype):
    """dtype of the stored C x C matrices (Ts, MT) and of X'^T: the input dtype."""
    return dtype


def chunk_fwd_prep(q, k, g, beta, table, HV, scale, use_l2norm, store_m=False):
    """Launches chunk_fwd_prep_kernel (grid (HV, NC)); returns (gates, eg_last, rn, Ts, MT) as laid out
    in gdn_packed/triton/chunk_fwd.py (MT is M itself with store_m)."""
    NC, (_, H, K) = table.shape[0], q.shape
    C = CHUNK
    f32 = dict(dtype=torch.float32, device=q.device)
    gates = torch.empty(NC, HV, 5, C, **f32)
    eg_last = torch.empty(NC, HV, **f32)
    rn = torch.empty(NC, HV, 2, C, **f32)
    ts = torch.empty(NC, HV, C, C, dtype=stored_dtype(q.dtype), device=q.device)
    mt = torch.empty_like(ts)
    if NC > 0 and HV > 0:
        chunk_fwd_prep_kernel[(HV, NC)](q, k, g, beta, table, gates, eg_last, rn, ts, mt, scale, H=H,
                                        HV=HV, K=K, C=C, USE_L2=bool(use_l2norm), STORE_M=store_m,
                                        **prep_config(K, q.dtype))
    return gates, eg_last, rn, ts, mt


def chunk_fwd_state(q, k, v, table, cu_chunks, prep, h0, o=None, ht=None, s_out=None, x_out=None):
    """Launches chunk_fwd_state_kernel, grid (cdiv(V, BV), HV, N), on chunk_fwd_prep's outputs `prep`.
    Forward: writes o [T, HV, V] (every row) and ht [N, HV, K, V] fp32. With s_out [NC, HV, V, K]
    and x_out [NC, HV, V, C] in the input dtype (the backward's recompute) it writes S^T entering each chunk and X'^T
    instead, and neither o nor ht."""
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    N = cu_chunks.numel() - 1
    store = s_out is not None
    cfg = state_config(K, V, q.dtype, smem_kb(q.device), store_states=store)
    gates, eg_last, _, ts, mt = prep
    unused = s_out if store else ht         # stand-in for the pointers this variant does not touch
    pick = lambda x: unused if x is None else x   # noqa: E731
    chunk_fwd_state_kernel[(triton.cdiv(V, cfg["BV"]), HV, N)](
        q, k, v, table, cu_chunks, gates, eg_last, ts, mt, pick(h0), pick(o), pick(ht), pick(s_out),
        pick(x_out), T, H=H, HV=HV, K=K, V=V, C=CHUNK, HAS_H0=h0 is not None, STORE_STATES=store,
        **cfg)


def chunk_gdr_fwd_triton(q, k, v, g, beta, table, cu_chunks, initial_state, scale, C, use_l2norm,
                         o, final_state):
    """Writes o [T, HV, V] (every row: padding rows 0) and final_state [N, HV, K, V] float32.

    q, k [T, H, K]; v [T, HV, V]; g, beta [T, HV]; table int32 [NC, 4]; cu_chunks int32 [N+1];
    initial_state [N, HV, K, V] or None. Two launches: prep, then the state pass."""
    _check_chunk(C)
    HV = v.shape[1]
    N = cu_chunks.numel() - 1
    if not (o.is_contiguous() and final_state.is_contiguous()):
        raise ValueError("o and final_state must be contiguous")
    if N == 0:
        o.zero_()               # no sequence: every row is padding
        return
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    h0 = None if initial_state is None else initial_state.to(torch.float32).contiguous()
    prep = chunk_fwd_prep(q, k, g, beta, table, HV, scale, use_l2norm)
    if HV > 0:
        chunk_fwd_state(q, k, v, table, cu_chunks, prep, h0, o=o, ht=final_state)


def chunk_gdr_bwd_triton(q, k, v, g, beta, table, cu_chunks, initial_state, scale, C, use_l2norm,
                         do, dht, dq, dk, dv, dg, dbeta, dh0):
    """Backward of backend="triton" (gdn_packed/triton/chunk_bwd.py)."""
    from gdn_packed.triton.chunk_bwd import chunk_gdr_bwd_triton as bwd
    bwd(q, k, v, g, beta, table, cu_chunks, initial_state, scale, C, use_l2norm,
        do, dht, dq, dk, dv, dg, dbeta, dh0)
