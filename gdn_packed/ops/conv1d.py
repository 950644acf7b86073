"""The varlen depthwise causal conv1d as torch custom ops: the one registration site.

    gdn_packed::conv1d_varlen_fwd (x, weight, bias?, initial_state?, cu_seqlens?, cu_seqlens_padded?,
                                   silu, backend) -> (y, final_state)
    gdn_packed::conv1d_varlen_bwd (... same inputs ..., dy, dfinal?) -> (dx, dweight, dbias,
                                                                         dinitial_state)

x [B, L, D] channel-last (B = 1 when packed), weight [D, W], W <= 8; the semantics are in
gdn_packed/torch_ref/conv1d.py (torch backend) and csrc/conv1d_varlen.cu (cuda backend). The forward
saves only its inputs; the backward recomputes the pre-activation. Outputs are allocated here and
every element is written by the backend. dweight/dbias are deterministic on both backends.
"""
from typing import Optional

import torch
from torch import Tensor

from gdn_packed import _validate as V
from gdn_packed import segments
from gdn_packed.ops import BACKENDS
from gdn_packed.ops._common import new_output, resolve_backend
from gdn_packed.ops._dispatch import kernel

OP = "causal_conv1d_varlen"
MAX_WIDTH = 8
ACTIVATIONS = ("silu", "swish", None)
BACKENDS_IMPLEMENTED = BACKENDS[OP]
CUDA_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@torch.library.custom_op("gdn_packed::conv1d_varlen_fwd", mutates_args=())
def conv1d_varlen_fwd(x: Tensor, weight: Tensor, bias: Optional[Tensor], initial_state: Optional[Tensor],
                      cu_seqlens: Optional[Tensor], cu_seqlens_padded: Optional[Tensor], silu: bool,
                      backend: str) -> tuple[Tensor, Tensor]:
    B, L, D = x.shape
    cu, N = segments.segments_or_rows(x, cu_seqlens)
    W = weight.shape[1]
    y = new_output(x.shape, x.dtype, x.device)
    final_state = new_output((N, D, W - 1), x.dtype, x.device)
    kernel(OP, backend, "fwd")(x.reshape(B * L, D), weight, bias, initial_state, cu, cu_seqlens_padded, silu,
                               y.view(B * L, D), final_state)
    return y, final_state


@conv1d_varlen_fwd.register_fake
def _(x, weight, bias, initial_state, cu_seqlens, cu_seqlens_padded, silu, backend):
    N = segments.segments_or_rows(x, cu_seqlens)[1]
    return x.new_empty(x.shape), x.new_empty((N, x.shape[2], weight.shape[1] - 1))


@torch.library.custom_op("gdn_packed::conv1d_varlen_bwd", mutates_args=())
def conv1d_varlen_bwd(x: Tensor, weight: Tensor, bias: Optional[Tensor], initial_state: Optional[Tensor],
                      cu_seqlens: Optional[Tensor], cu_seqlens_padded: Optional[Tensor], silu: bool,
                      backend: str, dy: Tensor, dfinal: Optional[Tensor]
                      ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    B, L, D = x.shape
    cu, N = segments.segments_or_rows(x, cu_seqlens)
    W = weight.shape[1]
    dx = new_output(x.shape, x.dtype, x.device)
    dweight = new_output(weight.shape, weight.dtype, weight.device)
    dbias = new_output((D,), weight.dtype if bias is None else bias.dtype, weight.device)
    dh0 = new_output((N, D, W - 1), x.dtype if initial_state is None else initial_state.dtype, x.device)
    kernel(OP, backend, "bwd")(x.reshape(B * L, D), weight, bias, initial_state, cu, cu_seqlens_padded, silu,
                               dy.reshape(B * L, D), dfinal, dx.view(B * L, D), dweight, dbias, dh0)
    return dx, dweight, dbias, dh0


@conv1d_varlen_bwd.register_fake
def _(x, weight, bias, initial_state, cu_seqlens, cu_seqlens_padded, silu, backend, dy, dfinal):
    N, D, W = segments.segments_or_rows(x, cu_seqlens)[1], x.shape[2], weight.shape[1]
    return (x.new_empty(x.shape), weight.new_empty(weight.shape),
            weight.new_empty((D,), dtype=weight.dtype if bias is None else bias.dtype),
            x.new_empty((N, D, W - 1), dtype=x.dtype if initial_state is None else initial_state.dtype))


def _setup_context(ctx, inputs, output):
    x, weight, bias, initial_state, cu_seqlens, cu_seqlens_padded, silu, backend = inputs
    ctx.save_for_backward(x, weight, bias, initial_state, cu_seqlens, cu_seqlens_padded)
    ctx.silu, ctx.backend = silu, backend


def _backward(ctx, dy, dfinal):
    x, weight, bias, initial_state, cu_seqlens, cu_seqlens_padded = ctx.saved_tensors
    if dy is None:
        dy = torch.zeros_like(x)
    dx, dweight, dbias, dh0 = conv1d_varlen_bwd(x, weight, bias, initial_state, cu_seqlens,
                                                cu_seqlens_padded, ctx.silu, ctx.backend, dy, dfinal)
    return (dx, dweight, None if bias is None else dbias, None if initial_state is None else dh0,
            None, None, None, None)


conv1d_varlen_fwd.register_autograd(_backward, setup_context=_setup_context)


def causal_conv1d_varlen(x, weight, bias=None, activation="silu", cu_seqlens=None, *, cu_seqlens_padded=None,
                         initial_state=None, output_final_state=False, backend="auto", validate=False):
    """Depthwise causal conv1d over packed sequences, restarting at every sequence (it never reads
    across a sequence boundary); forward and backward, channel-last.

    Per sequence and channel c: y[t] = act(bias[c] + sum_w weight[c, w] * x[t - (W-1) + w]), where
    inputs before the sequence start come from initial_state (or are 0).

    Args:
        x: [1, T, D] packed rows with cu_seqlens, or [B, L, D] without (each row one sequence);
            float32, float16, bfloat16 or float64.
        weight: [D, W], or [D, 1, W] as in nn.Conv1d / Megatron; 1 <= W <= 8.
        bias: [D] or None.
        activation: "silu" (default; alias "swish") or None.
        cu_seqlens: [N+1] int32/int64 offsets of N sequences packed into a batch-1 input, as in
            chunk_gated_delta_rule; None: each of the B rows is one sequence (N = B).
        cu_seqlens_padded: [N+1] storage offsets of the sequences' tokens, as in
            chunk_gated_delta_rule; rows outside them are padding. None: cu_seqlens.
            Padding rows are 0 in y and get 0 gradient.
        initial_state: [N, D, W-1] in x's dtype: the W-1 inputs before each sequence, oldest
            first; None means zeros.
        output_final_state: True returns the last W-1 inputs of each sequence, [N, D, W-1] in x's
            dtype (preceded by initial-state columns when the sequence is shorter), as the second
            value; False returns None there.
        backend: "auto" (default) picks "cuda" for CUDA tensors when gdn_packed._C can run there and
            x is float32/float16/bfloat16 (else "torch"), and "torch" for CPU tensors. "torch":
            PyTorch, any device. "cuda": the csrc/ kernels (CUDA tensors; TypeError for float64).
            "triton": not implemented for this op (NotImplementedError).
        validate: also check the values of cu_seqlens (and cu_seqlens_padded): starting at 0,
            non-decreasing, within the rows. That reads them back to the host, so it is off by
            default on CUDA tensors (the op then never synchronises); GDN_PACKED_VALIDATE=1 turns it
            on everywhere. CPU tensors are always checked (free there).

    Returns:
        (y, final_state): y [B, L, D] in x's dtype; final_state [N, D, W-1] or None unless
        output_final_state. Differentiable in x, weight, bias and initial_state; dweight and dbias
        are deterministic (fixed-order sums, no atomics).

    Bad inputs raise TypeError / ValueError naming the argument, before any launch.
    """
    weight = _check_inputs(x, weight, bias, activation, cu_seqlens, cu_seqlens_padded, initial_state)
    segments.check_values_where_free(cu_seqlens, cu_seqlens_padded, x.shape[1], validate)
    backend = resolve_backend(backend, x.device, have=BACKENDS_IMPLEMENTED, refuse=lambda b: _refuse(b, x))
    # int64 offsets once per call (every backend indexes in int64; the forward saves them for the backward)
    cu_seqlens, cu_seqlens_padded = (None if c is None else c.to(torch.int64)
                                     for c in (cu_seqlens, cu_seqlens_padded))
    y, final_state = conv1d_varlen_fwd(x, weight, bias, initial_state, cu_seqlens, cu_seqlens_padded,
                                       activation is not None, backend)
    return y, (final_state if output_final_state else None)


def _refuse(backend, x):
    """The inputs the cuda backend does not take (resolve_backend's `refuse`)."""
    if backend == "cuda" and x.dtype not in CUDA_DTYPES:
        return TypeError(f"backend='cuda' supports x of dtype float32/float16/bfloat16, got {x.dtype}")
    return None


def _check_inputs(x, weight, bias, activation, cu_seqlens, cu_seqlens_padded, initial_state):
    """Static checks; returns weight as [D, W]."""
    V.check_tensor("x", x, ndim=3)
    dev = x.device
    B, L, D = x.shape
    V.check_tensor("weight", weight, device=dev)
    if weight.dim() == 3 and weight.shape[1] == 1:
        weight = weight.squeeze(1)
    if weight.dim() != 2 or weight.shape[0] != D:
        raise ValueError(f"weight must have shape [D, W] or [D, 1, W] with D = x.shape[2] = {D}, "
                         f"got {tuple(weight.shape)}")
    W = weight.shape[1]
    if not 1 <= W <= MAX_WIDTH:
        raise ValueError(f"weight width W = weight.shape[-1] = {W} is outside the supported range "
                         f"1..{MAX_WIDTH}")
    if bias is not None:
        V.check_tensor("bias", bias, ndim=1, device=dev)
        V.check_shape("bias", bias, (D,), " ([D])")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be 'silu', 'swish' or None, got {activation!r}")
    N = segments.check_cu_seqlens(cu_seqlens, cu_seqlens_padded, B, dev)
    if initial_state is not None:
        V.check_tensor("initial_state", initial_state, ndim=3, device=dev)
        if initial_state.dtype != x.dtype:
            raise TypeError(f"initial_state must have x's dtype {x.dtype} (conv states are stored in the "
                            f"activation dtype), got {initial_state.dtype}")
        V.check_shape("initial_state", initial_state, (N, D, W - 1), " ([N, D, W-1])")
    return weight
