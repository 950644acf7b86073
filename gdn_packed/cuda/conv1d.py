"""Host side of csrc/conv1d_varlen.cu: the varlen causal conv1d forward and backward, with the
signature of the torch backend (gdn_packed/torch_ref/conv1d.py): flattened rows x [T, D], weight [D, W]
with W <= 8, the sequences' cu_seqlens [N+1] (an unpacked batch passes its row offsets); the outputs are
allocated by the caller (gdn_packed/ops/conv1d.py) and written in full here. dweight/dbias are reduced
from per-tile partial sums in a fixed order (deterministic)."""
import torch

from gdn_packed.cuda.launch import KERNEL_DTYPES, as_dtype, check_tensors, launch, offsets64

FWD_TILE_ROWS = 16    # rows per thread in the CUDA forward (sliding window along the rows)
BWD_TILE_ROWS = 64    # rows per thread (and per dweight/dbias partial sum) in the CUDA backward
MAX_WIDTH = 8         # csrc/conv1d_varlen.cu's widths


def _common(x, weight, bias, initial_state, cu_seqlens, cu_seqlens_padded, **outputs):
    """(reads, scalars) shared by the forward and the backward, after checking the inputs and the
    `outputs` name=(tensor, shape, dtype), whose shapes name x's ("x"), [D], [D, W] or [N, D, W-1]."""
    check_tensors(x=(x, (None, None), KERNEL_DTYPES), weight=(weight, (None, None), None))
    (T, D), W = x.shape, weight.shape[1]
    if not 1 <= W <= MAX_WIDTH:
        raise ValueError(f"weight must be [D, W] with 1 <= W <= {MAX_WIDTH}, got {tuple(weight.shape)}")
    cu, pad, N = offsets64(cu_seqlens, cu_seqlens_padded)
    sizes = {"x": (T, D), "D": (D,), "DW": (D, W), "state": (N, D, W - 1)}
    check_tensors(weight=(weight, (D, W), None), bias=(bias, (D,), None),
                  initial_state=(initial_state, (N, D, W - 1), None),
                  **{name: (t, sizes[shape], dtype) for name, (t, shape, dtype) in outputs.items()})
    reads = dict(x=x, weight=weight.to(torch.float32), bias=as_dtype(bias, torch.float32),
                 initial_state=as_dtype(initial_state, x.dtype), cu_seqlens=cu, cu_seqlens_padded=pad)
    return reads, dict(N=N, T=T, D=D, W=W, dtype=x.dtype)


def conv1d_fwd_cuda(x, weight, bias, initial_state, cu_seqlens, cu_seqlens_padded, silu, y, final_state,
                    *, host=False):
    """The csrc/ forward into y [T, D] and final_state [N, D, W-1]; host=True runs the same
    per-thread bodies in a CPU loop (CPU tensors)."""
    reads, scalars = _common(x, weight, bias, initial_state, cu_seqlens, cu_seqlens_padded,
                             y=(y, "x", x.dtype), final_state=(final_state, "state", x.dtype))
    launch("conv1d_varlen_fwd", x.device, host=host, reads=reads, writes=dict(y=y, final_state=final_state),
           silu=bool(silu), tile_rows=FWD_TILE_ROWS, **scalars)


def conv1d_bwd_cuda(x, weight, bias, initial_state, cu_seqlens, cu_seqlens_padded, silu, dy, dfinal,
                    dx, dweight, dbias, dinitial_state, *, host=False):
    """The csrc/ backward: dx [T, D], dinitial_state (x's dtype) directly; dweight/dbias [D, W]/[D]
    float32 through per-tile partial sums [ceil(T / BWD_TILE_ROWS), D, W+1] and a fixed-order reduction."""
    reads, scalars = _common(x, weight, bias, initial_state, cu_seqlens, cu_seqlens_padded,
                             dy=(dy, "x", None), dfinal=(dfinal, "state", None), dx=(dx, "x", x.dtype),
                             dweight=(dweight, "DW", None), dbias=(dbias, "D", None),
                             dinitial_state=(dinitial_state, "state", None))
    T, D, W = scalars["T"], scalars["D"], scalars["W"]
    tiles = (T + BWD_TILE_ROWS - 1) // BWD_TILE_ROWS
    partial = torch.empty((tiles, D, W + 1), dtype=torch.float32, device=x.device)
    dw32 = torch.empty((D, W + 1), dtype=torch.float32, device=x.device)
    dh0 = dinitial_state if dinitial_state.dtype == x.dtype else torch.empty_like(dinitial_state, dtype=x.dtype)
    reads.update(dy=dy.to(x.dtype), dfinal=as_dtype(dfinal, x.dtype))
    launch("conv1d_varlen_bwd", x.device, host=host, reads=reads,
           writes=dict(dx=dx, partial=partial, dweight_bias=dw32, dinitial_state=dh0),
           silu=bool(silu), tile_rows=BWD_TILE_ROWS, **scalars)
    dweight.copy_(dw32[:, :W])
    dbias.copy_(dw32[:, W])
    if dh0 is not dinitial_state:
        dinitial_state.copy_(dh0)
