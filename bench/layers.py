"""The GDN block (`layer`) and a HybridLM training step (`hybrid`): providers and gates.

Layouts: packed = x [1, T, D] with cu_seqlens; padded = [ndocs, row_len, D] with no mask, every row
computed in full (what a padded trainer pays today); dense = [B, T, D].
Gate (no float64 reference exists for a whole block): the packed forward of several documents must
equal each document run alone, within the dtype's output budget; this is the property packing needs
(no leak across documents) and it catches a provider that ignores cu_seqlens.
Providers: `ours` = gdn_packed.layers (the backend the layer picks: torch on CPU, GPU kernels on CUDA);
`megatron` = megatron-core's GatedDeltaNet block with its THD path (needs CUDA and fla-core).
"""

import torch
import torch.nn.functional as F

from bench.common import Case, Provider, grad_fn, import_reason, randn
from bench.gdr import budgets
from gdn_packed.testing import rel_err

GATE_LENGTHS = (5, 64, 70)


def _cu(lengths, device):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=device)


def _rows(s, layout):
    return {"dense": (s.B, s.T), "padded": (len(s.docs), s.T)}.get(layout)


def _self_consistency(forward, width, dtype, device):
    """rel. err between the packed forward of GATE_LENGTHS and the per-document forwards."""
    gen = torch.Generator(device=device).manual_seed(1)
    x = randn((1, sum(GATE_LENGTHS), width), dtype, device, gen)
    cu = _cu(GATE_LENGTHS, device)
    with torch.no_grad():
        packed = forward(x, cu)
        b = cu.tolist()
        alone = torch.cat([forward(x[:, a:e], _cu((e - a,), device)) for a, e in zip(b[:-1], b[1:])], 1)
    err = rel_err(packed.float().cpu(), alone.double().cpu())
    ok = err <= budgets(dtype, device)["o"]
    return ok, {"packed_vs_alone": err}, "" if ok else f"packed vs per-document rel. err {err:.2e}"


# ------------------------------------------------------------------------------------------------ layer
def _ours_layer(H, HV, K, V, hidden, W, dtype, device):
    from gdn_packed.layers import GatedDeltaNet
    torch.manual_seed(0)
    return GatedDeltaNet(hidden, H, HV, K, V, conv_kernel=W, dtype=dtype, device=device)


def _layer_build(make):
    def build(s, layout, mode, device, dtype):
        m = make(s.H, s.HV, s.K, s.V, s.width, s.conv_width, dtype, device)
        rows = _rows(s, layout)
        gen = torch.Generator(device=device).manual_seed(0)
        shape = (rows[0], rows[1], s.width) if rows else (1, s.real_tokens, s.width)
        x = randn(shape, dtype, device, gen).requires_grad_(mode != "fwd")
        cu = None if rows else _cu(s.docs, device)
        fwd = m.bench_forward if hasattr(m, "bench_forward") else (lambda x, cu: m(x, cu_seqlens=cu))
        if mode == "fwd":
            def run():
                with torch.no_grad():
                    return fwd(x, cu)
            return Case(run)
        params = [p for p in m.parameters() if p.requires_grad]
        bwd, fwdbwd = grad_fn(lambda: fwd(x, cu), [x] + params)
        return Case(bwd if mode == "bwd" else fwdbwd)
    return build


def _layer_gate(make):
    def gate(device, dtype, grads):
        m = make(2, 4, 16, 16, 64, 4, dtype, device)
        fwd = m.bench_forward if hasattr(m, "bench_forward") else (lambda x, cu: m(x, cu_seqlens=cu))
        return _self_consistency(fwd, 64, dtype, device)
    return gate


def _megatron_layer(H, HV, K, V, hidden, W, dtype, device):
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

    def bench_forward(x, cu):
        if cu is None:                               # SBHD: [s, b, h]
            return m(x.transpose(0, 1), attention_mask=None)[0].transpose(0, 1)
        psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                              max_seqlen_q=x.shape[1], max_seqlen_kv=x.shape[1])
        return m(x.transpose(0, 1), attention_mask=None, packed_seq_params=psp)[0].transpose(0, 1)
    m.bench_forward = bench_forward
    return m


def _megatron_why_not(device):
    if device.type != "cuda":
        return "megatron's GatedDeltaNet runs fla-core kernels: needs a GPU"
    return import_reason("fla.ops.gated_delta_rule") or import_reason("megatron.core.ssm.gated_delta_net")


LAYER_PROVIDERS = {
    "ours": Provider("ours", lambda d: import_reason("gdn_packed.layers", "GatedDeltaNet"),
                     _layer_build(_ours_layer), _layer_gate(_ours_layer)),
    "megatron": Provider("megatron", _megatron_why_not, _layer_build(_megatron_layer),
                         _layer_gate(_megatron_layer), note="megatron-core block, local submodules"),
}


# ----------------------------------------------------------------------------------------------- hybrid
VOCAB = 1024


def _ours_hybrid(s, dtype, device):
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


def _hybrid_build(s, layout, mode, device, dtype):
    m = _ours_hybrid(s, dtype, device)
    rows = _rows(s, layout)
    gen = torch.Generator(device=device).manual_seed(0)
    shape = rows if rows else (1, s.real_tokens)
    ids = torch.randint(0, VOCAB, shape, generator=gen, device=device)
    cu = None if rows else _cu(s.docs, device)
    params = [p for p in m.parameters() if p.requires_grad]

    def step():
        logits = _logits(m(ids, cu_seqlens=cu) if cu is not None else m(ids))
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))
        return torch.autograd.grad(loss, params)
    return Case(step, "training step: forward, cross-entropy, backward (no optimizer)")


def _hybrid_gate(device, dtype, grads):
    from bench.registry import Scenario
    s = Scenario(op="hybrid", layout="varlen", H=2, HV=4, K=16, V=16, hidden=64, lengths=GATE_LENGTHS)
    m = _ours_hybrid(s, dtype, device)

    def fwd(x, cu):
        ids = (x[..., 0].abs() * 1000).long() % VOCAB
        return _logits(m(ids, cu_seqlens=cu))
    return _self_consistency(fwd, 64, dtype, device)


HYBRID_PROVIDERS = {
    "ours": Provider("ours", lambda d: import_reason("gdn_packed.layers", "HybridLM"), _hybrid_build,
                     _hybrid_gate),
}
