"""gdn_packed.integrations.transformers (issue 27) on tiny random Qwen3-Next / Qwen3.5 / Qwen3.5-MoE
models (and the Qwen3.5 VL model's text stack), fp32 on CPU unless an id says bf16.

The reference is always transformers' own pure-PyTorch path (the fixture `hf_torch_path` puts its
torch functions back under the hub-kernel wrappers, which may pick fla-core), run on each document
alone or on a padded batch. Errors are gdn_packed.testing.rel_err (RMS of the difference over RMS of
the reference). Packed forwards pass use_cache=False, as training does: transformers' attention layers
find packed position_ids only without a cache (and without a 2-D mask); the GDN layers need neither.
"""
import copy
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5", reason="transformers >= 5 (the `hf` extra) "
                                   "is not installed")

from gdn_packed.integrations import transformers as hfi  # noqa: E402
from gdn_packed.ops._common import backend_usable, triton_usable  # noqa: E402
from gdn_packed.testing import budgets, rel_err  # noqa: E402
from gdn_packed.torch_ref.naive import naive_recurrent_gdr  # noqa: E402
from transformers import DataCollatorWithFlattening  # noqa: E402
from transformers.models.qwen3_5 import (Qwen3_5Config, Qwen3_5ForCausalLM,  # noqa: E402
                                         Qwen3_5ForConditionalGeneration, Qwen3_5TextConfig)
from transformers.models.qwen3_5 import modeling_qwen3_5  # noqa: E402
from transformers.models.qwen3_5_moe import (Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig,  # noqa: E402
                                             modeling_qwen3_5_moe)
from transformers.models.qwen3_next import Qwen3NextConfig, Qwen3NextForCausalLM, modeling_qwen3_next  # noqa: E402

FP32 = 1e-5                      # logits of a packed row against each document alone (issue 27)
FP32_GRAD = 1e-4                 # every parameter's loss gradient, relative
DOCS = (7, 70, 20, 33)           # one document over the chunk size (64)
HYBRID = ["linear_attention", "full_attention", "linear_attention"]
LINEAR = ["linear_attention", "linear_attention"]
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)
MODELS = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5_vl")
KERNEL_FUNCTIONS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                    "causal_conv1d_update", "causal_conv1d_forward")


def tiny(name, layer_types=HYBRID, seed=0):
    """A tiny random model of `name` (hidden 32, GVA 2 -> 4 heads, K 16, V 8, conv width 4), fp32, eval."""
    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=len(layer_types), num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                  layer_types=list(layer_types), use_cache=False, pad_token_id=0)
    torch.manual_seed(seed)
    if name == "qwen3_next":
        model = Qwen3NextForCausalLM(Qwen3NextConfig(intermediate_size=32, **MOE, **common))
    elif name == "qwen3_5":
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(intermediate_size=32, **common))
    elif name == "qwen3_5_moe":
        model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**MOE, **common))
    else:
        vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32, patch_size=2,
                      temporal_patch_size=1, spatial_merge_size=1)
        model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=dict(intermediate_size=32, **common),
                                                              vision_config=vision))
    with torch.no_grad():                   # livelier than the default init: errors that matter show
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def _plain(fn):
    """transformers' own torch function under its hub-kernel wrapper (a module whose forward closes
    over the function that may dispatch to fla-core, whose __wrapped__ is the torch function)."""
    for cell in getattr(getattr(type(fn), "forward", None), "__closure__", None) or ():
        inner = cell.cell_contents
        if inspect.isfunction(inner):
            return getattr(inner, "__wrapped__", inner)
    return getattr(fn, "__wrapped__", fn)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: one intra-op thread (several only spin on a shared 2-core machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def hf_torch_path(monkeypatch):
    """transformers' reference path is its pure-PyTorch one, whatever is installed (fla-core is)."""
    for module in (modeling_qwen3_next, modeling_qwen3_5, modeling_qwen3_5_moe):
        for name in KERNEL_FUNCTIONS:
            fn = _plain(getattr(module, name))
            assert fn.__module__ == module.__name__ and inspect.isfunction(fn), (module.__name__, name)
            monkeypatch.setattr(module, name, fn)


def packed_row(lengths, seed=1):
    """ids [1, T], position_ids restarting per document, the documents' (start, length)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 64, (1, sum(lengths)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    starts = torch.tensor((0,) + lengths).cumsum(0)[:-1].tolist()
    return ids, pos, list(zip(starts, lengths))


def doc_loss(logits, ids):
    """Summed next-token cross entropy within one document."""
    return torch.nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:], reduction="sum")


def grads(model):
    return {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}


def alone(model, ids, docs):
    """Each document run alone: logits per document, loss gradients."""
    model.zero_grad()
    logits = []
    for s, n in docs:
        out = model(ids[:, s:s + n]).logits
        doc_loss(out, ids[:, s:s + n]).backward()
        logits.append(out.detach())
    return logits, grads(model)


def naive_chunk(query, key, value, g, beta, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=False, **_):
    """transformers' chunked-op call answered by the float64 per-token recurrence (gdn_packed.testing's
    reference), the oracle of the gradients."""
    o, state = naive_recurrent_gdr(query, key, value, g, beta, initial_state=initial_state,
                                   use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    return o.to(query.dtype), (state if output_final_state else None)


def float64_gradients(name, layer_types, ids, docs):
    """The loss gradients of the documents alone through transformers' model in float64 with its
    chunked op replaced by the float64 recurrence. transformers' own fp32 path is no oracle here: its
    chunked backward loses up to 4e-3 (relative) of the A_log / dt_bias gradients of strongly decaying
    heads (exp of the in-chunk cumulative decay underflows), where gdn_packed stays within 4e-6."""
    model = tiny(name, layer_types).double()
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")          # the grouped-mm experts have no float64
    with pytest.MonkeyPatch.context() as mp:
        for module in (modeling_qwen3_next, modeling_qwen3_5, modeling_qwen3_5_moe):
            mp.setattr(module, "torch_chunk_gated_delta_rule", naive_chunk)
        return alone(model, ids, docs)[1]


def packed(model, ids, docs, **sources):
    model.zero_grad()
    out = model(ids, **sources).logits
    sum(doc_loss(out[:, s:s + n], ids[:, s:s + n]) for s, n in docs).backward()
    return [out[:, s:s + n].detach() for s, n in docs], grads(model)


# ---- a packed row keeps its documents apart -----------------------------------------------------------
SOURCES = [(m, "position_ids") for m in MODELS] + [(m, s) for m in ("qwen3_next", "qwen3_5", "qwen3_5_moe")
                                                  for s in ("cu_seq_lens_q", "seq_idx")]


@pytest.mark.parametrize("name, source", SOURCES, ids=[f"{m}-{s}" for m, s in SOURCES])
def test_packed_row_equals_each_document_alone(name, source):
    """Logits of every document within 1e-5 of transformers' own fp32 path on the documents alone, and
    the loss gradient of every parameter within 1e-4 of the float64 gradients of the documents alone. position_ids on the hybrid stack (the attention layers read them too);
    cu_seq_lens_q and seq_idx alone on a linear-attention-only stack (CPU attention reads neither), with
    the model's own non-restarting position ids, so the boundaries come from that source only."""
    layer_types = HYBRID if source == "position_ids" else LINEAR
    model = tiny(name, layer_types)
    ids, pos, docs = packed_row(DOCS)
    with torch.no_grad():
        ref_logits = [model(ids[:, s:s + n]).logits for s, n in docs]
    ref_grads = float64_gradients(name, layer_types, ids, docs)
    sources = {"position_ids": dict(position_ids=pos),
               "cu_seq_lens_q": dict(cu_seq_lens_q=torch.tensor([0] + [s + n for s, n in docs], dtype=torch.int32),
                                     max_length_q=max(DOCS)),
               "seq_idx": dict(seq_idx=torch.repeat_interleave(torch.arange(len(DOCS)), torch.tensor(DOCS))[None])}
    with hfi.patch(model):
        logits, got = packed(model, ids, docs, **sources[source])
    errs = [rel_err(x, r) for x, r in zip(logits, ref_logits)]
    assert max(errs) <= FP32, errs
    bad = {n: rel_err(got[n], ref_grads[n]) for n in ref_grads if rel_err(got[n], ref_grads[n]) > FP32_GRAD}
    assert not bad, bad


@pytest.mark.parametrize("name", MODELS[:3])
def test_transformers_alone_mixes_documents_and_remove_restores_it(name):
    """The failure this integration exists for, measured: transformers' own path on the packed row
    (position_ids) is far from the documents alone; patched it is not; removed, the same leak comes
    back bit for bit (the original forwards are in place)."""
    model = tiny(name)
    ids, pos, docs = packed_row(DOCS)
    with torch.no_grad():
        ref = [model(ids[:, s:s + n]).logits for s, n in docs]
        before = model(ids, position_ids=pos).logits
        with hfi.patch(model):
            during = model(ids, position_ids=pos).logits
        after = model(ids, position_ids=pos).logits
    leak = max(rel_err(before[:, s:s + n], r) for (s, n), r in zip(docs[1:], ref[1:]))
    assert leak > 1e-2, leak
    assert max(rel_err(during[:, s:s + n], r) for (s, n), r in zip(docs, ref)) <= FP32
    assert torch.equal(after, before)


# ---- padded batches and generation ---------------------------------------------------------------------
def padded_batch(lengths, side, seed=2):
    g = torch.Generator().manual_seed(seed)
    L = max(lengths)
    ids, mask = torch.zeros(len(lengths), L, dtype=torch.long), torch.zeros(len(lengths), L, dtype=torch.long)
    for b, n in enumerate(lengths):
        cols = slice(L - n, L) if side == "left" else slice(0, n)
        ids[b, cols], mask[b, cols] = torch.randint(1, 64, (n,), generator=g), 1
    return ids, mask


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("name", MODELS[:3])
def test_padded_batch_equals_transformers(name, side):
    """attention_mask [B, L]: the layers run on the real tokens only (packed); logits at real tokens
    within 1e-5 of transformers' own padded forward (whose GDN layers zero the padding and run over it)."""
    model = tiny(name)
    ids, mask = padded_batch((9, 70, 33), side)
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits
        with hfi.patch(model):
            got = model(ids, attention_mask=mask).logits
    real = mask.bool()
    assert rel_err(got[real], ref[real]) <= FP32


@pytest.mark.parametrize("name", MODELS[:3])
def test_generation_equals_transformers(name):
    """Greedy generation from a left-padded batch through transformers' cache (prefill: chunked op,
    conv and recurrent states written; decode: recurrent op from them): the same tokens, and the logits
    of every step within 1e-5."""
    model = tiny(name)
    model.generation_config.pad_token_id = 0
    ids, mask = padded_batch((5, 12, 3), "left")
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, use_cache=True, output_logits=True,
              return_dict_in_generate=True)
    with torch.no_grad():
        ref = model.generate(ids, **kw)
        with hfi.patch(model):
            got = model.generate(ids, **kw)
    assert torch.equal(got.sequences, ref.sequences)
    assert max(rel_err(x, r) for x, r in zip(got.logits, ref.logits)) <= FP32


def test_generation_from_packed_rows_is_refused():
    """With a cache every row is one sequence: a forward with use_cache on a packed row works (training
    with the default use_cache=True), but continuing from that cache is refused, and so is a packed
    continuation; a cache recording past states for rollback is not supported."""
    model = tiny("qwen3_5")
    ids, pos, docs = packed_row((5, 9))
    with torch.no_grad(), hfi.patch(model):
        cache = model(ids, position_ids=pos, use_cache=True).cache
        with pytest.raises(ValueError, match="filled from packed rows"):
            model(ids[:, :1], position_ids=torch.tensor([[9]]), cache=cache, use_cache=True)
        cache = model(ids[:, :5], use_cache=True).cache
        with pytest.raises(ValueError, match="several documents"):
            model(ids[:, 5:], position_ids=pos[:, 5:] + torch.tensor([[5, 0, 0, 0, 0, 0, 0, 0, 0]]),
                  cache=cache, use_cache=True)
        cache = model(ids[:, :5], use_cache=True).cache
        for layer in cache.layers:
            if hasattr(layer, "activate_past_recording"):
                layer.activate_past_recording()
        with pytest.raises(NotImplementedError, match="rollback"):
            model(ids[:, 5:6], cache=cache, use_cache=True)


# ---- precision and training -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", MODELS[:3])
def test_bf16_packed_row_runs_within_twice_transformers_error(name):
    """bf16 weights: the packed row runs forward and backward, and its logits' error against the fp32
    documents alone is at most twice that of transformers' own bf16 path on each document alone."""
    model = tiny(name)
    ids, pos, docs = packed_row(DOCS)
    with torch.no_grad():
        ref = [model(ids[:, s:s + n]).logits for s, n in docs]
    model.to(torch.bfloat16)
    with torch.no_grad():
        hf = [model(ids[:, s:s + n]).logits for s, n in docs]
    with hfi.patch(model):
        logits, got = packed(model, ids, docs, position_ids=pos)
    err_hf = max(rel_err(x, r) for x, r in zip(hf, ref))
    err = max(rel_err(x, r) for x, r in zip(logits, ref))
    assert err <= 2 * err_hf, (err, err_hf)
    assert all(torch.isfinite(g).all() for g in got.values())


def test_training_loop_packed_equals_unpacked():
    """20 AdamW steps of Qwen3.5: batches flattened by DataCollatorWithFlattening (patched) against the
    same documents as right-padded batches through transformers' own path: the loss of every step within
    1e-4."""
    base = tiny("qwen3_5")
    flat_model, pad_model = copy.deepcopy(base), base
    hfi.apply(flat_model)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (flat_model, pad_model)]
    collate = DataCollatorWithFlattening()
    g = torch.Generator().manual_seed(3)
    diffs = []
    for step in range(20):
        lengths = torch.randint(4, 48, (3,), generator=g).tolist()
        docs = [torch.randint(1, 64, (n,), generator=g) for n in lengths]
        flat = collate([{"input_ids": d.tolist()} for d in docs])
        L = max(lengths)
        ids = torch.zeros(len(docs), L, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, d in enumerate(docs):
            ids[b, :len(d)], mask[b, :len(d)] = d, 1
        labels = ids.masked_fill(mask == 0, -100)
        losses = []
        for model, opt, batch in ((flat_model, opts[0], flat),
                                  (pad_model, opts[1], dict(input_ids=ids, attention_mask=mask, labels=labels))):
            model.train()
            loss = model(**batch).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        diffs.append(abs(losses[0] - losses[1]))
    assert max(diffs) <= 1e-4, diffs


# ---- where boundaries come from, and what is refused ------------------------------------------------------
def _plan(B, L, **sources):
    p = hfi.document_boundaries(B, L, torch.device("cpu"), **sources)
    return p.cu_seqlens.tolist(), None if p.index is None else p.index.tolist(), p.doc_rows.tolist()


def test_boundary_rules():
    """Each source's rule on small cases (expected offsets written out)."""
    pos = torch.tensor([[0, 1, 2, 0, 1, 5, 6, 7]])          # a jump (1 -> 5) starts a document too
    assert _plan(1, 8, position_ids=pos) == ([0, 3, 5, 8], None, [0, 0, 0])
    seq = torch.tensor([[0, 0, 1, 1, 1, 3]])
    assert _plan(1, 6, seq_idx=seq, position_ids=torch.arange(6)[None])[0] == [0, 2, 5, 6]   # seq_idx first
    assert _plan(2, 3) == ([0, 3, 6], None, [0, 1])                                         # rows
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    gen_pos = torch.tensor([[1, 1, 0, 1, 2], [0, 1, 2, 3, 4]])      # generate()'s left-padded positions
    assert _plan(2, 5, attention_mask=mask, position_ids=gen_pos) == ([0, 3, 8], [2, 3, 4, 5, 6, 7, 8, 9], [0, 1])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    p = hfi.document_boundaries(2, 4, torch.device("cpu"), attention_mask=mask,
                                position_ids=torch.tensor([[0, 1, 2, 0], [0, 1, 0, 1]]), with_packed=True)
    assert (p.cu_seqlens.tolist(), p.doc_rows.tolist(), p.packed) == ([0, 3, 5, 7], [0, 1, 1], True)
    assert p.last_doc_per_row().tolist() == [0, 2]
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    assert _plan(2, 4, cu_seq_lens_q=cu, position_ids=pos) == ([0, 3, 7], None, [0, 0])    # cu_seq_lens_q first
    with pytest.raises(ValueError, match="non-decreasing"):
        _plan(1, 8, cu_seq_lens_q=torch.tensor([0, 5, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="both given"):
        _plan(2, 4, cu_seq_lens_q=cu, attention_mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match="2-D padding mask"):
        _plan(1, 4, attention_mask=torch.ones(1, 1, 4, 4))
    with pytest.raises(ValueError, match="position_ids must be an integer tensor"):
        _plan(2, 4, position_ids=torch.zeros(3, 4, dtype=torch.long))


def test_packed_rows_without_a_boundary_source_are_refused():
    """Signs of packing that carry no boundaries the GDN layers can use raise instead of mixing: flash
    keywords without cu_seq_lens_q, and a 4-D mask at the model unless the position ids restart."""
    model = tiny("qwen3_5")
    ids, pos, docs = packed_row((5, 9))
    T = ids.shape[1]
    block = torch.zeros(1, 1, T, T, dtype=torch.bool)
    for s, n in docs:
        block[..., s:s + n, s:s + n] = torch.ones(n, n, dtype=torch.bool).tril()
    with torch.no_grad(), hfi.patch(model):
        with pytest.raises(ValueError, match="came without cu_seq_lens_q"):
            model(ids, cu_seq_lens_k=torch.tensor([0, 5, 14], dtype=torch.int32), max_length_k=9)
        with pytest.raises(ValueError, match="4-D attention_mask"):
            model(ids, attention_mask=block)
        with pytest.raises(ValueError, match=r"cu_seq_lens_q must be non-decreasing"):
            model(ids, cu_seq_lens_q=torch.tensor([0, 9, 5, T], dtype=torch.int32), max_length_q=9)
        with pytest.raises(ValueError, match="cu_seq_lens_q is on the meta device"):
            model(ids, cu_seq_lens_q=torch.tensor([0, 5, T], dtype=torch.int32, device="meta"), max_length_q=9)
        got = model(ids, attention_mask=block, position_ids=pos).logits
        ref = model(ids, position_ids=pos).logits
    assert rel_err(got, ref) <= FP32


def test_apply_is_idempotent_and_remove_restores_every_layer():
    model = tiny("qwen3_next")
    layers = [m for m in model.modules() if type(m).__name__ == "Qwen3NextGatedDeltaNet"]
    hooked = [m for m in model.modules() if m._forward_pre_hooks]
    p = hfi.apply(model)
    assert hfi.apply(model) is p and len(p.layers) == len(layers) == 2
    assert all("forward" in layer.__dict__ for layer in layers)
    with pytest.raises(ValueError, match="already patched"):
        hfi.apply(model, backend="torch")
    with hfi.patch(model):                 # patched before the block: stays patched after it
        pass
    assert hfi.apply(model) is p
    p.remove()
    p.remove()
    assert not any("forward" in layer.__dict__ or hfi.LAYER in layer.__dict__ for layer in layers)
    assert [m for m in model.modules() if m._forward_pre_hooks] == hooked
    with hfi.patch(model, backend="torch") as same:
        assert same is model and all("forward" in layer.__dict__ for layer in layers)
    assert not any("forward" in layer.__dict__ for layer in layers) and hfi.PATCH not in model.__dict__
    with pytest.raises(ValueError, match="no Qwen3-Next"):
        hfi.apply(torch.nn.Linear(2, 2))


def test_gradient_checkpointing_gives_the_same_gradients_and_one_plan_serves_every_layer(monkeypatch):
    """The decoder-layer hook runs outside transformers' checkpoint, so the recompute in backward gets
    the position ids as well: the same gradients. The documents are derived once per forward (and
    reused by every layer and by the recompute), not once per layer."""
    model = tiny("qwen3_next")
    ids, pos, docs = packed_row(DOCS)
    calls = []
    derive = hfi.document_boundaries
    monkeypatch.setattr(hfi, "document_boundaries", lambda *a, **k: calls.append(1) or derive(*a, **k))
    with hfi.patch(model):
        _, plain = packed(model, ids, docs, position_ids=pos)
        assert len(calls) == 1
        model.gradient_checkpointing_enable()
        model.train()
        _, recomputed = packed(model, ids, docs, position_ids=pos.clone())
    assert len(calls) == 2
    assert max(rel_err(recomputed[n], plain[n]) for n in plain) <= 1e-6


def test_a_layer_hooked_by_accelerate_keeps_its_hook():
    """accelerate's add_hook_to_module moves a module's forward to `_old_forward` behind a wrapper:
    apply() replaces `_old_forward` (the wrapper still runs), remove() puts it back."""
    model = tiny("qwen3_5")
    layer = model.model.layers[0].linear_attn
    original, calls = layer.forward, []

    def wrapper(*args, **kwargs):
        calls.append(1)
        return layer._old_forward(*args, **kwargs)

    layer._hf_hook, layer._old_forward, layer.forward = object(), original, wrapper
    ids, pos, docs = packed_row((5, 9))
    with torch.no_grad():
        ref = [model(ids[:, s:s + n]).logits for s, n in docs]
        with hfi.patch(model):
            assert layer.forward is wrapper and layer._old_forward.__func__ is not original.__func__
            got = model(ids, position_ids=pos).logits
    assert calls and layer.forward is wrapper and layer._old_forward is original
    assert max(rel_err(got[:, s:s + n], r) for (s, n), r in zip(docs, ref)) <= FP32


def test_gpu_backends_keep_documents_apart_and_generate_the_same_tokens():
    """The ops' GPU paths through the integration: backend="auto" on CUDA tensors (triton chunked op and
    norm, cuda conv and recurrent op when gdn_packed._C is built), backend="triton" on CPU tensors under
    the Triton interpreter. A packed row within the device's fp32 budget of the documents alone, and
    greedy generation from a left-padded batch with transformers' tokens."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backend = "auto" if device.type == "cuda" else "triton"
    if not backend_usable("triton", device):
        pytest.skip(f"the triton backend cannot run on {device} here: {triton_usable(device)}")
    model = tiny("qwen3_5").to(device)
    model.generation_config.pad_token_id = 0
    ids, pos, docs = (t.to(device) if torch.is_tensor(t) else t for t in packed_row(DOCS))
    prompts, mask = (t.to(device) for t in padded_batch((5, 9), "left"))
    kw = dict(attention_mask=mask, max_new_tokens=3, do_sample=False, use_cache=True)
    with torch.no_grad():
        ref = [model(ids[:, s:s + n]).logits for s, n in docs]
        ref_tokens = model.generate(prompts, **kw)
        with hfi.patch(model, backend=backend):
            got = model(ids, position_ids=pos).logits
            tokens = model.generate(prompts, **kw)
    budget = budgets(torch.float32, device)["o"]
    assert max(rel_err(got[:, s:s + n], r) for (s, n), r in zip(docs, ref)) <= budget
    assert torch.equal(tokens, ref_tokens)


def test_our_ops_swapped_into_transformers_by_import():
    """The FLA-compatible signature: transformers' layer calls our chunked and recurrent ops as it calls
    FLA's (keywords use_cache, cu_seqlens=None, ...) and gets its own torch path's result (one sequence
    per row, where its own conv does not leak)."""
    import gdn_packed
    model = tiny("qwen3_5")
    ids, mask = padded_batch((12, 12), "right")
    with torch.no_grad():
        ref = model(ids, use_cache=True).logits
        mp = pytest.MonkeyPatch()
        mp.setattr(modeling_qwen3_5, "torch_chunk_gated_delta_rule", gdn_packed.chunk_gated_delta_rule)
        mp.setattr(modeling_qwen3_5, "torch_recurrent_gated_delta_rule", gdn_packed.fused_recurrent_gated_delta_rule)
        try:
            got = model(ids, use_cache=True).logits
        finally:
            mp.undo()
    assert rel_err(got, ref) <= FP32
