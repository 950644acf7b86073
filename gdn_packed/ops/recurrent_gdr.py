"""The recurrent (token-by-token) gated delta rule as torch custom ops: the decode / verify /
short-prefill path (forward only; train with chunk_gated_delta_rule).

    gdn_packed::recurrent_gdr_fwd      (q, k, v, g, beta, initial_state?, cu_seqlens?, cu_seqlens_padded?,
                                        scale, use_qk_l2norm, output_final_state, backend)
                                        -> (o, final_state [N, HV, K, V] or [0, HV, K, V])
    gdn_packed::recurrent_gdr_fwd_pool (q, k, v, g, beta, state_pool!, state_indices, cu_seqlens?,
                                        cu_seqlens_padded?, scale, use_qk_l2norm, backend) -> o
                                        (updates state_pool [P, HV, K, V] in place)

Backends: torch (gdn_packed/torch_ref/recurrent.py) and cuda (csrc/recurrent_gdr.cu, K <= 128).
"""
from typing import Optional

import torch
from torch import Tensor

from gdn_packed import _validate as V
from gdn_packed import segments
from gdn_packed.ops import BACKENDS
from gdn_packed.ops._common import new_output, resolve_backend
from gdn_packed.ops._dispatch import kernel
from gdn_packed.ops._fla_compat import fla_keywords

OP = "fused_recurrent_gated_delta_rule"
MAX_HEAD_DIM = 256
CUDA_MAX_K = 128
CUDA_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BACKENDS_IMPLEMENTED = BACKENDS[OP]


def _rows(x):
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


@torch.library.custom_op("gdn_packed::recurrent_gdr_fwd", mutates_args=())
def recurrent_gdr_fwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Optional[Tensor],
                      cu_seqlens: Optional[Tensor], cu_seqlens_padded: Optional[Tensor], scale: float,
                      use_qk_l2norm: bool, output_final_state: bool, backend: str) -> tuple[Tensor, Tensor]:
    cu, N = segments.segments_or_rows(q, cu_seqlens)
    HV, K, Vd = v.shape[2], q.shape[3], v.shape[3]
    o = new_output(v.shape, v.dtype, v.device)
    final_state = new_output((N if output_final_state else 0, HV, K, Vd), torch.float32, v.device)
    kernel(OP, backend, "fwd")(_rows(q), _rows(k), _rows(v), _rows(g), _rows(beta), cu, cu_seqlens_padded,
                               initial_state, None, scale, use_qk_l2norm, _rows(o),
                               final_state if output_final_state else None)
    return o, final_state


@recurrent_gdr_fwd.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_padded, scale, use_qk_l2norm, output_final_state,
      backend):
    N = segments.segments_or_rows(q, cu_seqlens)[1] if output_final_state else 0
    return v.new_empty(v.shape), v.new_empty((N, v.shape[2], q.shape[3], v.shape[3]), dtype=torch.float32)


@torch.library.custom_op("gdn_packed::recurrent_gdr_fwd_pool", mutates_args=("state_pool",))
def recurrent_gdr_fwd_pool(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state_pool: Tensor,
                           state_indices: Tensor, cu_seqlens: Optional[Tensor],
                           cu_seqlens_padded: Optional[Tensor], scale: float, use_qk_l2norm: bool,
                           backend: str) -> Tensor:
    o = new_output(v.shape, v.dtype, v.device)
    cu = segments.segments_or_rows(q, cu_seqlens)[0]
    kernel(OP, backend, "fwd")(_rows(q), _rows(k), _rows(v), _rows(g), _rows(beta), cu, cu_seqlens_padded,
                               state_pool, state_indices, scale, use_qk_l2norm, _rows(o), state_pool)
    return o


@recurrent_gdr_fwd_pool.register_fake
def _(q, k, v, g, beta, state_pool, state_indices, cu_seqlens, cu_seqlens_padded, scale, use_qk_l2norm, backend):
    return v.new_empty(v.shape)


def fused_recurrent_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                                     *, cu_seqlens=None, cu_seqlens_padded=None, state_indices=None,
                                     use_qk_l2norm_in_kernel=False, backend="auto", validate=False, **kwargs):
    """The gated delta rule one token at a time over packed sequences: the decode / verify /
    short-prefill path; forward only (train with chunk_gated_delta_rule). docs/DESIGN.md sections 2-3.
    Arguments follow FLA's fused_recurrent_gated_delta_rule, plus state_indices for a state pool; the
    eight positional ones are those of chunk_gated_delta_rule (fla-core 0.6.0 puts gk, gv between g and
    beta: pass beta by keyword there), everything after them is keyword-only.

    Per sequence and value head: S = exp(g_t) S + k_t beta_t (v_t - exp(g_t) S^T k_t)^T,
    o_t = scale S^T q_t, with S [K, V] float32.

    Args:
        q, k: [B, T, H, K] (float32, float16, bfloat16 or float64; q, k, v share one dtype), K <= 256.
        v: [B, T, HV, V], V <= 256; HV a multiple of H (value head h uses qk head h // (HV // H)).
        g: [B, T, HV] log-decay per token (normally <= 0).
        beta: [B, T, HV] update strength in [0, 1].
        scale: the factor of q in o; None means K ** -0.5.
        initial_state: float32. Without state_indices: [N, HV, K, V], the state entering each
            sequence (None: zeros). With state_indices: the state pool [P, HV, K, V] (contiguous),
            updated in place.
        output_final_state: True returns the states as the second value: [N, HV, K, V] per sequence,
            or the pool itself when state_indices is given (it is updated in place either way);
            False returns None there.
        cu_seqlens: [N+1] int32/int64 offsets of N sequences packed into a batch-1 input, as in
            chunk_gated_delta_rule; None: each of the B rows is one sequence (N = B).
        cu_seqlens_padded: [N+1] storage offsets of the sequences' tokens, as in
            chunk_gated_delta_rule; rows outside them are padding. None: cu_seqlens.
            Padding rows are 0 in o.
        state_indices: [N] int32/int64, one pool slot per sequence: sequence i starts from
            pool[state_indices[i]] and writes its final state back there. An index < 0 (or >= P)
            starts from zeros and writes nothing. A slot repeated within one call is defined the
            same on every backend: each of its sequences starts from the slot's state before the
            call, and the last of them (highest i) writes it back (the cuda kernel then runs a
            second launch; no host sync). validate=True rejects repeated slots (usually a caller
            bug) and indices >= P.
        use_qk_l2norm_in_kernel: replace q and k by x / sqrt(sum(x^2) + 1e-6) per head first.
        backend: "auto" (default) picks "cuda" for CUDA tensors when gdn_packed._C can run there and
            q is float32/float16/bfloat16 with K <= 128 (else "torch"), and "torch" for CPU tensors.
            "torch": PyTorch, any device. "cuda": the csrc/ kernel (CUDA tensors; ValueError for
            other dtypes or K > 128). "triton": not implemented for this op (NotImplementedError).
        validate: also check the values of cu_seqlens (and cu_seqlens_padded): starting at 0,
            non-decreasing, within the rows. That reads them back to the host, so it is off by
            default on CUDA tensors (the op then never synchronises); GDN_PACKED_VALIDATE=1 turns it
            on everywhere. CPU tensors are always checked (free there).
        kwargs: FLA's and transformers' other keywords (gdn_packed/ops/_fla_compat.py): ignored when
            they do not change the result (use_cache, gk=None, head_first=False, ...); a value asking
            for anything else (use_gate_in_kernel=True, gk, seq_idx without cu_seqlens, ...) is a
            ValueError, an unknown keyword a TypeError.

    Returns:
        (o, final_state): o [B, T, HV, V] in v's dtype; final_state as output_final_state says.

    Bad inputs raise TypeError / ValueError naming the argument, before any launch.
    """
    fla_keywords(OP, kwargs, cu_seqlens)
    _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_padded, state_indices, scale)
    segments.check_values_where_free(cu_seqlens, cu_seqlens_padded, q.shape[1], validate)
    if V.want_validate(validate) and state_indices is not None:
        _check_indices_values(state_indices, initial_state.shape[0])
    backend = resolve_backend(backend, q.device, have=BACKENDS_IMPLEMENTED, refuse=lambda b: _refuse(b, q))
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    l2 = bool(use_qk_l2norm_in_kernel)
    if state_indices is not None:
        o = recurrent_gdr_fwd_pool(q, k, v, g, beta, initial_state, state_indices, cu_seqlens, cu_seqlens_padded,
                                   scale, l2, backend)
        return o, (initial_state if output_final_state else None)
    o, final_state = recurrent_gdr_fwd(q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_padded, scale, l2,
                                       bool(output_final_state), backend)
    return o, (final_state if output_final_state else None)


def _refuse(backend, q):
    """The inputs the cuda backend does not take (resolve_backend's `refuse`)."""
    if backend == "cuda" and (q.dtype not in CUDA_DTYPES or q.shape[3] > CUDA_MAX_K):
        return ValueError(f"backend='cuda' needs q of dtype float32/float16/bfloat16 and K <= {CUDA_MAX_K}, "
                          f"got {q.dtype} and K = {q.shape[3]}")
    return None


def _check_indices_values(state_indices, P):
    idx = state_indices.detach().to("cpu", torch.int64)
    if idx.numel() and int(idx.max()) >= P:
        raise ValueError(f"state_indices must be < the state pool size P = {P}, got max {int(idx.max())}")
    used = idx[idx >= 0]
    if used.unique().numel() != used.numel():
        raise ValueError("state_indices must not repeat a non-negative slot within one call")


def _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_padded, state_indices, scale):
    B, T, H, HV, K, Vd = V.check_gdr_inputs(q, k, v, g, beta, MAX_HEAD_DIM)
    dev = q.device
    N = segments.check_cu_seqlens(cu_seqlens, cu_seqlens_padded, B, dev)
    if state_indices is not None:
        V.check_tensor("state_indices", state_indices, dtypes=V.INDEX_DTYPES, ndim=1, device=dev)
        V.check_shape("state_indices", state_indices, (N,), " ([N], one slot per sequence)")
        if initial_state is None:
            raise ValueError("state_indices needs the state pool as initial_state [P, HV, K, V]")
        V.check_tensor("initial_state", initial_state, dtypes=(torch.float32,), ndim=4, device=dev)
        if tuple(initial_state.shape[1:]) != (HV, K, Vd):
            raise ValueError(f"initial_state (the state pool) must have shape [P, {HV}, {K}, {Vd}], got "
                             f"{tuple(initial_state.shape)}")
        if not initial_state.is_contiguous():
            raise ValueError("initial_state (the state pool) must be contiguous: it is updated in place")
        if initial_state.requires_grad and torch.is_grad_enabled():
            raise ValueError("initial_state (the state pool) is updated in place, which autograd cannot follow: "
                             "pass a pool that does not require grad (or call under torch.no_grad())")
    elif initial_state is not None:
        V.check_tensor("initial_state", initial_state, dtypes=(torch.float32,), ndim=4, device=dev)
        V.check_shape("initial_state", initial_state, (N, HV, K, Vd), " ([N, HV, K, V])")
    if scale is not None:
        V.check_float(scale, "scale")
