"""The one place where a layer input becomes packed: every layer runs on `[1, R, ...]` rows with
`cu_seqlens` (and optional `cu_seqlens_padded`), whatever layout the caller used."""
import torch

from gdn_packed import packing, segments


def as_packed(x, cu_seqlens=None, cu_seqlens_padded=None, attention_mask=None):
    """Return (x_packed [1, R, ...], cu_seqlens, cu_seqlens_padded, restore), where `restore` maps a
    packed output [1, R, ...] back to x's layout.

    * attention_mask [B, L] with x [B, L, ...]: the real tokens are packed (host sync: their count),
      restore scatters them back, 0 on padding.
    * neither mask nor cu_seqlens, x [B, L, ...]: each row is one sequence (a view, no copy, no sync).
    * cu_seqlens (+ cu_seqlens_padded) with x [1, R, ...]: already packed, passed through.
    """
    if attention_mask is not None:
        if cu_seqlens is not None or cu_seqlens_padded is not None:
            raise ValueError("pass either attention_mask (padded [B, L] input) or cu_seqlens (packed "
                             "[1, T] input), not both")
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2 or x.dim() < 2 \
                or tuple(attention_mask.shape) != tuple(x.shape[:2]):
            raise ValueError(f"attention_mask must be a 2-D padding mask [B, L] = {list(x.shape[:2])} (the "
                             f"input's first two dims), got {tuple(getattr(attention_mask, 'shape', ()))}")
        B, L = attention_mask.shape
        xp, cu = packing.pack(x, attention_mask)
        return xp, cu, None, lambda y: packing.unpack(y, cu, B, L, attention_mask)
    if cu_seqlens is None:
        if cu_seqlens_padded is not None:
            raise ValueError("cu_seqlens_padded needs cu_seqlens (the real lengths) as well")
        if x.dim() < 2:
            raise ValueError(f"input must be [B, L, ...], got shape {tuple(x.shape)}")
        B, L = x.shape[:2]
        cu, _ = segments.segments_or_rows(x, None, torch.int32)
        return x.reshape(1, B * L, *x.shape[2:]), cu, None, lambda y: y.reshape(B, L, *y.shape[2:])
    check_packed(x, cu_seqlens, cu_seqlens_padded)
    return x, cu_seqlens, cu_seqlens_padded, lambda y: y


def check_packed(x, cu_seqlens, cu_seqlens_padded=None):
    """The checks of a packed layer input x [1, R, ...] with its offsets, as the ops run them: the
    offsets' dtype, shape and device, and their values where that is free (CPU tensors; always with
    GDN_PACKED_VALIDATE=1), so a bad layout is a ValueError naming cu_seqlens, never a wrong answer."""
    if x.dim() < 2 or x.shape[0] != 1:
        raise ValueError(f"packed input with cu_seqlens must have batch size 1 ([1, T, ...]), "
                         f"got shape {tuple(x.shape)}")
    segments.check_cu_seqlens(cu_seqlens, cu_seqlens_padded, 1, x.device)
    segments.check_values_where_free(cu_seqlens, cu_seqlens_padded, x.shape[1])


def zero_padding_rows(x, cu_seqlens, cu_seqlens_padded=None):
    """x [1, R, ...] with the rows outside the sequences' tokens replaced by 0 by selection
    (torch.where: NaN/Inf stored there is dropped, and its gradient there is 0). No host sync."""
    real = segments.padding_row_mask(cu_seqlens, cu_seqlens_padded, total_rows=x.shape[1])
    return torch.where(real.view(1, -1, *([1] * (x.dim() - 2))), x, x.new_zeros(()))
