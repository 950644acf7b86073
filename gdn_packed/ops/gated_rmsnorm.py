"""Gated RMSNorm as torch custom ops: the one registration site.

    y = x * rsqrt(mean(x^2, -1) + eps) * w * silu(z)               (float32 math, y in x's dtype)
    w = weight, or 1 + weight when zero_centered (TE's zero_centered_gamma; formed in float32)

    gdn_packed::gated_rmsnorm_fwd  (x, z, weight, eps, zero_centered, backend, real?) -> (y, rstd)
    gdn_packed::gated_rmsnorm_bwd  (dy, x, z, weight, rstd, zero_centered, backend, real?)
                                   -> (dx, dz, dweight)

real [T] bool over the token axis of a packed x [1, T, ..., N] (segments.real_rows: the one mask of the
packed layout every op takes), False on padding tokens: y, dx, dz are 0 on their rows and those rows add
nothing to dweight, whatever they hold (the public function builds it from cu_seqlens).

The output gate of the GDN block (`rmsnorm(o) * silu(z)` over the value head dim). The forward saves
x, z, weight and rstd (float32, one per row). Backends: "torch" (torch_ref/gated_rmsnorm.py, any
device) and "triton" (triton/gated_rmsnorm.py, fused, deterministic weight gradient).
"""
from typing import Optional

import torch
from torch import Tensor

from gdn_packed import _validate as V
from gdn_packed import segments
from gdn_packed.ops import BACKENDS
from gdn_packed.ops._common import new_output, refuse_float64, resolve_backend
from gdn_packed.ops._dispatch import kernel

OP = "gated_rmsnorm"
BACKENDS_IMPLEMENTED = BACKENDS[OP]


def _rows(x):
    return x.reshape(-1, x.shape[-1]).contiguous()


@torch.library.custom_op("gdn_packed::gated_rmsnorm_fwd", mutates_args=())
def gated_rmsnorm_fwd(x: Tensor, z: Tensor, weight: Tensor, eps: float, zero_centered: bool,
                      backend: str, real: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    y = new_output(x.shape, x.dtype, x.device)
    rstd = new_output(x.shape[:-1], torch.float32, x.device)
    y2 = y.view(-1, x.shape[-1])
    kernel(OP, backend, "fwd")(_rows(x), _rows(z), weight.contiguous(), eps, zero_centered, y2,
                               rstd.view(-1), real)
    return y, rstd


@gated_rmsnorm_fwd.register_fake
def _(x, z, weight, eps, zero_centered, backend, real=None):
    return x.new_empty(x.shape), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("gdn_packed::gated_rmsnorm_bwd", mutates_args=())
def gated_rmsnorm_bwd(dy: Tensor, x: Tensor, z: Tensor, weight: Tensor, rstd: Tensor,
                      zero_centered: bool, backend: str, real: Optional[Tensor] = None
                      ) -> tuple[Tensor, Tensor, Tensor]:
    dx = new_output(x.shape, x.dtype, x.device)
    dz = new_output(z.shape, z.dtype, z.device)
    dweight = new_output(weight.shape, weight.dtype, weight.device)
    N = x.shape[-1]
    kernel(OP, backend, "bwd")(_rows(dy), _rows(x), _rows(z), weight.contiguous(),
                               rstd.reshape(-1).contiguous(), zero_centered, dx.view(-1, N),
                               dz.view(-1, N), dweight, real)
    return dx, dz, dweight


@gated_rmsnorm_bwd.register_fake
def _(dy, x, z, weight, rstd, zero_centered, backend, real=None):
    return x.new_empty(x.shape), z.new_empty(z.shape), weight.new_empty(weight.shape)


def _setup_context(ctx, inputs, output):
    x, z, weight, eps, zero_centered, backend, *real = inputs
    ctx.save_for_backward(x, z, weight, output[1], (real + [None])[0])
    ctx.mark_non_differentiable(output[1])
    ctx.zero_centered, ctx.backend = zero_centered, backend


def _backward(ctx, dy, drstd):
    x, z, weight, rstd, real = ctx.saved_tensors
    if dy is None:
        dy = torch.zeros_like(x)
    dx, dz, dweight = gated_rmsnorm_bwd(dy, x, z, weight, rstd, ctx.zero_centered, ctx.backend, real)
    return dx, dz, dweight, None, None, None, None


gated_rmsnorm_fwd.register_autograd(_backward, setup_context=_setup_context)


def gated_rmsnorm(x, z, weight, eps=1e-6, backend="auto", *, zero_centered=False, cu_seqlens=None,
                  cu_seqlens_padded=None):
    """Gated RMSNorm, the output gate of the GDN block: x * rsqrt(mean(x^2) + eps) * weight * silu(z)
    over the last dim, computed in float32; forward and backward.

    Args:
        x: [..., N] float tensor (any leading shape).
        z: the gate, the shape of x.
        weight: [N].
        eps: added to mean(x^2); a non-negative float (default 1e-6).
        backend: "auto" (default) picks "triton" for CUDA tensors ("torch" when triton is not
            installed) and "torch" for CPU tensors. "torch": PyTorch, any device. "triton": the
            fused Triton kernels (deterministic weight gradient); on CPU tensors only under the
            Triton interpreter (TRITON_INTERPRET=1). "cuda": not implemented for this op
            (NotImplementedError).
        zero_centered: the weight is zero-centred and the scale is 1 + weight (Transformer Engine's
            zero_centered_gamma, Megatron's layernorm_zero_centered_gamma), formed in float32.
        cu_seqlens, cu_seqlens_padded: optional packed layout of x [1, T, ..., N] (token axis 1), as in
            chunk_gated_delta_rule. Rows outside the sequences' tokens are padding: y is exactly 0
            there, dx and dz are 0 and they add nothing to dweight, whatever x and z hold there
            (NaN/Inf included). No host sync. None: every row is normalised.

    Returns:
        y in x's shape and dtype. Differentiable in x, z and weight.

    Inputs are float32, float16 or bfloat16 with backend="triton" (float64: TypeError; the torch
    backend computes float64 in float64).
    """
    V.check_tensor("x", x)
    V.check_tensor("z", z, device=x.device)
    V.check_tensor("weight", weight, ndim=1, device=x.device)
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last dim, got shape {tuple(x.shape)}")
    V.check_shape("z", z, x.shape, " (the shape of x)")
    V.check_shape("weight", weight, (x.shape[-1],), " ([N], N = x.shape[-1])")
    eps = V.check_float(eps, "eps", minimum=0.0)
    if not isinstance(zero_centered, bool):
        raise TypeError(f"zero_centered must be a bool, got {type(zero_centered).__name__}")
    real = _real_rows(x, cu_seqlens, cu_seqlens_padded)
    backend = resolve_backend(backend, x.device, have=BACKENDS_IMPLEMENTED, refuse=refuse_float64(x))
    y, _ = gated_rmsnorm_fwd(x, z, weight, float(eps), zero_centered, backend, real)
    return y


def _real_rows(x, cu_seqlens, cu_seqlens_padded):
    """bool [T]: False on the padding tokens of a packed x [1, T, ..., N]; None without cu_seqlens. No
    host sync."""
    if cu_seqlens is None and cu_seqlens_padded is None:
        return None
    if x.dim() < 3:
        raise ValueError(f"x with cu_seqlens must be packed as [1, T, ..., N], got shape {tuple(x.shape)}")
    segments.check_cu_seqlens(cu_seqlens, cu_seqlens_padded, x.shape[0], x.device)
    segments.check_values_where_free(cu_seqlens, cu_seqlens_padded, x.shape[1])
    return segments.real_rows(cu_seqlens, cu_seqlens_padded, x.shape[1])
