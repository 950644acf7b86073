"""Megatron-Core `GatedDeltaNet` block on gdn_packed kernels (drop-in for megatron-core 0.19.2).

Same constructor, forward contract, submodules, parameter names/shapes/dtypes/initialisation and
`sharded_state_dict` as `megatron.core.ssm.gated_delta_net.GatedDeltaNet`, so a Megatron checkpoint
loads strictly and the block can be swapped in through the module spec (see `spec.py`).

Per TP rank (local sizes: qk = H*K/tp, v = HV*V/tp, hv = HV/tp):

    [s, b, hidden] -in_proj-> [q qk | k qk | v v | z v | b hv | a hv]     (ColumnParallelLinear, SP gather)
    q,k,v   = silu(causal_conv1d_varlen([q k v], conv1d.weight, cu_seqlens))
    g       = -exp(A_log) * softplus(a + dt_bias),  beta = sigmoid(b)     (float32)
    o       = chunk_gated_delta_rule(q, k, v, g, beta, l2norm(q, k), GVA by indexing)
    y       = rmsnorm(o) * out_norm.weight * silu(z)                       (fused gated RMSNorm)
    out     = out_proj(y)                                                  (RowParallelLinear, SP scatter)

THD input (`PackedSeqParams(qkv_format="thd")`, batch 1): real lengths from `cu_seqlens_q`, storage
offsets from `cu_seqlens_q_padded` when given. Padding rows are skipped by every kernel and are 0 in
the output (and get 0 gradient); nothing reads cu_seqlens back to the host. SBHD input: any batch,
each row one sequence. Context parallelism is refused (cp_size > 1 raises at construction).
"""
from functools import partial
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from megatron.core import tensor_parallel
from megatron.core.fp8_utils import get_fp8_align_size
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.ssm.utils import _split_tensor_factory
from megatron.core.tensor_parallel import get_cuda_rng_tracker
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
    sharded_state_dict_default,
)
from megatron.core.utils import deprecate_inference_params

from gdn_packed.ops.chunk_gdr import chunk_gated_delta_rule
from gdn_packed.ops.conv1d import causal_conv1d_varlen
from gdn_packed.ops.gated_rmsnorm import gated_rmsnorm
from gdn_packed.packing import padding_row_mask

# names of the in_proj output sections and of the conv1d channel sections, as in Megatron's
# checkpoints (sharded_state_dict splits the fused tensors into these so TP can be resharded)
IN_PROJ_SECTION_NAMES = ("query", "key", "value", "z", "beta", "alpha")
CONV_SECTION_NAMES = ("query", "key", "value")


class GatedDeltaNet(MegatronModule):
    """Gated DeltaNet mixer with Megatron-Core 0.19.2's interface, on gdn_packed kernels.

    Args are those of Megatron's block: `config` (TransformerConfig with the `linear_*` fields),
    `submodules` (GatedDeltaNetSubmodules: in_proj, out_norm, out_proj specs), `layer_number`,
    `bias` (linear biases), `conv_bias`, `conv_init` (uniform range of the conv weights, None keeps
    torch's default), `use_qk_l2norm`, `A_init_range`, `pg_collection` (needs `.tp` and `.cp`),
    `name`, `cp_comm_type` (accepted and ignored, as in Megatron).
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules,
        layer_number: Optional[int] = None,
        bias: bool = False,
        conv_bias: bool = False,
        conv_init: Optional[float] = None,
        use_qk_l2norm: bool = True,
        A_init_range: tuple = (1, 16),
        pg_collection: Optional[ProcessGroupCollection] = None,
        *,
        name: Optional[str] = None,
        cp_comm_type: Optional[str] = None,
    ):
        super().__init__(config)
        if pg_collection is None:
            raise ValueError("pg_collection must be provided for GatedDeltaNet (it needs .tp and .cp)")
        if not (0 <= A_init_range[0] <= A_init_range[1]):
            raise ValueError(f"A_init_range must be (lo, hi) with 0 <= lo <= hi, got {A_init_range}")
        self.layer_number = layer_number
        self.bias = bias
        self.conv_bias = conv_bias
        self.conv_init = conv_init
        self.use_qk_l2norm = use_qk_l2norm
        self.A_init_range = A_init_range
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp
        self.tp_size = pg_collection.tp.size()
        self.cp_size = pg_collection.cp.size()
        self.sp_size = self.tp_size if config.sequence_parallel else 1
        if self.cp_size > 1:
            raise NotImplementedError(
                f"gdn_packed.megatron.GatedDeltaNet does not support context parallelism "
                f"(cp size {self.cp_size}); run with context_parallel_size=1 or use Megatron's block")

        self.hidden_size = config.hidden_size
        self.act_fn = config.activation_func
        self.activation = self.act_fn.__name__
        if self.activation not in ("silu", "swish"):
            raise ValueError(f"GatedDeltaNet needs config.activation_func = F.silu (the conv and the "
                             f"output gate are SiLU), got {self.activation!r}")
        self.conv_kernel_dim = config.linear_conv_kernel_dim
        self.key_head_dim = config.linear_key_head_dim
        self.value_head_dim = config.linear_value_head_dim
        self.num_key_heads = config.linear_num_key_heads
        self.num_value_heads = config.linear_num_value_heads
        for what, n in (("linear_num_key_heads", self.num_key_heads),
                        ("linear_num_value_heads", self.num_value_heads)):
            if n % self.tp_size:
                raise ValueError(f"config.{what} = {n} must be divisible by the TP size {self.tp_size}")
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(f"linear_num_value_heads ({self.num_value_heads}) must be a multiple of "
                             f"linear_num_key_heads ({self.num_key_heads})")
        self.qk_dim = self.key_head_dim * self.num_key_heads
        self.v_dim = self.value_head_dim * self.num_value_heads
        self.qk_dim_local_tp = self.qk_dim // self.tp_size
        self.v_dim_local_tp = self.v_dim // self.tp_size
        self.num_k_heads_local_tp = self.num_key_heads // self.tp_size
        self.num_v_heads_local_tp = self.num_value_heads // self.tp_size
        self.in_proj_split_names = list(IN_PROJ_SECTION_NAMES)
        self.in_proj_split_sections = (
            self.qk_dim_local_tp, self.qk_dim_local_tp, self.v_dim_local_tp, self.v_dim_local_tp,
            self.num_v_heads_local_tp, self.num_v_heads_local_tp)
        self.in_proj_extra_dim = 2 * self.num_value_heads
        self.in_proj_dim = 2 * self.qk_dim + 2 * self.v_dim + self.in_proj_extra_dim
        self.conv_dim = 2 * self.qk_dim + self.v_dim
        self.conv_dim_local_tp = self.conv_dim // self.tp_size
        if config.fp8 and self.in_proj_dim % get_fp8_align_size(config.fp8_recipe):
            raise ValueError("for FP8 the GDN in_proj output size must be a multiple of "
                             f"{get_fp8_align_size(config.fp8_recipe)}, got {self.in_proj_dim}")

        # Modules and parameters are created in Megatron's order (so a seeded init matches):
        # in_proj, conv1d, dt_bias, A_log, out_norm, out_proj.
        self.in_proj = build_module(
            submodules.in_proj, self.hidden_size, self.in_proj_dim, config=config,
            init_method=config.init_method, gather_output=False, bias=bias, skip_bias_add=False,
            is_expert=False, tp_comm_buffer_name="fc1", tp_group=self.tp_group,
            name=None if name is None else name + ".in_proj")
        # The conv weight lives in an nn.Conv1d ([D, 1, W]) for checkpoint compatibility; its forward
        # is never called (the varlen conv op reads the weight as [D, W]).
        device = torch.cuda.current_device() if torch.cuda.is_available() else None
        self.conv1d = nn.Conv1d(
            self.conv_dim_local_tp, self.conv_dim_local_tp, kernel_size=self.conv_kernel_dim,
            groups=self.conv_dim_local_tp, padding=self.conv_kernel_dim - 1, bias=conv_bias,
            device=device, dtype=config.params_dtype)
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads_local_tp, device=device,
                                                dtype=config.params_dtype))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads_local_tp, device=device,
                                              dtype=config.params_dtype))
        for p in (self.conv1d.weight, self.conv1d.bias, self.dt_bias, self.A_log):
            if p is not None:
                p.tensor_model_parallel = True
                p.partition_dim = 0
        self.out_norm = build_module(submodules.out_norm, config=config,
                                     hidden_size=self.value_head_dim, eps=config.layernorm_epsilon)
        if self.tp_size > 1 and _fusable_rmsnorm_eps(self.out_norm, config.params_dtype) is not None:
            # The forward all-reduces this weight's gradient over TP (see _gated_norm); keep
            # Megatron's finalize_model_grads from summing it a second time under SP.
            self.out_norm.weight.sequence_parallel = False
        self.recompute_norm_out = (config.recompute_granularity == "selective"
                                   and "gdn_norm_out" in (config.recompute_modules or ()))
        self.norm_out_checkpoint = None
        self.out_proj = build_module(
            submodules.out_proj, self.v_dim, self.hidden_size, config=config,
            init_method=config.output_layer_init_method, bias=bias, input_is_parallel=True,
            skip_bias_add=True, is_expert=False, tp_comm_buffer_name="fc2", tp_group=self.tp_group,
            name=None if name is None else name + ".out_proj")
        self.reset_parameters()

    def reset_parameters(self):
        """Megatron's init (under config.perform_initialization): conv weights U(-conv_init,
        conv_init) when conv_init is set, dt_bias = 1, A_log = log(U(A_init_range)), drawn from the
        model-parallel RNG stream in that order."""
        if not self.config.perform_initialization:
            return
        with get_cuda_rng_tracker().fork(), torch.no_grad():
            if self.conv_init is not None:
                self.conv1d.weight.uniform_(-self.conv_init, self.conv_init)
            self.dt_bias.fill_(1.0)
            A = torch.empty_like(self.A_log).uniform_(*self.A_init_range)
            self.A_log.copy_(A.log())

    # ------------------------------------------------------------------------------------------
    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        inference_context=None,
        packed_seq_params: Optional[PackedSeqParams] = None,
        sequence_len_offset: Optional[int] = None,
        *,
        inference_params=None,
        **kwargs,
    ):
        """hidden_states [s, b, hidden] (s is the local shard under sequence parallelism) ->
        (output [s, b, hidden], out_proj bias or None). `attention_mask` is ignored (causality is
        by construction; packing comes from `packed_seq_params`)."""
        if deprecate_inference_params(inference_context, inference_params) is not None:
            raise NotImplementedError("gdn_packed.megatron.GatedDeltaNet does not support inference "
                                      "(inference_context) yet")
        cu_seqlens, cu_seqlens_padded = self._packed_layout(packed_seq_params, hidden_states)

        qkvzba, _ = self.in_proj(hidden_states)  # [S, B, in_proj_dim / tp], S = full length
        S, B = qkvzba.shape[:2]
        x = qkvzba.transpose(0, 1)  # [B, S, .] (a view; B = 1 for THD)
        qk, v_, hv = self.qk_dim_local_tp, self.v_dim_local_tp, self.num_v_heads_local_tp
        qkv, z, b, a = torch.split(x, [2 * qk + v_, v_, hv, hv], dim=-1)

        qkv, _ = causal_conv1d_varlen(
            qkv, self.conv1d.weight.squeeze(1), self.conv1d.bias, activation="silu",
            cu_seqlens=cu_seqlens, cu_seqlens_padded=cu_seqlens_padded)
        q, k, v = torch.split(qkv, [qk, qk, v_], dim=-1)
        q = q.unflatten(-1, (self.num_k_heads_local_tp, self.key_head_dim))
        k = k.unflatten(-1, (self.num_k_heads_local_tp, self.key_head_dim))
        v = v.unflatten(-1, (hv, self.value_head_dim))
        g, beta = self._gates(a, b)

        o, _ = chunk_gated_delta_rule(
            q, k, v, g, beta, cu_seqlens=cu_seqlens, cu_seqlens_padded=cu_seqlens_padded,
            use_qk_l2norm_in_kernel=self.use_qk_l2norm)
        z = z.unflatten(-1, (hv, self.value_head_dim))

        if self.recompute_norm_out:
            self.norm_out_checkpoint = tensor_parallel.CheckpointWithoutOutput()
            norm = partial(self._gated_norm, cu_seqlens=cu_seqlens,
                           cu_seqlens_padded=cu_seqlens_padded)
            y = self.norm_out_checkpoint.checkpoint(norm, o, z)
        else:
            y = self._gated_norm(o, z, cu_seqlens, cu_seqlens_padded)
        out, out_bias = self.out_proj(y)
        if self.recompute_norm_out:
            self.norm_out_checkpoint.discard_output_and_register_recompute(out)
        return out, out_bias

    def _gates(self, a, b):
        """g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b): [B, S, hv], float32
        (float64 for float64 input).

        On CPU they are computed in float64 and rounded: ATen's vectorised and scalar softplus /
        sigmoid differ in the last float32 bit, so a token's gate would depend on whether it falls in
        the vector body or the tail of the loop (i.e. on how the batch is packed); the rounded
        float64 values do not."""
        out = torch.float64 if a.dtype == torch.float64 else torch.float32
        dt = torch.float64 if a.device.type == "cpu" else out
        g = -self.A_log.to(dt).exp() * F.softplus(a.to(dt) + self.dt_bias.to(dt))
        beta = b.to(dt).sigmoid()
        return g.to(out), beta.to(out)

    def _packed_layout(self, packed_seq_params, hidden_states):
        """(cu_seqlens, cu_seqlens_padded) for THD input, (None, None) otherwise. Never syncs."""
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            return None, None
        if hidden_states.shape[1] != 1:
            raise ValueError(f"packed (thd) input must have batch 1, got hidden_states of shape "
                             f"{tuple(hidden_states.shape)}")
        cu = packed_seq_params.cu_seqlens_q
        if cu is None:
            raise ValueError("packed_seq_params.cu_seqlens_q is required for qkv_format='thd'")
        cu_padded = packed_seq_params.cu_seqlens_q_padded
        if cu_padded is cu:
            cu_padded = None
        elif cu_padded is not None and cu_padded.dtype != cu.dtype:
            cu_padded = cu_padded.to(cu.dtype)
        return cu, cu_padded

    def _gated_norm(self, o, z, cu_seqlens, cu_seqlens_padded):
        """rmsnorm(o) * out_norm.weight * silu(z) over the value head dim, returned as [S, B, v].

        A torch RMSNorm out_norm (the local spec) or TE RMSNorm without zero-centred gamma runs as
        the fused gated-RMSNorm op; any other out_norm module runs as Megatron does it
        (out_norm(o) * silu(z)), with padding rows zeroed explicitly."""
        B, S = o.shape[:2]
        norm = self.out_norm
        eps = _fusable_rmsnorm_eps(norm, o.dtype)
        if eps is not None:
            weight = norm.weight
            if self.tp_size > 1:  # replicated over TP, each rank sees its own heads: sum the grads
                weight = tensor_parallel.copy_to_tensor_model_parallel_region(weight, self.tp_group)
            y = gated_rmsnorm(o, z, weight, eps)
        else:
            y = (norm(o.reshape(-1, o.shape[-1])).view(o.shape) * F.silu(z.float())).to(o.dtype)
            if cu_seqlens is not None:
                real = padding_row_mask(cu_seqlens, cu_seqlens_padded, total_rows=S)
                y = y * real.view(1, S, 1, 1).to(y.dtype)
        return y.reshape(B, S, -1).transpose(0, 1).contiguous()

    # ------------------------------------------------------------------------------------------
    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None, tp_group=None):
        """Distributed-checkpoint view, identical to Megatron's block: A_log, dt_bias and conv1d
        sharded over TP on dim 0; in_proj.weight split into query/key/value/z/beta/alpha and
        conv1d.{weight,bias} into query/key/value so a checkpoint reshards across TP sizes."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        tp_group = self.tp_group if tp_group is None else tp_group
        dp_cp_group = metadata["dp_cp_group"]
        own = {}
        self._save_to_state_dict(own, "", keep_vars=True)
        out = make_sharded_tensors_for_checkpoint(
            own, prefix, {"A_log": 0, "dt_bias": 0}, sharded_offsets,
            tp_group=tp_group, dp_cp_group=dp_cp_group)
        for child_name, child in self.named_children():
            child_prefix = f"{prefix}{child_name}."
            if child_name == "conv1d":
                out.update(make_sharded_tensors_for_checkpoint(
                    child.state_dict(prefix="", keep_vars=True), child_prefix,
                    {"weight": 0, "bias": 0} if self.conv_bias else {"weight": 0},
                    sharded_offsets, tp_group=tp_group, dp_cp_group=dp_cp_group))
            else:
                out.update(sharded_state_dict_default(child, child_prefix, sharded_offsets,
                                                       metadata, tp_group=tp_group))
        key = f"{prefix}in_proj.weight"
        out[key] = _split_tensor_factory(out[key], list(self.in_proj_split_sections),
                                         list(IN_PROJ_SECTION_NAMES), 0)
        conv_sections = [self.qk_dim_local_tp, self.qk_dim_local_tp, self.v_dim_local_tp]
        for p in ("weight", "bias") if self.conv_bias else ("weight",):
            key = f"{prefix}conv1d.{p}"
            out[key] = _split_tensor_factory(out[key], conv_sections, list(CONV_SECTION_NAMES), 0)
        return out

    def backward_dw(self):
        """Weight gradients of the projections (delayed wgrad), as in Megatron."""
        self.in_proj.backward_dw()
        self.out_proj.backward_dw()


def _fusable_rmsnorm_eps(norm, dtype):
    """eps when `norm` is a plain RMSNorm (y = x * rsqrt(mean x^2 + eps) * weight), else None."""
    if isinstance(norm, nn.RMSNorm):
        if norm.weight is None:
            return None
        return norm.eps if norm.eps is not None else torch.finfo(dtype).eps
    if type(norm).__name__ == "RMSNorm" and type(norm).__module__.startswith("transformer_engine"):
        if getattr(norm, "zero_centered_gamma", True) or getattr(norm, "eps", None) is None:
            return None
        return float(norm.eps)
    return None
