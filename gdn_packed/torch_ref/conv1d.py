"""The varlen depthwise causal conv1d in vectorised PyTorch (the CPU path and the statement the CUDA
kernels in csrc/conv1d_varlen.cu are checked against), plus `causal_conv1d_ref`, the per-sequence
F.conv1d reference.

Layout. x [T, D] flattened packed rows (channel-last), weight [D, W], bias [D] or None,
initial_state [N, D, W-1] or None. Sequence i owns rows [base_i, base_i + len_i) (base =
cu_seqlens_padded or cu_seqlens); every other row is padding. With xin(p) the input at position p of
the row's own sequence (p < 0: initial_state[i, :, W-1+p], or 0 without one):

    z[t]  = bias + sum_w weight[:, w] * xin(pos_t - (W-1) + w)       y[t] = silu(z[t]) or z[t]
    final_state[i, :, j] = xin(len_i - (W-1) + j),  j < W-1          (the last W-1 inputs)

so the conv restarts at every sequence and never reads a neighbour's rows. Padding rows: y = 0,
dx = 0, and no share of dweight/dbias; they are excluded by selection (torch.where), never by a 0 factor,
so NaN/Inf stored in padding rows reaches nothing. Backward, with dz = dy * act'(z) on real rows:
    dx[t]       = sum_s weight[:, W-1-s] dz[t+s] (t+s in the same sequence) + dfinal term
    dweight[:, w] = sum_t dz[t] xin(pos_t - (W-1) + w),  dbias = sum_t dz[t]
    dinitial_state: the same sum as dx, over the virtual positions -(W-1)..-1, + dfinal term.
Everything is computed in float32 (float64 for float64 x) and rounded to the output dtypes at the end.
The only Python loops are over the W taps.
"""
import torch
import torch.nn.functional as F

from gdn_packed._runtime import compute_dtype
from gdn_packed.segments import locate_rows


class Rows:
    """Per-row (seq, pos, real) and per-sequence (base, len) of a packed layout of T rows."""

    def __init__(self, cu_seqlens, cu_seqlens_padded, T):
        cu = cu_seqlens.to(torch.int64)
        offsets = cu if cu_seqlens_padded is None else cu_seqlens_padded.to(torch.int64)
        self.lens = (cu[1:] - cu[:-1]).clamp_min(0)
        self.base = offsets[:-1]
        self.seq, self.pos, self.real = locate_rows(offsets, self.lens, T)
        self.row_len = torch.cat([self.lens, self.lens.new_zeros(1)])[self.seq]   # safe when N = 0
        self.N, self.T = self.lens.numel(), T
        self.r = torch.arange(T, device=cu.device)

    def row_or_pad(self, rows, ok):
        """rows where ok and inside [0, T), else T (the index of an appended zero row)."""
        ok = ok & (rows >= 0) & (rows < self.T)
        return torch.where(ok, rows, torch.full_like(rows, self.T))


def _with_zero_row(x):
    return torch.cat([x, x.new_zeros(1, *x.shape[1:])])


def _xin(R, xp, h0, s, W):
    """[T, D]: the input s positions before each row, within the row's own sequence."""
    from_x = xp[R.row_or_pad(R.r - s, R.pos >= s)]
    if s == 0 or h0 is None:
        return from_x
    from_h = h0[R.seq, :, (W - 1 - s + R.pos).clamp(0, W - 2)]
    return torch.where((R.pos < s)[:, None], from_h, from_x)


def _preact(R, xp, weight, bias, h0, W):
    z = torch.zeros_like(xp[:-1]) if bias is None else bias.expand_as(xp[:-1]).clone()
    for w in range(W):
        z = z + weight[:, w] * _xin(R, xp, h0, W - 1 - w, W)
    return z


def _prepare(x, weight, bias, initial_state, cu_seqlens, cu_seqlens_padded):
    dt = compute_dtype(x.dtype)
    R = Rows(cu_seqlens, cu_seqlens_padded, x.shape[0])
    xp = _with_zero_row(x.to(dt))
    w = weight.to(dt)
    b = None if bias is None else bias.to(dt)
    h0 = None if initial_state is None or R.N == 0 else initial_state.to(dt)
    return R, xp, w, b, h0


def conv1d_varlen_fwd_torch(x, weight, bias, initial_state, cu_seqlens, cu_seqlens_padded, silu,
                            y, final_state):
    """Writes y [T, D] and final_state [N, D, W-1] (every element)."""
    W = weight.shape[1]
    R, xp, w, b, h0 = _prepare(x, weight, bias, initial_state, cu_seqlens, cu_seqlens_padded)
    z = _preact(R, xp, w, b, h0, W)
    out = F.silu(z) if silu else z
    y.copy_(torch.where(R.real[:, None], out, torch.zeros_like(out)))
    if W == 1 or R.N == 0:
        return
    j = torch.arange(W - 1, device=x.device)
    p = R.lens[:, None] - (W - 1) + j[None, :]                       # [N, W-1] source positions
    fx = xp[R.row_or_pad(R.base[:, None] + p, p >= 0)].permute(0, 2, 1)  # [N, D, W-1]
    if h0 is not None:
        idx = (W - 1 + p).clamp(0, W - 2)[:, None, :].expand(-1, x.shape[1], -1)
        fx = torch.where((p < 0)[:, None, :], h0.gather(2, idx), fx)
    final_state.copy_(fx)


def conv1d_varlen_bwd_torch(x, weight, bias, initial_state, cu_seqlens, cu_seqlens_padded, silu,
                            dy, dfinal, dx, dweight, dbias, dinitial_state):
    """Writes dx [T, D], dweight [D, W], dbias [D] and dinitial_state [N, D, W-1]."""
    W = weight.shape[1]
    R, xp, w, b, h0 = _prepare(x, weight, bias, initial_state, cu_seqlens, cu_seqlens_padded)
    z = _preact(R, xp, w, b, h0, W)
    g = dy.to(z.dtype)
    if silu:
        sig = torch.sigmoid(z)
        g = g * sig * (1 + z * (1 - sig))
    zero = torch.zeros_like(g)
    dz = torch.where(R.real[:, None], g, zero)
    dbias.copy_(dz.sum(0))
    # padding rows select 0 rather than multiply 0 by their input (NaN x 0 = NaN)
    dweight.copy_(torch.stack([torch.where(R.real[:, None], dz * _xin(R, xp, h0, W - 1 - k, W), zero).sum(0)
                               for k in range(W)], 1))

    dzp = _with_zero_row(dz)
    acc = torch.zeros_like(dz)
    for s in range(W):   # output t+s reads x[t] through tap W-1-s
        acc = acc + w[:, W - 1 - s] * dzp[R.row_or_pad(R.r + s, R.real & (R.pos + s < R.row_len))]
    df = None if dfinal is None or R.N == 0 or W == 1 else dfinal.to(z.dtype)
    if df is not None:   # x[t] is final-state column pos - len + W - 1 when that is >= 0
        jf = R.pos - R.row_len + W - 1
        term = df[R.seq, :, jf.clamp(0, W - 2)]
        acc = acc + torch.where((R.real & (jf >= 0))[:, None], term, torch.zeros_like(term))
    dx.copy_(acc)

    if W == 1 or R.N == 0:
        dinitial_state.zero_()
        return
    j = torch.arange(W - 1, device=x.device)
    p = j - (W - 1)                                            # virtual positions -(W-1)..-1
    dh = torch.zeros(R.N, W - 1, x.shape[1], dtype=dz.dtype, device=x.device)
    for s in range(W):
        q = p[None, :] + s                                     # output position reading p via tap W-1-s
        ok = (q >= 0) & (q < R.lens[:, None])
        dh = dh + w[:, W - 1 - s] * dzp[R.row_or_pad(R.base[:, None] + q, ok)]
    dh = dh.permute(0, 2, 1)
    if df is not None:   # a sequence shorter than W-1 passes initial-state columns to the final state
        jj = j[None, :] - R.lens[:, None]
        term = df.gather(2, jj.clamp(0, W - 2)[:, None, :].expand(-1, x.shape[1], -1))
        dh = dh + torch.where((jj >= 0)[:, None, :], term, torch.zeros_like(term))
    dinitial_state.copy_(dh)


def causal_conv1d_ref(x, weight, bias=None, activation="silu", cu_seqlens=None, cu_seqlens_padded=None,
                      initial_state=None):
    """Reference: F.conv1d run per sequence, unpacked, in float64 (differentiable).

    x [1, T, D] (or [B, L, D] without cu_seqlens), weight [D, W]. Returns (y float64 with exact zeros
    on padding rows, final_state float64 [N, D, W-1])."""
    B, T, D = x.shape
    W = weight.shape[-1]
    wt = weight.reshape(D, 1, W).double()
    b = None if bias is None else bias.double()
    if cu_seqlens is None:
        cu = list(range(0, B * T + 1, T))
        xs = x.reshape(B * T, D)
    else:
        cu = cu_seqlens.tolist()
        xs = x[0]
    pad = cu if cu_seqlens_padded is None else cu_seqlens_padded.tolist()
    rows, pieces, finals, pos = xs.shape[0], [], [], 0
    for i in range(len(cu) - 1):
        s, n = pad[i], cu[i + 1] - cu[i]
        pieces.append(xs.new_zeros(s - pos, D, dtype=torch.float64))
        seq = xs[s:s + n].double().t()                                   # [D, n]
        prev = (initial_state[i].double() if initial_state is not None
                else seq.new_zeros(D, W - 1))
        full = torch.cat([prev, seq], 1)                                  # [D, W-1+n]
        out = (F.conv1d(full[None], wt, b, groups=D)[0].t() if n > 0     # [n, D]
               else full.new_zeros(0, D))
        pieces.append(F.silu(out) if activation == "silu" else out)
        finals.append(full[:, full.shape[1] - (W - 1):])
        pos = s + n
    pieces.append(xs.new_zeros(rows - pos, D, dtype=torch.float64))
    y = torch.cat(pieces).reshape(B, T, D)
    final = torch.stack(finals) if finals else xs.new_zeros(0, D, W - 1, dtype=torch.float64)
    return y, final
