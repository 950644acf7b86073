"""The Gated DeltaNet block (Qwen3-Next / Megatron-Core layout) on packed input.

    in_proj:   x [., hidden] -> q | k | v | z | b | a      (Hk*Dk, Hk*Dk, Hv*Dv, Hv*Dv, Hv, Hv)
    conv:      q | k | v  <- SiLU(varlen causal depthwise conv, width W), restarting at every sequence
    core:      o = chunk_gated_delta_rule(q, k, v, g, beta, l2-normalised q/k, native GVA), with the
               gates g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b) computed inside the op
               from the raw a, b (float32)
    out:       out_proj(rmsnorm(o) * out_norm.weight * silu(z))   (norm over the value head dim)

Padding rows of a packed input are replaced by 0 on entry (by selection, torch.where), so whatever
they hold (NaN/Inf included) the output is exactly 0 there, their input gradient is 0 and no parameter
gradient sees them; every op below also skips padding rows itself.

Parameter names and shapes are those of Megatron-Core 0.19.2's `GatedDeltaNet` (bias=False,
conv_bias=False by default), so its state dicts load one to one:
    in_proj.weight [2*Hk*Dk + 2*Hv*Dv + 2*Hv, hidden]   conv1d.weight [2*Hk*Dk + Hv*Dv, 1, W]
    conv1d.bias [2*Hk*Dk + Hv*Dv] (conv_bias=True only)  A_log, dt_bias [Hv]
    out_norm.weight [Dv]                                 out_proj.weight [hidden, Hv*Dv]
`hf_qwen3_next_gdn_state_dict` converts HF Qwen3-Next / Qwen3.5 `linear_attn` weights to these names.
"""
from typing import NamedTuple, Optional

import torch
from torch import Tensor, nn

from gdn_packed.layers._batch import as_packed, zero_padding_rows
from gdn_packed.layers.norms import GatedRMSNorm
from gdn_packed.ops import BACKENDS
from gdn_packed.ops.chunk_gdr import chunk_gated_delta_rule
from gdn_packed.ops.conv1d import causal_conv1d_varlen


class GDNState(NamedTuple):
    """Per-sequence state of a GDN block: conv [N, 2*Hk*Dk + Hv*Dv, W-1] (the last W-1 conv inputs,
    oldest first) and recurrent [N, Hv, Dk, Dv] float32."""
    conv: Optional[Tensor]
    recurrent: Optional[Tensor]


def _for_op(backend, have):
    """The GDN kernels follow `backend`; an op without that backend uses its own "auto" choice."""
    return backend if backend == "auto" or backend in have else "auto"


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet mixer. Input: packed [1, T, hidden] with cu_seqlens (+ cu_seqlens_padded), padded
    [B, L, hidden] with attention_mask [B, L], or [B, L, hidden] alone (each row one sequence).
    Output: same shape as the input; padding rows are 0."""

    def __init__(self, hidden_size, num_k_heads, num_v_heads, head_k_dim, head_v_dim, conv_kernel=4,
                 layer_norm_eps=1e-6, dtype=None, device=None, *, conv_bias=False,
                 A_init_range=(1.0, 16.0), init_std=0.02, backend="auto"):
        super().__init__()
        if num_v_heads % num_k_heads != 0:
            raise ValueError(f"num_v_heads ({num_v_heads}) must be a multiple of num_k_heads ({num_k_heads})")
        kw = dict(dtype=dtype, device=device)
        self.hidden_size = hidden_size
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.conv_kernel, self.backend = conv_kernel, backend
        self.A_init_range, self.init_std = A_init_range, init_std
        self.qk_dim, self.v_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.qk_dim + self.v_dim
        self.in_proj = nn.Linear(hidden_size, 2 * self.qk_dim + 2 * self.v_dim + 2 * num_v_heads,
                                 bias=False, **kw)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim,
                                padding=conv_kernel - 1, bias=conv_bias, **kw)  # holds weight [C, 1, W]
        self.A_log = nn.Parameter(torch.empty(num_v_heads, **kw))
        self.dt_bias = nn.Parameter(torch.empty(num_v_heads, **kw))
        self.out_norm = GatedRMSNorm(head_v_dim, eps=layer_norm_eps,
                                     backend=_for_op(backend, BACKENDS["gated_rmsnorm"]), **kw)
        self.out_proj = nn.Linear(self.v_dim, hidden_size, bias=False, **kw)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        """Megatron's init: in/out_proj N(0, init_std), conv PyTorch's default, dt_bias 1,
        A_log = log(U(A_init_range)), out_norm.weight 1."""
        nn.init.normal_(self.in_proj.weight, 0.0, self.init_std)
        nn.init.normal_(self.out_proj.weight, 0.0, self.init_std)
        self.conv1d.reset_parameters()
        self.dt_bias.fill_(1.0)
        A = torch.empty(self.num_v_heads, dtype=torch.float32, device=self.A_log.device)
        self.A_log.copy_(torch.log(A.uniform_(*self.A_init_range)))
        self.out_norm.weight.fill_(1.0)

    def forward(self, x, cu_seqlens=None, *, cu_seqlens_padded=None, attention_mask=None,
                initial_state=None, output_final_state=False):
        """x -> y (same shape), or (y, GDNState) with output_final_state. initial_state: a GDNState
        (either part may be None) with one entry per sequence (N = len(cu_seqlens) - 1, or B)."""
        xp, cu, cu_pad, restore = as_packed(x, cu_seqlens, cu_seqlens_padded, attention_mask)
        y, state = self.forward_packed(xp, cu, cu_pad, initial_state, output_final_state)
        y = restore(y)
        return (y, state) if output_final_state else y

    def mix(self, x, cu_seqlens, cu_seqlens_padded=None, *, max_seqlen=None):
        """x [1, R, hidden] packed rows -> y [1, R, hidden]: the mixer contract of gdn_packed.layers
        (GatedAttention.mix too; HybridBlock calls it). max_seqlen is part of that contract and not
        needed here. No host sync."""
        return self.forward_packed(x, cu_seqlens, cu_seqlens_padded)[0]

    def forward_packed(self, x, cu_seqlens, cu_seqlens_padded=None, initial_state=None,
                       output_final_state=False):
        """x [1, R, hidden] packed rows -> (y [1, R, hidden], GDNState or None unless
        output_final_state). No host sync."""
        Hk, Hv, Dk, Dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        conv0, rec0 = (None, None) if initial_state is None else initial_state
        x = zero_padding_rows(x, cu_seqlens, cu_seqlens_padded)
        qkv, z, b, a = self.in_proj(x).split([self.conv_dim, self.v_dim, Hv, Hv], dim=-1)
        qkv, conv_state = causal_conv1d_varlen(
            qkv, self.conv1d.weight, self.conv1d.bias, activation="silu", cu_seqlens=cu_seqlens,
            cu_seqlens_padded=cu_seqlens_padded, initial_state=conv0, output_final_state=output_final_state,
            backend=_for_op(self.backend, BACKENDS["causal_conv1d_varlen"]))
        q, k, v = qkv.split([self.qk_dim, self.qk_dim, self.v_dim], dim=-1)
        # the op computes g = -exp(A_log) softplus(a + dt_bias) and beta = sigmoid(b) in fp32 itself
        o, rec_state = chunk_gated_delta_rule(
            q.unflatten(-1, (Hk, Dk)), k.unflatten(-1, (Hk, Dk)), v.unflatten(-1, (Hv, Dv)), a, b,
            initial_state=rec0, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
            cu_seqlens_padded=cu_seqlens_padded, use_qk_l2norm_in_kernel=True, backend=self.backend,
            A_log=self.A_log, dt_bias=self.dt_bias)
        o = self.out_norm(o, z.unflatten(-1, (Hv, Dv)), cu_seqlens, cu_seqlens_padded)
        y = self.out_proj(o.flatten(-2))
        return y, (GDNState(conv_state, rec_state) if output_final_state else None)

    def load_hf_state_dict(self, state_dict, strict=True):
        """Load HF Qwen3-Next / Qwen3.5 `linear_attn.*` weights (names without the prefix)."""
        return self.load_state_dict(hf_qwen3_next_gdn_state_dict(
            state_dict, self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim), strict=strict)

    def extra_repr(self):
        return (f"hidden={self.hidden_size}, k_heads={self.num_k_heads}x{self.head_k_dim}, "
                f"v_heads={self.num_v_heads}x{self.head_v_dim}, conv={self.conv_kernel}, backend={self.backend!r}")


def hf_qwen3_next_gdn_state_dict(sd, num_k_heads, num_v_heads, head_k_dim, head_v_dim):
    """HF `linear_attn` weights -> GatedDeltaNet (Megatron) names.

    Qwen3-Next: in_proj_qkvz.weight rows are grouped per k-head, [Hk, (Dk | Dk | G*Dv | G*Dv)] with
    G = Hv / Hk, and in_proj_ba.weight rows [Hk, (G | G)]; both are regrouped into the flat
    q | k | v | z | b | a order of in_proj.weight. Qwen3.5: in_proj_qkv, in_proj_z, in_proj_b,
    in_proj_a are already flat and are concatenated. conv1d.weight (channels q | k | v), A_log,
    dt_bias and out_proj.weight keep their names; norm.weight becomes out_norm.weight.
    """
    Hk, G, Dk, Dv = num_k_heads, num_v_heads // num_k_heads, head_k_dim, head_v_dim
    out = {}
    if "in_proj_qkvz.weight" in sd:
        qkvz = sd["in_proj_qkvz.weight"]
        hidden = qkvz.shape[-1]
        q, k, v, z = qkvz.view(Hk, 2 * Dk + 2 * G * Dv, hidden).split([Dk, Dk, G * Dv, G * Dv], dim=1)
        b, a = sd["in_proj_ba.weight"].view(Hk, 2 * G, hidden).split([G, G], dim=1)
        parts = [p.reshape(-1, hidden) for p in (q, k, v, z, b, a)]
    else:
        parts = [sd[f"in_proj_{n}.weight"] for n in ("qkv", "z", "b", "a")]
    out["in_proj.weight"] = torch.cat(parts, dim=0)
    for name in ("conv1d.weight", "conv1d.bias", "A_log", "dt_bias", "out_proj.weight"):
        if name in sd:
            out[name] = sd[name]
    out["out_norm.weight"] = sd["norm.weight"]
    return out
