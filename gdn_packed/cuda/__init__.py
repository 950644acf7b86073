"""The Python host side of csrc/ (the cuda backend), as gdn_packed/triton/ is for the Triton kernels.

    launch.py       the one launcher of every gdn_packed._C entry point: tensors -> pointers (the
                    contiguous copies kept alive through the call), dtype codes, device and stream,
                    device launch or the `_host` mirror (the same per-thread bodies in a CPU loop)
    conv1d.py       the varlen causal conv1d, forward and backward (csrc/conv1d_varlen.cu)
    recurrent.py    the recurrent gated delta rule forward and its state-pool slot roles
                    (csrc/recurrent_gdr.cu)
    chunk_table.py  the chunk table (csrc/chunk_table.cu)
    chunk.py        the chunked gated delta rule on sm_90a: the forward (csrc/chunk_gdr_fwd_sm90.cu),
                    the backward's reverse dS pass (csrc/chunk_gdr_bwd_sm90.cu) and the backward that
                    runs it inside the Triton one; refusal(), why backend="cuda" does not take given inputs

gdn_packed/ops/ registers the custom ops, their fake kernels and autograd, and dispatches here for
backend="cuda". Every function takes host=True to run the host mirror on CPU tensors (tests).
"""
from gdn_packed.cuda.chunk import chunk_bwd_dstate_cuda, chunk_gdr_bwd_cuda, chunk_gdr_fwd_cuda, refusal
from gdn_packed.cuda.chunk_table import chunk_table_cuda
from gdn_packed.cuda.conv1d import BWD_TILE_ROWS, FWD_TILE_ROWS, conv1d_bwd_cuda, conv1d_fwd_cuda
from gdn_packed.cuda.recurrent import SLOT_LAST_WRITER, SLOT_OWN, SLOT_READ_ONLY, recurrent_fwd_cuda, slot_roles

__all__ = ["chunk_gdr_fwd_cuda", "chunk_gdr_bwd_cuda", "chunk_bwd_dstate_cuda", "refusal", "chunk_table_cuda", "conv1d_fwd_cuda", "conv1d_bwd_cuda", "FWD_TILE_ROWS", "BWD_TILE_ROWS",
           "recurrent_fwd_cuda", "slot_roles", "SLOT_OWN", "SLOT_READ_ONLY", "SLOT_LAST_WRITER"]
