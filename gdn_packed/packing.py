"""Packing helpers for packed (THD / varlen) sequences described by ``cu_seqlens``.

Layouts (see docs/DESIGN.md section 3)
---------------------------------
* **Padded batch** ``[B, L, ...]`` with an ``attention_mask`` ``[B, L]``: the real tokens of row ``b``
  are the positions where the mask is non-zero, taken in order (right padding, left padding or any
  other mask works).
* **Packed** ``[1, T, ...]`` with ``cu_seqlens`` ``[N+1]`` (int32 or int64, non-decreasing,
  ``cu_seqlens[0] == 0``): sequence ``i`` is rows ``[cu_seqlens[i], cu_seqlens[i+1])``. Rows at or
  after ``cu_seqlens[-1]`` belong to no sequence (padding).
* **Padded storage** ``[1, R, ...]`` with ``cu_seqlens_padded`` (same shape/dtype as ``cu_seqlens``):
  sequence ``i``'s real tokens are rows ``[cu_seqlens_padded[i], cu_seqlens_padded[i] + len_i)``;
  rows up to ``cu_seqlens_padded[i+1]`` are its padding, and every row at or after the last offset
  (or before the first one) is padding.

Host synchronisation
--------------------
Functions marked **[no sync]** never read device data back to the host (no ``.item()``,
``.tolist()``, ``.cpu()``), so they can sit on the hot path and inside a CUDA graph. Functions marked
**[sync]** must produce a data-dependent shape or a Python ``int``; each of them takes a hint
(``total``, ``max_seqlen``, ``num_seqs``, ``total_rows``) and does not synchronise when every hint it
needs is given. :func:`validate_cu_seqlens` is the explicit validation step and always synchronises.

The no-sync functions do not check *values* (monotonicity, slot sizes, ...); on malformed input they
never read or write out of bounds (such tokens are dropped / zero-filled) but the result is
meaningless. Call :func:`validate_cu_seqlens` when the input is not trusted.

All index tensors are computed with vectorised ops (``searchsorted``, ``nonzero``/``nonzero_static``,
``index_select``/``index_copy``); there is no Python loop over sequences or tokens, and the data
movers (:func:`pack`, :func:`unpack`, :func:`to_padded_layout`, :func:`from_padded_layout`) are
differentiable with respect to their floating-point input.

The segment logic itself (the checks of ``cu_seqlens``, :func:`validate_cu_seqlens`, locating rows,
:func:`padding_row_mask`) lives in :mod:`gdn_packed.segments`; this module re-exports the public part.
"""

from __future__ import annotations

import numbers
from typing import Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from gdn_packed._validate import check_int as _check_int
from gdn_packed.segments import check_cu_seqlens_meta as _check_cu_meta
from gdn_packed.segments import check_padded_meta as _check_padded_meta
from gdn_packed.segments import locate_rows
from gdn_packed.segments import offsets_and_rows
from gdn_packed.segments import padding_row_mask, reads_are_free, validate_cu_seqlens

__all__ = [
    "cu_seqlens_from_lengths",
    "lengths_from_cu_seqlens",
    "cu_seqlens_from_attention_mask",
    "unpad_indices",
    "cu_seqlens_from_position_ids",
    "pack",
    "unpack",
    "pad_cu_seqlens",
    "total_rows",
    "padded_rows_upper_bound",
    "to_padded_layout",
    "from_padded_layout",
    "padding_row_mask",
    "token_seq_ids",
    "position_ids_from_cu_seqlens",
    "validate_cu_seqlens",
]

_INDEX_DTYPES = (torch.int32, torch.int64)


# ----------------------------------------------------------------------------------------------------
# internal helpers
# ----------------------------------------------------------------------------------------------------
def _check_mask(mask, name: str = "attention_mask") -> None:
    if not isinstance(mask, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dim() != 2:
        raise ValueError(f"{name} must be 2-D [batch, seqlen], got shape {tuple(mask.shape)}")


def _as_bool(mask: Tensor) -> Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def _nonzero_1d(flags: Tensor, size: Optional[int], fill_value: int) -> Tensor:
    """int64 positions of the True entries of 1-D ``flags``, in order.

    ``size is None``: exact, synchronises (data-dependent shape). Otherwise exactly ``size`` entries,
    no synchronisation: surplus true entries are dropped, missing ones are ``fill_value``.
    """
    if size is None:
        return torch.nonzero(flags).view(-1)
    try:
        return torch.nonzero_static(flags, size=size, fill_value=fill_value).view(-1)
    except (NotImplementedError, RuntimeError, AttributeError):  # pragma: no cover - backend gap
        return _nonzero_1d_sorted(flags, size, fill_value)


def _nonzero_1d_sorted(flags: Tensor, size: int, fill_value: int) -> Tensor:
    """Sort-based fallback of :func:`_nonzero_1d` for backends without ``nonzero_static``."""
    n = flags.numel()
    order = torch.sort((~flags).to(torch.uint8), stable=True).indices  # True entries first, in order
    if size > n:
        order = torch.cat([order, order.new_full((size - n,), fill_value)])
    order = order[:size]
    count = flags.sum()
    keep = torch.arange(size, device=flags.device) < count
    return torch.where(keep, order, torch.full_like(order, fill_value))


# ----------------------------------------------------------------------------------------------------
# cu_seqlens <-> lengths / masks / position ids
# ----------------------------------------------------------------------------------------------------
def cu_seqlens_from_lengths(lengths: Union[Sequence[int], Tensor], dtype: torch.dtype = torch.int32,
                            *, device: Optional[Union[str, torch.device]] = None,
                            validate: Optional[bool] = None) -> Tensor:
    """``cu_seqlens`` ``[N+1]`` (``dtype``, int32 or int64) from sequence lengths ``[N]``.

    ``lengths``: a list/tuple of ints or a 1-D integer tensor. A tensor keeps its device unless
    ``device`` is given; a list goes to ``device`` (default CPU).

    Negative lengths raise ``ValueError``. **[no sync]** for device tensors: the non-negativity check
    runs for lists and CPU tensors (free) and for device tensors only with ``validate=True``
    (which synchronises); ``validate=False`` skips it everywhere.
    """
    if dtype not in _INDEX_DTYPES:
        raise TypeError(f"dtype must be torch.int32 or torch.int64, got {dtype}")
    if isinstance(lengths, Tensor):
        if lengths.dtype.is_floating_point or lengths.dtype.is_complex or lengths.dtype == torch.bool:
            raise TypeError(f"lengths must be an integer tensor, got {lengths.dtype}")
        if lengths.dim() != 1:
            raise ValueError(f"lengths must be 1-D, got shape {tuple(lengths.shape)}")
        if device is not None:
            lengths = lengths.to(device)
        check = validate if validate is not None else lengths.device.type == "cpu"
        if check and lengths.numel() and bool((lengths < 0).any()):
            bad = int(torch.nonzero(lengths < 0)[0, 0])
            raise ValueError(f"lengths must be non-negative, got lengths[{bad}] = {int(lengths[bad])}")
        lens = lengths.to(torch.int64)
    else:
        if not isinstance(lengths, (list, tuple)):
            raise TypeError(f"lengths must be a list, tuple or 1-D tensor, got {type(lengths).__name__}")
        for i, v in enumerate(lengths):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise TypeError(f"lengths must contain ints, got lengths[{i}] = {v!r}")
            if validate is not False and v < 0:
                raise ValueError(f"lengths must be non-negative, got lengths[{i}] = {v}")
        lens = torch.tensor([int(v) for v in lengths], dtype=torch.int64, device=device)
        if dtype == torch.int32 and validate is not False and sum(int(v) for v in lengths) > 2**31 - 1:
            raise ValueError("lengths sum to more than int32 can hold; use dtype=torch.int64")
    cu = torch.zeros(lens.numel() + 1, dtype=torch.int64, device=lens.device)
    torch.cumsum(lens, 0, out=cu[1:])
    return cu.to(dtype)


def lengths_from_cu_seqlens(cu_seqlens: Tensor) -> Tensor:
    """Sequence lengths ``[N]`` (same dtype/device) from ``cu_seqlens`` ``[N+1]``. **[no sync]**"""
    _check_cu_meta(cu_seqlens, "cu_seqlens")
    return cu_seqlens[1:] - cu_seqlens[:-1]


def cu_seqlens_from_attention_mask(mask: Tensor, dtype: torch.dtype = torch.int32) -> Tensor:
    """``cu_seqlens`` ``[B+1]`` from an attention mask ``[B, L]`` (bool or int; non-zero = real token).

    Row ``b`` becomes sequence ``b`` with length ``mask[b].sum()`` wherever its real tokens are
    (right, left or arbitrary padding); rows without real tokens become zero-length sequences.
    **[no sync]**
    """
    _check_mask(mask, "mask")
    if dtype not in _INDEX_DTYPES:
        raise TypeError(f"dtype must be torch.int32 or torch.int64, got {dtype}")
    lens = _as_bool(mask).sum(dim=1, dtype=torch.int64)
    cu = torch.zeros(mask.shape[0] + 1, dtype=torch.int64, device=mask.device)
    torch.cumsum(lens, 0, out=cu[1:])
    return cu.to(dtype)


def unpad_indices(mask: Tensor, *, total: Optional[int] = None,
                  max_seqlen: Optional[int] = None) -> Tuple[Tensor, Tensor, int]:
    """Indices to pack a padded batch: ``(indices, cu_seqlens, max_seqlen)``.

    * ``indices`` ``[T]`` int64: positions of the real tokens in the flattened ``B*L`` order
      (row-major), i.e. row by row, each row's real tokens in order. ``x.reshape(B*L, ...)[indices]``
      is the packed tensor.
    * ``cu_seqlens`` ``[B+1]`` int32 (see :func:`cu_seqlens_from_attention_mask`).
    * ``max_seqlen``: Python int, the longest row's number of real tokens.

    **[sync]** ``T`` and ``max_seqlen`` are data dependent. Pass ``total`` (= ``mask.sum()``) and
    ``max_seqlen`` to avoid any synchronisation. With a ``total`` hint the result has exactly
    ``total`` entries; if the hint exceeds the real count the surplus entries are ``B*L`` (one past
    the end, an invalid index), if it is short the last tokens are dropped.
    """
    _check_mask(mask, "mask")
    if total is not None:
        total = _check_int(total, "total")
    if max_seqlen is not None:
        max_seqlen = _check_int(max_seqlen, "max_seqlen")
    m = _as_bool(mask)
    flat = m.reshape(-1)
    indices = _nonzero_1d(flat, total, fill_value=flat.numel())
    cu_seqlens = cu_seqlens_from_attention_mask(m)
    if max_seqlen is None:
        max_seqlen = int(m.sum(dim=1).max()) if m.shape[0] > 0 else 0  # host sync
    return indices, cu_seqlens, max_seqlen


def cu_seqlens_from_position_ids(position_ids: Tensor, dtype: torch.dtype = torch.int32, *,
                                 num_seqs: Optional[int] = None) -> Tensor:
    """``cu_seqlens`` from packed ``position_ids`` (HF padding-free convention).

    ``position_ids``: ``[T]`` or ``[1, T]`` (a ``[B, T]`` tensor is read row by row as if the rows
    were concatenated, each row starting a new document). A new document starts at the first token
    (even if its position is not 0, e.g. a document continued from a previous chunk) and wherever
    the position does not increase by 1 over the previous token's: transformers' own rule for
    padding-free batches (DataCollatorWithFlattening), which gdn_packed.integrations.transformers
    follows too. A restart at 0 is such a place; so is a jump (``[0, 1, 2, 7, 8]`` is two documents).

    **[sync]** the number of documents is data dependent; pass ``num_seqs`` (the exact number of
    documents) to avoid the synchronisation. If the hint is too large the extra sequences are
    zero-length ones at the end; if it is too small the result is wrong.
    """
    if not isinstance(position_ids, Tensor):
        raise TypeError(f"position_ids must be a torch.Tensor, got {type(position_ids).__name__}")
    if position_ids.dtype.is_floating_point or position_ids.dtype.is_complex:
        raise TypeError(f"position_ids must be an integer tensor, got {position_ids.dtype}")
    if position_ids.dim() not in (1, 2):
        raise ValueError(f"position_ids must be [T] or [1, T], got shape {tuple(position_ids.shape)}")
    if dtype not in _INDEX_DTYPES:
        raise TypeError(f"dtype must be torch.int32 or torch.int64, got {dtype}")
    if num_seqs is not None:
        num_seqs = _check_int(num_seqs, "num_seqs")
    pos = position_ids if position_ids.dim() == 2 else position_ids.unsqueeze(0)
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    flat = starts.reshape(-1)
    t = flat.numel()
    begin = _nonzero_1d(flat, num_seqs, fill_value=t)
    end = torch.full((1,), t, dtype=torch.int64, device=flat.device)
    return torch.cat([begin, end]).to(dtype)


# ----------------------------------------------------------------------------------------------------
# padded batch <-> packed
# ----------------------------------------------------------------------------------------------------
def pack(x: Tensor, attention_mask: Tensor, *, total: Optional[int] = None) -> Tuple[Tensor, Tensor]:
    """Pack a padded batch: ``x [B, L, ...]`` -> ``(packed [1, T, ...], cu_seqlens [B+1] int32)``.

    The real tokens (``attention_mask != 0``) of each row are taken in order, rows one after the
    other. Differentiable w.r.t. ``x`` (``index_select``).

    **[sync]** ``T`` is data dependent; pass ``total`` (= ``attention_mask.sum()``) to avoid the
    synchronisation. With a hint larger than the real count the surplus rows are zeros (padding
    rows after ``cu_seqlens[-1]``); a smaller one is a ``ValueError`` where counting is free (CPU
    tensors, segments.reads_are_free) and not checked on a device (the last tokens would be dropped).
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    _check_mask(attention_mask, "attention_mask")
    if x.dim() < 2 or tuple(x.shape[:2]) != tuple(attention_mask.shape):
        raise ValueError(
            f"x must be [B, L, ...] matching attention_mask {tuple(attention_mask.shape)}, "
            f"got shape {tuple(x.shape)}")
    if total is not None:
        total = _check_int(total, "total")
    b, l = attention_mask.shape
    m = _as_bool(attention_mask.to(x.device))
    flat = m.reshape(-1)
    if total is not None and reads_are_free(flat.device) and total < int(flat.sum()):
        raise ValueError(f"total ({total}) is less than the {int(flat.sum())} real tokens of attention_mask: "
                         f"the packed rows would not hold the tokens cu_seqlens counts")
    indices = _nonzero_1d(flat, total, fill_value=b * l)
    x_flat = x.reshape(b * l, *x.shape[2:])
    if total is None:
        packed = x_flat.index_select(0, indices)
    elif b * l == 0:
        packed = x_flat.new_zeros((total, *x.shape[2:])) + x_flat.sum() * 0  # keep graph connected
    else:
        valid = indices < b * l
        packed = x_flat.index_select(0, indices.clamp(max=b * l - 1))
        packed = torch.where(valid.view(-1, *([1] * (x.dim() - 2))), packed, packed.new_zeros(()))
    return packed.unsqueeze(0), cu_seqlens_from_attention_mask(m)


def unpack(packed: Tensor, cu_seqlens: Tensor, batch_size: int, seqlen: int,
           attention_mask: Optional[Tensor] = None) -> Tensor:
    """Inverse of :func:`pack`: ``packed [1, T, ...]`` -> ``[batch_size, seqlen, ...]``, padding = 0.

    * With ``attention_mask`` ``[B, L]``: token ``t`` goes back exactly where :func:`pack` took it
      (the ``t``-th non-zero of the mask in row-major order), so left or arbitrary padding round
      trips. ``cu_seqlens`` is then only shape-checked.
    * Without it: right padding, sequence ``i`` fills row ``i``, positions ``[0, len_i)``.

    Tokens that do not fit (a sequence longer than ``seqlen``, rows of ``packed`` at or after
    ``cu_seqlens[-1]``, surplus tokens) are dropped. Differentiable w.r.t. ``packed``
    (``index_copy``). **[no sync]**
    """
    if not isinstance(packed, Tensor):
        raise TypeError(f"packed must be a torch.Tensor, got {type(packed).__name__}")
    if packed.dim() < 2 or packed.shape[0] != 1:
        raise ValueError(f"packed must be [1, T, ...], got shape {tuple(packed.shape)}")
    _check_cu_meta(cu_seqlens, "cu_seqlens")
    batch_size = _check_int(batch_size, "batch_size")
    seqlen = _check_int(seqlen, "seqlen")
    if cu_seqlens.numel() != batch_size + 1:
        raise ValueError(
            f"cu_seqlens must have batch_size + 1 = {batch_size + 1} elements, "
            f"got {cu_seqlens.numel()}")
    t = packed.shape[1]
    rows = batch_size * seqlen
    feat = packed.shape[2:]
    src = packed[0]
    if attention_mask is not None:
        _check_mask(attention_mask, "attention_mask")
        if tuple(attention_mask.shape) != (batch_size, seqlen):
            raise ValueError(
                f"attention_mask must have shape (batch_size, seqlen) = {(batch_size, seqlen)}, "
                f"got {tuple(attention_mask.shape)}")
        flat = _as_bool(attention_mask.to(packed.device)).reshape(-1)
        dest = _nonzero_1d(flat, t, fill_value=rows)  # surplus tokens -> dump row
    else:
        cu = cu_seqlens.to(packed.device)
        seq, pos, real = locate_rows(cu[:-1], cu[1:] - cu[:-1], t)
        fits = real & (pos < seqlen)
        dest = torch.where(fits, seq * seqlen + pos, torch.full_like(pos, rows))
    out = src.new_zeros((rows + 1, *feat)).index_copy(0, dest, src)  # row `rows` is a dump row
    return out[:rows].view(batch_size, seqlen, *feat)


# ----------------------------------------------------------------------------------------------------
# packed <-> padded storage (cu_seqlens_padded)
# ----------------------------------------------------------------------------------------------------
def pad_cu_seqlens(cu_seqlens: Tensor, multiple: int = 1, extra: int = 0, tail: int = 0) -> Tensor:
    """Storage offsets ``cu_seqlens_padded`` (same shape/dtype/device) for ``cu_seqlens``.

    Sequence ``i``'s slot holds ``ceil(len_i / multiple) * multiple + extra`` rows, slots back to
    back from row 0. ``tail`` (trailing padding rows after the last slot) does not move any offset;
    it is accepted (and checked) so the same arguments can be passed to :func:`total_rows` /
    :func:`padded_rows_upper_bound`, which add it. **[no sync]** int32 offsets past 2^31 - 1 are a
    ``ValueError`` on CPU tensors (free: segments.reads_are_free) and not checked on a device.
    """
    _check_cu_meta(cu_seqlens, "cu_seqlens")
    multiple = _check_int(multiple, "multiple", minimum=1)
    extra = _check_int(extra, "extra")
    _check_int(tail, "tail")
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
    slots = (lens + (multiple - 1)) // multiple * multiple + extra
    out = torch.zeros(cu_seqlens.numel(), dtype=torch.int64, device=cu_seqlens.device)
    torch.cumsum(slots, 0, out=out[1:])
    if cu_seqlens.dtype == torch.int32 and reads_are_free(out.device) and int(out.max()) > 2**31 - 1:
        raise ValueError(f"the padded offsets of cu_seqlens (multiple={multiple}, extra={extra}) reach "
                         f"{int(out.max())}, more than int32 holds: pass int64 cu_seqlens")
    return out.to(cu_seqlens.dtype)


def total_rows(cu_seqlens_padded: Tensor, tail: int = 0) -> int:
    """Rows of a padded-storage tensor: ``cu_seqlens_padded[-1] + tail`` as a Python int.

    **[sync]** reads the last offset. For a no-sync static bound use :func:`padded_rows_upper_bound`
    (rows after the last offset are padding, so allocating more rows is always legal).
    """
    _check_cu_meta(cu_seqlens_padded, "cu_seqlens_padded")
    tail = _check_int(tail, "tail")
    return int(cu_seqlens_padded[-1]) + tail


def padded_rows_upper_bound(num_tokens: int, num_seqs: int, multiple: int = 1, extra: int = 0,
                            tail: int = 0) -> int:
    """Static upper bound of ``total_rows(pad_cu_seqlens(cu, multiple, extra), tail)`` for any
    ``cu_seqlens`` with ``num_seqs`` sequences and ``num_tokens`` tokens (both known from shapes):
    ``num_tokens + num_seqs * (multiple - 1 + extra) + tail``. Pure Python, **[no sync]**.
    """
    num_tokens = _check_int(num_tokens, "num_tokens")
    num_seqs = _check_int(num_seqs, "num_seqs")
    multiple = _check_int(multiple, "multiple", minimum=1)
    extra = _check_int(extra, "extra")
    tail = _check_int(tail, "tail")
    return num_tokens + num_seqs * (multiple - 1 + extra) + tail


def _token_targets(cu_seqlens: Tensor, cu_seqlens_padded: Tensor, num_tokens: int,
                   num_rows: int) -> Tuple[Tensor, Tensor]:
    """Storage row of each packed token ``t in [0, num_tokens)`` and whether it is a real token
    that fits in its slot and in ``[0, num_rows)``."""
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    seq, pos, real = locate_rows(cu_seqlens[:-1], lens, num_tokens)
    if cu_seqlens.numel() == 1:
        return pos, real
    padded = cu_seqlens_padded.to(torch.int64)
    slot = (padded[1:] - padded[:-1])[seq]
    row = padded[seq] + pos
    ok = real & (pos < slot) & (row >= 0) & (row < num_rows)
    return row, ok


def _check_layout_args(name, x, shape, cu_seqlens, cu_seqlens_padded):
    """Metadata checks of the padded-layout converters: x a batch-1 tensor, a cu_seqlens pair."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 2 or x.shape[0] != 1:
        raise ValueError(f"{name} must be {shape}, got shape {tuple(x.shape)}")
    _check_cu_meta(cu_seqlens, "cu_seqlens")
    _check_padded_meta(cu_seqlens, cu_seqlens_padded, "cu_seqlens", "cu_seqlens_padded")


def to_padded_layout(packed: Tensor, cu_seqlens: Tensor, cu_seqlens_padded: Tensor,
                     total_rows: int) -> Tensor:
    """Scatter ``packed [1, T, ...]`` into padded storage ``[1, total_rows, ...]``; padding rows 0.

    Sequence ``i``'s tokens go to rows ``[cu_seqlens_padded[i], cu_seqlens_padded[i] + len_i)``.
    Tokens that would land outside their slot or outside ``[0, total_rows)``, and rows of ``packed``
    at or after ``cu_seqlens[-1]``, are dropped. Differentiable w.r.t. ``packed``. **[no sync]**
    """
    _check_layout_args("packed", packed, "[1, T, ...]", cu_seqlens, cu_seqlens_padded)
    total_rows = _check_int(total_rows, "total_rows")
    cu = cu_seqlens.to(packed.device)
    padded = cu_seqlens_padded.to(packed.device)
    row, ok = _token_targets(cu, padded, packed.shape[1], total_rows)
    dest = torch.where(ok, row, torch.full_like(row, total_rows))
    feat = packed.shape[2:]
    out = packed.new_zeros((total_rows + 1, *feat)).index_copy(0, dest, packed[0])
    return out[:total_rows].unsqueeze(0)


def from_padded_layout(x: Tensor, cu_seqlens: Tensor, cu_seqlens_padded: Tensor, *,
                       total: Optional[int] = None) -> Tensor:
    """Gather the real rows of padded storage ``x [1, R, ...]`` back to packed ``[1, T, ...]``.

    Inverse of :func:`to_padded_layout`. Differentiable w.r.t. ``x`` (``index_select``; padding
    rows get zero gradient).

    **[sync]** ``T = cu_seqlens[-1]`` is read from the device unless ``total`` is given (with a
    larger hint the extra rows are 0). Rows whose source lies outside ``x`` are 0.
    """
    _check_layout_args("x", x, "[1, R, ...]", cu_seqlens, cu_seqlens_padded)
    t = int(cu_seqlens[-1]) if total is None else _check_int(total, "total")  # sync without hint
    r = x.shape[1]
    feat = x.shape[2:]
    if r == 0:
        return x.new_zeros((1, t, *feat)) + x.sum() * 0  # keep the graph connected
    cu = cu_seqlens.to(x.device)
    padded = cu_seqlens_padded.to(x.device)
    row, ok = _token_targets(cu, padded, t, r)
    src = torch.where(ok, row, torch.zeros_like(row))
    out = x[0].index_select(0, src)
    out = torch.where(ok.view(-1, *([1] * len(feat))), out, out.new_zeros(()))
    return out.unsqueeze(0)


# ----------------------------------------------------------------------------------------------------
# shared per-row index logic (RoPE, attention masks, conv, ...)
# ----------------------------------------------------------------------------------------------------
def token_seq_ids(cu_seqlens: Tensor, cu_seqlens_padded: Optional[Tensor] = None,
                  total_rows: Optional[int] = None) -> Tensor:
    """Sequence index of every row ``[total_rows]`` (``cu_seqlens``' dtype), -1 on padding rows.

    Rows are those of the padded storage when ``cu_seqlens_padded`` is given, else of the packed
    layout. **[no sync]** when ``total_rows`` is given; otherwise it is the last offset (**[sync]**).
    """
    offsets, rows = offsets_and_rows(cu_seqlens, cu_seqlens_padded, total_rows)
    seq, _, real = locate_rows(offsets, cu_seqlens[1:] - cu_seqlens[:-1], rows)
    return torch.where(real, seq, torch.full_like(seq, -1)).to(cu_seqlens.dtype)


def position_ids_from_cu_seqlens(cu_seqlens: Tensor, cu_seqlens_padded: Optional[Tensor] = None,
                                 total_rows: Optional[int] = None, *,
                                 dtype: Optional[torch.dtype] = None) -> Tensor:
    """Position of every row within its sequence (0, 1, 2, ... restarting at each sequence start),
    0 on padding rows. ``dtype`` defaults to ``cu_seqlens``' dtype.

    Same row conventions and sync rules as :func:`token_seq_ids`.
    """
    offsets, rows = offsets_and_rows(cu_seqlens, cu_seqlens_padded, total_rows)
    _, pos, real = locate_rows(offsets, cu_seqlens[1:] - cu_seqlens[:-1], rows)
    out = torch.where(real, pos, torch.zeros_like(pos))
    return out.to(cu_seqlens.dtype if dtype is None else dtype)
