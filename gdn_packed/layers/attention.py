"""Gated full attention (Qwen3-Next style) on packed input.

    q | gate = q_proj(x)    (per head: [q (D) | gate (D)])      k = k_proj(x),  v = v_proj(x)
    q, k     = RMSNorm over the head dim, then rotary on the first rotary_dim = D * partial_rotary_factor
               dims, positions restarting at 0 at every sequence
    o        = causal attention within each sequence (grouped KV heads), 0 on padding rows
    y        = o_proj(o * sigmoid(gate))

Attention backends (`attn.backend` says which one runs):
    "flash_attn"   flash_attn.flash_attn_varlen_func (CUDA, when installed)
    "torch_varlen" torch.nn.attention.varlen.varlen_attn (CUDA)
    "sdpa"         scaled_dot_product_attention run once per sequence on its own rows (causal; any
                   device: the CPU path). It reads the sequence offsets on the host (free for CPU
                   tensors, one sync on CUDA, where the varlen backends are the default).
The varlen backends read max_seqlen on the host unless it is passed in (`max_seqlen=`).

Isolation: padding rows are replaced by 0 on entry (torch.where), and every backend computes a
sequence from its own rows only, so NaN/Inf in one document or in padding reaches no other document
(a dense block-diagonal mask would not do: the masked probabilities are 0, but 0 x NaN = NaN in P V).
"""
import inspect

import torch
import torch.nn.functional as F
from torch import nn

from gdn_packed import packing
from gdn_packed.layers._batch import as_packed, check_packed, zero_padding_rows
from gdn_packed.layers.norms import RMSNorm

ATTN_BACKENDS = ("auto", "flash_attn", "torch_varlen", "sdpa")


def _flash_attn_varlen():
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


def _torch_varlen():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def resolve_attn_backend(backend, device):
    if backend not in ATTN_BACKENDS:
        raise ValueError(f"attention backend must be one of {ATTN_BACKENDS}, got {backend!r}")
    if backend == "auto":
        if device.type == "cuda":
            if _flash_attn_varlen() is not None:
                return "flash_attn"
            if _torch_varlen() is not None:
                return "torch_varlen"
        return "sdpa"
    if backend in ("flash_attn", "torch_varlen"):
        if device.type != "cuda":
            raise ValueError(f"attention backend {backend!r} needs CUDA tensors, got {device}")
        if (_flash_attn_varlen if backend == "flash_attn" else _torch_varlen)() is None:
            raise RuntimeError(f"attention backend {backend!r} is not available in this environment")
    return backend


class RotaryEmbedding(nn.Module):
    """cos/sin tables [R, rotary_dim] (float32) for integer positions, HF's rotate-half convention."""

    def __init__(self, rotary_dim, theta=10000.0, device=None):
        super().__init__()
        if rotary_dim % 2:
            raise ValueError(f"rotary_dim must be even, got {rotary_dim}")
        inv_freq = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions):
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()


def apply_partial_rotary(x, cos, sin):
    """x [1, R, H, D]: rotate the first cos.shape[-1] dims of every head, keep the rest."""
    rd = cos.shape[-1]
    xr, xp = x[..., :rd].float(), x[..., rd:]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    x1, x2 = xr[..., : rd // 2], xr[..., rd // 2:]
    rotated = xr * c + torch.cat([-x2, x1], dim=-1) * s
    return torch.cat([rotated.to(x.dtype), xp], dim=-1)


class GatedAttention(nn.Module):
    """Causal self-attention with grouped KV heads, a sigmoid output gate, q/k RMSNorm and partial
    rotary embedding, over packed sequences. Same input layouts as GatedDeltaNet."""

    def __init__(self, hidden_size, num_heads, num_kv_heads, head_dim, partial_rotary_factor=0.25,
                 rope_theta=10000.0, rms_norm_eps=1e-6, dtype=None, device=None, *, init_std=0.02,
                 backend="auto"):
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if backend not in ATTN_BACKENDS:
            raise ValueError(f"attention backend must be one of {ATTN_BACKENDS}, got {backend!r}")
        kw = dict(dtype=dtype, device=device)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.requested_backend, self.init_std = backend, init_std
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim * 2, bias=False, **kw)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False, **kw)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False, **kw)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False, **kw)
        self.q_norm = RMSNorm(head_dim, rms_norm_eps, **kw)
        self.k_norm = RMSNorm(head_dim, rms_norm_eps, **kw)
        rotary_dim = int(head_dim * partial_rotary_factor) // 2 * 2
        self.rotary = RotaryEmbedding(rotary_dim, rope_theta, device=device)
        for lin in (self.q_proj, self.k_proj, self.v_proj, self.o_proj):
            nn.init.normal_(lin.weight, 0.0, init_std)

    @property
    def backend(self):
        """The attention backend that runs for this module's parameters' device."""
        return resolve_attn_backend(self.requested_backend, self.q_proj.weight.device)

    def forward(self, x, cu_seqlens=None, *, cu_seqlens_padded=None, attention_mask=None, max_seqlen=None):
        xp, cu, cu_pad, restore = as_packed(x, cu_seqlens, cu_seqlens_padded, attention_mask)
        return restore(self.forward_packed(xp, cu, cu_pad, max_seqlen=max_seqlen))

    def mix(self, x, cu_seqlens, cu_seqlens_padded=None, *, max_seqlen=None):
        """The mixer contract of gdn_packed.layers (GatedDeltaNet.mix too): forward_packed."""
        return self.forward_packed(x, cu_seqlens, cu_seqlens_padded, max_seqlen=max_seqlen)

    def forward_packed(self, x, cu_seqlens, cu_seqlens_padded=None, *, max_seqlen=None):
        """x [1, R, hidden] packed rows -> [1, R, hidden], 0 on padding rows."""
        check_packed(x, cu_seqlens, cu_seqlens_padded)
        R, H, Hkv, D = x.shape[1], self.num_heads, self.num_kv_heads, self.head_dim
        x = zero_padding_rows(x, cu_seqlens, cu_seqlens_padded)
        q, gate = self.q_proj(x).view(1, R, H, 2 * D).chunk(2, dim=-1)
        k = self.k_proj(x).view(1, R, Hkv, D)
        v = self.v_proj(x).view(1, R, Hkv, D)
        q, k = self.q_norm(q), self.k_norm(k)
        pos = packing.position_ids_from_cu_seqlens(cu_seqlens, cu_seqlens_padded, total_rows=R)
        cos, sin = self.rotary(pos)
        q, k = apply_partial_rotary(q, cos, sin), apply_partial_rotary(k, cos, sin)
        backend = self.backend
        if backend == "sdpa":
            o = _sdpa_per_sequence(q, k, v, cu_seqlens, cu_seqlens_padded)
        else:
            o = _varlen(backend, q, k, v, cu_seqlens, cu_seqlens_padded, max_seqlen)
        o = zero_padding_rows(o, cu_seqlens, cu_seqlens_padded)
        return self.o_proj(o.reshape(1, R, H * D) * torch.sigmoid(gate.reshape(1, R, H * D)))


def _sdpa_per_sequence(q, k, v, cu_seqlens, cu_seqlens_padded):
    """Causal SDPA of each sequence over its own rows (q [1, R, H, D], k, v [1, R, Hkv, D]); padding
    rows of the result are 0. Reads the offsets on the host."""
    R = q.shape[1]
    cu = cu_seqlens.tolist()
    starts = cu if cu_seqlens_padded is None else cu_seqlens_padded.tolist()
    outs, rows = [], []
    for s, n in zip(starts[:-1], (b - a for a, b in zip(cu[:-1], cu[1:]))):
        s, e = min(max(s, 0), R), min(max(s + n, 0), R)    # (unchecked device offsets: wrong, no crash)
        if e <= s:
            continue
        qs, ks, vs = (t[:, s:e].transpose(1, 2) for t in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True).transpose(1, 2))
        rows.append(torch.arange(s, e, device=q.device))
    o = q.new_zeros(q.shape)
    if not outs:
        return o
    return o.index_copy(1, torch.cat(rows), torch.cat(outs, dim=1))


def _varlen(backend, q, k, v, cu_seqlens, cu_seqlens_padded, max_seqlen):
    """flash_attn / torch varlen on the real rows (gathered from padded storage when needed)."""
    R = q.shape[1]
    cu = cu_seqlens.to(torch.int32)
    if max_seqlen is None:
        max_seqlen = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0  # host sync
    if cu_seqlens_padded is not None:
        q, k, v = (packing.from_padded_layout(t, cu_seqlens, cu_seqlens_padded, total=R) for t in (q, k, v))
    if backend == "flash_attn":
        o = _flash_attn_varlen()(q[0], k[0], v[0], cu, cu, max_seqlen, max_seqlen, causal=True)
    else:
        fn = _torch_varlen()
        params = inspect.signature(fn).parameters  # the keyword set changed between torch releases
        kw = dict(is_causal=True) if "is_causal" in params else dict(window_size=(-1, 0))
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:
            G = q.shape[2] // k.shape[2]
            k, v = k.repeat_interleave(G, dim=2), v.repeat_interleave(G, dim=2)
        o = fn(q[0], k[0], v[0], cu, cu, max_seqlen, max_seqlen, **kw)
    o = o.unsqueeze(0)
    if cu_seqlens_padded is not None:
        o = packing.to_padded_layout(o, cu_seqlens, cu_seqlens_padded, R)
    return o
