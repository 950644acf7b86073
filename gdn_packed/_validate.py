"""Input checks shared by every public op. They run in Python before any launch and never read a
tensor's values back to the host. The checks of cu_seqlens / cu_seqlens_padded live in
gdn_packed/segments.py (which imports this module; this module imports no other gdn_packed module);
their value checks run only when the caller asks: `validate=True` or GDN_PACKED_VALIDATE=1."""
import math
import numbers
import os

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)


def want_validate(validate: bool) -> bool:
    return bool(validate) or os.environ.get("GDN_PACKED_VALIDATE", "0") not in ("", "0")


def check_tensor(name, x, *, dtypes=FLOAT_DTYPES, ndim=None, device=None):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if dtypes is not None and x.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({allowed}), got {x.dtype}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(x.shape)}")
    if device is not None and x.device != device:
        raise ValueError(f"{name} is on {x.device} but the other inputs are on {device}")


def check_shape(name, x, shape, what=""):
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}{what}, got {tuple(x.shape)}")


def check_int(value, name: str, minimum: int = 0) -> int:
    """value as an int (bools and non-integers are a TypeError), at least `minimum`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_float(value, name: str, minimum=None) -> float:
    """value as a finite float (bools and non-numbers are a TypeError; NaN, inf and values below
    `minimum` a ValueError)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_gdr_inputs(q, k, v, g, beta, max_head_dim):
    """Shapes, dtypes and devices of the gated-delta-rule inputs q, k [B, T, H, K], v [B, T, HV, V],
    g, beta [B, T, HV] (shared by the chunked and the recurrent op). Returns (B, T, H, HV, K, V)."""
    check_tensor("q", q, ndim=4)
    dev = q.device
    check_tensor("k", k, ndim=4, device=dev)
    check_tensor("v", v, ndim=4, device=dev)
    check_tensor("g", g, ndim=3, device=dev)
    check_tensor("beta", beta, ndim=3, device=dev)
    B, T, H, K = q.shape
    HV, Vd = v.shape[2], v.shape[3]
    check_shape("k", k, q.shape, " (the shape of q)")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if tuple(v.shape[:2]) != (B, T):
        raise ValueError(f"v must have batch and length {(B, T)} like q, got v.shape {tuple(v.shape)}")
    if H == 0 or HV % H != 0:
        raise ValueError(f"the number of value heads (v.shape[2] = {HV}) must be a positive multiple "
                         f"of the number of qk heads (q.shape[2] = {H})")
    for name, d in (("K (q.shape[3])", K), ("V (v.shape[3])", Vd)):
        if not 0 < d <= max_head_dim:
            raise ValueError(f"head dim {name} = {d} is outside the supported range 1..{max_head_dim}")
    check_shape("g", g, (B, T, HV), " ([B, T, HV] like v)")
    check_shape("beta", beta, (B, T, HV), " ([B, T, HV] like v)")
    return B, T, H, HV, K, Vd
