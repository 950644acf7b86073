"""What every op shares: output allocation (NaN-poisoned under gdn_packed.testing) and the choice of
backend. Backends: "torch" (pure PyTorch, any device), "triton" (GPU kernels; CPU tensors only under
the Triton interpreter), "cuda" (csrc/ through gdn_packed._C). Which function implements an op on
a backend is in the dispatch table, gdn_packed/ops/_dispatch.py. The schedule switch and the
compute dtype, which the kernels' host code reads too, are gdn_packed/_runtime.py's."""
import os
from contextlib import contextmanager

import torch

from gdn_packed._runtime import compute_dtype, device_schedule, host_schedule  # noqa: F401  (re-exported)

BACKENDS = ("auto", "torch", "triton", "cuda")
_poison = False


@contextmanager
def poisoned_outputs():
    """Within this block ops allocate their float outputs filled with NaN, so a row that no kernel
    writes shows up in tests."""
    global _poison
    old, _poison = _poison, True
    try:
        yield
    finally:
        _poison = old


def new_output(shape, dtype, device):
    if _poison and dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def triton_usable(device) -> str:
    """'' when Triton kernels can run on tensors of `device`, else the reason they cannot."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return ("backend='triton' needs the triton package, which is not installed: "
                "pip install 'gdn_packed[triton]' (or pip install triton), or use backend='torch'")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        return ("backend='triton' on CPU tensors needs the Triton interpreter: set TRITON_INTERPRET=1 "
                "before importing triton, or use backend='torch'")
    if device.type not in ("cpu", "cuda"):
        return f"backend='triton' does not run on {device.type} tensors"
    return ""


def resolve_backend(backend, device, *, have=("torch",), refuse=None):
    """Map the user's backend string to one this op implements on `device`.

    `have` lists the backends the op has kernels for, fastest GPU one first (gdn_packed.ops.BACKENDS).
    `refuse(b)` says whether backend b takes this particular input (dtype, head dim, ...): None when
    it does, else the exception naming the argument. A backend asked by name raises it; "auto" passes
    over a refused backend, down to "torch", which takes every input (it is never asked)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        if device.type == "cuda":
            for b in have:
                if b != "torch" and backend_usable(b, device) and (refuse is None or refuse(b) is None):
                    return b
        return "torch"
    if backend not in have:
        raise NotImplementedError(f"backend={backend!r} is not implemented for this op yet; "
                                  f"available: {', '.join(have)}")
    if backend == "triton":
        why = triton_usable(device)
        if why:
            raise RuntimeError(why)
    if backend == "cuda":
        if device.type != "cuda":
            raise ValueError(f"backend='cuda' needs CUDA tensors, got tensors on {device}")
        if not _cuda_ok():
            from gdn_packed._cext import cuda_unavailable_reason
            raise RuntimeError(f"backend='cuda' is unavailable: {cuda_unavailable_reason()}")
    error = None if refuse is None or backend == "torch" else refuse(backend)
    if error is not None:
        raise error
    return backend


def refuse_float64(x):
    """`refuse` for an op whose triton kernels compute in float32 at most: float64 input x with
    backend="triton" is a TypeError naming the dtype; "auto" then picks "torch" (exact float64)."""
    def refuse(backend):
        if backend == "triton" and x.dtype == torch.float64:
            return TypeError(f"backend='triton' computes in float32 and does not take float64 inputs, "
                             f"got {x.dtype}; use backend='torch' (exact float64) or cast to float32")
        return None
    return refuse


def backend_usable(backend, device) -> bool:
    """Whether `backend` can run on tensors of `device` on this machine (torch always; triton on CUDA,
    or on CPU under the interpreter; cuda with gdn_packed._C and CUDA tensors)."""
    if backend == "triton":
        return not triton_usable(device)
    if backend == "cuda":
        return device.type == "cuda" and _cuda_ok()
    return backend == "torch"


def _cuda_ok():
    from gdn_packed._cext import cuda_available
    return cuda_available()
