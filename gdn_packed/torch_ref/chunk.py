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

Schedules (gdn_packed._runtime.host_schedule). CPU tensors: the chunk table is read on the host
(there is no device to wait for); each 64-row chunk of the table is split in two chunks of
HOST_CHUNK = 32 rows (the C x C products cost ~C FLOPs per token: 139 instead of 182 kFLOP per token
and head forward at K = V = 128) and the state pass advances all sequences in lock-step, one chunk of
each per step (steps = the longest sequence's chunk count). Sequences are ordered by chunk count, so
the ones still running at a step are a prefix of the state tensor and that step's chunks one
contiguous slice of the blocks: no gather, no scatter inside the loop. Other devices (CUDA): nothing
is read back; the state pass walks the table's T // C + N chunk slots one at a time, restarting the
state at each sequence's first chunk by selection. Both run the same formulas; results agree within
fp32 rounding (the chunk sizes differ), and each is bit-identical from run to run.

Blocks (`Schedule.blocks`): consecutive steps are grouped into blocks of about BLOCK_CHUNK_HEADS = 64
chunk x head pairs, and the forward runs block by block (gather, per-chunk quantities, the block's
steps, output), so a block's intermediates stay in cache instead of streaming [NC, ...] tensors of
the whole batch through memory (measured: ~1.5x on the packing scenario's forward, 1 thread).

Memory of the backward. On the host schedule the forward keeps `kept` (kept_shape; the op returns
it, non-differentiable, when autograd will need it): the state entering each chunk of an even step
(one per 2 x HOST_CHUNK = 64 rows) and Vnew of every row, K V / 64 + V floats per token and value
head, 384 floats (1.5 KiB in float32, 3 KiB in float64) at K = V = 128. The backward then runs no
forward state pass: block by block in reverse, the block's per-chunk quantities again (W, U, T, E,
...: batched, no loop), the states of its odd steps from the even ones (one product each), its steps
of the reverse state pass, its gradients. That spares the backward ~30% of its FLOPs (two forward
state passes); with the in-place updates of the state passes, forward+backward on the dense benchmark
shape ran 1.2-1.5x faster than before (bench/NOTES.md, issue 16). Other
schedules (CUDA tensors) keep nothing (the op saves only its inputs there); the backward then
recomputes: a first forward pass (skipped when there is one block) keeps the states entering each
block (at most K V / HOST_CHUNK floats per token and value head), then block by block in reverse
the block's forward again from its entering state, keeping the state entering each chunk.

Numerics: everything is computed in float32 (float64 for float64 inputs); o is rounded to v's dtype
at the end, states are float32.
"""
from dataclasses import dataclass

import torch

from gdn_packed._runtime import compute_dtype, host_schedule
from gdn_packed.torch_ref.naive import l2norm

HOST_CHUNK = 32
BLOCK_CHUNK_HEADS = 64


def host_chunk(C):
    """The chunk size of the host schedule for the op's chunk size C."""
    return HOST_CHUNK if C % HOST_CHUNK == 0 else C


def kept_shape(T, N, HV, K, V, C, device, dtype=None):
    """The shape of `kept`, what the forward keeps for the backward, from shapes only (the op's fake
    kernel calls this). On the host schedule, with c = host_chunk(C): the state entering every chunk
    of an even step (its index in its sequence is even: one per 2c rows), [T // 2c + N, HV, K, V],
    then every chunk's Vnew, [T // c + N, HV, c, V], flat; the counts bound those of any packing
    (sum over sequences of ceil(len / c), of ceil(len / 2c)). Elsewhere [0] (nothing kept)."""
    if not host_schedule(device):
        return (0,)
    c = host_chunk(C)
    return ((T // (2 * c) + N) * HV * K * V + (T // c + N) * HV * c * V,)


class Kept:
    """The forward's `kept` (kept_shape) as blocks: `states` [m2, H, G, K, V] (slot[off]: the first
    of the states of the even step whose chunks start at off), `Vnew` [m, H, G, C, V]. The state
    entering a chunk of an odd step is one product from the previous chunk's:
    e^Gamma S + Kd^T Vnew (`fill`); blocks start at even steps (`Schedule.blocks`), so that chunk is
    in the same block."""

    @classmethod
    def of(cls, kept, sc, H, HV, K, V):
        """A Kept over kept, or None when nothing is kept: other schedules, or more chunks than
        kept_shape's bound, which only corrupt cu_seqlens give. The forward and the backward decide
        alike from the same inputs. A backward on the device schedule ignores a kept made by the
        host schedule (device_schedule() entered between forward and backward): it recomputes."""
        if kept is None or kept.numel() == 0 or sc.steps is None:
            return None
        m2, m, C = sc.T // (2 * sc.C) + sc.N, sc.T // sc.C + sc.N, sc.C
        if kept.numel() != m2 * HV * K * V + m * HV * C * V:
            raise ValueError(f"kept must hold (T // {2 * C} + N) HV K V + (T // {C} + N) HV {C} V = "
                             f"{m2 * HV * K * V + m * HV * C * V} elements, got {kept.numel()}")
        if sc.steps is None:
            return None
        out = cls()
        out.slot, n = {}, 0
        for i, (off, a) in enumerate(sc.steps):
            if i % 2 == 0:
                out.slot[off], n = n, n + a
        if sc.NC > m or n > m2:
            return None
        out.states = kept[: m2 * HV * K * V].view(m2, H, HV // H, K, V)
        out.Vnew = kept[m2 * HV * K * V:].view(m, H, HV // H, C, V)
        out.unused = (out.states[n:], out.Vnew[sc.NC:])
        return out

    def storing(self, step, lo):
        """step (of chunk_forward, for chunks from lo), also storing the states of even steps."""
        def store(sl, S):
            j = self.slot.get(lo + sl.start)
            if j is not None:
                self.states[j: j + S.shape[0]] = S
            step(sl, S)
        return store

    def fill(self, f, lo, steps):
        """f.S_in (chunks from lo, of these steps) from the states kept and f's Kd, eG, Vnew."""
        for i, (off, a) in enumerate(steps):
            o = slice(off - lo, off - lo + a)
            j = self.slot.get(off)
            if j is not None:
                f.S_in[o] = self.states[j: j + a]
                continue
            p = slice(steps[i - 1][0] - lo, steps[i - 1][0] - lo + a)   # same sequences: a prefix
            torch.mul(f.S_in[p], f.eG[p][..., None, None], out=f.S_in[o])
            _add_product(f.S_in[o], _tr(f.Kd[p]), f.Vnew[p])


def _l2norm_bwd(x, dy, eps: float = 1e-6):
    """Gradient of y = x / sqrt(|x|^2 + eps) given dy."""
    inv = torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)
    y = x * inv
    return inv * (dy - y * (dy * x).sum(-1, keepdim=True) * inv)


def _tr(x):
    return x.transpose(-1, -2)


def _add_product(out, a, b, alpha=1):
    """out += alpha a @ b in place, over any batch dims (one GEMM accumulating into out: no
    temporary); out contiguous."""
    out.view(-1, *out.shape[-2:]).baddbmm_(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]),
                                           alpha=alpha)


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
        self.C = host_chunk(C)
        sub = C // self.C
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

    def blocks(self, heads):
        """(lo, hi, steps): consecutive steps grouped so that each group's chunks [lo, hi) hold about
        BLOCK_CHUNK_HEADS chunk x head pairs; a group's blocks then stay in cache. Groups start at
        even steps (see Kept). One group on the device schedule (its steps are the NC slots)."""
        if self.steps is None:
            return [(0, self.NC, [(j, 1) for j in range(self.NC)])]
        out, cur = [], []
        for i, (off, a) in enumerate(self.steps):
            cur.append((off, a))
            if i % 2 and sum(n for _, n in cur) * heads >= BLOCK_CHUNK_HEADS:
                out.append((cur[0][0], off + a, cur))
                cur = []
        if cur:
            out.append((cur[0][0], cur[-1][0] + cur[-1][1], cur))
        return out

    def gather(self, x, H, dt, lo=0, hi=None):
        """x [T, H*G, *f] (or [T, H, *f] with G = 1) -> chunks [lo, hi) as [hi - lo, H, G, C, *f] in
        dtype dt, 0 past each chunk's length."""
        hi = self.NC if hi is None else hi
        f, G = x.shape[2:], x.shape[1] // H
        out = torch.empty(hi - lo, H, G, self.C, *f, dtype=dt, device=x.device)
        if self.T == 0 or hi == lo:
            return out.zero_()
        b = x.reshape(self.T, -1).index_select(0, self.safe_rows[lo * self.C: hi * self.C])
        # by selection, not by a multiply: a clamped row may hold NaN/Inf (NaN * 0 = NaN)
        b.masked_fill_(~self.mask[lo:hi].reshape(-1, 1), 0)
        return out.copy_(b.view(hi - lo, self.C, H, G, *f).movedim(1, 3))

    def rows_buffer(self, out):
        """A zero [T + 1, width] buffer for `scatter` into out [T, H*G, *f] (row T: "no row")."""
        return torch.zeros(self.T + 1, out.shape[1:].numel(), dtype=out.dtype, device=out.device)

    def scatter(self, vals, buf, lo=0):
        """vals = chunks [lo, lo + len) as [len, H, G, C, *f] -> their rows of buf [T + 1, H*G*f]."""
        n = vals.shape[0]
        buf.index_copy_(0, self.rows[lo * self.C: (lo + n) * self.C],
                        vals.movedim(3, 1).reshape(n * self.C, buf.shape[1]).to(buf.dtype))

    @staticmethod
    def write(buf, out):
        """out [T, ...] = buf[:T]: chunk rows as scattered, all other rows (padding) exact zeros."""
        out.view(out.shape[0], buf.shape[1]).copy_(buf[:-1])


def with_scratch(x):
    """x [N, ...] -> [N + 1, ...] with a zero scratch row at index N."""
    return torch.cat([x, x.new_zeros(1, *x.shape[1:])])


class StatePass:
    """The sequential pass over the states: step(sl, S) advances the states S [a, H, G, K, V] in
    place through the chunks sl of the blocks (chunk sl[i] belongs to state i). S0 [N, H, G, K, V] enters each sequence (reverse:
    leaves it); result() is the state at its other end (a zero-length sequence keeps its S0).
    run(steps, step) calls step(sl, S) per step.""" 

    def __init__(self, sc, S0, reverse=False):
        self.sc, self.reverse = sc, reverse
        if sc.steps is not None:                    # host: position p holds sequence order[p]
            self.S = S0.index_select(0, sc.order)
        else:                                       # device: row N is a scratch row
            self.ends = with_scratch(S0)
            self.out = self.ends.clone()
            self.S = self.ends[sc.N]

    def checkpoint(self, steps):
        """A copy of the states the steps start from, for `resume` (host schedule)."""
        return self.S[: steps[-1 if self.reverse else 0][1]].clone()

    def resume(self, S):
        """A pass that continues from a checkpoint (host schedule)."""
        p = StatePass.__new__(StatePass)
        p.sc, p.reverse, p.S = self.sc, self.reverse, S
        return p

    def run(self, steps, step, lo=0):
        """steps: (offset, count) of each step's chunks; lo: the offset of chunk 0 of the blocks."""
        sc = self.sc
        for off, a in (reversed(steps) if self.reverse else steps):
            sl = slice(off - lo, off - lo + a)
            if sc.steps is not None:
                step(sl, self.S[:a])
                continue
            enter, leave = (sc.last, sc.first) if self.reverse else (sc.first, sc.last)
            self.S = torch.where(enter[off] < sc.N, self.ends.index_select(0, enter[off:off + 1])[0], self.S)
            step(sl, self.S[None])
            self.out.index_copy_(0, leave[off:off + 1], self.S[None])

    def result(self):
        if self.sc.steps is not None:
            return torch.empty_like(self.S).index_copy_(0, self.sc.order, self.S)
        return self.out[: self.sc.N]


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
    step: object            # step(sl, S): the state pass through chunks sl


def chunk_forward(sc, lo, hi, q, k, v, g, beta, scale, use_l2norm, keep_states=False, output=True,
                  intra=True, kept=None):
    """The per-chunk quantities of chunks [lo, hi) and `step`, their part of the state pass (which
    fills Vnew, QS and, with keep_states, S_in). Without `output` no QS; without `intra` no QK, M
    (then only what the state pass needs). kept: (S_in, Vnew) of chunks [lo, hi) to fill (the
    forward's) or to read (the backward's, instead of a state pass)."""
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    G, C, NC = HV // H, sc.C, hi - lo
    dt = compute_dtype(q.dtype)
    qc, kc = sc.gather(q, H, dt, lo, hi), sc.gather(k, H, dt, lo, hi)
    if use_l2norm:
        qc, kc = l2norm(qc), l2norm(kc)
    qc = qc * scale
    vc, gc, bc = (sc.gather(x, H, dt, lo, hi) for x in (v, g, beta))

    a = torch.exp(gc)                                          # 0 for g = -inf: a hard reset
    below = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)      # [t, s]: t > s
    E = torch.where(below, a[..., :, None], 1.0).cumprod(-2).tril_()
    eg = a.cumprod(-1)
    eG, eGg = eg[..., -1], E[..., -1, :].contiguous()
    KK = kc @ _tr(kc)
    A = (KK * E).mul_(bc[..., :, None])                        # diagonal unread (unitriangular)
    eye = torch.eye(C, dtype=dt, device=q.device)
    Tinv = torch.linalg.solve_triangular(A, eye.expand_as(A), upper=False, unitriangular=True)
    W = Tinv @ ((bc * eg)[..., None] * kc)
    U = Tinv @ (bc[..., None] * vc)
    Kd = eGg[..., None] * kc
    QK = M = None
    if intra:
        QK = qc @ _tr(kc)
        M = QK * E
    eQ = eg[..., None] * qc if output else None
    QS = torch.empty_like(U) if output else None
    if kept is not None:
        S_in, Vnew = kept
    else:
        Vnew = torch.empty_like(U)
        S_in = U.new_empty(NC, H, G, K, V) if keep_states else None

    def step(sl, S):
        if S_in is not None:
            S_in[sl] = S
        Vnew[sl] = U[sl]
        _add_product(Vnew[sl], W[sl], S, alpha=-1)
        if QS is not None:
            torch.matmul(eQ[sl], S, out=QS[sl])
        _add_product(S.mul_(eG[sl][..., None, None]), _tr(Kd[sl]), Vnew[sl])

    return Forward(qc, kc, vc, bc, E, KK, QK, Tinv, W, U, eg, eGg, eG, Kd, M, QS, S_in, Vnew, step)


def _states(x, dt, N, H, G, K, V, device):
    return (torch.zeros(N, H, G, K, V, dtype=dt, device=device) if x is None
            else x.to(dt).reshape(N, H, G, K, V))


def chunk_gdr_fwd_torch(q, k, v, g, beta, table, cu_chunks, initial_state, scale, C, use_l2norm,
                        o, final_state, kept=None):
    """Writes o [T, HV, V] (every row), final_state [N, HV, K, V] float32 and, when given, kept
    (kept_shape; every element: chunks past the last are zeros)."""
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    sc = Schedule(table, cu_chunks, T, C)
    sp = StatePass(sc, _states(initial_state, compute_dtype(q.dtype), sc.N, H, HV // H, K, V, q.device))
    buf = sc.rows_buffer(o)
    keep = Kept.of(kept, sc, H, HV, K, V)
    for x in (() if kept is None else (kept,) if keep is None else keep.unused):
        x.zero_()
    for lo, hi, steps in sc.blocks(HV):
        f = chunk_forward(sc, lo, hi, q, k, v, g, beta, scale, use_l2norm,
                          kept=None if keep is None else (None, keep.Vnew[lo:hi]))
        sp.run(steps, f.step if keep is None else keep.storing(f.step, lo), lo)
        sc.scatter((f.M @ f.Vnew).add_(f.QS), buf, lo)
    sc.write(buf, o)
    final_state.copy_(sp.result().reshape(final_state.shape))


def chunk_gdr_bwd_torch(q, k, v, g, beta, table, cu_chunks, initial_state, scale, C, use_l2norm,
                        do, dht, dq, dk, dv, dg, dbeta, dh0, kept=None):
    """Writes dq, dk [T, H, K], dv [T, HV, V], dg, dbeta [T, HV] (every row) and dh0 [N, HV, K, V].

    Block by block in reverse (`Schedule.blocks`): the block's per-chunk quantities are recomputed;
    the states entering its chunks and Vnew are read from `kept` (the forward's) when it holds them,
    else recomputed by the block's forward state pass from the state entering the block (kept by a
    first forward pass when there is more than one block); then its part of the reverse state pass
    and its gradients."""
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    G, dt = HV // H, compute_dtype(q.dtype)
    sc = Schedule(table, cu_chunks, T, C)
    blocks = sc.blocks(HV)
    keep = Kept.of(kept, sc, H, HV, K, V)
    fp = StatePass(sc, _states(initial_state, dt, sc.N, H, G, K, V, q.device))
    entering = [None] * len(blocks)
    if keep is None and len(blocks) > 1:
        for b, (lo, hi, steps) in enumerate(blocks):
            entering[b] = fp.checkpoint(steps)
            f = chunk_forward(sc, lo, hi, q, k, v, g, beta, scale, use_l2norm, output=False, intra=False)
            fp.run(steps, f.step, lo)
    bp = StatePass(sc, _states(dht, dt, sc.N, H, G, K, V, q.device), reverse=True)
    outs = (dq, dk, dv, dg, dbeta)
    bufs = [sc.rows_buffer(x) for x in outs]
    for (lo, hi, steps), S_enter in reversed(list(zip(blocks, entering))):
        S_in = None if keep is None else keep.states.new_empty(hi - lo, *keep.states.shape[1:])
        f = chunk_forward(sc, lo, hi, q, k, v, g, beta, scale, use_l2norm, keep_states=True, output=False,
                          kept=None if keep is None else (S_in, keep.Vnew[lo:hi]))
        if keep is None:
            (fp if S_enter is None else fp.resume(S_enter)).run(steps, f.step, lo)
        else:
            keep.fill(f, lo, steps)
        grads = chunk_backward(sc, lo, hi, f, steps, bp, q, k, do, scale, use_l2norm)
        for vals, buf in zip(grads, bufs):
            sc.scatter(vals, buf, lo)
    dh0.copy_(bp.result().reshape(dh0.shape))
    for buf, out in zip(bufs, outs):
        sc.write(buf, out)


def chunk_backward(sc, lo, hi, f, steps, bp, q, k, do, scale, use_l2norm):
    """Gradients of chunks [lo, hi) given their forward f (with S_in): runs their steps of the reverse
    state pass bp, returns dQ, dK [n, H, 1, C, K], dV [n, H, G, C, V], dG, dB [n, H, G, C]."""
    H = q.shape[1]
    dt = f.q.dtype
    dO = sc.gather(do, H, dt, lo, hi)

    # reverse state pass: dVnew and what each chunk needs of its dS_next (VdS, SdS), with
    #   dS <- e^Gamma dS + q^T dOe - W^T dVnew   (accumulated in place)
    C = sc.C
    S, Vn, E, bc, eg = f.S_in, f.Vnew, f.E, f.beta, f.eg
    dOe = eg[..., None] * dO
    dVnew = _tr(f.M) @ dO                                      # completed with Kd dS_next below
    qG = f.q.expand_as(f.W).contiguous()
    VdS = torch.empty_like(f.W)                                # row r: dS_next Vnew_r
    SdS = torch.empty_like(f.eG)                               # sum(S_in * dS_next)
    prod = S.new_empty(max((a for _, a in steps), default=0), *S.shape[1:])

    def step(sl, dS):
        torch.matmul(Vn[sl], _tr(dS), out=VdS[sl])
        SdS[sl] = torch.mul(S[sl], dS, out=prod[: dS.shape[0]]).sum((-2, -1))
        _add_product(dVnew[sl], f.Kd[sl], dS)
        _add_product(dS.mul_(f.eG[sl][..., None, None]), _tr(qG[sl]), dOe[sl])
        _add_product(dS, _tr(f.W[sl]), dVnew[sl], alpha=-1)

    bp.run(steps, step, lo)

    # every per-chunk gradient, batched over chunks and heads (q is scale * q here)
    TdU = _tr(f.Tinv) @ dVnew                                  # T^T dU
    dQi = dOe @ _tr(S)                                         # inter-chunk part of dq
    TdW = (TdU @ _tr(S)).neg_()                                # T^T dW'
    dP = (dO @ _tr(Vn)).mul_(E)
    dAE = (TdW @ _tr(f.W)).add_(TdU @ _tr(f.U)).neg_().tril_(-1).mul_(E)      # dA * E
    dKK = dAE * bc[..., :, None]
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
    ones = torch.ones(C, C, dtype=dt, device=q.device)
    X_below = ones.triu() @ X                                  # [r, s] = sum_{t >= r} X[t, s]
    dG = (local.flip(-1).cumsum(-1).flip(-1) + torch.where(ones.tril(-1) > 0, X_below, 0).sum(-1)
          + torch.nn.functional.pad(tau.cumsum(-1)[..., :-1], (1, 0)) + (f.eG * SdS)[..., None])

    dQ = dQ * scale
    if use_l2norm:
        dQ = _l2norm_bwd(sc.gather(q, H, dt, lo, hi), dQ)
        dK = _l2norm_bwd(sc.gather(k, H, dt, lo, hi), dK)
    return dQ, dK, dV, dG, dB


# torch's CPU kernels of exp, softplus, sigmoid (...) compute an element on the vectorised (SLEEF)
# path, or on a scalar (libm) path for the last < 2 vector widths of each contiguous run and of each
# thread's share, and the two paths can differ in the last bit. On gate rows [T, HV] (a few elements
# per row) which rows fall on a scalar tail depends on T and the layout, i.e. on the other sequences
# of the packing: a sequence's gates, hence its o and gradients, would change with its neighbours.
# `_lanewise` runs such a function on a flat contiguous copy padded to a multiple of LANES (a multiple
# of every CPU vector width x 2), in pieces of GATE_PIECE elements (below TensorIterator's parallel
# grain of 32768, so one thread each): every element takes the vectorised path, wherever it sits.
LANES = 64
GATE_PIECE = 1 << 14


def _lanewise(fn, x):
    """fn(x) for an elementwise fn, with bits that do not depend on x's layout or size (CPU)."""
    if x.device.type != "cpu":
        return fn(x)
    n = x.numel()
    flat = torch.cat([x.reshape(-1), x.new_zeros(-n % LANES)])
    if flat.numel() <= GATE_PIECE:
        return fn(flat)[:n].view(x.shape)
    out = torch.cat([fn(piece) for piece in flat.split(GATE_PIECE)])
    return out[:n].view(x.shape)


def gate_fwd_torch(a, b, A_log, dt_bias):
    """The gating of Qwen3-Next / Megatron from raw rows, in float32 (float64 for float64 inputs):
    g = -exp(A_log[h]) softplus(a + dt_bias[h]),  beta = sigmoid(b).  a, b [T, HV]; A_log, dt_bias [HV].
    Returns (g, beta) [T, HV]: these feed the chunked kernels unrounded (beta through bf16 drifts)."""
    dt = compute_dtype(a.dtype)
    x = a.to(dt) + dt_bias.to(dt)
    return (-torch.exp(A_log.to(dt)) * _lanewise(torch.nn.functional.softplus, x),
            _lanewise(torch.sigmoid, b.to(dt)))


def gate_bwd_torch(a, b, A_log, dt_bias, dg, dbeta):
    """Chain rule of gate_fwd_torch given dg, dbeta [T, HV] (0 on padding rows, so da, db are too):
    da = dg * -exp(A_log) sigmoid(a + dt_bias), db = dbeta beta (1 - beta),
    dA_log = sum_t dg g, ddt_bias = sum_t da: token sums of fixed order (torch.sum, no atomics).
    Returns float32 (float64) da, db [T, HV] and dA_log, ddt_bias [HV]."""
    dt = compute_dtype(a.dtype)
    x = a.to(dt) + dt_bias.to(dt)
    decay = torch.exp(A_log.to(dt))
    dg, dbeta = dg.to(dt), dbeta.to(dt)
    da = dg * -decay * _lanewise(torch.sigmoid, x)
    beta = _lanewise(torch.sigmoid, b.to(dt))
    db = dbeta * beta * (1 - beta)
    dA_log = (dg * -decay * _lanewise(torch.nn.functional.softplus, x)).sum(0)
    return da, db, dA_log, da.sum(0)
