"""The chunked gated delta rule in vectorised PyTorch: the CPU path and the readable statement of the
algorithm that the Triton and CUDA kernels are checked against (docs/DESIGN.md section 2).

Layout. Inputs are flattened packed rows: q, k [T, H, K]; v [T, HV, V]; g, beta [T, HV];
initial_state [N, HV, K, V]. A `Schedule` (built from the chunk table of gdn_packed.ops.chunk_table)
says which rows form each chunk and in which order the state pass visits the chunks. Every chunk is
gathered into a chunk-major [NC, H, G, C, *] block: chunk, qk-head, value head within the group
(G = HV // H, so GVA is a broadcast over the G axis, never a copy of q/k), row, feature. Rows of a
chunk past its length are zeros with g = beta = 0: such a row leaves the state untouched and receives
no gradient. They are zeroed by selection, never by multiplying with a 0/1 mask, so NaN/Inf in another
document's rows or in padding cannot leak in (NaN * 0 = NaN).

Per chunk, with a_t = exp(g_t) and E[r, s] = prod_{s < t <= r} a_t = exp(gamma_r - gamma_s) for
r >= s (else 0), gamma = cumsum(g), Gamma = gamma at the last row:
    A = strict_lower(beta_r (K K^T) E),  T = (I + A)^-1
    W = T diag(beta e^gamma) K,  U = T diag(beta) V
    Vnew = U - W S,  O = scale (diag(e^gamma) Q S + ((Q K^T) E) Vnew)
    S_next = e^Gamma S + (diag(e^(Gamma - gamma)) K)^T Vnew
Only the state pass is sequential; everything else is batched over all chunks and heads. The backward
is the analytic chunked backward of docs/DESIGN.md section 2 (a reverse state pass for dS, then every
per-chunk gradient batched), not autograd of the forward graph; it uses dA = -strict_lower(T^T dW' W^T
+ T^T dU U^T) (T^T dT T^T rewritten with W = T Kb, U = T Vb) and T^T dW' = -(T^T dVnew) S^T.

Gates: every decay factor is a product of a_t = exp(g_t) <= 1 over a segment (cumprod), never exp
of a difference of two cumulative sums. So g = -inf is a hard reset (a_t = 0, the state restarts)
and very negative g (-1e30, or -3e38 twice, whose fp32 sum overflows to -inf) is exact: nothing
overflows, no -inf - -inf = NaN. With fast decay (g ~ -20 per token, gamma ~ -1e3 in a chunk) the
products also keep full fp32 precision where a difference of two long sums would lose ~1e-4.

Schedules (gdn_packed.ops._common.host_schedule). CPU tensors: the chunk table is read on the host
(there is no device to wait for); each 64-row chunk of the table is split in two chunks of
HOST_CHUNK = 32 rows (the C x C products cost ~C FLOPs per token: 139 instead of 182 kFLOP per token
and head forward at K = V = 128) and the state pass advances all sequences in lock-step, one chunk of
each per step (steps = the longest sequence's chunk count). Sequences are ordered by chunk count, so
the ones still running at a step are a prefix of the state tensor and that step's chunks one
contiguous slice of the blocks: no gather, no scatter inside the loop. Other devices (CUDA): nothing
is read back; the state pass walks the table's T // C + N chunk slots one at a time, restarting the
state at each sequence's first chunk by selection. Both run the same formulas; results agree within
fp32 rounding (the chunk sizes differ), and each is bit-identical from run to run.

Memory of the backward: it recomputes the forward's per-chunk quantities from the inputs (the op
saves only its inputs). Held at once, per token and value head in float32: the C x C blocks E, M, T,
A-products (4C floats), the rows W, U, Vnew, Kd, gradients (~8 (K + V) floats) and the state entering
each chunk (K V / C floats: 512 at K = V = 128, C = 32).

Numerics: everything is computed in float32 (float64 for float64 inputs); o is rounded to v's dtype
at the end, states are float32.
"""
from dataclasses import dataclass

import torch

from gdn_packed.ops._common import host_schedule
from gdn_packed.torch_ref.naive import l2norm

HOST_CHUNK = 32


def compute_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _l2norm_bwd(x, dy, eps: float = 1e-6):
    """Gradient of y = x / sqrt(|x|^2 + eps) given dy."""
    inv = torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)
    y = x * inv
    return inv * (dy - y * (dy * x).sum(-1, keepdim=True) * inv)


def _tr(x):
    return x.transpose(-1, -2)


class Schedule:
    """The chunks (rows [NC * C], `T` for "no row", and `mask` [NC, C] of the real ones) in the order
    the state pass visits them, and the gather/scatter between packed rows and chunk blocks.

    Host schedule: `steps` lists (offset, count) per lock-step step; `order` [N] is the sequence
    at each position of the state tensor. Device schedule: `steps` is None and the pass walks the NC
    slots; slot j restarts the state from its sequence's initial state when it is the sequence's
    first chunk (`first[j]` = that sequence, else N) and stores the state it leaves when it is the
    last (`last[j]`); index N is a scratch row."""

    def __init__(self, table, cu_chunks, T, C):
        self.T, self.N = T, cu_chunks.numel() - 1
        if host_schedule(table.device):
            start, length = self._plan_host(table, C)
        else:
            start, length = self._plan_device(table, cu_chunks, C)
        self.NC = start.numel()
        pos = torch.arange(self.C, device=table.device)
        self.mask = pos < length[:, None]
        self.rows = torch.where(self.mask, start[:, None] + pos, T).reshape(-1)
        self.safe_rows = self.rows.clamp_max(max(T - 1, 0))

    def _plan_host(self, table, C):
        sub = C // HOST_CHUNK if C % HOST_CHUNK == 0 else 1
        self.C = C // sub
        seq, idx, start, length = (x[:, None] for x in table.long().unbind(1))
        p = torch.arange(sub)
        seq, idx = seq.expand(-1, sub), idx * sub + p
        start, length = start + p * self.C, (length - p * self.C).clamp(0, self.C)
        keep = (seq >= 0) & (length > 0)        # empty pieces only ever end a sequence
        seq, idx, start, length = (x[keep] for x in (seq, idx, start, length))
        N = self.N
        n = torch.bincount(seq, minlength=N)   # chunks per sequence
        self.order = torch.argsort(n, descending=True, stable=True)
        rank = torch.empty_like(self.order)
        rank[self.order] = torch.arange(N)
        perm = torch.argsort(idx * N + rank[seq])          # step-major, then by position
        counts = (n[self.order][None, :] > torch.arange(int(n.max()) if N else 0)[:, None]).sum(1)
        offsets = torch.cumsum(counts, 0) - counts
        self.steps = list(zip(offsets.tolist(), counts.tolist()))
        return start[perm], length[perm]

    def _plan_device(self, table, cu_chunks, C):
        self.C, self.steps, N = C, None, self.N
        seq, idx, start, length = table.long().unbind(1)
        valid = seq >= 0
        seq = torch.where(valid, seq, N)
        last_slot = torch.cat([cu_chunks[1:].long() - 1, cu_chunks.new_full((1,), -1).long()])
        is_last = valid & (last_slot.index_select(0, seq) == torch.arange(seq.numel(), device=seq.device))
        self.first = torch.where(valid & (idx == 0), seq, N)
        self.last = torch.where(is_last, seq, N)
        return start, length

    def gather(self, x, H, dt):
        """x [T, H*G, *f] (or [T, H, *f] with G = 1) -> [NC, H, G, C, *f] in dtype dt, 0 past the length."""
        f, G = x.shape[2:], x.shape[1] // H
        out = torch.empty(self.NC, H, G, self.C, *f, dtype=dt, device=x.device)
        if self.T == 0 or self.NC == 0:
            return out.zero_()
        b = x.reshape(self.T, -1).index_select(0, self.safe_rows)
        # by selection, not by a multiply: a clamped row may hold NaN/Inf (NaN * 0 = NaN)
        b.masked_fill_(~self.mask.view(-1, 1), 0)
        return out.copy_(b.view(self.NC, self.C, H, G, *f).movedim(1, 3))

    def scatter(self, vals, out):
        """vals [NC, H, G, C, *f] -> out [T, H*G, *f]. Every row of `out` is written: chunk rows in
        place, all other rows (padding) with exact zeros, whatever `out` held before."""
        width = vals.shape[1] * vals.shape[2] * vals.shape[4:].numel()
        buf = torch.zeros(self.T + 1, width, dtype=out.dtype, device=out.device)
        buf.index_copy_(0, self.rows, vals.movedim(3, 1).reshape(self.NC * self.C, width).to(out.dtype))
        out.view(self.T, width).copy_(buf[: self.T])


def with_scratch(x):
    """x [N, ...] -> [N + 1, ...] with a zero scratch row at index N."""
    return torch.cat([x, x.new_zeros(1, *x.shape[1:])])


def state_pass(sc, S0, step, reverse=False):
    """Runs step(sl, S) over the schedule (backwards with reverse): step advances the states
    S [a, H, G, K, V] in place through the chunks sl of the blocks (chunk sl[i] belongs to state i).
    S0 [N, H, G, K, V] enters each sequence (reverse: leaves it); returns the state at its other end
    (a zero-length sequence returns its S0)."""
    if sc.steps is not None:
        S = S0.index_select(0, sc.order)
        for off, a in (reversed(sc.steps) if reverse else sc.steps):
            step(slice(off, off + a), S[:a])
        return torch.empty_like(S).index_copy_(0, sc.order, S)
    N = sc.N
    ends = with_scratch(S0)
    out = ends.clone()
    enter, leave = (sc.last, sc.first) if reverse else (sc.first, sc.last)
    S = ends[N]
    for j in (reversed(range(sc.NC)) if reverse else range(sc.NC)):
        S = torch.where(enter[j] < N, ends.index_select(0, enter[j:j + 1])[0], S)
        step(slice(j, j + 1), S[None])
        out.index_copy_(0, leave[j:j + 1], S[None])
    return out[:N]


@dataclass
class Forward:
    """Per-chunk quantities of the forward, kept for the output and recomputed by the backward."""
    q: torch.Tensor         # [NC, H, 1, C, K]   scale * q (after l2norm when asked)
    k: torch.Tensor         # [NC, H, 1, C, K]
    v: torch.Tensor         # [NC, H, G, C, V]
    beta: torch.Tensor      # [NC, H, G, C]
    E: torch.Tensor         # [NC, H, G, C, C]   exp(gamma_r - gamma_s), r >= s
    KK: torch.Tensor        # [NC, H, 1, C, C]   K K^T
    QK: torch.Tensor        # [NC, H, 1, C, C]   scale Q K^T
    Tinv: torch.Tensor      # [NC, H, G, C, C]   (I + A)^-1
    W: torch.Tensor         # [NC, H, G, C, K]
    U: torch.Tensor         # [NC, H, G, C, V]
    eg: torch.Tensor        # [NC, H, G, C]      exp(gamma)
    eGg: torch.Tensor       # [NC, H, G, C]      exp(Gamma - gamma)
    eG: torch.Tensor        # [NC, H, G]         exp(Gamma)
    Kd: torch.Tensor        # [NC, H, G, C, K]   diag(exp(Gamma - gamma)) K
    M: torch.Tensor         # [NC, H, G, C, C]   scale (Q K^T) * E
    QS: torch.Tensor        # [NC, H, G, C, V]   scale diag(exp(gamma)) Q S
    S_in: torch.Tensor      # [NC, H, G, K, V]   state entering each chunk (None unless asked)
    Vnew: torch.Tensor      # [NC, H, G, C, V]
    S_final: torch.Tensor   # [N, H, G, K, V]


def chunk_forward(sc, q, k, v, g, beta, initial_state, scale, use_l2norm, keep_states=False):
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    G, N, C = HV // H, sc.N, sc.C
    dt = compute_dtype(q.dtype)
    qc, kc = sc.gather(q, H, dt), sc.gather(k, H, dt)
    if use_l2norm:
        qc, kc = l2norm(qc), l2norm(kc)
    qc = qc * scale
    vc, gc, bc = sc.gather(v, H, dt), sc.gather(g, H, dt), sc.gather(beta, H, dt)

    a = torch.exp(gc)                                          # 0 for g = -inf: a hard reset
    below = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)      # [t, s]: t > s
    E = torch.where(below, a[..., :, None], 1.0).cumprod(-2).tril_()
    eg = a.cumprod(-1)
    eG, eGg = eg[..., -1], E[..., -1, :].contiguous()
    KK, QK = kc @ _tr(kc), qc @ _tr(kc)
    A = (KK * E).mul_(bc[..., :, None])                        # diagonal unread (unitriangular)
    eye = torch.eye(C, dtype=dt, device=q.device)
    Tinv = torch.linalg.solve_triangular(A, eye.expand_as(A), upper=False, unitriangular=True)
    W = Tinv @ ((bc * eg)[..., None] * kc)
    U = Tinv @ (bc[..., None] * vc)
    M = QK * E
    Kd = eGg[..., None] * kc
    WQ = torch.cat([W, eg[..., None] * qc], -2)                # one product gives W S and e^gamma Q S
    Vnew, QS = torch.empty_like(U), torch.empty_like(U)
    S_in = U.new_empty(sc.NC, H, G, K, V) if keep_states else None

    def step(sl, S):
        if S_in is not None:
            S_in[sl] = S
        ws = WQ[sl] @ S
        torch.sub(U[sl], ws[..., :C, :], out=Vnew[sl])
        QS[sl] = ws[..., C:, :]
        S.mul_(eG[sl][..., None, None]).add_(_tr(Kd[sl]) @ Vnew[sl])

    S0 = (torch.zeros(N, H, G, K, V, dtype=dt, device=q.device) if initial_state is None
          else initial_state.to(dt).reshape(N, H, G, K, V))
    final = state_pass(sc, S0, step)
    return Forward(qc, kc, vc, bc, E, KK, QK, Tinv, W, U, eg, eGg, eG, Kd, M, QS, S_in, Vnew, final)


def chunk_gdr_fwd_torch(q, k, v, g, beta, table, cu_chunks, initial_state, scale, C, use_l2norm,
                        o, final_state):
    """Writes o [T, HV, V] (every row) and final_state [N, HV, K, V] float32."""
    sc = Schedule(table, cu_chunks, q.shape[0], C)
    f = chunk_forward(sc, q, k, v, g, beta, initial_state, scale, use_l2norm)
    sc.scatter((f.M @ f.Vnew).add_(f.QS), o)
    final_state.copy_(f.S_final.reshape(final_state.shape))


def chunk_gdr_bwd_torch(q, k, v, g, beta, table, cu_chunks, initial_state, scale, C, use_l2norm,
                        do, dht, dq, dk, dv, dg, dbeta, dh0):
    """Writes dq, dk [T, H, K], dv [T, HV, V], dg, dbeta [T, HV] (every row) and dh0 [N, HV, K, V]."""
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    G, N = HV // H, cu_chunks.numel() - 1
    sc = Schedule(table, cu_chunks, T, C)
    f = chunk_forward(sc, q, k, v, g, beta, initial_state, scale, use_l2norm, keep_states=True)
    dt = f.q.dtype
    dO = sc.gather(do, H, dt)

    # reverse state pass: dS_next of every chunk (dSn), dVnew, then dh0 of every sequence
    dVnew = _tr(f.M) @ dO                                      # completed with Kd dS_next below
    dOe = f.eg[..., None] * dO
    dS_loc = _tr(f.q) @ dOe
    dSn = torch.empty_like(f.S_in)

    def step(sl, dS):
        dSn[sl] = dS
        dVnew[sl] += f.Kd[sl] @ dS
        dS.mul_(f.eG[sl][..., None, None]).add_(dS_loc[sl]).sub_(_tr(f.W[sl]) @ dVnew[sl])

    dST = (torch.zeros(N, H, G, K, V, dtype=dt, device=q.device) if dht is None
           else dht.to(dt).reshape(N, H, G, K, V))
    dh0.copy_(state_pass(sc, dST, step, reverse=True).reshape(dh0.shape))

    # every per-chunk gradient, batched over chunks and heads (q is scale * q here)
    S, Vn, E, bc, eg = f.S_in, f.Vnew, f.E, f.beta, f.eg
    TdU = _tr(f.Tinv) @ dVnew                                 # T^T dU
    dQi = dOe @ _tr(S)                                         # inter-chunk part of dq
    TdW = (TdU @ _tr(S)).neg_()                                # T^T dW'
    dP = (dO @ _tr(Vn)).mul_(E)
    dAE = (TdW @ _tr(f.W)).add_(TdU @ _tr(f.U)).neg_().tril_(-1).mul_(E)      # dA * E
    dKK = dAE * bc[..., :, None]
    VdS = Vn @ _tr(dSn)                                        # row r: dS_next Vnew_r
    kTdW = (TdW * f.k).sum(-1)
    # GVA: the qk-head's gradients sum over its value heads (summed before the products with q, k)
    dPs, dKKs = dP.sum(2, keepdim=True), (dKK + _tr(dKK)).sum(2, keepdim=True)
    dQ = dQi.sum(2, keepdim=True) + dPs @ f.k
    dK = (_tr(dPs) @ f.q + dKKs @ f.k
          + (f.eGg[..., None] * VdS + (bc * eg)[..., None] * TdW).sum(2, keepdim=True))
    dV = bc[..., None] * TdU
    dB = eg * kTdW + (TdU * f.v).sum(-1) + (dAE * f.KK).sum(-1)
    # dg_r = sum_{t >= r} dgamma_t (docs/DESIGN.md section 2), summed so that no large terms cancel:
    #   sum_{t >= r} (rowsum X - colsum X)_t  =  sum_{t >= r, s < r} X[t, s]
    #   sum_{t >= r} (-tau_t) + sum_t tau_t   =  sum_{t < r} tau_t
    # (with fast decay the first forms lose ~1e-5 in fp32 to cancellation, these do not)
    X = (dP * f.QK).add_(dKK * f.KK)
    tau = f.eGg * (f.k * VdS).sum(-1)
    local = (f.q * dQi).sum(-1) + bc * eg * kTdW
    X_below = X.flip(-2).cumsum(-2).flip(-2)                    # [r, s] = sum_{t >= r} X[t, s]
    strict = torch.ones(sc.C, sc.C, dtype=torch.bool, device=q.device).tril(-1)
    dG = (local.flip(-1).cumsum(-1).flip(-1) + torch.where(strict, X_below, 0).sum(-1)
          + torch.nn.functional.pad(tau.cumsum(-1)[..., :-1], (1, 0))
          + (f.eG * (S * dSn).sum((-2, -1)))[..., None])

    dQ = dQ * scale
    if use_l2norm:
        dQ = _l2norm_bwd(sc.gather(q, H, dt), dQ)
        dK = _l2norm_bwd(sc.gather(k, H, dt), dK)
    for vals, out in ((dQ, dq), (dK, dk), (dV, dv), (dG, dg), (dB, dbeta)):
        sc.scatter(vals, out)


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
