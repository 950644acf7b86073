"""The GDN block (`layer`) and a HybridLM training step (`hybrid`): provider calls, cases and gates.

Layouts: packed = x [1, T, D] with cu_seqlens; padded = [ndocs, row_len, D] with no mask, every row
computed in full (what a padded trainer pays today); dense = [B, T, D].
Gate (no float64 reference exists for a whole block): the packed forward of several documents must
equal each document run alone, within the dtype's output budget; this is the property packing needs
(no leak across documents) and it catches a provider that ignores cu_seqlens.
Calling convention of a provider's `call` (bench/providers.py declares the providers):
  layer:   call(H, HV, K, V, hidden, conv_width, dtype, device) -> Block(module, forward), where
           forward(x, cu_seqlens or None) -> y is the explicit adapter from the bench's [B, T, D] input
           to the module's own calling convention;
  hybrid:  call(scenario, dtype, device) -> a module called as m(ids) or m(ids, cu_seqlens=cu).
Providers: `ours` = gdn_packed.layers (the backend the layer picks: torch on CPU, GPU kernels on CUDA);
`megatron` = megatron-core's GatedDeltaNet block with its THD path (needs CUDA and fla-core).
"""
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from bench.common import Case, Family, grad_fn, import_reason, randn
from bench.gdr import budgets
from gdn_packed.packing import cu_seqlens_from_lengths
from gdn_packed.testing import rel_err

GATE_LENGTHS = (5, 64, 70)


def _self_consistency(forward, width, dtype, device):
    """rel. err between the packed forward of GATE_LENGTHS and the per-document forwards."""
    gen = torch.Generator(device=device).manual_seed(1)
    x = randn((1, sum(GATE_LENGTHS), width), dtype, device, gen)
    cu = cu_seqlens_from_lengths(GATE_LENGTHS, device=device)
    with torch.no_grad():
        packed = forward(x, cu)
        b = cu.tolist()
        alone = torch.cat([forward(x[:, a:e], cu_seqlens_from_lengths([e - a], device=device))
                           for a, e in zip(b[:-1], b[1:])], 1)
    err = rel_err(packed.float().cpu(), alone.double().cpu())
    ok = err <= budgets(dtype, device)["o"]
    return ok, {"packed_vs_alone": err}, "" if ok else f"packed vs per-document rel. err {err:.2e}"


# ------------------------------------------------------------------------------------------------ layer
@dataclass(frozen=True)
class Block:
    """A built layer: the module (its parameters are what the backward differentiates) and the call
    adapter forward(x [B, T, D], cu_seqlens or None) -> y [B, T, D]."""
    module: torch.nn.Module
    forward: Callable[[torch.Tensor, Optional[torch.Tensor]], torch.Tensor]


def ours_layer(H, HV, K, V, hidden, W, dtype, device):
    from gdn_packed.layers import GatedDeltaNet
    torch.manual_seed(0)
    m = GatedDeltaNet(hidden, H, HV, K, V, conv_kernel=W, dtype=dtype, device=device)
    return Block(m, lambda x, cu: m(x, cu_seqlens=cu))


def _layer_build(p, s, layout, mode, device, dtype):
    block = p.call(s.H, s.HV, s.K, s.V, s.width, s.conv_width, dtype, device)
    rows = s.rows(layout)
    gen = torch.Generator(device=device).manual_seed(0)
    shape = (rows[0], rows[1], s.width) if rows else (1, s.real_tokens, s.width)
    x = randn(shape, dtype, device, gen).requires_grad_(mode != "fwd")
    cu = None if rows else cu_seqlens_from_lengths(s.docs, device=device)
    if mode == "fwd":
        def run():
            with torch.no_grad():
                return block.forward(x, cu)
        return Case(run, p.note)
    params = [q for q in block.module.parameters() if q.requires_grad]
    bwd, fwdbwd = grad_fn(lambda: block.forward(x, cu), [x] + params)
    return Case(bwd if mode == "bwd" else fwdbwd, p.note)


def _layer_gate(p, device, dtype, grads):
    block = p.call(2, 4, 16, 16, 64, 4, dtype, device)
    return _self_consistency(block.forward, 64, dtype, device)


LAYER = Family(ops=("layer",), build=_layer_build, gate=_layer_gate)


def megatron_layer(H, HV, K, V, hidden, W, dtype, device):
    """megatron-core's GatedDeltaNet (local, non-TE submodules), THD input, world size 1."""
    import os
    import torch.distributed as dist
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29541")
        dist.init_process_group("gloo", rank=0, world_size=1)
    cfg = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=max(1, H),
                            ffn_hidden_size=4 * hidden, linear_conv_kernel_dim=W, linear_key_head_dim=K,
                            linear_value_head_dim=V, linear_num_key_heads=H, linear_num_value_heads=HV,
                            normalization="RMSNorm", params_dtype=dtype, bf16=dtype == torch.bfloat16,
                            activation_func=F.silu, add_bias_linear=False)
    sub = GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear,
                                  out_norm=LocalSpecProvider().layer_norm(rms_norm=True, for_qk=False),
                                  out_proj=RowParallelLinear)
    world = dist.group.WORLD
    m = GatedDeltaNet(cfg, sub, layer_number=1, pg_collection=ProcessGroupCollection(tp=world, cp=world))
    m = m.to(device)

    def forward(x, cu):
        if cu is None:                               # SBHD: [s, b, h]
            return m(x.transpose(0, 1), attention_mask=None)[0].transpose(0, 1)
        psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                              max_seqlen_q=x.shape[1], max_seqlen_kv=x.shape[1])
        return m(x.transpose(0, 1), attention_mask=None, packed_seq_params=psp)[0].transpose(0, 1)
    return Block(m, forward)


def megatron_why_not(device):
    if device.type != "cuda":
        return "megatron's GatedDeltaNet runs fla-core kernels: needs a GPU"
    return import_reason("fla.ops.gated_delta_rule") or import_reason("megatron.core.ssm.gated_delta_net")


# ----------------------------------------------------------------------------------------------- hybrid
VOCAB = 1024


def ours_hybrid(s, dtype, device):
    """A "GGGA" HybridLM at the scenario's GDN shape; attention with 2H query heads over H kv heads."""
    from gdn_packed.layers import HybridConfig, HybridLM
    cfg = HybridConfig(vocab_size=VOCAB, hidden_size=s.width, intermediate_size=2 * s.width, pattern="GGGA",
                       num_k_heads=s.H, num_v_heads=s.HV, head_k_dim=s.K, head_v_dim=s.V,
                       conv_kernel=s.conv_width, num_heads=2 * s.H, num_kv_heads=s.H, head_dim=s.K)
    torch.manual_seed(0)
    return HybridLM(cfg, dtype=dtype, device=device)


def _logits(out):
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return out[0]
    return out.logits


def _hybrid_build(p, s, layout, mode, device, dtype):
    m = p.call(s, dtype, device)
    rows = s.rows(layout)
    gen = torch.Generator(device=device).manual_seed(0)
    shape = rows if rows else (1, s.real_tokens)
    ids = torch.randint(0, VOCAB, shape, generator=gen, device=device)
    cu = None if rows else cu_seqlens_from_lengths(s.docs, device=device)
    params = [w for w in m.parameters() if w.requires_grad]

    def step():
        logits = _logits(m(ids, cu_seqlens=cu) if cu is not None else m(ids))
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))
        return torch.autograd.grad(loss, params)
    return Case(step, "training step: forward, cross-entropy, backward (no optimizer)")


def _hybrid_gate(p, device, dtype, grads):
    from bench.registry import Scenario
    s = Scenario(op="hybrid", layout="varlen", H=2, HV=4, K=16, V=16, hidden=64, lengths=GATE_LENGTHS)
    m = p.call(s, dtype, device)

    def fwd(x, cu):
        ids = (x[..., 0].abs() * 1000).long() % VOCAB
        return _logits(m(ids, cu_seqlens=cu))
    return _self_consistency(fwd, 64, dtype, device)


HYBRID = Family(ops=("hybrid",), build=_hybrid_build, gate=_hybrid_gate)

__all__ = ["LAYER", "HYBRID", "Block", "ours_layer", "megatron_layer", "megatron_why_not", "ours_hybrid"]
