"""Custom-op registration and dispatch, one module per op (namespace `gdn_packed`).

BACKENDS maps each public op to the backends it has kernels for (fastest GPU one first); "auto" picks
among them (gdn_packed.ops._common.resolve_backend). Layers and the bench read it from here.
"""
BACKENDS = {
    "chunk_gated_delta_rule": ("triton", "torch"),
    "fused_recurrent_gated_delta_rule": ("cuda", "torch"),
    "causal_conv1d_varlen": ("cuda", "torch"),
    "gated_rmsnorm": ("torch", "triton"),
}
