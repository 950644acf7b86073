"""Triton kernels (GPU; CPU tensors only under TRITON_INTERPRET=1, which is how the tests run them).

    chunk.py            launchers of the chunked gated delta rule: the forward and backward entry
                        points that gdn_packed.ops.chunk_gdr dispatches to
    configs.py          launch configs of every kernel (one heuristic on K, V, dtype, GPU; no autotune)
    common.py           jit helpers shared by the kernels: chunk table, padding rows, gate sums
    chunk_fwd.py        forward kernels of the chunked gated delta rule (prep, state pass)
    chunk_bwd.py        backward kernels
    chunk_bwd_state.py  the backward's reverse sequential pass over each sequence's chunks
    chunk_fwd_legacy.py the former forward kernels, used by the backward until it is reworked
    chunk_gate.py       the gating from raw a, b (g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b))
    gated_rmsnorm.py    the fused gated RMSNorm, forward and backward
Which kernels run, their grids and what they store in between: docs/DESIGN.md section 11.
"""
