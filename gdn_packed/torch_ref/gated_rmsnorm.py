"""Gated RMSNorm, the torch backend and the reference.

    y = x * rstd * w * silu(z),   rstd = 1 / sqrt(mean(x^2) + eps)     (over the last dim, N)

with the scale w = weight, or w = 1 + weight for a zero-centred weight (TE's zero_centered_gamma,
Megatron's layernorm_zero_centered_gamma; 1 + weight is formed in float32, never in weight's dtype).
Backward, with xhat = x * rstd, s = silu(z), u = dy * w * s (the gradient of xhat):

    dx     = rstd * (u - xhat * mean(u * xhat))
    dz     = dy * xhat * w * sigmoid(z) * (1 + z * (1 - sigmoid(z)))
    dweight = sum over rows of dy * xhat * s              (the same for both weight conventions)

Everything is computed in float32 whatever the input dtype; y, dx, dz are rounded to their tensor's
dtype once, at the end. `rstd` (float32, one per row) is the only saved intermediate.

Padding rows (the rows of the tokens where `real` [T] bool is False, when given): x, z, dy and rstd
are replaced by 0 by selection (torch.where), so y, dx, dz are exactly 0 there and the rows add
nothing to dweight, whatever NaN/Inf they hold.
"""
import torch


def _scale(weight, zero_centered):
    w = weight.float()
    return w + 1 if zero_centered else w


def _select_rows(real, *xs):
    """Each x [M, N] (or [M]), M = T R rows of the T tokens of real [T] (R rows per token), with the rows
    of padding tokens (real False) replaced by 0; unchanged without real."""
    if real is None or real.numel() == 0:
        return xs
    T = real.numel()
    return tuple(torch.where(real.view(T, 1, *([1] * (x.dim() - 1))), x.reshape(T, -1, *x.shape[1:]),
                             torch.zeros((), dtype=x.dtype, device=x.device)).view(x.shape) for x in xs)


def gated_rmsnorm_fwd_torch(x, z, weight, eps, zero_centered, y, rstd, real=None):
    """x, z [M, N]; weight [N]; real [T] bool (M = T R) or None; writes y [M, N] (x's dtype) and rstd [M]
    (float32, 0 on padding rows)."""
    xf, zf = _select_rows(real, x.float(), z.float())
    (r,) = _select_rows(real, torch.rsqrt(xf.square().mean(-1) + eps))
    y.copy_(xf * r[:, None] * _scale(weight, zero_centered) * torch.nn.functional.silu(zf))
    rstd.copy_(r)


def gated_rmsnorm_bwd_torch(dy, x, z, weight, rstd, zero_centered, dx, dz, dweight, real=None):
    """Writes dx, dz [M, N] and dweight [N] (weight's dtype)."""
    xf, zf, dyf, rstd = _select_rows(real, x.float(), z.float(), dy.float(), rstd)
    w = _scale(weight, zero_centered)
    xhat = xf * rstd[:, None]
    sig = torch.sigmoid(zf)
    s = zf * sig
    u = dyf * w * s
    dx.copy_(rstd[:, None] * (u - xhat * (u * xhat).mean(-1, keepdim=True)))
    dz.copy_(dyf * xhat * w * sig * (1 + zf * (1 - sig)))
    dweight.copy_((dyf * xhat * s).sum(0))


def gated_rmsnorm_ref(x, z, weight, eps=1e-6, zero_centered=False):
    """The formula, differentiable by autograd: the test reference (run it in float64)."""
    w = weight + 1 if zero_centered else weight
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * w * torch.nn.functional.silu(z)
