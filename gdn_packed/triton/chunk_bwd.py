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
    dbeta = dX'.v - eg k^.(dX' S^T) + rowsum(DA (.) K^K^^T)
    dgam  = q^.dQ^ - colsum(Pm (.) Q^K^^T) + beta rowsum(DA (.) K^K^^T) - colsum(diag(beta) DA (.) K^K^^T)
            - beta eg k^.(dX' S^T),  tau_i = w_i k^_i.(U dSn^T)_i
    (the C x C terms as row / column sums of Pm, DA times the Gram matrices Q^K^^T, K^K^^T: exact
    products of the input-dtype q, k, one C x C dot each)
    dg_i = sum_{i' >= i} dgam_i' + sum_{i' < i} tau_i' + egL <S, dSn>   (in-chunk; Pm's diagonal,
            E_ii = 1, cancels between the q^.dQ^ and colsum terms and is left out of both);
    l2norm: dq = rq (dQ^ - q^ (q^.dQ^)) (same for k).
(Checked against autograd of the float64 recurrence to 1e-15 by a torch prototype of these formulas.)

Launches (grids depend only on T, N and the shapes; unused chunk slots exit at once; fastest grid axis
first):
  forward prep and state pass (STORE_STATES: st = S^T at chunk start [NC, HV, V, K], as the forward's
      dots used it, and ut = U^T [NC, HV, V, C], U = X' + Ts X' of the rounded X', both in the input
      dtype); launched by gdn_packed/triton/chunk.py, chunk_gdr_bwd_triton
  chunk_bwd_dstate_kernel  grid (cdiv(V, BV), HV, N S): the reverse sequential pass per sequence (or
      segment of S, chunk.py's chunk_bwd_dstate: dS is affine in the dS entering from the right,
      dS^T_prev = dS^T P~ + ..., so with S > 1 a pass A with PROPAGATE over the last S - 1 segments
      carries K identity rows to each segment's transition and chunk_combine_kernel with REVERSE
      gives the dS entering every segment; P~ of a segment is the forward's transition transposed,
      so given the forward's, pass A forms at most the last segment's: LAST_TRANSITION; as the
      forward's pass A, it takes its chunks' rows from two table rows, common.run_rows / chunk_at, and
      the chunk decay as a vector beside the tiles), dS^T [BV,
      K] fp32 in registers (transposed: it is the register A operand of dS^T K^T). Writes dSn^T [NC,
      HV, V, K] and dX'^T [NC, HV, V, C] per chunk
      slot and dv = beta dX', all in the input dtype, dh0 (fp32, the first segment); and exact zeros
      on the padding rows of dv, dg, dbeta, dq, dk.
  chunk_bwd_p_kernel       grid (H, NC): one program per qk head and chunk slot, looping the G value
      heads of the qk head: dM = dO U^T over V-blocks, Pm and its C x C dgam share, and P = sum_g (Pm_g +
      its diagonal) [NC, H, C, C] fp32 for the dq and dk kernels (dg partial slot 0).
  chunk_bwd_dq_kernel      grid (cdiv(K, BK), H, NC): one program per K-block, qk head and chunk slot,
      looping the group's value heads and, per head, the V-blocks: the state product (scale eg rq) dO S^T
      straight into the dq accumulator, and per head its dgam share q.(that product) as the growth of
      q.dq over the head's loop; then ONE product P K^ for the group. Writes dq (input dtype; fp32
      pre-l2norm values with l2norm) and its dg shares (slots 1 + i_k; dq has no dbeta share).
  chunk_bwd_a_kernel       grid (H, NC): the C x C part of dk as the P kernel does dq's: dA' = dX' U^T and
      dX'.v over V-blocks, DA and its dgam / dbeta shares, B = sum_g (diag(beta) DA + DA^T diag(beta))
      [NC, H, C, C] fp32 for the dk kernel (slot 1 + nq; nq: the dq kernel's K-blocks).
  chunk_bwd_dk_kernel      grid (cdiv(K, BK), H, NC): per V-block the state products -(beta eg rk) dX' S^T
      and (w rk) U dSn^T straight into the dk accumulator (their row factors in the a operand), the row
      dots k.(dX' S^T), k.(U dSn^T) as rowdot(dX', k S), rowdot(U, k dSn), and <S, dSn>; then B K^ and
      P^T Q^ once for the group. Writes dk and its dg / dbeta shares (slots 2 + nq + i_k). dX' and U
      are loaded a V-block ahead, across the group's heads (_next_block): scaled in registers, they
      are not the shared-memory dot operands triton's pipeliner puts in flight.
      The C x C parts in kernels of their own leave the dq / dk kernels' loops holding their [C, BK]
      accumulator alone: 4 warps, 2 CTAs per SM (bf16 / fp16; 8 warps with fp32 inputs).
      No kernel writes a per-value-head share of dq or dk: the group is summed in registers (P, B in
      the P / A kernels' registers).
  chunk_bwd_finalize_kernel grid (H, NC): dg, dbeta = the sums of their partials, and
      the l2norm backward of dq, dk.
Deterministic: no atomics; every scratch element has one writer; every sum runs in a fixed order.

Numerics: every tensor-core dot takes its operands in the input dtype with fp32 accumulation (fp32
inputs: every fp32-operand dot at configs.dot_precision, tf32). Rounded to the input dtype only as dot
operands: dS^T, dU^T, dX'^T scaled by its gate (dstate); U, dX', dSn^T (dq / dk: U, dX' and dSn^T
are stored in the input dtype, as those kernels' dots take them; U formed from the rounded X', which
keeps dg's cancelling terms consistent; dSn^T also enters the row dot <S, dSn> of dg, whose S^T is in
the input dtype already); S^T is stored by the forward's state pass in the
input dtype, exactly as its dots used it.
fp32 values that must enter a bf16/fp16 dot at better than input precision enter it as two operands,
the rounded value and its rounding error (relative error ~2^-16): the gated dO^T of the dS update
(rounded once, it doubled dh0's error on short sequences: bench/NOTES.md), the gated dO of dq's state
product, the gated dX' and U of dk's, and P, B in their products with K^, Q^ (_dot2: two chained dots
into the accumulator; at 4 warps, one warpgroup, the chain costs no layout conversion). dgam takes the row
sums and the column sums of the same C x C products (Pm (.) Q^K^^T, DA (.) K^K^^T), whose difference
the reverse cumsum sums: they are formed from one fp32 Gram matrix per kernel and fp32 Pm, DA, so the
difference cancels to fp32 rounding (bf16 operands there put dg above FLA's error: bench/NOTES.md). Kept fp32: dS in
registers, the combine of the segment boundaries, every accumulator, gate, exponential and row dot.
Names: `b_` block values, `p_`/`o_` pointers/offsets, `m_` masks, `i_` program and loop indices, as in FLA.
"""
import torch
import triton
import triton.language as tl

from gdn_packed.triton.common import (GATE_BEGK, GATE_BETA, GATE_EGK, GATE_EGQ, GATE_WK,
                                      block_offsets, chunk_at, chunk_rows, gate_row, group_rows, head_of,
                                      padding_after, padding_before_first, run_rows, segment_chunks,
                                      segment_decay, zero_rows)


@triton.jit
def _cc(p, j, hv, HV, C: tl.constexpr):
    """The [C, C] matrix of chunk slot j, value head hv from a [NC, HV, C, C] buffer (fully written)."""
    o_c = tl.arange(0, C)
    return tl.load(p + (j * HV + hv) * (C * C) + o_c[:, None] * C + o_c[None, :])


@triton.jit
def _zero_padding(dq, dk, dv, dg, dbeta, a, b, hv, i_v, H, HV, K: tl.constexpr, V: tl.constexpr,
                  BKP: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, S_O, S_DQK, S_G):
    """Zeros on padding rows [a, b): dv columns of V-block i_v of value head hv; dg, dbeta of hv (V-block
    0); dq, dk of qk head hv // G (V-block 0 of the group's first value head). Rows S_O (dv), S_DQK (dq,
    dk), S_G (dg, dbeta) apart."""
    G = HV // H
    zero_rows(dv, a, b, hv * V + i_v * BV, tl.minimum(V - i_v * BV, BV), S_O, BV, C)
    if i_v == 0:
        zero_rows(dg, a, b, hv, 1, S_G, 1, C)
        zero_rows(dbeta, a, b, hv, 1, S_G, 1, C)
        if hv % G == 0:
            zero_rows(dq, a, b, (hv // G) * K, K, S_DQK, BKP, C)
            zero_rows(dk, a, b, (hv // G) * K, K, S_DQK, BKP, C)


@triton.jit(do_not_specialize=["T_rows", "segments"])
def chunk_bwd_dstate_kernel(q, k, do, gates, eg_last, ts, mm, dht, dsn, dxp, dv, dh0, dq, dk, dg, dbeta,
                            ends, table, cu_chunks, T_rows, segments, H, HV, S_QK, S_O, S_DQK, S_G,
                            K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
                            BV: tl.constexpr, HAS_DHT: tl.constexpr, PROPAGATE: tl.constexpr,
                            LAST_TRANSITION: tl.constexpr):
    i_v, i_h, i_p = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    # sequence i_n, segment i_s of `segments` (pass A: of the last segments - 1)
    if PROPAGATE:
        i_n, i_s = i_p // (segments - 1), i_p % (segments - 1) + 1
        if LAST_TRANSITION:     # the transition rows of the last segment only (the others: the forward's)
            if (i_v * BV >= V) & (i_s < segments - 1):
                return
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
    if PROPAGATE:       # the rows of the segment's chunks from two table rows read here (run_rows)
        first, end = run_rows(table, j0, j1, T_rows)
    for i_t in range(0, j1 - j0):
        j = (j1 - 1 - i_t).to(tl.int64)
        if PROPAGATE:   # the tile addresses from i_t alone: the pipeliner loads them two chunks ahead
            start, length = chunk_at(first, end, j1 - j0 - 1 - i_t, T_rows, C)
        else:           # (the same here costs registers the pass lacks: spills)
            start, length = chunk_rows(table, j, C)
        m_c = o_c < length
        p_slot = j * HV + i_h
        if not PROPAGATE:
            tl.store(dsn + p_slot * (V * K) + p_st, b_ds.to(dsn.dtype.element_ty), mask=m_s)
        # scalar int64 bases and int32 tile offsets (no per-element 64-bit address arithmetic) up to
        # K = 128; for wider K the int64 rows (there the [C, BK] offset tile costs more registers)
        m_qk = m_c[:, None] & m_k[None, :]
        if BK <= 128:
            o_qk = start * S_QK + i_qh * K + (o_c[:, None] * S_QK + o_k[None, :])
            p_vt = start * S_O + i_h * V + (o_c[None, :] * S_O + o_v[:, None])      # [BV, C] transposed rows
        else:
            o_qk = (start + o_c)[:, None] * S_QK + i_qh * K + o_k[None, :]
            p_vt = (start + o_c)[None, :] * S_O + i_h * V + o_v[:, None]
        b_k = tl.load(k + o_qk, mask=m_qk, other=0.)                  # [C, BK]
        b_q = tl.load(q + o_qk, mask=m_qk, other=0.)
        m_vt = m_v[:, None] & m_c[None, :]
        b_dot = tl.load(do + p_vt, mask=m_vt, other=0.)               # dO^T
        b_beta = gate_row(gates, p_slot, GATE_BETA, C)
        b_wk = gate_row(gates, p_slot, GATE_WK, C)
        if PROPAGATE:   # the chunk decay broadcast over the K columns: a vector load, copied with the
            # tiles (a scalar load is waited for by the fence before the dS update's wgmma; in the pass,
            # which waits there for its stores anyway, the scalar is loaded late: the fence before the
            # first wgmma would wait for it)
            b_dec = tl.load(eg_last + p_slot + 0 * o_k)[None, :]
        # dU^T = dO^T M + (dS^T K^T) (w rk);  dX'^T = dU^T + dU^T Ts
        b_du = tl.dot(b_ds.to(DT), tl.trans(b_k), tl.zeros([BV, C], dtype=tl.float32))
        b_du = tl.dot(b_dot, _cc(mm, j, i_h, HV, C), b_du * b_wk[None, :])
        b_dx = tl.dot(b_du.to(DT), _cc(ts, j, i_h, HV, C), b_du)
        if not PROPAGATE:
            tl.store(dxp + p_slot * (V * C) + o_v[:, None] * C + o_c[None, :], b_dx.to(dxp.dtype.element_ty),
                     mask=m_v[:, None])
            tl.store(dv + p_vt, (b_dx * b_beta[None, :]).to(dv.dtype.element_ty), mask=m_vt)
        # dS^T <- egL dS^T + (dO^T (scale eg rq)) Q - (dX'^T (beta eg rk)) K
        b_ag = b_dot.to(tl.float32) * gate_row(gates, p_slot, GATE_EGQ, C)[None, :]
        b_a = b_ag.to(DT)
        if PROPAGATE:
            b_ds = b_ds * b_dec
        else:
            b_ds = b_ds * tl.load(eg_last + p_slot)
        b_ds = tl.dot(b_a, b_q, b_ds)
        if DT != tl.float32:    # the rounding of the gated dO^T, taken back by a second product
            b_ds = tl.dot((b_ag - b_a.to(tl.float32)).to(DT), b_q, b_ds)
        b_b = (b_dx * gate_row(gates, p_slot, GATE_BEGK, C)[None, :]).to(DT)
        b_ds = tl.dot(-b_b, b_k, b_ds)
    if PROPAGATE:       # the segment's rows at its start: dS^T from a zero dS at its end, then the transition
        p_e = (i_p.to(tl.int64) * HV + i_h) * (R * K) + o_v[:, None] * K + o_k[None, :]
        tl.store(ends + p_e, b_ds, mask=(o_v < R)[:, None] & m_k[None, :])
    elif i_s == 0:
        tl.store(dh0 + (i_n.to(tl.int64) * HV + i_h) * (K * V) + o_kv, b_ds, mask=m_s)
        a, b = padding_after(table, cu_chunks, i_n, N, T_rows)
        _zero_padding(dq, dk, dv, dg, dbeta, a, b, i_h, i_v, H, HV, K, V, triton.next_power_of_2(K), BV, C,
                      S_O, S_DQK, S_G)
        if i_n == 0:
            first = padding_before_first(table, cu_chunks, N, T_rows)
            _zero_padding(dq, dk, dv, dg, dbeta, first * 0, first, i_h, i_v, H, HV, K, V,
                          triton.next_power_of_2(K), BV, C, S_O, S_DQK, S_G)


@triton.jit
def _rowdot(a, b):
    return tl.sum(a.to(tl.float32) * b.to(tl.float32), 1)


@triton.jit
def _xt(p, p_slot, i_v, V: tl.constexpr, C: tl.constexpr, BV: tl.constexpr):
    """V-block i_v of chunk slot p_slot of a [NC, HV, V, C] scratch (U^T or dX'^T, input dtype) as its
    transpose [C, BV] (U or dX'), 0 past V."""
    o_v = i_v + tl.arange(0, BV)
    return tl.load(p + p_slot * (V * C) + o_v[None, :] * C + tl.arange(0, C)[:, None],
                   mask=(o_v < V)[None, :], other=0.)


@triton.jit
def _next_block(p_slot, i_v, i_g, G, V: tl.constexpr, BV: tl.constexpr):
    """The step after (value head p_slot, V-block i_v) of a group's walk over its value heads' V-blocks,
    (slot, V-block): the next value head's first block after a head's last, this block again after the
    group's last (an in-bounds load, not used). For a prefetch of the a operands one step ahead, which
    triton's pipeliner leaves in the step that uses them (a register load, not a dot's shared-memory
    operand)."""
    wrap = i_v + BV >= V
    on = wrap & (i_g + 1 < G)               # on to the next value head's first block
    return tl.where(on, p_slot + 1, p_slot), tl.where(on, 0, tl.where(wrap, i_v, i_v + BV))


@triton.jit
def _pm(b_dM, b_E, scale, C: tl.constexpr):
    """From dM = dO U^T (fp32 [C, C]) of a value head and its decay E: Pm = scale dM (.) E, its strict
    lower part and its diagonal apart (E_ii = 1: no gate gradient; left in the products whose row and
    column sums make dgam, it would enter as row sum - column sum of the same value, noise the reverse
    cumsum accumulates)."""
    o_c = tl.arange(0, C)
    b_pm = scale * b_dM * b_E
    return tl.where(o_c[:, None] > o_c[None, :], b_pm, 0.), tl.sum(tl.where(o_c[:, None] == o_c[None, :], b_pm, 0.), 1)


@triton.jit
def _vk_block(p, base, i_v, col0, V: tl.constexpr, K: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr):
    """Rows i_v.. (BV) and columns col0.. (BK) of the [V, K] block at base of a scratch (input dtype),
    0 outside."""
    o_v = i_v + tl.arange(0, BV)
    o_b = col0 + tl.arange(0, BK)
    if BK == K:     # whole rows: the column mask folds
        return tl.load(p + base + o_v[:, None] * K + o_b[None, :], mask=(o_v < V)[:, None], other=0.)
    return tl.load(p + base + o_v[:, None] * K + o_b[None, :], mask=(o_v < V)[:, None] & (o_b < K)[None, :],
                   other=0.)


@triton.jit
def _store_rows(p, x, length, col0, stride, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr):
    """p[r * stride + c] = x[r, c] for rows r < length and columns col0 + c < K of a [C, BK] tile, its
    offsets and mask formed here from block_offsets (not the loads' offset tiles kept live to the end)."""
    idx = block_offsets(C, BK)
    r, c = idx // BK, idx % BK
    tl.store(p + r * stride + c, x.to(p.dtype.element_ty), mask=(r < length) & (col0 + c < K))


@triton.jit
def _dot2(a, b, acc, HL: tl.constexpr, PREC: tl.constexpr):
    """acc + a b for an fp32 a and a b in the input dtype: with HL (bf16 / fp16) two chained dots, a's
    rounded value, then its rounding error (relative error ~2^-16, better than one tf32 pass, and no fp32
    copy of b); without HL (fp32 b) one dot at PREC. Used at 4 warps, one warpgroup: at 8 the chained
    accumulator took a layout replicated over the warpgroups (twice the registers; the 8-warp kernels
    had one dot over the two halves side by side, b loaded with its rows twice over, bench/NOTES.md)."""
    if HL:
        h = a.to(b.dtype)
        return tl.dot((a - h.to(tl.float32)).to(b.dtype), b, tl.dot(h, b, acc))
    else:
        return tl.dot(a, b, acc, input_precision=PREC)


@triton.jit
def _kblock(table, i_k, i_qh, j, S_QK: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr):
    """Chunk slot j's rows and the [C, BK] tile of K-block i_k of qk head i_qh in a [T, H, K] tensor whose
    rows are S_QK apart: start, length, i_k (0 at compile time when one block covers K, so its column
    mask folds), the scalar int64 base p and int32 tile offsets o (no per-element 64-bit address
    arithmetic), the mask m."""
    start, length = chunk_rows(table, j, C)
    if BK == K:
        i_k = 0
    o_c = tl.arange(0, C)
    o_b = tl.arange(0, BK)
    m = (o_c < length)[:, None] & (i_k * BK + o_b < K)[None, :]
    return start, length, i_k, start * S_QK + i_qh * K + i_k * BK, o_c[:, None] * S_QK + o_b[None, :], m


@triton.jit
def _qk_tile(x, p_qk, length, i_k, S_QK: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr):
    """The [C, BK] tile of K-block i_k at p_qk of a [T, H, K] tensor (rows S_QK apart, rows < length, 0
    outside), its offsets formed here (not an offset tile kept live from the kernel's start)."""
    o_c = tl.arange(0, C)
    o_b = tl.arange(0, BK)
    m = (o_c < length)[:, None] & (i_k * BK + o_b < K)[None, :]
    return tl.load(x + p_qk + o_c[:, None] * S_QK + o_b[None, :], mask=m, other=0.)


@triton.jit
def _gram(x, y, start, length, i_qh, S_QK: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
          PREC: tl.constexpr, SAME: tl.constexpr):
    """x_i.y_j [C, C] fp32 of the raw rows of a chunk (rows from start, < length; qk head i_qh of [T, H, K]
    tensors, rows S_QK apart) over K-blocks of BK; SAME: y is x (one load a block)."""
    o_c = tl.arange(0, C)
    b_g = tl.zeros([C, C], dtype=tl.float32)
    for i_k in range(0, K, BK):
        o_b = i_k + tl.arange(0, BK)
        o = start * S_QK + i_qh * K + (o_c[:, None] * S_QK + o_b[None, :])
        m = (o_c < length)[:, None] & (o_b < K)[None, :]
        b_x = tl.load(x + o, mask=m, other=0.)
        b_y = b_x if SAME else tl.load(y + o, mask=m, other=0.)
        b_g = tl.dot(b_x, tl.trans(b_y), b_g, input_precision=PREC)
    return b_g


@triton.jit
def chunk_bwd_p_kernel(q, k, g, do, rn, ut, pm, dg_part, table, scale, T,
                       H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                       BK: tl.constexpr, BV: tl.constexpr, S_QK: tl.constexpr, S_O: tl.constexpr,
                       S_G: tl.constexpr, PREC: tl.constexpr):
    """The C x C part of dq for qk head i_qh, chunk slot j, the group's value heads g:
        P = sum_g (Pm_g + diag(Pm_g)),  Pm_g = scale (dO_g U_g^T) (.) E_g strictly lower
    (dO U^T over V-blocks of BV), written to pm for the dq kernel's P K^ and the dk kernel's P^T Q^; and
    per value head the dgam share rowsum(Pm (.) Q^K^^T) - colsum(Pm (.) Q^K^^T) (Q^K^^T over K-blocks
    of BK, from the raw q, k and the row factors) as its reverse cumsum to dg partial slot 0. No [C, K]
    accumulator: the dq kernel keeps only its own."""
    i_qh, j = tl.program_id(0), tl.program_id(1).to(tl.int64)
    start, length = chunk_rows(table, j, C)
    if length == 0:
        return
    G: tl.constexpr = HV // H
    o_c = tl.arange(0, C)
    rows, m_c = start + o_c, o_c < length
    p_rn = (j * HV + i_qh * G) * (2 * C)                                # row factors of the qk head
    b_gns = group_rows(g, rows, length, i_qh * G, G, S_G, C, 1)          # the heads' g of the next rows
    b_qk = _gram(q, k, start, length, i_qh, S_QK, K, C, BK, PREC, False)
    b_qk *= tl.load(rn + p_rn + o_c)[:, None] * tl.load(rn + p_rn + C + o_c)[None, :]    # q^_i.k^_j
    b_P = tl.zeros([C, C], dtype=tl.float32)
    o_cv = o_c[:, None] * S_O + tl.arange(0, BV)[None, :]               # [C, BV] of dO's rows
    for i_g in range(0, G):
        i_h = i_qh * G + i_g
        p_slot = j * HV + i_h
        b_dM = tl.zeros([C, C], dtype=tl.float32)                     # dO U^T
        p_cv = start * S_O + i_h * V
        for i_v in range(0, V, BV):
            m_v = i_v + tl.arange(0, BV) < V
            b_do = tl.load(do + (p_cv + i_v) + o_cv, mask=m_c[:, None] & m_v[None, :], other=0.)
            b_dM = tl.dot(b_do, tl.trans(_xt(ut, p_slot, i_v, V, C, BV)), b_dM)
        b_pmg, b_pdg = _pm(b_dM, segment_decay(head_of(b_gns, i_g), C), scale, C)
        b_pq = b_pmg * b_qk
        p_part = i_h.to(tl.int64) * T + rows                           # [1, HV, T]: 64 rows contiguous
        tl.store(dg_part + p_part, tl.cumsum(tl.sum(b_pq, 1) - tl.sum(b_pq, 0), 0, reverse=True), mask=m_c)
        b_P += b_pmg + tl.where(o_c[:, None] == o_c[None, :], b_pdg[:, None], 0.)
    tl.store(pm + (j * H + i_qh) * (C * C) + block_offsets(C, C), b_P)


@triton.jit
def chunk_bwd_dq_kernel(q, k, do, gates, rn, st, dq, pm, dg_part, table, T,
                        H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                        C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, S_QK: tl.constexpr,
                        S_O: tl.constexpr, S_DQK: tl.constexpr, S_G: tl.constexpr, PREC: tl.constexpr,
                        HL: tl.constexpr):
    """rq dQ^ of K-block i_k, qk head i_qh, chunk slot j, the group's value heads g summed:
        rq dQ^ = rq (P K^) + sum_g (scale eg rq)_g dO_g S_g^T
    with P from chunk_bwd_p_kernel (pm); the state product accumulated over the V-blocks (the gated dO
    through _dot2: rounded value, then rounding error with HL, bf16 / fp16 inputs). Writes dq (fp32
    before the l2norm backward with l2norm) and per value head its dgam share (scale eg rq)
    q.(dO S^T) (this K-block's columns) as its reverse cumsum to dg partial slot 1 + i_k: the growth
    of q.dq over the head's V-block loop, so that the loop holds the accumulator alone (4 warps, 2 CTAs
    per SM; 8 warps with fp32 inputs)."""
    i_qh, j = tl.program_id(1), tl.program_id(2).to(tl.int64)
    start, length, i_k, p_qk, o_qk, m_qk = _kblock(table, tl.program_id(0), i_qh, j, S_QK, K, C, BK)
    if length == 0:
        return
    G = HV // H
    o_c = tl.arange(0, C)
    rows, m_c = start + o_c, o_c < length
    b_dq = tl.zeros([C, BK], dtype=tl.float32)
    b_qdq = tl.zeros([C], dtype=tl.float32)                           # q.dq before this head
    o_cv = o_c[:, None] * S_O + tl.arange(0, BV)[None, :]               # [C, BV] of dO's rows
    for i_g in range(0, G):
        i_h = i_qh * G + i_g
        p_slot = j * HV + i_h
        b_egq = gate_row(gates, p_slot, GATE_EGQ, C)                    # scale eg rq
        p_cv = start * S_O + i_h * V
        for i_v in range(0, V, BV):
            m_v = i_v + tl.arange(0, BV) < V
            b_do = tl.load(do + (p_cv + i_v) + o_cv, mask=m_c[:, None] & m_v[None, :], other=0.)
            b_s = _vk_block(st, p_slot * (V * K), i_v, i_k * BK, V, K, BV, BK)      # S^T
            b_dq = _dot2(b_do.to(tl.float32) * b_egq[:, None], b_s, b_dq, HL, PREC)
        b_dg = _rowdot(_qk_tile(q, p_qk, length, i_k, S_QK, K, C, BK), b_dq)   # raw q
        p_part = ((1 + i_k) * HV + i_h).to(tl.int64) * T + rows
        tl.store(dg_part + p_part, tl.cumsum(b_dg - b_qdq, 0, reverse=True), mask=m_c)
        b_qdq = b_dg
    p_P = pm + (j * H + i_qh) * (C * C) + block_offsets(C, C)
    b_rk = tl.load(rn + (j * HV + i_qh * G) * (2 * C) + C + o_c)
    b_rq = tl.load(rn + (j * HV + i_qh * G) * (2 * C) + o_c)
    b_dq = _dot2(tl.load(p_P) * b_rq[:, None] * b_rk[None, :], _qk_tile(k, p_qk, length, i_k, S_QK, K, C, BK),
                 b_dq, HL, PREC)                                        # rq (P K^), raw k
    _store_rows(dq + start * S_DQK + i_qh * K + i_k * BK, b_dq, length, i_k * BK, S_DQK, K, C, BK)


@triton.jit
def chunk_bwd_a_kernel(k, v, g, gates, rn, ut, dxp, bm, dg_part, dbeta_part, table, T, slot,
                       H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                       BK: tl.constexpr, BV: tl.constexpr, S_QK: tl.constexpr, S_V: tl.constexpr,
                       S_G: tl.constexpr, PREC: tl.constexpr):
    """The C x C part of dk for qk head i_qh, chunk slot j, the group's value heads g:
        B = sum_g (diag(beta) DA + DA^T diag(beta))_g,  DA = -(dX' U^T) (.) E strictly lower
    (dX' U^T over V-blocks of BV), written to bm for the dk kernel's B K^; and per value head, to partial
    slot `slot`: dgam beta rowsum(DA (.) K^K^^T) - colsum(diag(beta) DA (.) K^K^^T) (reverse cumsum),
    dbeta rowsum(DA (.) K^K^^T) + dX'.v (K^K^^T over K-blocks of BK from the raw k and its row
    factors)."""
    i_qh, j = tl.program_id(0), tl.program_id(1).to(tl.int64)
    start, length = chunk_rows(table, j, C)
    if length == 0:
        return
    G: tl.constexpr = HV // H
    o_c = tl.arange(0, C)
    rows, m_c = start + o_c, o_c < length
    b_gns = group_rows(g, rows, length, i_qh * G, G, S_G, C, 1)          # the heads' g of the next rows
    b_kk = _gram(k, k, start, length, i_qh, S_QK, K, C, BK, PREC, True)
    b_rk = tl.load(rn + (j * HV + i_qh * G) * (2 * C) + C + o_c)
    b_kk *= b_rk[:, None] * b_rk[None, :]                               # k^_i.k^_j
    b_B = tl.zeros([C, C], dtype=tl.float32)
    o_cv = o_c[:, None] * S_V + tl.arange(0, BV)[None, :]               # [C, BV] of v's rows
    for i_g in range(0, G):
        i_h = i_qh * G + i_g
        p_slot = j * HV + i_h
        b_dA = tl.zeros([C, C], dtype=tl.float32)                     # dX' U^T (= -dA)
        b_dxv = tl.zeros([C], dtype=tl.float32)                       # dX' . v
        p_cv = start * S_V + i_h * V
        for i_v in range(0, V, BV):
            m_v = i_v + tl.arange(0, BV) < V
            b_dx = _xt(dxp, p_slot, i_v, V, C, BV)                          # dX'
            b_v = tl.load(v + (p_cv + i_v) + o_cv, mask=m_c[:, None] & m_v[None, :], other=0.)
            b_dxv += _rowdot(b_dx, b_v)
            b_dA = tl.dot(b_dx, tl.trans(_xt(ut, p_slot, i_v, V, C, BV)), b_dA)
        b_E = segment_decay(head_of(b_gns, i_g), C)
        b_beta = gate_row(gates, p_slot, GATE_BETA, C)
        b_da = tl.where(o_c[:, None] > o_c[None, :], -b_dA * b_E, 0.)  # DA
        b_rowA = tl.sum(b_da * b_kk, 1)                                 # k^.(DA K^)
        b_dab = b_da * b_beta[:, None]                                  # diag(beta) DA
        b_dg = tl.cumsum(b_beta * b_rowA - tl.sum(b_dab * b_kk, 0), 0, reverse=True)
        p_part = (slot * HV + i_h).to(tl.int64) * T + rows
        tl.store(dg_part + p_part, b_dg, mask=m_c)
        tl.store(dbeta_part + p_part, b_rowA + b_dxv, mask=m_c)
        b_B += b_dab + tl.trans(b_dab)
    tl.store(bm + (j * H + i_qh) * (C * C) + block_offsets(C, C), b_B)


@triton.jit
def chunk_bwd_dk_kernel(q, k, gates, rn, eg_last, ut, st, dsn, dxp, pm, bm, dk, dg_part, dbeta_part, table, T, slot0,
                        H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                        C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, S_QK: tl.constexpr,
                        S_DQK: tl.constexpr, PREC: tl.constexpr, HL: tl.constexpr):
    """rk dK^ of K-block i_k, qk head i_qh, chunk slot j, the group's value heads g summed:
        rk dK^ = rk (P^T Q^ + B K^) + sum_g (-(beta eg rk) dX' S^T + (w rk) U dSn^T)_g
    with P, B from the P and A kernels (pm, bm; through _dot2, rq / rk in the a operand); the state
    products accumulated over the V-blocks straight into dk (4 warps, 2 CTAs per SM; HL: bf16 / fp16).
    Writes dk and per value head this K-block's shares to partial slot slot0 + i_k: dgam -(beta eg rk)
    k.(dX' S^T) (reverse cumsum) + tau's exclusive cumsum + egL <S, dSn> (this K-block's columns),
    tau = (w rk) k.(U dSn^T); dbeta -(eg rk) k.(dX' S^T)."""
    i_qh, j = tl.program_id(1), tl.program_id(2).to(tl.int64)
    start, length, i_k, p_qk, o_qk, m_qk = _kblock(table, tl.program_id(0), i_qh, j, S_QK, K, C, BK)
    if length == 0:
        return
    G = HV // H
    o_c = tl.arange(0, C)
    rows, m_c = start + o_c, o_c < length
    b_dk = tl.zeros([C, BK], dtype=tl.float32)
    b_k = tl.load(k + p_qk + o_qk, mask=m_qk, other=0.)               # raw k [C, BK]
    o_vv = tl.arange(0, BV)
    # dX' and U, scaled by their row factors in registers, are loaded one step ahead (_next_block)
    # where one K-block covers K (with two, the block's column masks left no registers for them)
    AHEAD: tl.constexpr = BK >= K
    b_dx_n = _xt(dxp, j * HV + i_qh * G, 0, V, C, BV)
    b_u_n = _xt(ut, j * HV + i_qh * G, 0, V, C, BV)
    for i_g in range(0, G):
        i_h = i_qh * G + i_g
        p_slot = j * HV + i_h
        p_vk = p_slot * (V * K)
        # the state products straight into dk, their row factors in the a operand (_dot2: rounded
        # value, then rounding error with HL), and their row dots with k per V-block as rowdot(dX',
        # k S) and rowdot(U, k dSn): [C, BV] products, so that the loop holds dk alone
        b_nbegk = -gate_row(gates, p_slot, GATE_BEGK, C)                # -(beta eg rk)
        b_wk = gate_row(gates, p_slot, GATE_WK, C)                      # w rk
        b_kF1 = tl.zeros([C], dtype=tl.float32)                       # k . (dX' S^T)
        b_kF2 = tl.zeros([C], dtype=tl.float32)                       # k . (U dSn^T)
        b_sds = 0.                                                    # <S, dSn> over this K-block
        for i_v in range(0, V, BV):
            if AHEAD:
                b_dx, b_u = b_dx_n, b_u_n                                   # dX', U
                n_slot, n_v = _next_block(p_slot, i_v, i_g, G, V, BV)
                b_dx_n = _xt(dxp, n_slot, n_v, V, C, BV)
                b_u_n = _xt(ut, n_slot, n_v, V, C, BV)
            else:
                b_dx = _xt(dxp, p_slot, i_v, V, C, BV)
                b_u = _xt(ut, p_slot, i_v, V, C, BV)
            b_s = _vk_block(st, p_vk, i_v, i_k * BK, V, K, BV, BK)          # S^T
            b_dsn = _vk_block(dsn, p_vk, i_v, i_k * BK, V, K, BV, BK)       # dSn^T
            b_dk = _dot2(b_dx.to(tl.float32) * b_nbegk[:, None], b_s, b_dk, HL, PREC)
            b_dk = _dot2(b_u.to(tl.float32) * b_wk[:, None], b_dsn, b_dk, HL, PREC)
            b_kF1 += _rowdot(b_dx, tl.dot(b_k, tl.trans(b_s), input_precision=PREC))
            b_kF2 += _rowdot(b_u, tl.dot(b_k, tl.trans(b_dsn), input_precision=PREC))
            if HL:      # <S, dSn> of the block as the trace of S^T dSn (exact products of the input-dtype
                # tiles on the tensor cores, operands from shared memory: the tiles' elements in
                # registers spilled dk's loop at 4 warps)
                b_sds += tl.sum(tl.where(o_vv[:, None] == o_vv[None, :], tl.dot(b_s, tl.trans(b_dsn)), 0.))
            else:       # fp32: the row dot (a tf32 dot would round S and dSn)
                b_sds += tl.sum(_rowdot(b_s, b_dsn), 0)
        b_dgam = b_nbegk * b_kF1
        b_db = -gate_row(gates, p_slot, GATE_EGK, C) * b_kF1
        b_tau = b_wk * b_kF2
        # tau's share sum_{i' < i} tau_i' as a forward cumsum (not sum(tau) - sum_{i' >= i} tau_i',
        # which cancels when w puts all of tau on the last rows: fast decay)
        p_part = ((slot0 + i_k) * HV + i_h).to(tl.int64) * T + rows
        tl.store(dg_part + p_part, tl.cumsum(b_dgam, 0, reverse=True) + (tl.cumsum(b_tau, 0) - b_tau)
                 + tl.load(eg_last + p_slot) * b_sds, mask=m_c)
        tl.store(dbeta_part + p_part, b_db, mask=m_c)
    p_rn = (j * HV + i_qh * G) * (2 * C)
    b_rq = tl.load(rn + p_rn + o_c)
    b_rk = tl.load(rn + p_rn + C + o_c)
    o_P = (j * H + i_qh) * (C * C) + block_offsets(C, C)
    b_dk = _dot2(tl.load(bm + o_P) * b_rk[:, None] * b_rk[None, :], _qk_tile(k, p_qk, length, i_k, S_QK, K, C, BK),
                 b_dk, HL, PREC)                                        # rk (B K^)
    b_dk = _dot2(tl.trans(tl.load(pm + o_P)) * b_rk[:, None] * b_rq[None, :],
                 _qk_tile(q, p_qk, length, i_k, S_QK, K, C, BK), b_dk, HL, PREC)     # rk (P^T Q^)
    _store_rows(dk + start * S_DQK + i_qh * K + i_k * BK, b_dk, length, i_k * BK, S_DQK, K, C, BK)


@triton.jit
def _l2norm_bwd(x, dx_pre, dx, r, rows, m_c, col0, S_X, S_PRE, S_DX, K: tl.constexpr, C: tl.constexpr,
                BK: tl.constexpr):
    """dx = dxr - r^2 x (x.dxr) for the raw rows x (columns col0 + [0, K)) given dxr = r dX^ (dx_pre: the
    gradient with r held fixed), over K-blocks of BK: the row dot first, then the rows (two reads of x
    and dxr; no [C, K] fp32 tile live for K up to 256). Rows S_X, S_PRE, S_DX apart."""
    o_b = tl.arange(0, BK)
    b_dot = tl.zeros([C], dtype=tl.float32)
    for kb in range(0, K, BK):
        o = col0 + kb + o_b[None, :]
        m = m_c[:, None] & (kb + o_b < K)[None, :]
        b_dot += _rowdot(tl.load(x + rows[:, None] * S_X + o, mask=m, other=0.),
                         tl.load(dx_pre + rows[:, None] * S_PRE + o, mask=m, other=0.))
    for kb in range(0, K, BK):
        o = col0 + kb + o_b[None, :]
        m = m_c[:, None] & (kb + o_b < K)[None, :]
        b_x = tl.load(x + rows[:, None] * S_X + o, mask=m, other=0.).to(tl.float32)
        b_d = tl.load(dx_pre + rows[:, None] * S_PRE + o, mask=m, other=0.) - (r * r * b_dot)[:, None] * b_x
        tl.store(dx + rows[:, None] * S_DX + o, b_d.to(dx.dtype.element_ty), mask=m)


@triton.jit
def chunk_bwd_finalize_kernel(q, k, dq_pre, dk_pre, rn, dg_part, dbeta_part, dq, dk, dg, dbeta, table,
                              T, H, HV, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
                              NK: tl.constexpr, NQ: tl.constexpr, S_QK: tl.constexpr, S_DQK: tl.constexpr,
                              S_G: tl.constexpr, USE_L2: tl.constexpr):
    """dg = the sum of partial slots [0, NK) (the dq kernel's, then the dk kernel's), dbeta = the sum of
    slots [NQ, NK) (the dk kernel's: the dq kernel has no dbeta share), and with USE_L2 the l2norm
    backward of dq, dk; one program per (qk head, chunk slot)."""
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
            b_dg += tl.load(dg_part + (i_k * HV + i_h).to(tl.int64) * T + rows, mask=m_c, other=0.)
        for i_k in range(NQ, NK):
            b_db += tl.load(dbeta_part + (i_k * HV + i_h).to(tl.int64) * T + rows, mask=m_c, other=0.)
        tl.store(dg + rows * S_G + i_h, b_dg.to(dg.dtype.element_ty), mask=m_c)
        tl.store(dbeta + rows * S_G + i_h, b_db.to(dbeta.dtype.element_ty), mask=m_c)
    if USE_L2:
        p_rn = (j * HV + i_qh * G) * (2 * C)
        _l2norm_bwd(q, dq_pre, dq, tl.load(rn + p_rn + o_c), rows, m_c, i_qh * K, S_QK, H * K, S_DQK, K, C, BK)
        _l2norm_bwd(k, dk_pre, dk, tl.load(rn + p_rn + C + o_c), rows, m_c, i_qh * K, S_QK, H * K, S_DQK, K, C,
                    BK)