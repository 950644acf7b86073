"""LEGACY (until the reworked backward lands; used only by chunk_bwd.py): the former Triton forward of the chunked gated delta rule over the device-side chunk table (docs/DESIGN.md section 2).

Per chunk (C = 64 rows, gamma = cumsum g from the chunk start, E[r,s] = exp(gamma_r - gamma_s), r >= s):
    A = strict_lower(diag(beta) (K K^T) * E),  Tm = (I + A)^-1,  M = scale * causal(Q K^T) * E
    Vnew   = Tm diag(beta) (V - diag(e^gamma) K S)     (= U - W S, with W and U never formed)
    O      = scale * diag(e^gamma) Q S + M Vnew
    S_next = e^Gamma S + K^T diag(e^(Gamma - gamma)) Vnew
With use_qk_l2norm, q and k enter every dot raw and the row factors 1/sqrt(|x|^2 + 1e-6) are applied
to the fp32 results (QK^T, KK^T, KS, QS) or folded into the other operand (K^T Vnew), so normalised
q/k are never rounded to the input dtype.

Two kernels (`b_` = a block of values in registers, `p_`/`*_off` = pointers/offsets):
  chunk_prep_kernel          grid (NC, HV), one program per chunk slot and value head, all parallel.
      in  q, k [T, H, K], g, beta [T, HV], table [NC, 4]
      out Tm, M [NC, HV, P, C, C]: P = 1 plane of fp32 (fp32 inputs) or P = 2 planes hi, lo of the
          input dtype (bf16/fp16: hi + lo carries the fp32 value to ~2^-16); rn [NC, HV, 2, C] fp32,
          the l2norm row factors of q and k (only with use_qk_l2norm).
      Tm: the four 16x16 diagonal blocks by forward substitution, the six blocks below them by
      T_ij = -T_ii sum_{k=j..i-1} A_ik T_kj (fp32 dots, input_precision="tf32x3"); zeros above.
  chunk_state_output_kernel  grid (N, HV, cdiv(V, BV)), one program per sequence, value head and
      V-block, looping over the sequence's chunk slots cu_chunks[n]..cu_chunks[n+1] with the state
      block S [K, BV] in float32 registers. It writes o for every real row, the final state, and zeros
      on the padding rows that follow the sequence (program n = 0 also those before the first one).
      in  q, k, v [T, HV, V], g, beta, table, cu_chunks [N+1], Tm, M, rn, initial state [N, HV, K, V]
      out o [T, HV, V] (v's dtype), final state [N, HV, K, V] float32
      STORE_STATES (the backward's recompute): instead of o and the final state it writes the state
      entering each chunk, S_in [NC, HV, K, V] fp32, and Vnew [T, HV, V] fp32 (real rows), and skips
      Q S, M Vnew and the padding rows.
Unused slots (length 0) and sequences without chunks exit at once; the grids depend only on T, N and
the shapes. GVA: value head hv reads qk-head hv // (HV // H). Row offsets are int64.

Fusion plan, from bytes moved per (token, value head) at K = V = 128, bf16, GVA 2 (q/k shared by two
value heads through L2, so 128 B each); the floor is q + k + v + o + g + beta = 776 B:
  - FLA-style five passes (A = KK^T -> inverse -> W, U -> state pass writing h per chunk and v_new ->
    output pass re-reading q, k, h, v_new): A 256 B + Ai 128 B + W, U 512 B written and re-read, h
    (K*V*2/C = 512 B) and v_new 256 B written and re-read: ~4 kB, ~5x the floor.
  - Here W and U are never materialised (Vnew = Tm (beta (V - e^gamma K S)) costs the state pass one
    extra 64x64xBV dot instead of reading 512 B), and the output is produced inside the state pass,
    where S is already in registers, so neither h nor v_new goes to memory. What remains between the
    two kernels is Tm and M: 2 x 64 x 4 B = 512 B per (token, value head) written once and read once
    (hi + lo bf16 planes are the same bytes as fp32; the full square is read so that the loads are
    unmasked, contiguous and pipelined by cp.async). Total ~ 776 + 2 x 512 + ~130 (q, k read by both
    kernels) ~ 1.9 kB, ~2.5x the floor, ~0.45 ms of HBM time at 1x32768, HV = 32.
  - Not fused: the inverse into the state pass. It is independent of S but costs microseconds of
    latency per chunk; in the sequential loop it would multiply by the chunk count instead of
    running in parallel.
  - The gate cumsum is recomputed by both kernels from g (64 floats) instead of being stored.
The price of fusing the output into the state pass: Q S and M Vnew (and the V-blocks each reading q,
k, Tm, M through L2) sit in the sequential loop. The state pass has N*HV*V/BV programs (128 at
1x32768, HV=32, BV=32: about one per H200 SM), so its per-chunk latency, not bandwidth, bounds it.

Numerics (what is rounded): inputs q, k, v are used exactly (bf16/fp16 operands of tl.dot with fp32
accumulation); gate sums, exponentials, the l2norm factors, the state and all dot results are fp32.
The state S, its update term, X and Vnew enter tensor-core dots as hi + lo pairs of the input dtype
(SPLIT), and Tm, M as stored hi + lo planes, so every dot is ~fp32-exact (the lo x lo terms, ~2^-16
relative, are dropped) at two to three times the dot cost. o is rounded to v's dtype once, at the
store. fp32 inputs: every dot is one fp32 dot (tf32 on the GPU, exact under the interpreter).
"""
import torch
import triton
import triton.language as tl

from gdn_packed.triton.common import chunk_rows, padding_after, padding_before_first


@triton.jit
def _mm_f32(a, b):
    return tl.dot(a, b, input_precision="tf32x3")


@triton.jit
def _substitute_row(a, t, sel):
    """Row i (sel = r == i) of t := e_i - sum_s a[i, s] t[s, :]; rows < i of t are final."""
    a_i = tl.sum(tl.where(sel, a, 0.0), axis=0)                      # row i of a, by column s
    return tl.where(sel, t - tl.sum(a_i[:, None] * t, axis=0)[None, :], t)


@triton.jit
def _inv_unit_lower16x4(a0, a1, a2, a3):
    """(I + a)^-1 of four strictly lower-triangular fp32 [16, 16] blocks by forward substitution, the
    four chains interleaved in one rolled loop (unrolled, the 4 x 15 steps exhaust the registers)."""
    r = tl.arange(0, 16)
    t0 = (r[:, None] == r[None, :]).to(tl.float32)
    t1, t2, t3 = t0, t0, t0
    for i in range(1, 16):
        sel = r[:, None] == i
        t0 = _substitute_row(a0, t0, sel)
        t1 = _substitute_row(a1, t1, sel)
        t2 = _substitute_row(a2, t2, sel)
        t3 = _substitute_row(a3, t3, sel)
    return t0, t1, t2, t3


@triton.jit
def _a_block(kk, b_beta, g_r, g_s, DIAG: tl.constexpr):
    """A block: beta_r kk[r, s] exp(gamma_r - gamma_s), strictly lower on a diagonal block."""
    r = tl.arange(0, 16)
    d = g_r[:, None] - g_s[None, :]
    if DIAG:
        lower = r[:, None] > r[None, :]
        a = tl.where(lower, b_beta[:, None] * kk * tl.exp(tl.where(lower, d, 0.0)), 0.0)
    else:
        a = b_beta[:, None] * kk * tl.exp(d)
    return a


@triton.jit
def _store_planes(p, off, b, mask, SPLIT: tl.constexpr, C: tl.constexpr):
    """Store fp32 b in p's dtype at p + off; with SPLIT also the rounding remainder in the plane after
    (p + C*C + off), so that hi + lo carries b to ~16 bits more than one plane."""
    hi = b.to(p.dtype.element_ty)
    tl.store(p + off, hi, mask=mask)
    if SPLIT:
        tl.store(p + C * C + off, (b - hi.to(tl.float32)).to(p.dtype.element_ty), mask=mask)


@triton.jit
def _store16(p, b, i: tl.constexpr, j: tl.constexpr, SPLIT: tl.constexpr, C: tl.constexpr):
    r = tl.arange(0, 16)
    _store_planes(p, (16 * i + r)[:, None] * C + (16 * j + r)[None, :], b, None, SPLIT, C)


@triton.jit
def _rows_tile(p, rows, rmask, stride, cols, cmask):
    return tl.load(p + rows[:, None] * stride + cols[None, :], mask=rmask[:, None] & cmask[None, :],
                   other=0.0)


@triton.jit
def chunk_prep_kernel(q, k, g, beta, table, t_out, m_out, rn_out, scale,
                      H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                      C: tl.constexpr, USE_L2: tl.constexpr, SPLIT: tl.constexpr):
    tl.static_assert(C == 64)
    j = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1)
    h = hv // (HV // H)
    start, length = chunk_rows(table, j, C)
    if length == 0:
        return
    rc = tl.arange(0, C)
    r16 = tl.arange(0, 16)
    rows, rmask = start + rc, rc < length
    rows0, rows1, rows2, rows3 = start + r16, start + 16 + r16, start + 32 + r16, start + 48 + r16
    m0, m1, m2, m3 = r16 < length, 16 + r16 < length, 32 + r16 < length, 48 + r16 < length
    p_q, p_k = q + h * K, k + h * K

    qk = tl.zeros([C, C], dtype=tl.float32)
    kk00 = tl.zeros([16, 16], dtype=tl.float32)
    kk10, kk11, kk20, kk21, kk22 = kk00, kk00, kk00, kk00, kk00
    kk30, kk31, kk32, kk33 = kk00, kk00, kk00, kk00
    ssq = tl.zeros([C], dtype=tl.float32)
    ssk = ssq
    ssk0 = tl.zeros([16], dtype=tl.float32)
    ssk1, ssk2, ssk3 = ssk0, ssk0, ssk0
    for kb in range(0, K, BK):
        cols = kb + tl.arange(0, BK)
        cm = cols < K
        b_q = _rows_tile(p_q, rows, rmask, H * K, cols, cm)
        b_k = _rows_tile(p_k, rows, rmask, H * K, cols, cm)
        b_k0 = _rows_tile(p_k, rows0, m0, H * K, cols, cm)
        b_k1 = _rows_tile(p_k, rows1, m1, H * K, cols, cm)
        b_k2 = _rows_tile(p_k, rows2, m2, H * K, cols, cm)
        b_k3 = _rows_tile(p_k, rows3, m3, H * K, cols, cm)
        qk = tl.dot(b_q, tl.trans(b_k), qk)
        kk00 = tl.dot(b_k0, tl.trans(b_k0), kk00)
        kk10 = tl.dot(b_k1, tl.trans(b_k0), kk10)
        kk11 = tl.dot(b_k1, tl.trans(b_k1), kk11)
        kk20 = tl.dot(b_k2, tl.trans(b_k0), kk20)
        kk21 = tl.dot(b_k2, tl.trans(b_k1), kk21)
        kk22 = tl.dot(b_k2, tl.trans(b_k2), kk22)
        kk30 = tl.dot(b_k3, tl.trans(b_k0), kk30)
        kk31 = tl.dot(b_k3, tl.trans(b_k1), kk31)
        kk32 = tl.dot(b_k3, tl.trans(b_k2), kk32)
        kk33 = tl.dot(b_k3, tl.trans(b_k3), kk33)
        if USE_L2:
            ssq += tl.sum(b_q.to(tl.float32) * b_q.to(tl.float32), axis=1)
            ssk += tl.sum(b_k.to(tl.float32) * b_k.to(tl.float32), axis=1)
            ssk0 += tl.sum(b_k0.to(tl.float32) * b_k0.to(tl.float32), axis=1)
            ssk1 += tl.sum(b_k1.to(tl.float32) * b_k1.to(tl.float32), axis=1)
            ssk2 += tl.sum(b_k2.to(tl.float32) * b_k2.to(tl.float32), axis=1)
            ssk3 += tl.sum(b_k3.to(tl.float32) * b_k3.to(tl.float32), axis=1)

    # gates: gamma per 16-row group (offset by the sums of the groups before it) and over the chunk
    b_g = tl.load(g + rows * HV + hv, mask=rmask, other=0.0).to(tl.float32)
    gam = tl.cumsum(b_g, axis=0)
    g0 = tl.load(g + rows0 * HV + hv, mask=m0, other=0.0).to(tl.float32)
    g1 = tl.load(g + rows1 * HV + hv, mask=m1, other=0.0).to(tl.float32)
    g2 = tl.load(g + rows2 * HV + hv, mask=m2, other=0.0).to(tl.float32)
    g3 = tl.load(g + rows3 * HV + hv, mask=m3, other=0.0).to(tl.float32)
    s0 = tl.sum(g0, axis=0)
    s1 = s0 + tl.sum(g1, axis=0)
    s2 = s1 + tl.sum(g2, axis=0)
    gam0, gam1 = tl.cumsum(g0, axis=0), tl.cumsum(g1, axis=0) + s0
    gam2, gam3 = tl.cumsum(g2, axis=0) + s1, tl.cumsum(g3, axis=0) + s2
    be0 = tl.load(beta + rows0 * HV + hv, mask=m0, other=0.0).to(tl.float32)
    be1 = tl.load(beta + rows1 * HV + hv, mask=m1, other=0.0).to(tl.float32)
    be2 = tl.load(beta + rows2 * HV + hv, mask=m2, other=0.0).to(tl.float32)
    be3 = tl.load(beta + rows3 * HV + hv, mask=m3, other=0.0).to(tl.float32)
    if USE_L2:
        rk0, rk1 = 1.0 / tl.sqrt(ssk0 + 1e-6), 1.0 / tl.sqrt(ssk1 + 1e-6)
        rk2, rk3 = 1.0 / tl.sqrt(ssk2 + 1e-6), 1.0 / tl.sqrt(ssk3 + 1e-6)
        kk00, kk10, kk11 = kk00 * rk0[None, :], kk10 * rk0[None, :], kk11 * rk1[None, :]
        kk20, kk21, kk22 = kk20 * rk0[None, :], kk21 * rk1[None, :], kk22 * rk2[None, :]
        kk30, kk31 = kk30 * rk0[None, :], kk31 * rk1[None, :]
        kk32, kk33 = kk32 * rk2[None, :], kk33 * rk3[None, :]
        be0, be1, be2, be3 = be0 * rk0, be1 * rk1, be2 * rk2, be3 * rk3

    # M = scale * causal(Q K^T) * E
    causal = rc[:, None] >= rc[None, :]
    b_m = tl.where(causal, qk * tl.exp(tl.where(causal, gam[:, None] - gam[None, :], 0.0)), 0.0) * scale
    if USE_L2:
        rnq, rnk = 1.0 / tl.sqrt(ssq + 1e-6), 1.0 / tl.sqrt(ssk + 1e-6)
        b_m = b_m * rnq[:, None] * rnk[None, :]
        tl.store(rn_out + (j * HV + hv) * (2 * C) + rc, rnq)
        tl.store(rn_out + (j * HV + hv) * (2 * C) + C + rc, rnk)
    tm_off = (j * HV + hv) * ((1 + SPLIT) * C * C)
    _store_planes(m_out + tm_off, rc[:, None] * C + rc[None, :], b_m, None, SPLIT, C)

    # Tm = (I + A)^-1 by 16x16 blocks
    t00, t11, t22, t33 = _inv_unit_lower16x4(_a_block(kk00, be0, gam0, gam0, True),
                                             _a_block(kk11, be1, gam1, gam1, True),
                                             _a_block(kk22, be2, gam2, gam2, True),
                                             _a_block(kk33, be3, gam3, gam3, True))
    a10 = _a_block(kk10, be1, gam1, gam0, False)
    a21 = _a_block(kk21, be2, gam2, gam1, False)
    a32 = _a_block(kk32, be3, gam3, gam2, False)
    a20 = _a_block(kk20, be2, gam2, gam0, False)
    a31 = _a_block(kk31, be3, gam3, gam1, False)
    a30 = _a_block(kk30, be3, gam3, gam0, False)
    t10 = -_mm_f32(t11, _mm_f32(a10, t00))
    t21 = -_mm_f32(t22, _mm_f32(a21, t11))
    t32 = -_mm_f32(t33, _mm_f32(a32, t22))
    t20 = -_mm_f32(t22, _mm_f32(a20, t00) + _mm_f32(a21, t10))
    t31 = -_mm_f32(t33, _mm_f32(a31, t11) + _mm_f32(a32, t21))
    t30 = -_mm_f32(t33, _mm_f32(a30, t00) + _mm_f32(a31, t10) + _mm_f32(a32, t20))
    p_t = t_out + tm_off
    _store16(p_t, t00, 0, 0, SPLIT, C)
    _store16(p_t, t10, 1, 0, SPLIT, C)
    _store16(p_t, t11, 1, 1, SPLIT, C)
    _store16(p_t, t20, 2, 0, SPLIT, C)
    _store16(p_t, t21, 2, 1, SPLIT, C)
    _store16(p_t, t22, 2, 2, SPLIT, C)
    _store16(p_t, t30, 3, 0, SPLIT, C)
    _store16(p_t, t31, 3, 1, SPLIT, C)
    _store16(p_t, t32, 3, 2, SPLIT, C)
    _store16(p_t, t33, 3, 3, SPLIT, C)
    zero = tl.zeros([16, 16], dtype=tl.float32)
    _store16(p_t, zero, 0, 1, SPLIT, C)
    _store16(p_t, zero, 0, 2, SPLIT, C)
    _store16(p_t, zero, 0, 3, SPLIT, C)
    _store16(p_t, zero, 1, 2, SPLIT, C)
    _store16(p_t, zero, 1, 3, SPLIT, C)
    _store16(p_t, zero, 2, 3, SPLIT, C)


@triton.jit
def _split_planes(b, dtype, SPLIT: tl.constexpr):
    """fp32 b as (hi, lo) in dtype with hi + lo ~ b to ~2^-16 (SPLIT), else (b in dtype, the same)."""
    b_hi = b.to(dtype)
    if SPLIT:
        b_lo = (b - b_hi.to(tl.float32)).to(dtype)
    else:
        b_lo = b_hi
    return b_hi, b_lo


@triton.jit
def _dot_split(a, b_hi, b_lo, SPLIT: tl.constexpr):
    """a @ (b_hi + b_lo) (SPLIT), else a @ b_hi."""
    acc = tl.dot(a, b_hi)
    if SPLIT:
        acc = tl.dot(a, b_lo, acc)
    return acc


@triton.jit
def _dot_state(a, b, SPLIT: tl.constexpr):
    """a (input dtype, exact) @ b (fp32) on tensor cores: b rounded to a's dtype once, or (SPLIT) as
    hi + lo parts so the product is ~fp32-exact."""
    b_hi, b_lo = _split_planes(b, a.dtype, SPLIT)
    return _dot_split(a, b_hi, b_lo, SPLIT)


@triton.jit
def _dot_pair(a_hi, a_lo, b, SPLIT: tl.constexpr):
    """(a_hi + a_lo) @ b for fp32 b: with SPLIT three products of hi/lo parts in a_hi's dtype (the
    lo x lo term, ~2^-16 relative, is dropped); else a_hi @ b in fp32 (tf32 on the GPU)."""
    if SPLIT:
        b_hi = b.to(a_hi.dtype)
        acc = tl.dot(a_hi, b_hi)
        acc = tl.dot(a_lo, b_hi, acc)
        acc = tl.dot(a_hi, (b - b_hi.to(tl.float32)).to(a_hi.dtype), acc)
    else:
        acc = tl.dot(a_hi, b)
    return acc


@triton.jit
def load_row_norms(rn, j, hv, HV, C: tl.constexpr, USE_L2: tl.constexpr):
    """The l2norm row factors (1/|q_r|, 1/|k_r|) [C] of chunk slot j, value head hv, written by
    chunk_prep_kernel (ones without l2norm)."""
    rc = tl.arange(0, C)
    if USE_L2:
        base = (j * HV + hv) * (2 * C)
        rnq = tl.load(rn + base + rc)
        rnk = tl.load(rn + base + C + rc)
    else:
        rnq = tl.full([C], 1.0, dtype=tl.float32)
        rnk = rnq
    return rnq, rnk


@triton.jit
def _zero_rows(o, a, b, hv, cv, vmask, HV: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
               C: tl.constexpr):
    """o[a:b, hv, cv] = 0 (a, b int64 scalars)."""
    rc = tl.arange(0, C)
    zeros = tl.zeros([C, BV], dtype=o.dtype.element_ty)
    for it in range(0, tl.cdiv(b - a, C)):
        rows = a + it * C + rc
        tl.store(o + rows[:, None] * (HV * V) + hv * V + cv[None, :], zeros,
                 mask=(rows < b)[:, None] & vmask[None, :])


@triton.jit(do_not_specialize=["T_rows"])
def chunk_state_output_kernel(q, k, v, g, beta, table, cu_chunks, t_in, m_in, rn_in, h0, o, ht, s_out,
                              vnew_out, scale, T_rows,
                              H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                              BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
                              USE_L2: tl.constexpr, HAS_H0: tl.constexpr, SPLIT: tl.constexpr,
                              STORE_STATES: tl.constexpr):
    n = tl.program_id(0)
    hv = tl.program_id(1)
    iv = tl.program_id(2)
    N = tl.num_programs(0)
    h = hv // (HV // H)
    # HALVES (fp32 with BK > 128): the state is held as two K-halves [BK / 2, BV] (b_s: rows rk,
    # b_s2: rows rk2) and every product over K or onto K splits in two; q, k, Tm, M are loaded next
    # to their dots, K^T is read transposed by the pointer order (no register transpose), and the
    # K S, Q S dots loop over the halves (one shared-memory tile site, fewer hoisted addresses).
    # The whole-K form spills registers on sm_90 (gdn_packed/triton/chunk.py).
    HALVES: tl.constexpr = (not SPLIT) and BK > 128
    BKA: tl.constexpr = BK // 2 if HALVES else BK
    rk = tl.arange(0, BKA)
    kmask = rk < K
    cv = iv * BV + tl.arange(0, BV)
    vmask = cv < V
    rc = tl.arange(0, C)
    s_base = (n * HV + hv).to(tl.int64) * (K * V)
    s_off = s_base + rk[:, None] * V + cv[None, :]
    smask = kmask[:, None] & vmask[None, :]
    if HAS_H0:
        b_s = tl.load(h0 + s_off, mask=smask, other=0.0)
    else:
        b_s = tl.zeros([BKA, BV], dtype=tl.float32)
    if HALVES:
        rk2 = BKA + tl.arange(0, BKA)
        kmask2 = rk2 < K
        s_off2 = s_base + rk2[:, None] * V + cv[None, :]
        smask2 = kmask2[:, None] & vmask[None, :]
        if HAS_H0:
            b_s2 = tl.load(h0 + s_off2, mask=smask2, other=0.0)
        else:
            b_s2 = tl.zeros([BKA, BV], dtype=tl.float32)

    c0 = tl.load(cu_chunks + n)
    c1 = tl.load(cu_chunks + n + 1)
    for it in range(0, c1 - c0):
        j = (c0 + it).to(tl.int64)
        start, length = chunk_rows(table, j, C)
        if STORE_STATES:
            tl.store(s_out + (j * HV + hv) * (K * V) + rk[:, None] * V + cv[None, :], b_s, mask=smask)
            if HALVES:
                tl.store(s_out + (j * HV + hv) * (K * V) + rk2[:, None] * V + cv[None, :], b_s2,
                         mask=smask2)
        rows, rmask = start + rc, rc < length
        b_g = tl.load(g + rows * HV + hv, mask=rmask, other=0.0).to(tl.float32)
        b_beta = tl.load(beta + rows * HV + hv, mask=rmask, other=0.0).to(tl.float32)
        gam = tl.cumsum(b_g, axis=0)
        gam_end = tl.sum(b_g, axis=0)
        eg = tl.exp(gam)
        qk_off = rows[:, None] * (H * K) + h * K + rk[None, :]
        qk_mask = rmask[:, None] & kmask[None, :]
        if not HALVES:  # (HALVES: each K-half of q and k is loaded next to its dot)
            b_k = tl.load(k + qk_off, mask=qk_mask, other=0.0)
            b_q = tl.load(q + qk_off, mask=qk_mask, other=0.0)
        v_off = rows[:, None] * (HV * V) + hv * V + cv[None, :]
        v_mask = rmask[:, None] & vmask[None, :]
        b_v = tl.load(v + v_off, mask=v_mask, other=0.0).to(tl.float32)
        tm_off = (j * HV + hv) * ((1 + SPLIT) * C * C) + rc[:, None] * C + rc[None, :]
        if not HALVES:
            b_t = tl.load(t_in + tm_off)
            b_m = tl.load(m_in + tm_off)
        if SPLIT:
            b_t_lo = tl.load(t_in + C * C + tm_off)
            b_m_lo = tl.load(m_in + C * C + tm_off)
        elif not HALVES:
            b_t_lo, b_m_lo = b_t, b_m

        if HALVES:
            b_ks = tl.zeros([C, BV], dtype=tl.float32)
            for ih in range(0, 2):  # a loop, not two copies: one load and dot site for both halves
                b_ks = tl.dot(tl.load(k + qk_off + ih * BKA,
                                      mask=rmask[:, None] & (rk + ih * BKA < K)[None, :], other=0.0),
                              tl.where(ih == 0, b_s, b_s2), b_ks)
        else:
            b_s_hi, b_s_lo = _split_planes(b_s, b_k.dtype, SPLIT)   # once for both products
            b_ks = _dot_split(b_k, b_s_hi, b_s_lo, SPLIT)             # K S      [C, BV]
            if not STORE_STATES:
                b_qs = _dot_split(b_q, b_s_hi, b_s_lo, SPLIT)         # Q S      [C, BV]
        w_k = tl.exp(gam_end - gam)                              # row weights of the state update
        if USE_L2:
            rnq, rnk = load_row_norms(rn_in, j, hv, HV, C, USE_L2)
            b_ks = b_ks * rnk[:, None]
            if not STORE_STATES and not HALVES:
                b_qs = b_qs * rnq[:, None]
            w_k = w_k * rnk
        b_x = b_beta[:, None] * (b_v - eg[:, None] * b_ks)
        if HALVES:      # Tm and M loaded next to their dots
            b_vn = tl.dot(tl.load(t_in + tm_off), b_x)
        else:
            b_vn = _dot_pair(b_t, b_t_lo, b_x, SPLIT)            # Vnew     [C, BV]
        if STORE_STATES:
            tl.store(vnew_out + v_off, b_vn, mask=v_mask)
        else:
            if HALVES:      # Q S here, after Vnew, where fewer tiles are live
                b_qs = tl.zeros([C, BV], dtype=tl.float32)
                for ih in range(0, 2):
                    b_qs = tl.dot(tl.load(q + qk_off + ih * BKA,
                                          mask=rmask[:, None] & (rk + ih * BKA < K)[None, :], other=0.0),
                                  tl.where(ih == 0, b_s, b_s2), b_qs)
                if USE_L2:
                    b_qs = b_qs * rnq[:, None]
                b_o = tl.dot(tl.load(m_in + tm_off), b_vn, (scale * eg)[:, None] * b_qs)
            else:
                b_o = (scale * eg)[:, None] * b_qs + _dot_pair(b_m, b_m_lo, b_vn, SPLIT)
            tl.store(o + v_off, b_o.to(o.dtype.element_ty), mask=v_mask)
        if HALVES:
            # K^T read again, transposed by the pointer order (an L1/L2 hit), instead of keeping the
            # K tiles live through the chunk and transposing them in registers
            kt_off = rows[None, :] * (H * K) + h * K
            b_u = b_vn * w_k[:, None]
            b_kt = tl.load(k + kt_off + rk[:, None], mask=kmask[:, None] & rmask[None, :], other=0.0)
            b_s = tl.dot(b_kt, b_u, b_s * tl.exp(gam_end))
            b_kt2 = tl.load(k + kt_off + rk2[:, None], mask=kmask2[:, None] & rmask[None, :], other=0.0)
            b_s2 = tl.dot(b_kt2, b_u, b_s2 * tl.exp(gam_end))
        else:
            b_s = b_s * tl.exp(gam_end) + _dot_state(tl.trans(b_k), b_vn * w_k[:, None], SPLIT)
    if not STORE_STATES:
        tl.store(ht + s_off, b_s, mask=smask)
        if HALVES:
            tl.store(ht + s_off2, b_s2, mask=smask2)
        a, b = padding_after(table, cu_chunks, n, N, T_rows)
        _zero_rows(o, a, b, hv, cv, vmask, HV, V, BV, C)
        if n == 0:
            first = padding_before_first(table, cu_chunks, N, T_rows)
            _zero_rows(o, first * 0, first, hv, cv, vmask, HV, V, BV, C)


# ---- the former launchers, used by the legacy backward (chunk_bwd.py) ----
CHUNK = 64

_SMEM_KB = {9: 227, 8: 163}


def _pow2(x):
    return triton.next_power_of_2(x)


def _smem_kb(device):
    if device.type != "cuda":
        return _SMEM_KB[9]
    major, minor = torch.cuda.get_device_capability(device)
    return 227 if major >= 9 else 163 if (major, minor) in ((8, 0), (8, 6), (8, 7), (8, 9)) else 99


def split_planes(dtype):
    """Whether Tm, M and the state enter the bf16/fp16 tensor-core dots as hi + lo pairs."""
    return dtype != torch.float32


def prep_config(K, dtype):
    return dict(BK=16, SPLIT=split_planes(dtype), num_warps=4, num_stages=2)


def state_config(K, V, dtype, smem_kb=227):
    BK = _pow2(K)
    esize = torch.finfo(dtype).bits // 8
    small_v = V % 32 != 0 or K > 128 or (esize == 4 and K > 64)
    BV = 16 if small_v else 32
    C = CHUNK
    # one pipeline stage holds q, k [C, BK], v [C, BV] in the input dtype and Tm, M [C, C] (4 B)
    stage_kb = (2 * C * BK * esize + C * BV * esize + 2 * C * C * 4) / 1024
    return dict(BK=BK, BV=BV, SPLIT=split_planes(dtype),
                num_warps=8 if K > 128 else 4,
                num_stages=2 if 2 * stage_kb + 16 <= smem_kb else 1)


def chunk_prep(q, k, g, beta, table, HV, scale, use_l2norm):
    """Launches chunk_prep_kernel (grid (NC, HV)) and returns (Tm, M, rn), the per-chunk inputs of the
    state passes of the forward and the backward:
    Tm, M [NC, HV, P, C, C]: P = 1 plane of fp32 (fp32 inputs) or 2 planes hi, lo of the input dtype;
    rn [NC, HV, 2, C] fp32, the l2norm row factors of q and k (with use_l2norm; else a stand-in that
    no kernel reads)."""
    NC, (_, H, K) = table.shape[0], q.shape
    C = CHUNK
    p = prep_config(K, q.dtype)
    t_mat = torch.empty(NC, HV, 1 + p["SPLIT"], C, C, device=q.device,
                        dtype=q.dtype if p["SPLIT"] else torch.float32)
    m_mat = torch.empty_like(t_mat)
    l2 = bool(use_l2norm)
    rnorm = torch.empty(NC, HV, 2, C, dtype=torch.float32, device=q.device) if l2 else t_mat
    if NC > 0 and HV > 0:
        chunk_prep_kernel[(NC, HV)](q, k, g, beta, table, t_mat, m_mat, rnorm, scale, H=H, HV=HV, K=K,
                                    C=C, USE_L2=l2, **p)
    return t_mat, m_mat, rnorm


def chunk_state_pass(q, k, v, g, beta, table, cu_chunks, prep, h0, scale, use_l2norm, o=None, ht=None,
                     s_out=None, vnew_out=None):
    """Launches chunk_state_output_kernel, grid (N, HV, cdiv(V, BV)), on chunk_prep's outputs `prep`.
    Forward: writes o [T, HV, V] (every row) and ht [N, HV, K, V]. With s_out [NC, HV, K, V] and
    vnew_out [T, HV, V] (fp32; the backward's recompute) it writes those instead, and neither o nor ht."""
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    N = cu_chunks.numel() - 1
    store = s_out is not None
    s = state_config(K, V, q.dtype, _smem_kb(q.device))
    t_mat, m_mat, rnorm = prep
    unused = s_out if store else ht            # stand-in for the pointers this variant does not touch
    chunk_state_output_kernel[(N, HV, triton.cdiv(V, s["BV"]))](
        q, k, v, g, beta, table, cu_chunks, t_mat, m_mat, rnorm, unused if h0 is None else h0,
        unused if o is None else o, unused if ht is None else ht, unused if s_out is None else s_out,
        unused if vnew_out is None else vnew_out, scale, T,
        H=H, HV=HV, K=K, V=V, BK=s["BK"], BV=s["BV"], C=CHUNK, USE_L2=bool(use_l2norm),
        HAS_H0=h0 is not None, SPLIT=s["SPLIT"], STORE_STATES=store, num_warps=s["num_warps"],
        num_stages=s["num_stages"])


