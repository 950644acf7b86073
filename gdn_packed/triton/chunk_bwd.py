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
    dgam  = q^.dQ^ - k^.(Pm^T Q^) + beta k^.(DA K^) - k^.(DA^T beta K^) - beta eg k^.(dX' S^T) - tau,
            tau_i = w_i k^_i.(U dSn^T)_i; the last real row also gets sum(tau) + egL <S, dSn>
    dg  = reverse cumsum of dgam within the chunk;  l2norm: dq = rq (dQ^ - q^ (q^.dQ^)) (same for k).
(Checked against autograd of the float64 recurrence to 1e-15 by a torch prototype of these formulas.)

Launches (grids depend only on T, N and the shapes; unused chunk slots exit at once; fastest grid axis
first):
  forward prep (store_m: M instead of M T) and state pass (STORE_STATES: S^T at chunk start fp32
      [NC, HV, V, K], X'^T [NC, HV, V, C] input dtype)
  chunk_bwd_dstate_kernel  grid (cdiv(V, BV), HV, N): the reverse sequential pass, dS^T [BV, K] fp32 in
      registers (transposed: it is the register A operand of dS^T K^T). Writes dSn^T per chunk slot
      fp32 [NC, HV, V, K], dX'^T fp32 [NC, HV, V, C], dv = beta dX' (input dtype), dh0; and exact
      zeros on the padding rows of dv, dg, dbeta, dq, dk.
  chunk_bwd_grads_kernel   grid (cdiv(K, BK), H, NC): one program per K-block, qk head and chunk slot;
      loops the G value heads of the qk head and the V-blocks; dq, dk of the group summed in registers
      (no GVA partials); writes dq, dk (input dtype; fp32 pre-l2norm values with l2norm) and the
      dgam / dbeta partials of its K-block [NK, T, HV] fp32.
  chunk_bwd_finalize_kernel grid (H, NC): dg = reverse cumsum of the summed dgam partials, dbeta, and
      the l2norm backward of dq, dk.
Deterministic: no atomics; every scratch element has one writer; every sum runs in a fixed order.

Numerics: every tensor-core dot takes its operands in the input dtype with fp32 accumulation (fp32
inputs: tf32x3 dots, ~fp32 exact). Rounded to the input dtype only as dot operands: dS^T, dO^T scaled
by its gate, dU^T, dX'^T scaled by its gate (dstate); U, dX', S^T, dSn^T (grads). Pm and DA enter
their products with K^, Q^ as fp32 tf32 dots: dgam takes the row sums and the column sums of the same
C x C products (Pm (.) Q^K^^T, DA (.) K^K^^T) from two different dots, and their difference, summed
by the reverse cumsum, cancels only if both see Pm, DA at better than bf16 precision (bf16 operands
there put dg at ~1.2-1.5x FLA's error; tf32 keeps it below). Kept fp32: dS (registers and
scratch), dX' (scratch), every accumulator, gate, exponential and row dot.
Names: `b_` block values, `p_`/`o_` pointers/offsets, `m_` masks, as in FLA.
"""
import torch
import triton
import triton.language as tl

from gdn_packed.triton.segments import chunk_rows, padding_after, padding_before_first

CHUNK = 64


@triton.jit
def _mma(a, b, acc, F32: tl.constexpr):
    """acc + a @ b on tensor cores; fp32 operands (F32) as tf32x3 (~fp32 exact)."""
    if F32:
        out = tl.dot(a, b, acc, input_precision="tf32x3")
    else:
        out = tl.dot(a, b, acc)
    return out


@triton.jit
def _mma_tf32(a, b, acc, F32: tl.constexpr):
    """acc + a @ b with fp32 operands: tf32 (bf16/fp16 inputs), tf32x3 (F32, ~fp32 exact)."""
    if F32:
        out = tl.dot(a, b, acc, input_precision="tf32x3")
    else:
        out = tl.dot(a, b, acc, input_precision="tf32")
    return out


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
def _zero_rows(p, a, b, col0, ncols, stride, BW: tl.constexpr, C: tl.constexpr):
    """p[r * stride + col0 + c] = 0 for rows a <= r < b (int64) and columns c < ncols (ncols <= BW)."""
    o_c = tl.arange(0, C)
    o_w = tl.arange(0, BW)
    zeros = tl.zeros([C, BW], dtype=p.dtype.element_ty)
    for it in range(0, tl.cdiv(b - a, C)):
        rows = a + it * C + o_c
        tl.store(p + rows[:, None] * stride + col0 + o_w[None, :], zeros,
                 mask=(rows < b)[:, None] & (o_w < ncols)[None, :])


@triton.jit
def _zero_padding(dq, dk, dv, dg, dbeta, a, b, hv, i_v, H, HV, K: tl.constexpr, V: tl.constexpr,
                  BKP: tl.constexpr, BV: tl.constexpr, C: tl.constexpr):
    """Zeros on padding rows [a, b): dv columns of V-block i_v of value head hv; dg, dbeta of hv (V-block
    0); dq, dk of qk head hv // G (V-block 0 of the group's first value head)."""
    G = HV // H
    _zero_rows(dv, a, b, hv * V + i_v * BV, tl.minimum(V - i_v * BV, BV), HV * V, BV, C)
    if i_v == 0:
        _zero_rows(dg, a, b, hv, 1, HV, 1, C)
        _zero_rows(dbeta, a, b, hv, 1, HV, 1, C)
        if hv % G == 0:
            _zero_rows(dq, a, b, (hv // G) * K, K, H * K, BKP, C)
            _zero_rows(dk, a, b, (hv // G) * K, K, H * K, BKP, C)


@triton.jit(do_not_specialize=["T_rows"])
def chunk_bwd_dstate_kernel(q, k, do, gates, eg_last, ts, mm, dht, dsn, dxp, dv, dh0, dq, dk, dg, dbeta,
                            table, cu_chunks, T_rows, H, HV, K: tl.constexpr, V: tl.constexpr,
                            C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                            HAS_DHT: tl.constexpr, F32: tl.constexpr):
    i_v, i_h, i_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_qh = i_h // (HV // H)
    DT = k.dtype.element_ty
    o_c = tl.arange(0, C)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_s = m_v[:, None] & m_k[None, :]
    p_st = o_v[:, None] * K + o_k[None, :]              # [BV, BK] tile of a [V, K] (transposed) state
    p_h = (i_n.to(tl.int64) * HV + i_h) * (K * V) + o_k[None, :] * V + o_v[:, None]   # of [K, V]
    if HAS_DHT:
        b_ds = tl.load(dht + p_h, mask=m_s, other=0.)                 # dS^T [BV, BK]
    else:
        b_ds = tl.zeros([BV, BK], dtype=tl.float32)
    j0 = tl.load(cu_chunks + i_n)
    j1 = tl.load(cu_chunks + i_n + 1)
    for i_t in range(0, j1 - j0):
        j = (j1 - 1 - i_t).to(tl.int64)
        start, length = chunk_rows(table, j, C)
        rows, m_c = start + o_c, o_c < length
        p_slot = j * HV + i_h
        tl.store(dsn + p_slot * (V * K) + p_st, b_ds, mask=m_s)
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
        b_du = _mma(b_ds.to(DT), tl.trans(b_k), tl.zeros([BV, C], dtype=tl.float32), F32)
        b_du = _mma(b_dot, _cc(mm, j, i_h, HV, C), b_du * b_wrk[None, :], F32)
        b_dx = _mma(b_du.to(DT), _cc(ts, j, i_h, HV, C), b_du, F32)
        tl.store(dxp + p_slot * (V * C) + o_v[:, None] * C + o_c[None, :], b_dx, mask=m_v[:, None])
        tl.store(dv + p_vt, (b_dx * b_beta[None, :]).to(dv.dtype.element_ty), mask=m_vt)
        # dS^T <- egL dS^T + (dO^T (scale eg rq)) Q - (dX'^T (beta eg rk)) K
        b_a = (b_dot.to(tl.float32) * _gate_row(gates, j, i_h, HV, 2, C)[None, :]).to(DT)
        b_ds = _mma(b_a, b_q, b_ds * tl.load(eg_last + p_slot), F32)
        b_b = (b_dx * _gate_row(gates, j, i_h, HV, 4, C)[None, :]).to(DT)
        b_ds = _mma(-b_b, b_k, b_ds, F32)
    tl.store(dh0 + p_h, b_ds, mask=m_s)
    a, b = padding_after(table, cu_chunks, i_n, tl.num_programs(2), T_rows)
    _zero_padding(dq, dk, dv, dg, dbeta, a, b, i_h, i_v, H, HV, K, V, triton.next_power_of_2(K), BV, C)
    if i_n == 0:
        first = padding_before_first(table, cu_chunks, tl.num_programs(2), T_rows)
        _zero_padding(dq, dk, dv, dg, dbeta, first * 0, first, i_h, i_v, H, HV, K, V,
                      triton.next_power_of_2(K), BV, C)


@triton.jit
def _segment_decay(g, rows, length, hv, HV, C: tl.constexpr):
    """E [C, C]: E_ij = exp(sum of g over rows (j, i]) for j <= i, else 0, as a row-wise reverse scan of
    the masked g (no difference of two cumsums: g = -inf gives 0, never inf - inf)."""
    o_c = tl.arange(0, C)
    # b_gn[t] = g of row t + 1 (0 past the chunk): row i sums b_gn[t] over j <= t < i
    b_gn = tl.load(g + (rows + 1) * HV + hv, mask=(o_c + 1) < length, other=0.)
    b_z = tl.where(o_c[None, :] < o_c[:, None], b_gn.to(tl.float32)[None, :], 0.)
    b_d = tl.cumsum(b_z, 1, reverse=True)
    return tl.where(o_c[:, None] >= o_c[None, :], tl.exp(b_d), 0.)


@triton.jit
def _rowdot(a, b):
    return tl.sum(a.to(tl.float32) * b.to(tl.float32), 1)


@triton.jit
def chunk_bwd_grads_kernel(q, k, v, g, do, gates, eg_last, rn, ts, xp, st, dsn, dxp, dq, dk, dgam_part,
                           dbeta_part, table, scale, T, H, HV, K: tl.constexpr, V: tl.constexpr,
                           C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_L2: tl.constexpr,
                           F32: tl.constexpr):
    i_k, i_qh, j = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    start, length = chunk_rows(table, j, C)
    if length == 0:
        return
    G = HV // H
    DT = k.dtype.element_ty
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
    p_rn = (j * HV + i_qh * G) * (2 * C)
    b_rq = tl.load(rn + p_rn + o_c)                                   # (the group shares rq, rk)
    b_rk = tl.load(rn + p_rn + C + o_c)
    causal = o_c[:, None] >= o_c[None, :]
    len_v = tl.where(i_k == 0, length, 0)                             # dX'.v: K-block 0 only
    b_dq = tl.zeros([C, BK], dtype=tl.float32)                        # rq dQ^ of the group
    b_dk = tl.zeros([C, BK], dtype=tl.float32)                        # rk dK^ of the group
    for i_g in range(0, G):
        i_h = i_qh * G + i_g
        p_slot = j * HV + i_h
        b_ts = _cc(ts, j, i_h, HV, C)
        b_dM = tl.zeros([C, C], dtype=tl.float32)                     # dO U^T
        b_dA = tl.zeros([C, C], dtype=tl.float32)                     # dX' U^T (= -dA)
        b_qF = tl.zeros([C], dtype=tl.float32)                        # q . (dO S^T)
        b_kF1 = tl.zeros([C], dtype=tl.float32)                       # k . (dX' S^T)
        b_kF2 = tl.zeros([C], dtype=tl.float32)                       # k . (U dSn^T)
        b_dxv = tl.zeros([C], dtype=tl.float32)                       # dX' . v
        b_sds = tl.zeros([BK], dtype=tl.float32)                      # <S, dSn> over this K-block
        b_g2 = _gate_row(gates, j, i_h, HV, 2, C)
        b_g3 = _gate_row(gates, j, i_h, HV, 3, C)
        b_g4 = _gate_row(gates, j, i_h, HV, 4, C)
        p_cv = start * (HV * V) + i_h * V
        p_vk = p_slot * (V * K) + i_k * BK
        for i_v in range(0, V, BV):
            o_v = i_v + tl.arange(0, BV)
            m_v = o_v < V
            o_ct = o_v[None, :] * C + o_c[:, None]                        # [C, BV] of a [V, C] buffer
            b_xp = tl.load(xp + p_slot * (V * C) + o_ct, mask=m_v[None, :], other=0.)     # X'
            b_u = _mma(b_ts, b_xp, b_xp.to(tl.float32), F32).to(DT)       # U = X' + Ts X'
            b_dx = tl.load(dxp + p_slot * (V * C) + o_ct, mask=m_v[None, :], other=0.).to(DT)
            m_cv = m_c[:, None] & m_v[None, :]
            o_cv = o_c[:, None] * (HV * V) + o_v[None, :]
            b_do = tl.load(do + p_cv + o_cv, mask=m_cv, other=0.)
            b_v = tl.load(v + p_cv + o_cv, mask=(o_c < len_v)[:, None] & m_v[None, :], other=0.)
            b_dxv += _rowdot(b_dx, b_v)
            b_dM = _mma(b_do, tl.trans(b_u), b_dM, F32)
            b_dA = _mma(b_dx, tl.trans(b_u), b_dA, F32)
            o_vk = o_v[:, None] * K + o_b[None, :]                        # [BV, BK] of [V, K]
            m_vk = m_v[:, None] & m_k[None, :]
            b_s = tl.load(st + p_vk + o_vk, mask=m_vk, other=0.)          # S^T
            b_dsn = tl.load(dsn + p_vk + o_vk, mask=m_vk, other=0.)       # dSn^T
            b_sds += tl.sum(b_s * b_dsn, 0)
            b_f = _mma(b_do, b_s.to(DT), tl.zeros([C, BK], dtype=tl.float32), F32)
            b_qF += _rowdot(b_q, b_f)
            b_dq += b_g2[:, None] * b_f
            b_f = _mma(b_dx, b_s.to(DT), tl.zeros([C, BK], dtype=tl.float32), F32)
            b_kF1 += _rowdot(b_k, b_f)
            b_dk -= b_g4[:, None] * b_f
            b_f = _mma(b_u, b_dsn.to(DT), tl.zeros([C, BK], dtype=tl.float32), F32)
            b_kF2 += _rowdot(b_k, b_f)
            b_dk += b_g3[:, None] * b_f
        b_E = _segment_decay(g, rows, length, i_h, HV, C)
        b_beta = _gate_row(gates, j, i_h, HV, 0, C)
        b_pm = tl.where(causal, scale * b_dM * b_E, 0.)                  # Pm
        b_da = tl.where(o_c[:, None] > o_c[None, :], -b_dA * b_E, 0.)     # DA
        zero = tl.zeros([C, BK], dtype=tl.float32)
        b_t = _mma_tf32(b_pm * b_rk[None, :], b_k.to(tl.float32), zero, F32)        # Pm K^
        b_qM = b_rq * _rowdot(b_q, b_t)
        b_dq += b_rq[:, None] * b_t
        b_t = _mma_tf32(tl.trans(b_pm * b_rq[:, None]), b_q.to(tl.float32), zero, F32)   # Pm^T Q^
        b_colP = b_rk * _rowdot(b_k, b_t)
        b_dk += b_rk[:, None] * b_t
        b_t = _mma_tf32(b_da * b_rk[None, :], b_k.to(tl.float32), zero, F32)        # DA K^
        b_rowA = b_rk * _rowdot(b_k, b_t)
        b_dk += (b_rk * b_beta)[:, None] * b_t
        b_t = _mma_tf32(tl.trans(b_da * (b_beta * b_rk)[:, None]), b_k.to(tl.float32), zero, F32)   # DA^T beta K^
        b_colA = b_rk * _rowdot(b_k, b_t)
        b_dk += b_rk[:, None] * b_t
        b_eg = _gate_row(gates, j, i_h, HV, 1, C)                       # eg rk
        b_tau = b_g3 * b_kF2
        b_dgam = (b_g2 * b_qF + b_qM - b_colP + b_beta * b_rowA - b_colA - b_beta * b_eg * b_kF1 - b_tau)
        b_last = tl.sum(b_tau, 0) + tl.load(eg_last + p_slot) * tl.sum(b_sds, 0)
        b_dgam += tl.where(o_c == length - 1, b_last, 0.)
        b_db = b_dxv - b_eg * b_kF1 + b_rowA
        p_part = (i_k * T + rows) * HV + i_h
        tl.store(dgam_part + p_part, b_dgam, mask=m_c)
        tl.store(dbeta_part + p_part, b_db, mask=m_c)
    tl.store(dq + p_qk + o_qk, b_dq.to(dq.dtype.element_ty), mask=m_qk)
    tl.store(dk + p_qk + o_qk, b_dk.to(dk.dtype.element_ty), mask=m_qk)


@triton.jit
def _l2norm_bwd(x, dxr, r):
    """Gradient of the raw rows x given dxr = r dX^ (the gradient with r held fixed): dxr - r^2 x (x.dxr)."""
    return dxr - (r * r * _rowdot(x, dxr))[:, None] * x.to(tl.float32)


@triton.jit
def chunk_bwd_finalize_kernel(q, k, dq_pre, dk_pre, rn, dgam_part, dbeta_part, dq, dk, dg, dbeta, table,
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
        b_dgam = tl.zeros([C], dtype=tl.float32)
        b_db = tl.zeros([C], dtype=tl.float32)
        for i_k in range(0, NK):
            p_part = (i_k * T + rows) * HV + i_h
            b_dgam += tl.load(dgam_part + p_part, mask=m_c, other=0.)
            b_db += tl.load(dbeta_part + p_part, mask=m_c, other=0.)
        tl.store(dg + rows * HV + i_h, tl.cumsum(b_dgam, 0, reverse=True).to(dg.dtype.element_ty),
                 mask=m_c)
        tl.store(dbeta + rows * HV + i_h, b_db.to(dbeta.dtype.element_ty), mask=m_c)
    if USE_L2:
        o_k = tl.arange(0, BKP)
        m_qk = m_c[:, None] & (o_k < K)[None, :]
        p_qk = rows[:, None] * (H * K) + i_qh * K + o_k[None, :]
        p_rn = (j * HV + i_qh * G) * (2 * C)
        b_dq = _l2norm_bwd(tl.load(q + p_qk, mask=m_qk, other=0.), tl.load(dq_pre + p_qk, mask=m_qk, other=0.),
                           tl.load(rn + p_rn + o_c))
        tl.store(dq + p_qk, b_dq.to(dq.dtype.element_ty), mask=m_qk)
        b_dk = _l2norm_bwd(tl.load(k + p_qk, mask=m_qk, other=0.), tl.load(dk_pre + p_qk, mask=m_qk, other=0.),
                           tl.load(rn + p_rn + C + o_c))
        tl.store(dk + p_qk, b_dk.to(dk.dtype.element_ty), mask=m_qk)


def bwd_configs(K, V, dtype):
    """Block sizes and warps of the backward kernels (one config each, no autotune), from sm_90 AOT
    compiles (registers / spills in bench/NOTES.md, "backward rework"):
    - dstate: the whole K (padded to a power of two) x BV = 64 (wgmma M = 64 with dS^T as the register
      A operand; at 1x32768, HV = 32, V = 128: 64 programs, one wave); 4 warps (8 when K > 128).
    - grads: K-blocks of 16 and V-blocks of 32 at 8 warps, the largest blocks that compile without
      spills (the [C, BK] / [BV, BK] pointer tiles of six streamed operands cost more registers than
      the accumulators); every K-block recomputes U, dO U^T and dX' U^T.
    - finalize: the whole K row, 4 warps (no dots)."""
    np2 = triton.next_power_of_2
    return dict(
        dstate=dict(BK=np2(K), BV=min(64, np2(V)), num_warps=4 if K <= 128 else 8, num_stages=1),
        grads=dict(BK=min(16, np2(K)), BV=min(32, np2(V)), num_warps=8, num_stages=1),
        finalize=dict(BKP=np2(K), num_warps=4, num_stages=1),
    )


def _fwd_buffers_torch(q, k, v, g, beta, table, cu_chunks, h0, scale, use_l2norm):
    """The forward prep (store_m) and state pass (STORE_STATES) buffers in torch, per chunk slot:
    gates [NC, HV, 5, C], eg_last [NC, HV], rn [NC, HV, 2, C] fp32; Ts, M [NC, HV, C, C] input dtype;
    S^T [NC, HV, V, K] fp32 (chunk start), X'^T [NC, HV, V, C] input dtype. Stands in for the forward
    kernels (gdn_packed/triton/chunk_fwd.py) until they produce these layouts."""
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    G, NC, C, dev, dt = HV // H, table.shape[0], CHUNK, q.device, q.dtype
    f = torch.float32
    gates = torch.zeros(NC, HV, 5, C, dtype=f, device=dev)
    eg_last = torch.ones(NC, HV, dtype=f, device=dev)
    rn = torch.zeros(NC, HV, 2, C, dtype=f, device=dev)
    ts = torch.zeros(NC, HV, C, C, dtype=dt, device=dev)
    mm = torch.zeros(NC, HV, C, C, dtype=dt, device=dev)
    st = torch.zeros(NC, HV, V, K, dtype=f, device=dev)
    xp = torch.zeros(NC, HV, V, C, dtype=dt, device=dev)
    tab, cu = table.tolist(), cu_chunks.tolist()
    for n in range(len(cu) - 1):
        for hv in range(HV):
            h = hv // G
            S = torch.zeros(K, V, dtype=f, device=dev) if h0 is None else h0[n, hv].float()
            for j in range(cu[n], cu[n + 1]):
                s0, L = tab[j][2], tab[j][3]
                qq, kk = q[s0:s0 + L, h].float(), k[s0:s0 + L, h].float()
                vv, gg, bb = v[s0:s0 + L, hv].float(), g[s0:s0 + L, hv].float(), beta[s0:s0 + L, hv].float()
                one = torch.ones(L, dtype=f, device=dev)
                rq = torch.rsqrt((qq * qq).sum(1) + 1e-6) if use_l2norm else one
                rk = torch.rsqrt((kk * kk).sum(1) + 1e-6) if use_l2norm else one
                gam = gg.cumsum(0)
                eg, w = gam.exp(), (gam[-1] - gam).exp()
                E = torch.where(torch.ones(L, L, dtype=torch.bool, device=dev).tril(),
                                (gam[:, None] - gam[None, :]), -float("inf")).exp()
                qh, kh = qq * rq[:, None], kk * rk[:, None]
                A = (bb[:, None] * E * (kh @ kh.T)).tril(-1)
                Tm = torch.linalg.inv(torch.eye(L, dtype=f, device=dev) + A)
                Xp = (bb[:, None] * (vv - (eg * rk)[:, None] * (kk @ S))).to(dt)
                U = Tm.to(dt).float() @ Xp.float()
                st[j, hv], xp[j, hv, :, :L] = S.T, Xp.T
                S = gam[-1].exp() * S + kk.T @ ((w * rk)[:, None] * U)
                gates[j, hv, :, :L] = torch.stack([bb, eg * rk, scale * eg * rq, w * rk, bb * eg * rk])
                eg_last[j, hv] = gam[-1].exp()
                rn[j, hv, 0, :L], rn[j, hv, 1, :L] = rq, rk
                ts[j, hv, :L, :L] = (Tm - torch.eye(L, dtype=f, device=dev)).to(dt)
                mm[j, hv, :L, :L] = (scale * E * (qh @ kh.T)).to(dt)
    return gates, eg_last, rn, ts, mm, st, xp


def chunk_gdr_bwd_triton(q, k, v, g, beta, table, cu_chunks, initial_state, scale, C, use_l2norm,
                         do, dht, dq, dk, dv, dg, dbeta, dh0):
    """Backward of backend="triton" on flattened rows: writes every row of dq, dk [T, H, K], dv [T, HV, V],
    dg, dbeta [T, HV] (0 on padding rows) and dh0 [N, HV, K, V] fp32. Grids depend only on T, N and
    the shapes (no host sync).

    Scratch per token x value head (K = V = 128, bf16, G = HV // H = 2), from the forward buffers on:
    S^T 1024 B + X'^T 256 B (state pass), Ts + M 256 B, gates/rn ~28 B (prep); dSn^T 1024 B, dX'^T
    512 B (dstate); dgam/dbeta partials 8 B per K-block (16 B); with l2norm fp32 dq/dk 512 B."""
    if C != CHUNK:
        raise ValueError(f"the Triton kernels are written for chunk size {CHUNK}, got {C}")
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    N, NC = cu_chunks.numel() - 1, table.shape[0]
    dev = q.device
    q, k, v, g, beta, do = (x.contiguous() for x in (q, k, v, g, beta, do))
    outs = (dq, dk, dv, dg, dbeta)
    work = [x if x.is_contiguous() else torch.empty_like(x, memory_format=torch.contiguous_format)
            for x in outs]
    dq_, dk_, dv_, dg_, dbeta_ = work
    cfg = bwd_configs(K, V, q.dtype)
    l2, f32 = bool(use_l2norm), q.dtype == torch.float32
    h0 = None if initial_state is None else initial_state.to(torch.float32).contiguous()
    gates, eg_last, rn, ts, mm, st, xp = _fwd_buffers_torch(q, k, v, g, beta, table, cu_chunks, h0, scale,
                                                            l2)
    dsn = torch.empty(NC, HV, V, K, dtype=torch.float32, device=dev)
    dxp = torch.empty(NC, HV, V, C, dtype=torch.float32, device=dev)
    if N > 0 and HV > 0:
        c = cfg["dstate"]
        dht_ = None if dht is None else dht.to(torch.float32).contiguous()
        chunk_bwd_dstate_kernel[(triton.cdiv(V, c["BV"]), HV, N)](
            q, k, do, gates, eg_last, ts, mm, dh0 if dht_ is None else dht_, dsn, dxp, dv_, dh0, dq_, dk_,
            dg_, dbeta_, table, cu_chunks, T, H, HV, K=K, V=V, C=C, BK=c["BK"], BV=c["BV"],
            HAS_DHT=dht_ is not None, F32=f32, num_warps=c["num_warps"], num_stages=c["num_stages"])
    if NC > 0 and HV > 0:
        c = cfg["grads"]
        NK = triton.cdiv(K, c["BK"])
        part = torch.empty(2, NK, T, HV, dtype=torch.float32, device=dev)
        pre = (torch.empty(2, T, H, K, dtype=torch.float32, device=dev) if l2 else None)
        chunk_bwd_grads_kernel[(NK, H, NC)](
            q, k, v, g, do, gates, eg_last, rn, ts, xp, st, dsn, dxp, pre[0] if l2 else dq_,
            pre[1] if l2 else dk_, part[0], part[1], table, scale, T, H, HV, K=K, V=V, C=C, BK=c["BK"],
            BV=c["BV"], USE_L2=l2, F32=f32, num_warps=c["num_warps"], num_stages=c["num_stages"])
        c = cfg["finalize"]
        chunk_bwd_finalize_kernel[(H, NC)](
            q, k, pre[0] if l2 else dq_, pre[1] if l2 else dk_, rn, part[0], part[1], dq_, dk_, dg_,
            dbeta_, table, T, H, HV, K=K, C=C, BKP=c["BKP"], NK=NK, USE_L2=l2,
            num_warps=c["num_warps"], num_stages=c["num_stages"])
    for x, y in zip(outs, work):
        if x is not y:
            x.copy_(y)
