"""Triton forward of the chunked gated delta rule over the device-side chunk table (docs/DESIGN.md
sections 2 and 11). Per chunk of C = 64 rows (q^ = rq q, k^ = rk k, the l2norm row factors, 1 without
l2norm; gam_i = sum of g over rows [0, i]; E_ij = exp(sum of g over (j, i]), j <= i):
    A   = strictly lower, A_ij = beta_i E_ij k^_i.k^_j        T = (I + A)^-1,  Ts = T - I
    M   = lower incl. diagonal, M_ij = scale E_ij q^_i.k^_j
    X'  = beta (V - (e^gam rk) (K S))         (row-scaled; K raw)
    U   = T X' = X' + Ts X'                   (Vnew)
    O   = (scale e^gam rq) (Q S) + M U
    S  <- e^gam_last S + K^T ((w rk) U),  w_i = exp(sum of g over (i, last])

Kernels (`b_` block values, `p_` / `o_` pointers / offsets, `m_` masks, `i_` program and loop indices,
as in FLA and chunk_bwd.py):
  chunk_fwd_prep_kernel   grid (H, NC): one program per qk head and chunk slot, all parallel, for the
      G = HV / H value heads of the head's group: q, k read and K K^T, Q K^T, the row norms formed once
      for the group; then every value head's gate rows and row factors, M for every one, and T for
      every one from the last head down (so that neither Q K^T nor the rows' inputs are live in the
      inverses: no register spills at G > 1, l2norm included), the last head's decay E formed once for
      its M and its T (segment_decay's C x C scan, ~1300 instructions, is the costliest step after the
      dots: bench/NOTES.md).
      in  q, k [T, H, K], g, beta [T, HV], table [NC, 4]
      out gates fp32 [NC, HV, GATE_ROWS, C]: the rows common.GATE_* (beta, e^gam rk, scale e^gam rq,
          w rk, beta e^gam rk; 0 on dead rows); eg_last fp32 [NC, HV] (1 for an empty slot);
          rn fp32 [NC, HV, 2, C] (rq, rk; 0 on dead rows);
          Ts [NC, HV, C, C] and M [NC, HV, C, C] in the input dtype (fp32 for fp32 inputs), the same
          for the forward and the backward. Every slot is written, also empty ones, so no later
          kernel reads memory that nothing wrote.
      T by block doubling on tensor cores: with D_b the inverse of the b x b diagonal blocks,
      D_2b = D_b - D_b A_b D_b where A_b keeps A's entries in the lower-left b-block of each 2b-block
      (exact: A_b D_b A_b = 0); D_2 = I - A_1 directly, then b = 2..32 (five levels of two C x C dots).
  chunk_fwd_state_kernel  grid (cdiv(V, BV), HV, N): one program per V-block (fastest axis: the blocks
      of one sequence and head run side by side and share q, k, Ts, M through L2), value head and
      sequence, looping over the sequence's chunk slots with the transposed state S^T [BV, K] in fp32
      registers (BV: configs.state_config; V >= 128 in bf16 / fp16: 128 rows at 8 warps, each warpgroup
      one 64-row half), so every state product takes S^T as the register operand of the tensor-core dot:
          KS^T = S^T K^T, X'^T = beta (V^T - (e^gam rk) KS^T), U^T = X'^T + X'^T Ts^T,
          O^T  = (scale e^gam rq) S^T Q^T + U^T M^T,  S^T <- e^gam_last S^T + ((w rk) U^T) K
      (five dots per chunk; fp32 with K > 128, SPLIT_K: the products with k and q over the two halves
      of K, _split_dot_t / _split_dot). It writes o (every real row; zeros on the padding rows after the
      sequence, program n = 0 also before the first) and the final state ht. STORE_STATES (the
      backward's recompute): instead it writes st, the S^T entering each chunk, [NC, HV, V, K], as the
      dots use it, and ut, U^T = X'^T (I + Ts)^T of the rounded X' (one more C x C dot: the dq / dk
      kernels' U, with which dg's cancelling terms stay consistent; bench/NOTES.md has the error of
      the alternative), [NC, HV, V, C], both in the input dtype (fp32 for fp32 inputs).
      Pointers a variant does not use are None (o, ht with STORE_STATES; st, ut without; ends outside
      pass A).
      Segments (launched by chunk.py's chunk_fwd_state when configs.state_segments > 1): the chunk
      step is affine, S^T <- S^T P + E^T with the K x K transition
      P = e^gam_last I - K^T diag(beta e^gam rk) (I + Ts)^T diag(w rk) K. Grid axis 2 is then
      (sequence, segment); PROPAGATE (pass A) walks one of the first segments - 1 segments with
      cdiv(V + K, BV) blocks of the rows of [S^T; P^T] (S^T from 0, P^T from I, v = 0 on those rows)
      and writes its end rows [V + K, K] fp32 to ends; its grid is (sequences x their segments' row
      blocks, HV, 1), and without an h0 (HAS_H0: the combine's) the first segment's blocks of P^T alone
      are left out (that transition would only carry h0) and its P^T rows written 0. Two launches where
      configs.pass_a_plan says so (the run-time block0, blocks, pieces: the row blocks a launch covers,
      and the pieces each of its segments is walked in): the S^T blocks over whole segments, then the
      P^T blocks over halves (pieces = 2; the second half's P^T rows to halves), whose transitions
      chunk_compose_kernel multiplies. Pass A takes its
      chunks' rows from two table rows (common.run_rows / chunk_at), so its tile addresses depend on
      the loop index alone and the pipeliner loads them two chunks ahead, and V^T through a dot with I
      (exact), a copied tile read in the dot's layout; the other variants have no registers left for
      either (spills: bench/NOTES.md). The pass proper starts each segment from the state
      chunk_combine_kernel formed, and the last segment writes the final state and the padding zeros.
  chunk_combine_kernel    grid (cdiv(V, BV), HV, N): the state entering every segment from pass A's
      end rows, one fp32 product [BV, K] x [K, K] per segment boundary (also the backward's dS pass,
      walking the segments in reverse).
  chunk_compose_kernel    grid (cdiv(K, BR), HV, N (S - 1)): P = P_first P_second of the segments whose
      pass A walked halves, over the first half's rows in ends.

Numerics: q, k, v enter the dots exactly (input dtype, fp32 accumulation); gate sums, exponentials,
the row factors and the state are fp32; the state and X', U enter their dots rounded to the input
dtype (bf16: 2^-9 relative, the price of one tensor-core pass per product); T is formed from
fp32 operands (configs.dot_precision; bf16 inputs: its two whole-tile doubling levels from bf16
operands, configs.prep_config) and stored once in the input dtype, as is M (an fp32 product
of the bf16 q, k, rounded once). fp32 inputs: every dot in
fp32 operands (tf32 on the GPU, exact under the interpreter). o is rounded to v's dtype once.
"""
import triton
import triton.language as tl

from gdn_packed.triton.common import (GATE_BEGK, GATE_BETA, GATE_EGK, GATE_EGQ, GATE_ROWS, GATE_WK,
                                      block_offsets, chunk_at, chunk_row_sums, chunk_rows, gate_row,
                                      group_rows, head_of, padding_after, padding_before_first, run_rows,
                                      segment_chunks, segment_decay, zero_rows)


@triton.jit
def diag_blocks(x, C: tl.constexpr, B: tl.constexpr):
    """The C / B diagonal [B, B] blocks of a [C, C] tile, as [C / B, B, B]."""
    NB: tl.constexpr = C // B
    x4 = tl.permute(tl.reshape(x, [NB, B, NB, B]), (0, 2, 1, 3))         # [I, J, B, B] block (I, J)
    same = (tl.arange(0, NB)[:, None] == tl.arange(0, NB)[None, :])[:, :, None, None]
    return tl.sum(tl.where(same, x4, 0.0), axis=1)


@triton.jit
def block_diagonal(d, C: tl.constexpr, B: tl.constexpr):
    """The [C, C] block-diagonal tile whose diagonal [B, B] blocks are d [C / B, B, B]."""
    NB: tl.constexpr = C // B
    same = (tl.arange(0, NB)[:, None] == tl.arange(0, NB)[None, :])[:, :, None, None]
    x4 = tl.where(same, d[:, None, :, :], 0.0)                               # [I, J, B, B]
    return tl.reshape(tl.permute(x4, (0, 2, 1, 3)), [C, C])


@triton.jit
def inv_unit_lower(a, PREC: tl.constexpr, C: tl.constexpr, OP: tl.constexpr):
    """(I + a)^-1 for a strictly lower [C, C] fp32 a, by block doubling (see the module docstring): the
    levels up to block size 16 on the C / 16 diagonal 16 x 16 blocks (batched dots, fp32 operands at
    PREC), the levels above on the whole tile with operands of type OP (fp32 at PREC, or a 16-bit type:
    one tensor-core pass of half the operand bytes; a level changes only the off-diagonal blocks, so
    the rounding of its operands enters there alone)."""
    B: tl.constexpr = 16
    rb = tl.arange(0, B)
    odd_r, even_c = (rb % 2)[:, None] == 1, (rb % 2)[None, :] == 0
    pair = (rb // 2)[:, None] == (rb // 2)[None, :]
    a3 = diag_blocks(a, C, B)
    t3 = tl.where((rb[:, None] == rb[None, :])[None, :, :], 1.0, 0.0) \
        - tl.where((pair & odd_r & even_c)[None, :, :], a3, 0.0)
    for lvl in tl.static_range(1, 4):      # block size b = 2^lvl within the 16 x 16 blocks
        lower_left = (((rb >> (lvl + 1))[:, None] == (rb >> (lvl + 1))[None, :])
                      & (((rb >> lvl) & 1)[:, None] == 1) & (((rb >> lvl) & 1)[None, :] == 0))
        ta = tl.dot(t3, tl.where(lower_left[None, :, :], a3, 0.0), input_precision=PREC)
        t3 = t3 - tl.dot(ta, t3, input_precision=PREC)
    t = block_diagonal(t3, C, B)
    rc = tl.arange(0, C)
    for lvl in tl.static_range(4, 6):      # b = 16, 32 on the whole tile
        lower_left = (((rc >> (lvl + 1))[:, None] == (rc >> (lvl + 1))[None, :])
                      & (((rc >> lvl) & 1)[:, None] == 1) & (((rc >> lvl) & 1)[None, :] == 0))
        if OP == tl.float32:
            ta = tl.dot(t, tl.where(lower_left, a, 0.0), input_precision=PREC)
            t = t - tl.dot(ta, t, input_precision=PREC)
        else:
            t_in = t.to(OP)
            ta = tl.dot(t_in, tl.where(lower_left, a, 0.0).to(OP))
            t = t - tl.dot(ta.to(OP), t_in)
    return t


@triton.jit
def chunk_fwd_prep_kernel(q, k, g, beta, table, gates, eg_last, rn, ts, mm, scale,
                          H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                          C: tl.constexpr, S_QK: tl.constexpr, S_G: tl.constexpr, USE_L2: tl.constexpr,
                          PREC: tl.constexpr, DOUBLING_16: tl.constexpr):
    i_qh = tl.program_id(0)
    j = tl.program_id(1).to(tl.int64)
    start, length = chunk_rows(table, j, C)
    o_c = tl.arange(0, C)
    rows, m_c = start + o_c, o_c < length
    # g of rows i and i + 1 and beta of the group's value heads, loaded with the first K-block
    G: tl.constexpr = HV // H
    b_gs = group_rows(g, rows, length, i_qh * G, G, S_G, C, 0)
    b_gns = group_rows(g, rows, length, i_qh * G, G, S_G, C, 1)
    b_betas = group_rows(beta, rows, length, i_qh * G, G, S_G, C, 0)

    # the qk head's Gram matrices K K^T, Q K^T and row norms: once for the G value heads of its group
    b_kk = tl.zeros([C, C], dtype=tl.float32)
    b_qk = tl.zeros([C, C], dtype=tl.float32)
    b_ssq = tl.zeros([C], dtype=tl.float32)
    b_ssk = tl.zeros([C], dtype=tl.float32)
    for kb in range(0, K, BK):
        o_b = kb + tl.arange(0, BK)
        o_qk = rows[:, None] * S_QK + i_qh * K + o_b[None, :]
        m_qk = m_c[:, None] & (o_b < K)[None, :]
        b_k = tl.load(k + o_qk, mask=m_qk, other=0.0)
        b_q = tl.load(q + o_qk, mask=m_qk, other=0.0)
        b_kk = tl.dot(b_k, tl.trans(b_k), b_kk)
        b_qk = tl.dot(b_q, tl.trans(b_k), b_qk)
        if USE_L2:
            b_ssk += tl.sum(b_k.to(tl.float32) * b_k.to(tl.float32), axis=1)
            b_ssq += tl.sum(b_q.to(tl.float32) * b_q.to(tl.float32), axis=1)
    if USE_L2:
        b_rk = tl.where(m_c, 1.0 / tl.sqrt(b_ssk + 1e-6), 0.0)
        b_rq = tl.where(m_c, 1.0 / tl.sqrt(b_ssq + 1e-6), 0.0)
    else:
        b_rk = tl.where(m_c, 1.0, 0.0)
        b_rq = b_rk
    m_causal = o_c[:, None] >= o_c[None, :]
    o_cc = block_offsets(C, C)                  # a [C, C] tile of a value head's Ts / M
    b_kk = (b_rk[:, None] * b_kk) * b_rk[None, :]
    b_qk = ((scale * b_rq)[:, None] * b_qk) * b_rk[None, :]

    for i_g in range(0, G):     # every value head's rows first: none of their inputs is live in the inverses
        p_slot = j * HV + i_qh * G + i_g
        b_gam, b_suf, b_tot = chunk_row_sums(head_of(b_gs, i_g), head_of(b_gns, i_g))
        b_beta = head_of(b_betas, i_g)
        b_eg = tl.where(m_c, tl.exp(b_gam), 0.0)
        p_g = gates + p_slot * (GATE_ROWS * C) + o_c
        tl.store(p_g + GATE_BETA * C, b_beta)
        tl.store(p_g + GATE_EGK * C, b_eg * b_rk)
        tl.store(p_g + GATE_EGQ * C, scale * b_eg * b_rq)
        tl.store(p_g + GATE_WK * C, tl.where(m_c, tl.exp(b_suf), 0.0) * b_rk)
        tl.store(p_g + GATE_BEGK * C, b_beta * b_eg * b_rk)
        tl.store(eg_last + p_slot, tl.exp(b_tot))
        tl.store(rn + p_slot * (2 * C) + o_c, b_rq)
        tl.store(rn + p_slot * (2 * C) + C + o_c, b_rk)
    # then M per value head, so that Q K^T is dead before the inverses; then T per value head from the last
    # one down: the last head's decay E, formed for its M, serves its T too (one C x C scan less)
    for i_g in range(0, G - 1):
        b_m = tl.where(m_causal, b_qk * segment_decay(head_of(b_gns, i_g), C), 0.0)
        tl.store(mm + (j * HV + i_qh * G + i_g) * (C * C) + o_cc, b_m.to(mm.dtype.element_ty))
    b_dec = segment_decay(head_of(b_gns, G - 1), C)
    tl.store(mm + (j * HV + i_qh * G + G - 1) * (C * C) + o_cc,
             tl.where(m_causal, b_qk * b_dec, 0.0).to(mm.dtype.element_ty))
    _store_t(G - 1, b_dec, b_betas, b_kk, ts, j * HV + i_qh * G, C, PREC, DOUBLING_16)
    for i_r in range(1, G):
        _store_t(G - 1 - i_r, segment_decay(head_of(b_gns, G - 1 - i_r), C), b_betas, b_kk, ts, j * HV + i_qh * G,
                 C, PREC, DOUBLING_16)


@triton.jit
def _store_t(i_g, b_dec, b_betas, b_kk, ts, slot0, C: tl.constexpr, PREC: tl.constexpr,
             DOUBLING_16: tl.constexpr):
    """Ts = T - I of value head i_g of the group (T = (I + A)^-1, A = beta E K K^T strictly lower, E the
    head's decay b_dec) at chunk slot x HV + the group's first head, slot0; DOUBLING_16: the inverse's
    whole-tile levels in Ts's (16-bit) dtype (configs.prep_config)."""
    o_c = tl.arange(0, C)
    b_a = tl.where(o_c[:, None] > o_c[None, :], head_of(b_betas, i_g)[:, None] * b_kk * b_dec, 0.0)
    if DOUBLING_16:
        b_t = inv_unit_lower(b_a, PREC, C, ts.dtype.element_ty)
    else:
        b_t = inv_unit_lower(b_a, PREC, C, tl.float32)
    tl.store(ts + (slot0 + i_g) * (C * C) + block_offsets(C, C),
             tl.where(o_c[:, None] == o_c[None, :], 0.0, b_t).to(ts.dtype.element_ty))


@triton.jit
def _halves(x, BK: tl.constexpr):
    """The column halves [M, BK / 2] of x [M, BK]."""
    return tl.split(tl.permute(tl.reshape(x, [x.shape[0], 2, BK // 2]), (0, 2, 1)))


@triton.jit
def _half_tiles(p, o_r, m_r, K: tl.constexpr, BK: tl.constexpr):
    """The two column halves [C, BK / 2] of the [C, BK] tile at p + o_r[:, None] + column (rows where m_r,
    columns < K; 0 elsewhere), BK / 2 < K: the first half has no masked column."""
    HK: tl.constexpr = BK // 2
    o_h = tl.arange(0, HK)
    t0 = tl.load(p + o_r[:, None] + o_h[None, :], mask=m_r[:, None], other=0.0)
    if K == BK:
        t1 = tl.load(p + HK + o_r[:, None] + o_h[None, :], mask=m_r[:, None], other=0.0)
    else:
        t1 = tl.load(p + HK + o_r[:, None] + o_h[None, :], mask=m_r[:, None] & (o_h + HK < K)[None, :],
                     other=0.0)
    return t0, t1


@triton.jit
def _split_dot_t(a, p, o_r, m_r, K: tl.constexpr, BK: tl.constexpr):
    """a [M, BK] times the transpose of the [C, BK] tile of _half_tiles, as two products over the halves
    of BK: [M, C] fp32. (fp32 with K > 128: a whole [C, BK] fp32 tile as a register operand spills.)"""
    a0, a1 = _halves(a, BK)
    t0, t1 = _half_tiles(p, o_r, m_r, K, BK)
    return tl.dot(a1, tl.trans(t1), tl.dot(a0, tl.trans(t0)))


@triton.jit
def _split_dot(a, p, o_r, m_r, K: tl.constexpr, BK: tl.constexpr):
    """a [M, C] times the [C, BK] tile of _half_tiles, one half of BK at a time: [M, BK] fp32."""
    t0, t1 = _half_tiles(p, o_r, m_r, K, BK)
    return tl.reshape(tl.permute(tl.join(tl.dot(a, t0), tl.dot(a, t1)), (0, 2, 1)), [a.shape[0], BK])


@triton.jit(do_not_specialize=["T_rows", "segments", "block0", "blocks", "pieces"])
def chunk_fwd_state_kernel(q, k, v, table, cu_chunks, gates, eg_last, ts, mm, h0, o, ht, st, ut, ends, halves,
                           T_rows, segments, block0, blocks, pieces, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                           V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
                           S_QK: tl.constexpr, S_V: tl.constexpr, S_O: tl.constexpr, HAS_H0: tl.constexpr,
                           STORE_STATES: tl.constexpr, PROPAGATE: tl.constexpr, SPLIT_K: tl.constexpr):
    # sequence i_n, segment i_s of `segments` (pass A: of the first segments - 1), i_p = the two as one index
    NB: tl.constexpr = (V + K + BV - 1) // BV       # pass A's row blocks of [S^T; P^T] a segment
    NV: tl.constexpr = (V + BV - 1) // BV           # those of S^T
    if PROPAGATE:   # axis 0: the sequence, then its first segments - 1 segments, then row blocks block0 ..
        # block0 + blocks - 1, then the pieces of the segment each walks; without h0 (HAS_H0 here: whether
        # the combine carries an h0) the first segment's blocks of P^T (the last ones) are left out: the
        # combine never reads that transition then
        units = blocks * pieces
        skip = 0 if HAS_H0 else tl.maximum(block0 + blocks - tl.maximum(block0, NV), 0) * pieces
        per_seq = (segments - 1) * units - skip
        i_h, i_n, i_a = tl.program_id(1), tl.program_id(0) // per_seq, tl.program_id(0) % per_seq
        i_a = tl.where(i_a >= units - skip, i_a + skip, i_a)
        i_s, i_v, piece = i_a // units, block0 + (i_a % units) // pieces, i_a % pieces
        i_p = i_n * (segments - 1) + i_s
    else:
        i_v, i_h, i_p = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        i_n, i_s = i_p // segments, i_p % segments
        N = tl.num_programs(2) // segments
    i_qh = i_h // (HV // H)
    DT = k.dtype.element_ty
    R: tl.constexpr = V + K if PROPAGATE else V     # rows of the carried block S^T (pass A: and P^T)
    o_c = tl.arange(0, C)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    # S^T [BV, BK]: element (v, k) of the state S [K, V]; h0 holds one state per program (sequence, or
    # sequence and segment)
    o_kv = (i_p * HV + i_h).to(tl.int64) * (K * V) + o_k[None, :] * V + o_v[:, None]
    m_s = m_v[:, None] & m_k[None, :]
    if PROPAGATE:       # zero state rows, then the identity rows of P^T
        b_st = tl.where((o_v[:, None] - V == o_k[None, :]) & (o_v < R)[:, None], 1.0, 0.0)
    elif HAS_H0:
        b_st = tl.load(h0 + o_kv, mask=m_s, other=0.0)
    else:
        b_st = tl.zeros([BV, BK], dtype=tl.float32)

    c0, c1 = segment_chunks(cu_chunks, i_n, i_s, segments)
    if PROPAGATE:       # the piece's chunks (the first or second half of the segment's); their rows from two
        # table rows read here (run_rows)
        if pieces > 1:
            half = tl.cdiv(c1 - c0, 2)
            c0, c1 = tl.where(piece == 0, c0, c0 + half), tl.where(piece == 0, c0 + half, c1)
        first, end = run_rows(table, c0, c1, T_rows)
    for i_t in range(0, c1 - c0):
        j = (c0 + i_t).to(tl.int64)
        if PROPAGATE:   # the tile addresses from i_t alone: the pipeliner loads them two chunks ahead
            start, length = chunk_at(first, end, i_t, T_rows, C)
        else:           # (the same here costs registers the other variants lack: spills)
            start, length = chunk_rows(table, j, C)
        p_slot = j * HV + i_h
        m_c = o_c < length
        # scalar int64 bases, int32 tile offsets (no per-element 64-bit address arithmetic)
        p_k = k + start * S_QK + i_qh * K
        o_qk = o_c[:, None] * S_QK + o_k[None, :]
        m_qk = m_c[:, None] & m_k[None, :]
        if not SPLIT_K:
            b_k = tl.load(p_k + o_qk, mask=m_qk, other=0.0)
        m_vt = m_v[:, None] & m_c[None, :]
        b_vt = tl.load(v + start * S_V + i_h * V + (o_c[None, :] * S_V + o_v[:, None]), mask=m_vt, other=0.0)
        b_beta = gate_row(gates, p_slot, GATE_BETA, C)
        b_egk = gate_row(gates, p_slot, GATE_EGK, C)
        b_wk = gate_row(gates, p_slot, GATE_WK, C)
        # the chunk decay broadcast over the K columns (a vector load, copied with the tiles; a scalar load
        # would be waited for by the fence before the next wgmma)
        b_dec = tl.load(eg_last + p_slot + 0 * o_k)
        o_cc = o_c[:, None] * C + o_c[None, :]
        b_st_in = b_st.to(DT)
        if SPLIT_K:
            b_kst = _split_dot_t(b_st_in, p_k, o_c * S_QK, m_c, K, BK)
        else:
            b_kst = tl.dot(b_st_in, tl.trans(b_k))                  # (K S)^T   [BV, C]
        if PROPAGATE and DT != tl.float32:  # V^T times I on the tensor core (exact): a copied tile read in
            # the dot's layout, not a register load converted to it through shared memory
            b_vx = tl.dot(b_vt, tl.where(o_c[:, None] == o_c[None, :], 1.0, 0.0).to(DT))
        else:
            b_vx = b_vt.to(tl.float32)
        b_xt = b_beta[None, :] * (b_vx - b_egk[None, :] * b_kst)    # X'^T      [BV, C]
        b_xt_in = b_xt.to(DT)
        b_ts = tl.load(ts + p_slot * (C * C) + o_cc)
        b_ut = tl.dot(b_xt_in, tl.trans(b_ts), b_xt)    # U^T = X'^T (I + Ts)^T
        if STORE_STATES:    # the backward's U^T: X'^T (I + Ts)^T of the rounded X', in the input dtype
            b_utr = tl.dot(b_xt_in, tl.trans(b_ts), b_xt_in.to(tl.float32)).to(DT)
        elif not PROPAGATE:
            b_egq = gate_row(gates, p_slot, GATE_EGQ, C)
            if SPLIT_K:
                b_ot = _split_dot_t(b_st_in, q + start * S_QK + i_qh * K, o_c * S_QK, m_c, K, BK)
            else:
                b_ot = tl.dot(b_st_in, tl.trans(tl.load(q + start * S_QK + i_qh * K + o_qk, mask=m_qk, other=0.0)))
            b_ot = b_ot * b_egq[None, :]                            # (Q S)^T scaled
            b_ot = tl.dot(b_ut.to(DT), tl.trans(tl.load(mm + p_slot * (C * C) + o_cc)), b_ot)   # + (M U)^T
            tl.store(o + start * S_O + i_h * V + (o_c[None, :] * S_O + o_v[:, None]), b_ot.to(o.dtype.element_ty),
                     mask=m_vt)
        b_uw = (b_ut * b_wk[None, :]).to(DT)
        if SPLIT_K:     # (k read again, an L1/L2 hit, half a tile at a time: fp32 with K > 128)
            b_st = b_st * b_dec[None, :] + _split_dot(b_uw, p_k, o_c * S_QK, m_c, K, BK)
        else:
            b_st = b_st * b_dec[None, :] + tl.dot(b_uw, b_k)
        if STORE_STATES:    # U^T and the state entering the chunk as the dots used it (input dtype), stored
            # after the step's last dot: a store still in flight is waited for by the fence before a wgmma
            tl.store(ut + p_slot * (V * C) + (o_v[:, None] * C + o_c[None, :]), b_utr, mask=m_v[:, None])
            if K == BK:     # the block's rows are contiguous: one [BV, K] block from its base
                o_st = i_v * (BV * K) + block_offsets(BV, BK)
            else:
                o_st = o_v[:, None] * K + o_k[None, :]
            tl.store(st + p_slot * (K * V) + o_st, b_st_in, mask=m_s)
    if PROPAGATE:       # the segment's end rows: S^T from a zero entering state, then P^T (a second piece's
        # P^T rows, o_v >= V, to halves [N (segments - 1), HV, K, K])
        if piece == 0:
            p_e = (i_p * HV + i_h).to(tl.int64) * (R * K) + o_v[:, None] * K + o_k[None, :]
            tl.store(ends + p_e, b_st, mask=(o_v < R)[:, None] & m_k[None, :])
        else:
            p_e = (i_p * HV + i_h).to(tl.int64) * (K * K) + (o_v - V)[:, None] * K + o_k[None, :]
            tl.store(halves + p_e, b_st, mask=((o_v >= V) & (o_v < R))[:, None] & m_k[None, :])
        if not HAS_H0:  # the first segment's rows nobody formed: 0, so that every word of kept is written
            if (i_s == 0) & (i_v == 0):
                for b in tl.static_range(NV, NB):
                    o_r = b * BV + tl.arange(0, BV)
                    tl.store(ends + (i_p * HV + i_h).to(tl.int64) * (R * K) + o_r[:, None] * K + o_k[None, :],
                             tl.zeros([BV, BK], dtype=tl.float32), mask=(o_r < R)[:, None] & m_k[None, :])
    elif not STORE_STATES and i_s == segments - 1:
        tl.store(ht + (i_n * HV + i_h).to(tl.int64) * (K * V) + o_k[None, :] * V + o_v[:, None], b_st,
                 mask=m_s)
        a, b = padding_after(table, cu_chunks, i_n, N, T_rows)
        col0, ncols = i_h * V + i_v * BV, tl.minimum(V - i_v * BV, BV)
        zero_rows(o, a, b, col0, ncols, S_O, BV, C)
        if i_n == 0:
            first = padding_before_first(table, cu_chunks, N, T_rows)
            zero_rows(o, first * 0, first, col0, ncols, S_O, BV, C)


@triton.jit(do_not_specialize=["segments"])
def chunk_combine_kernel(ends, h0, ent, cu_chunks, segments, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                         BK: tl.constexpr, BV: tl.constexpr, HAS_H0: tl.constexpr, REVERSE: tl.constexpr,
                         PREC: tl.constexpr):
    """The state entering every segment (grid (cdiv(V, BV), HV, N)), for the forward state pass and
    (REVERSE) the backward's dS pass, which walks the segments from the last: S = h0 (or 0) enters the
    first segment walked, and S^T <- S^T P_t + E_t^T from pass A's end rows [V + K, K] of segment t
    (E_t^T the segment's end state from zero, P_t its K x K transition; t = s forward, s - 1 reverse,
    as pass A covers the segments the walk leaves: the first segments - 1 forward, the last reverse);
    writes the state entering segment s, [K, V] fp32, to ent[n * segments + s]. An empty segment (a
    sequence shorter than the segments) passes the state on as it is: its transition is I, but the
    product would round the state to the dot's precision (tf32 on a GPU). Without h0 the first
    transition is not read (0 P + E = E): the dS pass that takes the forward's transitions has none for
    the last segment (chunk.py, chunk_bwd_dstate)."""
    i_v, i_h, i_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_s = (o_v < V)[:, None] & m_k[None, :]
    o_kv = o_k[None, :] * V + o_v[:, None]
    if HAS_H0:
        b_st = tl.load(h0 + (i_n * HV + i_h).to(tl.int64) * (K * V) + o_kv, mask=m_s, other=0.0)
    else:
        b_st = tl.zeros([BV, BK], dtype=tl.float32)
    for i in range(0, segments - 1):
        i_s, i_t = i, i
        if REVERSE:
            i_s, i_t = segments - 1 - i, segments - 2 - i
        tl.store(ent + ((i_n * segments + i_s) * HV + i_h).to(tl.int64) * (K * V) + o_kv, b_st, mask=m_s)
        lo, hi = segment_chunks(cu_chunks, i_n, i_t + 1 if REVERSE else i_t, segments)   # pass A's segment t
        if hi > lo:
            p_e = ends + ((i_n * (segments - 1) + i_t) * HV + i_h).to(tl.int64) * ((V + K) * K)
            b_e = tl.load(p_e + o_v[:, None] * K + o_k[None, :], mask=m_s, other=0.0)
            if (i > 0) | HAS_H0:
                b_p = tl.load(p_e + (V + o_k)[:, None] * K + o_k[None, :], mask=m_k[:, None] & m_k[None, :],
                              other=0.0)
                b_st = tl.dot(b_st, b_p, b_e, input_precision=PREC)
            else:       # 0 P + E: the transition is not read (the dS pass leaves the last one unset)
                b_st = b_e
    i_s = segments - 1
    if REVERSE:
        i_s = 0
    tl.store(ent + ((i_n * segments + i_s) * HV + i_h).to(tl.int64) * (K * V) + o_kv, b_st, mask=m_s)


@triton.jit(do_not_specialize=["segments"])
def chunk_compose_kernel(ends, halves, segments, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                         BK: tl.constexpr, BR: tl.constexpr, HAS_H0: tl.constexpr, PREC: tl.constexpr):
    """The transitions of the segments whose pass A walked two halves (pass_a_plan; grid (cdiv(K, BR), HV,
    N (segments - 1))): P = P_first P_second [K, K] fp32 from the first half's P^T rows (ends: rows V ..
    V + K - 1 of the segment's [V + K, K] end rows) and the second's (halves [N (segments - 1), HV, K,
    K]), written over the first's: each program its BR rows, which no other program reads. Without h0
    the first segment of every sequence has no transition (pass A formed none): left as it is (0)."""
    i_r, i_h, i_p = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if HAS_H0 or i_p % (segments - 1) != 0:
        o_r = i_r * BR + tl.arange(0, BR)
        o_k = tl.arange(0, BK)
        m_k = o_k < K
        m_r = (o_r < K)[:, None] & m_k[None, :]
        base = (i_p * HV + i_h).to(tl.int64)
        p_a = ends + base * ((V + K) * K) + (V + o_r)[:, None] * K + o_k[None, :]
        b_a = tl.load(p_a, mask=m_r, other=0.0)
        b_b = tl.load(halves + base * (K * K) + o_k[:, None] * K + o_k[None, :],
                      mask=m_k[:, None] & m_k[None, :], other=0.0)
        tl.store(p_a, tl.dot(b_a, b_b, input_precision=PREC), mask=m_r)
