"""The one owner of the segment logic: what `cu_seqlens` / `cu_seqlens_padded` mean and how they are
checked (docs/DESIGN.md section 3).

* Metadata checks (`check_cu_seqlens_meta`, `check_padded_meta`, `check_cu_seqlens`): type, dtype,
  rank, size, device. They never read the values, so they never synchronise; every public op runs
  them once, before any launch, and the internals trust their result.
* The value check `validate_cu_seqlens`: starts at 0, non-decreasing, slots hold their sequences,
  within the rows. It copies the offsets to the host (**[sync]**); ops run it
  (`check_values_where_free`) with `validate=True` or GDN_PACKED_VALIDATE=1, and always on CPU tensors,
  where the copy costs nothing.
* Locating rows (`locate_rows`, `real_rows`, `padding_row_mask`) and `segments_or_rows` (the
  cu_seqlens of an unpacked batch): vectorised, no synchronisation.

gdn_packed.packing re-exports `validate_cu_seqlens` and `padding_row_mask` (its public API).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from gdn_packed._runtime import host_schedule
from gdn_packed._validate import INDEX_DTYPES, check_int, want_validate

__all__ = ["check_cu_seqlens_meta", "check_padded_meta", "check_cu_seqlens", "validate_cu_seqlens",
           "check_values_where_free", "reads_are_free",
           "locate_rows", "real_rows", "padding_row_mask", "offsets_and_rows", "segments_or_rows"]


# ----------------------------------------------------------------------------------------------------
# metadata checks (no sync)
# ----------------------------------------------------------------------------------------------------
def check_cu_seqlens_meta(cu_seqlens, name: str = "cu_seqlens") -> None:
    """Type, dtype, rank and size of one offsets tensor. Never synchronises."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.numel() < 1:
        raise ValueError(f"{name} must have at least 1 element (it is [N+1] for N sequences), got 0")


def check_padded_meta(cu_seqlens, cu_seqlens_padded, name: str = "cu_seqlens",
                      padded_name: str = "cu_seqlens_padded") -> None:
    """cu_seqlens_padded is a tensor of cu_seqlens' dtype, shape and device. Never synchronises."""
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


def check_cu_seqlens(cu_seqlens, cu_seqlens_padded, batch, device) -> int:
    """The metadata checks of an op's cu_seqlens pair against inputs of batch size `batch` on
    `device`; returns N, the number of sequences (`batch` without cu_seqlens)."""
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
        check_padded_meta(cu_seqlens, cu_seqlens_padded)
    return cu_seqlens.numel() - 1


# ----------------------------------------------------------------------------------------------------
# value check (explicit, synchronising)
# ----------------------------------------------------------------------------------------------------
def validate_cu_seqlens(cu_seqlens: Tensor, cu_seqlens_padded: Optional[Tensor] = None,
                        total_rows: Optional[int] = None, name: str = "cu_seqlens",
                        padded_name: Optional[str] = None) -> None:
    """Check ``cu_seqlens`` (and optionally ``cu_seqlens_padded`` / ``total_rows``) fully.

    Raises ``TypeError``/``ValueError`` whose message names the offending argument (``name``, and
    ``padded_name``, default ``name + "_padded"``) for: not a tensor, dtype not int32/int64, not
    1-D, empty, first element != 0, decreasing values; padded offsets of a different
    shape/dtype/device, negative or decreasing, a slot shorter than its sequence; the last offset
    (of the padded offsets if given, else of ``cu_seqlens``) beyond ``total_rows``.

    **[sync]** this is the explicit validation step: it copies the offsets to the host.
    """
    padded_name = padded_name if padded_name is not None else f"{name}_padded"
    check_cu_seqlens_meta(cu_seqlens, name)
    if cu_seqlens_padded is not None:
        check_cu_seqlens_meta(cu_seqlens_padded, padded_name)
        check_padded_meta(cu_seqlens, cu_seqlens_padded, name, padded_name)
    if total_rows is not None:
        total_rows = check_int(total_rows, "total_rows")
    _check_values(cu_seqlens, cu_seqlens_padded, total_rows, name, padded_name)


def _check_values(cu_seqlens, cu_seqlens_padded, total_rows, name="cu_seqlens", padded_name="cu_seqlens_padded"):
    """The value part of validate_cu_seqlens, on offsets whose metadata was checked. **[sync]**"""
    cu = cu_seqlens.detach().to("cpu", torch.int64)
    if int(cu[0]) != 0:
        raise ValueError(f"{name}[0] must be 0, got {int(cu[0])}")
    lens = cu[1:] - cu[:-1]
    _check_non_decreasing(cu, lens, name)
    last_name, last = name, int(cu[-1])

    if cu_seqlens_padded is not None:
        pad = cu_seqlens_padded.detach().to("cpu", torch.int64)
        if int(pad[0]) < 0:
            raise ValueError(f"{padded_name}[0] must be >= 0, got {int(pad[0])}")
        slots = pad[1:] - pad[:-1]
        _check_non_decreasing(pad, slots, padded_name)
        short = slots < lens
        if short.numel() and bool(short.any()):
            i = int(torch.nonzero(short)[0, 0])
            raise ValueError(
                f"{padded_name}: sequence {i} has length {int(lens[i])} but its padded slot holds "
                f"{int(slots[i])} (from {name} and {padded_name})")
        last_name, last = padded_name, int(pad[-1])

    if total_rows is not None and last > total_rows:
        raise ValueError(
            f"{last_name}[-1] = {last} exceeds total_rows = {total_rows} "
            f"(the tensor has only {total_rows} rows)")


def reads_are_free(device) -> bool:
    """Whether reading index values on `device` back to the host costs nothing: CPU tensors, unless
    torch.compile is tracing or the thread runs the device schedule (gdn_packed._runtime)."""
    return not torch.compiler.is_compiling() and host_schedule(device)


def check_values_where_free(cu_seqlens: Optional[Tensor], cu_seqlens_padded: Optional[Tensor],
                            total_rows: int, validate: bool = False) -> None:
    """validate_cu_seqlens where the caller asks for it (validate=True, GDN_PACKED_VALIDATE=1) and
    wherever it is free: CPU tensors, which have no device to wait for, unless torch.compile is
    tracing or the thread runs the device schedule (gdn_packed._runtime.device_schedule, as
    testing.no_host_sync does). Every public op runs it, so bad values on CPU are a ValueError
    naming cu_seqlens, never a loop or an allocation sized by a corrupt offset. The metadata
    checks (check_cu_seqlens) ran before."""
    if cu_seqlens is None:
        return
    if reads_are_free(cu_seqlens.device) or want_validate(validate):
        _check_values(cu_seqlens, cu_seqlens_padded, total_rows)


def _check_non_decreasing(offsets: Tensor, steps: Tensor, name: str) -> None:
    if steps.numel() and bool((steps < 0).any()):
        i = int(torch.nonzero(steps < 0)[0, 0])
        raise ValueError(
            f"{name} must be non-decreasing, but {name}[{i + 1}] = {int(offsets[i + 1])} < "
            f"{name}[{i}] = {int(offsets[i])}")


# ----------------------------------------------------------------------------------------------------
# locating rows (no sync; the inputs are trusted: the public callers checked them)
# ----------------------------------------------------------------------------------------------------
def locate_rows(offsets: Tensor, lengths: Tensor, rows: int) -> Tuple[Tensor, Tensor, Tensor]:
    """Map every row ``r in [0, rows)`` of a storage layout to ``(seq, pos, real)`` (int64, int64,
    bool), where sequence ``i`` occupies rows ``[offsets[i], offsets[i] + lengths[i])``
    (``offsets`` [N+1] or [N], ``lengths`` [N]).

    ``seq`` is the slot containing the row (clamped to ``[0, N-1]``; only meaningful where ``real``),
    ``pos = r - offsets[seq]``. No synchronisation.
    """
    device = offsets.device
    r = torch.arange(rows, device=device, dtype=torch.int64)
    n = lengths.numel()
    if n == 0:
        return r.new_zeros(rows), r.new_zeros(rows), torch.zeros(rows, dtype=torch.bool, device=device)
    off = offsets.to(torch.int64)
    raw = torch.searchsorted(off, r, right=True) - 1  # last i with off[i] <= r; n when r >= off[n]
    seq = raw.clamp(0, n - 1)
    pos = r - off[seq]
    real = (raw >= 0) & (raw < n) & (pos < lengths.to(torch.int64)[seq])
    return seq, pos, real


def real_rows(cu_seqlens: Tensor, cu_seqlens_padded: Optional[Tensor], rows: int) -> Tensor:
    """bool [rows]: True on rows holding a real token. The unchecked core of padding_row_mask, for
    callers that checked cu_seqlens already. No synchronisation."""
    offsets = cu_seqlens if cu_seqlens_padded is None else cu_seqlens_padded
    return locate_rows(offsets, cu_seqlens[1:] - cu_seqlens[:-1], rows)[2]


def offsets_and_rows(cu_seqlens: Tensor, cu_seqlens_padded: Optional[Tensor],
                     total_rows: Optional[int]) -> Tuple[Tensor, int]:
    """Checked storage offsets (cu_seqlens_padded, else cu_seqlens) and the row count: total_rows,
    or the last offset (**[sync]**) when it is None."""
    check_cu_seqlens_meta(cu_seqlens, "cu_seqlens")
    if cu_seqlens_padded is not None:
        check_padded_meta(cu_seqlens, cu_seqlens_padded)
        offsets = cu_seqlens_padded
    else:
        offsets = cu_seqlens
    if total_rows is None:
        rows = int(offsets[-1])  # host sync: documented on the callers
    else:
        rows = check_int(total_rows, "total_rows")
    return offsets, rows


def padding_row_mask(cu_seqlens: Tensor, cu_seqlens_padded: Optional[Tensor] = None,
                     total_rows: Optional[int] = None) -> Tensor:
    """bool ``[total_rows]``: True on rows holding a real token, False on padding rows.

    ``cu_seqlens_padded=None`` means the packed layout itself (rows at or after ``cu_seqlens[-1]``
    are padding). **[no sync]** when ``total_rows`` is given; otherwise it is read from the last
    offset (**[sync]**).
    """
    _, rows = offsets_and_rows(cu_seqlens, cu_seqlens_padded, total_rows)
    return real_rows(cu_seqlens, cu_seqlens_padded, rows)


def segments_or_rows(x, cu_seqlens, dtype=torch.int64):
    """cu_seqlens, or for an unpacked batch x [B, L, ...] the one that makes each row a sequence
    ([0, L, 2L, ..., BL] in `dtype`); and N, the number of sequences. No host sync."""
    if cu_seqlens is not None:
        return cu_seqlens, cu_seqlens.shape[0] - 1
    B, L = x.shape[:2]
    return torch.arange(B + 1, dtype=dtype, device=x.device) * L, B
