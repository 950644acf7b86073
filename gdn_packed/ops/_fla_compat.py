"""The keywords FLA's gated-delta-rule functions (fla-core 0.6.0) and transformers' calls of them take
beyond gdn_packed's own: what chunk_gated_delta_rule and fused_recurrent_gated_delta_rule do with them
(docs/DESIGN.md section 4).

* A keyword that does not change the math is accepted and ignored: kernel tuning (`chunk_size` 16/32/64,
  `chunk_indices`, `cu_seqlens_cpu`) and what transformers' layers pass along (`use_cache`,
  `max_length_q`, `num_items_in_batch`, output flags).
* A keyword at FLA's default value is accepted (`head_first=False`, `state_v_first=False`, `gk=None`,
  ...); any other value asks for something these ops do not compute and is a ValueError naming it.
* Keywords that carry document boundaries (`seq_idx`, `position_ids`, `cu_seq_lens_k`) are ignored when
  `cu_seqlens` is given and a ValueError when it is not: ignoring them would mix packed documents.
* Anything else is a TypeError naming it (FLA swallows unknown keywords; a typo must not pass here).
"""
import torch

IGNORED = frozenset({"use_cache", "chunk_indices", "cu_seqlens_cpu", "max_length_q", "max_length_k",
                     "num_items_in_batch", "output_attentions", "output_hidden_states", "output_router_logits"})
BOUNDARY_CARRIERS = frozenset({"seq_idx", "position_ids", "cu_seq_lens_k"})
CHUNK_SIZES = (16, 32, 64)
# FLA's default, and what another value would ask for
AT_DEFAULT = {
    "head_first": (False, "inputs are [B, T, H, K] here; pass x.transpose(1, 2) of a [B, H, T, K] tensor"),
    "state_v_first": (False, "states are [N, HV, K, V] here (K before V); transpose them yourself"),
    "transpose_state_layout": (False, "states are [N, HV, K, V] here (K before V); transpose them yourself"),
    "allow_neg_eigval": (False, "beta in [0, 2) is not computed here"),
    "is_causal": (True, "the recurrence is causal"),
    "cp_context": (None, "context parallelism runs through gdn_packed.megatron"),
    "gk": (None, "the decay is one scalar g per token and value head here; per-key decay is not computed"),
    "gv": (None, "the decay is one scalar g per token and value head here; per-value decay is not computed"),
    "use_gate_in_kernel": (False, "this op takes the log-decay g; chunk_gated_delta_rule fuses the gating "
                                  "(A_log=, dt_bias=)"),
    "use_beta_sigmoid_in_kernel": (False, "pass beta = sigmoid(b)"),
}
FUSED_GATE = ("use_gate_in_kernel", "use_beta_sigmoid_in_kernel")


def _is_default(value, default):
    if default is None:
        return value is None
    return isinstance(value, (bool, int)) and bool(value) == default


def fla_keywords(op, kwargs, cu_seqlens, A_log=None, dt_bias=None, fused_gate=False):
    """Check the extra keywords `kwargs` of public op `op` (module docstring); returns dt_bias.

    fused_gate: the op computes FLA's `use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True`
    gating itself from A_log / dt_bias (chunk_gated_delta_rule): those two keywords are then taken
    together (with A_log; a missing dt_bias becomes zeros, as in FLA), and `use_gate_in_kernel=False`
    with A_log is refused (FLA would ignore A_log there, this op would not)."""
    for name, value in kwargs.items():
        if name in IGNORED or (fused_gate and name in FUSED_GATE):
            continue
        if name == "chunk_size":
            if value not in CHUNK_SIZES:
                raise ValueError(f"{op}: chunk_size must be one of {CHUNK_SIZES} (as in FLA; the result does "
                                 f"not depend on it), got {value!r}")
        elif name in BOUNDARY_CARRIERS:
            if value is not None and cu_seqlens is None:
                raise ValueError(f"{op}: {name} marks packed documents, which this op reads only from "
                                 f"cu_seqlens; pass cu_seqlens (gdn_packed.packing builds it from position ids "
                                 f"or lengths), or None for unpacked rows")
        elif name in AT_DEFAULT:
            default, why = AT_DEFAULT[name]
            if not _is_default(value, default):
                raise ValueError(f"{op}: {name}={value!r} is not supported ({why}); only FLA's default "
                                 f"{name}={default!r} is accepted")
        else:
            raise TypeError(f"{op}() got an unexpected keyword argument {name!r}")
    if not fused_gate or not any(name in kwargs for name in FUSED_GATE):
        return dt_bias
    gate, sig = (bool(kwargs.get(name, False)) for name in FUSED_GATE)
    if gate != sig:
        raise ValueError(f"{op}: use_gate_in_kernel and use_beta_sigmoid_in_kernel go together here (the "
                         f"fused gating computes g = -exp(A_log) softplus(g + dt_bias) AND beta = sigmoid(beta)), "
                         f"got {gate} and {sig}")
    if gate and A_log is None:
        raise ValueError(f"{op}: use_gate_in_kernel=True needs A_log")
    if not gate and A_log is not None:
        raise ValueError(f"{op}: use_gate_in_kernel=False with A_log is ambiguous (FLA ignores A_log there, "
                         f"this op would apply it); drop one of them")
    return torch.zeros_like(A_log) if gate and dt_bias is None else dt_bias
