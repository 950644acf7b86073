"""Host side of the Triton chunked gated delta rule: the launchers of the forward and backward kernels
and the backend entry points that gdn_packed.ops.chunk_gdr dispatches to (same signatures as
gdn_packed.torch_ref.chunk). Launch configs: gdn_packed/triton/configs.py. Grids depend only on T, N,
the number of chunk slots and the shapes, never on the values of cu_seqlens (no host sync).
"""
import math
from typing import NamedTuple

import torch
import triton

from gdn_packed import _runtime
from gdn_packed.triton.chunk_bwd import (chunk_bwd_a_kernel, chunk_bwd_dk_kernel, chunk_bwd_dq_kernel,
                                        chunk_bwd_dstate_kernel, chunk_bwd_finalize_kernel, chunk_bwd_p_kernel)
from gdn_packed.triton.chunk_fwd import (chunk_combine_kernel, chunk_compose_kernel, chunk_fwd_prep_kernel,
                                         chunk_fwd_state_kernel)
from gdn_packed.triton.common import GATE_ROWS
from gdn_packed.triton.configs import (CHUNK, bwd_configs, bwd_head_slices, combine_config, compose_config,
                                      dot_precision, num_sms, pass_a_plan, prep_config, smem_kb, state_config,
                                      state_segments)

# input_precision of every dot with fp32 operands in the fp32 path (configs.dot_precision: tf32, so
# fp32 inputs are held to the GPU fp32 budgets on a GPU); tests/test_sm90_aot.py reads the compiled
# fp32 kernels and checks their dots against it
FP32_DOT_PRECISION = dot_precision(torch.float32)


def _check_chunk(C):
    if C != CHUNK:
        raise ValueError(f"the Triton kernels are written for chunk size {CHUNK}, got {C}")


class Rows(NamedTuple):
    """Row strides (elements) of the [T, heads, D] tensors the kernels read and write, as constexprs:
    S_QK of q and k, S_V of v, S_O of o, do and dv, S_DQK of dq and dk, S_G of g, beta, dg and dbeta.
    Heads and columns are packed (a head D elements after the last, columns adjacent); rows may be
    further apart than the heads fill, as in views of a fused projection."""
    S_QK: int
    S_V: int
    S_O: int
    S_DQK: int
    S_G: int

    def of(self, *names):
        """{name: stride} of the strides a kernel takes."""
        return {n: getattr(self, n) for n in names}


def packed_rows(*xs):
    """xs (one shape [T, heads, D]) as the kernels read them, with their common row stride: views whose
    heads and columns are packed and whose rows are one stride apart (q, k, v split from a fused
    projection) as they are, anything else as contiguous copies."""
    if all(x.stride()[1:] == (x.shape[2], 1) and x.stride(0) == xs[0].stride(0) for x in xs):
        return (*xs, xs[0].stride(0))
    xs = [x.contiguous() for x in xs]
    return (*xs, xs[0].stride(0))


def _rows(q, k, v, g, beta):
    """The inputs as the kernels read them (packed_rows; g, beta contiguous) and the Rows of a call whose
    outputs (o, dq, dk, dv, dg, dbeta) are contiguous."""
    q, k, s_qk = packed_rows(q, k)
    v, s_v = packed_rows(v)
    (_, H, K), (_, HV, V) = q.shape, v.shape
    return q, k, v, g.contiguous(), beta.contiguous(), Rows(S_QK=s_qk, S_V=s_v, S_O=HV * V, S_DQK=H * K, S_G=HV)


class Prep(NamedTuple):
    """What chunk_fwd_prep_kernel stores per chunk slot and value head (gdn_packed/triton/chunk_fwd.py):
    gates fp32 [NC, HV, GATE_ROWS, C], eg_last fp32 [NC, HV], rn fp32 [NC, HV, 2, C], ts and mm
    (Ts = T - I and M) [NC, HV, C, C] in the input dtype. The forward and the backward use the same."""
    gates: torch.Tensor
    eg_last: torch.Tensor
    rn: torch.Tensor
    ts: torch.Tensor
    mm: torch.Tensor


def prep_shapes(NC, HV):
    """{name: shape} of a Prep in the order of its layout (prep_in): ts, mm in the input dtype first (16-byte
    aligned where the words are: the sm_90a forward stores them 16 bytes at a time), then the fp32 gates,
    rn, eg_last."""
    C = CHUNK
    return dict(ts=(NC, HV, C, C), mm=(NC, HV, C, C), gates=(NC, HV, GATE_ROWS.value, C), rn=(NC, HV, 2, C),
                eg_last=(NC, HV))


def prep_words(NC, HV, dtype):
    """fp32 words a Prep takes (its input-dtype ts, mm counted in fp32 words)."""
    e = torch.finfo(dtype).bits // 8
    return sum(math.prod(shape) * (e if name in ("ts", "mm") else 4) // 4
               for name, shape in prep_shapes(NC, HV).items())


def prep_in(words, NC, HV, dtype):
    """A Prep laid out in the flat fp32 tensor `words` (prep_words long): views, no copy."""
    out, at = {}, 0
    for name, shape in prep_shapes(NC, HV).items():
        wide = name in ("ts", "mm")
        n = math.prod(shape) * (torch.finfo(dtype).bits // 8 if wide else 4) // 4
        out[name] = (words[at:at + n].view(dtype) if wide else words[at:at + n]).view(shape)
        at += n
    return Prep(**out)


def chunk_fwd_prep(q, k, g, beta, table, HV, scale, use_l2norm, rows, out=None):
    """Launches chunk_fwd_prep_kernel (grid (H, NC)) and returns its outputs as a Prep (written into
    `out`, a Prep of views, when given)."""
    NC, (_, H, K) = table.shape[0], q.shape
    C = CHUNK
    prep = out if out is not None else prep_in(torch.empty(prep_words(NC, HV, q.dtype), dtype=torch.float32,
                                                           device=q.device), NC, HV, q.dtype)
    if NC > 0 and HV > 0:
        chunk_fwd_prep_kernel[(H, NC)](
            q=q, k=k, g=g, beta=beta, table=table, **prep._asdict(), scale=scale, H=H, HV=HV, K=K, C=C,
            **rows.of("S_QK", "S_G"), USE_L2=bool(use_l2norm), **prep_config(K, q.dtype))
    return prep


def fwd_segments(T, N, HV, K, V, dtype, device, training=False):
    """The segments per sequence of the forward's state pass (configs.state_segments), from shapes;
    training: for a forward that keeps them for its backward (kept_shape), whose recompute and dS pass
    then run in the same segments: S minimises the cost of both directions."""
    smem = smem_kb(device)
    cfg = state_config(K, V, dtype, smem)
    bwd = (state_config(K, V, dtype, smem, store_states=True), bwd_configs(K, V, dtype, smem)["dstate"])
    return state_segments(T, N, HV, K, V, cfg, num_sms(device), bwd=bwd if training else None)


def keeps(T, N, HV, K, V, dtype, device):
    """Whether the forward keeps anything for the backward: not when the backward may run in head slices
    (bwd_head_slices > 1 with the largest scratch these shapes allow: one qk head a value head and
    l2norm), where it recomputes each slice's prep and states within its scratch budget."""
    return bwd_head_slices(T, N, HV, HV, K, V, dtype, True, sms=num_sms(device)) == 1


def _segment_words(N, S, HV, K, V):
    """The floats of the segments' part of `kept`: the entering states [N S, HV, K, V], then pass A's end
    rows [N (S - 1), HV, V + K, K] (0 when S = 1)."""
    return N * HV * K * (S * V + (S - 1) * (V + K)) if S > 1 else 0


def kept_shape(T, N, HV, K, V, C, device, dtype):
    """The shape of `kept`, what the forward keeps for the backward (the op's fake kernel calls this),
    fp32 flat, from shapes only: when the forward's state pass runs in S > 1 segments, the state entering
    every segment ([N S, HV, K, V]: S K V floats per sequence and value head), so that the backward's
    recompute starts every segment from it (no pass A, no combine), and pass A's end rows ([N (S - 1),
    HV, V + K, K]), whose segment transitions the backward's dS pass takes transposed (chunk_bwd_dstate);
    then prep's outputs (Prep: Ts, M in the input dtype, gates, row factors, chunk decays: 2 C e + 28 +
    4 / C bytes per token and value head, e the input dtype's bytes: 284 B in bf16, 540 B in fp32), so
    that the backward runs no prep. Empty when the backward may run in head slices (keeps)."""
    if not keeps(T, N, HV, K, V, dtype, device):
        return (0,)
    S = fwd_segments(T, N, HV, K, V, dtype, device, training=True)
    return (_segment_words(N, S, HV, K, V) + prep_words(T // C + N, HV, dtype),)


def kept_parts(kept, T, N, HV, K, V, dtype, device):
    """(entering states [N S, HV, K, V], pass A's end rows [N (S - 1), HV, V + K, K], Prep) as views of
    `kept` (kept_shape); (None, None, None) for an empty kept, the first two None when S = 1."""
    if kept is None or kept.numel() == 0:
        return None, None, None
    S = fwd_segments(T, N, HV, K, V, dtype, device, training=True)
    n = _segment_words(N, S, HV, K, V)
    prep = prep_in(kept[n:], T // CHUNK + N, HV, dtype)
    if not n:
        return None, None, prep
    m = N * S * HV * K * V
    return kept[:m].view(N * S, HV, K, V), kept[m:n].view(N * (S - 1), HV, V + K, K), prep


def entering_states(pass_a, cu_chunks, N, HV, K, V, S, h0, dtype, device, reverse=False, out=None, ends=None):
    """The state entering every segment of a segmented sequential pass, [N S, HV, K, V] fp32 (written to
    out when given), and pass A's end rows (into ends when given): launches `pass_a(programs, ends)`
    (the pass with PROPAGATE over the segments the walk leaves, writing each one's end rows [V + K, K]
    to ends; programs = N (S - 1), one per segment walked, which the forward's pass A, with grids of its
    own from configs.pass_a_plan, does not need) and chunk_combine_kernel (grid (cdiv(V, BV'), HV, N)).
    h0 [N, HV, K, V] (or None: 0) enters the first segment walked (the last one when reverse)."""
    if ends is None:
        ends = torch.empty(N * (S - 1), HV, V + K, K, dtype=torch.float32, device=device)
    pass_a(N * (S - 1), ends)
    ent = torch.empty(N * S, HV, K, V, dtype=torch.float32, device=device) if out is None else out
    cfg = combine_config(K, V, dtype, h0 is not None)
    chunk_combine_kernel[(triton.cdiv(V, cfg["BV"]), HV, N)](
        ends=ends, h0=h0, ent=ent, cu_chunks=cu_chunks, segments=S, HV=HV, K=K, V=V, HAS_H0=h0 is not None,
        REVERSE=reverse, **cfg)
    return ent, ends


def chunk_fwd_state(q, k, v, table, cu_chunks, prep, h0, rows, o=None, ht=None, st=None, ut=None, kept=None,
                    entering=None, ends=None, S=None):
    """Launches chunk_fwd_state_kernel on chunk_fwd_prep's outputs `prep`. Forward: writes o [T, HV, V]
    (every row) and ht [N, HV, K, V] fp32. With st [NC, HV, V, K] and ut [NC, HV, V, C] in the input
    dtype (the backward's recompute) it writes S^T entering each chunk and U^T instead, and neither o
    nor ht.

    Segments (S; else configs.state_segments, from shapes): with S > 1 every sequence's chunk slots are
    split into S segments: pass A (the kernel with PROPAGATE, grid (N x the row blocks of [S^T; P^T] of
    S - 1 segments, HV, 1), segment 0's blocks of P^T only with h0; where configs.pass_a_plan says so,
    the S^T blocks in one launch and the P^T blocks over the halves of their segments in a second, the
    halves' transitions multiplied by chunk_compose_kernel) gives each of the first S - 1
    segments its end state from zero and its K x K transition (segment 0's: 0 without h0),
    chunk_combine_kernel the state entering every segment (entering_states), and the pass (grid (cdiv(V,
    BV), HV, N S)) runs every segment from its entering state (into kept [N S, HV, K, V] when given: the
    forward's). `entering` (the backward: those kept) gives those states: no pass A, no combine, S = its
    length / (N HV K V).
    Returns pass A's end rows [N (S - 1), HV, V + K, K] (written into `ends` when given; with
    `entering`: `ends` as given, the forward's), None when S = 1: their transitions are the dS pass's
    (chunk_bwd_dstate)."""
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    N = cu_chunks.numel() - 1
    store = st is not None
    cfg = state_config(K, V, q.dtype, smem_kb(q.device), store_states=store)
    cfg_a = state_config(K, V, q.dtype, smem_kb(q.device))     # pass A stores no states
    if entering is not None:
        S = entering.numel() // max(1, N * HV * K * V)
    elif S is None:
        S = state_segments(T, N, HV, K, V, cfg, num_sms(q.device), cfg_a=cfg_a)
    if kept is not None and kept.numel() != N * S * HV * K * V:    # (a forward in other segments than kept's)
        raise ValueError(f"kept's entering states hold {kept.numel()} floats, not the {N * S * HV * K * V} "
                         f"of {S} segments")
    inputs = dict(q=q, k=k, v=v, table=table, cu_chunks=cu_chunks, gates=prep.gates, eg_last=prep.eg_last,
                  ts=prep.ts, mm=prep.mm, T_rows=T, segments=S, H=H, HV=HV, K=K, V=V, C=CHUNK,
                  **rows.of("S_QK", "S_V", "S_O"))

    def pass_a(programs, ends):     # the row blocks of N (S - 1) segments, segment 0's of P^T only with h0
        nb, nv = triton.cdiv(V + K, cfg_a["BV"]), triton.cdiv(V, cfg_a["BV"])
        pieces, _ = pass_a_plan(N, HV, K, V, S, triton.cdiv(triton.cdiv(T, CHUNK * N), S), cfg_a,
                                num_sms(q.device), has_h0=h0 is not None)
        if pieces > 1 and V % cfg_a["BV"]:  # a block with rows of both kinds would leave halves unwritten
            raise RuntimeError(f"pass A in halves needs V ({V}) a multiple of its block rows ({cfg_a['BV']})")
        # (one launch: no program writes halves, but the kernel must compile with a pointer there)
        halves = ends.new_empty(N * (S - 1), HV, K, K) if pieces > 1 else ends
        launches = [(0, nb, 1)] if pieces == 1 else [(0, nv, 1), (nv, nb - nv, 2)]    # long walks first
        for block0, blocks, n in launches:
            skip = 0 if h0 is not None else max(block0 + blocks - max(block0, nv), 0) * n
            if (S - 1) * blocks * n == skip:    # (forced halves of S = 2 without h0: nothing to walk)
                continue
            chunk_fwd_state_kernel[(N * ((S - 1) * blocks * n - skip), HV, 1)](
                **inputs, h0=None, o=None, ht=None, st=None, ut=None, ends=ends, halves=halves, block0=block0,
                blocks=blocks, pieces=n, HAS_H0=h0 is not None, STORE_STATES=False, PROPAGATE=True, **cfg_a)
        if pieces > 1:      # P = P_first P_second
            cfg_c = compose_config(K, q.dtype)
            chunk_compose_kernel[(triton.cdiv(K, cfg_c["BR"]), HV, N * (S - 1))](
                ends=ends, halves=halves, segments=S, HV=HV, K=K, V=V, HAS_H0=h0 is not None, **cfg_c)
    if entering is not None:
        h0 = entering.view(N * S, HV, K, V) if S > 1 else h0
    elif S > 1:
        h0, ends = entering_states(pass_a, cu_chunks, N, HV, K, V, S, h0, q.dtype, q.device, out=kept, ends=ends)
    chunk_fwd_state_kernel[(triton.cdiv(V, cfg["BV"]), HV, N * S)](
        **inputs, h0=h0, o=o, ht=ht, st=st, ut=ut, ends=None, halves=None, block0=0, blocks=0, pieces=1,
        HAS_H0=h0 is not None, STORE_STATES=store, PROPAGATE=False, **cfg)
    return ends if S > 1 else None


def chunk_bwd_dstate(q, k, do, table, cu_chunks, prep, rows, dht, dsn, dxp, dv, dh0, dq, dk, dg, dbeta, cfg,
                     fwd_ends=None):
    """Launches chunk_bwd_dstate_kernel (the reverse dS pass), segmented as chunk_fwd_state (the
    segments walked from the last; pass A over the last S - 1 with PROPAGATE; S from
    configs.state_segments with six dots per chunk in both passes).

    fwd_ends: the forward state pass's end rows of the same sequences (chunk_fwd_state's return, [N (S -
    1), HV, V + K, K]) or None. dS is affine in the dS leaving a segment through the transpose of the
    segment's forward transition (the chunk step's dS^T <- dS^T P_c^T: docs/DESIGN.md section 11), so
    with them the pass runs in their S segments and its pass A carries no transition rows (half its
    programs at V = K): segment s's adjoint transition is the forward's P_s transposed. The last
    segment's, which the forward never forms (its pass A covers the first S - 1), multiplies the dS
    entering that segment, dht: without dht it is 0 and chunk_combine_kernel leaves the product out;
    with dht pass A carries the transition rows of the last segment alone (LAST_TRANSITION)."""
    T, H, K = q.shape
    HV, V = do.shape[1], do.shape[2]
    N = cu_chunks.numel() - 1
    S = (fwd_ends.shape[0] // N + 1 if fwd_ends is not None else
         state_segments(T, N, HV, K, V, cfg, num_sms(q.device), dots=(6, 6), fwd_pass_a=False))
    inputs = dict(q=q, k=k, do=do, gates=prep.gates, eg_last=prep.eg_last, ts=prep.ts, mm=prep.mm, table=table,
                  cu_chunks=cu_chunks, T_rows=T, segments=S, H=H, HV=HV, K=K, V=V, C=CHUNK,
                  **rows.of("S_QK", "S_O", "S_DQK", "S_G"), **cfg)

    def pass_a(programs, ends):
        rows_a = V + K if fwd_ends is None or dht is not None else V
        chunk_bwd_dstate_kernel[(triton.cdiv(rows_a, cfg["BV"]), HV, programs)](
            **inputs, dht=None, dsn=None, dxp=None, dv=None, dh0=None, dq=None, dk=None, dg=None, dbeta=None,
            ends=ends, HAS_DHT=False, PROPAGATE=True, LAST_TRANSITION=fwd_ends is not None)
        if fwd_ends is not None:    # this pass A's ends t hold segment t + 1; the forward's t segment t
            e, f = (x.view(N, S - 1, HV, V + K, K) for x in (ends, fwd_ends))
            e[:, :S - 2, :, V:] = f[:, 1:, :, V:].transpose(-1, -2)
    if S > 1:
        dht, _ = entering_states(pass_a, cu_chunks, N, HV, K, V, S, dht, q.dtype, q.device, reverse=True)
    chunk_bwd_dstate_kernel[(triton.cdiv(V, cfg["BV"]), HV, N * S)](
        **inputs, dht=dht, dsn=dsn, dxp=dxp, dv=dv, dh0=dh0, dq=dq, dk=dk, dg=dg, dbeta=dbeta, ends=None,
        HAS_DHT=dht is not None, PROPAGATE=False, LAST_TRANSITION=False)


def chunk_gdr_fwd_triton(q, k, v, g, beta, table, cu_chunks, initial_state, scale, C, use_l2norm,
                         o, final_state, kept=None):
    """Writes o [T, HV, V] (every row: padding rows 0) and final_state [N, HV, K, V] float32.

    q, k [T, H, K]; v [T, HV, V]; g, beta [T, HV]; table int32 [NC, 4]; cu_chunks int32 [N+1];
    initial_state [N, HV, K, V] or None. Launches prep, then the state pass (with segments: pass A and
    the combine before it, the entering states into kept [N S HV K V] fp32 when given: kept_shape)."""
    _check_chunk(C)
    HV = v.shape[1]
    N = cu_chunks.numel() - 1
    if not (o.is_contiguous() and final_state.is_contiguous()):
        raise ValueError("o and final_state must be contiguous")
    if N == 0:
        o.zero_()               # no sequence: every row is padding
        return
    q, k, v, g, beta, rows = _rows(q, k, v, g, beta)
    h0 = None if initial_state is None else initial_state.to(torch.float32).contiguous()
    T, K, V = q.shape[0], q.shape[2], v.shape[2]
    entering, ends, prep = kept_parts(kept, T, N, HV, K, V, q.dtype, q.device)
    prep = chunk_fwd_prep(q, k, g, beta, table, HV, scale, use_l2norm, rows, out=prep)
    if HV > 0:      # in the segments kept_shape has room for when it keeps (a training step's)
        S = fwd_segments(T, N, HV, K, V, q.dtype, q.device, training=kept is not None and kept.numel() > 0)
        chunk_fwd_state(q, k, v, table, cu_chunks, prep, h0, rows, o=o, ht=final_state, kept=entering, ends=ends,
                        S=S)


def chunk_gdr_bwd_triton(q, k, v, g, beta, table, cu_chunks, initial_state, scale, C, use_l2norm,
                         do, dht, dq, dk, dv, dg, dbeta, dh0, kept=None, dstate=None, prep=None, entering=None,
                         grads=None):
    """Backward of backend="triton" on flattened rows: writes every row of dq, dk [T, H, K], dv [T, HV, V],
    dg, dbeta [T, HV] (0 on padding rows) and dh0 [N, HV, K, V] fp32. The op saves the inputs and
    `kept` (kept_shape: the states entering the forward's segments and prep's outputs), so the forward's
    state pass runs again (STORE_STATES, from the kept states), then the backward kernels of
    chunk_bwd.py; without kept (keep=False, head slices) prep runs again too, unless `prep` gives its
    outputs (the cuda forward's kept). Grids depend only on T, N, the chunk slots and the shapes.

    Scratch: configs.bwd_scratch_bytes (~2.1 kB per token and value head at K = V = 128 in bf16, G = 2:
    S^T, dSn^T 512 B each and U^T, dX'^T 256 B each in the input dtype, Ts + M 256 B and gates / row
    factors ~28 B when prep runs here, the group's P and B 256 B each fp32 per token and qk head, dg /
    dbeta partials 8 B per share (the P and A kernels' and one per K-block of the dq and dk kernels);
    with l2norm the fp32 dq, dk before the l2norm backward, 1 kB per token and qk head; the segments'
    boundary rows). Bounded: when that exceeds configs.BWD_SCRATCH_BUDGET the backward runs in P slices
    of H / P qk heads (and their value heads) one after another (configs.bwd_head_slices, from shapes),
    each a complete backward of its heads with 1 / P of the scratch: T = 1M, 16 / 32 heads, K = V =
    128 bf16 takes 8 slices of 8.9 GB (11.0 GB with l2norm) instead of 71 (88) GB. The heads of a GVA
    group share no sum, so every slice computes its gradients exactly as the whole backward does (each
    slice runs its own prep and segments: the forward keeps nothing then).

    dstate: a replacement of chunk_bwd_dstate (its arguments; backend="cuda": the sm_90a dS pass,
    gdn_packed.cuda.chunk), used when the backward runs in one slice (its outputs are then contiguous).
    grads: a replacement of the four chunk-parallel kernels (P, dq, A, dk; backend="cuda": the sm_90a
    chunk-parallel kernel, gdn_packed.cuda.chunk.chunk_bwd_grads_cuda's arguments), writing dq, dk (or
    their fp32 values before the l2norm backward) and two dg and two dbeta shares; in one slice only.
    prep, entering: prep's outputs and the states entering the segments of the state pass (fwd_segments;
    [N S, HV, K, V] fp32) kept by another forward (backend="cuda": its kernel's), used where kept gives
    none and the backward runs in one slice."""
    _check_chunk(C)
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    N = cu_chunks.numel() - 1
    outs = (dq, dk, dv, dg, dbeta)
    if N == 0:                  # no sequence: every row is padding
        for x in outs:
            x.zero_()
        return
    q, k, v, g, beta, rows = _rows(q, k, v, g, beta)
    do = do.contiguous()
    work = [x if x.is_contiguous() else torch.empty_like(x, memory_format=torch.contiguous_format)
            for x in outs]
    h0 = None if initial_state is None else initial_state.to(torch.float32).contiguous()
    dht = None if dht is None else dht.to(torch.float32).contiguous()
    kept_entering, ends, kept_prep = kept_parts(kept, T, N, HV, K, V, q.dtype, q.device)
    prep = kept_prep if kept_prep is not None else prep
    entering = kept_entering if kept_entering is not None else entering
    P = bwd_head_slices(T, N, H, HV, K, V, q.dtype, bool(use_l2norm), sms=num_sms(q.device))
    if P == 1:
        _bwd_heads(q, k, v, g, beta, do, h0, dht, *work, dh0, table, cu_chunks, scale, use_l2norm, rows,
                   entering, ends, prep, dstate, grads)
    else:           # each slice's views of the inputs and outputs (rows as before), its states contiguous
        Hs, HVs = H // P, HV // P
        for p in range(P):
            qk, vh = slice(p * Hs, (p + 1) * Hs), slice(p * HVs, (p + 1) * HVs)
            part = lambda x: None if x is None else x[:, vh].contiguous()   # noqa: E731  [N, HVs, K, V]
            dh0_s = torch.empty(N, HVs, K, V, dtype=torch.float32, device=q.device)
            dq_, dk_, dv_, dg_, dbeta_ = work
            _bwd_heads(q[:, qk], k[:, qk], v[:, vh], g[:, vh], beta[:, vh], do[:, vh], part(h0), part(dht),
                       dq_[:, qk], dk_[:, qk], dv_[:, vh], dg_[:, vh], dbeta_[:, vh], dh0_s, table, cu_chunks,
                       scale, use_l2norm, rows, None, None, None)
            dh0[:, vh] = dh0_s
    for x, y in zip(outs, work):
        if x is not y:
            x.copy_(y)


def _bwd_heads(q, k, v, g, beta, do, h0, dht, dq, dk, dv, dg, dbeta, dh0, table, cu_chunks, scale, use_l2norm,
               rows, entering, ends, prep, dstate=None, grads=None):
    """The backward of the H qk heads of q [T, H, K] (all, or a slice: views whose rows are `rows` apart)
    and their HV value heads: prep (unless given), the recompute, the dS pass, the P / dq / A / dk
    kernels and finalize, with scratch for these heads only. With `dstate` (the cuda backend's dS pass)
    the recompute runs beside the dS pass (_runtime.fork)."""
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    NC, C, dev = table.shape[0], CHUNK, q.device
    cfg = bwd_configs(K, V, q.dtype, smem_kb(q.device))
    l2 = bool(use_l2norm)
    f32 = dict(dtype=torch.float32, device=dev)
    if prep is None:
        prep = chunk_fwd_prep(q, k, g, beta, table, HV, scale, l2, rows)
    # S^T entering each chunk (as the forward's dots used it) and U^T; slots outside every
    # sequence are never written here and never read (the P / dq / A / dk kernels exit on empty slots)
    st = torch.empty(NC, HV, V, K, dtype=q.dtype, device=dev)
    ut = torch.empty(NC, HV, V, C, dtype=q.dtype, device=dev)
    dsn = torch.empty(NC, HV, V, K, dtype=q.dtype, device=dev)
    dxp = torch.empty(NC, HV, V, C, dtype=q.dtype, device=dev)
    if HV > 0 and dstate is None:
        ends = chunk_fwd_state(q, k, v, table, cu_chunks, prep, h0, rows, st=st, ut=ut, entering=entering, ends=ends)
        chunk_bwd_dstate(q, k, do, table, cu_chunks, prep, rows, dht, dsn, dxp, dv, dh0, dq, dk, dg, dbeta,
                         cfg["dstate"], fwd_ends=ends)
    elif HV > 0:
        # the hook's dS pass reads nothing the recompute writes (it takes no end rows) and the recompute
        # nothing the dS pass writes: the dS pass is enqueued first and the recompute beside it, on the
        # SMs the dS pass leaves (its CTAs are dispatched first; where it fills the GPU, the recompute
        # fills its tail)
        with _runtime.fork(dev) as side:
            dstate(q, k, do, table, cu_chunks, prep, rows, dht, dsn, dxp, dv, dh0, dq, dk, dg, dbeta, cfg["dstate"])
            with side:
                chunk_fwd_state(q, k, v, table, cu_chunks, prep, h0, rows, st=st, ut=ut, entering=entering,
                                ends=ends)
    if NC > 0 and HV > 0:
        cq, ck = cfg["dq"], cfg["dk"]
        nq, nk = triton.cdiv(K, cq["BK"]), triton.cdiv(K, ck["BK"])
        # dg shares: the P kernel's (slot 0), one per K-block of the dq kernel (slots [1, 1 + nq)), the A
        # kernel's (slot 1 + nq), one per K-block of the dk kernel (2 + nq ...); dbeta shares: the A and
        # dk kernels' only (slots [1 + nq, 2 + nq + nk); the others are never written nor read). With
        # `grads`: its two sides' dg and dbeta shares (slots 0, 1).
        # [2, slot, HV, T]: a program's 64 rows of one head contiguous (as [T, HV] columns each 4-byte
        # access took a line of its own: finalize ran at 6.8x its estimate on the H200)
        NQ, NK = (0, 2) if grads is not None else (1 + nq, 2 + nq + nk)
        part = torch.empty(2, NK, HV, T, **f32)
        # with l2norm the dq / dk kernels write dq, dk before the l2norm backward to pre [2, T, H, K] fp32
        pre = torch.empty(2, T, H, K, **f32) if l2 else None
        out_rows = rows._replace(S_DQK=H * K) if l2 else rows
        shape = dict(H=H, HV=HV, K=K, V=V, C=C)
        if grads is not None:
            grads(q, k, v, g, do, table, prep, st, ut, dsn, dxp, scale, pre[0] if l2 else dq, pre[1] if l2 else dk,
                  part[0], part[1])
        else:
            pm = torch.empty(NC, H, C, C, **f32)    # sum over the group of Pm + diag(Pm): P -> dq, dk kernels
            bm = torch.empty(NC, H, C, C, **f32)    # sum over the group of diag(beta) DA + DA^T diag(beta): A -> dk
            chunk_bwd_p_kernel[(H, NC)](
                q=q, k=k, g=g, do=do, rn=prep.rn, ut=ut, pm=pm, dg_part=part[0], table=table, scale=scale, T=T,
                **shape, **rows.of("S_QK", "S_O", "S_G"), **cfg["p"])
            chunk_bwd_dq_kernel[(nq, H, NC)](
                q=q, k=k, do=do, gates=prep.gates, rn=prep.rn, st=st, dq=pre[0] if l2 else dq, pm=pm,
                dg_part=part[0], table=table, T=T, **shape, **out_rows.of("S_QK", "S_O", "S_DQK", "S_G"), **cq)
            chunk_bwd_a_kernel[(H, NC)](
                k=k, v=v, g=g, gates=prep.gates, rn=prep.rn, ut=ut, dxp=dxp, bm=bm, dg_part=part[0],
                dbeta_part=part[1], table=table, T=T, slot=1 + nq, **shape, **rows.of("S_QK", "S_V", "S_G"),
                **cfg["a"])
            chunk_bwd_dk_kernel[(nk, H, NC)](
                q=q, k=k, gates=prep.gates, rn=prep.rn, eg_last=prep.eg_last, ut=ut, st=st, dsn=dsn, dxp=dxp, pm=pm,
                bm=bm, dk=pre[1] if l2 else dk, dg_part=part[0], dbeta_part=part[1], table=table, T=T, slot0=2 + nq,
                **shape, **out_rows.of("S_QK", "S_DQK"), **ck)
        chunk_bwd_finalize_kernel[(H, NC)](
            q=q, k=k, dq_pre=pre[0] if l2 else None, dk_pre=pre[1] if l2 else None, rn=prep.rn,
            dg_part=part[0], dbeta_part=part[1], dq=dq, dk=dk, dg=dg, dbeta=dbeta, table=table, T=T, H=H,
            HV=HV, K=K, C=C, NK=NK, NQ=NQ, **rows.of("S_QK", "S_DQK", "S_G"), USE_L2=l2, **cfg["finalize"])
