"""Layers on packed input: the GDN block against a float64 per-sequence reference, and the hybrid LM
giving the same logits, losses and gradients whether run padded, packed, packed with alignment padding
or one document at a time; documents and padding do not leak into each other (bit-identical)."""
import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from gdn_packed import packing
from gdn_packed.layers import (GatedAttention, GatedDeltaNet, GDNState, HybridConfig, HybridLM,
                               hf_qwen3_next_gdn_state_dict, next_token_targets)
from gdn_packed.testing import BUDGETS, layout, no_host_sync, rel_err
from gdn_packed.torch_ref.gated_rmsnorm import gated_rmsnorm_ref
from gdn_packed.torch_ref.naive import naive_recurrent_gdr

ROOT = Path(__file__).resolve().parents[1]
LENS = [13, 70, 1, 40]        # one document crosses a 64-row chunk, one has a single token
GAPS = [3, 2, 7, 0]           # cu_seqlens_padded slots: alignment padding after each document
TAIL = 5
# Megatron's decay init, A = exp(A_log) ~ U(1, 16): per-token log-decays down to about -20, the case
# where gate sums formed as differences of cumulative sums lose precision (the op now avoids that).
A_RANGE = (1.0, 16.0)
CFG = HybridConfig(vocab_size=97, hidden_size=64, intermediate_size=96, pattern="GGGA", num_k_heads=2,
                   num_v_heads=4, head_k_dim=32, head_v_dim=32, num_heads=4, num_kv_heads=2, head_dim=32,
                   A_init_range=A_RANGE)


def documents(seed=0, lens=LENS):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, CFG.vocab_size, (n,), generator=gen) for n in lens]


def as_padded(docs, left=False):
    L = max(len(d) for d in docs) + 2
    ids = torch.randint(0, CFG.vocab_size, (len(docs), L), generator=torch.Generator().manual_seed(9))
    mask = torch.zeros(len(docs), L, dtype=torch.bool)
    for i, d in enumerate(docs):
        sl = slice(L - len(d), L) if left else slice(0, len(d))
        ids[i, sl], mask[i, sl] = d, True
    return ids, mask


def as_packed(docs):
    return torch.cat(docs)[None], packing.cu_seqlens_from_lengths([len(d) for d in docs])


def as_padded_storage(docs, gaps=GAPS, tail=TAIL, fill=7):
    cu = packing.cu_seqlens_from_lengths([len(d) for d in docs])
    pad = packing.cu_seqlens_from_lengths([len(d) + g for d, g in zip(docs, gaps)])
    ids = torch.full((1, int(pad[-1]) + tail), fill, dtype=torch.long)
    for d, s in zip(docs, pad.tolist()):
        ids[0, s:s + len(d)] = d
    return ids, cu, pad


def model(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return HybridLM(CFG, dtype=dtype)


def per_token_logits(m, docs, mode):
    """Run `m` in one layout; return (per-document logits, summed next-token loss, per-doc mean losses)."""
    if mode == "padded":
        ids, mask = as_padded(docs)
        logits, tgt = m(ids, attention_mask=mask), next_token_targets(ids, attention_mask=mask)
        rows = [logits[i, :len(d)] for i, d in enumerate(docs)]
        tgts = [tgt[i, :len(d)] for i, d in enumerate(docs)]
    elif mode in ("packed", "padded_storage"):
        if mode == "packed":
            ids, cu = as_packed(docs)
            pad = None
        else:
            ids, cu, pad = as_padded_storage(docs)
        logits = m(ids, cu, cu_seqlens_padded=pad)
        tgt = next_token_targets(ids, cu, cu_seqlens_padded=pad)
        starts = (pad if pad is not None else cu).tolist()
        rows = [logits[0, s:s + len(d)] for s, d in zip(starts, docs)]
        tgts = [tgt[0, s:s + len(d)] for s, d in zip(starts, docs)]
    else:  # one document at a time, [1, n] without cu_seqlens
        rows, tgts = [], []
        for d in docs:
            rows.append(m(d[None])[0])
            tgts.append(next_token_targets(d[None])[0])
    losses = [F.cross_entropy(r.float(), t, ignore_index=-100, reduction="sum") for r, t in zip(rows, tgts)]
    counts = [max(1, int((t != -100).sum())) for t in tgts]
    return rows, sum(losses), [l.detach() / c for l, c in zip(losses, counts)]


def run(m, docs, mode):
    m.zero_grad(set_to_none=True)
    rows, loss, doc_losses = per_token_logits(m, docs, mode)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in m.named_parameters()}
    return torch.cat([r.detach() for r in rows]), grads, doc_losses


MODES = ["padded", "packed", "padded_storage", "one_by_one"]


@pytest.fixture(scope="module")
def fp32_runs():
    m, docs = model(), documents()
    return {mode: run(m, docs, mode) for mode in MODES}


@pytest.mark.parametrize("mode", ["padded", "padded_storage", "one_by_one"])
def test_hybrid_lm_fp32_layouts_agree(fp32_runs, mode):
    ref_logits, ref_grads, _ = fp32_runs["packed"]
    logits, grads, _ = fp32_runs[mode]
    assert rel_err(logits, ref_logits) <= 1e-5
    for name, g in grads.items():
        assert rel_err(g, ref_grads[name]) <= 1e-5, name
        assert ref_grads[name].abs().sum() > 0, f"{name} got no gradient"


def test_hybrid_lm_per_document_loss_padded_equals_packed(fp32_runs):
    for a, b in zip(fp32_runs["padded"][2], fp32_runs["packed"][2]):
        assert abs(a.item() - b.item()) <= 1e-6 * max(1.0, abs(b.item()))


def test_hybrid_lm_bf16_layouts_within_budget():
    m, docs = model(torch.bfloat16), documents()
    ref_logits, ref_grads, _ = run(m, docs, "packed")
    for mode in ("padded", "padded_storage", "one_by_one"):
        logits, grads, _ = run(m, docs, mode)
        assert rel_err(logits, ref_logits) <= BUDGETS[torch.bfloat16]["o"], mode
        for name, g in grads.items():
            assert rel_err(g, ref_grads[name]) <= BUDGETS[torch.bfloat16]["grad"], (mode, name)


def test_left_padding_gives_the_same_logits():
    m, docs = model(), documents()
    ids, mask = as_padded(docs, left=True)
    with torch.no_grad():
        left = m(ids, attention_mask=mask)
        packed = m(*as_packed(docs))
    rows = torch.cat([left[i, -len(d):] for i, d in enumerate(docs)])
    assert rel_err(rows, packed[0]) <= 1e-6
    assert torch.equal(left[~mask], torch.zeros_like(left[~mask]))


def _grads(m):
    return [p.grad.clone() for p in m.parameters()]


@pytest.mark.parametrize("layout", ["padded", "padded_storage"])
def test_padding_contents_change_nothing(layout):
    m, docs = model(), documents()
    outs = []
    for fill in (7, 50):
        m.zero_grad(set_to_none=True)
        if layout == "padded":
            ids, mask = as_padded(docs)
            ids = torch.where(mask, ids, fill)
            logits = m(ids, attention_mask=mask)
            tgt = next_token_targets(ids, attention_mask=mask)
        else:
            ids, cu, pad = as_padded_storage(docs, fill=fill)
            logits = m(ids, cu, cu_seqlens_padded=pad)
            tgt = next_token_targets(ids, cu, cu_seqlens_padded=pad)
            mask = packing.padding_row_mask(cu, pad, total_rows=ids.shape[1])[None]
        F.cross_entropy(logits.flatten(0, 1), tgt.flatten(), reduction="sum").backward()
        outs.append((logits[mask], _grads(m)))
    assert torch.equal(outs[0][0], outs[1][0])
    assert all(torch.equal(a, b) for a, b in zip(outs[0][1], outs[1][1]))


def test_changing_one_document_changes_nothing_in_the_others():
    """Hidden states in, per-row outputs and input gradients of the other documents bit-identical."""
    m = model()
    cu, pad, rows = packing.cu_seqlens_from_lengths(LENS), None, sum(LENS)
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(1, rows, CFG.hidden_size, generator=gen)
    w = torch.randn(1, rows, CFG.hidden_size, generator=gen)
    other = torch.ones(rows, dtype=torch.bool)
    other[cu[1]:cu[2]] = False  # document 1 changes
    results = []
    for scale in (1.0, -3.0):
        x = torch.where(other[None, :, None], h, h * scale).requires_grad_()
        y = m.stack(x, cu, cu_seqlens_padded=pad)
        (y * w).sum().backward()
        results.append((y.detach()[0, other], x.grad[0, other]))
    assert not torch.equal(results[0][0], torch.zeros_like(results[0][0]))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])


# ---- the GDN block ----------------------------------------------------------------------------------
def gdn_block_ref(layer, x, cu, pad=None, conv0=None, rec0=None):
    """The GDN block one sequence at a time, written from the formulas (F.conv1d, the per-token
    recurrence, the gated RMSNorm formula) in `layer`'s dtype (float64 for the reference), differentiable
    in x and the parameters. Returns (y with zeros on padding rows, conv states, recurrent states)."""
    Hk, Hv, Dk, Dv, W = layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim, layer.conv_kernel
    qk, vd, C, dt = Hk * Dk, Hv * Dv, layer.conv_dim, x.dtype
    pieces, convs, recs, pos = [], [], [], 0
    starts = (pad if pad is not None else cu).tolist()
    for i, n in enumerate((cu[1:] - cu[:-1]).tolist()):
        s = starts[i]
        pieces.append(x.new_zeros(s - pos, x.shape[-1]))
        qkv, z, b, a = layer.in_proj(x[0, s:s + n]).split([C, vd, Hv, Hv], dim=-1)
        hist = x.new_zeros(C, W - 1) if conv0 is None else conv0[i].to(dt)
        full = torch.cat([hist, qkv.T], dim=1)
        convs.append(full[:, full.shape[1] - (W - 1):])
        if n == 0:  # a zero-length sequence passes its states through
            recs.append(x.new_zeros(Hv, Dk, Dv) if rec0 is None else rec0[i].to(dt))
            pos = s
            continue
        conv = F.silu(F.conv1d(full[None], layer.conv1d.weight, groups=C)[0].T)
        q, k, v = conv.split([qk, qk, vd], dim=-1)
        g = -layer.A_log.exp() * F.softplus(a + layer.dt_bias)
        o, st = naive_recurrent_gdr(q.view(1, n, Hk, Dk), k.view(1, n, Hk, Dk), v.view(1, n, Hv, Dv), g[None],
                                    b.sigmoid()[None], initial_state=None if rec0 is None else rec0[i:i + 1],
                                    use_qk_l2norm_in_kernel=True, compute_dtype=dt)
        recs.append(st[0])
        o = gated_rmsnorm_ref(o[0], z.view(n, Hv, Dv), layer.out_norm.weight, 1e-6)
        pieces.append(layer.out_proj(o.reshape(n, vd)))
        pos = s + n
    pieces.append(x.new_zeros(x.shape[1] - pos, x.shape[-1]))
    return torch.cat(pieces)[None], torch.stack(convs), torch.stack(recs)


def gdn_layer(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    layer = GatedDeltaNet(48, 2, 4, 32, 16, conv_kernel=4, dtype=dtype, A_init_range=A_RANGE)
    with torch.no_grad():
        layer.out_norm.weight.uniform_(0.5, 1.5)
    return layer


def test_gdn_parameter_names_and_shapes_follow_megatron():
    layer = GatedDeltaNet(48, 2, 4, 32, 16, conv_kernel=4)
    shapes = {n: tuple(p.shape) for n, p in layer.named_parameters()}
    assert shapes == {"in_proj.weight": (2 * 64 + 2 * 64 + 2 * 4, 48), "conv1d.weight": (2 * 64 + 64, 1, 4),
                      "A_log": (4,), "dt_bias": (4,), "out_norm.weight": (16,), "out_proj.weight": (48, 64)}
    assert torch.equal(layer.dt_bias, torch.ones(4))
    assert ((layer.A_log.exp() >= 1) & (layer.A_log.exp() <= 16)).all()


@pytest.mark.parametrize("padded_storage", [False, True], ids=["packed", "cu_seqlens_padded"])
def test_gdn_block_matches_float64_reference_with_states(padded_storage):
    layer = gdn_layer()
    lens, N = [5, 0, 70, 1], 4
    cu = packing.cu_seqlens_from_lengths(lens)
    pad = packing.cu_seqlens_from_lengths([n + g for n, g in zip(lens, [2, 1, 0, 3])]) if padded_storage else None
    rows = int((pad if pad is not None else cu)[-1]) + 4
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, rows, 48, generator=gen).requires_grad_()
    conv0 = torch.randn(N, layer.conv_dim, 3, generator=gen)
    rec0 = 0.1 * torch.randn(N, 4, 32, 16, generator=gen)
    y, st = layer(x, cu, cu_seqlens_padded=pad, initial_state=GDNState(conv0, rec0), output_final_state=True)
    ref_layer = copy.deepcopy(layer).double()
    xd = x.detach().double().requires_grad_()
    yr, conv_r, rec_r = gdn_block_ref(ref_layer, xd, cu, pad, conv0, rec0)
    assert rel_err(y, yr) <= 1e-5
    assert rel_err(st.conv, conv_r) <= 1e-6 and rel_err(st.recurrent, rec_r) <= 1e-5
    real = packing.padding_row_mask(cu, pad, total_rows=rows)
    assert torch.equal(y[0, ~real], torch.zeros_like(y[0, ~real]))
    dy = torch.randn(y.shape, generator=gen)
    got = torch.autograd.grad(y, [x] + list(layer.parameters()), dy)
    ref = torch.autograd.grad(yr, [xd] + list(ref_layer.parameters()), dy.double())
    for (name, _), gg, rr in zip([("x", x)] + list(layer.named_parameters()), got, ref):
        assert rel_err(gg, rr) <= 1e-5, name
    assert torch.equal(got[0][0, ~real], torch.zeros_like(got[0][0, ~real]))


def test_gdn_chunked_prefill_continues_from_states():
    """Running a sequence in two pieces, passing the final states on, equals running it whole."""
    layer = gdn_layer()
    x = torch.randn(1, 90, 48, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        whole = layer(x)
        a, st = layer(x[:, :37], output_final_state=True)
        b = layer(x[:, 37:], initial_state=st)
    assert rel_err(torch.cat([a, b], dim=1), whole) <= 1e-5


def test_gdn_padded_batch_with_mask_equals_packed():
    layer, docs = gdn_layer(), [torch.randn(n, 48) for n in (9, 30, 2)]
    L = 33
    x = torch.zeros(3, L, 48)
    mask = torch.zeros(3, L, dtype=torch.bool)
    for i, d in enumerate(docs):
        x[i, :len(d)], mask[i, :len(d)] = d, True
    with torch.no_grad():
        padded = layer(x, attention_mask=mask)
        packed = layer(torch.cat(docs)[None], packing.cu_seqlens_from_lengths([9, 30, 2]))
    assert rel_err(padded[mask], packed[0]) <= 1e-6
    assert torch.equal(padded[~mask], torch.zeros_like(padded[~mask]))


def test_gdn_packed_forward_and_backward_make_no_host_sync():
    layer = gdn_layer()
    cu = torch.tensor([0, 5, 40, 41], dtype=torch.int32)
    pad = torch.tensor([0, 8, 48, 52], dtype=torch.int32)
    x = torch.randn(1, 56, 48, requires_grad=True)
    with no_host_sync():
        y, st = layer(x, cu, cu_seqlens_padded=pad, output_final_state=True)
        (y.square().sum() + st.recurrent.sum()).backward()
    assert x.grad is not None


def test_gdn_block_under_torch_compile_fullgraph():
    layer = gdn_layer()
    cu = torch.tensor([0, 5, 40, 41], dtype=torch.int32)
    x = torch.randn(1, 44, 48, requires_grad=True)

    def f(x, cu):
        return layer(x, cu).square().sum()

    eager = torch.autograd.grad(f(x, cu), [x] + list(layer.parameters()))
    torch._dynamo.reset()
    comp = torch.compile(f, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(comp(x, cu), [x] + list(layer.parameters()))
    for a, b in zip(eager, got):
        assert rel_err(b, a) <= 1e-6
    assert torch._dynamo.explain(f)(x, cu).graph_break_count == 0


def test_hf_qwen3_next_weights_map_one_to_one():
    """in_proj_qkvz / in_proj_ba grouped per k-head regroup into the flat q|k|v|z|b|a rows."""
    Hk, Hv, Dk, Dv, hidden = 2, 4, 3, 5, 7
    G = Hv // Hk
    q, k = torch.randn(Hk, Dk, hidden), torch.randn(Hk, Dk, hidden)
    v, z = torch.randn(Hv, Dv, hidden), torch.randn(Hv, Dv, hidden)
    b, a = torch.randn(Hv, hidden), torch.randn(Hv, hidden)
    qkvz = torch.cat([q, k, v.view(Hk, G * Dv, hidden), z.view(Hk, G * Dv, hidden)], dim=1).reshape(-1, hidden)
    ba = torch.cat([b.view(Hk, G, hidden), a.view(Hk, G, hidden)], dim=1).reshape(-1, hidden)
    sd = {"in_proj_qkvz.weight": qkvz, "in_proj_ba.weight": ba, "norm.weight": torch.randn(Dv),
          "conv1d.weight": torch.randn(2 * Hk * Dk + Hv * Dv, 1, 4), "A_log": torch.randn(Hv),
          "dt_bias": torch.randn(Hv), "out_proj.weight": torch.randn(hidden, Hv * Dv)}
    out = hf_qwen3_next_gdn_state_dict(sd, Hk, Hv, Dk, Dv)
    flat = [t.reshape(-1, hidden) for t in (q, k, v, z, b, a)]
    assert torch.equal(out["in_proj.weight"], torch.cat(flat))
    assert out["out_norm.weight"] is sd["norm.weight"]
    qwen35 = {f"in_proj_{n}.weight": t for n, t in
              (("qkv", torch.cat(flat[:3])), ("z", flat[3]), ("b", flat[4]), ("a", flat[5]))}
    qwen35.update({n: t for n, t in sd.items() if not n.startswith("in_proj")})
    assert torch.equal(hf_qwen3_next_gdn_state_dict(qwen35, Hk, Hv, Dk, Dv)["in_proj.weight"], out["in_proj.weight"])
    layer = GatedDeltaNet(hidden, Hk, Hv, Dk, Dv)
    layer.load_hf_state_dict(sd)
    assert torch.equal(layer.in_proj.weight, out["in_proj.weight"])


def test_gdn_matches_hf_qwen3_next_after_loading_its_weights(monkeypatch):
    M = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    from transformers import Qwen3NextConfig
    for name in ("torch_chunk_gated_delta_rule", "causal_conv1d_fn"):  # HF's plain torch paths, not FLA
        fn = getattr(M, name)
        monkeypatch.setattr(M, name, getattr(fn, "__wrapped__", fn))
    cfg = Qwen3NextConfig(hidden_size=48, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                          linear_value_head_dim=8, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
                          num_hidden_layers=1, layer_types=["linear_attention"])
    torch.manual_seed(0)
    hf = M.Qwen3NextGatedDeltaNet(cfg, layer_idx=0)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
        hf.A_log.uniform_(-2, 0)
    ours = GatedDeltaNet(48, 2, 4, 16, 8, layer_norm_eps=1e-6)
    ours.load_hf_state_dict(hf.state_dict())
    x = torch.randn(1, 20, 48)
    with torch.no_grad():
        assert rel_err(ours(x), hf(x)) <= 1e-5


# ---- attention --------------------------------------------------------------------------------------
def test_attention_backend_is_visible_and_positions_restart():
    torch.manual_seed(0)
    attn = GatedAttention(32, 4, 2, 16, partial_rotary_factor=0.25)
    assert attn.backend == "sdpa"       # parameters on CPU: the per-segment SDPA, on any machine
    if torch.cuda.is_available():
        from gdn_packed.layers.attention import _flash_attn_varlen, _torch_varlen
        on_gpu = GatedAttention(32, 4, 2, 16, partial_rotary_factor=0.25, device="cuda")
        expected = ("flash_attn" if _flash_attn_varlen() is not None else
                    "torch_varlen" if _torch_varlen() is not None else "sdpa")
        assert on_gpu.backend == expected
    docs = [torch.randn(n, 32) for n in (6, 11)]
    with torch.no_grad():
        packed = attn(torch.cat(docs)[None], packing.cu_seqlens_from_lengths([6, 11]))
        alone = torch.cat([attn(d[None])[0] for d in docs])
    assert rel_err(packed[0], alone) <= 1e-6
    with pytest.raises(ValueError, match="needs CUDA"):
        GatedAttention(32, 4, 2, 16, backend="flash_attn").backend


@pytest.mark.parametrize("cu, match", [([0, 10, 5, 30], "non-decreasing"), ([0, 10, 40], "exceeds total_rows"),
                                       ([3, 10, 30], r"cu_seqlens\[0\] must be 0")],
                         ids=["decreasing", "past-T", "first-not-0"])
def test_bad_offsets_are_named_errors_in_every_layer(cu, match):
    """A bad layout on CPU is a ValueError naming cu_seqlens at every packed entry point, as in the ops;
    the attention layer and a stack without GDN layers (whose ops would catch it) included."""
    torch.manual_seed(0)
    bad = torch.tensor(cu, dtype=torch.int32)
    x, ids = torch.randn(1, 30, 32), torch.randint(0, CFG.vocab_size, (1, 30))
    attn, lm = GatedAttention(32, 2, 1, 16), HybridLM(HybridConfig(**{**CFG.__dict__, "pattern": "AA"}))
    calls = [lambda: attn(x, bad), lambda: attn.forward_packed(x, bad), lambda: lm(ids, bad),
             lambda: lm.stack.forward_packed(lm.embed(ids), bad), lambda: next_token_targets(ids, bad),
             lambda: attn(x, torch.tensor([0, 30], dtype=torch.int32), cu_seqlens_padded=bad)]
    for i, call in enumerate(calls):
        with pytest.raises(ValueError, match=match if i < 5 else "cu_seqlens_padded|cu_seqlens"):
            call()
    with pytest.raises(ValueError, match=r"attention_mask must be a 2-D padding mask \[B, L\] = \[2, 8\]"):
        attn(torch.randn(2, 8, 32), attention_mask=torch.ones(2, 1, 8, 8, dtype=torch.bool))


def test_attention_matches_a_dense_reference():
    """One sequence: softmax(q k^T / sqrt(D) + causal) v with q/k RMSNorm and rotary on 1/4 of the dims."""
    torch.manual_seed(0)
    attn = GatedAttention(32, 4, 2, 16, partial_rotary_factor=0.25).double()
    x = torch.randn(1, 9, 32, dtype=torch.float64)
    P = dict(attn.named_parameters())
    qg = (x @ P["q_proj.weight"].T).view(9, 4, 32)
    q, gate = qg[..., :16], qg[..., 16:]
    k = (x @ P["k_proj.weight"].T).view(9, 2, 16).repeat_interleave(2, dim=1)
    v = (x @ P["v_proj.weight"].T).view(9, 2, 16).repeat_interleave(2, dim=1)
    rms = lambda t: t * torch.rsqrt(t.square().mean(-1, keepdim=True) + 1e-6)  # noqa: E731
    q, k = rms(q), rms(k)
    ang = torch.arange(9, dtype=torch.float64)[:, None] / 10000 ** (torch.arange(0, 4, 2, dtype=torch.float64) / 4)
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]

    def rot(t):
        a, b, rest = t[..., :2], t[..., 2:4], t[..., 4:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin, rest], dim=-1)

    q, k = rot(q), rot(k)
    s = torch.einsum("ihd,jhd->hij", q, k) / 4 + torch.full((9, 9), float("-inf"), dtype=torch.float64).triu(1)
    o = torch.einsum("hij,jhd->ihd", s.softmax(-1), v) * gate.sigmoid()
    ref = o.reshape(9, 64) @ P["o_proj.weight"].T
    assert rel_err(attn(x)[0], ref) <= 1e-6  # the rotary tables are float32 by design


# ---- the example -------------------------------------------------------------------------------------
def test_example_trains_two_steps():
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "train_hybrid_packed.py"), "--steps", "2",
                          "--tokens", "128"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "step 2" in out.stdout


def test_mixers_share_one_contract():
    """HybridBlock calls mixer.mix on either kind: [1, R, hidden] -> [1, R, hidden]; GatedDeltaNet's
    forward_packed keeps its (y, GDNState or None) return, y the same as mix."""
    torch.manual_seed(0)
    cu, pad, rows = layout([5, 0, 9], gaps=[2, 1, 0], tail=3)
    x = torch.randn(1, rows, 32)
    gdn, attn = GatedDeltaNet(32, 2, 4, 8, 8), GatedAttention(32, 4, 2, 16)
    with torch.no_grad():
        for m in (gdn, attn):
            assert m.mix(x, cu, pad).shape == x.shape
        y, state = gdn.forward_packed(x, cu, pad, None, True)
        assert torch.equal(y, gdn.mix(x, cu, pad)) and state.recurrent.shape[0] == 3
        assert gdn.forward_packed(x, cu, pad)[1] is None
