"""gdn_packed: packed (THD, varlen) Gated DeltaNet kernels as torch custom ops.

Public API (docs/DESIGN.md section 4):
    chunk_gated_delta_rule            the chunked gated delta rule over cu_seqlens segments (fwd + bwd)
    fused_recurrent_gated_delta_rule  the token-by-token recurrence (decode; per-sequence or pooled
                                      states; forward only)
    causal_conv1d_varlen              the depthwise causal conv1d restarting at every sequence (fwd + bwd)
    gated_rmsnorm                     rmsnorm(x) * weight * silu(z), the GDN output gate (fwd + bwd)
    packing                           cu_seqlens helpers, pack/unpack, padded-storage layouts
    layers                            GatedDeltaNet, GatedAttention, HybridLM on packed input
    cuda_available(), cuda_unavailable_reason()
                                      whether the csrc/ kernels (gdn_packed._C) can run here, and why not
help() of each op lists its arguments, the backends it has and what backend="auto" picks.
"""
from gdn_packed import packing
from gdn_packed._cext import cuda_available, cuda_unavailable_reason
from gdn_packed.ops.chunk_gdr import chunk_gated_delta_rule
from gdn_packed.ops.conv1d import causal_conv1d_varlen
from gdn_packed.ops.recurrent_gdr import fused_recurrent_gated_delta_rule
from gdn_packed.ops.gated_rmsnorm import gated_rmsnorm
from gdn_packed import layers  # noqa: E402  (after the ops it is built on)

__version__ = "0.1.0"

__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "causal_conv1d_varlen",
           "gated_rmsnorm", "layers", "packing", "cuda_available", "cuda_unavailable_reason"]
