"""The chunked gated delta rule in vectorised PyTorch: the CPU path and the readable statement of the
algorithm that the Triton and CUDA kernels are checked against (docs/DESIGN.md section 2).

Layout. Inputs are flattened packed rows: q, k [T, H, K]; v [T, HV, V]; g, beta [T, HV];
initial_state [N, HV, K, V]; the chunk table (gdn_packed.ops.chunk_table) says which rows form each
chunk. Every chunk is gathered into a [H, G, NC, C, *] block (G = HV // H value heads per qk-head, so
GVA is a broadcast over the G axis, never a copy of q/k). Rows of a chunk past its length are zeros
with g = beta = 0: such a row leaves the state untouched and receives no gradient. They are zeroed by
selection, never by multiplying with a 0/1 mask, so NaN/Inf in another document's rows or in padding
cannot leak in (NaN * 0 = NaN).

Per chunk, with gamma = cumsum(g), E[r, s] = exp(gamma_r - gamma_s) for r >= s (else 0):
    A = strict_lower(beta_r (K K^T) E),  T = (I + A)^-1
    W = T diag(beta e^gamma) K,  U = T diag(beta) V
    Vnew = U - W S,  O = scale (diag(e^gamma) Q S + ((Q K^T) E) Vnew)
    S_next = e^Gamma S + (diag(e^(Gamma - gamma)) K)^T Vnew
Only the state pass is sequential: it loops over the chunk index within a sequence, batched over all
sequences and heads. The backward is the analytic chunked backward of docs/DESIGN.md section 2 (a reverse
state pass for dS, then every per-chunk gradient batched), not autograd of the forward graph.

Gates: g = -inf is a hard reset (decay factor 0) and very negative g (-1e30, or -3e38 twice, whose
sum overflows fp32 to -inf) is exact too: every exponent is exp of a sum of g over a segment
(-inf at worst, giving 0), never a difference of two cumulative sums (-inf - -inf = NaN).

Numerics: everything is computed in float32 (float64 for float64 inputs); o is rounded to v's dtype
at the end, states are float32.

Loop bound: on CUDA tensors the state pass runs the static bound ceil(T / C) steps (no host sync);
on CPU tensors there is no device to synchronise with, so it reads the longest sequence's chunk count.
"""
from dataclasses import dataclass

import torch

from gdn_packed.torch_ref.naive import l2norm


def compute_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _l2norm_bwd(x, dy, eps: float = 1e-6):
    """Gradient of y = x / sqrt(|x|^2 + eps) given dy."""
    inv = torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)
    y = x * inv
    return inv * (dy - y * (dy * x).sum(-1, keepdim=True) * inv)


class Chunks:
    """Row indices of every chunk, and the gather/scatter between packed rows and chunk blocks.

    rows [NC, C]: the packed row of each chunk row (clamped into range; `mask` says which are real).
    Blocks are [H, G, NC, C, *]: qk-head, value head within the group, chunk, row, feature; the
    batch dims lead so every matmul below runs on contiguous [C, *] tiles.
    """

    def __init__(self, table, T, C):
        pos = torch.arange(C, device=table.device)
        self.mask = pos[None, :] < table[:, 3:4].long()
        rows = table[:, 2:3].long() + pos[None, :]
        self.rows = torch.where(self.mask, rows, torch.full_like(rows, T))   # T: "no row"
        self.safe_rows = self.rows.clamp_max(max(T - 1, 0)).reshape(-1)
        self.table, self.T, self.C, self.NC = table, T, C, table.shape[0]

    def gather(self, x, H, dt):
        """x [T, H*G, *f] (or [T, H, *f] with G = 1) -> [H, G, NC, C, *f] in dtype dt, 0 past the length."""
        f, G = x.shape[2:], x.shape[1] // H
        if self.T == 0 or self.NC == 0:
            return x.new_zeros(H, G, self.NC, self.C, *f, dtype=dt)
        src = x.reshape(self.T, H, G, *f).movedim(0, 2)                      # [H, G, T, *f] (a view)
        b = src.index_select(2, self.safe_rows).to(dt).view(H, G, self.NC, self.C, *f)
        # by selection, not by a multiply: a clamped row may hold NaN/Inf (NaN * 0 = NaN)
        return b.masked_fill_(~self.mask.view(self.NC, self.C, *(1,) * len(f)), 0)

    def scatter(self, vals, out):
        """vals [H, G, NC, C, *f] -> out [T, H*G, *f]. Every row of `out` is written: chunk rows in
        place, all other rows (padding) with exact zeros, whatever `out` held before."""
        H, G, NC, C = vals.shape[:4]
        f = vals.shape[4:]
        buf = torch.zeros(H, G, self.T + 1, *f, dtype=out.dtype, device=out.device)
        buf.index_copy_(2, self.rows.reshape(-1), vals.reshape(H, G, NC * C, *f).to(out.dtype))
        out.view(self.T, H, G, *f).copy_(buf[:, :, : self.T].movedim(2, 0))


class SlotOrder:
    """Where sequences start and end along the chunk slots, for the state passes.

    The state pass walks the NC chunk slots in order: a static count (no host sync) and no step spent
    on a sequence that has ended. Slot j restarts the state from its sequence's initial state when it
    is the sequence's first chunk (`first`), and stores the state it leaves when it is the last
    (`last`). Index N is a scratch row: slots past the real chunks read and write it and hold zeros,
    so they leave the state untouched."""

    def __init__(self, table, cu_chunks):
        N, NC = cu_chunks.numel() - 1, table.shape[0]
        seq = table[:, 0].long()
        valid = seq >= 0
        self.seq = torch.where(valid, seq, torch.full_like(seq, N))
        last_slot = torch.cat([cu_chunks[1:].long() - 1, cu_chunks.new_full((1,), -1).long()])
        is_last = valid & (last_slot.index_select(0, self.seq) == torch.arange(NC, device=seq.device))
        self.first = torch.where(valid & (table[:, 1] == 0), self.seq, torch.full_like(seq, N))
        self.last = torch.where(is_last, self.seq, torch.full_like(seq, N))
        self.is_first, self.is_last = valid & (table[:, 1] == 0), is_last


def with_scratch(x):
    """x [N, ...] -> [N + 1, ...] with a zero scratch row at index N."""
    return torch.cat([x, x.new_zeros(1, *x.shape[1:])])


@dataclass
class Forward:
    """Per-chunk quantities of the forward, kept for the output and recomputed by the backward."""
    q: torch.Tensor         # [H, 1, NC, C, K] (after l2norm when asked)
    k: torch.Tensor         # [H, 1, NC, C, K]
    v: torch.Tensor         # [H, G, NC, C, V]
    beta: torch.Tensor      # [H, G, NC, C]
    E: torch.Tensor         # [H, G, NC, C, C]   exp(gamma_r - gamma_s), r >= s
    Tinv: torch.Tensor      # [H, G, NC, C, C]   (I + A)^-1
    W: torch.Tensor         # [H, G, NC, C, K]
    eg: torch.Tensor        # [H, G, NC, C]      exp(gamma)
    eGg: torch.Tensor       # [H, G, NC, C]      exp(Gamma - gamma)
    eG: torch.Tensor        # [H, G, NC]         exp(Gamma)
    M: torch.Tensor         # [H, G, NC, C, C]   (Q K^T) * E
    S_in: torch.Tensor      # [H, G, NC, K, V]   state entering each chunk
    Vnew: torch.Tensor      # [H, G, NC, C, V]
    S_final: torch.Tensor   # [N, H, G, K, V]


def chunk_forward(ch, q, k, v, g, beta, cu_chunks, initial_state, use_l2norm):
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    G, N, NC, C = HV // H, cu_chunks.numel() - 1, ch.NC, ch.C
    dt = compute_dtype(q.dtype)
    qc, kc = ch.gather(q, H, dt), ch.gather(k, H, dt)
    if use_l2norm:
        qc, kc = l2norm(qc), l2norm(kc)
    vc = ch.gather(v, H, dt)
    gc, bc = ch.gather(g, H, dt), ch.gather(beta, H, dt)

    # Gate sums in fp32 without forming gamma_r - gamma_s from two long cumulative sums (with fast
    # decay gamma reaches -1e3 within a chunk and that difference would lose ~1e-4 of the exponent):
    # seg[r, s] = sum_{s < t <= r} g_t is summed directly, and so is Gamma - gamma_r = seg[C-1, r].
    gamma = gc.cumsum(-1)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    # (selected, not multiplied by a 0/1 mask: g = -inf, a hard reset, must give seg = -inf, not NaN)
    seg = torch.where(causal.T, 0.0, gc[..., :, None].expand(*gc.shape, C)).cumsum(-2)
    E = torch.exp(seg.masked_fill(~causal, float("-inf")))
    A = (bc[..., :, None] * (kc @ kc.transpose(-1, -2)) * E).tril(-1)
    eye = torch.eye(C, dtype=dt, device=q.device)
    Tinv = torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False, unitriangular=True)
    eg = torch.exp(gamma)
    W = Tinv @ ((bc * eg)[..., None] * kc)
    U = Tinv @ (bc[..., None] * vc)
    M = (qc @ kc.transpose(-1, -2)) * E
    Gamma = gamma[..., -1]
    eG = torch.exp(Gamma)
    eGg = torch.exp(seg[..., -1, :])
    Kd = eGg[..., None] * kc

    S0 = with_scratch(torch.zeros(N, H, G, K, V, dtype=dt, device=q.device) if initial_state is None
                      else initial_state.to(dt).reshape(N, H, G, K, V))
    final = S0.clone()                                         # zero-length sequences keep S0
    S_in, Vnew = S0.new_empty(H, G, NC, K, V), torch.empty_like(U)
    so = SlotOrder(ch.table, cu_chunks)
    S = S0[N]
    for j in range(NC):
        S = torch.where(so.is_first[j:j + 1], S0.index_select(0, so.first[j:j + 1])[0], S)
        S_in[:, :, j] = S
        Vnew[:, :, j] = U[:, :, j] - W[:, :, j] @ S
        S = eG[:, :, j, None, None] * S + Kd[:, :, j].transpose(-1, -2) @ Vnew[:, :, j]
        final.index_copy_(0, so.last[j:j + 1], S[None])
    return Forward(qc, kc, vc, bc, E, Tinv, W, eg, eGg, eG, M, S_in, Vnew, final[:N])


def chunk_gdr_fwd_torch(q, k, v, g, beta, table, cu_chunks, initial_state, scale, C, use_l2norm,
                        o, final_state):
    """Writes o [T, HV, V] (every row) and final_state [N, HV, K, V] float32."""
    ch = Chunks(table, q.shape[0], C)
    f = chunk_forward(ch, q, k, v, g, beta, cu_chunks, initial_state, use_l2norm)
    O = scale * (f.eg[..., None] * (f.q @ f.S_in) + f.M @ f.Vnew)
    ch.scatter(O, o)
    final_state.copy_(f.S_final.reshape(final_state.shape))


def chunk_gdr_bwd_torch(q, k, v, g, beta, table, cu_chunks, initial_state, scale, C, use_l2norm,
                        do, dht, dq, dk, dv, dg, dbeta, dh0):
    """Writes dq, dk [T, H, K], dv [T, HV, V], dg, dbeta [T, HV] (every row) and dh0 [N, HV, K, V]."""
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    G, N = HV // H, cu_chunks.numel() - 1
    ch = Chunks(table, T, C)
    f = chunk_forward(ch, q, k, v, g, beta, cu_chunks, initial_state, use_l2norm)
    dt = f.q.dtype
    NC = ch.NC
    dO = ch.gather(do, H, dt)

    # reverse state pass: dS_next of every chunk, then dh0 of every sequence
    dVnew = scale * f.M.transpose(-1, -2) @ dO                 # the part of dVnew without dS_next
    dS_loc = scale * f.q.transpose(-1, -2) @ (f.eg[..., None] * dO)
    Kd = f.eGg[..., None] * f.k
    dST = with_scratch(torch.zeros(N, H, G, K, V, dtype=dt, device=q.device) if dht is None
                       else dht.to(dt).reshape(N, H, G, K, V))
    dS0 = dST.clone()                                          # zero-length sequences: dh0 = dht
    dSn = torch.empty_like(f.S_in)
    so = SlotOrder(table, cu_chunks)
    dS = dST[N]
    for j in reversed(range(NC)):
        dS = torch.where(so.is_last[j:j + 1], dST.index_select(0, so.last[j:j + 1])[0], dS)
        dSn[:, :, j] = dS
        dvn = dVnew[:, :, j] + Kd[:, :, j] @ dS
        dS = f.eG[:, :, j, None, None] * dS + dS_loc[:, :, j] - f.W[:, :, j].transpose(-1, -2) @ dvn
        dS0.index_copy_(0, so.first[j:j + 1], dS[None])
    dh0.copy_(dS0[:N].reshape(dh0.shape))

    # every per-chunk gradient, batched over chunks and heads
    S, Vn, E, Tinv, eg = f.S_in, f.Vnew, f.E, f.Tinv, f.eg
    qc, kc, vc, bc = f.q, f.k, f.v, f.beta
    tr = lambda x: x.transpose(-1, -2)  # noqa: E731
    dVnew = dVnew + Kd @ dSn
    dWp = -dVnew @ tr(S)
    dM = scale * dO @ tr(Vn)
    dP = dM * E
    QK, KK = qc @ tr(kc), kc @ tr(kc)
    TdW, TdU = tr(Tinv) @ dWp, tr(Tinv) @ dVnew
    Kb, Vb = (bc * eg)[..., None] * kc, bc[..., None] * vc
    dT = dWp @ tr(Kb) + dVnew @ tr(Vb)
    dA = -(tr(Tinv) @ dT @ tr(Tinv)).tril(-1)
    dKK = dA * bc[..., :, None] * E
    VdS = Vn @ tr(dSn)                                          # row r: dS_next Vnew_r

    dQ = scale * eg[..., None] * (dO @ tr(S)) + dP @ kc
    dK = (tr(dP) @ qc + f.eGg[..., None] * VdS + (bc * eg)[..., None] * TdW
          + (dKK + tr(dKK)) @ kc)
    dV = bc[..., None] * TdU
    dB = eg * (TdW * kc).sum(-1) + (TdU * vc).sum(-1) + (dA * KK * E).sum(-1)
    # dg_r = sum_{t >= r} dgamma_t (docs/DESIGN.md section 2), summed so that no large terms cancel:
    #   sum_{t >= r} (rowsum X - colsum X)_t  =  sum_{t >= r, s < r} X[t, s]
    #   sum_{t >= r} (-tau_t) + sum_t tau_t   =  sum_{t < r} tau_t
    # (with fast decay the first forms lose ~1e-5 in fp32 to cancellation, these do not)
    X = (dM * QK + dA * bc[..., :, None] * KK) * E
    tau = f.eGg * (kc * VdS).sum(-1)
    local = eg * ((dO * (scale * qc @ S)).sum(-1) + (TdW * bc[..., None] * kc).sum(-1))
    X_below = X.flip(-2).cumsum(-2).flip(-2)                    # [r, s] = sum_{t >= r} X[t, s]
    strict = torch.ones(ch.C, ch.C, dtype=torch.bool, device=q.device).tril(-1)
    dG = (local.flip(-1).cumsum(-1).flip(-1) + (X_below * strict).sum(-1)
          + torch.nn.functional.pad(tau.cumsum(-1)[..., :-1], (1, 0))
          + (f.eG * (S * dSn).sum((-2, -1)))[..., None])

    dQ, dK = dQ.sum(1, keepdim=True), dK.sum(1, keepdim=True)  # GVA: sum over the value heads
    if use_l2norm:
        dQ = _l2norm_bwd(ch.gather(q, H, dt), dQ)
        dK = _l2norm_bwd(ch.gather(k, H, dt), dK)
    for vals, out in ((dQ, dq), (dK, dk), (dV, dv), (dG, dg), (dB, dbeta)):
        ch.scatter(vals, out)


def gate_fwd_torch(a, b, A_log, dt_bias):
    """The gating of Qwen3-Next / Megatron from raw rows, in float32 (float64 for float64 inputs):
    g = -exp(A_log[h]) softplus(a + dt_bias[h]),  beta = sigmoid(b).  a, b [T, HV]; A_log, dt_bias [HV].
    Returns (g, beta) [T, HV]: these feed the chunked kernels unrounded (beta through bf16 drifts)."""
    dt = compute_dtype(a.dtype)
    x = a.to(dt) + dt_bias.to(dt)
    return -torch.exp(A_log.to(dt)) * torch.nn.functional.softplus(x), torch.sigmoid(b.to(dt))


def gate_bwd_torch(a, b, A_log, dt_bias, dg, dbeta):
    """Chain rule of gate_fwd_torch given dg, dbeta [T, HV] (0 on padding rows, so da, db are too):
    da = dg * -exp(A_log) sigmoid(a + dt_bias), db = dbeta beta (1 - beta),
    dA_log = sum_t dg g, ddt_bias = sum_t da: token sums of fixed order (torch.sum, no atomics).
    Returns float32 (float64) da, db [T, HV] and dA_log, ddt_bias [HV]."""
    dt = compute_dtype(a.dtype)
    x = a.to(dt) + dt_bias.to(dt)
    decay = torch.exp(A_log.to(dt))
    dg, dbeta = dg.to(dt), dbeta.to(dt)
    da = dg * -decay * torch.sigmoid(x)
    beta = torch.sigmoid(b.to(dt))
    db = dbeta * beta * (1 - beta)
    dA_log = (dg * -decay * torch.nn.functional.softplus(x)).sum(0)
    return da, db, dA_log, da.sum(0)
