"""Triton kernels (GPU; CPU tensors only under TRITON_INTERPRET=1, which is how the tests run them).

    chunk.py            host side of the chunked gated delta rule: launch configs, the forward and
                        backward entry points that gdn_packed.ops.chunk_gdr dispatches to
    chunk_fwd.py        forward kernels of the chunked gated delta rule
    chunk_bwd.py        backward kernels (reverse state pass, chunk-parallel grads, finalize) and the
                        backward's launch sequence
    chunk_gate.py       the gating from raw a, b (g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b))
    gated_rmsnorm.py    the fused gated RMSNorm, forward and backward
    segments.py         chunk-table and padding-row index logic shared by the kernels
Which kernels run, their grids and what they store in between: docs/DESIGN.md section 11.
"""
