"""Backward of the packed chunked gated delta rule: Triton kernels.

Notation (per chunk slot j, value head hv, qk head h = hv // G, G = HV // H; rows i < C = 64, rows at or
past the slot's length L are dead and every per-row gate is 0 there), as in the forward prep/state
kernels: q^ = rq q, k^ = rk k (rq, rk = 1 without l2norm), gam = in-chunk cumsum of g, eg = e^gam,
w_i = e^(gam_(L-1) - gam_i), egL = e^gam_(L-1), E_ij = e^(gam_i - gam_j) (j <= i, else 0),
A = strict_lower(beta_i E_ij k^_i.k^_j), T = (I + A)^-1, Ts = T - I, M = scale E (Q^ K^^T) (j <= i),
X' = beta (V - eg K^ S), U = T X', O = scale eg Q^ S + M U, S_next = egL S + K^^T (w U).
Given dO and dSn (gradient of the state leaving the chunk), chunk by chunk in reverse:
    dU  = M^T dO + w K^ dSn          dX' = T^T dU = dU + Ts^T dU          dv = beta dX'
    dS  = egL dSn + scale Q^^T (eg dO) - K^^T (beta eg dX')     (enters the previous chunk as its dSn)
and in parallel, with dM = dO U^T, dA = -dX' U^T, Pm = scale dM E (j <= i), DA = dA E (j < i):
    dQ^ = scale eg dO S^T + Pm K^
    dK^ = Pm^T Q^ - beta eg dX' S^T + w U dSn^T + beta DA K^ + DA^T (beta K^)
    dbeta = dX'.v - eg k^.(dX' S^T) + k^.(DA K^)                 (row dots: no C x C Gram matrix)
    dgam  = q^.dQ^ - k^.(Pm^T Q^) + beta k^.(DA K^) - k^.(DA^T beta K^) - beta eg k^.(dX' S^T),
            tau_i = w_i k^_i.(U dSn^T)_i
    dg_i = sum_{i' >= i} dgam_i' + sum_{i' < i} tau_i' + egL <S, dSn>   (in-chunk; Pm's diagonal,
            E_ii = 1, cancels between the q^.dQ^ and k^.(Pm^T Q^) terms and is left out of both);  l2norm: dq = rq (dQ^ - q^ (q^.dQ^)) (same for k).
(Checked against autograd of the float64 recurrence to 1e-15 by a torch prototype of these formulas.)

Launches (grids depend only on T, N and the shapes; unused chunk slots exit at once; fastest grid axis
first):
  forward prep (store_m: M instead of M T) and state pass (STORE_STATES: S^T at chunk start
      [NC, HV, V, K] and X'^T [NC, HV, V, C], in the input dtype as the forward's dots used them);
      launched by gdn_packed/triton/chunk.py, chunk_gdr_bwd_triton
  chunk_bwd_dstate_kernel  grid (cdiv(V, BV), HV, N S): the reverse sequential pass per sequence (or
      segment of S, chunk.py's chunk_bwd_dstate: dS is affine in the dS entering from the right,
      dS^T_prev = dS^T P~ + ..., so with S > 1 a pass A with PROPAGATE over the last S - 1 segments
      carries K identity rows to each segment's transition and chunk_combine_kernel with REVERSE
      gives the dS entering every segment), dS^T [BV, K] fp32 in registers (transposed: it is the
      register A operand of dS^T K^T). Writes dSn^T [NC, HV, V, K] and dX'^T [NC, HV, V, C] per chunk
      slot and dv = beta dX', all in the input dtype, dh0 (fp32, the first segment); and exact zeros
      on the padding rows of dv, dg, dbeta, dq, dk.
  chunk_bwd_cc_kernel      grid (HV, NC): the C x C part, once per value head and chunk: dM = dO U^T and
      dA = dX' U^T over the V-blocks, Pm and DA, then per K-block their products with K^ and Q^;
      writes those shares of rq dQ^ and rk dK^ fp32 [NC, HV, C, K] and its dg / dbeta shares
      (dX'.v, the row and column dots of Pm and DA) to the last partial slot.
  chunk_bwd_grads_kernel   grid (cdiv(K, BK), H, NC): one program per K-block, qk head and chunk slot;
      loops the G value heads of the qk head and the V-blocks for the state products (dO S^T, dX' S^T,
      U dSn^T); dq, dk of the group summed in registers with the C x C shares (no GVA partials);
      writes dq, dk (input dtype; fp32 pre-l2norm values with l2norm) and the dg / dbeta partials of
      its K-block [NK + 1, T, HV] fp32 (dg's cumsums are linear: each part's share is summed already).
  chunk_bwd_finalize_kernel grid (H, NC): dg, dbeta = the sums of their partials, and
      the l2norm backward of dq, dk.
Deterministic: no atomics; every scratch element has one writer; every sum runs in a fixed order.

Numerics: every tensor-core dot takes its operands in the input dtype with fp32 accumulation (fp32
inputs: every fp32-operand dot at configs.dot_precision, tf32). Rounded to the input dtype only as dot
operands: dS^T, dU^T, dX'^T scaled by its gate (dstate); U, dX', dSn^T
(grads: dX' and dSn^T are stored in the input dtype, as the grads kernel's dots take them; dSn^T also
enters the row dot <S, dSn> of dg, whose S^T is in the input dtype already); S^T is stored by the
forward's state pass in the input dtype, exactly as its dots used it.
dO^T scaled by its gate (scale e^gam rq) enters the dS update as two input-dtype operands, the
rounded value and its rounding error (one more dot, 24 -> 28 HGMMA a chunk): rounded once, it put dh0
at ~2x FLA's error on short sequences (bf16 4.76e-4 vs 2.36e-4; now 2.00e-4).
Pm and DA enter their products with K^, Q^ as fp32 tf32 dots: dgam takes the row sums and the column sums of the same
C x C products (Pm (.) Q^K^^T, DA (.) K^K^^T) from two different dots, and their difference, summed
by the reverse cumsum, cancels only if both see Pm, DA at better than bf16 precision (bf16 operands
there put dg at ~1.2-1.5x FLA's error; tf32 keeps it below). Kept fp32: dS in registers, the
combine of the segment boundaries, every accumulator, gate, exponential and row dot.
Names: `b_` block values, `p_`/`o_` pointers/offsets, `m_` masks, as in FLA.
"""
import torch
import triton
import triton.language as tl

from gdn_packed.triton.common import (chunk_rows, padding_after, padding_before_first, segment_chunks,
                                      segment_decay, zero_rows)


@triton.jit
def _gate_row(gates, j, hv, HV, r: tl.constexpr, C: tl.constexpr):
    """Row r of the forward's gates [NC, HV, 5, C] (0 beta, 1 eg rk, 2 scale eg rq, 3 w rk,
    4 beta eg rk; 0 on dead rows) for chunk slot j, value head hv."""
    return tl.load(gates + ((j * HV + hv) * 5 + r) * C + tl.arange(0, C))


@triton.jit
def _cc(p, j, hv, HV, C: tl.constexpr):
    """The [C, C] matrix of chunk slot j, value head hv from a [NC, HV, C, C] buffer (fully written)."""
    o_c = tl.arange(0, C)
    return tl.load(p + (j * HV + hv) * (C * C) + o_c[:, None] * C + o_c[None, :])


@triton.jit
def _zero_padding(dq, dk, dv, dg, dbeta, a, b, hv, i_v, H, HV, K: tl.constexpr, V: tl.constexpr,
                  BKP: tl.constexpr, BV: tl.constexpr, C: tl.constexpr):
    """Zeros on padding rows [a, b): dv columns of V-block i_v of value head hv; dg, dbeta of hv (V-block
    0); dq, dk of qk head hv // G (V-block 0 of the group's first value head)."""
    G = HV // H
    zero_rows(dv, a, b, hv * V + i_v * BV, tl.minimum(V - i_v * BV, BV), HV * V, BV, C)
    if i_v == 0:
        zero_rows(dg, a, b, hv, 1, HV, 1, C)
        zero_rows(dbeta, a, b, hv, 1, HV, 1, C)
        if hv % G == 0:
            zero_rows(dq, a, b, (hv // G) * K, K, H * K, BKP, C)
            zero_rows(dk, a, b, (hv // G) * K, K, H * K, BKP, C)


@triton.jit(do_not_specialize=["T_rows", "segments"])
def chunk_bwd_dstate_kernel(q, k, do, gates, eg_last, ts, mm, dht, dsn, dxp, dv, dh0, dq, dk, dg, dbeta,
                            ends, table, cu_chunks, T_rows, segments, H, HV, K: tl.constexpr,
                            V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                            HAS_DHT: tl.constexpr, PROPAGATE: tl.constexpr):
    i_v, i_h, i_p = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    # sequence i_n, segment i_s of `segments` (pass A: of the last segments - 1)
    if PROPAGATE:
        i_n, i_s = i_p // (segments - 1), i_p % (segments - 1) + 1
    else:
        i_n, i_s = i_p // segments, i_p % segments
    N = tl.num_programs(2) // segments
    if PROPAGATE:
        N = tl.num_programs(2) // (segments - 1)
    i_qh = i_h // (HV // H)
    DT = k.dtype.element_ty
    R: tl.constexpr = V + K if PROPAGATE else V     # rows of the carried dS^T (pass A: and the transition)
    o_c = tl.arange(0, C)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_s = m_v[:, None] & m_k[None, :]
    p_st = o_v[:, None] * K + o_k[None, :]              # [BV, BK] tile of a [V, K] (transposed) state
    o_kv = o_k[None, :] * V + o_v[:, None]              # of [K, V]
    if PROPAGATE:       # zero dS rows, then the identity rows of the segment's transition
        b_ds = tl.where((o_v[:, None] - V == o_k[None, :]) & (o_v < R)[:, None], 1.0, 0.0)
    elif HAS_DHT:       # dht, or the dS entering this segment (one per program)
        b_ds = tl.load(dht + (i_p.to(tl.int64) * HV + i_h) * (K * V) + o_kv, mask=m_s, other=0.)
    else:
        b_ds = tl.zeros([BV, BK], dtype=tl.float32)
    j0, j1 = segment_chunks(cu_chunks, i_n, i_s, segments)
    for i_t in range(0, j1 - j0):
        j = (j1 - 1 - i_t).to(tl.int64)
        start, length = chunk_rows(table, j, C)
        rows, m_c = start + o_c, o_c < length
        p_slot = j * HV + i_h
        if not PROPAGATE:
            tl.store(dsn + p_slot * (V * K) + p_st, b_ds.to(dsn.dtype.element_ty), mask=m_s)
        m_qk = m_c[:, None] & m_k[None, :]
        p_qk = rows[:, None] * (H * K) + i_qh * K + o_k[None, :]
        b_k = tl.load(k + p_qk, mask=m_qk, other=0.)                  # [C, BK]
        b_q = tl.load(q + p_qk, mask=m_qk, other=0.)
        m_vt = m_v[:, None] & m_c[None, :]
        p_vt = rows[None, :] * (HV * V) + i_h * V + o_v[:, None]      # [BV, C] transposed rows
        b_dot = tl.load(do + p_vt, mask=m_vt, other=0.)               # dO^T
        b_beta = _gate_row(gates, j, i_h, HV, 0, C)
        b_wrk = _gate_row(gates, j, i_h, HV, 3, C)
        # dU^T = dO^T M + (dS^T K^T) (w rk);  dX'^T = dU^T + dU^T Ts
        b_du = tl.dot(b_ds.to(DT), tl.trans(b_k), tl.zeros([BV, C], dtype=tl.float32))
        b_du = tl.dot(b_dot, _cc(mm, j, i_h, HV, C), b_du * b_wrk[None, :])
        b_dx = tl.dot(b_du.to(DT), _cc(ts, j, i_h, HV, C), b_du)
        if not PROPAGATE:
            tl.store(dxp + p_slot * (V * C) + o_v[:, None] * C + o_c[None, :], b_dx.to(dxp.dtype.element_ty),
                     mask=m_v[:, None])
            tl.store(dv + p_vt, (b_dx * b_beta[None, :]).to(dv.dtype.element_ty), mask=m_vt)
        # dS^T <- egL dS^T + (dO^T (scale eg rq)) Q - (dX'^T (beta eg rk)) K
        b_ag = b_dot.to(tl.float32) * _gate_row(gates, j, i_h, HV, 2, C)[None, :]
        b_a = b_ag.to(DT)
        b_ds = tl.dot(b_a, b_q, b_ds * tl.load(eg_last + p_slot))
        if DT != tl.float32:    # the rounding of the gated dO^T, taken back by a second product
            b_ds = tl.dot((b_ag - b_a.to(tl.float32)).to(DT), b_q, b_ds)
        b_b = (b_dx * _gate_row(gates, j, i_h, HV, 4, C)[None, :]).to(DT)
        b_ds = tl.dot(-b_b, b_k, b_ds)
    if PROPAGATE:       # the segment's rows at its start: dS^T from a zero dS at its end, then the transition
        p_e = (i_p.to(tl.int64) * HV + i_h) * (R * K) + o_v[:, None] * K + o_k[None, :]
        tl.store(ends + p_e, b_ds, mask=(o_v < R)[:, None] & m_k[None, :])
    elif i_s == 0:
        tl.store(dh0 + (i_n.to(tl.int64) * HV + i_h) * (K * V) + o_kv, b_ds, mask=m_s)
        a, b = padding_after(table, cu_chunks, i_n, N, T_rows)
        _zero_padding(dq, dk, dv, dg, dbeta, a, b, i_h, i_v, H, HV, K, V, triton.next_power_of_2(K), BV, C)
        if i_n == 0:
            first = padding_before_first(table, cu_chunks, N, T_rows)
            _zero_padding(dq, dk, dv, dg, dbeta, first * 0, first, i_h, i_v, H, HV, K, V,
                          triton.next_power_of_2(K), BV, C)


@triton.jit
def _rowdot(a, b):
    return tl.sum(a.to(tl.float32) * b.to(tl.float32), 1)


@triton.jit
def _u_dx(xp, dxp, b_ts, p_slot, i_v, V: tl.constexpr, C: tl.constexpr, BV: tl.constexpr):
    """V-block i_v of chunk slot p_slot from the [V, C] scratch of X'^T and dX'^T (input dtype): its
    columns o_v, their mask, U = X' + Ts X' [C, BV] (input dtype) and dX' [C, BV]."""
    o_v = i_v + tl.arange(0, BV)
    m_v = o_v < V
    o_ct = o_v[None, :] * C + tl.arange(0, C)[:, None]                  # [C, BV] of a [V, C] buffer
    b_xp = tl.load(xp + p_slot * (V * C) + o_ct, mask=m_v[None, :], other=0.)     # X'
    b_u = tl.dot(b_ts, b_xp, b_xp.to(tl.float32)).to(b_xp.dtype)     # U = X' + Ts X'
    b_dx = tl.load(dxp + p_slot * (V * C) + o_ct, mask=m_v[None, :], other=0.)
    return o_v, m_v, b_u, b_dx


@triton.jit
def chunk_bwd_cc_kernel(q, k, v, g, do, gates, rn, ts, xp, dxp, dq_cc, dk_cc, dg_part, dbeta_part, table, scale, T,
                        H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                        C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, SLOT: tl.constexpr,
                        PREC: tl.constexpr):
    """The C x C part of the gradients, once per (value head, chunk): dM = dO U^T, dA = dX' U^T over
    the V-blocks, Pm and DA from them, then over K-blocks their products with K^ and Q^: rq dQ^ and
    rk dK^ shares written fp32 to dq_cc, dk_cc [NC, HV, C, K], and this part's dg / dbeta shares to
    partial slot SLOT."""
    i_h, j = tl.program_id(0), tl.program_id(1).to(tl.int64)
    start, length = chunk_rows(table, j, C)
    if length == 0:
        return
    i_qh = i_h // (HV // H)
    o_c = tl.arange(0, C)
    rows, m_c = start + o_c, o_c < length
    p_slot = j * HV + i_h
    b_ts = _cc(ts, j, i_h, HV, C)
    b_dM = tl.zeros([C, C], dtype=tl.float32)                         # dO U^T
    b_dA = tl.zeros([C, C], dtype=tl.float32)                         # dX' U^T (= -dA)
    b_dxv = tl.zeros([C], dtype=tl.float32)                           # dX' . v
    p_cv = start * (HV * V) + i_h * V
    for i_v in range(0, V, BV):
        o_v, m_v, b_u, b_dx = _u_dx(xp, dxp, b_ts, p_slot, i_v, V, C, BV)
        m_cv = m_c[:, None] & m_v[None, :]
        o_cv = o_c[:, None] * (HV * V) + o_v[None, :]
        b_do = tl.load(do + p_cv + o_cv, mask=m_cv, other=0.)
        b_v = tl.load(v + p_cv + o_cv, mask=m_cv, other=0.)
        b_dxv += _rowdot(b_dx, b_v)
        b_dM = tl.dot(b_do, tl.trans(b_u), b_dM)
        b_dA = tl.dot(b_dx, tl.trans(b_u), b_dA)
    b_E = segment_decay(g, rows, length, HV, i_h, C)
    b_beta = _gate_row(gates, j, i_h, HV, 0, C)
    lower = o_c[:, None] > o_c[None, :]
    # Pm split into its strict lower part and its diagonal: the diagonal (E_ii = 1) has no gate
    # gradient, and left in the two dots below it would enter dgam as row sum - column sum of
    # the same value from two roundings, noise the reverse cumsum accumulates (fast decay: the
    # true dgam is tiny there, the noise is not)
    b_pm = tl.where(lower, scale * b_dM * b_E, 0.)                    # Pm, strictly lower
    b_pd = tl.sum(tl.where(o_c[:, None] == o_c[None, :], scale * b_dM * b_E, 0.), 1)   # Pm_ii
    b_da = tl.where(lower, -b_dA * b_E, 0.)                           # DA
    p_rn = p_slot * (2 * C)
    b_rq = tl.load(rn + p_rn + o_c)
    b_rk = tl.load(rn + p_rn + C + o_c)
    b_qM = tl.zeros([C], dtype=tl.float32)
    b_colP = tl.zeros([C], dtype=tl.float32)
    b_rowA = tl.zeros([C], dtype=tl.float32)
    b_colA = tl.zeros([C], dtype=tl.float32)
    o_b = tl.arange(0, BK)
    zero = tl.zeros([C, BK], dtype=tl.float32)
    for i_k in range(0, K, BK):
        m_qk = m_c[:, None] & (i_k + o_b < K)[None, :]
        o_qk = start * (H * K) + i_qh * K + i_k + o_c[:, None] * (H * K) + o_b[None, :]
        b_q = tl.load(q + o_qk, mask=m_qk, other=0.)
        b_k = tl.load(k + o_qk, mask=m_qk, other=0.)
        b_kf, b_qf = b_k.to(tl.float32), b_q.to(tl.float32)
        b_t = tl.dot(b_pm * b_rk[None, :], b_kf, zero, input_precision=PREC)                 # Pm K^
        b_qM += b_rq * _rowdot(b_q, b_t)
        b_dq = b_rq[:, None] * (b_t + (b_pd * b_rk)[:, None] * b_kf)
        b_t = tl.dot(tl.trans(b_pm * b_rq[:, None]), b_qf, zero, input_precision=PREC)       # Pm^T Q^
        b_colP += b_rk * _rowdot(b_k, b_t)
        b_dk = b_rk[:, None] * (b_t + (b_pd * b_rq)[:, None] * b_qf)
        b_t = tl.dot(b_da * b_rk[None, :], b_kf, zero, input_precision=PREC)                 # DA K^
        b_rowA += b_rk * _rowdot(b_k, b_t)
        b_dk += (b_rk * b_beta)[:, None] * b_t
        b_t = tl.dot(tl.trans(b_da * (b_beta * b_rk)[:, None]), b_kf, zero,
                     input_precision=PREC)                                                     # DA^T beta K^
        b_colA += b_rk * _rowdot(b_k, b_t)
        b_dk += b_rk[:, None] * b_t
        o_cc = p_slot * (C * K) + o_c[:, None] * K + i_k + o_b[None, :]
        tl.store(dq_cc + o_cc, b_dq, mask=m_qk)
        tl.store(dk_cc + o_cc, b_dk, mask=m_qk)
    p_part = (SLOT * T + rows) * HV + i_h
    tl.store(dg_part + p_part, tl.cumsum(b_qM - b_colP + b_beta * b_rowA - b_colA, 0, reverse=True), mask=m_c)
    tl.store(dbeta_part + p_part, b_dxv + b_rowA, mask=m_c)


@triton.jit
def chunk_bwd_grads_kernel(q, k, do, gates, eg_last, ts, xp, st, dsn, dxp, dq_cc, dk_cc, dq, dk, dg_part,
                           dbeta_part, table, T, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                           V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """The state-product part of the gradients per (K-block, qk head, chunk), the group's value heads
    summed in registers, plus the C x C part from chunk_bwd_cc_kernel's dq_cc, dk_cc: writes dq, dk (rq dQ^,
    rk dK^) and this K-block's dg / dbeta shares."""
    i_k, i_qh, j = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    start, length = chunk_rows(table, j, C)
    if length == 0:
        return
    G = HV // H
    o_c = tl.arange(0, C)
    rows, m_c = start + o_c, o_c < length
    o_b = tl.arange(0, BK)
    m_k = i_k * BK + o_b < K
    m_qk = m_c[:, None] & m_k[None, :]
    # scalar int64 bases and int32 tile offsets (no per-element 64-bit address arithmetic)
    p_qk = start * (H * K) + i_qh * K + i_k * BK
    o_qk = o_c[:, None] * (H * K) + o_b[None, :]
    b_q = tl.load(q + p_qk + o_qk, mask=m_qk, other=0.)               # raw q, k [C, BK]
    b_k = tl.load(k + p_qk + o_qk, mask=m_qk, other=0.)
    b_dq = tl.zeros([C, BK], dtype=tl.float32)                        # rq dQ^ of the group
    b_dk = tl.zeros([C, BK], dtype=tl.float32)                        # rk dK^ of the group
    o_cck = o_c[:, None] * K + i_k * BK + o_b[None, :]
    for i_g in range(0, G):
        i_h = i_qh * G + i_g
        p_slot = j * HV + i_h
        b_dq += tl.load(dq_cc + p_slot * (C * K) + o_cck, mask=m_qk, other=0.)
        b_dk += tl.load(dk_cc + p_slot * (C * K) + o_cck, mask=m_qk, other=0.)
        b_ts = _cc(ts, j, i_h, HV, C)
        b_qF = tl.zeros([C], dtype=tl.float32)                        # q . (dO S^T)
        b_kF1 = tl.zeros([C], dtype=tl.float32)                       # k . (dX' S^T)
        b_kF2 = tl.zeros([C], dtype=tl.float32)                       # k . (U dSn^T)
        b_sds = tl.zeros([BK], dtype=tl.float32)                      # <S, dSn> over this K-block
        b_g2 = _gate_row(gates, j, i_h, HV, 2, C)
        b_g3 = _gate_row(gates, j, i_h, HV, 3, C)
        b_g4 = _gate_row(gates, j, i_h, HV, 4, C)
        p_cv = start * (HV * V) + i_h * V
        p_vk = p_slot * (V * K) + i_k * BK
        for i_v in range(0, V, BV):
            o_v, m_v, b_u, b_dx = _u_dx(xp, dxp, b_ts, p_slot, i_v, V, C, BV)
            b_do = tl.load(do + p_cv + o_c[:, None] * (HV * V) + o_v[None, :],
                           mask=m_c[:, None] & m_v[None, :], other=0.)
            o_vk = o_v[:, None] * K + o_b[None, :]                        # [BV, BK] of [V, K]
            m_vk = m_v[:, None] & m_k[None, :]
            b_s = tl.load(st + p_vk + o_vk, mask=m_vk, other=0.)          # S^T
            b_dsn = tl.load(dsn + p_vk + o_vk, mask=m_vk, other=0.)       # dSn^T
            b_sds += tl.sum(b_s.to(tl.float32) * b_dsn.to(tl.float32), 0)
            b_f = tl.dot(b_do, b_s, tl.zeros([C, BK], dtype=tl.float32))
            b_qF += _rowdot(b_q, b_f)
            b_dq += b_g2[:, None] * b_f
            b_f = tl.dot(b_dx, b_s, tl.zeros([C, BK], dtype=tl.float32))
            b_kF1 += _rowdot(b_k, b_f)
            b_dk -= b_g4[:, None] * b_f
            b_f = tl.dot(b_u, b_dsn, tl.zeros([C, BK], dtype=tl.float32))
            b_kF2 += _rowdot(b_k, b_f)
            b_dk += b_g3[:, None] * b_f
        b_beta = _gate_row(gates, j, i_h, HV, 0, C)
        b_eg = _gate_row(gates, j, i_h, HV, 1, C)                       # eg rk
        b_tau = b_g3 * b_kF2
        # this K-block's share of dg: the reverse cumsum of its dgam terms, plus tau's share
        # sum_{i' < i} tau_i' as a forward cumsum (not sum(tau) - sum_{i' >= i} tau_i', which cancels
        # when w puts all of tau on the last rows: fast decay), plus egL <S, dSn> on every row
        b_dg = (tl.cumsum(b_g2 * b_qF - b_beta * b_eg * b_kF1, 0, reverse=True) + (tl.cumsum(b_tau, 0) - b_tau)
                + tl.load(eg_last + p_slot) * tl.sum(b_sds, 0))
        p_part = (i_k * T + rows) * HV + i_h
        tl.store(dg_part + p_part, b_dg, mask=m_c)
        tl.store(dbeta_part + p_part, -b_eg * b_kF1, mask=m_c)
    tl.store(dq + p_qk + o_qk, b_dq.to(dq.dtype.element_ty), mask=m_qk)
    tl.store(dk + p_qk + o_qk, b_dk.to(dk.dtype.element_ty), mask=m_qk)


@triton.jit
def _l2norm_bwd(x, dxr, r):
    """Gradient of the raw rows x given dxr = r dX^ (the gradient with r held fixed): dxr - r^2 x (x.dxr)."""
    return dxr - (r * r * _rowdot(x, dxr))[:, None] * x.to(tl.float32)


@triton.jit
def chunk_bwd_finalize_kernel(q, k, dq_pre, dk_pre, rn, dg_part, dbeta_part, dq, dk, dg, dbeta, table,
                              T, H, HV, K: tl.constexpr, C: tl.constexpr, BKP: tl.constexpr,
                              NK: tl.constexpr, USE_L2: tl.constexpr):
    i_qh, j = tl.program_id(0), tl.program_id(1).to(tl.int64)
    start, length = chunk_rows(table, j, C)
    if length == 0:
        return
    G = HV // H
    o_c = tl.arange(0, C)
    rows, m_c = start + o_c, o_c < length
    for i_g in range(0, G):
        i_h = i_qh * G + i_g
        b_dg = tl.zeros([C], dtype=tl.float32)
        b_db = tl.zeros([C], dtype=tl.float32)
        for i_k in range(0, NK):
            p_part = (i_k * T + rows) * HV + i_h
            b_dg += tl.load(dg_part + p_part, mask=m_c, other=0.)
            b_db += tl.load(dbeta_part + p_part, mask=m_c, other=0.)
        tl.store(dg + rows * HV + i_h, b_dg.to(dg.dtype.element_ty), mask=m_c)
        tl.store(dbeta + rows * HV + i_h, b_db.to(dbeta.dtype.element_ty), mask=m_c)
    if USE_L2:
        o_k = tl.arange(0, BKP)
        m_qk = m_c[:, None] & (o_k < K)[None, :]
        p_qk = rows[:, None] * (H * K) + i_qh * K + o_k[None, :]
        p_rn = (j * HV + i_qh * G) * (2 * C)
        b_dq = _l2norm_bwd(tl.load(q + p_qk, mask=m_qk, other=0.),
                           tl.load(dq_pre + p_qk, mask=m_qk, other=0.), tl.load(rn + p_rn + o_c))
        tl.store(dq + p_qk, b_dq.to(dq.dtype.element_ty), mask=m_qk)
        b_dk = _l2norm_bwd(tl.load(k + p_qk, mask=m_qk, other=0.),
                           tl.load(dk_pre + p_qk, mask=m_qk, other=0.), tl.load(rn + p_rn + C + o_c))
        tl.store(dk + p_qk, b_dk.to(dk.dtype.element_ty), mask=m_qk)
