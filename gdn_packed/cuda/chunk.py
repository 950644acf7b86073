"""Host side of csrc/chunk_gdr_fwd_sm90.cu: the chunked gated delta rule forward on sm_90a (K = V = 128,
bf16 / fp16), warp-specialised CTAs over the device chunk table. host=True runs the kernel's host mirror
(the same tile program with plain loops, CPU tensors; it also takes float32, which the device kernel
does not). The backward of a cuda forward is the Triton one (gdn_packed.triton.chunk.chunk_gdr_bwd_triton,
ops/_dispatch.py) with its reverse dS pass on csrc/chunk_gdr_bwd_sm90.cu (chunk_gdr_bwd_cuda), on the
segments' entering states and prep outputs the forward kept (kept_shape: the kernel writes them when
autograd will need them), so that backward runs neither pass A nor prep of its own.

    refusal(q, v, device)   None when backend="cuda" of the chunked op takes these inputs on `device`,
                            else the exception saying why (resolve_backend's `refuse`)
    chunk_gdr_fwd_cuda(...) the forward, the dispatch table's "fwd" and "fwd_raw" (raw a, b gates): one of
                            the three forward kernels (KERNELS), as forward_kernel picks
    forward_kernel(N, HV, sms, clusters, pairs)  which kernel the forward runs on a device of `sms`
                            SMs: "split" for few long sequences (where its clusters fit at once), else
                            "fused"; gva_pairs(H, HV): whether the fused and split kernels and the dS
                            pass pair value heads;
                            split_clusters(device, pairs): how many of its clusters a GPU holds at once
    chunk_bwd_dstate_cuda(...)  the backward's reverse dS pass (csrc/chunk_gdr_bwd_sm90.cu) in place of
                            the Triton one (gdn_packed.triton.chunk.chunk_bwd_dstate): the same inputs
                            (Triton prep's outputs) and outputs
    chunk_bwd_grads_cuda(...)  the backward's chunk-parallel gradients (csrc/chunk_gdr_grads_sm90.cu) in
                            place of the Triton P, dq, A and dk kernels: their inputs, dq / dk and the dg /
                            dbeta shares that the Triton finalize kernel sums
    chunk_gdr_bwd_cuda(...) the dispatch table's "bwd": the Triton backward with those two, on the kept
                            entering states and prep
    kept_shape(...)         the dispatch table's "kept_shape": what the forward keeps (the segments'
                            entering states, a Prep's words)
"""
import os

import torch

from gdn_packed.cuda.launch import check_tensors, launch

HEAD_DIM = 128          # the kernel's only K and V
CHUNK = 64
MAX_SEQUENCES = 65535   # the grid's y dimension
# The forward hung on the first H200 it met (2026-12-04, first session: a setmaxnreg pool overdrawn) and
# device launches were refused until a GPU run passed it; the second session's H200 ran it (the GPU tests
# of tests/test_cuda_chunk_gpu.py, memcheck clean, three shapes profiled; bench/NOTES.md "The second H200
# session"), so backend='cuda' launches it. 'auto' still picks triton (ops/chunk_gdr.AUTO_BACKENDS).


def refusal(q, v, device, N=None):
    """None when the cuda chunked forward takes q [.., H, K], v [.., HV, V] (and N sequences) on
    `device`; else the exception naming why: TypeError (dtype), ValueError (shape), RuntimeError (no
    sm_90a kernel in gdn_packed._C, no sm_90 GPU)."""
    from gdn_packed import _cext
    C = _cext.get_C()
    if C is not None and getattr(C, "chunk_gdr_fwd_sm90_missing", ""):
        return RuntimeError(f"backend='cuda': gdn_packed._C has no sm_90a chunked kernel "
                            f"({C.chunk_gdr_fwd_sm90_missing}); use backend='triton'")
    if q.shape[-1] != HEAD_DIM or v.shape[-1] != HEAD_DIM:
        return ValueError(f"backend='cuda' of chunk_gated_delta_rule takes K = V = {HEAD_DIM} only, got "
                          f"K = {q.shape[-1]}, V = {v.shape[-1]}; use backend='triton'")
    if q.dtype not in (torch.bfloat16, torch.float16):
        return TypeError(f"backend='cuda' of chunk_gated_delta_rule takes bfloat16 or float16 q, k, v, got "
                         f"{q.dtype}; use backend='triton'")
    if N is not None and N > MAX_SEQUENCES:
        return ValueError(f"backend='cuda' of chunk_gated_delta_rule takes at most {MAX_SEQUENCES} sequences, "
                          f"got {N}; use backend='triton'")
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] != 9:
        return RuntimeError("backend='cuda' of chunk_gated_delta_rule needs an sm_90 GPU (H100 / H200), got "
                            f"{torch.cuda.get_device_name(device)}; use backend='triton'")
    return None


# The forward's kernels (csrc/chunk_gdr_fwd_sm90_device.cuh, FwdKind):
#   "fused"  2 HV N CTAs in clusters of 2, each with a state warpgroup (its 64 value columns) and a prep
#            warpgroup that preps every other chunk for both; on GVA pairs clusters of 4, the pair's four
#            CTAs sharing each k / q load
#   "split"  4 HV N CTAs in clusters of 4: the two state CTAs fed by two prep CTAs (two prep warpgroups
#            each) over the cluster's shared memory; on GVA pairs (an even number of value heads a qk
#            head: gva_pairs) clusters of 8, the pair's four state CTAs sharing each k / q load
#   "state"  Triton prep (every chunk slot in parallel) first, then 2 HV N state-only CTAs on its outputs
KERNELS = ("fused", "split", "state")


def gva_pairs(H, HV):
    """Whether the value heads can be taken in GVA pairs, two sharing each k / q load (the fused forward's
    clusters of 4, the split kernel's clusters of 8, the dS pass's clusters of 4): when every qk head has an
    even number of them (the entry points refuse `pairs` otherwise)."""
    return (HV // H) % 2 == 0


def forward_kernel(N, HV, sms, clusters=None, pairs=False):
    """The kernel the forward runs on a device of `sms` SMs: "split" where the fused kernel's 2 HV N CTAs
    would leave at least half of the SMs idle (few long sequences), so that the split kernel's 2 HV N prep
    CTAs take them and prep leaves the state CTAs' chain, provided its clusters (HV N of 4, or with
    `pairs` HV N / 2 of 8) are resident at once (`clusters`: how many can be, split_clusters; SMs / 4 (/ 8)
    where unknown); else "fused" (a second wave of the split kernel's clusters would take as long as the
    first). In the model (bench/NOTES.md, "The split kernel"): the anchor (64 state CTAs on 132 SMs) fused
    1070 us, Triton prep + state-only 233 + 614, split 669 (on GVA pairs). "state" is never picked: the
    split kernel does its prep on chip."""
    size = 8 if pairs else 4
    clusters = sms // size if clusters is None or clusters < 0 else clusters
    return "split" if 2 * HV * N <= sms // 2 and HV * N * 4 <= clusters * size else "fused"


_CLUSTERS = {}      # (device index, pairs) -> split_clusters' answer


def split_clusters(device_index, pairs):
    """The split kernel's clusters (of 4; with pairs, of 8) that can be resident at once on CUDA device
    `device_index` (cudaOccupancyMaxActiveClusters: a cluster's CTAs share one GPC, whose SMs need not be a
    multiple of the cluster's), or -1 where the runtime cannot say. Asked once per device and form; not
    during a CUDA-graph capture (-1 then, not kept: the runtime calls are not stream work, but whether a
    capture allows them is not known here)."""
    key = (device_index, bool(pairs))
    if key not in _CLUSTERS:
        if torch.cuda.is_current_stream_capturing():
            return -1
        from gdn_packed import _cext
        _CLUSTERS[key] = int(_cext.get_C().chunk_gdr_fwd_sm90_split_clusters(device_index, bool(pairs)))
    return _CLUSTERS[key]


def kept_shape(T, N, HV, K, V, C, device, dtype):
    """The shape of the forward's `kept` (the op's fake kernel calls this), fp32 flat, from shapes only:
    when the Triton state pass runs in S > 1 segments (gdn_packed.triton.chunk.fwd_segments: few long
    sequences), the state entering every segment ([N S, HV, K, V], which the kernel's state warpgroup
    stores as each segment starts), so that the backward's recompute of the states starts every segment
    from it (no pass A, no combine); then prep's outputs of every chunk slot (gdn_packed.triton.chunk.Prep:
    Ts, M, gates, row factors, chunk decays; 284 B a token and value head in bf16), which the kernel's prep
    writes and the Triton backward then takes instead of running prep. Empty where that backward runs in
    head slices (each slice its own prep and segments: gdn_packed.triton.chunk.keeps) or where Triton is
    not installed (that backward cannot run: it says so then, not the forward)."""
    try:
        from gdn_packed.triton.chunk import fwd_segments, keeps, prep_words
    except ImportError:
        return (0,)
    if not keeps(T, N, HV, K, V, dtype, device):
        return (0,)
    S = fwd_segments(T, N, HV, K, V, dtype, device, training=True)
    return (_entering_words(N, S, HV, K, V) + prep_words(T // C + N, HV, dtype),)


def _entering_words(N, S, HV, K, V):
    """The floats of kept's entering states: [N S, HV, K, V] with S > 1 segments, none with one."""
    return N * S * HV * K * V if S > 1 else 0


def _kept_parts(kept, T, N, NC, HV, dtype, device):
    """kept (kept_shape) as (entering states [N S, HV, K, V], None with one segment; a Prep of views), or
    (None, None) when empty; a ValueError when it is not that tensor."""
    if kept is None or kept.numel() == 0:
        return None, None
    from gdn_packed.triton.chunk import fwd_segments, prep_in, prep_words
    K = HEAD_DIM
    n = _entering_words(N, fwd_segments(T, N, HV, K, K, dtype, device, training=True), HV, K, K)
    want = n + prep_words(NC, HV, dtype)
    if kept.dtype != torch.float32 or kept.dim() != 1 or kept.numel() != want or not kept.is_contiguous() \
            or kept.data_ptr() % 16:
        raise ValueError(f"kept must be a contiguous, 16-byte aligned float32 tensor of {want} words (kept_shape), "
                         f"got {tuple(kept.shape)} {kept.dtype}")
    return (kept[:n].view(-1, HV, K, K) if n else None), prep_in(kept[n:], NC, HV, dtype)


def _aligned(x):
    """x contiguous with a 16-byte aligned base (TMA; the table's rows are read as int4)."""
    x = x.contiguous()
    return x if x.data_ptr() % 16 == 0 else x.clone()


def chunk_gdr_fwd_cuda(q, k, v, g, beta, table, cu_chunks, initial_state, scale, C, use_l2norm, o,
                       final_state, kept=None, *, A_log=None, dt_bias=None, host=False, kernel=None):
    """Writes o [T, HV, V] (every row: padding rows 0) and final_state [N, HV, K, V] float32, as
    gdn_packed.triton.chunk.chunk_gdr_fwd_triton. q, k [T, H, K], v [T, HV, V] (bf16 / fp16; fp32 with
    host=True); g, beta [T, HV]; table int32 [NC, 4], cu_chunks int32 [N+1]. With A_log, dt_bias [HV],
    g and beta are the raw a, b and the kernel forms g = -exp(A_log) softplus(a + dt_bias),
    beta = sigmoid(b) itself (fp32). kept (kept_shape, or None / empty): the states entering the segments
    and prep's outputs of the sequences' chunk slots are written there for the backward (its other slots
    are left as they are). kernel: one of KERNELS, or None: as forward_kernel says on the device, the
    fused kernel's tile program on CPU tensors (the host mirror; "split" runs the split kernel's, "state"
    Triton prep under the Triton interpreter and the state-only kernel's); with "state" Triton prep writes
    every chunk slot of kept's Prep."""
    if C != CHUNK:
        raise ValueError(f"the cuda chunked kernel is written for chunk size {CHUNK}, got {C}")
    T, H, K = q.shape
    HV, Vd = v.shape[1], v.shape[2]
    N, NC = cu_chunks.numel() - 1, table.shape[0]
    acts = (torch.bfloat16, torch.float16, torch.float32) if host else (torch.bfloat16, torch.float16)
    check_tensors(q=(q, (T, H, HEAD_DIM), acts), k=(k, (T, H, HEAD_DIM), q.dtype),
                  v=(v, (T, HV, HEAD_DIM), q.dtype), o=(o, (T, HV, HEAD_DIM), q.dtype),
                  g=(g, (T, HV), None), beta=(beta, (T, HV), None),
                  table=(table, (NC, 4), torch.int32), cu_chunks=(cu_chunks, (N + 1,), torch.int32),
                  initial_state=(initial_state, (N, HV, K, Vd), None),
                  final_state=(final_state, (N, HV, K, Vd), torch.float32),
                  A_log=(A_log, (HV,), None), dt_bias=(dt_bias, (HV,), None))
    if H == 0 or HV % H:
        raise ValueError(f"the value heads of v (v.shape[1] = {HV}) must be a multiple of the qk heads of q "
                         f"(q.shape[1] = {H})")
    if (A_log is None) != (dt_bias is None):
        raise ValueError("A_log and dt_bias come together (the raw gates) or not at all")
    if N == 0:
        o.zero_()               # no sequence: every row is padding
        return
    raw = A_log is not None
    entering, prep = _kept_parts(kept, T, N, NC, HV, q.dtype, q.device)
    ins = dict(prep_gates=None, prep_eg_last=None, prep_ts=None, prep_mm=None)    # the fused kernel's
    kernel, pairs = _kernel(q.device, N, H, HV, kernel)
    if kernel == "state":
        g, beta, prep = _triton_prep(q.device)(q, k, v, g, beta, table, HV, scale, use_l2norm, A_log, dt_bias, prep)
        ins = {f"prep_{n}": _aligned(getattr(prep, n)) for n in ("gates", "eg_last", "ts", "mm")}
        raw, prep = False, None                     # the gates are prep's; the backward keeps its outputs
    keep = {f"kept_{n}": None if prep is None else getattr(prep, n) for n in ("gates", "eg_last", "rn", "ts", "mm")}
    segments = 0 if entering is None else entering.shape[0] // N
    out = o if host or o.data_ptr() % 16 == 0 else torch.empty_like(o)    # TMA stores o's whole chunks
    launch("chunk_gdr_fwd_sm90", q.device, host=host,
           reads=dict(q=_aligned(q), k=_aligned(k), v=_aligned(v), g=g.to(torch.float32),
                      beta=beta.to(torch.float32),
                      A_log=A_log.to(torch.float32) if raw else None,
                      dt_bias=dt_bias.to(torch.float32) if raw else None,
                      table=_aligned(table), cu_chunks=cu_chunks,
                      initial_state=None if initial_state is None else initial_state.to(torch.float32), **ins),
           writes=dict(o=out, final_state=final_state, kept_entering=entering, **keep), kept_segments=segments,
           NC=NC, N=N, T=T, H=H, HV=HV, K=K, V=Vd, chunk_size=C, dtype=q.dtype, scale=float(scale),
           l2norm=bool(use_l2norm), raw_gates=raw, split=kernel == "split", pairs=pairs)
    if out is not o:
        o.copy_(out)


def _kernel(device, N, H, HV, kernel):
    """(kernel, pairs): the forward kernel to run (chunk_gdr_fwd_cuda's `kernel`: the one named, else the
    fused one on CPU tensors, the host mirror, and forward_kernel's choice on a device) and whether in its
    form on GVA pairs: the fused kernel wherever the value heads pair (gva_pairs; its clusters of 4 read
    each k / q block once for four CTAs); the split kernel where they pair and, on a device, its clusters of
    8 fit at once (where only clusters of 4 do, the form without pairs); the state-only kernel never."""
    if kernel is not None and kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS} or None, got {kernel!r}")
    pairs = gva_pairs(H, HV)
    if kernel is not None or device.type == "cpu":
        kernel = kernel or "fused"
        return kernel, kernel != "state" and pairs
    if device.type != "cuda":           # (the sm_90 report's meta tensors: an H200's 132 SMs)
        return forward_kernel(N, HV, 132, None, pairs), pairs
    index = device.index if device.index is not None else torch.cuda.current_device()
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    for form in ((True, False) if pairs else (False,)):
        kernel = forward_kernel(N, HV, sms, split_clusters(index, form), form)
        if kernel != "fused":           # ("split"; the GPU tests force "state" through forward_kernel too)
            return kernel, form and kernel == "split"
    return "fused", pairs


def _triton_prep(device):
    """The first launches of the "state" forward: fn(q, k, v, g, beta, table, HV, scale, l2norm, A_log,
    dt_bias, out) -> (g, beta, Prep), the gates formed from the raw a, b first (the Triton gate pass) when
    A_log is given, Triton prep's outputs of every chunk slot written into `out` (a Prep of views: kept's)
    when given. On CPU tensors only under the Triton interpreter (else a RuntimeError saying so)."""
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise RuntimeError("kernel='state' on CPU tensors runs Triton prep under the Triton interpreter: set "
                           "TRITON_INTERPRET=1 before importing triton")
    from gdn_packed.triton.chunk import _rows, chunk_fwd_prep
    from gdn_packed.triton.chunk_gate import gate_fwd_triton

    def run(q, k, v, g, beta, table, HV, scale, l2norm, A_log, dt_bias, out):
        if A_log is not None:
            g, beta = gate_fwd_triton(g, beta, A_log, dt_bias)
        qr, kr, _, gr, br, rows = _rows(q, k, v, g, beta)
        return g, beta, chunk_fwd_prep(qr, kr, gr, br, table, HV, scale, l2norm, rows, out=out)
    return run


def chunk_bwd_dstate_cuda(q, k, do, table, cu_chunks, prep, dht, dsn, dxp, dv, dh0, dq, dk, dg, dbeta, *,
                          host=False, pairs=None):
    """The reverse dS pass of the backward on Triton prep's outputs `prep` (gdn_packed.triton.chunk.Prep:
    gates [NC, HV, 5, C] fp32, eg_last [NC, HV] fp32, ts, mm [NC, HV, C, C] in q's dtype), as
    gdn_packed.triton.chunk.chunk_bwd_dstate: writes dsn [NC, HV, V, K] (dS^T leaving each chunk slot)
    and dxp [NC, HV, V, C] (dX'^T) in q's dtype in the slots of the sequences' chunks, dv [T, HV, V]
    (every row: padding rows 0), dh0 [N, HV, K, V] fp32, and 0 on the padding rows of dq, dk [T, H, K]
    and dg, dbeta [T, HV] (their other rows are the dq / dk / finalize kernels'). q, k [T, H, K],
    do [T, HV, V] (bf16 / fp16; fp32 with host=True), dht [N, HV, K, V] or None; table int32 [NC, 4],
    cu_chunks int32 [N + 1]. pairs: the kernel on GVA pairs of value heads, clusters of 4 sharing each k / q
    load (None: where they pair, gva_pairs; the same results either way; the host mirror ignores it)."""
    T, H, K = q.shape
    HV, Vd = do.shape[1], do.shape[2]
    N, NC = cu_chunks.numel() - 1, table.shape[0]
    acts = (torch.bfloat16, torch.float16, torch.float32) if host else (torch.bfloat16, torch.float16)
    gate_dt = (torch.float32, torch.bfloat16, torch.float16)
    check_tensors(q=(q, (T, H, HEAD_DIM), acts), k=(k, (T, H, HEAD_DIM), q.dtype),
                  do=(do, (T, HV, HEAD_DIM), q.dtype), table=(table, (NC, 4), torch.int32),
                  cu_chunks=(cu_chunks, (N + 1,), torch.int32),
                  gates=(prep.gates, (NC, HV, 5, CHUNK), torch.float32),
                  eg_last=(prep.eg_last, (NC, HV), torch.float32),
                  ts=(prep.ts, (NC, HV, CHUNK, CHUNK), q.dtype), mm=(prep.mm, (NC, HV, CHUNK, CHUNK), q.dtype),
                  dht=(dht, (N, HV, K, Vd), None), dsn=(dsn, (NC, HV, Vd, K), q.dtype),
                  dxp=(dxp, (NC, HV, Vd, CHUNK), q.dtype), dv=(dv, (T, HV, Vd), q.dtype),
                  dh0=(dh0, (N, HV, K, Vd), torch.float32), dq=(dq, (T, H, K), q.dtype),
                  dk=(dk, (T, H, K), q.dtype), dg=(dg, (T, HV), gate_dt), dbeta=(dbeta, (T, HV), dg.dtype))
    if H == 0 or HV % H:
        raise ValueError(f"the value heads of do (do.shape[1] = {HV}) must be a multiple of the qk heads of q "
                         f"(q.shape[1] = {H})")
    if N == 0:
        for x in (dq, dk, dv, dg, dbeta):
            x.zero_()           # no sequence: every row is padding
        return
    out = dv if host or dv.data_ptr() % 16 == 0 else torch.empty_like(dv)     # TMA stores dv's whole chunks
    launch("chunk_gdr_bwd_sm90", q.device, host=host,
           reads=dict(q=_aligned(q), k=_aligned(k), do=_aligned(do), gates=_aligned(prep.gates),
                      eg_last=prep.eg_last.contiguous(), ts=_aligned(prep.ts), mm=_aligned(prep.mm),
                      table=_aligned(table), cu_chunks=cu_chunks,
                      dht=None if dht is None else dht.to(torch.float32)),
           writes=dict(dsn=dsn, dxp=dxp, dv=out, dh0=dh0, dq=dq, dk=dk, dg=dg, dbeta=dbeta), N=N, T=T, H=H, HV=HV,
           K=K, V=Vd, NC=NC, chunk_size=CHUNK, dtype=q.dtype, gate_dtype=dg.dtype,
           pairs=gva_pairs(H, HV) if pairs is None else pairs)
    if out is not dv:
        dv.copy_(out)


def _dstate_as_triton(q, k, do, table, cu_chunks, prep, rows, dht, dsn, dxp, dv, dh0, dq, dk, dg, dbeta, cfg):
    """chunk_bwd_dstate_cuda with gdn_packed.triton.chunk.chunk_bwd_dstate's arguments (the Triton
    backward's `dstate`): rows and cfg are the Triton kernel's (q, k with other row strides are copied)."""
    chunk_bwd_dstate_cuda(q, k, do, table, cu_chunks, prep, dht, dsn, dxp, dv, dh0, dq, dk, dg, dbeta)


def chunk_bwd_grads_cuda(q, k, v, g, do, table, prep, st, ut, dsn, dxp, scale, dq, dk, dg_part, dbeta_part, *,
                         host=False):
    """The chunk-parallel gradients of the backward (csrc/chunk_gdr_grads_sm90.cu) in place of the Triton P,
    dq, A and dk kernels (gdn_packed.triton.chunk._bwd_heads' `grads`), on what the recompute (st = S^T,
    ut = U^T) and the dS pass (dsn = dSn^T, dxp = dX'^T) wrote, [NC, HV, V, K] and [NC, HV, V, C] in q's
    dtype, and prep's outputs `prep` (gates, eg_last, rn). Writes, on the rows of the table's chunks: dq, dk
    [T, H, K] (fp32: their values before the l2norm backward, else q's dtype), dg_part and dbeta_part [2, HV,
    T] fp32 (the two sides' shares): what chunk_bwd_finalize_kernel sums with NK = 2, NQ = 0. q, k [T, H, K],
    v, do [T, HV, V] (bf16 / fp16; fp32 with host=True), g [T, HV] fp32; table int32 [NC, 4]."""
    T, H, K = q.shape
    HV, Vd = v.shape[1], v.shape[2]
    NC = table.shape[0]
    acts = (torch.bfloat16, torch.float16, torch.float32) if host else (torch.bfloat16, torch.float16)
    out_dt = (q.dtype, torch.float32)
    check_tensors(q=(q, (T, H, HEAD_DIM), acts), k=(k, (T, H, HEAD_DIM), q.dtype),
                  v=(v, (T, HV, HEAD_DIM), q.dtype), do=(do, (T, HV, HEAD_DIM), q.dtype),
                  g=(g, (T, HV), torch.float32), table=(table, (NC, 4), torch.int32),
                  gates=(prep.gates, (NC, HV, 5, CHUNK), torch.float32),
                  eg_last=(prep.eg_last, (NC, HV), torch.float32), rn=(prep.rn, (NC, HV, 2, CHUNK), torch.float32),
                  st=(st, (NC, HV, Vd, K), q.dtype), ut=(ut, (NC, HV, Vd, CHUNK), q.dtype),
                  dsn=(dsn, (NC, HV, Vd, K), q.dtype), dxp=(dxp, (NC, HV, Vd, CHUNK), q.dtype),
                  dq=(dq, (T, H, K), out_dt), dk=(dk, (T, H, K), dq.dtype),
                  dg_part=(dg_part, (2, HV, T), torch.float32), dbeta_part=(dbeta_part, (2, HV, T), torch.float32))
    if H == 0 or HV % H:
        raise ValueError(f"the value heads of v (v.shape[1] = {HV}) must be a multiple of the qk heads of q "
                         f"(q.shape[1] = {H})")
    launch("chunk_gdr_grads_sm90", q.device, host=host,
           reads=dict(q=_aligned(q), k=_aligned(k), v=_aligned(v), do=_aligned(do), g=g, gates=_aligned(prep.gates),
                      eg_last=prep.eg_last, rn=_aligned(prep.rn), st=_aligned(st), ut=_aligned(ut),
                      dsn=_aligned(dsn), dxp=_aligned(dxp), table=_aligned(table)),
           writes=dict(dq=dq, dk=dk, dg_part=dg_part, dbeta_part=dbeta_part), N=0, T=T, H=H, HV=HV, K=K, V=Vd,
           NC=NC, chunk_size=CHUNK, dtype=q.dtype, scale=float(scale), dqk_f32=dq.dtype == torch.float32)


def _grads_as_triton(*args):
    """chunk_bwd_grads_cuda as the Triton backward's `grads`, looked up when called (the tests' host-mirror
    stand-in and the sm_90 report's recorder replace it, as _dstate_as_triton's dS pass)."""
    chunk_bwd_grads_cuda(*args)


def chunk_gdr_bwd_cuda(*args, kept=None, **kw):
    """Backward of backend="cuda": gdn_packed.triton.chunk.chunk_gdr_bwd_triton (its arguments) with the
    reverse dS pass of csrc/chunk_gdr_bwd_sm90.cu in place of the Triton one and the chunk-parallel
    gradients of csrc/chunk_gdr_grads_sm90.cu in place of its P, dq, A and dk kernels, on the segments'
    entering states and prep outputs the forward kept (kept_shape; without them that backward runs pass A
    and prep)."""
    from gdn_packed.triton.chunk import chunk_gdr_bwd_triton
    q, v, table, cu_chunks = args[0], args[2], args[5], args[6]
    entering, prep = _kept_parts(kept, q.shape[0], cu_chunks.numel() - 1, table.shape[0], v.shape[1], q.dtype,
                                 q.device)
    chunk_gdr_bwd_triton(*args, **kw, entering=entering, prep=prep, dstate=_dstate_as_triton, grads=_grads_as_triton)
