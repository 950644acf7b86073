"""The one dispatch table: public op -> backend -> the functions that implement it.

Each implementation is a string "module:function" imported on first use, so importing gdn_packed
never imports triton or loads gdn_packed._C. The backends of an op are listed fastest GPU one first;
gdn_packed.ops.BACKENDS (the public table) is derived from this one, and `kernel` is how the
registered ops find the function for the backend they were given (resolved by
gdn_packed.ops._common.resolve_backend in the public function).

The parts of an op ("fwd", "bwd", "gate_fwd", ...; "kept_shape" where the forward keeps
something for its backward) take the arguments documented in the module of
its torch implementation (gdn_packed/torch_ref/*.py). "fwd_raw", where a backend has it, is a forward
that takes the raw gate inputs a, b in g's and beta's places and A_log=, dt_bias= keywords and forms
the gates itself (no "gate_fwd" launch before it).
"""
from functools import lru_cache
from importlib import import_module

TABLE = {
    "chunk_gated_delta_rule": {
        "triton": {
            "fwd": "gdn_packed.triton.chunk:chunk_gdr_fwd_triton",
            "bwd": "gdn_packed.triton.chunk:chunk_gdr_bwd_triton",
            "kept_shape": "gdn_packed.triton.chunk:kept_shape",
            "gate_fwd": "gdn_packed.triton.chunk_gate:gate_fwd_triton",
            "gate_bwd": "gdn_packed.triton.chunk_gate:gate_bwd_triton",
        },
        # opt-in only: "auto" does not pick it until tools/gpu_check.py has passed it on an H200
        # (ops/chunk_gdr.py); its backward is the Triton one on the prep outputs the forward kept, with
        # its reverse dS pass the sm_90a kernel's (gdn_packed/cuda/chunk.py)
        "cuda": {
            "fwd": "gdn_packed.cuda.chunk:chunk_gdr_fwd_cuda",
            "fwd_raw": "gdn_packed.cuda.chunk:chunk_gdr_fwd_cuda",
            "bwd": "gdn_packed.cuda.chunk:chunk_gdr_bwd_cuda",
            "kept_shape": "gdn_packed.cuda.chunk:kept_shape",
            "gate_fwd": "gdn_packed.triton.chunk_gate:gate_fwd_triton",
            "gate_bwd": "gdn_packed.triton.chunk_gate:gate_bwd_triton",
        },
        "torch": {
            "fwd": "gdn_packed.torch_ref.chunk:chunk_gdr_fwd_torch",
            "bwd": "gdn_packed.torch_ref.chunk:chunk_gdr_bwd_torch",
            "gate_fwd": "gdn_packed.torch_ref.chunk:gate_fwd_torch",
            "gate_bwd": "gdn_packed.torch_ref.chunk:gate_bwd_torch",
            "kept_shape": "gdn_packed.torch_ref.chunk:kept_shape",
        },
    },
    "fused_recurrent_gated_delta_rule": {
        "cuda": {"fwd": "gdn_packed.cuda.recurrent:recurrent_fwd_cuda"},
        "torch": {"fwd": "gdn_packed.torch_ref.recurrent:recurrent_gdr_fwd_torch"},
    },
    "causal_conv1d_varlen": {
        "cuda": {
            "fwd": "gdn_packed.cuda.conv1d:conv1d_fwd_cuda",
            "bwd": "gdn_packed.cuda.conv1d:conv1d_bwd_cuda",
        },
        "torch": {
            "fwd": "gdn_packed.torch_ref.conv1d:conv1d_varlen_fwd_torch",
            "bwd": "gdn_packed.torch_ref.conv1d:conv1d_varlen_bwd_torch",
        },
    },
    # the chunk table of a packed tensor (ops/chunk_table.py; "fwd" is the whole op)
    "chunk_table": {
        "cuda": {"fwd": "gdn_packed.cuda.chunk_table:chunk_table_cuda"},
        "torch": {"fwd": "gdn_packed.torch_ref.chunk_table:chunk_table_torch"},
    },
    "gated_rmsnorm": {
        "torch": {
            "fwd": "gdn_packed.torch_ref.gated_rmsnorm:gated_rmsnorm_fwd_torch",
            "bwd": "gdn_packed.torch_ref.gated_rmsnorm:gated_rmsnorm_bwd_torch",
        },
        "triton": {
            "fwd": "gdn_packed.triton.gated_rmsnorm:gated_rmsnorm_fwd_triton",
            "bwd": "gdn_packed.triton.gated_rmsnorm:gated_rmsnorm_bwd_triton",
        },
    },
}


def backends(op):
    """The backends `op` has kernels for, fastest GPU one first."""
    return tuple(TABLE[op])


@lru_cache(maxsize=None)
def kernel(op, backend, part):
    """The function implementing `part` of `op` on `backend` (imported on first use)."""
    try:
        target = TABLE[op][backend][part]
    except KeyError:
        raise NotImplementedError(f"backend={backend!r} has no {part!r} for {op}; "
                                  f"available: {', '.join(backends(op))}") from None
    module, name = target.split(":")
    return getattr(import_module(module), name)
