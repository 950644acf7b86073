"""Norm modules of the layers: plain RMSNorm (pre-norms, q/k norms, final norm) and the gated RMSNorm
of the GDN output (the `gdn_packed::gated_rmsnorm_fwd` op)."""
import torch
import torch.nn.functional as F
from torch import nn

from gdn_packed.ops.gated_rmsnorm import gated_rmsnorm


class RMSNorm(nn.Module):
    """`x * rsqrt(mean(x^2) + eps) * weight` over the last dim, computed in float32."""

    def __init__(self, hidden_size, eps=1e-6, dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))

    def forward(self, x):
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """`rmsnorm(x) * weight * silu(z)` over the last dim (float32 math, output in x's dtype)."""

    def __init__(self, hidden_size, eps=1e-6, backend="auto", dtype=None, device=None):
        super().__init__()
        self.eps, self.backend = eps, backend
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))

    def forward(self, x, z, cu_seqlens=None, cu_seqlens_padded=None):
        """x, z [..., N]; with cu_seqlens (x packed [1, T, ..., N]) padding rows give exactly 0."""
        return gated_rmsnorm(x, z, self.weight, self.eps, backend=self.backend, cu_seqlens=cu_seqlens,
                             cu_seqlens_padded=cu_seqlens_padded)
