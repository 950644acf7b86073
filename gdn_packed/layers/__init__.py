"""Layers built on the gdn_packed ops, all running on packed (cu_seqlens) rows:

    GatedDeltaNet   the GDN mixer (Megatron-Core parameter names), + GDNState, HF weight conversion
    GatedAttention  gated full attention with partial rotary, varlen over cu_seqlens
    HybridLM / HybridStack / HybridConfig   a small GDN/attention hybrid LM (pattern such as "GGGA")
    next_token_targets                      per-sequence next-token labels in any input layout
"""
from gdn_packed.layers.attention import GatedAttention
from gdn_packed.layers.gated_deltanet import GatedDeltaNet, GDNState, hf_qwen3_next_gdn_state_dict
from gdn_packed.layers.hybrid import HybridConfig, HybridLM, HybridStack, SwiGLU, next_token_targets
from gdn_packed.layers.norms import GatedRMSNorm, RMSNorm

__all__ = ["GatedDeltaNet", "GDNState", "hf_qwen3_next_gdn_state_dict", "GatedAttention", "HybridConfig",
           "HybridLM", "HybridStack", "SwiGLU", "next_token_targets", "GatedRMSNorm", "RMSNorm"]
