"""The chunked gated delta rule as torch custom ops: the one registration site.

    gdn_packed::chunk_gdr_fwd  (q, k, v, g, beta, initial_state?, cu_seqlens?, cu_seqlens_padded?,
                                scale, use_qk_l2norm, backend, A_log?, dt_bias?, keep=True,
                                table?, cu_chunks?, real?) -> (o, final_state, kept)
    gdn_packed::chunk_gdr_bwd  (... same inputs ..., do, dht?, ..., kept?, table?, cu_chunks?, real?)
                                -> (dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias)

With A_log and dt_bias [HV] (the gating of Qwen3-Next / Megatron), `g` and `beta` hold the raw a and b
[B, T, HV]: the backend computes g = -exp(A_log) softplus(a + dt_bias) and beta = sigmoid(b) in float32
first (the "gate_fwd" kernel), and its backward returns da, db in g's / beta's slots plus dA_log, ddt_bias
(token sums of fixed order); without them dA_log and ddt_bias are empty.

`kept` is what the forward keeps for its backward beyond the inputs: with keep on the torch backend's
host schedule (CPU tensors) the state entering each chunk and its Vnew (torch_ref/chunk.py, kept_shape:
its size follows from the shapes alone); on the triton backend (triton/chunk.py, kept_shape) prep's
outputs and, when its state pass runs in segments (few long sequences), the state entering every segment
and the segments' transitions, so that the backward runs no prep and no pass A of its own; on the cuda
backend (cuda/chunk.py, kept_shape) the same but the transitions, written by its kernel; where the
backward runs in head slices, or with keep=False, an empty tensor and the backward recomputes from the
inputs. The public function asks for kept only when autograd will need it and drops it from what it
returns.
The segments are worked out once per call: the public function builds the chunk table (the
gdn_packed::chunk_table op, on the device, no host sync) and, with the gating on packed rows, the token
mask `real` [T] (segments.real_rows, the mask every op takes), hands them to the forward, which saves
them for the backward (neither is rebuilt there). Called without them, as tests call the ops, the ops
build them. Both flatten the packed rows and hand them to one backend implementation
(gdn_packed.ops._dispatch.kernel), which writes every row of the outputs it is given. Input checks live
in `chunk_gated_delta_rule`, the public function, and run once, before any launch; the ops trust them.
"""
from typing import Optional

import torch
from torch import Tensor

from gdn_packed import _validate as V
from gdn_packed import segments
from gdn_packed.ops import BACKENDS
from gdn_packed.ops._common import compute_dtype, new_output, refuse_float64, resolve_backend, triton_usable
from gdn_packed.ops._dispatch import TABLE, kernel
from gdn_packed.ops._fla_compat import fla_keywords
from gdn_packed.ops.chunk_table import chunk_slots, make_chunk_table

OP = "chunk_gated_delta_rule"
CHUNK_SIZE = 64
MAX_HEAD_DIM = 256
BACKENDS_IMPLEMENTED = BACKENDS[OP]
# "cuda" is opt-in (asked by name) until tools/gpu_check.py has passed it on an H200 (issue 28)
AUTO_BACKENDS = tuple(b for b in BACKENDS_IMPLEMENTED if b != "cuda")


def _segments(q, cu_seqlens, cu_seqlens_padded, table=None, cu_chunks=None):
    """Flattened row count T, sequence count N, and the chunk table over the rows: the one given (what
    the public function built), else built here (the public function checked cu_seqlens: no check)."""
    T = q.shape[0] * q.shape[1]
    cu_seqlens, N = segments.segments_or_rows(q, cu_seqlens, torch.int32)
    if table is None:
        table, cu_chunks = make_chunk_table(cu_seqlens, cu_seqlens_padded, T, CHUNK_SIZE)
    return T, N, table, cu_chunks


def _token_mask(A_log, cu_seqlens, cu_seqlens_padded, T):
    """real [T] bool (False on padding rows), what the gating needs of the packed layout; None without
    gating or without cu_seqlens (every row real). No sync."""
    if A_log is None or cu_seqlens is None:
        return None
    return segments.real_rows(cu_seqlens, cu_seqlens_padded, T)


def _rows(x, T):
    return x.reshape(T, *x.shape[2:])


def _raw_gate_rows(a, b, real, T):
    """The raw gate inputs a, b as rows [T, HV], with the padding rows (real [T] False) replaced by 0
    (selection, no sync): whatever they hold, padding rows then give finite g, beta, and their da, db
    and share of dA_log, ddt_bias are exactly 0 (the chunked backward gives them dg = dbeta = 0)."""
    a, b = _rows(a, T), _rows(b, T)
    if real is None:
        return a, b
    return torch.where(real[:, None], a, a.new_zeros(())), torch.where(real[:, None], b, b.new_zeros(()))


@torch.library.custom_op("gdn_packed::chunk_gdr_fwd", mutates_args=())
def chunk_gdr_fwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                  initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor],
                  cu_seqlens_padded: Optional[Tensor], scale: float, use_qk_l2norm: bool,
                  backend: str, A_log: Optional[Tensor] = None,
                  dt_bias: Optional[Tensor] = None, keep: bool = True, table: Optional[Tensor] = None,
                  cu_chunks: Optional[Tensor] = None, real: Optional[Tensor] = None
                  ) -> tuple[Tensor, Tensor, Tensor]:
    T, N, table, cu_chunks = _segments(q, cu_seqlens, cu_seqlens_padded, table, cu_chunks)
    HV, K, V_ = v.shape[2], q.shape[3], v.shape[3]
    o = new_output(v.shape, v.dtype, v.device)
    final_state = new_output((N, HV, K, V_), torch.float32, v.device)
    kept = new_output(*_kept_spec(q, v, N, backend, keep), v.device)
    g_rows, beta_rows = _rows(g, T), _rows(beta, T)
    fwd, more = kernel(OP, backend, "fwd"), ({"kept": kept} if kept.numel() else {})
    if A_log is not None:
        if real is None:
            real = _token_mask(A_log, cu_seqlens, cu_seqlens_padded, T)
        a_rows, b_rows = _raw_gate_rows(g, beta, real, T)
        if "fwd_raw" in TABLE[OP][backend]:     # a forward that forms the gates itself (_dispatch.py)
            fwd, g_rows, beta_rows = kernel(OP, backend, "fwd_raw"), a_rows, b_rows
            more.update(A_log=A_log, dt_bias=dt_bias)
        else:
            g_rows, beta_rows = kernel(OP, backend, "gate_fwd")(a_rows, b_rows, A_log, dt_bias)
    fwd(_rows(q, T), _rows(k, T), _rows(v, T), g_rows, beta_rows, table, cu_chunks,
        initial_state, scale, CHUNK_SIZE, use_qk_l2norm, _rows(o, T), final_state, **more)
    return o, final_state, kept


def _kept_spec(q, v, N, backend, keep):
    """(shape, dtype) of the forward's `kept` output: the backend's kept_shape (torch_ref/chunk.py,
    triton/chunk.py) in the compute dtype where the backend keeps something and keep is set; else empty."""
    if not (keep and "kept_shape" in TABLE[OP][backend]):
        return (0,), torch.float32
    shape = kernel(OP, backend, "kept_shape")(q.shape[0] * q.shape[1], N, v.shape[2], q.shape[3], v.shape[3],
                                              CHUNK_SIZE, q.device, q.dtype)
    return shape, compute_dtype(q.dtype)


@chunk_gdr_fwd.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_padded, scale, use_qk_l2norm, backend,
      A_log=None, dt_bias=None, keep=True, table=None, cu_chunks=None, real=None):
    N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    kept_shape, kept_dtype = _kept_spec(q, v, N, backend, keep)
    return (v.new_empty(v.shape),
            v.new_empty((N, v.shape[2], q.shape[3], v.shape[3]), dtype=torch.float32),
            v.new_empty(kept_shape, dtype=kept_dtype))


@torch.library.custom_op("gdn_packed::chunk_gdr_bwd", mutates_args=())
def chunk_gdr_bwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                  initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor],
                  cu_seqlens_padded: Optional[Tensor], do: Tensor, dht: Optional[Tensor],
                  scale: float, use_qk_l2norm: bool, backend: str, A_log: Optional[Tensor] = None,
                  dt_bias: Optional[Tensor] = None, kept: Optional[Tensor] = None, table: Optional[Tensor] = None,
                  cu_chunks: Optional[Tensor] = None, real: Optional[Tensor] = None
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    T, N, table, cu_chunks = _segments(q, cu_seqlens, cu_seqlens_padded, table, cu_chunks)
    HV, K, V_ = v.shape[2], q.shape[3], v.shape[3]
    dq, dk, dv = (new_output(x.shape, x.dtype, x.device) for x in (q, k, v))
    dg, dbeta = new_output(g.shape, g.dtype, g.device), new_output(beta.shape, beta.dtype, beta.device)
    dh0 = new_output((N, HV, K, V_), torch.float32, q.device)
    g_rows, beta_rows, dg_rows, dbeta_rows = _rows(g, T), _rows(beta, T), _rows(dg, T), _rows(dbeta, T)
    gating = A_log is not None
    if gating:      # the chunked backward runs on the float32 gates and writes float32 dg, dbeta
        gate_fwd, gate_bwd = kernel(OP, backend, "gate_fwd"), kernel(OP, backend, "gate_bwd")
        if real is None:
            real = _token_mask(A_log, cu_seqlens, cu_seqlens_padded, T)
        a_rows, b_rows = _raw_gate_rows(g, beta, real, T)
        g_rows, beta_rows = gate_fwd(a_rows, b_rows, A_log, dt_bias)
        dg_rows = new_output(g_rows.shape, torch.float32, g.device)
        dbeta_rows = new_output(g_rows.shape, torch.float32, g.device)
    more = {"kept": kept} if kept is not None and kept.numel() else {}
    kernel(OP, backend, "bwd")(_rows(q, T), _rows(k, T), _rows(v, T), g_rows, beta_rows, table, cu_chunks,
        initial_state, scale, CHUNK_SIZE, use_qk_l2norm, _rows(do, T), dht,
        _rows(dq, T), _rows(dk, T), _rows(dv, T), dg_rows, dbeta_rows, dh0, **more)
    if gating:
        da, db, dA_log, ddt_bias = gate_bwd(a_rows, b_rows, A_log, dt_bias, dg_rows, dbeta_rows)
        _rows(dg, T).copy_(da)
        _rows(dbeta, T).copy_(db)
        dA_log, ddt_bias = dA_log.to(A_log.dtype), ddt_bias.to(dt_bias.dtype)
    else:
        dA_log, ddt_bias = (q.new_empty(0, dtype=torch.float32) for _ in range(2))
    return dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias


@chunk_gdr_bwd.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_padded, do, dht, scale, use_qk_l2norm,
      backend, A_log=None, dt_bias=None, kept=None, table=None, cu_chunks=None, real=None):
    N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if A_log is None:
        dA_log, ddt_bias = (q.new_empty(0, dtype=torch.float32) for _ in range(2))
    else:
        dA_log, ddt_bias = A_log.new_empty(A_log.shape), dt_bias.new_empty(dt_bias.shape)
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), g.new_empty(g.shape),
            beta.new_empty(beta.shape),
            q.new_empty((N, v.shape[2], q.shape[3], v.shape[3]), dtype=torch.float32), dA_log, ddt_bias)


def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_padded, scale, l2, backend, *more = inputs
    A_log, dt_bias, _keep, table, cu_chunks, real = (more + [None] * 6)[:6]
    kept = output[2]
    ctx.mark_non_differentiable(kept)
    ctx.set_materialize_grads(False)        # no zero gradient for kept (as large as 5 v's), nor do, dht
    ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_padded, A_log, dt_bias,
                          kept, table, cu_chunks, real)
    ctx.scale, ctx.l2, ctx.backend = scale, l2, backend


def _backward(ctx, do, dht, _dkept):
    (q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_padded, A_log, dt_bias, kept, table, cu_chunks,
     real) = ctx.saved_tensors
    if do is None:
        do = torch.zeros_like(v)
    dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias = chunk_gdr_bwd(
        q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_padded, do, dht, ctx.scale, ctx.l2,
        ctx.backend, A_log, dt_bias, kept, table, cu_chunks, real)
    dh0 = None if initial_state is None else dh0.to(initial_state.dtype)
    if A_log is None:
        dA_log = ddt_bias = None
    return dq, dk, dv, dg, dbeta, dh0, None, None, None, None, None, dA_log, ddt_bias, None, None, None, None


chunk_gdr_fwd.register_autograd(_backward, setup_context=_setup_context)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, *,
                           cu_seqlens=None, cu_seqlens_padded=None, use_qk_l2norm_in_kernel=False,
                           A_log=None, dt_bias=None, backend="auto", validate=False, **kwargs):
    """The gated delta rule over packed sequences, computed in chunks of 64 tokens; forward and
    backward (docs/DESIGN.md sections 2-4). Arguments follow FLA's chunk_gated_delta_rule: the eight
    positional ones are FLA's (fla-core <= 0.6.0), everything after them is keyword-only.

    Per sequence and value head the state S [K, V] (float32) starts at initial_state (or 0) and each
    token does S = exp(g_t) S + k_t beta_t (v_t - exp(g_t) S^T k_t)^T, then o_t = scale S^T q_t.

    Args:
        q, k: [B, T, H, K] queries and keys (float32, float16, bfloat16 or float64; q, k, v share one
            dtype). K <= 256.
        v: [B, T, HV, V] values, V <= 256. HV is a multiple of H: value head h uses qk head
            h // (HV // H) (grouped value heads, no copy of q or k).
        g: [B, T, HV] log-decay per token (normally <= 0). With A_log/dt_bias: the raw gate input a.
        beta: [B, T, HV] update strength in [0, 1]. With A_log/dt_bias: the raw gate input b.
        scale: the factor of q in o; None means K ** -0.5.
        initial_state: [N, HV, K, V] float32 (or float64) state entering each sequence; None means
            zeros. Gets a gradient when it requires one.
        output_final_state: True returns the state after each sequence as the second value; False
            returns None there.
        cu_seqlens: [N+1] int32/int64 offsets of N sequences packed into the rows of a batch-1
            input: sequence i has len_i = cu_seqlens[i+1] - cu_seqlens[i] real tokens
            (non-decreasing, cu_seqlens[0] = 0; zero-length sequences are allowed). None: each of
            the B rows is one sequence (N = B).
        cu_seqlens_padded: [N+1] storage offsets, same dtype and shape as cu_seqlens: sequence i's
            tokens are rows [cu_seqlens_padded[i], cu_seqlens_padded[i] + len_i), and every row
            outside these ranges is padding. None: cu_seqlens (no gaps between sequences; rows
            after cu_seqlens[-1] are still padding).
            Padding rows are 0 in o, get 0 gradient and belong to no chunk.
        use_qk_l2norm_in_kernel: replace q and k by x / sqrt(sum(x^2) + 1e-6) per head inside the op
            (with its gradient), as FLA's flag does.
        A_log, dt_bias: [HV] each, both or neither. With them g and beta hold the raw a and b of the
            Qwen3-Next / Megatron gating, and the op computes g = -exp(A_log) * softplus(a + dt_bias)
            and beta = sigmoid(b) itself, in float32 (never rounded to a's dtype); gradients reach a,
            b, A_log and dt_bias.
        backend: "auto" (default) picks "triton" for CUDA tensors ("torch" when triton is not
            installed) and "torch" for CPU tensors. "torch": vectorised PyTorch, any device.
            "triton": the Triton kernels; on CPU tensors only under the Triton interpreter
            (TRITON_INTERPRET=1 set before triton is imported); they compute in float32 at most, so
            float64 inputs are a TypeError there ("auto" runs float64 on "torch", exactly).
            "cuda": the sm_90a CUDA forward (csrc/chunk_gdr_fwd_sm90.cu; H100 / H200, K = V = 128,
            bfloat16 / float16; other inputs are an error naming why) with the Triton backward, its
            reverse dS pass on csrc/chunk_gdr_bwd_sm90.cu;
            opt-in only: "auto" never picks it yet.
        validate: also check the values of cu_seqlens (and cu_seqlens_padded): starting at 0,
            non-decreasing, within the rows. That reads them back to the host, so it is off by
            default on CUDA tensors (the op then never synchronises); GDN_PACKED_VALIDATE=1 turns it
            on everywhere. CPU tensors are always checked (free there).
        kwargs: FLA's and transformers' other keywords (gdn_packed/ops/_fla_compat.py): ignored when
            they do not change the result (use_cache, chunk_size, head_first=False, ...); FLA's fused
            gating use_gate_in_kernel=True with use_beta_sigmoid_in_kernel=True maps onto A_log /
            dt_bias; a value asking for anything else (head_first=True, state_v_first=True, seq_idx
            without cu_seqlens, ...) is a ValueError, an unknown keyword a TypeError.

    Returns:
        (o, final_state): o [B, T, HV, V] in v's dtype; final_state [N, HV, K, V] float32, or None
        unless output_final_state.

    Bad inputs raise TypeError / ValueError naming the argument, before any launch.
    """
    dt_bias = fla_keywords(OP, kwargs, cu_seqlens, A_log, dt_bias, fused_gate=True)
    _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_padded, scale)
    _check_gates(A_log, dt_bias, v.shape[2], q.device)
    segments.check_values_where_free(cu_seqlens, cu_seqlens_padded, q.shape[1], validate)
    N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    backend = resolve_backend(backend, q.device, have=AUTO_BACKENDS if backend == "auto" else BACKENDS_IMPLEMENTED,
                              refuse=lambda b: _refuse(b, q, v, N))
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    grads = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, g, beta, initial_state, A_log, dt_bias))
    # the segments, once per call: the forward saves them for the backward
    T = q.shape[0] * q.shape[1]
    table, cu_chunks = torch.ops.gdn_packed.chunk_table(segments.segments_or_rows(q, cu_seqlens, torch.int32)[0],
                                                        cu_seqlens_padded, T, CHUNK_SIZE, trusted=True)
    real = _token_mask(A_log, cu_seqlens, cu_seqlens_padded, T)
    o, final_state, _ = chunk_gdr_fwd(q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_padded,
                                      scale, bool(use_qk_l2norm_in_kernel), backend, A_log, dt_bias, grads,
                                      table, cu_chunks, real)
    return o, (final_state if output_final_state else None)


def _refuse(backend, q, v, N):
    """resolve_backend's `refuse`: float64 on triton; on cuda what its kernel does not take
    (gdn_packed.cuda.chunk.refusal), or no triton for its backward."""
    if backend != "cuda":
        return refuse_float64(q)(backend)
    from gdn_packed.cuda.chunk import refusal
    why = triton_usable(q.device)
    return refusal(q, v, q.device, N) or (RuntimeError(f"backend='cuda' of {OP} runs the Triton backward: "
                                                       f"{why}") if why else None)


def _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_padded, scale):
    B, T, H, HV, K, Vd = V.check_gdr_inputs(q, k, v, g, beta, MAX_HEAD_DIM)
    dev = q.device
    N = segments.check_cu_seqlens(cu_seqlens, cu_seqlens_padded, B, dev)
    chunk_slots(B * T, CHUNK_SIZE, N)
    if initial_state is not None:
        V.check_tensor("initial_state", initial_state, dtypes=(torch.float32, torch.float64), ndim=4,
                       device=dev)
        V.check_shape("initial_state", initial_state, (N, HV, K, Vd), " ([N, HV, K, V])")
    if scale is not None:
        V.check_float(scale, "scale")


def _check_gates(A_log, dt_bias, HV, dev):
    if (A_log is None) != (dt_bias is None):
        raise ValueError("A_log and dt_bias come together: pass both (g and beta are then the raw a "
                         "and b of the gating) or neither")
    if A_log is None:
        return
    for name, x in (("A_log", A_log), ("dt_bias", dt_bias)):
        V.check_tensor(name, x, ndim=1, device=dev)
        V.check_shape(name, x, (HV,), " ([HV], one per value head)")
