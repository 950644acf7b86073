"""Backward of the packed chunked gated delta rule: Triton kernels (docs/DESIGN.md section 2, "Backward, one
chunk"), over the chunk table of gdn_packed/torch_ref/chunk_table.py.

Per chunk (C rows), gamma = cumsum(g), eg = e^gamma, eGg = e^(Gamma - gamma), eG = e^Gamma,
E[r, s] = e^(gamma_r - gamma_s) (r >= s, else 0), M = (Q K^T) E, T = (I + A)^-1 from the forward:
    dVnew = scale M^T dO + diag(eGg) K dS_next
    dS    = eG dS_next + scale Q^T diag(eg) dO - W^T dVnew          (reverse over each sequence's chunks)
    dQ    = scale diag(eg) dO S^T + dP K,           dP = scale (dO Vnew^T) E
    dK    = dP^T Q + diag(eGg) Vnew dS_next^T + diag(beta eg) T^T dW' + (dKK + dKK^T) K
    dV    = diag(beta) T^T dVnew,   dW' = -dVnew S^T,  dA = strict_lower(-T^T dT T^T),  dKK = dA beta_r E
    dbeta, dgamma as in docs/DESIGN.md; dg = reverse cumsum of dgamma within the chunk.

Launches, in order (grids depend only on T, N and the shapes; unused chunk slots exit at once):
  chunk_prep (the forward's)    grid (NC, HV): Tm = (I + A)^-1, M = scale causal(QK^T) E, row norms.
  chunk_state_pass (the forward's chunk_state_output_kernel with STORE_STATES) grid (N, HV,
                               cdiv(V, BV)): per-chunk entering states S_in and Vnew, no o.
  chunk_bwd_dstate_kernel      grid (N, HV, cdiv(V, BV)): reverse pass: dS_next per chunk, dVnew, dh0
                               (dht passed through zero-length sequences) (chunk_bwd_state.py).
  chunk_bwd_dqk_kernel         grid (NC, HV, cdiv(K, BK)): loops over V-blocks; writes the per-value-head
                               dQ partial, the dP/dS part of dK, dW' and this K-block's share of dgamma.
  chunk_bwd_wy_kernel          grid (NC, HV): through the inverse: dV, dbeta, the WY part of dK (added
                               to the partial in place: one writer), dgamma, dg = reverse cumsum.
  chunk_bwd_qk_finalize_kernel grid (cdiv(T, BT), H): sums the dQ/dK partials over the G value heads of
                               a group in a fixed order, l2norm backward, writes dq, dk on every row
                               (0 on padding) and the zeros of dv, dg, dbeta on padding rows.
Deterministic by construction: no atomics, every scratch element has one writer, and the sums over
K-blocks (dgamma) and value heads (dq, dk) run in a fixed order in one program.

Layouts (row-major, contiguous): q, k [T, H, K]; v, do [T, HV, V]; g, beta [T, HV]; table int32 [NC, 4];
cu_chunks int32 [N+1]. Scratch (freed after the backward; per token and value head at K = V = 128,
bf16): Tm, M hi/lo planes [NC, HV, 2, C, C] 512 B; S_in, dS_next fp32 [NC, HV, K, V] 2 kB; Vnew,
dVnew fp32 [T, HV, V] 1 kB; dQ/dK partials and dW' fp32 [T, HV, K] 1.5 kB; dgamma partials [NK, T, HV].
Numerics: fp32 accumulation; gate sums, exponentials, states, Vnew, dVnew and all partials stay fp32.
Products with a state (S, dS_next) and with dO go through the forward's _dot_state, those with Tm / M
through _dot_pair (bf16/fp16: hi + lo split, ~fp32 exact; fp32 inputs: tf32 on the GPU); raw q, k enter
the dots and l2norm row factors scale fp32 results. Rounded to the input dtype: Vnew and dVnew as the
left operand of dO-free products, dP and dKK (C x C) before their products with q / k, and the outputs.
The C x C x C products of dA are fp32 (tf32x3) dots.
Names: `b_` block values, `p_`/`o_` pointers/offsets, `m_` masks, as in FLA.
"""
import torch
import triton
import triton.language as tl

from gdn_packed.triton.chunk_fwd_legacy import (CHUNK, chunk_prep, chunk_state_pass, split_planes,
                                     state_config)
from gdn_packed.triton.chunk_bwd_state import chunk_bwd_dstate_kernel, load_cc_planes
from gdn_packed.triton.chunk_fwd_legacy import _dot_pair, _dot_state, _mm_f32, _rows_tile, load_row_norms
from gdn_packed.triton.common import chunk_rows

@triton.jit
def _causal_decay(b_gam, C: tl.constexpr):
    """E [C, C]: exp(gamma_r - gamma_s) for r >= s, else 0 (only differences with r >= s are formed)."""
    o_c = tl.arange(0, C)
    causal = o_c[:, None] >= o_c[None, :]
    return tl.exp(tl.where(causal, b_gam[:, None] - b_gam[None, :], float("-inf")))


@triton.jit
def _chunk_gates(g, rows, m_c, i_h, HV, C: tl.constexpr):
    """gamma [C] (chunk-local cumsum of g, constant past the length), Gamma, and E [C, C]."""
    b_g = tl.load(g + rows * HV + i_h, mask=m_c, other=0.).to(tl.float32)
    b_gam = tl.cumsum(b_g, 0)
    return b_gam, tl.sum(b_g, 0), _causal_decay(b_gam, C)


@triton.jit
def chunk_bwd_dqk_kernel(q, k, g, do, vnew, dvn, s_in, dsn, rn_in, dq_part, dk_part, dwp, dgam_part,
                         table, scale, T, H, HV, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                         BK: tl.constexpr, BV: tl.constexpr, USE_L2: tl.constexpr,
                         SPLIT: tl.constexpr):
    j, i_h, i_kb = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    start, length = chunk_rows(table, j, C)
    if length == 0:
        return
    o_c = tl.arange(0, C)
    rows, m_c = start + o_c, o_c < length
    DT = q.dtype.element_ty
    i_qh = i_h // (HV // H)
    o_k = i_kb * BK + tl.arange(0, BK)

    # the V loop first, with only its four accumulators live (q, k, gates are loaded after it)
    b_dqS = tl.zeros([C, BK], dtype=tl.float32)     # dO S^T
    b_dkS = tl.zeros([C, BK], dtype=tl.float32)     # Vnew dS_next^T
    b_dw = tl.zeros([C, BK], dtype=tl.float32)      # dW' = -dVnew S^T
    b_dM = tl.zeros([C, C], dtype=tl.float32)       # dO Vnew^T
    b_sds = tl.zeros([BK], dtype=tl.float32)        # <S, dS_next> over this K-block
    p_st = (j * HV + i_h) * (K * V)
    for i_v in range(0, V, BV):
        o_v = i_v + tl.arange(0, BV)
        m_v = m_c[:, None] & (o_v < V)[None, :]
        p_v = rows[:, None] * (HV * V) + i_h * V + o_v[None, :]
        b_do = tl.load(do + p_v, mask=m_v, other=0.).to(DT)
        b_vn = tl.load(vnew + p_v, mask=m_v, other=0.)
        b_dvn = tl.load(dvn + p_v, mask=m_v, other=0.)
        m_s = (o_k < K)[:, None] & (o_v < V)[None, :]
        p_s = p_st + o_k[:, None] * V + o_v[None, :]
        b_St = tl.trans(tl.load(s_in + p_s, mask=m_s, other=0.).to(tl.float32))
        b_dSt = tl.trans(tl.load(dsn + p_s, mask=m_s, other=0.).to(tl.float32))
        b_dqS += _dot_state(b_do, b_St, SPLIT)
        b_dkS += _dot_state(b_vn.to(DT), b_dSt, SPLIT)
        b_dw -= _dot_state(b_dvn.to(DT), b_St, SPLIT)
        b_dM += _dot_state(b_do, tl.trans(b_vn), SPLIT)
        b_sds += tl.sum(tl.trans(b_St * b_dSt), 1)
    m_k = m_c[:, None] & (o_k < K)[None, :]
    p_o = rows[:, None] * (HV * K) + i_h * K + o_k[None, :]
    tl.store(dwp + p_o, b_dw, mask=m_k)

    b_gam, b_Gam, b_E = _chunk_gates(g, rows, m_c, i_h, HV, C)
    b_eg = tl.exp(b_gam)
    b_eGg = tl.exp(b_Gam - b_gam)
    b_rq, b_rk = load_row_norms(rn_in, j, i_h, HV, C, USE_L2)
    p_qk = rows[:, None] * (H * K) + i_qh * K + o_k[None, :]
    b_qr = tl.load(q + p_qk, mask=m_k, other=0.)                 # raw q, k: exact dot operands
    b_kr = tl.load(k + p_qk, mask=m_k, other=0.)
    b_dM = b_dM * scale
    b_dP = b_dM * b_E
    b_dq = scale * b_eg[:, None] * b_dqS + tl.dot((b_dP * b_rk[None, :]).to(DT), b_kr.to(DT))
    b_dk = tl.dot(tl.trans(b_dP * b_rq[:, None]).to(DT), b_qr.to(DT)) + b_eGg[:, None] * b_dkS
    tl.store(dq_part + p_o, b_dq, mask=m_k)
    tl.store(dk_part + p_o, b_dk, mask=m_k)

    # this K-block's share of dgamma (every term is linear in a sum over K)
    b_X = b_dM * tl.dot(b_qr.to(DT), tl.trans(b_kr.to(DT))) * b_rq[:, None] * b_rk[None, :] * b_E
    b_tau = b_eGg * b_rk * tl.sum(b_kr.to(tl.float32) * b_dkS, 1)
    b_dgam = (tl.sum(b_X, 1) - tl.sum(b_X, 0)
              + scale * b_eg * b_rq * tl.sum(b_qr.to(tl.float32) * b_dqS, 1) - b_tau)
    b_last = tl.sum(b_tau, 0) + tl.exp(b_Gam) * tl.sum(b_sds, 0)
    b_dgam += tl.where(o_c == length - 1, b_last, 0.)
    tl.store(dgam_part + (i_kb * T + rows) * HV + i_h, b_dgam, mask=m_c)


@triton.jit
def _dot_pair_right(a, b_hi, b_lo, SPLIT: tl.constexpr):
    """fp32 a @ (b_hi + b_lo): the mirror of _dot_pair (the stored pair on the right); fp32 inputs:
    one fp32 dot with tf32x3 (this product feeds dA, which every k, beta, g gradient reads)."""
    if SPLIT:
        a_hi = a.to(b_hi.dtype)
        acc = tl.dot(a_hi, b_hi)
        acc = tl.dot(a_hi, b_lo, acc)
        acc = tl.dot((a - a_hi.to(tl.float32)).to(b_hi.dtype), b_hi, acc)
    else:
        acc = _mm_f32(a, b_hi)
    return acc


@triton.jit
def chunk_bwd_wy_kernel(k, v, g, beta, tm, rn_in, dvn, dwp, dk_part, dgam_part, dv, dbeta, dg, table, T,
                        H, HV, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, NK: tl.constexpr,
                        BK: tl.constexpr, BV: tl.constexpr, USE_L2: tl.constexpr, SPLIT: tl.constexpr):
    j, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    start, length = chunk_rows(table, j, C)
    if length == 0:
        return
    o_c = tl.arange(0, C)
    rows, m_c = start + o_c, o_c < length
    DT = k.dtype.element_ty
    i_qh = i_h // (HV // H)
    b_beta = tl.load(beta + rows * HV + i_h, mask=m_c, other=0.).to(tl.float32)
    # T^T as a stored pair (hi, lo planes, or fp32 twice), only ever a dot operand
    b_Tt_hi, b_Tt_lo = load_cc_planes(tm, j, i_h, HV, SPLIT, C, True)

    # dT = dVnew Vb^T + dW' Kb^T, dV = diag(beta) T^T dVnew; the C x C tiles are built one at a time
    # (dT, then dA, then K K^T and E) so that no more than four are live
    b_dT = tl.zeros([C, C], dtype=tl.float32)
    b_db = tl.zeros([C], dtype=tl.float32)
    for i_v in range(0, V, BV):
        o_v = i_v + tl.arange(0, BV)
        m_v = m_c[:, None] & (o_v < V)[None, :]
        p_v = rows[:, None] * (HV * V) + i_h * V + o_v[None, :]
        b_dvn = tl.load(dvn + p_v, mask=m_v, other=0.)
        b_v = tl.load(v + p_v, mask=m_v, other=0.).to(tl.float32)
        b_tdu = _dot_pair(b_Tt_hi, b_Tt_lo, b_dvn, SPLIT)
        tl.store(dv + p_v, (b_beta[:, None] * b_tdu).to(dv.dtype.element_ty), mask=m_v)
        b_db += tl.sum(b_tdu * b_v, 1)
        b_dT += tl.dot(b_dvn.to(DT), tl.trans((b_v * b_beta[:, None]).to(DT)))

    b_g = tl.load(g + rows * HV + i_h, mask=m_c, other=0.).to(tl.float32)
    b_gam = tl.cumsum(b_g, 0)
    b_eg = tl.exp(b_gam)
    b_kb = b_beta * b_eg
    _, b_rk = load_row_norms(rn_in, j, i_h, HV, C, USE_L2)
    for i_k in range(0, K, BK):
        o_k = i_k + tl.arange(0, BK)
        b_kr = _rows_tile(k + i_qh * K, rows, m_c, H * K, o_k, o_k < K)
        b_dw = _rows_tile(dwp + i_h * K, rows, m_c, HV * K, o_k, o_k < K)
        b_dT += tl.dot(b_dw.to(DT), tl.trans((b_kr.to(tl.float32) * (b_rk * b_kb)[:, None]).to(DT)))

    # dA = strict_lower(-T^T dT T^T)
    b_dA = -_dot_pair_right(_dot_pair(b_Tt_hi, b_Tt_lo, b_dT, SPLIT), b_Tt_hi, b_Tt_lo, SPLIT)
    b_dA = tl.where(o_c[:, None] > o_c[None, :], b_dA, 0.)
    b_kk = tl.zeros([C, C], dtype=tl.float32)
    for i_k in range(0, K, BK):
        o_k = i_k + tl.arange(0, BK)
        b_kr = _rows_tile(k + i_qh * K, rows, m_c, H * K, o_k, o_k < K)
        b_kk += tl.dot(b_kr.to(DT), tl.trans(b_kr.to(DT)))
    b_E = _causal_decay(b_gam, C)
    b_dAE = b_dA * b_E
    b_kk = b_kk * b_rk[:, None] * b_rk[None, :]
    b_db += tl.sum(b_dAE * b_kk, 1)
    b_dKK = b_dAE * b_beta[:, None]
    b_X = b_dKK * b_kk
    b_dgam = tl.sum(b_X, 1) - tl.sum(b_X, 0)
    # (dKK + dKK^T) Kn with Kn = diag(rk) Kraw: rk scales the contraction index, folded in before rounding
    b_dKs = ((b_dKK + tl.trans(b_dKK)) * b_rk[None, :]).to(DT)
    for i_k in range(0, K, BK):
        o_k = i_k + tl.arange(0, BK)
        m_k = m_c[:, None] & (o_k < K)[None, :]
        b_kr = _rows_tile(k + i_qh * K, rows, m_c, H * K, o_k, o_k < K)
        p_o = rows[:, None] * (HV * K) + i_h * K + o_k[None, :]
        b_dw = tl.load(dwp + p_o, mask=m_k, other=0.)
        b_tdw = _dot_pair(b_Tt_hi, b_Tt_lo, b_dw, SPLIT)
        b_dk = tl.load(dk_part + p_o, mask=m_k, other=0.)
        b_dk += b_kb[:, None] * b_tdw + tl.dot(b_dKs, b_kr.to(DT))
        tl.store(dk_part + p_o, b_dk, mask=m_k)
        b_s = tl.sum(b_tdw * b_kr.to(tl.float32), 1) * b_rk
        b_db += b_eg * b_s
        b_dgam += b_kb * b_s
    for i_kb in range(0, NK):
        b_dgam += tl.load(dgam_part + (i_kb * T + rows) * HV + i_h, mask=m_c, other=0.)
    b_dg = tl.cumsum(b_dgam, 0, reverse=True)
    tl.store(dg + rows * HV + i_h, b_dg.to(dg.dtype.element_ty), mask=m_c)
    tl.store(dbeta + rows * HV + i_h, b_db.to(dbeta.dtype.element_ty), mask=m_c)


@triton.jit
def chunk_bwd_qk_finalize_kernel(q, k, dq_part, dk_part, real, dq, dk, dv, dg, dbeta, T, H, HV,
                                 K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                                 BKF: tl.constexpr, BVF: tl.constexpr, USE_L2: tl.constexpr):
    i_t, i_qh = tl.program_id(0), tl.program_id(1)
    G = HV // H
    rows = i_t.to(tl.int64) * BT + tl.arange(0, BT)
    m_t = rows < T
    m_r = (tl.load(real + rows, mask=m_t, other=0) != 0) & m_t
    o_k = tl.arange(0, BKF)
    m_k = m_r[:, None] & (o_k < K)[None, :]
    m_out = m_t[:, None] & (o_k < K)[None, :]
    p_in = rows[:, None] * (H * K) + i_qh * K + o_k[None, :]
    b_dq = tl.zeros([BT, BKF], dtype=tl.float32)
    b_dk = tl.zeros([BT, BKF], dtype=tl.float32)
    for i_g in range(0, G):
        p_p = rows[:, None] * (HV * K) + (i_qh * G + i_g) * K + o_k[None, :]
        b_dq += tl.load(dq_part + p_p, mask=m_k, other=0.)
        b_dk += tl.load(dk_part + p_p, mask=m_k, other=0.)
    if USE_L2:
        b_q = tl.load(q + p_in, mask=m_k, other=0.).to(tl.float32)
        b_r = tl.rsqrt(tl.sum(b_q * b_q, 1) + 1e-6)
        b_dq = b_r[:, None] * (b_dq - b_q * (b_r * b_r * tl.sum(b_dq * b_q, 1))[:, None])
        b_k = tl.load(k + p_in, mask=m_k, other=0.).to(tl.float32)
        b_r = tl.rsqrt(tl.sum(b_k * b_k, 1) + 1e-6)
        b_dk = b_r[:, None] * (b_dk - b_k * (b_r * b_r * tl.sum(b_dk * b_k, 1))[:, None])
    tl.store(dq + p_in, b_dq.to(dq.dtype.element_ty), mask=m_out)
    tl.store(dk + p_in, b_dk.to(dk.dtype.element_ty), mask=m_out)
    # padding rows of the per-v-head outputs (real rows are written by chunk_bwd_wy_kernel)
    m_p = m_t & ~m_r
    o_v = tl.arange(0, BVF)
    for i_g in range(0, G):
        i_h = i_qh * G + i_g
        tl.store(dv + rows[:, None] * (HV * V) + i_h * V + o_v[None, :],
                 tl.zeros([BT, BVF], dtype=tl.float32).to(dv.dtype.element_ty),
                 mask=m_p[:, None] & (o_v < V)[None, :])
        tl.store(dg + rows * HV + i_h, tl.zeros([BT], dtype=tl.float32).to(dg.dtype.element_ty), mask=m_p)
        tl.store(dbeta + rows * HV + i_h, tl.zeros([BT], dtype=tl.float32).to(dbeta.dtype.element_ty),
                 mask=m_p)




def bwd_configs(K, V, dtype):
    """Block sizes, warps and pipeline stages of every backward kernel: one config each, by this
    heuristic (no autotune), chosen from the sm_90 AOT reports (tests/test_triton_bwd_aot.py prints
    registers, shared memory and spills of each) so that none spills registers. C x C matrices
    (Tm, M) are read unmasked, transposed by pointer order, and q/k row norms come from the prep
    kernel, so dot operands go from memory to shared memory without register copies.
    (The recompute of S_in and Vnew is the forward's state pass, with the forward's state_config.)
    - dstate: the full-K state block [K, BV = 16] fp32 in registers (BV 16, the smallest wgmma N:
      dS, dO, the hi/lo dS copies and Vnew-sized temporaries scale with it). bf16/fp16: 8 warps,
      2 stages (K = V = 128: 148 registers, 142 KB; K = 256: 235 registers, 216 KB). fp32: tf32 wgmma
      needs K-major operands, so Q^T, K^T, M^T, Tm^T are register transposes; K <= 128: 4 warps and 2
      stages (K = 128: 254 registers, 8 warps spill 56 B; K = 32: 248, 8 warps spill 32 B); K > 128 cannot
      double-buffer within 227 KB: 8 warps, 1 stage, dS held as two K-halves (as in the forward's
      state pass; chunk_bwd_state.py), 252-254 registers, no spill (4 warps spill 72 B).
    - dqk: K-blocks of 64 (32 when V <= 16: at K = 256, V = 16 blocks of 64 spill 8 B in bf16 and
      368 B in fp32), V-blocks of 32, 8 warps, 2 stages: the V loop keeps four accumulators
      (dO S^T, Vnew dS^T, dVnew S^T [C, BK], dO Vnew^T [C, C]) and loads q, k, gates only after it.
    - wy: K- and V-blocks of 32, 8 warps; its C x C tiles (dT, dA, K K^T, E) are built one after
      another. bf16/fp16: 2 stages; fp32: 1 (2 stages spill 48 B).
    - finalize: row blocks of 2048 // K padded rows, 4 warps (no dots)."""
    np2 = triton.next_power_of_2
    st = state_config(K, V, dtype)
    fp32 = dtype == torch.float32
    BK = min(64, np2(K))
    return dict(
        dstate=dict(BK=st["BK"], BV=16, num_warps=4 if fp32 and K <= 128 else 8,
                    num_stages=1 if fp32 and K > 128 else 2),
        dqk=dict(BK=min(32, BK) if V <= 16 else BK, BV=min(32, np2(V)), num_warps=8, num_stages=2),
        wy=dict(BK=min(32, np2(K)), BV=min(32, np2(V)), num_warps=8, num_stages=1 if fp32 else 2),
        finalize=dict(BT=max(1, min(32, 2048 // np2(K))), BKF=np2(K), BVF=np2(V), num_warps=4,
                      num_stages=1),
    )


def real_row_mask(table, T, C):
    """int8 [T]: 1 on rows covered by a chunk (real tokens), 0 on padding. On the device, no host sync."""
    pos = torch.arange(C, device=table.device)
    rows = torch.where(pos[None, :] < table[:, 3:4], table[:, 2:3].long() + pos[None, :],
                       torch.full_like(pos, T)[None, :].expand(table.shape[0], C))
    mask = torch.zeros(T + 1, dtype=torch.int8, device=table.device)
    mask.index_fill_(0, rows.reshape(-1), 1)
    return mask[:T]


def chunk_gdr_bwd_triton(q, k, v, g, beta, table, cu_chunks, initial_state, scale, C, use_l2norm,
                         do, dht, dq, dk, dv, dg, dbeta, dh0):
    """Backward of backend="triton" on flattened rows (the signature of torch_ref.chunk's backward):
    writes every row of dq, dk [T, H, K], dv [T, HV, V], dg, dbeta [T, HV] and dh0 [N, HV, K, V] fp32.
    Launches: the forward's chunk_prep and state pass (S_in, Vnew), then the dstate, dqk, wy and finalize
    kernels; grids depend only on T, N and the shapes."""
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
    cfg = bwd_configs(K, V, q.dtype)
    l2 = bool(use_l2norm)
    f32 = dict(dtype=torch.float32, device=dev)
    state_dtype = torch.float32
    NK = triton.cdiv(K, cfg["dqk"]["BK"])     # dgamma partials: one per dqk K-block
    split = split_planes(q.dtype)
    s_in = torch.empty(NC, HV, K, V, dtype=state_dtype, device=dev)
    dsn = torch.empty(NC, HV, K, V, dtype=state_dtype, device=dev)
    vnew, dvn = torch.empty(T, HV, V, **f32), torch.empty(T, HV, V, **f32)
    dq_part, dk_part, dwp = (torch.empty(T, HV, K, **f32) for _ in range(3))
    dgam_part = torch.empty(NK, T, HV, **f32)
    # Tm, M (fp32, or hi + lo planes in the input dtype) and the l2norm row factors, as in the forward
    t_mat, m_mat, rnorm = prep = chunk_prep(q, k, g, beta, table, HV, scale, l2)
    if N > 0 and HV > 0:
        h0 = None if initial_state is None else initial_state.to(torch.float32).contiguous()
        chunk_state_pass(q, k, v, g, beta, table, cu_chunks, prep, h0, scale, l2, s_out=s_in,
                         vnew_out=vnew)
        c = cfg["dstate"]
        dht_ = None if dht is None else dht.to(torch.float32).contiguous()
        chunk_bwd_dstate_kernel[(N, HV, triton.cdiv(V, c["BV"]))](
            q, k, g, beta, do, table, cu_chunks, t_mat, m_mat, rnorm, dht_ if dht_ is not None else dh0,
            dsn,
            dvn, dh0, scale, H, HV, K=K, V=V, C=C, BK=c["BK"], BV=c["BV"], USE_L2=l2,
            HAS_DHT=dht_ is not None, SPLIT=split, num_warps=c["num_warps"], num_stages=c["num_stages"])
    if NC > 0 and HV > 0:
        c = cfg["dqk"]
        chunk_bwd_dqk_kernel[(NC, HV, NK)](
            q, k, g, do, vnew, dvn, s_in, dsn, rnorm, dq_part, dk_part, dwp, dgam_part, table, scale,
            T, H, HV, K=K, V=V, C=C, BK=c["BK"], BV=c["BV"], USE_L2=l2, SPLIT=split,
            num_warps=c["num_warps"], num_stages=c["num_stages"])
        c = cfg["wy"]
        chunk_bwd_wy_kernel[(NC, HV)](
            k, v, g, beta, t_mat, rnorm, dvn, dwp, dk_part, dgam_part, work[2], work[4], work[3], table,
            T, H, HV, K=K, V=V, C=C, NK=NK, BK=c["BK"], BV=c["BV"], USE_L2=l2, SPLIT=split,
            num_warps=c["num_warps"], num_stages=c["num_stages"])
    if T > 0 and H > 0:
        c = cfg["finalize"]
        chunk_bwd_qk_finalize_kernel[(triton.cdiv(T, c["BT"]), H)](
            q, k, dq_part, dk_part, real_row_mask(table, T, C), work[0], work[1], work[2], work[3],
            work[4], T, H, HV, K=K, V=V, BT=c["BT"], BKF=c["BKF"], BVF=c["BVF"], USE_L2=l2,
            num_warps=c["num_warps"], num_stages=c["num_stages"])
    for x, y in zip(outs, work):
        if x is not y:
            x.copy_(y)
