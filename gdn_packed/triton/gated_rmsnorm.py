"""Gated RMSNorm, fused Triton kernels (forward and backward).

    y = x * rstd * w * silu(z),   rstd = 1 / sqrt(mean(x^2) + eps)   over the last dim (N)

w is the weight, or 1 + weight when ZERO_CENTERED (a zero-centred weight; 1 + weight in float32).

Inputs are contiguous rows: x, z, dy [M, N] (fp32/bf16/fp16), w [N], and with HAS_REAL the token mask
real [T] (bool; False on padding tokens, gdn_packed.segments.real_rows: the one representation of the
packed layout every op takes), M = T * R: row m belongs to token m // R (R = rows_per_token, the
heads). All arithmetic is float32; only the loads and the final stores of y, dx, dz convert dtype (so
bf16 is also right under the Triton interpreter, which only gets bf16 casts right). Padding rows are excluded by masked loads (other=0) and tl.where, never by a 0 factor:
y, dx, dz are 0 there, rstd is stored as 0 and they add nothing to the weight gradient.

Forward grid: (cdiv(M, BLOCK_M),); each program normalises BLOCK_M whole rows (BLOCK_N >= N) and
writes y [M, N] and rstd [M] float32.
Backward grid: (P,); program p owns the contiguous rows [p * rows_per_prog, (p + 1) * rows_per_prog),
walks them BLOCK_M at a time, writes dx and dz and its partial weight gradient dw_partial[p, :]
(float32). The caller sums dw_partial over p in a fixed order: deterministic, no atomics.
Names: `b_` block values, `p_` pointers, as in FLA.
"""
import torch
import triton
import triton.language as tl

from gdn_packed.triton.configs import rmsnorm_bwd_programs, rmsnorm_config


@triton.jit
def _real_rows(real, o_m, M, rows_per_token, HAS_REAL: tl.constexpr):
    """(in bounds, in bounds and not padding) masks of the rows o_m."""
    m_m = o_m < M
    if HAS_REAL:
        return m_m, m_m & (tl.load(real + o_m // rows_per_token, mask=m_m, other=0) != 0)
    return m_m, m_m


@triton.jit
def gated_rmsnorm_fwd_kernel(x, z, w, y, rstd, real, M, N, rows_per_token, eps, ZERO_CENTERED: tl.constexpr,
                             HAS_REAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    i_m = tl.program_id(0)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_n = tl.arange(0, BLOCK_N)
    m_m, m_r = _real_rows(real, o_m, M, rows_per_token, HAS_REAL)
    m_n = o_n < N
    mask = m_m[:, None] & m_n[None, :]
    m_load = m_r[:, None] & m_n[None, :]
    offs = o_m.to(tl.int64)[:, None] * N + o_n[None, :]
    b_x = tl.load(x + offs, mask=m_load, other=0.).to(tl.float32)
    b_z = tl.load(z + offs, mask=m_load, other=0.).to(tl.float32)
    b_w = tl.load(w + o_n, mask=m_n, other=0.).to(tl.float32)
    if ZERO_CENTERED:
        b_w += 1.
    b_r = tl.where(m_r, tl.rsqrt(tl.sum(b_x * b_x, 1) / N + eps), 0.)
    b_y = b_x * b_r[:, None] * b_w[None, :] * (b_z * tl.sigmoid(b_z))
    tl.store(y + offs, b_y.to(y.dtype.element_ty), mask=mask)
    tl.store(rstd + o_m, b_r, mask=m_m)


@triton.jit
def gated_rmsnorm_bwd_kernel(dy, x, z, w, rstd, real, dx, dz, dw_partial, M, N, rows_per_token, rows_per_prog,
                             ZERO_CENTERED: tl.constexpr, HAS_REAL: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr):
    i_p = tl.program_id(0)
    o_n = tl.arange(0, BLOCK_N)
    m_n = o_n < N
    b_w = tl.load(w + o_n, mask=m_n, other=0.).to(tl.float32)
    if ZERO_CENTERED:
        b_w += 1.
    b_dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    row0 = i_p * rows_per_prog
    for i in range(0, rows_per_prog, BLOCK_M):
        o_m = row0 + i + tl.arange(0, BLOCK_M)
        m_m, m_r = _real_rows(real, o_m, M, rows_per_token, HAS_REAL)
        mask = m_m[:, None] & m_n[None, :]
        m_load = m_r[:, None] & m_n[None, :]
        offs = o_m.to(tl.int64)[:, None] * N + o_n[None, :]
        b_x = tl.load(x + offs, mask=m_load, other=0.).to(tl.float32)
        b_z = tl.load(z + offs, mask=m_load, other=0.).to(tl.float32)
        b_dy = tl.load(dy + offs, mask=m_load, other=0.).to(tl.float32)
        b_r = tl.load(rstd + o_m, mask=m_r, other=0.)
        b_xhat = b_x * b_r[:, None]
        b_sig = tl.sigmoid(b_z)
        b_s = b_z * b_sig
        b_u = b_dy * b_w[None, :] * b_s
        b_c = tl.sum(b_u * b_xhat, 1) / N
        b_dx = b_r[:, None] * (b_u - b_xhat * b_c[:, None])
        b_dz = b_dy * b_xhat * b_w[None, :] * b_sig * (1 + b_z * (1 - b_sig))
        tl.store(dx + offs, b_dx.to(dx.dtype.element_ty), mask=mask)
        tl.store(dz + offs, b_dz.to(dz.dtype.element_ty), mask=mask)
        b_dw += tl.sum(b_dy * b_xhat * b_s, 0)
    tl.store(dw_partial + i_p * N + o_n, b_dw, mask=m_n)


def _rows_per_token(M, real):
    return 1 if real is None or real.numel() == 0 else M // real.numel()


def gated_rmsnorm_fwd_triton(x, z, weight, eps, zero_centered, y, rstd, real=None):
    """x, z, y [M, N] contiguous; weight [N]; rstd [M] float32; real [T] bool (M = T R: rows m of token
    m // R) or None (all rows)."""
    M, N = x.shape
    cfg = rmsnorm_config(N)
    gated_rmsnorm_fwd_kernel[(triton.cdiv(M, cfg["BLOCK_M"]),)](
        x=x, z=z, w=weight, y=y, rstd=rstd, real=real, M=M, N=N, rows_per_token=_rows_per_token(M, real),
        eps=eps, ZERO_CENTERED=zero_centered,
        HAS_REAL=real is not None, **cfg)


def gated_rmsnorm_bwd_triton(dy, x, z, weight, rstd, zero_centered, dx, dz, dweight, real=None):
    """Writes dx, dz [M, N] (contiguous) and dweight [N] (weight's dtype), deterministically."""
    M, N = x.shape
    cfg = rmsnorm_config(N)
    row_blocks = triton.cdiv(M, cfg["BLOCK_M"])
    P = rmsnorm_bwd_programs(x.device, row_blocks)
    dw_partial = torch.empty(P, N, dtype=torch.float32, device=x.device)
    gated_rmsnorm_bwd_kernel[(P,)](
        dy=dy, x=x, z=z, w=weight, rstd=rstd, real=real, dx=dx, dz=dz, dw_partial=dw_partial, M=M, N=N,
        rows_per_token=_rows_per_token(M, real), rows_per_prog=triton.cdiv(row_blocks, P) * cfg["BLOCK_M"],
        ZERO_CENTERED=zero_centered, HAS_REAL=real is not None, **cfg)
    dweight.copy_(dw_partial.sum(0))      # fixed-order sum over the P programs
