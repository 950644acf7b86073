"""Triton kernels (GPU; CPU tensors only under TRITON_INTERPRET=1). Kernel families:
chunk_fwd (forward of the chunked gated delta rule), segments (shared chunk-table index logic);
chunk holds their host-side launch code and config heuristic."""
