"""Padding-free training (and generation) of HF transformers' Qwen3-Next, Qwen3.5 and Qwen3.5-MoE with
every packed document kept apart: one call replaces the forward of each linear-attention layer.

    patch = apply(model)        every GatedDeltaNet layer of `model` runs gdn_packed's ops (idempotent)
    patch.remove()              transformers' own forward back
    with patch(model): ...      apply() for the block

A replaced layer computes what transformers' layer computes, with the same parameters and submodules
(so PEFT / LoRA wrappers of the projections keep working): its projections, then gdn_packed's varlen
causal conv, the chunked gated delta rule (training, prefill; the gating fused in the op) or the
recurrent one (one-token decode), gdn_packed's gated RMSNorm when the layer's norm is transformers' own
(else the layer's norm module), out_proj. The ops pick their backend (torch on CPU; triton / cuda on
GPUs, `backend=` to force one). transformers is imported by apply(), not by this module.

Documents (docs/DESIGN.md section 12), from the first source the layer gets, in this order:
  1. `cu_seq_lens_q` (+ `max_length_q`, a hint): offsets over the flattened batch*length rows, as
     transformers' flash-attention path reads them (a document may run on across a row boundary);
  2. `seq_idx` [B, L]: a new document where the index changes;
  3. `position_ids` [B, L] (handed to the layer by a hook on its decoder layer, which transformers does
     not do): a new document where the position does not increase by 1 (transformers' own rule);
  4. none: each row is one document (with sources 2-4 every row starts one).
  A 2-D `attention_mask` removes padding first (the layer runs on the real tokens only, packed, and
  writes 0 on padding), and with sources 2-3 the rules apply between consecutive real tokens.
Refused with a ValueError rather than mixing documents: `cu_seq_lens_k` / `max_length_*` without
`cu_seq_lens_q`, `cu_seq_lens_q` with a padding mask, a mask that is not 2-D at a layer, a 4-D mask at
the model without another source (position ids that restart, cu_seq_lens_q, seq_idx). A cache keeps
one sequence per row: a forward that fills it from rows of several documents works (training with
use_cache=True), continuing from such a cache or continuing with such rows is a ValueError, and a cache
that records past states for rollback (assisted decoding) a NotImplementedError.
"""
import inspect
import weakref
from contextlib import contextmanager
from types import MethodType
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gdn_packed import segments
from gdn_packed.layers.gated_deltanet import _for_op
from gdn_packed.ops import BACKENDS
from gdn_packed.ops.chunk_gdr import chunk_gated_delta_rule
from gdn_packed.ops.conv1d import causal_conv1d_varlen
from gdn_packed.ops.gated_rmsnorm import gated_rmsnorm
from gdn_packed.ops.recurrent_gdr import fused_recurrent_gated_delta_rule

__all__ = ["apply", "patch", "Patch", "document_boundaries"]

_MODELS = "transformers.models."
GDN_CLASSES = {(_MODELS + "qwen3_next.modeling_qwen3_next", "Qwen3NextGatedDeltaNet"),
               (_MODELS + "qwen3_5.modeling_qwen3_5", "Qwen3_5GatedDeltaNet"),
               (_MODELS + "qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeGatedDeltaNet")}
NORM_CLASSES = {(_MODELS + "qwen3_next.modeling_qwen3_next", "Qwen3NextRMSNormGated"),
                (_MODELS + "qwen3_5.modeling_qwen3_5", "Qwen3_5RMSNormGated"),
                (_MODELS + "qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeRMSNormGated")}
POSITIONS = "gdn_packed_position_ids"      # the keyword the decoder-layer hook hands the layer
PATCH = "_gdn_packed_patch"                # a patched model's Patch
LAYER = "_gdn_packed_layer"                # a patched layer's (Patch, attribute replaced, what it held)
_ABSENT = object()
_PARTIAL_PACKING = ("cu_seq_lens_k", "max_length_q", "max_length_k")


def _is_a(module, classes):
    return any((c.__module__, c.__name__) in classes for c in type(module).__mro__)


# ----------------------------------------------------------------------------------------------------
# where the documents are
# ----------------------------------------------------------------------------------------------------
class Plan(NamedTuple):
    """How a layer input [B, L, ...] becomes packed rows [1, T, ...]: cu_seqlens (int32 [N+1]) of its N
    documents over them; `index`, the flat B*L position of each row (None: the rows are the input
    itself, and rows at or after cu_seqlens[-1] are padding); `doc_rows` [N], the input row each
    document starts in; `packed`, whether a row holds several documents (None when not asked)."""
    cu_seqlens: Tensor
    index: Optional[Tensor]
    doc_rows: Tensor
    packed: Optional[bool]
    batch: int
    length: int

    def pack(self, x):
        rows = x.reshape(1, self.batch * self.length, *x.shape[2:])
        return rows if self.index is None else rows.index_select(1, self.index)

    def unpack(self, y):
        feature = y.shape[2:]
        if self.index is not None:
            y = y.new_zeros((self.batch * self.length, *feature)).index_copy(0, self.index, y[0])
        return y.reshape(self.batch, self.length, *feature)

    def last_doc_per_row(self):
        """[B]: the last document starting in each row, -1 for a row without one."""
        N = self.doc_rows.numel()
        last = torch.full((self.batch,), -1, dtype=torch.int64, device=self.doc_rows.device)
        return last.scatter_reduce(0, self.doc_rows, torch.arange(N, device=last.device), "amax")


def _per_token(name, t, B, L, device):
    """A [B, L] (or [1, L], broadcast) integer tensor of one value per token."""
    if not isinstance(t, Tensor) or t.dtype.is_floating_point or t.dim() != 2 or t.shape[1] != L \
            or t.shape[0] not in (1, B):
        raise ValueError(f"{name} must be an integer tensor [B, L] = [{B}, {L}] (or [1, {L}]), got "
                         f"{type(t).__name__ if not isinstance(t, Tensor) else (t.dtype, tuple(t.shape))}")
    return t.to(device).expand(B, L)


def document_boundaries(batch, length, device, *, attention_mask=None, cu_seq_lens_q=None, seq_idx=None,
                        position_ids=None, with_packed=False):
    """The Plan of a layer input [batch, length, ...] from transformers' boundary sources (module
    docstring); with_packed also finds whether a row holds several documents (Plan.packed).
    Reads values back to the host (the number of real tokens and of documents) unless cu_seq_lens_q
    is given on the device (and with_packed is off)."""
    B, L = batch, length
    real = None
    if attention_mask is not None:
        if not isinstance(attention_mask, Tensor) or attention_mask.dim() != 2 \
                or tuple(attention_mask.shape) != (B, L):
            raise ValueError(f"the linear-attention layers take a 2-D padding mask [B, L] = [{B}, {L}], got "
                             f"{tuple(getattr(attention_mask, 'shape', ()))}: a 4-D mask does not say where "
                             f"documents start; pass position_ids, cu_seq_lens_q or seq_idx with a 2-D mask")
        real = attention_mask.to(device) != 0
    if cu_seq_lens_q is not None:
        if real is not None:
            raise ValueError("cu_seq_lens_q and a padding attention_mask were both given: pass one (cu_seq_lens_q "
                             "describes packed rows, the mask padded ones)")
        segments.check_cu_seqlens_meta(cu_seq_lens_q, "cu_seq_lens_q")
        if cu_seq_lens_q.device.type == "meta":
            raise ValueError("cu_seq_lens_q is on the meta device: it holds no offsets")
        if cu_seq_lens_q.device.type == "cpu":     # free on the host; a device tensor is not read back
            segments.validate_cu_seqlens(cu_seq_lens_q, total_rows=B * L, name="cu_seq_lens_q")
        cu = cu_seq_lens_q.to(device=device, dtype=torch.int32)
        index, doc_rows = None, (cu[:-1].long() // L).clamp(max=B - 1)
    else:
        index = None if real is None else torch.nonzero(real.reshape(-1)).view(-1)
        flat = torch.arange(B * L, device=device) if index is None else index
        row = flat // L
        starts = torch.ones(flat.numel(), dtype=torch.bool, device=device)
        starts[1:] = row[1:] != row[:-1]
        if seq_idx is not None:
            s = _per_token("seq_idx", seq_idx, B, L, device).reshape(-1)[flat]
            starts[1:] |= s[1:] != s[:-1]
        elif position_ids is not None:
            p = _per_token("position_ids", position_ids, B, L, device).reshape(-1)[flat]
            starts[1:] |= p[1:] != p[:-1] + 1
        first = torch.nonzero(starts).view(-1)
        ends = torch.full((1,), flat.numel(), dtype=torch.int64, device=device)
        cu, doc_rows = torch.cat([first, ends]).to(torch.int32), row[first]
    packed = bool((torch.bincount(doc_rows, minlength=B) > 1).any()) if with_packed else None
    return Plan(cu, index, doc_rows, packed, B, L)


class _LastPlan:
    """The last Plan of one model, reused by its next layer while the same source tensors (identity and
    version: the memo holds them, so an identity cannot be reused) come in: one host read-back per
    model forward instead of one per layer."""

    def __init__(self):
        self.key, self.plan = None, None

    def get(self, static, tensors, make):
        key = (static, torch.is_inference_mode_enabled(),
               tuple((t, t._version) if isinstance(t, Tensor) else (t, None) for t in tensors))
        if self.key is None or not _same_key(self.key, key):
            self.key = None                     # make() may raise: no stale plan under the new key
            self.plan, self.key = make(), key
        return self.plan


def _same_key(a, b):
    return a[:2] == b[:2] and len(a[2]) == len(b[2]) and all(
        x is y and vx == vy for (x, vx), (y, vy) in zip(a[2], b[2]))


# ----------------------------------------------------------------------------------------------------
# the layer
# ----------------------------------------------------------------------------------------------------
def _project(layer, x):
    """x [1, T, hidden] -> conv input q|k|v [1, T, 2*Hk*Dk + Hv*Dv], z [1, T, Hv, Dv], b, a [1, T, Hv],
    through the layer's own projection modules (Qwen3-Next's grouped qkvz / ba, or Qwen3.5's flat ones)."""
    if hasattr(layer, "in_proj_qkvz"):
        q, k, v, z, b, a = layer.fix_query_key_value_ordering(layer.in_proj_qkvz(x), layer.in_proj_ba(x))
        return torch.cat([t.flatten(2) for t in (q, k, v)], dim=-1), z, b, a
    z = layer.in_proj_z(x).unflatten(-1, (-1, layer.head_v_dim))
    return layer.in_proj_qkv(x), z, layer.in_proj_b(x), layer.in_proj_a(x)


def _conv_window(qkv, cu, old):
    """Per sequence the conv state after its rows, [N, D, W] in transformers' layout (the last W conv
    inputs, oldest first) of `old` [N, D, W] (the state before) followed by its packed rows of qkv."""
    width = old.shape[-1]
    if qkv.shape[1] == 0:
        return old
    lens = (cu[1:] - cu[:-1]).long()
    col = torch.arange(width, device=qkv.device)
    new_rows = cu[1:, None].long() - width + col                      # [N, W] packed row of each column
    new = qkv[0].index_select(0, new_rows.clamp(0, qkv.shape[1] - 1).reshape(-1))
    new = new.view(*new_rows.shape, -1).transpose(1, 2)               # [N, D, W]
    kept = old.gather(2, (lens[:, None] + col).clamp(max=width - 1)[:, None, :].expand_as(old))
    return torch.where((lens[:, None] + col >= width)[:, None, :], new, kept)


def _rows_of_last_docs(per_doc, last, before):
    """[B, ...]: the value of each row's last document (per_doc [N, ...], last [B] from
    Plan.last_doc_per_row), `before` [B, ...] for a row without one."""
    picked = per_doc.index_select(0, last.clamp(min=0)) if per_doc.shape[0] else before
    return torch.where((last >= 0).view(-1, *([1] * (before.dim() - 1))), picked.to(before.dtype), before)


def _gated_norm(layer, o, z, cu, backend):
    norm = layer.norm
    if _is_a(norm, NORM_CLASSES) and "forward" not in norm.__dict__ and getattr(norm, "activation", "silu") \
            in ("silu", "swish"):
        return gated_rmsnorm(o, z, norm.weight, norm.variance_epsilon, backend=backend, cu_seqlens=cu)
    return norm(o.reshape(-1, o.shape[-1]), z.reshape(-1, z.shape[-1])).view(o.shape)


def _forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
    """The replacement of a transformers GatedDeltaNet layer's forward (module docstring)."""
    patch = self.__dict__[LAYER][0]
    cache = kwargs.pop("cache_params", None) if cache is None else cache
    positions = kwargs.pop(POSITIONS, None)
    positions = kwargs.get("position_ids") if positions is None else positions
    cu_q, seq_idx = kwargs.get("cu_seq_lens_q"), kwargs.get("seq_idx")
    if cu_q is None and any(kwargs.get(name) is not None for name in _PARTIAL_PACKING):
        raise ValueError(f"{', '.join(n for n in _PARTIAL_PACKING if kwargs.get(n) is not None)} came without "
                         f"cu_seq_lens_q: the rows look packed but no document boundaries reached the "
                         f"linear-attention layer; pass cu_seq_lens_q, seq_idx or position_ids")
    idx, B, L = self.layer_idx, hidden_states.shape[0], hidden_states.shape[1]
    if cache is not None and cache.is_recording_past(idx):
        raise NotImplementedError("gdn_packed.integrations.transformers: a cache that records past states for "
                                  "rollback (assisted / speculative decoding) is not supported")
    conv_old = None if cache is None else cache.get_conv_state(idx)
    state_old = None if cache is None else cache.get_recurrent_state(idx)
    source = (attention_mask, cu_q) + ((seq_idx,) if cu_q is None else ()) + \
        ((positions,) if cu_q is None and seq_idx is None else ())
    plan = patch.plans.get((B, L, hidden_states.device, cache is not None), source, lambda: document_boundaries(
        B, L, hidden_states.device, attention_mask=attention_mask, cu_seq_lens_q=cu_q, seq_idx=seq_idx,
        position_ids=positions, with_packed=cache is not None))
    if cache is not None:
        _check_continuation(patch, cache, plan, conv_old is not None)
    cu, rows, backend = plan.cu_seqlens, plan.doc_rows, patch.backend

    qkv, z, b, a = _project(self, plan.pack(hidden_states))
    conv0 = None if conv_old is None else conv_old.index_select(0, rows)[..., 1:].to(qkv.dtype)
    mixed, _ = causal_conv1d_varlen(qkv, self.conv1d.weight, self.conv1d.bias, activation="silu", cu_seqlens=cu,
                                    initial_state=conv0, backend=_for_op(backend, BACKENDS["causal_conv1d_varlen"]))
    q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
    q, k = (t.unflatten(-1, (-1, self.head_k_dim)) for t in (q, k))
    v = v.unflatten(-1, (-1, self.head_v_dim))
    state0 = None if state_old is None else state_old.index_select(0, rows).to(torch.float32)
    if state0 is not None and L == 1:           # one-token decode: the recurrent op, gates formed here in fp32
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        o, state = fused_recurrent_gated_delta_rule(
            q, k, v, g, b.float().sigmoid(), initial_state=state0, output_final_state=True, cu_seqlens=cu,
            use_qk_l2norm_in_kernel=True, backend=_for_op(backend, BACKENDS["fused_recurrent_gated_delta_rule"]))
    else:                                       # training / prefill: the chunked op, gating fused in it
        o, state = chunk_gated_delta_rule(
            q, k, v, a, b, initial_state=state0, output_final_state=cache is not None, cu_seqlens=cu,
            use_qk_l2norm_in_kernel=True, A_log=self.A_log, dt_bias=self.dt_bias,
            backend=_for_op(backend, BACKENDS["chunk_gated_delta_rule"]))
    if cache is not None:
        _update_cache(cache, idx, plan, qkv.detach(), conv_old, state.detach(), state_old, self.conv1d.kernel_size[0])
    o = _gated_norm(self, o, z, cu, _for_op(backend, BACKENDS["gated_rmsnorm"]))
    return plan.unpack(self.out_proj(o.flatten(-2)))


def _check_continuation(patch, cache, plan, continues):
    """A cache continues one sequence per row: refuse rows of several documents there, and a cache
    whose states came from such rows (each row's state is its LAST document's, decoding from it
    would continue that document while transformers' attention layers see the whole row)."""
    if not continues:
        (patch.packed_caches.add if plan.packed else patch.packed_caches.discard)(cache)
        return
    if plan.packed:
        raise ValueError("a row holds several documents (its position_ids / seq_idx / cu_seq_lens_q restart) "
                         "while continuing from a cache: generation with packed rows is not supported; give "
                         "each sequence its own row (left padding with attention_mask)")
    if cache in patch.packed_caches:
        raise ValueError("this cache was filled from packed rows (several documents per row): generating from it "
                         "is not supported; prefill each sequence in its own row (left padding with attention_mask)")


def _update_cache(cache, idx, plan, qkv, conv_old, state, state_old, width):
    """Write each row's conv window and recurrent state (its last document's) into transformers' cache;
    the cache's own update_conv_state keeps its token count and lazy set-up."""
    rows, B, L = plan.doc_rows, plan.batch, plan.length
    before = qkv.new_zeros((B, qkv.shape[-1], width)) if conv_old is None else conv_old.to(qkv.dtype)
    windows = _conv_window(qkv, plan.cu_seqlens, before.index_select(0, rows))
    last = plan.last_doc_per_row()
    window = _rows_of_last_docs(windows, last, before)
    state_before = state.new_zeros((B, *state.shape[1:])) if state_old is None else state_old
    new_state = _rows_of_last_docs(state, last, state_before)
    cache.update_conv_state(window.new_zeros(()).expand(B, window.shape[1], L), idx, conv_kernel_size=width)
    cache.get_conv_state(idx).copy_(window)
    cache.update_recurrent_state(new_state, idx)


# ----------------------------------------------------------------------------------------------------
# hooks: position ids into the layer, custom masks refused at the model
# ----------------------------------------------------------------------------------------------------
def _argument(params, name, args, kwargs):
    """The value of argument `name` of a call (args, kwargs) to a forward with parameters `params`
    (without self); None when absent."""
    if name in kwargs:
        return kwargs[name]
    i = params.index(name) if name in params else len(args)
    return args[i] if i < len(args) else None


def _forward_params(module):
    return list(inspect.signature(type(module).forward).parameters)[1:]


def _positions_hook(params):
    def hook(module, args, kwargs):
        return args, {**kwargs, POSITIONS: _argument(params, "position_ids", args, kwargs)}
    return hook


def _text_positions(position_ids):
    """The text positions among transformers' position ids: [B, L] itself; Qwen3.5's [4, B, L] (text,
    then the three M-RoPE rows): row 0; M-RoPE only ([3, B, L]): none."""
    if isinstance(position_ids, Tensor) and position_ids.dim() == 3:
        return position_ids[0] if position_ids.shape[0] == 4 else None
    return position_ids


def _custom_mask_hook(params):
    def hook(module, args, kwargs):
        mask = _argument(params, "attention_mask", args, kwargs)
        if not (isinstance(mask, Tensor) and mask.dim() == 4):
            return None
        if kwargs.get("cu_seq_lens_q") is not None or kwargs.get("seq_idx") is not None:
            return None
        pos = _text_positions(_argument(params, "position_ids", args, kwargs))
        if isinstance(pos, Tensor) and pos.shape[-1] > 1 and bool((pos[..., 1:] != pos[..., :-1] + 1).any()):
            return None
        raise ValueError("a 4-D attention_mask does not tell the linear-attention (GatedDeltaNet) layers where "
                         "documents start or which tokens are padding, and nothing else does here: pass "
                         "position_ids that restart at every document, cu_seq_lens_q or seq_idx (packed rows), "
                         "or a 2-D attention_mask (padded rows)")
    return hook


# ----------------------------------------------------------------------------------------------------
# apply / remove
# ----------------------------------------------------------------------------------------------------
class Patch:
    """What apply() changed on one model; remove() puts transformers' forwards back."""

    def __init__(self, model, backend):
        self.model, self.backend = model, backend
        self.layers, self.hooks, self.plans = [], [], _LastPlan()
        self.packed_caches = weakref.WeakSet()   # caches filled from rows of several documents

    def __repr__(self):
        return f"Patch({len(self.layers)} GatedDeltaNet layers, backend={self.backend!r})"

    def _replace(self, layer, forward):
        # accelerate's hooks wrap `forward` and call `_old_forward`: replace that one then
        attr = "_old_forward" if hasattr(layer, "_hf_hook") and "_old_forward" in layer.__dict__ else "forward"
        setattr(layer, LAYER, (self, attr, layer.__dict__.get(attr, _ABSENT)))
        setattr(layer, attr, MethodType(forward, layer))
        self.layers.append(layer)

    def remove(self):
        """Undo apply(): the layers' forwards, the hooks. Calling it twice does nothing more."""
        for layer in self.layers:
            _, attr, held = layer.__dict__.pop(LAYER)
            if held is _ABSENT:
                delattr(layer, attr)
            else:
                setattr(layer, attr, held)
        for handle in self.hooks:
            handle.remove()
        self.layers, self.hooks, self.plans = [], [], _LastPlan()
        if self.model.__dict__.get(PATCH) is self:
            del self.model.__dict__[PATCH]


def _transformers():
    try:
        import transformers
    except ImportError as e:
        raise ImportError("gdn_packed.integrations.transformers needs transformers >= 5 "
                          "(pip install 'gdn_packed[hf]')") from e
    if int(transformers.__version__.split(".")[0]) < 5:
        raise ImportError(f"gdn_packed.integrations.transformers needs transformers >= 5, found "
                          f"{transformers.__version__} (pip install 'gdn_packed[hf]')")
    return transformers


def _layer_forward():
    """_forward, firing accelerate's hooks of the conv (its weight is read directly) as transformers does."""
    try:
        from transformers.integrations.accelerate import force_accelerate_hooks
    except ImportError:
        return _forward
    return force_accelerate_hooks("conv1d")(_forward)


def apply(model, *, backend="auto"):
    """Make every Qwen3-Next / Qwen3.5 / Qwen3.5-MoE GatedDeltaNet layer of `model` (any transformers
    model or submodule holding them, the VL models' text stack included) run gdn_packed's ops and keep
    packed documents apart (module docstring). Idempotent: a model already patched returns its Patch.

    backend: "auto" (default; each op's own choice), "torch", "triton" or "cuda" (ops without that
    backend use their "auto" choice). Returns the Patch; patch.remove() undoes it.
    Raises ValueError when the model has no such layer or a layer's activation is not SiLU."""
    _transformers()
    current = model.__dict__.get(PATCH)
    if current is not None:
        if current.backend != backend:
            raise ValueError(f"model is already patched with backend={current.backend!r}; remove() it first")
        return current
    if backend not in ("auto", "torch", "triton", "cuda"):
        raise ValueError(f"backend must be 'auto', 'torch', 'triton' or 'cuda', got {backend!r}")
    layers = [m for m in model.modules() if _is_a(m, GDN_CLASSES)]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no Qwen3-Next / Qwen3.5 / Qwen3.5-MoE GatedDeltaNet layer "
                         f"(supported: {sorted(name for _, name in GDN_CLASSES)})")
    for layer in layers:
        if getattr(layer, "activation", "silu") not in ("silu", "swish"):
            raise ValueError(f"layer {layer.layer_idx}: the conv activation must be SiLU, got {layer.activation!r}")
    patch = Patch(model, backend)
    forward = _layer_forward()
    for layer in layers:
        if LAYER not in layer.__dict__:
            patch._replace(layer, forward)
    mine = {id(layer) for layer in patch.layers}
    for parent in model.modules():
        if any(id(child) in mine for child in parent.children()):
            patch.hooks.append(parent.register_forward_pre_hook(
                _positions_hook(_forward_params(parent)), with_kwargs=True))
        stack = getattr(parent, "layers", None)
        if isinstance(stack, nn.ModuleList) and any(id(c) in mine for block in stack for c in block.children()):
            patch.hooks.append(parent.register_forward_pre_hook(
                _custom_mask_hook(_forward_params(parent)), with_kwargs=True))
    setattr(model, PATCH, patch)
    return patch


@contextmanager
def patch(model, *, backend="auto"):
    """`with patch(model):` runs the block with apply(model) in effect, and removes it after, unless the
    model was patched before the block (then it stays)."""
    before = model.__dict__.get(PATCH)
    p = apply(model, backend=backend)
    try:
        yield model
    finally:
        if before is None:
            p.remove()
