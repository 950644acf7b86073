"""Megatron-Core `GatedDeltaNet` block on gdn_packed kernels (drop-in for megatron-core 0.19.2).

Same constructor (plus Megatron-LM main's `pp_layer_offset`), forward contract, submodules,
parameter names/shapes/dtypes/initialisation and `sharded_state_dict` as
`megatron.core.ssm.gated_delta_net.GatedDeltaNet`, so a Megatron checkpoint loads strictly and the
block can be swapped in through the module spec (see `spec.py`).

Per TP rank (local sizes: qk = H*K/tp, v = HV*V/tp, hv = HV/tp; under CP each rank then keeps 1/cp
of every section's heads for whole sequences, see `context_parallel.py`):

    [s, b, hidden] -in_proj-> [q qk | k qk | v v | z v | b hv | a hv]     (ColumnParallelLinear, SP gather)
    (CP > 1: one all-to-all, sequence shards -> whole sequences, 1/cp of the heads)
    q,k,v   = silu(causal_conv1d_varlen([q k v], conv1d.weight, cu_seqlens))
    o       = chunk_gated_delta_rule(q, k, v, a, b, A_log=, dt_bias=, l2norm(q, k), GVA by indexing)
              (the op forms g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b) in float32)
    y       = rmsnorm(o) * w * silu(z),  w = out_norm.weight (1 + weight when zero-centred)
    (CP > 1: one all-to-all back)
    out     = out_proj(y)                                                  (RowParallelLinear, SP scatter)

THD input (`PackedSeqParams(qkv_format="thd")`, batch 1): real lengths from `cu_seqlens_q`, storage
offsets from `cu_seqlens_q_padded` when given. Padding rows are replaced by 0 on entry (by selection,
so NaN/Inf there reach no real row and no parameter gradient), skipped by every kernel, and are 0 in
the output (and get 0 gradient); nothing reads cu_seqlens back to the host unless validating
(GDN_PACKED_VALIDATE=1). SBHD input: any batch, each row one sequence.
"""
import contextlib
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

from gdn_packed import _validate as V
from gdn_packed import segments
from gdn_packed.megatron import context_parallel as cpx
from gdn_packed.ops.chunk_gdr import chunk_gated_delta_rule
from gdn_packed.ops.conv1d import causal_conv1d_varlen
from gdn_packed.ops.gated_rmsnorm import gated_rmsnorm
from gdn_packed.packing import padding_row_mask, validate_cu_seqlens

# names of the in_proj output sections and of the conv1d channel sections, as in Megatron's
# checkpoints (sharded_state_dict splits the fused tensors into these so TP can be resharded)
IN_PROJ_SECTION_NAMES = ("query", "key", "value", "z", "beta", "alpha")
CONV_SECTION_NAMES = ("query", "key", "value")


class GatedDeltaNet(MegatronModule):
    """Gated DeltaNet mixer with Megatron-Core's interface, on gdn_packed kernels.

    Args are those of Megatron's block: `config` (TransformerConfig with the `linear_*` fields),
    `submodules` (GatedDeltaNetSubmodules: in_proj, out_norm, out_proj specs), `layer_number`,
    `bias` (linear biases), `conv_bias`, `conv_init` (uniform range of the conv weights, None keeps
    torch's default), `use_qk_l2norm`, `A_init_range`, `pg_collection` (needs `.tp` and `.cp`),
    `name`, `cp_comm_type` (accepted and ignored, as in Megatron: context parallelism is the
    all-to-all of `context_parallel.py`), `pp_layer_offset` (Megatron-LM main: the global layer
    offset of this pipeline stage, kept as an attribute). Any other keyword is a TypeError naming it.

    `out_norm_fused` tells whether the output norm runs fused with the gate (the gated-RMSNorm op):
    it does for torch.nn.RMSNorm and Transformer Engine's RMSNorm, zero-centred or not; any other
    out_norm module runs as in Megatron (out_norm(o) * silu(z)).
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
        pp_layer_offset: int = 0,
    ):
        super().__init__(config)
        if pg_collection is None:
            raise ValueError("pg_collection must be provided for GatedDeltaNet (it needs .tp and .cp)")
        if not (0 <= A_init_range[0] <= A_init_range[1]):
            raise ValueError(f"A_init_range must be (lo, hi) with 0 <= lo <= hi, got {A_init_range}")
        self.layer_number = layer_number
        self.pp_layer_offset = pp_layer_offset
        self.bias = bias
        self.conv_bias = conv_bias
        self.conv_init = conv_init
        self.use_qk_l2norm = use_qk_l2norm
        self.A_init_range = A_init_range
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp
        self.cp_group = pg_collection.cp
        self.tp_size = pg_collection.tp.size()
        self.cp_size = pg_collection.cp.size()
        self.sp_size = self.tp_size if config.sequence_parallel else 1

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
        shards = self.tp_size * self.cp_size  # heads are split over TP, then over CP
        for what, n in (("linear_num_key_heads", self.num_key_heads),
                        ("linear_num_value_heads", self.num_value_heads)):
            if n % shards:
                raise ValueError(f"config.{what} = {n} must be divisible by the TP size x CP size "
                                 f"{self.tp_size} x {self.cp_size}")
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
        self.out_norm_fused = fused_rmsnorm_kind(self.out_norm) is not None
        if self.tp_size > 1 and self.out_norm_fused:
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
        model-parallel RNG stream in that order (on a machine without CUDA, which has no such
        stream, from torch's default generator)."""
        if not self.config.perform_initialization:
            return
        rng = get_cuda_rng_tracker().fork() if torch.cuda.is_available() else contextlib.nullcontext()
        with rng, torch.no_grad():
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
        """hidden_states [s, b, hidden] (s is the local shard under sequence and context
        parallelism) -> (output [s, b, hidden], out_proj bias or None). `attention_mask` is ignored
        (causality is by construction; packing comes from `packed_seq_params`)."""
        if deprecate_inference_params(inference_context, inference_params) is not None:
            raise NotImplementedError("gdn_packed.megatron.GatedDeltaNet does not support inference "
                                      "(inference_context) yet")
        cu_seqlens, cu_seqlens_padded = self._packed_layout(packed_seq_params, hidden_states)
        cp, rank = self.cp_size, self.cp_group.rank()
        rows = hidden_states.shape[0] * self.sp_size * cp     # S, all rows of the sequences
        if cp > 1:
            gather, scatter = self._cp_row_order(cu_seqlens, cu_seqlens_padded, rows, hidden_states.device)
        if cu_seqlens is not None:
            # padding rows replaced by 0 on entry (selection): whatever they hold (NaN/Inf), they add
            # nothing to the in_proj weight gradient, and every row after is finite
            real = self._local_real_rows(cu_seqlens, cu_seqlens_padded, rows, None if cp == 1 else scatter)
            hidden_states = torch.where(real.view(-1, 1, 1), hidden_states,
                                        hidden_states.new_zeros(()))

        qkvzba, _ = self.in_proj(hidden_states)  # [S/cp, B, in_proj_dim / tp] (SP gathered)
        if cp > 1:
            features = cpx.feature_order(self.in_proj_split_sections, cp, qkvzba.device)
            qkvzba = cpx.cp_to_hp(qkvzba, features, gather, self.cp_group)  # [S, B, . / cp]
        S, B = qkvzba.shape[:2]
        x = qkvzba.transpose(0, 1)  # [B, S, .] (a view; B = 1 for THD)
        qk, v_, hv = (n // cp for n in (self.qk_dim_local_tp, self.v_dim_local_tp,
                                        self.num_v_heads_local_tp))
        qkv, z, b, a = torch.split(x, [2 * qk + v_, v_, hv, hv], dim=-1)

        conv_sections = [self.qk_dim_local_tp, self.qk_dim_local_tp, self.v_dim_local_tp]
        conv_weight = cpx.rank_share(self.conv1d.weight.squeeze(1), conv_sections, rank, cp)
        conv_bias = (None if self.conv1d.bias is None
                     else cpx.rank_share(self.conv1d.bias, conv_sections, rank, cp))
        qkv, _ = causal_conv1d_varlen(qkv, conv_weight, conv_bias, activation="silu",
                                      cu_seqlens=cu_seqlens, cu_seqlens_padded=cu_seqlens_padded)
        q, k, v = torch.split(qkv, [qk, qk, v_], dim=-1)
        q = q.unflatten(-1, (qk // self.key_head_dim, self.key_head_dim))
        k = k.unflatten(-1, (qk // self.key_head_dim, self.key_head_dim))
        v = v.unflatten(-1, (hv, self.value_head_dim))

        # raw a, b in: the op forms g = -exp(A_log) softplus(a + dt_bias) and beta = sigmoid(b)
        o, _ = chunk_gated_delta_rule(
            q, k, v, a, b, cu_seqlens=cu_seqlens, cu_seqlens_padded=cu_seqlens_padded,
            use_qk_l2norm_in_kernel=self.use_qk_l2norm,
            A_log=cpx.rank_share(self.A_log, [self.num_v_heads_local_tp], rank, cp),
            dt_bias=cpx.rank_share(self.dt_bias, [self.num_v_heads_local_tp], rank, cp))
        z = z.unflatten(-1, (hv, self.value_head_dim))

        norm = partial(self._gated_norm, cu_seqlens=cu_seqlens, cu_seqlens_padded=cu_seqlens_padded)
        if cp > 1:
            norm = partial(self._gated_norm_to_cp, norm=norm, scatter=scatter)
        if self.recompute_norm_out:
            self.norm_out_checkpoint = tensor_parallel.CheckpointWithoutOutput()
            y = self.norm_out_checkpoint.checkpoint(norm, o, z)
        else:
            y = norm(o, z)
        out, out_bias = self.out_proj(y)
        if self.recompute_norm_out:
            self.norm_out_checkpoint.discard_output_and_register_recompute(out)
        return out, out_bias

    def _packed_layout(self, packed_seq_params, hidden_states):
        """(cu_seqlens, cu_seqlens_padded) for THD input, (None, None) otherwise. Never syncs on
        CUDA tensors unless validating."""
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            return None, None
        if hidden_states.shape[1] != 1:
            raise ValueError(f"packed (thd) input must have batch 1, got hidden_states of shape "
                             f"{tuple(hidden_states.shape)}")
        cu = packed_seq_params.cu_seqlens_q
        if cu is None:
            raise ValueError("packed_seq_params.cu_seqlens_q is required for qkv_format='thd'")
        segments.check_cu_seqlens_meta(cu, "packed_seq_params.cu_seqlens_q")
        cu_padded = packed_seq_params.cu_seqlens_q_padded
        if cu_padded is not None:
            segments.check_cu_seqlens_meta(cu_padded, "packed_seq_params.cu_seqlens_q_padded")
            if cu_padded.dtype != cu.dtype:
                cu_padded = cu_padded.to(cu.dtype)
            segments.check_padded_meta(cu, cu_padded, "packed_seq_params.cu_seqlens_q",
                                       "packed_seq_params.cu_seqlens_q_padded")
        _check_kv_equals_q(packed_seq_params)
        return cu, (None if cu_padded is cu else cu_padded)

    def _local_real_rows(self, cu_seqlens, cu_seqlens_padded, rows, scatter):
        """bool [rows of hidden_states]: False on this rank's padding rows. The sequences' `rows`
        rows in natural order are cut over CP (`scatter`: natural row of each all-to-all row, rank r's
        rows at [r S/cp, (r+1) S/cp)), then each CP rank's rows into contiguous SP slices. No sync."""
        real = padding_row_mask(cu_seqlens, cu_seqlens_padded, total_rows=rows)
        if scatter is not None:
            n = rows // self.cp_size
            real = real.index_select(0, scatter.narrow(0, self.cp_group.rank() * n, n))
        if self.sp_size > 1:
            n = real.shape[0] // self.sp_size
            real = real.narrow(0, self.tp_group.rank() * n, n)
        return real

    def _cp_row_order(self, cu_seqlens, cu_seqlens_padded, rows, device):
        """The natural-order row tables of `context_parallel.natural_row_order` for this input
        (sequences at their storage offsets, `rows` rows in all), after the layout checks: shapes
        always, cu_seqlens values when validating."""
        cp = self.cp_size
        cu_storage = cu_seqlens if cu_seqlens_padded is None else cu_seqlens_padded
        if cu_storage is None:
            if rows % (2 * cp):
                raise ValueError(
                    f"context parallelism (cp size {cp}) splits each sequence into 2 x {cp} equal "
                    f"chunks: the sequence length {rows} (hidden_states rows x SP x CP) must be a "
                    f"multiple of {2 * cp}")
        else:
            if cu_storage.numel() < 2:
                raise ValueError("packed_seq_params.cu_seqlens_q must hold at least one sequence "
                                 "under context parallelism")
            if V.want_validate(False):
                name = "packed_seq_params.cu_seqlens_q" + ("" if cu_seqlens_padded is None else "_padded")
                self._validate_cp_offsets(cu_storage, rows, name)
        return cpx.natural_row_order(cu_storage, cp, rows, device)

    def _validate_cp_offsets(self, cu_storage, rows, name):
        """[sync] Megatron's CP layout checks: the storage offsets span all `rows` rows and every
        storage length is a multiple of 2 x cp."""
        cp = self.cp_size
        validate_cu_seqlens(cu_storage, name=name)
        cu = cu_storage.detach().to("cpu", torch.int64)
        if int(cu[-1]) != rows:
            raise ValueError(f"{name}[-1] = {int(cu[-1])} must equal the total sequence length "
                             f"{rows} (hidden_states rows x SP x CP) under context parallelism")
        lengths = (cu[1:] - cu[:-1]).tolist()
        if any(n % (2 * cp) for n in lengths):
            raise ValueError(f"{name}: under context parallelism (cp size {cp}) every sequence's "
                             f"storage length must be a multiple of {2 * cp}, got {lengths}")

    def _gated_norm_to_cp(self, o, z, norm, scatter):
        """The gated norm, then the all-to-all back to this rank's sequence shard (under CP the
        norm-out recompute covers both, as in Megatron)."""
        return cpx.hp_to_cp(norm(o, z), scatter, self.cp_group)

    def _gated_norm(self, o, z, cu_seqlens, cu_seqlens_padded):
        """rmsnorm(o) * out_norm.weight * silu(z) over the value head dim, returned as [S, B, v].

        A torch RMSNorm or a Transformer Engine RMSNorm out_norm (zero-centred or not) runs as the
        fused gated-RMSNorm op; any other out_norm module runs as Megatron does it
        (out_norm(o) * silu(z)). Either way padding rows of o and z are replaced by 0 on entry (by
        selection), so y is 0 there and they add nothing to out_norm's weight gradient, whatever z
        holds there."""
        B, S = o.shape[:2]
        norm = self.out_norm
        kind = fused_rmsnorm_kind(norm)
        if kind is not None:
            eps, zero_centered = kind
            weight = norm.weight
            if self.tp_size > 1:  # replicated over TP, each rank sees its own heads: sum the grads
                weight = tensor_parallel.copy_to_tensor_model_parallel_region(weight, self.tp_group)
            y = gated_rmsnorm(o, z, weight, torch.finfo(o.dtype).eps if eps is None else eps,
                              zero_centered=zero_centered, cu_seqlens=cu_seqlens,
                              cu_seqlens_padded=cu_seqlens_padded)
        else:
            if cu_seqlens is not None:      # y = norm(0) * silu(0) = 0 on padding rows
                real = padding_row_mask(cu_seqlens, cu_seqlens_padded, total_rows=S).view(1, S, 1, 1)
                o, z = (torch.where(real, t, t.new_zeros(())) for t in (o, z))
            y = (norm(o.reshape(-1, o.shape[-1])).view(o.shape) * F.silu(z.float())).to(o.dtype)
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


def fused_rmsnorm_kind(norm):
    """(eps, zero_centered) when `norm` is an RMSNorm the gated-RMSNorm op computes exactly
    (y = x * rsqrt(mean x^2 + eps) * w, w = weight or 1 + weight): torch.nn.RMSNorm with a weight
    (eps None: the input dtype's eps, as torch does), or Transformer Engine's RMSNorm (its
    zero_centered_gamma); None for any other module."""
    if isinstance(norm, nn.RMSNorm):
        return None if norm.weight is None else (norm.eps, False)
    if type(norm).__name__ == "RMSNorm" and type(norm).__module__.startswith("transformer_engine"):
        eps, zero_centered = getattr(norm, "eps", None), getattr(norm, "zero_centered_gamma", None)
        if isinstance(eps, (int, float)) and isinstance(zero_centered, bool):
            return float(eps), zero_centered
    return None


def _check_kv_equals_q(psp):
    """Megatron asserts that the kv offsets equal the q offsets (each side's padded offsets when
    given, else its real ones): a GDN layer has one sequence layout. The same tensor passes at once;
    otherwise shapes are compared always, values when both are CPU tensors or when validating (on
    CUDA that reads them back)."""
    q_name = "cu_seqlens_q" + ("_padded" if psp.cu_seqlens_q_padded is not None else "")
    kv_name = "cu_seqlens_kv" + ("_padded" if psp.cu_seqlens_kv_padded is not None else "")
    q, kv = getattr(psp, q_name), getattr(psp, kv_name)
    if kv is None or kv is q:
        return
    if kv.shape == q.shape:
        if kv.device.type == "cpu" and q.device.type == "cpu":
            if torch.equal(kv.long(), q.long()):
                return
        elif not V.want_validate(False) or torch.equal(kv.cpu().long(), q.cpu().long()):
            return
    show = lambda t: t.tolist() if t.numel() <= 16 else f"shape {tuple(t.shape)}"  # noqa: E731
    raise ValueError(f"packed_seq_params.{kv_name} must equal packed_seq_params.{q_name}: a "
                     f"GatedDeltaNet layer has one sequence layout (as in Megatron); got {show(kv)} "
                     f"and {show(q)}")
