"""The gating of Qwen3-Next / Megatron for the chunked gated delta rule, from raw inputs (docs/DESIGN.md
section 2, "Gating used by the layers"), in float32:

    g = -exp(A_log[h]) softplus(a + dt_bias[h]),   beta = sigmoid(b)
    da = dg * -exp(A_log[h]) sigmoid(a + dt_bias[h]),   db = dbeta beta (1 - beta)
    dA_log[h] = sum_t dg g,   ddt_bias[h] = sum_t da

  chunk_gate_fwd_kernel  grid (cdiv(T, BT),): rows [p BT, (p + 1) BT) x all HV heads.
      in  a, b [T, HV] (any float dtype), A_log, dt_bias [HV];  out g, beta [T, HV] float32
  chunk_gate_bwd_kernel  grid (cdiv(T, BT),): the same rows.
      in  a, b, A_log, dt_bias, dg, dbeta [T, HV] float32
      out da, db [T, HV] (a's / b's dtype), and per program the partial sums dA_log_part,
          ddt_bias_part [P, HV] float32, which the launcher sums over P in a fixed order
          (deterministic: no atomics).
Rows are independent, so padding rows need no special case: their dg, dbeta are 0 (the chunked
backward writes 0 there), hence so are da, db and their share of the sums.

Why a pass of its own and not the prologue of each chunked kernel (five kernels read g and beta,
some once per V-block, so each would recompute the exp/log per read): bytes and simplicity. This
pass reads a, b and writes g, beta as float32 (8 B per token and value head; the backward reads
four and writes two such arrays), ~1-2% of the chunked kernels' ~1.9 kB per token and value head
at K = V = 128, and the chunked kernels read g and beta in float32 from it, so beta is never rounded
to bf16. softplus(x) = max(x, 0) + log1p(exp(-|x|)), with log1p(y) = log(1 + y) y / ((1 + y) - 1)
(exact to a few ulp in float32 without a libdevice call). All arithmetic is float32; only the loads
and the stores of da, db convert dtype (so bf16 is right under the Triton interpreter too).
"""
import torch
import triton
import triton.language as tl

from gdn_packed.triton.configs import gate_config


@triton.jit
def _softplus_sigmoid(x):
    """(softplus(x), sigmoid(x)) in float32, stable for any x."""
    y = tl.exp(-tl.abs(x))
    u = 1.0 + y
    log1p_y = tl.where(u == 1.0, y, tl.log(u) * y / (u - 1.0))
    sig = tl.where(x >= 0, 1.0 / u, y / u)
    return tl.maximum(x, 0.0) + log1p_y, sig


@triton.jit
def _gate_tile(a, b, A_log, dt_bias, p, T, HV, BT: tl.constexpr, BH: tl.constexpr):
    rows = p.to(tl.int64) * BT + tl.arange(0, BT)
    heads = tl.arange(0, BH)
    m_h = heads < HV
    mask = (rows < T)[:, None] & m_h[None, :]
    off = rows[:, None] * HV + heads[None, :]
    b_a = tl.load(a + off, mask=mask, other=0.).to(tl.float32)
    b_b = tl.load(b + off, mask=mask, other=0.).to(tl.float32)
    b_decay = tl.exp(tl.load(A_log + heads, mask=m_h, other=0.).to(tl.float32))
    b_x = b_a + tl.load(dt_bias + heads, mask=m_h, other=0.).to(tl.float32)[None, :]
    return off, mask, b_x, b_b, b_decay


@triton.jit
def chunk_gate_fwd_kernel(a, b, A_log, dt_bias, g, beta, T, HV, BT: tl.constexpr, BH: tl.constexpr):
    off, mask, b_x, b_b, b_decay = _gate_tile(a, b, A_log, dt_bias, tl.program_id(0), T, HV, BT, BH)
    sp, _ = _softplus_sigmoid(b_x)
    _, b_beta = _softplus_sigmoid(b_b)
    tl.store(g + off, -b_decay[None, :] * sp, mask=mask)
    tl.store(beta + off, b_beta, mask=mask)


@triton.jit
def chunk_gate_bwd_kernel(a, b, A_log, dt_bias, dg, dbeta, da, db, dA_log_part, ddt_bias_part, T, HV,
                          BT: tl.constexpr, BH: tl.constexpr):
    p = tl.program_id(0)
    off, mask, b_x, b_b, b_decay = _gate_tile(a, b, A_log, dt_bias, p, T, HV, BT, BH)
    sp, sig = _softplus_sigmoid(b_x)
    _, b_beta = _softplus_sigmoid(b_b)
    b_dg = tl.load(dg + off, mask=mask, other=0.).to(tl.float32)
    b_dbeta = tl.load(dbeta + off, mask=mask, other=0.).to(tl.float32)
    b_da = -b_decay[None, :] * sig * b_dg
    tl.store(da + off, b_da.to(da.dtype.element_ty), mask=mask)
    tl.store(db + off, (b_dbeta * b_beta * (1.0 - b_beta)).to(db.dtype.element_ty), mask=mask)
    heads = tl.arange(0, BH)
    tl.store(dA_log_part + p * HV + heads, tl.sum(-b_decay[None, :] * sp * b_dg, 0), mask=heads < HV)
    tl.store(ddt_bias_part + p * HV + heads, tl.sum(b_da, 0), mask=heads < HV)


def gate_fwd_triton(a, b, A_log, dt_bias):
    """a, b [T, HV] -> g, beta [T, HV] float32 (the signature of torch_ref.chunk.gate_fwd_torch)."""
    T, HV = a.shape
    a, b, A_log, dt_bias = (x.contiguous() for x in (a, b, A_log, dt_bias))
    g = torch.empty(T, HV, dtype=torch.float32, device=a.device)
    beta = torch.empty_like(g)
    c = gate_config(HV)
    if T > 0 and HV > 0:
        chunk_gate_fwd_kernel[(triton.cdiv(T, c["BT"]),)](
            a=a, b=b, A_log=A_log, dt_bias=dt_bias, g=g, beta=beta, T=T, HV=HV, **c)
    return g, beta


def gate_bwd_triton(a, b, A_log, dt_bias, dg, dbeta):
    """Returns float32 da, db [T, HV] and dA_log, ddt_bias [HV] (see chunk_gate_bwd_kernel)."""
    T, HV = a.shape
    a, b, A_log, dt_bias, dg, dbeta = (x.contiguous() for x in (a, b, A_log, dt_bias, dg, dbeta))
    c = gate_config(HV)
    P = triton.cdiv(T, c["BT"])
    f32 = dict(dtype=torch.float32, device=a.device)
    da, db = torch.empty(T, HV, **f32), torch.empty(T, HV, **f32)
    parts = torch.zeros(2, P, HV, **f32)
    if T > 0 and HV > 0:
        chunk_gate_bwd_kernel[(P,)](
            a=a, b=b, A_log=A_log, dt_bias=dt_bias, dg=dg, dbeta=dbeta, da=da, db=db, dA_log_part=parts[0],
            ddt_bias_part=parts[1], T=T, HV=HV, **c)
    return da, db, parts[0].sum(0), parts[1].sum(0)      # fixed-order sums over the P programs
