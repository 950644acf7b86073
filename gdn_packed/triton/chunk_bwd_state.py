"""The reverse sequential pass of the chunked gated delta rule backward (docs/DESIGN.md section 2): one
program per (sequence, value head, V-block), grid (N, HV, cdiv(V, BV)), walking the sequence's chunk
slots cu_chunks[n+1]-1 .. cu_chunks[n] with a [K, BV] float32 state-gradient block in registers.
(The forward-order recompute of S_in and Vnew is the forward's chunk_state_output_kernel with
STORE_STATES.) Tm = (I + A)^-1, M = scale causal(Q K^T) E and the l2norm row factors come from the
forward's chunk_prep_kernel (Tm, M [NC, HV, 1 + SPLIT, C, C]: fp32, or hi + lo planes in the input
dtype with SPLIT; full squares, zeros above the diagonal). Sequences without chunks store only their
boundary state (dh0 = dht, or 0).

  chunk_bwd_dstate_kernel     (reverse order), dS = dht[n] (or 0) entering the last chunk
      dS_next[j] = dS,   dVnew = M^T dO + diag(e^(Gamma - gamma)) K dS
      dS <- e^Gamma dS + scale Q^T diag(e^gamma) dO - K^T diag(beta e^gamma) Tm^T dVnew
      (the last term is W^T dVnew: W is never formed)
      out dS_next [NC, HV, K, V] (state dtype), dVnew [T, HV, V] fp32, dh0 [N, HV, K, V] fp32
With use_qk_l2norm, q and k enter the dots raw and the row factors 1/sqrt(|x|^2 + 1e-6) scale the fp32
results or the other operand (as in the forward). Numerics: state operands of tensor-core dots go
through the forward's _dot_state, Tm and M products through its _dot_pair (SPLIT for bf16/fp16: hi + lo
parts, ~fp32 exact; fp32 inputs: fp32 dots, tf32 on the GPU). States are stored fp32.
Names: `b_` blocks, `p_`/`o_` offsets, `m_` masks, as in FLA.
"""
import triton
import triton.language as tl

from gdn_packed.triton.chunk_fwd_legacy import _dot_pair, _dot_state, load_row_norms
from gdn_packed.triton.common import chunk_rows


@triton.jit
def load_cc_planes(p, j, i_h, HV, SPLIT: tl.constexpr, C: tl.constexpr, TRANS: tl.constexpr):
    """The [C, C] matrix (transposed with TRANS) of chunk slot j, value head i_h, from the forward's
    [NC, HV, 1 + SPLIT, C, C] buffer: (hi, lo) planes in the input dtype (SPLIT) or (fp32, fp32).
    chunk_prep_kernel writes the full square (zeros above the diagonal), so the loads are unmasked
    and go straight to shared memory as dot operands (a transpose is the pointer order, not a shuffle)."""
    o_c = tl.arange(0, C)
    if TRANS:
        o_rc = o_c[None, :] * C + o_c[:, None]
    else:
        o_rc = o_c[:, None] * C + o_c[None, :]
    off = (j * HV + i_h) * ((1 + SPLIT) * C * C) + o_rc
    b_hi = tl.load(p + off)
    if SPLIT:
        b_lo = tl.load(p + C * C + off)
    else:
        b_lo = b_hi
    return b_hi, b_lo


@triton.jit
def chunk_bwd_dstate_kernel(q, k, g, beta, do, table, cu_chunks, t_in, m_in, rn_in, dht, dsn, dvn, dh0, scale,
                            H, HV, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
                            BV: tl.constexpr, USE_L2: tl.constexpr, HAS_DHT: tl.constexpr,
                            SPLIT: tl.constexpr):
    i_n, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_qh = i_h // (HV // H)
    # HALVES (fp32 with BK > 128): dS held as two K-halves [BK / 2, BV] (b_ds: rows o_k, b_ds2: rows
    # o_k2); k read per half next to its dot, Q^T and K^T read transposed by the pointer order (no
    # register transpose), the dots in small loops (one shared-memory tile site each, fewer hoisted
    # addresses). The whole-K form spills registers on sm_90 (bwd_configs in chunk_bwd.py).
    HALVES: tl.constexpr = (not SPLIT) and BK > 128
    BKA: tl.constexpr = BK // 2 if HALVES else BK
    o_c = tl.arange(0, C)
    o_k = tl.arange(0, BKA)
    o_v = i_v * BV + tl.arange(0, BV)
    m_s = (o_k < K)[:, None] & (o_v < V)[None, :]
    p_s = o_k[:, None] * V + o_v[None, :]
    p_h = (i_n.to(tl.int64) * HV + i_h) * (K * V) + p_s
    if HAS_DHT:
        b_ds = tl.load(dht + p_h, mask=m_s, other=0.)
    else:
        b_ds = tl.zeros([BKA, BV], dtype=tl.float32)
    if HALVES:
        o_k2 = BKA + tl.arange(0, BKA)
        m_s2 = (o_k2 < K)[:, None] & (o_v < V)[None, :]
        p_s2 = o_k2[:, None] * V + o_v[None, :]
        p_h2 = (i_n.to(tl.int64) * HV + i_h) * (K * V) + p_s2
        if HAS_DHT:
            b_ds2 = tl.load(dht + p_h2, mask=m_s2, other=0.)
        else:
            b_ds2 = tl.zeros([BKA, BV], dtype=tl.float32)
    j0 = tl.load(cu_chunks + i_n)
    j1 = tl.load(cu_chunks + i_n + 1)
    for i_t in range(0, j1 - j0):
        j = (j1 - 1 - i_t).to(tl.int64)
        start, length = chunk_rows(table, j, C)
        rows, m_c = start + o_c, o_c < length
        tl.store(dsn + (j * HV + i_h) * (K * V) + p_s, b_ds.to(dsn.dtype.element_ty), mask=m_s)
        if HALVES:
            tl.store(dsn + (j * HV + i_h) * (K * V) + p_s2, b_ds2.to(dsn.dtype.element_ty), mask=m_s2)
        b_g = tl.load(g + rows * HV + i_h, mask=m_c, other=0.).to(tl.float32)
        b_beta = tl.load(beta + rows * HV + i_h, mask=m_c, other=0.).to(tl.float32)
        b_gam = tl.cumsum(b_g, axis=0)
        b_Gam = tl.sum(b_g, axis=0)
        b_eg = tl.exp(b_gam)
        m_k = m_c[:, None] & (o_k < K)[None, :]
        p_qk = rows[:, None] * (H * K) + i_qh * K + o_k[None, :]
        if not HALVES:
            b_q = tl.load(q + p_qk, mask=m_k, other=0.)
            b_k = tl.load(k + p_qk, mask=m_k, other=0.)
        b_rq, b_rk = load_row_norms(rn_in, j, i_h, HV, C, USE_L2)
        p_v = rows[:, None] * (HV * V) + i_h * V + o_v[None, :]
        m_v = m_c[:, None] & (o_v < V)[None, :]
        b_do = tl.load(do + p_v, mask=m_v, other=0.).to(tl.float32)
        if HALVES:
            b_kds = tl.zeros([C, BV], dtype=tl.float32)
            for i_w in range(0, 2):     # K dS over the two halves: one load and dot site
                b_kds = tl.dot(tl.load(k + p_qk + i_w * BKA,
                                       mask=m_c[:, None] & (o_k + i_w * BKA < K)[None, :], other=0.),
                               tl.where(i_w == 0, b_ds, b_ds2), b_kds)
            b_mt_hi, b_mt_lo = load_cc_planes(m_in, j, i_h, HV, SPLIT, C, True)
            b_dv = tl.dot(b_mt_hi, b_do, b_kds * (b_rk * tl.exp(b_Gam - b_gam))[:, None])
            tl.store(dvn + p_v, b_dv, mask=m_v)
            b_tt_hi, b_tt_lo = load_cc_planes(t_in, j, i_h, HV, SPLIT, C, True)
            b_y = tl.dot(b_tt_hi, b_dv) * (b_beta * b_eg * b_rk)[:, None]
            b_x = b_do * (scale * b_eg * b_rq)[:, None]
            p_t = rows[None, :] * (H * K) + i_qh * K
            m_t = (o_k < K)[:, None] & m_c[None, :]
            m_t2 = (o_k2 < K)[:, None] & m_c[None, :]
            b_ds = b_ds * tl.exp(b_Gam)
            b_ds2 = b_ds2 * tl.exp(b_Gam)
            for i_w in range(0, 2):     # Q^T x, then K^T (-y): one load and dot site per half
                p_w = tl.where(i_w == 0, q, k)
                b_w = tl.where(i_w == 0, b_x, -b_y)
                b_ds = tl.dot(tl.load(p_w + p_t + o_k[:, None], mask=m_t, other=0.), b_w, b_ds)
                b_ds2 = tl.dot(tl.load(p_w + p_t + o_k2[:, None], mask=m_t2, other=0.), b_w, b_ds2)
        else:
            b_tt_hi, b_tt_lo = load_cc_planes(t_in, j, i_h, HV, SPLIT, C, True)
            b_mt_hi, b_mt_lo = load_cc_planes(m_in, j, i_h, HV, SPLIT, C, True)
            b_dv = (_dot_pair(b_mt_hi, b_mt_lo, b_do, SPLIT)
                    + _dot_state(b_k, b_ds, SPLIT) * (b_rk * tl.exp(b_Gam - b_gam))[:, None])
            tl.store(dvn + p_v, b_dv, mask=m_v)
            b_tdv = _dot_pair(b_tt_hi, b_tt_lo, b_dv, SPLIT)
            b_ds = (b_ds * tl.exp(b_Gam)
                    + _dot_state(tl.trans(b_q), b_do * (scale * b_eg * b_rq)[:, None], SPLIT)
                    - _dot_state(tl.trans(b_k), b_tdv * (b_beta * b_eg * b_rk)[:, None], SPLIT))
    tl.store(dh0 + p_h, b_ds, mask=m_s)
    if HALVES:
        tl.store(dh0 + p_h2, b_ds2, mask=m_s2)
