"""The one launcher of gdn_packed._C's kernel entry points (csrc/bindings.cpp).

    launch(entry, device, host=False, reads={...}, writes={...}, **scalars)

`reads` are the tensors a kernel reads: each is made contiguous here and the copy is held until the
call returns (it runs asynchronously on the stream, which orders it before any later free). `writes`
are the outputs it fills in place: they must be contiguous already. None is a null pointer. A
torch.dtype among the scalars becomes its dtype code. host=False launches on the current stream of
`device` (a CUDA device); host=True calls the `<entry>_host` mirror on CPU tensors.

    check_tensors(name=(tensor, shape, dtypes), ...)

is what every launcher runs first: the kernels trust the sizes they are given, so a tensor smaller
than they say would be read or written past its end. Only metadata is read (no host sync).
check_offsets / offsets64 (cu_seqlens and cu_seqlens_padded checked; in int64) and as_dtype (a
None-safe cast) are the rest of the plumbing the launchers share.
"""
from __future__ import annotations

import torch

from gdn_packed.segments import check_cu_seqlens_meta, check_padded_meta

# dtype codes of csrc/dtypes.cuh (enum DType)
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def dtype_code(dtype: torch.dtype) -> int:
    if dtype not in DTYPE_CODES:
        raise TypeError(f"the cuda backend takes float32, float16 or bfloat16, got {dtype}")
    return DTYPE_CODES[dtype]


# the element types of the csrc/ kernels' activations (q, k, v, o; x, y, ...)
KERNEL_DTYPES = tuple(DTYPE_CODES)


def check_tensors(**specs):
    """Each name=(tensor, shape, dtypes): an absent tensor (None) passes; otherwise a ValueError
    naming it unless it has `shape` (a None entry: any size), a TypeError unless its dtype is
    `dtypes` (a dtype or a tuple of them; None: any floating dtype, for inputs the launcher
    converts itself)."""
    for name, (t, shape, dtypes) in specs.items():
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if len(t.shape) != len(shape):
            raise ValueError(f"{name} must be {len(shape)}-D, got shape {tuple(t.shape)}")
        if any(want is not None and n != want for n, want in zip(t.shape, shape)):
            raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
        allowed = (dtypes,) if isinstance(dtypes, torch.dtype) else dtypes
        if allowed is None and not t.dtype.is_floating_point or allowed is not None and t.dtype not in allowed:
            want = "a floating dtype" if allowed is None else " or ".join(map(str, allowed))
            raise TypeError(f"{name} must have dtype {want}, got {t.dtype}")


def check_offsets(cu_seqlens, cu_seqlens_padded):
    """The metadata checks of cu_seqlens [N+1] and cu_seqlens_padded (int32/int64); returns N."""
    check_cu_seqlens_meta(cu_seqlens)
    if cu_seqlens_padded is not None:
        check_padded_meta(cu_seqlens, cu_seqlens_padded)
    return cu_seqlens.shape[0] - 1


def offsets64(cu_seqlens, cu_seqlens_padded):
    """(cu_seqlens, cu_seqlens_padded or None) checked (check_offsets) and in int64, the index type of
    the conv and recurrent kernels, and N."""
    N = check_offsets(cu_seqlens, cu_seqlens_padded)
    return cu_seqlens.to(torch.int64), as_dtype(cu_seqlens_padded, torch.int64), N


def as_dtype(t, dtype):
    """t in `dtype` (t itself when it has it); None stays None (an absent optional input)."""
    return None if t is None else t.to(dtype)


def _pointer(name, t, device, *, output):
    if t is None:
        return None
    if t.device != device:
        raise ValueError(f"{name} must be on {device} for this launch, got a tensor on {t.device}")
    if output and not t.is_contiguous():
        raise ValueError(f"{name} is written in place by the kernel and must be contiguous")
    return t.data_ptr()


def launch(entry: str, device: torch.device, *, host: bool = False, reads: dict, writes: dict, **scalars):
    """Call gdn_packed._C.<entry> (or <entry>_host when host) with keyword arguments."""
    from gdn_packed import _cext   # loads _C on the first launch, not at import

    C = _cext.get_C()
    if C is None:
        raise RuntimeError(f"gdn_packed._C is needed for {entry}: {_cext.cuda_unavailable_reason()}")
    device = torch.device("cpu") if host else torch.device(device)
    if not host:
        if device.type != "cuda":
            raise ValueError(f"{entry} launches on a CUDA device, got {device} (host=True runs the host mirror)")
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    copies = {name: None if t is None else t.contiguous() for name, t in reads.items()}   # alive until return
    args = {name: _pointer(name, t, device, output=False) for name, t in copies.items()}
    args.update({name: _pointer(name, t, device, output=True) for name, t in writes.items()})
    args.update({k: dtype_code(v) if isinstance(v, torch.dtype) else v for k, v in scalars.items()})
    if host:
        getattr(C, entry + "_host")(**args)
    else:
        with torch.cuda.device(device):
            getattr(C, entry)(**args, device=device.index, stream=torch.cuda.current_stream(device).cuda_stream)
