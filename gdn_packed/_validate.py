"""Input checks shared by every public op. They run in Python before any launch and never read a
tensor's values back to the host; value checks that need the values (monotonic cu_seqlens, offsets
within the tensor) run only when the caller asks: `validate=True` or GDN_PACKED_VALIDATE=1."""
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


def check_cu_seqlens_meta(cu_seqlens, name: str = "cu_seqlens") -> None:
    """Metadata-only checks (type, dtype, rank, size). Never synchronises."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.numel() < 1:
        raise ValueError(f"{name} must have at least 1 element (it is [N+1] for N sequences), got 0")


def check_padded_meta(cu_seqlens, cu_seqlens_padded, name: str, padded_name: str) -> None:
    if not isinstance(cu_seqlens_padded, torch.Tensor):
        raise TypeError(
            f"{padded_name} must be a torch.Tensor, got {type(cu_seqlens_padded).__name__}")
    if cu_seqlens_padded.dtype != cu_seqlens.dtype:
        raise TypeError(
            f"{padded_name} must have the same dtype as {name}: "
            f"got {cu_seqlens_padded.dtype} and {cu_seqlens.dtype}")
    if cu_seqlens_padded.shape != cu_seqlens.shape:
        raise ValueError(
            f"{padded_name} must have the same shape as {name}: "
            f"got {tuple(cu_seqlens_padded.shape)} and {tuple(cu_seqlens.shape)}")
    if cu_seqlens_padded.device != cu_seqlens.device:
        raise ValueError(
            f"{padded_name} must be on the same device as {name}: "
            f"got {cu_seqlens_padded.device} and {cu_seqlens.device}")


def check_cu_seqlens(cu_seqlens, cu_seqlens_padded, batch, device):
    """Static checks of a cu_seqlens pair; returns N, the number of sequences."""
    if cu_seqlens is None:
        if cu_seqlens_padded is not None:
            raise ValueError("cu_seqlens_padded needs cu_seqlens (the real lengths) as well")
        return batch
    check_cu_seqlens_meta(cu_seqlens)
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but the other inputs are on {device}")
    if batch != 1:
        raise ValueError(f"inputs must have batch size 1 when cu_seqlens is given, got batch {batch}")
    if cu_seqlens_padded is not None:
        check_padded_meta(cu_seqlens, cu_seqlens_padded, "cu_seqlens", "cu_seqlens_padded")
    return cu_seqlens.numel() - 1


def check_cu_seqlens_values(cu_seqlens, cu_seqlens_padded, total_rows):
    """Value checks (reads cu_seqlens on the host): only with validate=True."""
    from gdn_packed.packing import validate_cu_seqlens
    validate_cu_seqlens(cu_seqlens, cu_seqlens_padded, total_rows=total_rows)
