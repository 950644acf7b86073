"""A small hybrid GDN/attention language model that runs packed end to end.

    HybridLM:    embed -> HybridStack -> lm_head
    HybridStack: for each letter of `pattern` ("G" GatedDeltaNet, "A" GatedAttention) a pre-norm block
                 h = h + mixer(norm(h));  h = h + SwiGLU(norm(h));   then a final RMSNorm

Padding compaction: a padded batch [B, L] with an attention mask is packed ONCE at the entry (only
the real tokens go through embedding, every layer and the head) and unpacked at the exit. Packed
input ([1, T] with cu_seqlens, optionally stored with cu_seqlens_padded alignment padding) runs as
is; its padding rows are zeroed at the entry, stay 0 through every block (mixers write 0 there,
RMSNorm(0) = SwiGLU(0) = 0) and get zero gradient.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gdn_packed import packing
from gdn_packed.layers._batch import as_packed, check_packed, zero_padding_rows
from gdn_packed.layers.attention import GatedAttention
from gdn_packed.layers.gated_deltanet import GatedDeltaNet
from gdn_packed.layers.norms import RMSNorm


@dataclass
class HybridConfig:
    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    pattern: str = "GGGA"
    rms_norm_eps: float = 1e-6
    # GatedDeltaNet
    num_k_heads: int = 2
    num_v_heads: int = 4
    head_k_dim: int = 32
    head_v_dim: int = 32
    conv_kernel: int = 4
    A_init_range: tuple = (1.0, 16.0)   # A = exp(A_log) ~ U(range), Megatron's default
    # GatedAttention
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    partial_rotary_factor: float = 0.25
    rope_theta: float = 10000.0
    init_std: float = 0.02
    backend: str = "auto"        # GDN kernels (chunk_gated_delta_rule, conv, gated RMSNorm)
    attn_backend: str = "auto"   # see gdn_packed.layers.attention


class SwiGLU(nn.Module):
    def __init__(self, hidden_size, intermediate_size, init_std=0.02, out_init_std=0.02, dtype=None, device=None):
        super().__init__()
        kw = dict(bias=False, dtype=dtype, device=device)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, **kw)
        for lin, std in ((self.gate_proj, init_std), (self.up_proj, init_std), (self.down_proj, out_init_std)):
            nn.init.normal_(lin.weight, 0.0, std)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class HybridBlock(nn.Module):
    def __init__(self, kind, cfg: HybridConfig, out_init_std, dtype=None, device=None):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.kind = kind
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        if kind == "G":
            self.mixer = GatedDeltaNet(cfg.hidden_size, cfg.num_k_heads, cfg.num_v_heads, cfg.head_k_dim,
                                       cfg.head_v_dim, cfg.conv_kernel, cfg.rms_norm_eps, init_std=cfg.init_std,
                                       A_init_range=cfg.A_init_range, backend=cfg.backend, **kw)
            nn.init.normal_(self.mixer.out_proj.weight, 0.0, out_init_std)
        elif kind == "A":
            self.mixer = GatedAttention(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                        cfg.partial_rotary_factor, cfg.rope_theta, cfg.rms_norm_eps,
                                        init_std=cfg.init_std, backend=cfg.attn_backend, **kw)
            nn.init.normal_(self.mixer.o_proj.weight, 0.0, out_init_std)
        else:
            raise ValueError(f"layer pattern letters must be 'G' (GatedDeltaNet) or 'A' (GatedAttention), "
                             f"got {kind!r}")
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, cfg.init_std, out_init_std, **kw)

    def forward_packed(self, h, cu_seqlens, cu_seqlens_padded=None, max_seqlen=None):
        h = h + self.mixer.mix(self.input_norm(h), cu_seqlens, cu_seqlens_padded, max_seqlen=max_seqlen)
        return h + self.mlp(self.mlp_norm(h))


class HybridStack(nn.Module):
    """The blocks of `cfg.pattern` and a final RMSNorm, on hidden states [B, L, hidden] (+ mask) or
    packed [1, T, hidden] (+ cu_seqlens, cu_seqlens_padded)."""

    def __init__(self, cfg: HybridConfig, dtype=None, device=None):
        super().__init__()
        out_std = cfg.init_std / (2 * max(1, len(cfg.pattern))) ** 0.5
        self.layers = nn.ModuleList(HybridBlock(c, cfg, out_std, dtype, device) for c in cfg.pattern)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, device=device)

    def forward(self, hidden_states, cu_seqlens=None, *, cu_seqlens_padded=None, attention_mask=None,
                max_seqlen=None):
        hp, cu, cu_pad, restore = as_packed(hidden_states, cu_seqlens, cu_seqlens_padded, attention_mask)
        return restore(self.forward_packed(hp, cu, cu_pad, max_seqlen=max_seqlen))

    def forward_packed(self, h, cu_seqlens, cu_seqlens_padded=None, *, max_seqlen=None):
        check_packed(h, cu_seqlens, cu_seqlens_padded)
        h = zero_padding_rows(h, cu_seqlens, cu_seqlens_padded)
        for layer in self.layers:
            h = layer.forward_packed(h, cu_seqlens, cu_seqlens_padded, max_seqlen)
        return self.norm(h)


class HybridLM(nn.Module):
    """Embedding, HybridStack, LM head. forward(input_ids [B, L] + attention_mask, or [1, T] +
    cu_seqlens (+ cu_seqlens_padded), or [B, L] alone) -> logits [..., vocab_size] in the same layout
    (0 on padding positions)."""

    def __init__(self, cfg: HybridConfig, dtype=None, device=None):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.stack = HybridStack(cfg, dtype, device)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype, device=device)
        nn.init.normal_(self.embed.weight, 0.0, cfg.init_std)
        nn.init.normal_(self.lm_head.weight, 0.0, cfg.init_std)

    def forward(self, input_ids, cu_seqlens=None, *, cu_seqlens_padded=None, attention_mask=None,
                max_seqlen=None):
        ids, cu, cu_pad, restore = as_packed(input_ids, cu_seqlens, cu_seqlens_padded, attention_mask)
        h = self.stack.forward_packed(self.embed(ids), cu, cu_pad, max_seqlen=max_seqlen)
        return restore(self.lm_head(h))


def next_token_targets(input_ids, cu_seqlens=None, *, cu_seqlens_padded=None, attention_mask=None,
                       ignore_index=-100):
    """Next-token labels in input_ids' layout: the id of the next token of the same sequence, and
    `ignore_index` at the last token of every sequence and on padding. No host sync for packed input."""
    ids, cu, cu_pad, restore = as_packed(input_ids, cu_seqlens, cu_seqlens_padded, attention_mask)
    R = ids.shape[1]
    seq = packing.token_seq_ids(cu, cu_pad, total_rows=R)
    tgt = torch.full_like(ids[0], ignore_index)
    if R > 1:
        same = (seq[1:] == seq[:-1]) & (seq[:-1] >= 0)
        tgt[:-1] = torch.where(same, ids[0, 1:], tgt[:-1])
    out = restore(tgt[None])
    if attention_mask is not None:
        out = torch.where(attention_mask.bool(), out, torch.full_like(out, ignore_index))
    return out
